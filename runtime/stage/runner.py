"""The stage runner: this rank's layers, micro-batch states, groups and optimizer, and the handler
table (:meth:`StageRunner.handlers`) assembled from the handler families of the package
(``model_ops``, ``p2p``, ``gradients``, ``offloading``, ``optimizer``; ``memory`` and ``faults``
around them)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
from torch import Tensor

from k3sched.config import Config
from k3sched.pipelines import TABLE as PIPELINE_TABLE
from k3sched.seqslice import slice_bounds
from k3sched.tasks import LANE_OF, Kind
from moe import LayerCtx, MicroBatch, MoEModel

from offload import ActivationManager, MemoryTracker, PolicyTable
from offload.gradshard import GradShards

from ..executor import Handler, PlanTask
from ..groups import Groups
from ..options import RuntimeOptions
from .faults import FaultInjection
from .gradients import GradientOps
from .memory import MemorySampling
from .model_ops import ModelOps
from .offloading import BACKWARD_KINDS, LAST_FORWARD, OffloadOps
from .optimizer import OptimizerOps
from .p2p import P2P_MODES, P2POps, P2PStream, PendingSends
from .spec import StageSpec, build_stage_model, model_args, synthetic_batch


class StageRunner(ModelOps, P2POps, GradientOps, OffloadOps, OptimizerOps, MemorySampling, FaultInjection):
    """This rank's stage: model, micro-batch states, groups, optimizer and task handlers."""

    data = None
    """``runtime.data.TokenData``: micro-batches from a token file (None: synthetic tokens)."""
    step = 0
    """The global index of the step in progress (:meth:`begin_step`)."""

    def __init__(self, cfg: Config, spec: StageSpec, groups: Groups, *, seed: int = 0, lr: float = 1e-3,
                 weight_decay: float = 0.01, device: torch.device | None = None, options: RuntimeOptions | None = None,
                 remote_group=None, p2p: str = "buffered", p2p_timeout_s: float = 120.0,
                 compute_stream=None) -> None:
        self.cfg, self.spec, self.groups = cfg, spec, groups
        self.args = model_args(cfg)
        self.device = device or torch.device("cpu")
        lo = groups.layout
        self.seed = seed
        from k3sched.balance import placement_for as expert_placement

        self.placement = expert_placement(cfg)  # [Note: expert placement] in k3sched/balance.py
        self._replicated = self.placement.replicated()
        self.model = build_stage_model(self.args, seed, spec, ep_rank=lo.ep_idx, ep_size=lo.ep, device=self.device,
                                       slots=self.placement.slots)
        self.params = [p for p in self.model.parameters()]
        opts = options or RuntimeOptions()  # [Note: runtime options]: the debug and fault-injection hooks
        self.acts = ActivationManager(self.device, table=PolicyTable.from_config(cfg), debug=opts.offload_debug,
                                      copy_delay_s=opts.copy_delay_s, remote_group=remote_group,
                                      compute_stream=compute_stream)
        self.unsafe_shared_dx = opts.unsafe_shared_dx
        self.gshards: GradShards | None = None
        opt_params = self.params
        if cfg.schedule.grad_offload:
            chunk_of = {L: c for c, v in spec.chunk_vstage.items() for L in spec.vstage_layers[v]}
            self.gshards = GradShards({L: self.model.layers[L] for L in spec.layers}, chunk_of,
                                      is_expert=MoEModel.is_expert_param, device=self.device,
                                      device_pool=self.acts.device_pool, rs_groups=(groups.dense, groups.expert),
                                      ag_groups=(groups.optim, groups.optim_expert), lr=lr,
                                      weight_decay=weight_decay, copy_delay_s=self.acts.copy_delay_s)
            opt_params = [p for n, p in self.model.named_parameters() if not n.startswith("layers.")]
        # with grad_offload the layers' parameters are stepped by GradShards on host shards
        self.optimizer = torch.optim.AdamW(self.adamw_groups(opt_params), lr=lr, weight_decay=weight_decay) \
            if opt_params else None
        self.plan_steps = PIPELINE_TABLE[cfg.schedule.pipeline].steps  # pipedream-2bw: 2 ([Note: pipedream-2bw])
        self.step_contribs: list[float] = []
        """Per training step of the plan, this rank's loss contribution (:meth:`end_step`)."""
        if self.plan_steps > 1:
            self.init_versions()  # two weight versions (runtime/stage/optimizer.py)
        # activation sets by (state_key, layer): (mb, layer), or ((mb, slice), layer) per slice
        self._bwd_left: dict[tuple, int] = {}  # set -> backward tasks left this step
        self._bwd_count: dict[tuple, int] = {}
        self._offloaded: set[tuple] = set()  # sets the plan offloads
        self._quantized: set[tuple] = set()  # sets kept on the device as FP8
        self._mem_lock = threading.Lock()
        self.sends = PendingSends()
        self.memory = MemoryTracker(self._static_tensors, self._saved_tensors, self.acts, self.device,
                                    extra_host=lambda: self.gshards.host_bytes() if self.gshards else 0,
                                    in_flight=self.sends.buffers)
        self.replicas = lo.ep * lo.dp
        self.mbs: dict[int | tuple[int, int], MicroBatch] = {}
        """Task states of the step by :meth:`state_key`: micro-batch m, or (m, j) per slice j."""
        self._up: dict[tuple, Tensor] = {}  # (state key, layer index of grads) -> upstream grad
        if p2p not in P2P_MODES:
            raise ValueError(f"p2p: one of {', '.join(P2P_MODES)}; got {p2p!r}")
        self.p2p_timeout_s = p2p_timeout_s
        self.streams: dict[tuple[str, int, int], P2PStream] | None = None  # [Note: strict P2P]
        if p2p == "strict":
            missing = sorted(set(groups.p2p) - set(groups.ready))
            if missing:
                raise ValueError(f"--p2p strict: no ready-token group for {missing[0]} (build_p2p_groups(ready=True))")
            self.streams = {k: P2PStream(f"{k[0]} {k[1]}->{k[2]}", p2p_timeout_s) for k in groups.p2p}
        self.fail_task, self.fail_step, self.fail_signal = opts.fail_task, opts.fail_step, opts.fail_signal
        self._rs_buckets: dict[tuple[int, int], int] = {}
        m = cfg.model
        self.act_shape = (m.micro_batch_size, m.seq_len, m.hidden)
        self._shared_layers = {L for L in spec.layers if self.args.is_moe_layer(L) and self.args.shared_experts}
        self.capture_grads = False
        self.captured: dict[str, Tensor] | None = None

    # -- plan-dependent set-up -------------------------------------------------------------------
    def bind_plan(self, lanes: Mapping[str, list[PlanTask]]) -> None:
        """Read what the handlers need from the plan: the bucket count of each layer's grad.rs."""
        for t in lanes["collective"]:
            if t.kind is Kind.GRAD_RS:
                key = (t.chunk, t.layer)
                self._rs_buckets[key] = max(self._rs_buckets.get(key, 0), (t.bucket or 0) + 1)
        for ts in lanes.values():
            for t in ts:
                if t.mb is not None and t.layer is not None and t.kind in BACKWARD_KINDS:
                    k = (self.state_key(t), t.layer)
                    self._bwd_count[k] = self._bwd_count.get(k, 0) + 1
                if t.kind in (Kind.ACT_OFFLOAD, Kind.ACT_ROFFLOAD):
                    self._offloaded.add((self.state_key(t), t.layer))
        if self.cfg.schedule.act_quant == "fp8":  # [Note: FP8 on the device]: the sets the plan keeps
            self._quantized = {(self.state_key(t), t.layer) for ts in lanes.values() for t in ts
                               if t.kind in LAST_FORWARD and (self.state_key(t), t.layer) not in self._offloaded}
        if self.gshards is not None:
            self.gshards.bind(lanes)

    # -- steps -----------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Fresh micro-batch states with this replica's tokens for global step ``step`` (synthetic, or
        from :attr:`data` at its position)."""
        cfg, lo = self.cfg, self.groups.layout
        self.step = step
        M = cfg.parallel.microbatches
        self.mbs.clear()
        self._up.clear()
        self._bwd_left = dict(self._bwd_count)
        self.memory.begin_step()
        bounds = slice_bounds(cfg) if cfg.parallel.seq_chunks > 1 else None
        for m in range(M * self.plan_steps):  # pipedream-2bw: micro-batch m of training step step*2 + m // M
            if self.data is not None:
                tokens, targets = self.data.batch(m)
            else:
                tokens, targets = synthetic_batch(self.seed, step * self.plan_steps + m // M, lo.replica, m % M,
                                                  cfg.model.micro_batch_size, cfg.model.seq_len, cfg.model.vocab)
            tokens, targets, scale = tokens.to(self.device), targets.to(self.device), 1.0 / (M * self.replicas)
            if bounds is None:
                states = [self.model.new_microbatch(tokens, targets, index=m, loss_scale=scale)]
            else:  # one state per slice ([Note: sequence slices in the model] in moe/model.py)
                states = self.model.new_slices(tokens, targets, bounds, index=m, loss_scale=scale)
            for mb in states:
                mb.layers = [LayerCtx(i, self.args.is_moe_layer(i), label=f"{mb.label}/L{i}")
                             for i in range(self.args.layers)]
                self.mbs[m if mb.slice is None else (m, mb.slice)] = mb

    @staticmethod
    def state_key(t: PlanTask) -> int | tuple[int, int]:
        """The key in :attr:`mbs` of task ``t``'s state: its micro-batch, or (micro-batch, slice)."""
        return t.mb if t.slice is None else (t.mb, t.slice)

    def end_step(self) -> float:
        """Wait for outstanding sends; return this rank's loss contribution (sum over its
        micro-batches of cross-entropy if it holds the head, plus aux-loss terms of its layers)."""
        self.sends.wait_all(self.p2p_timeout_s)
        self.acts.end_step()
        if self.gshards is not None:
            self.gshards.end_step()
        coef = self.args.aux_loss_coef
        per = [0.0] * self.plan_steps  # per training step of the plan (pipedream-2bw: two)
        M = self.cfg.parallel.microbatches
        for key, mb in self.mbs.items():
            k = (key if isinstance(key, int) else key[0]) // M
            if mb.ce is not None:
                per[k] += float(mb.ce)
            for L in self.spec.layers:
                aux = mb.layers[L].aux
                if aux is not None:
                    per[k] += coef * float(aux)
        self.mbs.clear()
        self._up.clear()
        self.step_contribs = per
        return sum(per)

    # -- handlers --------------------------------------------------------------------------------
    def handlers(self) -> dict[Kind, Handler]:
        model_ops = {"attn", "router", "dispatch", "shared", "expert", "combine", "mlp", "embed", "head"}
        table: dict[Kind, Handler] = {k: self._model_task for k in Kind if k.op in model_ops}
        table.update({
            Kind.SHARED_DX: self._shared_dx,
            Kind.FWD_SEND: self._send, Kind.BWD_SEND: self._send,
            Kind.FWD_RECV: self._recv, Kind.BWD_RECV: self._recv,
            Kind.GRAD_RS: self._grad_rs, Kind.GRAD_MIRROR: self._grad_mirror,
            Kind.ACT_OFFLOAD: self._offload, Kind.ACT_ONLOAD: self._onload,
            Kind.ACT_ROFFLOAD: self._roffload, Kind.ACT_RSTORE: self._rstore,
            Kind.ACT_RSERVE: self._rserve, Kind.ACT_RONLOAD: self._ronload,
            Kind.OPTIM: self._optim,
        })
        if self.gshards is not None:
            table.update(self.gshards.handlers())
        if self.versions is not None:  # pipedream-2bw: each micro-batch's compute on its weight version
            table = {k: h if LANE_OF[k] != "compute" or k is Kind.OPTIM else self.versioned(h) for k, h in table.items()}
        table = {k: self._tracked(h) for k, h in table.items()}
        if self.fail_task is not None:
            table = {k: self._maybe_fail(h) for k, h in table.items()}
        return table
