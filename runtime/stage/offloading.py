"""Activation storage of a stage: act.offload / act.onload / act.roffload / act.rstore /
act.rserve / act.ronload -> :class:`offload.ActivationManager` ([Note: activation storage
policies]); the offload_remote lane's communicator and its start-up order check.

Every task is wrapped (:meth:`Offloading.tracked`): in debug mode a backward task checks its
layer's activations are resident, the last backward task of an onloaded set releases its device
buffer to the pool, and the memory tracker samples device / host / peer bytes after each task
([Note: measured memory]). ``schedule.act_quant: fp8`` on sets the plan keeps (no plan tasks of
their own, [Note: FP8 on the device] in ``offload/manager.py``): the layer's last forward task
(combine.fwd / mlp.fwd) quantizes the set after it ran; each backward task first reads back what it
needs (a dX task its sub-op's graph-saved tensors, router.bwd / dW tasks / dispatch.re all of its
sub-op's)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist

from k3sched.tasks import Kind
from moe import LayerCtx
from moe.split import GRAPH_USER
from offload import ActivationManager

from ..executor import Handler, PlanTask
from ..groups import Groups
from .memory import MemorySampler
from .model_ops import state_key
from .spec import StageSpec

BACKWARD_KINDS = frozenset(k for k in Kind if k.phase in ("dx", "dw", "bwd", "re"))
LAST_FORWARD = frozenset({Kind.COMBINE_FWD, Kind.MLP_FWD})
"""The last forward task of a layer: its saved set is complete ([Note: FP8 on the device])."""
REMOTE_KINDS = (Kind.ACT_ROFFLOAD, Kind.ACT_RSTORE, Kind.ACT_RSERVE, Kind.ACT_RONLOAD)


class Offloading:
    """The stage's handlers of the offload lanes and the bookkeeping around every task (activation
    residency, FP8, memory samples). Owns which sets the plan offloads or quantizes and the backward
    tasks each has left this step (:meth:`bind`, :meth:`begin_step`) and the executor's lane streams.
    ``acts`` is the stage's activation manager (the memory tracker reads it too), ``mbs`` its
    micro-batch states, ``sampler`` the memory sampler each task ends with."""

    def __init__(self, acts: ActivationManager, spec: StageSpec, groups: Groups, mbs: dict, sampler: MemorySampler, *,
                 device: torch.device, seq_chunks: int, act_quant: str) -> None:
        self.acts, self.spec, self.groups, self.mbs, self.sampler = acts, spec, groups, mbs, sampler
        self.device, self.seq_chunks, self.act_quant = device, seq_chunks, act_quant
        # activation sets by (state_key, layer): (mb, layer), or ((mb, slice), layer) per slice
        self._bwd_left: dict[tuple, int] = {}  # set -> backward tasks left this step
        self._bwd_count: dict[tuple, int] = {}
        self._offloaded: set[tuple] = set()  # sets the plan offloads
        self._quantized: set[tuple] = set()  # sets kept on the device as FP8
        self._lock = threading.Lock()
        self.lane_streams: list = []

    def bind(self, lanes: Mapping[str, list[PlanTask]]) -> None:
        """The sets the plan offloads or keeps as FP8, and each set's backward tasks."""
        for ts in lanes.values():
            for t in ts:
                if t.mb is not None and t.layer is not None and t.kind in BACKWARD_KINDS:
                    k = (state_key(t), t.layer)
                    self._bwd_count[k] = self._bwd_count.get(k, 0) + 1
                if t.kind in (Kind.ACT_OFFLOAD, Kind.ACT_ROFFLOAD):
                    self._offloaded.add((state_key(t), t.layer))
        if self.act_quant == "fp8":  # [Note: FP8 on the device]: the sets the plan keeps
            self._quantized = {(state_key(t), t.layer) for ts in lanes.values() for t in ts
                               if t.kind in LAST_FORWARD and (state_key(t), t.layer) not in self._offloaded}

    def begin_step(self) -> None:
        """Every set's backward tasks are all still to run."""
        self._bwd_left = dict(self._bwd_count)

    def tracked(self, h: Handler) -> Handler:
        """Run ``h`` with the activation bookkeeping around it (see the module docstring)."""
        def run(t: PlanTask) -> None:
            key = (state_key(t), t.layer)  # a set per (micro-batch or slice, layer)
            bwd = t.kind in BACKWARD_KINDS and t.mb is not None and t.layer is not None
            quantized = key in self._quantized
            names = None
            if bwd and quantized:  # an FP8 set: what this task reads back in full precision
                lc = self.mbs[key[0]].layers[t.layer]
                names = self._reads(t, lc)
                self.acts.dequantize_resident(self._buffer(t), lc, t.id, t.kind.op, names)
            if bwd and self.acts.debug and (key in self._offloaded or quantized) \
                    and not self.acts.resident_for(self._buffer(t), t.kind.op, names):
                raise RuntimeError(f"reads layer {t.layer} of {self.mbs[key[0]].label} before its onload finished")
            h(t)
            if quantized and t.kind in LAST_FORWARD:
                self.acts.quantize_resident(self._buffer(t), self.mbs[key[0]].layers[t.layer], t.id)
            if bwd and (key in self._offloaded or quantized):
                with self._lock:
                    self._bwd_left[key] -= 1
                    last = self._bwd_left[key] == 0
                if last:
                    self.acts.release(self._buffer(t), self.mbs[key[0]].layers[t.layer], self._lane_fence())
            self.sampler.sample(read_static=t.lane == "compute")
        return run

    @staticmethod
    def _reads(t: PlanTask, lc: LayerCtx) -> set[str] | None:
        """Saved names a backward task reads: a dX-only task (dx; combine.bwd, dispatch.bwd) its
        sub-op's graph-saved tensors; router.bwd (dX and dW), dW tasks and dispatch.re every
        tensor of their sub-op (None)."""
        if t.kind.phase in ("dw", "re") or t.kind is Kind.ROUTER_BWD:
            return None
        c = lc.sub_ops().get(t.kind.op)
        return c.store.names_of(GRAPH_USER) if c is not None else set()

    def _buffer(self, t: PlanTask) -> str:
        """The set's name, as plan.json's ``buffer`` (``s0/mb2/L4/act``; a slice's ``s0/mb2q1/L4/act``)."""
        mb = f"mb{t.mb}" if t.slice is None else f"mb{t.mb}q{t.slice}"
        return f"s{self.spec.stage}/{mb}/L{t.layer}/act"

    def _lane_fence(self):
        """GPU: events on every lane stream that may still read a released buffer."""
        if self.device.type != "cuda":
            return None
        evs = []
        for s in self._streams():
            ev = torch.cuda.Event()
            ev.record(s)
            evs.append(ev)
        return evs

    def _streams(self) -> list:
        return self.lane_streams or [torch.cuda.current_stream(self.device)]

    def bind_streams(self, streams: Mapping[str, object]) -> None:
        """The executor's lane streams (GPU; empty on CPU): fences of released buffers cover them
        all, and the device pool allocates on the compute stream ([Note: pools and fences])."""
        self.lane_streams = list(streams.values())
        self.acts.bind_compute_stream(streams.get("compute"))

    def offload(self, t: PlanTask) -> None:
        self.acts.offload_local(self._buffer(t), self.mbs[state_key(t)].layers[t.layer], t.id)

    def onload(self, t: PlanTask) -> None:
        self.acts.onload_local(self._buffer(t), self.mbs[state_key(t)].layers[t.layer], t.id)

    def _unit(self, t: PlanTask) -> int:
        """The pipeline unit of a remote transfer's tags: the micro-batch, or mb * S + slice."""
        return t.mb if t.slice is None else t.mb * self.seq_chunks + t.slice

    def roffload(self, t: PlanTask) -> None:
        self.acts.offload_remote(self._buffer(t), self.mbs[state_key(t)].layers[t.layer],
                                 self.groups.pp_rank(t.peer_stage), self._unit(t), t.layer, t.id)

    def ronload(self, t: PlanTask) -> None:
        self.acts.onload_remote(self._buffer(t), self.mbs[state_key(t)].layers[t.layer],
                                self.groups.pp_rank(t.peer_stage), self._unit(t), t.layer, t.id)

    def rstore(self, t: PlanTask) -> None:
        self.acts.store_remote(t.buffer, self.groups.pp_rank(t.peer_stage), self._unit(t), t.layer, t.id)

    def rserve(self, t: PlanTask) -> None:
        self.acts.serve_remote(t.buffer, self.groups.pp_rank(t.peer_stage), self._unit(t), t.layer, t.id)


def build_remote_group(groups: Groups, plan: Mapping, timeout=None):
    """The offload_remote lane's own communicator: the ranks of this rank's (dp, ep) column across
    PP stages (the pp group's members, a separate process group), created on every rank when the
    plan has remote offload tasks (every rank plans the same, so all create it or none does).
    ``timeout`` (a timedelta: the run's ``--timeout``) bounds its operations like every other group's."""
    kinds = {t["kind"] for st in plan["stages"] for t in st["lanes"].get("offload_remote", [])}
    lo = groups.layout
    if not kinds or lo.pp < 2:
        return None
    mine = None
    for d in range(lo.dp):
        for e in range(lo.ep):
            pg = dist.new_group([lo.rank_of(s, d, e) for s in range(lo.pp)], timeout=timeout)
            if (d, e) == (lo.dp_idx, lo.ep_idx):
                mine = pg
    return mine


def remote_order(lanes: Mapping[str, list[PlanTask]], stage: int) -> dict[str, dict[int, list]]:
    """Transfers of the offload_remote lane by peer stage, in lane order: ``send`` (roffload,
    rserve) and ``recv`` (rstore, ronload) keys ``(direction, mb, layer)`` (``(direction, mb, layer,
    slice)`` for a slice's)."""
    out: dict[str, dict[int, list]] = {"send": {}, "recv": {}}
    for t in lanes.get("offload_remote", []):
        d = "out" if t.kind in (Kind.ACT_ROFFLOAD, Kind.ACT_RSTORE) else "back"
        side = "send" if t.kind in (Kind.ACT_ROFFLOAD, Kind.ACT_RSERVE) else "recv"
        out[side].setdefault(t.peer_stage, []).append([d, t.mb, t.layer] if t.slice is None
                                                      else [d, t.mb, t.layer, t.slice])
    return out


def verify_remote_orders(groups: Groups, lanes: Mapping[str, list[PlanTask]], stage: int) -> None:
    """Start-up check: the remote sends of stage a to stage b are, in order, b's receives from a
    (else the offload_remote lanes would deadlock)."""
    from ..groups import verify_pairing

    verify_pairing(groups, "offload_remote", remote_order(lanes, stage), stage)
