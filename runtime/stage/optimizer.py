"""The optimizer step of a stage: optim.run -> reduce embed/head/final-norm gradients (optim
group), AdamW step, zero grads; with ``schedule.grad_offload`` :class:`offload.GradShards` steps
AdamW on the host shards and all-gathers the layers' parameters ([Note: sharded gradients]).

pipedream-2bw keeps two weight versions per parameter ([Note: pipedream-2bw] in
k3sched/schedule_generators.py): :attr:`Optimizer.versions` ``[0]`` is what the plan's first step
runs on (W_{t-1}), ``[1]`` the second step's (W_t). Every compute task of micro-batch m first points
each parameter's ``.data`` at version ``m // M`` (:meth:`Optimizer.versioned`; one compute lane,
so no two tasks swap at once; what a forward saves for its backward was made from, and still
refers to, its own version's buffers). The optimizer of the plan's step k copies the newest version
(``[1 - k]``) over version k, whose last user on this stage has finished, and steps AdamW on it with
step k's gradient: W_{t+1} = AdamW(W_t, grad L_t(W_{t-1})) lands in ``[0]``, W_{t+2} in ``[1]``, so
the next run of the plan finds its two versions in place.

With ``schedule.layer_optim`` ([Note: per-layer optimizer] in k3sched/graph.py) the one AdamW holds
a param group per layer (``"layer": L``) and one for the rest; ``s{s}/v{c}/L{l}/optim.run`` steps
layer L's group alone (:func:`step_groups`) and drops its gradients, and the stage's optim.run
steps the rest. AdamW is elementwise per parameter, so this computes what one step over all of them
does; the checkpoint names state by parameter, so either layout resumes the other's."""

from __future__ import annotations

import torch
from torch import Tensor

from k3sched.tasks import parse_task_id
from moe import MoEModel, handoff
from offload.gradshard import GradShards

from ..executor import Handler, PlanTask
from ..groups import Groups
from .gradients import allreduce_grads


def step_groups(opt: torch.optim.Optimizer, groups: list[dict]) -> None:
    """``opt.step()`` over ``groups`` (some of its param groups) only, then their gradients dropped.
    The step walks ``opt.param_groups``; only the compute lane steps or reads it."""
    every = opt.param_groups
    opt.param_groups = groups
    try:
        opt.step()
    finally:
        opt.param_groups = every
    for g in groups:
        for p in g["params"]:
            p.grad = None


class Optimizer:
    """The stage's handler of optim.run (:meth:`run`) and the gradients it can capture. Owns the
    AdamW of the stage's parameters (:attr:`optimizer`; with ``schedule.grad_offload`` of the
    non-layer ones only: ``gshards`` steps the layers'), the pipedream-2bw weight versions and the
    gradient capture (set :attr:`capture_grads`, read :attr:`captured`)."""

    def __init__(self, model: MoEModel, groups: Groups, *, microbatches: int, plan_steps: int, layer_optim: bool,
                 lr: float, weight_decay: float, gshards: GradShards | None = None) -> None:
        self.model, self.groups, self.gshards, self.microbatches = model, groups, gshards, microbatches
        self.params = [p for p in model.parameters()]
        self.layer_groups = False
        """``schedule.layer_optim``: the AdamW holds a param group per layer (module docstring)."""
        self._layer_captured: dict[str, Tensor] = {}
        opt_params = self.params
        if gshards is not None:  # the layers' parameters are stepped by GradShards on host shards
            opt_params = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
        self.optimizer = torch.optim.AdamW(self.adamw_groups(opt_params, layer_optim), lr=lr,
                                           weight_decay=weight_decay) if opt_params else None
        self.versions: list[list[Tensor]] | None = None
        """pipedream-2bw: the two weight versions of :attr:`params` (None: one version, every other schedule)."""
        self._version = 0
        if plan_steps > 1:
            self.init_versions()
        self.capture_grads = False
        """Capture the gradients at the next optim.run into :attr:`captured`."""
        self.captured: dict[str, Tensor] | None = None

    def init_versions(self) -> None:
        """Two weight versions, both W_0 (module docstring; steps 0 and 1 both run on W_0)."""
        self.versions = [[p.data for p in self.params], [p.data.clone() for p in self.params]]
        self._version = 0

    def use_version(self, k: int) -> None:
        """Point every parameter at weight version ``k``."""
        if k != self._version:
            for p, w in zip(self.params, self.versions[k]):
                p.data = w
            self._version = k

    def versioned(self, h: Handler) -> Handler:
        """``h`` run on the weight version of its task's micro-batch (tasks without one: unchanged)."""
        M = self.microbatches

        def run(t: PlanTask) -> None:
            if t.mb is not None:
                self.use_version(t.mb // M)
            h(t)

        return run

    def _renew_version(self, k: int) -> None:
        """Before the optimizer of the plan's step ``k``: version k := the newest one (1 - k)."""
        self.use_version(k)
        with torch.no_grad():
            for w, newest in zip(self.versions[k], self.versions[1 - k]):
                w.copy_(newest)

    def adamw_groups(self, params: list[Tensor], layer_optim: bool) -> list[Tensor] | list[dict]:
        """What the AdamW of ``params`` is built on: the parameters, or with ``layer_optim``
        (``schedule.layer_optim``) a param group of the non-layer ones and one per layer (:attr:`layer_groups`)."""
        if not layer_optim:
            return params
        mine = {id(p) for p in params}
        rest: list[Tensor] = []
        by_layer: dict[int, list[Tensor]] = {}
        for n, p in self.model.named_parameters():
            if id(p) in mine:
                (by_layer.setdefault(int(n.split(".")[1]), []) if n.startswith("layers.") else rest).append(p)
        groups = [{"params": rest}] if rest else []
        groups += [{"params": ps, "layer": L} for L, ps in sorted(by_layer.items())]
        self.layer_groups = bool(by_layer)
        self._layer_captured = {}
        return groups

    def _ready(self, params: list[Tensor]) -> None:
        """Gradients of ``params`` about to be stepped: zeros where none was made, handed over."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            handoff.write(p.grad, "param grad (optim.run)")

    def _optim_layer(self, layer: int) -> None:
        """``s{s}/v{c}/L{l}/optim.run``: AdamW over layer ``layer``'s parameters alone."""
        # looked up each time: loading a checkpoint replaces the group dicts
        group = next(g for g in self.optimizer.param_groups if g.get("layer") == layer)
        self._ready(group["params"])
        if self.capture_grads:  # the stage's optim.run hands them over with the rest
            names = {id(p): n for n, p in self.model.named_parameters()}
            self._layer_captured.update({names[id(p)]: p.grad.detach().clone() for p in group["params"]})
        step_groups(self.optimizer, [group])

    def run(self, t: PlanTask) -> None:
        """optim.run: the stage's, or with a layer one layer's (``schedule.layer_optim``)."""
        if t.layer is not None:
            self._optim_layer(t.layer)
            return
        rest = [p for n, p in self.model.named_parameters() if not n.startswith("layers.")]
        allreduce_grads(rest, self.groups.optim)
        self._ready(rest if self.gshards is not None or self.layer_groups else self.params)
        if self.capture_grads:
            self.captured, self.capture_grads = {**self._layer_captured, **self.grads()}, False
            self._layer_captured = {}
            if self.gshards is not None:  # the layers' gradients live in the host shards
                self.captured.update({f"layers.{L}.{n}": g for (L, n), g in self.gshards.full_grads().items()})
        if self.versions is not None:
            self._renew_version(parse_task_id(t.id).step or 0)
        if self.optimizer is not None:
            if self.layer_groups:  # the layers' groups were stepped by their own tasks
                step_groups(self.optimizer, [g for g in self.optimizer.param_groups if "layer" not in g])
            else:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        if self.gshards is not None:
            self.gshards.step()

    def grads(self) -> dict[str, Tensor]:
        """Current gradients by full parameter name (this rank's slices)."""
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
