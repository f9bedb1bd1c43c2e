"""The stage runner: this rank's layers and micro-batch states, the handler families built on them
(:class:`ModelOps`, :class:`P2P`, :class:`Gradients`, :class:`Offloading`, :class:`Optimizer`; the
:class:`MemorySampler` and :class:`Faults` around them), and the handler table
(:meth:`StageRunner.handlers`) mapping every task kind to the handler of its family."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from k3sched.config import Config
from k3sched.pipelines import TABLE as PIPELINE_TABLE
from k3sched.seqslice import slice_bounds
from k3sched.tasks import LANE_OF, Kind
from moe import LayerCtx, MicroBatch, MoEModel

from offload import ActivationManager, PolicyTable
from offload.gradshard import GradShards

from ..executor import Handler, PlanTask
from ..groups import Groups
from ..options import RuntimeOptions
from .faults import Faults
from .gradients import Gradients
from .memory import MemorySampler
from .model_ops import ModelOps, state_key
from .offloading import Offloading
from .optimizer import Optimizer
from .p2p import P2P
from .spec import StageSpec, build_stage_model, model_args, synthetic_batch


class StageRunner:
    """This rank's stage: its model slice, the micro-batch states of the step in progress, the
    handler families and the task handlers. The families own their state; the runner owns what
    several share (the model, :attr:`mbs`, :attr:`acts`, :attr:`gshards`) and hands it to them."""

    data = None
    """``runtime.data.TokenData``: micro-batches from a token file (None: synthetic tokens)."""
    step = 0
    """The global index of the step in progress (:meth:`begin_step`)."""
    state_key = staticmethod(state_key)

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
        self.model = build_stage_model(self.args, seed, spec, ep_rank=lo.ep_idx, ep_size=lo.ep, device=self.device,
                                       slots=self.placement.slots)
        opts = options or RuntimeOptions()  # [Note: runtime options]: the debug and fault-injection hooks
        self.acts = ActivationManager(self.device, table=PolicyTable.from_config(cfg), debug=opts.offload_debug,
                                      copy_delay_s=opts.copy_delay_s, remote_group=remote_group,
                                      compute_stream=compute_stream)
        self.gshards = self._build_gshards(lr, weight_decay) if cfg.schedule.grad_offload else None
        self.plan_steps = PIPELINE_TABLE[cfg.schedule.pipeline].steps  # pipedream-2bw: 2 ([Note: pipedream-2bw])
        self.step_contribs: list[float] = []
        """Per training step of the plan, this rank's loss contribution (:meth:`end_step`)."""
        self.replicas = lo.ep * lo.dp
        self.mbs: dict[int | tuple[int, int], MicroBatch] = {}
        """Task states of the step by :meth:`state_key`: micro-batch m, or (m, j) per slice j."""
        m = cfg.model
        shared_layers = {L for L in spec.layers if self.args.is_moe_layer(L) and self.args.shared_experts}
        self.model_ops = ModelOps(self.model, self.mbs, groups.ep, shared_layers=shared_layers,
                                  head_index=self.args.layers, gshards=self.gshards,
                                  unsafe_shared_dx=opts.unsafe_shared_dx)
        self.p2p = P2P(spec, groups, self.mbs, self.model_ops.keep_up, seq_chunks=cfg.parallel.seq_chunks,
                       act_shape=(m.micro_batch_size, m.seq_len, m.hidden), dtype=self.args.torch_dtype,
                       device=self.device, mode=p2p, timeout_s=p2p_timeout_s)
        self.gradients = Gradients(self.model, groups, replicated=self.placement.replicated(), gshards=self.gshards)
        self.optim = Optimizer(self.model, groups, microbatches=cfg.parallel.microbatches, plan_steps=self.plan_steps,
                               layer_optim=cfg.schedule.layer_optim, lr=lr, weight_decay=weight_decay,
                               gshards=self.gshards)
        self.sampler = MemorySampler(self.optim, spec, self.mbs, self.acts, self.p2p.sends, device=self.device,
                                     gshards=self.gshards)
        self.memory = self.sampler.tracker
        self.offload = Offloading(self.acts, spec, groups, self.mbs, self.sampler, device=self.device,
                                  seq_chunks=cfg.parallel.seq_chunks, act_quant=cfg.schedule.act_quant)
        self.faults = Faults(opts, step=lambda: self.step, rank=lo.rank, device=self.device)

    def _build_gshards(self, lr: float, weight_decay: float) -> GradShards:
        """``schedule.grad_offload``: the layers' gradients in host shards ([Note: sharded gradients]),
        shared by the model (dW tasks accumulate), gradient (grad.rs) and optimizer families."""
        spec, groups = self.spec, self.groups
        chunk_of = {L: c for c, v in spec.chunk_vstage.items() for L in spec.vstage_layers[v]}
        return GradShards({L: self.model.layers[L] for L in spec.layers}, chunk_of,
                          is_expert=MoEModel.is_expert_param, device=self.device,
                          device_pool=self.acts.device_pool, rs_groups=(groups.dense, groups.expert),
                          ag_groups=(groups.optim, groups.optim_expert), lr=lr,
                          weight_decay=weight_decay, copy_delay_s=self.acts.copy_delay_s)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The stage's AdamW (:attr:`Optimizer.optimizer`; the checkpoint reads and loads it)."""
        return self.optim.optimizer

    # -- plan-dependent set-up -------------------------------------------------------------------
    def bind_plan(self, lanes: Mapping[str, list[PlanTask]]) -> None:
        """Read what the families need from the plan: grad.rs buckets, offloaded and FP8 sets,
        gradient shard flush groups."""
        self.gradients.bind(lanes)
        self.offload.bind(lanes)
        if self.gshards is not None:
            self.gshards.bind(lanes)

    def bind_streams(self, streams: Mapping[str, object]) -> None:
        """The executor's lane streams (GPU; empty on CPU): :meth:`Offloading.bind_streams`."""
        self.offload.bind_streams(streams)

    # -- steps -----------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Fresh micro-batch states with this replica's tokens for global step ``step`` (synthetic, or
        from :attr:`data` at its position)."""
        cfg, lo = self.cfg, self.groups.layout
        self.step = step
        M = cfg.parallel.microbatches
        self.mbs.clear()
        self.model_ops.clear()
        self.offload.begin_step()
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

    def end_step(self) -> float:
        """Wait for outstanding sends; return this rank's loss contribution (sum over its
        micro-batches of cross-entropy if it holds the head, plus aux-loss terms of its layers)."""
        self.p2p.wait_all()
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
        self.model_ops.clear()
        self.step_contribs = per
        return sum(per)

    def routing_counts(self) -> dict[int, tuple[list[int], list[int]]]:
        """This rank's routed slots since the last call, per MoE layer of the stage: (per expert,
        per global slot); the counters restart."""
        out = {}
        for L in self.spec.layers:
            block = self.model.layers[L]
            if getattr(block, "is_moe", False):
                out[L] = (block.routed_E.tolist(), block.routed_G.tolist())
                block.reset_routing_counts()
        return out

    # -- handlers --------------------------------------------------------------------------------
    def handlers(self) -> dict[Kind, Handler]:
        """Every task kind's handler: its family's, run on its weight version (pipedream-2bw), with
        the activation bookkeeping and memory sample around it, and fault injection if set."""
        ops, p2p, grads, off, optim = self.model_ops, self.p2p, self.gradients, self.offload, self.optim
        model_ops = {"attn", "router", "dispatch", "shared", "expert", "combine", "mlp", "embed", "head"}
        table: dict[Kind, Handler] = {k: ops.run for k in Kind if k.op in model_ops}
        table.update({
            Kind.SHARED_DX: ops.shared_dx,
            Kind.FWD_SEND: p2p.send, Kind.BWD_SEND: p2p.send,
            Kind.FWD_RECV: p2p.recv, Kind.BWD_RECV: p2p.recv,
            Kind.GRAD_RS: grads.grad_rs, Kind.GRAD_MIRROR: grads.grad_mirror,
            Kind.ACT_OFFLOAD: off.offload, Kind.ACT_ONLOAD: off.onload,
            Kind.ACT_ROFFLOAD: off.roffload, Kind.ACT_RSTORE: off.rstore,
            Kind.ACT_RSERVE: off.rserve, Kind.ACT_RONLOAD: off.ronload,
            Kind.OPTIM: optim.run,
        })
        if self.gshards is not None:
            table.update(self.gshards.handlers())
        if optim.versions is not None:  # pipedream-2bw: each micro-batch's compute on its weight version
            table = {k: h if LANE_OF[k] != "compute" or k is Kind.OPTIM else optim.versioned(h)
                     for k, h in table.items()}
        table = {k: off.tracked(h) for k, h in table.items()}
        if self.faults.fail_task is not None:
            table = {k: self.faults.wrap(h) for k, h in table.items()}
        return table
