"""The optimizer step of a stage: optim.run -> reduce embed/head/final-norm gradients (optim
group), AdamW step, zero grads; with ``schedule.grad_offload`` :class:`offload.GradShards` steps
AdamW on the host shards and all-gathers the layers' parameters ([Note: sharded gradients]).

pipedream-2bw keeps two weight versions per parameter ([Note: pipedream-2bw] in
k3sched/schedule_generators.py): :attr:`OptimizerOps.versions` ``[0]`` is what the plan's first step
runs on (W_{t-1}), ``[1]`` the second step's (W_t). Every compute task of micro-batch m first points
each parameter's ``.data`` at version ``m // M`` (:meth:`OptimizerOps.versioned`; one compute lane,
so no two tasks swap at once; what a forward saves for its backward was made from, and still
refers to, its own version's buffers). The optimizer of the plan's step k copies the newest version
(``[1 - k]``) over version k, whose last user on this stage has finished, and steps AdamW on it with
step k's gradient: W_{t+1} = AdamW(W_t, grad L_t(W_{t-1})) lands in ``[0]``, W_{t+2} in ``[1]``, so
the next run of the plan finds its two versions in place."""

from __future__ import annotations

import torch
from torch import Tensor

from k3sched.tasks import parse_task_id
from moe import handoff

from ..executor import Handler, PlanTask
from .gradients import _allreduce_grads


class OptimizerOps:
    """:class:`~runtime.stage.StageRunner` handler of optim.run and the gradients it can capture."""

    versions: list[list[Tensor]] | None = None
    """pipedream-2bw: the two weight versions of :attr:`params` (None: one version, every other schedule)."""
    _version = 0

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
        M = self.cfg.parallel.microbatches

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

    def _optim(self, t: PlanTask) -> None:
        rest = [p for n, p in self.model.named_parameters() if not n.startswith("layers.")]
        _allreduce_grads(rest, self.groups.optim)
        stepped = rest if self.gshards is not None else self.params
        for p in stepped:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            handoff.write(p.grad, "param grad (optim.run)")
        if self.capture_grads:
            self.captured, self.capture_grads = self.grads(), False
            if self.gshards is not None:  # the layers' gradients live in the host shards
                self.captured.update({f"layers.{L}.{n}": g for (L, n), g in self.gshards.full_grads().items()})
        if self.versions is not None:
            self._renew_version(parse_task_id(t.id).step or 0)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.gshards is not None:
            self.gshards.step()

    def grads(self) -> dict[str, Tensor]:
        """Current gradients by full parameter name (this rank's slices)."""
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
