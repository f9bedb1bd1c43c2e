"""Graph builder: a config (plus an offload choice) -> the task DAG of one training step.

The step is built for every PP stage at once, because pipeline send/recv tasks tie stages
together. Model chunks are *virtual stages* (vstages) numbered 0..pp*vpp-1 in model order; a
placement maps each vstage to a (PP rank, local chunk). Each (vstage, micro-batch) expands into
three *units* that the pipeline backbone orders: ``F`` (forward), ``I`` (input-gradient
backward, the critical path) and ``W`` (weight gradients, deferrable). Every task records its
unit so the planner can follow the backbone; ``topo`` is the creation order, a topological order.

[Note: layer task graph]
Forward of one MoE layer:   attn.fwd -> router.fwd -> dispatch.fwd (ep) -> expert.fwd -> combine.fwd (ep)
                                   \\-> shared.fwd -------------------------------------/
Backward (I):  up -> combine.bwd (ep) -> expert.dx -> dispatch.bwd (ep) -> router.bwd -> attn.dx
                 \\-> shared.dx ------------------------------------------/
               optional dispatch.re (ep, from `up`) re-runs the dispatch for expert.dw (EP-DR)
Backward (W):  attn.dw <- attn.dx, shared.dw <- shared.dx, expert.dw <- expert.dx (+ dispatch.re)
These tasks, their edges and memory effects are the rows of the step table ([Note: step table] in
k3sched/steptable.py), from which the builder makes them and which ``moe`` and the runtime read
too. shared.dx (compute lane) and dispatch.bwd (ep lane) stay unordered so
they overlap: each writes its own partial gradient of the FFN input, and router.bwd, which waits for
both, sums them ([Note: partial input gradients] in moe/context.py); ``k3sched run --racecheck``
checks that no two unordered tasks touch one tensor ([Note: race detector] in runtime/racecheck.py).
A dense layer has mlp.fwd / mlp.dx / mlp.dw in place of the MoE ops. ``up`` is the input
gradient from the layer above (attn.dx), the head (head.dx) or the next stage (grad.recv).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from .config import Config, ConfigError
from .cost import CostModel
from .layersplit import split_layers
from .pipelines import TABLE as PIPELINE_TABLE
from .schedules import Placement
from .seqslice import slice_bounds, unit_of
from .steptable import LAYER_IN_GRAD, LAYER_OUT, layer_steps
from .tasks import LANE_OF, WGRAD_KINDS, Kind, Mem, Task, format_task_id, parse_task_id

Unit = tuple[int, str, int]  # (vstage, "F" | "I" | "W", mb)
_GRAD_KINDS = WGRAD_KINDS | {Kind.ROUTER_BWD}  # tasks that add to parameter gradients (router.bwd: the router's dW)

# [Note: gradient accumulation order] A weight gradient is the sum of every micro-batch's (and
# sequence slice's) contribution, added into one buffer by the tasks that compute them
# (moe/split.py ``WGradSlot.apply``: ``param.grad.add_``). Floating-point addition is not
# associative, so the order of those additions is part of what is computed: two plans that add
# the same contributions in different orders give gradients that differ in their last bits, and
# the runs drift apart from the next step on. Each task that adds to a gradient therefore depends
# on the task of the same kind, layer and chunk that comes before it in the graph's order (the
# backward order of the pipeline: micro-batches ascending on a vstage, slices in reverse): every
# plan of a pipeline, serial or co-scheduled, exact or listed, adds in that one order. Without
# it, a co-scheduled plan may run embed.dw of micro-batch 2 before that of micro-batch 1, and its
# loss then differs from the serial run's.
# These tasks share the compute lane, so the dependency costs the executor nothing: it only keeps
# a schedule from reordering them.


def placement_for(cfg: Config) -> Placement:
    """V-shaped placement for ZB-V, DualPipeV, V-Half and V-Min, Megatron's loop placement
    otherwise; DualPipe and Chimera: two copies of the pp model stages as 2*pp vstages in V
    placement ([Note: dualpipe mapping])."""
    entry = PIPELINE_TABLE[cfg.schedule.pipeline]  # [Note: schedule registry]
    if entry.copies == 2:
        return Placement("v", cfg.parallel.pp, 2)
    return Placement(entry.placement, cfg.parallel.pp, cfg.parallel.vpp)


@dataclass
class OffloadChoice:
    """Which (stage, mb, layer) activation sets leave the device, and where to.
    ``remote[(stage, mb, layer)] = peer_stage`` for remote offload, else local host. In a sliced
    plan a set is one slice's: (stage, mb, layer, slice)."""

    local: set[tuple[int, int, int]] = field(default_factory=set)
    remote: dict[tuple[int, int, int], int] = field(default_factory=dict)
    everything: bool = False  # every set offloaded locally (the planner's search graph)

    def __contains__(self, key: tuple[int, int, int]) -> bool:
        return self.everything or key in self.local or key in self.remote

    def is_local(self, key: tuple[int, int, int]) -> bool:
        return key in self.local or (self.everything and key not in self.remote)


def set_task_id(key: tuple[int, ...], kind: Kind) -> str:
    """The id of the ``kind`` task (attn.fwd, act.offload, ...) of activation set ``key``:
    (stage, mb, layer), or (stage, mb, layer, slice) in a sliced plan."""
    return format_task_id(key[0], kind, mb=key[1], layer=key[2], slice=key[3] if len(key) > 3 else None)


@dataclass
class StepGraph:
    cfg: Config
    placement: Placement
    tasks: dict[str, Task]
    unit: dict[str, Unit]
    topo: dict[str, int]
    start_deps: dict[str, list[str]]
    static_device: list[int]
    static_host: list[int]
    layers: list[list[int]]  # per vstage
    offload_sets: dict[tuple[int, int, int], int]  # (stage, mb, layer) -> bytes offloadable


class _Builder:
    def __init__(self, cfg: Config, offload: OffloadChoice | None):
        self.cfg = cfg
        self.cost = CostModel(cfg)
        self.pl = placement_for(cfg)
        self.nv = self.pl.num_stages
        located = [self.pl.locate(v) for v in range(self.nv)]
        self._rank = [r for r, _ in located]
        self._chunk = [c for _, c in located]
        self.off = offload or OffloadChoice()
        self.tasks: dict[str, Task] = {}
        self.unit: dict[str, Unit] = {}
        self.topo: dict[str, int] = {}
        self.start_deps: dict[str, list[str]] = {}
        self._grad_last: dict[tuple, str] = {}  # [Note: gradient accumulation order]
        self.layers = split_layers(cfg)
        self.bidir = PIPELINE_TABLE[cfg.schedule.pipeline].copies == 2
        self.steps = PIPELINE_TABLE[cfg.schedule.pipeline].steps  # [Note: pipedream-2bw]
        if self.steps > 1 and cfg.schedule.grad_offload:
            raise ConfigError(f"schedule.grad_offload: {cfg.schedule.pipeline} keeps two weight versions and is "
                              f"planned without gradient offload; set grad_offload false")
        if self.bidir:  # vstage pp + k is the up copy of model stage k
            self.layers = self.layers + self.layers
        self.offload_sets: dict[tuple[int, int, int], int] = {}
        self._saved = {k: self.cost.saved_bytes(k) for k in Kind}
        self._grad_out = {k: self.cost.grad_out_bytes(k) for k in Kind}
        self._dur: dict[object, float] = {}  # memo of dur() and a2a_bytes(), per cost model
        # sequence slices ([Note: sequence slices] in k3sched/seqslice.py): one cost model per slice
        self.S = cfg.parallel.seq_chunks
        self._j: int | None = None  # the slice being built (None: whole micro-batches)
        self._bounds = slice_bounds(cfg)
        self._slices = [self._slice_state(self.cost.sliced(*b)) for b in self._bounds] if self.S > 1 else []
        self._pending_offload: dict[tuple[int, int, int], tuple] = {}
        dr = cfg.schedule.dispatch_recompute  # the layer rows of the step table ([Note: step table])
        rows = {moe: layer_steps(moe, dr) for moe in (True, False)}
        # (row, its planned edges to kinds the layer has) by (MoE layer, forward)
        self._rows = {(moe, fwd): tuple((r, tuple(k for k in r.deps if k in {q.kind for q in rows[moe]}))
                                        for r in rows[moe] if (r.unit == "F") == fwd)
                      for moe in (True, False) for fwd in (True, False)}
        self._first_bwd = {moe: next(r.kind for r in rows[moe] if r.unit == "I" and r.entry) for moe in (True, False)}

    # -- helpers -------------------------------------------------------------------------------
    def route(self, m: int) -> range:
        """The vstages micro-batch ``m`` passes (DualPipe: the first half down, the rest up)."""
        if not self.bidir:
            return range(self.nv)
        pp = self.cfg.parallel.pp
        return range(0, pp) if m < self.cfg.parallel.microbatches // 2 else range(pp, 2 * pp)

    def mbs_of(self, v: int, step: int | None = None) -> list[int]:
        """Micro-batches through vstage ``v`` (of the plan's step ``step`` only, when given)."""
        M = self.cfg.parallel.microbatches
        mbs = range(M * self.steps) if step is None else range(M * step, M * (step + 1))
        return [m for m in mbs if v in self.route(m)]

    def optim_id(self, stage: int, step: int) -> str:
        """The optimizer task of the plan's step ``step`` on ``stage`` ([Note: pipedream-2bw])."""
        return format_task_id(stage, Kind.OPTIM, step=step or None)

    def dur(self, kind: Kind, layer: int | None = None, nbytes: int = 0) -> float:
        """Duration of a task of ``kind`` (by layer and payload where those price it), each
        distinct one costed once: a K2-like step has 35k tasks of a few dozen distinct costs."""
        if kind is Kind.GRAD_RS or nbytes:
            key: object = (kind, layer, nbytes)
            d = self._dur.get(key)
            if d is None:
                d = self._dur[key] = self.cost.duration_us(kind, layer=layer, nbytes=nbytes)
            return d
        d = self._dur.get(kind)
        if d is None:
            d = self._dur[kind] = self.cost.duration_us(kind)
        return d

    def a2a_bytes(self, kind: Kind) -> int:
        """:meth:`CostModel.a2a_bytes` of ``kind``, computed once per cost model (slice)."""
        key = ("a2a_bytes", kind)
        b = self._dur.get(key)
        if b is None:
            b = self._dur[key] = self.cost.a2a_bytes(kind)
        return int(b)

    def add(self, kind: Kind, v: int, unit: str, mb: int | None, *, layer: int | None = None, deps=(),
            alloc: Mem | None = None, free: Mem | None = None, nbytes: int = 0, scope_chunk: bool = False,
            duration: float | None = None, bucket: int | None = None, at_stage: int | None = None,
            **extra) -> str:
        """Add a task of vstage ``v`` (``at_stage``: a task another stage runs on its behalf, e.g. the
        peer side of a remote offload; its chunk is then 0)."""
        stage, chunk = self._rank[v], self._chunk[v]
        if at_stage is not None:
            stage, chunk = at_stage, 0
        if self.steps > 1 and kind in _GRAD_KINDS and mb is not None and mb >= self.cfg.parallel.microbatches:
            # one gradient buffer: the previous step's optimizer reads it first ([Note: pipedream-2bw])
            deps = [*deps, self.optim_id(stage, mb // self.cfg.parallel.microbatches - 1)]
        # [Note: gradient accumulation order]: after the same gradient's previous add
        gkey = (stage, kind, layer, chunk, mb // self.cfg.parallel.microbatches) \
            if kind in _GRAD_KINDS and mb is not None else None
        if gkey in self._grad_last:
            deps = [*deps, self._grad_last[gkey]]
        j = self._j if mb is not None else None
        tid = format_task_id(stage, kind, mb=mb, layer=None if scope_chunk else layer,
                             chunk=chunk if (scope_chunk or mb is None) else None, bucket=bucket, slice=j)
        t = Task(tid, kind, LANE_OF[kind], stage, chunk, mb, layer,
                 duration_us=self.dur(kind, layer, nbytes) if duration is None else duration,
                 deps=[d for d in deps if d], alloc=alloc or Mem(), free=free or Mem(), bytes=nbytes, slice=j, **extra)
        assert tid not in self.tasks, tid
        self.tasks[tid] = t
        if gkey is not None:
            self._grad_last[gkey] = tid
        self.unit[tid] = (v, unit, -1 if mb is None else mb if self.S == 1 else unit_of(mb, j, unit, self.S))
        self.topo[tid] = len(self.topo)
        return tid

    def is_first(self, v: int) -> bool:
        return v == 0 or (self.bidir and v == self.cfg.parallel.pp)

    def is_last(self, v: int) -> bool:
        return v == self.nv - 1 or (self.bidir and v == self.cfg.parallel.pp - 1)

    def fwd_alloc(self, kind: Kind) -> Mem:
        w, x = self._saved[kind]
        return Mem(device=w + x)

    # -- sequence slices ([Note: sequence slices] in k3sched/seqslice.py) ------------------------
    @staticmethod
    def _slice_state(cost: CostModel) -> tuple:
        return cost, {k: cost.saved_bytes(k) for k in Kind}, {k: cost.grad_out_bytes(k) for k in Kind}, {}

    @contextmanager
    def _at_slice(self, j: int):
        """Build slice ``j``: its cost model, saved bytes and durations replace the whole
        micro-batch's while inside; task ids and units then name the slice."""
        outer = self.cost, self._saved, self._grad_out, self._dur, self._j
        self.cost, self._saved, self._grad_out, self._dur = self._slices[j]
        self._j = j
        try:
            yield
        finally:
            self.cost, self._saved, self._grad_out, self._dur, self._j = outer

    def _mk(self, m: int) -> int | tuple[int, int]:
        """Key of micro-batch ``m`` (and the slice being built) in the per-(vstage, mb) tables."""
        return m if self._j is None else (m, self._j)

    def set_key(self, stage: int, m: int, L: int) -> tuple[int, ...]:
        """Key of an activation set: (stage, mb, layer), plus the slice in a sliced plan."""
        return (stage, m, L) if self._j is None else (stage, m, L, self._j)

    def _kv_grad_bytes(self, j: int) -> int:
        """Bytes of the key / value gradients of the prefix [0, start of slice j) that slice j's
        attention backward hands to the earlier slices (model dtype)."""
        return 2 * self.cfg.model.micro_batch_size * self._bounds[j][0] * self.cfg.model.hidden * self.cost.b

    # -- expansion -----------------------------------------------------------------------------
    def build(self) -> StepGraph:
        cfg, pl = self.cfg, self.pl
        self.fwd_out: dict[tuple[int, int], list[str]] = {}
        self.bwd_out: dict[tuple[int, int], str] = {}
        self.send_f: dict[tuple[int, int], str] = {}
        self.send_b: dict[tuple[int, int], str] = {}
        self.layer_bwd_first: dict[tuple[int, int, int], str] = {}
        self.wgrads: dict[tuple[int, int], list[str]] = {}  # (mb, layer) -> dW ids
        for v in range(self.nv):
            for m in self.mbs_of(v):
                self.forward(v, m)
        for k in range(self.steps):  # step by step, so a step's optimizer precedes the next one's dW
            for v in reversed(range(self.nv)):
                for m in self.mbs_of(v, k if self.steps > 1 else None):
                    self.backward(v, m)
            self.gradients(k)
        static_dev, static_host = [], []
        for s in range(cfg.parallel.pp):
            vs = [v for v in range(self.nv) if self._rank[v] == s]
            layers = [L for v in vs for L in self.layers[v]]
            d, h = self.cost.static_bytes(layers, embed=any(self.is_first(v) for v in vs),
                                          head=any(self.is_last(v) for v in vs))
            if self.steps > 1:  # the second weight version ([Note: pipedream-2bw])
                d += self.cost.weight_bytes(layers, embed=any(self.is_first(v) for v in vs),
                                            head=any(self.is_last(v) for v in vs))
            static_dev.append(d)
            static_host.append(h)
        return StepGraph(cfg, pl, self.tasks, self.unit, self.topo, self.start_deps, static_dev, static_host,
                         self.layers, self.offload_sets)

    def forward(self, v: int, m: int) -> None:
        """Forward of micro-batch ``m`` on vstage ``v``; in a sliced plan one pass per sequence
        slice, in slice order ([Note: sequence slices] in k3sched/seqslice.py)."""
        if not self._slices:
            return self._forward(v, m)
        for j in range(self.S):
            with self._at_slice(j):
                self._forward(v, m)

    def backward(self, v: int, m: int) -> None:
        """Backward of micro-batch ``m`` on vstage ``v``; in a sliced plan one pass per slice, in
        reverse slice order."""
        if not self._slices:
            return self._backward(v, m)
        for j in reversed(range(self.S)):
            with self._at_slice(j):
                self._backward(v, m)

    def _forward(self, v: int, m: int) -> None:
        model = self.cfg.model
        stage = self._rank[v]
        mk, j = self._mk(m), self._j
        if self.is_first(v):
            prev = [self.add(Kind.EMBED_FWD, v, "F", m, scope_chunk=True)]
        elif self._rank[v - 1] != stage:
            prev = [self.add(Kind.FWD_RECV, v, "F", m, scope_chunk=True, deps=[self.send_f[(v - 1, mk)]],
                             release=(self._rank[v - 1], self.cost.p2p_bytes()),
                             duration=self.cost.duration_us(Kind.FWD_RECV, stages=(self._rank[v - 1], stage)))]
        else:
            prev = self.fwd_out[(v - 1, mk)]
        for L in self.layers[v]:
            # causal attention: slice j reads the keys and values of slice j-1 (and so of every earlier one)
            kv = [format_task_id(stage, Kind.ATTN_FWD, mb=m, layer=L, slice=j - 1)] if j else []
            moe = model.is_moe(L)
            ids = self._layer(v, m, L, moe, True, prev, {Kind.ATTN_FWD: kv},
                              after={Kind.ATTN_FWD: lambda a: self._offload_pending(v, m, L, a)})
            prev = [ids[k] for k in LAYER_OUT["moe" if moe else "dense"]]
            kinds = ids  # the layer's forward kinds
            key = self.set_key(stage, m, L)
            # sub-ops kept on the device stay out of the set ([Note: storage policies from the config])
            nbytes = sum(sum(self._saved[k]) for k in kinds if not self.cost.kept_on_device(k))
            self.offload_sets[key] = nbytes
            if j is not None and j < self.S - 1 and key in self.off:
                self._pending_offload[(stage, m, L)] = (nbytes, list(prev))
            else:
                self._offload_set(v, m, L, nbytes, list(prev))
        if self.is_last(v):
            prev = [self.add(Kind.HEAD_FWD, v, "F", m, scope_chunk=True, deps=prev,
                             alloc=self.fwd_alloc(Kind.HEAD_FWD))]
        elif self._rank[v + 1] != stage:
            # the send buffer stays on this stage until the receive has it (released by the receive)
            self.send_f[(v, mk)] = self.add(Kind.FWD_SEND, v, "F", m, scope_chunk=True, deps=prev,
                                            nbytes=self.cost.p2p_bytes(), duration=self.dur(Kind.FWD_SEND),
                                            alloc=Mem(device=self.cost.p2p_bytes()))
        self.fwd_out[(v, mk)] = prev

    def _layer(self, v: int, m: int, L: int, moe: bool, fwd: bool, entry: list[str | None],
               cross: dict[Kind, list[str]], after: dict | None = None) -> dict[Kind, str]:
        """The forward (``fwd``) or backward tasks of layer ``L`` (an MoE layer: ``moe``) of
        micro-batch ``m`` on vstage ``v``, by kind, from the step table's rows in table order
        ([Note: step table] in k3sched/steptable.py): entry rows wait for ``entry``, every row for
        its planned edges and then ``cross[kind]`` (edges to other slices); ``after[kind]`` is
        called with the task's id once it is added."""
        ids: dict[Kind, str] = {}
        for r, within in self._rows[(moe, fwd)]:
            deps = list(entry) if r.entry else []
            deps += [ids[k] for k in within]
            deps += cross.get(r.kind, ())
            key = ("row", r.kind)  # per cost model (slice): the row's bytes and duration
            got = self._dur.get(key)
            if got is None:
                got = self._dur[key] = (self._bytes(r.alloc), self._bytes(r.free),
                                        (self.a2a_bytes(r.kind), self.dur(r.kind)) if r.lane == "ep" else (0, None))
            alloc, free, (nbytes, duration) = got
            if r.kind is Kind.ATTN_DX:
                mem = self._attn_dx_mem(r.kind, free, alloc)
            else:
                mem = {"alloc": Mem(device=alloc), "free": Mem(device=free)}
            ids[r.kind] = tid = self.add(r.kind, v, r.unit, m, layer=L, deps=deps, nbytes=nbytes, duration=duration,
                                         **mem)
            if r.unit == "W":
                self.wgrads.setdefault((m, L), []).append(tid)
            if after and r.kind in after:
                after[r.kind](tid)
        return ids

    def _bytes(self, terms) -> int:
        """Bytes of memory-effect terms of the step table (the slice's, in a sliced plan)."""
        out = 0
        for what, k in terms:
            if what == "w":
                out += self._saved[k][0]
            elif what == "x":
                out += self._saved[k][1]
            elif what == "dx":
                out += self._grad_out[k]
            elif what == "expert_in":  # dispatch recompute rebuilds it: [Note: step table]
                cost, model = self.cost, self.cfg.model
                out += (cost.T * model.top_k * model.hidden * cost.b if self.cfg.schedule.dispatch_recompute
                        else self._saved[Kind.DISPATCH_FWD][0])
            else:
                raise ValueError(f"step table: unknown memory term {what!r} of {k.value}")
        return out

    def _offload_pending(self, v: int, m: int, L: int, attn: str) -> None:
        """Slice j-1's activation set of layer ``L`` leaves once slice j's attention ``attn`` has
        read its keys / values."""
        pending = self._pending_offload.pop((self._rank[v], m, L), None)
        if pending is not None:
            with self._at_slice(self._j - 1):
                self._offload_set(v, m, L, pending[0], pending[1] + [attn])

    def _buffer(self, stage: int, m: int, L: int) -> str:
        return f"s{stage}/mb{m}{'' if self._j is None else f'q{self._j}'}/L{L}/act"

    def _offload_set(self, v: int, m: int, L: int, nbytes: int, deps: list[str]) -> None:
        """The offload copy of activation set (stage of ``v``, ``m``, ``L``) of the slice being built
        when the offload choice takes it: to the host, or to a peer stage's memory."""
        stage = self._rank[v]
        key = self.set_key(stage, m, L)
        buf = self._buffer(stage, m, L)
        if self.off.is_local(key):
            self.add(Kind.ACT_OFFLOAD, v, "F", m, layer=L, deps=deps, nbytes=nbytes,
                     alloc=Mem(host=nbytes), free=Mem(device=nbytes), buffer=buf)
        elif key in self.off.remote:
            peer = self.off.remote[key]
            off = self.add(Kind.ACT_ROFFLOAD, v, "F", m, layer=L, deps=deps, nbytes=nbytes,
                           alloc=Mem(peer=nbytes), free=Mem(device=nbytes), peer_stage=peer, buffer=buf)
            # the peer's side: receive and keep it (its memory is accounted via peer_stage)
            self.add(Kind.ACT_RSTORE, v, "F", m, layer=L, deps=[off], nbytes=nbytes, at_stage=peer,
                     peer_stage=stage, buffer=buf, duration=self.cfg.hardware.launch_us + self.cost.pp_link[1])

    def _onload(self, v: int, m: int, L: int, trigger: str | None) -> str | None:
        stage = self._rank[v]
        key = self.set_key(stage, m, L)
        if key not in self.off:
            return None
        nbytes = self.offload_sets[key]
        buf = self._buffer(stage, m, L)
        if self.off.is_local(key):
            off = format_task_id(stage, Kind.ACT_OFFLOAD, mb=m, layer=L, slice=self._j)
            t = self.add(Kind.ACT_ONLOAD, v, "I", m, layer=L, deps=[off], nbytes=nbytes,
                         alloc=Mem(device=nbytes), free=Mem(host=nbytes), buffer=buf)
        else:
            peer = self.off.remote[key]
            store = format_task_id(peer, Kind.ACT_RSTORE, mb=m, layer=L, slice=self._j)
            serve = self.add(Kind.ACT_RSERVE, v, "I", m, layer=L, deps=[store], nbytes=nbytes, at_stage=peer,
                             peer_stage=stage, buffer=buf, duration=self.cfg.hardware.launch_us + self.cost.pp_link[1])
            if trigger:
                self.start_deps[serve] = [trigger]
            return self.add(Kind.ACT_RONLOAD, v, "I", m, layer=L, deps=[serve], nbytes=nbytes,
                            alloc=Mem(device=nbytes), free=Mem(peer=nbytes), peer_stage=peer, buffer=buf)
        if trigger:
            self.start_deps[t] = [trigger]
        return t

    def _backward(self, v: int, m: int) -> None:
        model, cost = self.cfg.model, self.cost
        stage = self._rank[v]
        sv, dx_alloc = self._saved, self._grad_out.__getitem__
        mk = self._mk(m)
        if self.is_last(v):
            head_fwd = self.fwd_out[(v, mk)][0]
            up = self.add(Kind.HEAD_DX, v, "I", m, scope_chunk=True, deps=[head_fwd],
                          free=Mem(device=sv[Kind.HEAD_FWD][1]), alloc=Mem(device=dx_alloc(Kind.HEAD_DX)))
            self.add(Kind.HEAD_DW, v, "W", m, scope_chunk=True, deps=[up],
                     free=Mem(device=sv[Kind.HEAD_FWD][0] + dx_alloc(Kind.HEAD_DX)))
        elif self._rank[v + 1] != stage:
            up = self.add(Kind.BWD_RECV, v, "I", m, scope_chunk=True, deps=[self.send_b[(v + 1, mk)]],
                          release=(self._rank[v + 1], self.cost.p2p_bytes()),
                          duration=self.cost.duration_us(Kind.BWD_RECV, stages=(self._rank[v + 1], stage)))
        else:
            up = self.bwd_out[(v + 1, mk)]
        layers = self.layers[v]
        # Prefetch trigger: onload of layer L starts when the backward of layer L+2 starts; the
        # top two layers of the chunk are released with the chunk's upstream gradient's producer.
        first_bwd: dict[int, str] = {}
        for i, L in enumerate(reversed(layers)):
            trig_layer = layers[len(layers) - 1 - i + 2] if i >= 2 else None
            trigger = first_bwd.get(trig_layer) if trig_layer is not None else up
            onl = self._onload(v, m, L, trigger)
            moe = model.is_moe(L)
            ids = self._layer(v, m, L, moe, False, [up, onl], {Kind.ATTN_DX: self._kv_grad_dep(stage, m, L)})
            first_bwd[L] = ids[self._first_bwd[moe]]
            up = ids[LAYER_IN_GRAD]
        if self.is_first(v):
            self.add(Kind.EMBED_DW, v, "W", m, scope_chunk=True, deps=[up])
        elif self._rank[v - 1] != stage:
            self.send_b[(v, mk)] = self.add(Kind.BWD_SEND, v, "I", m, scope_chunk=True, deps=[up],
                                            nbytes=cost.p2p_bytes(), duration=self.dur(Kind.BWD_SEND),
                                            alloc=Mem(device=cost.p2p_bytes()))
        self.bwd_out[(v, mk)] = up

    def _kv_grad_dep(self, stage: int, m: int, L: int) -> list[str]:
        """Slice j's attention backward waits for slice j+1's, which adds the key / value gradients
        of the prefix into slice j's ([Note: sequence slices] in k3sched/seqslice.py)."""
        j = self._j
        if j is None or j == self.S - 1:
            return []
        return [format_task_id(stage, Kind.ATTN_DX, mb=m, layer=L, slice=j + 1)]

    def _attn_dx_mem(self, kind: Kind, saved: int, grad_out: int) -> dict[str, Mem]:
        """Memory effect of an attention dX: it frees the forward's saved activations and keeps its
        output gradient; in a sliced plan it also frees the prefix key / value gradients slice j+1
        handed it and hands the (shorter) prefix's on to slice j-1."""
        j = self._j
        if j is None:
            return {"free": Mem(device=saved), "alloc": Mem(device=grad_out)}
        got = self._kv_grad_bytes(j + 1) if j + 1 < self.S else 0
        return {"free": Mem(device=saved + got), "alloc": Mem(device=grad_out + self._kv_grad_bytes(j))}

    def grad_rs(self, v: int, mb: int | None, layer: int, deps: list[str]) -> list[str]:
        """DP reduce-scatter of one layer's gradient in buckets of ``schedule.grad_bucket_mb``
        (as DDP buckets do), so a P2P transfer on the collective lane waits at most one bucket."""
        total_us, nbytes = self.cost.grad_rs_us(layer)
        nb = max(1, math.ceil(nbytes / (self.cfg.schedule.grad_bucket_mb * 2**20)))
        hw = self.cfg.hardware
        out = []
        for b in range(nb):
            out.append(self.add(Kind.GRAD_RS, v, "W", mb, layer=layer, deps=deps, nbytes=nbytes // nb, bucket=b,
                                duration=hw.launch_us + total_us / nb))
        return out

    def gradients(self, step: int = 0) -> None:
        """Gradient reduction and the optimizer of the plan's step ``step`` (one step but for
        pipedream-2bw)."""
        cfg, cost = self.cfg, self.cost
        mbs_of = self.mbs_of if self.steps == 1 else (lambda v: self.mbs_of(v, step))
        last_mb = None if self.steps == 1 else (step + 1) * cfg.parallel.microbatches - 1
        p = cfg.parallel
        reduce = p.ep * p.dp > 1
        optim_deps: dict[int, list[str]] = {}
        stepped: dict[int, int] = {}  # parameters of the stage its per-layer optimizers step
        for v in range(self.nv):
            stage = self._rank[v]
            for L in self.layers[v]:
                if cfg.schedule.grad_offload:
                    # K3 Pipeline ZeRO-2: the gradient of a chunk accumulates in one of two device
                    # buffers while consecutive backward slots use that chunk; it is flushed (DP
                    # reduce-scatter, then onload-add-offload of the host fp32 shard) once per group
                    # of `pp` micro-batches, the span over which interleaved 1F1B stays on a chunk.
                    dense, expert = cost.layer_params(L)
                    shard = 4 * (dense // (p.ep * p.dp) + expert // p.dp)
                    group = max(1, p.pp)
                    prev_off = prev_add = None
                    mine_mbs = self.mbs_of(v)
                    for g0 in range(0, len(mine_mbs), group):
                        mbs = mine_mbs[g0:g0 + group]
                        m = mbs[-1]
                        deps = [w for mm in mbs for w in self.wgrads[(mm, L)]]
                        if reduce:
                            # the reduce-scatter writes the layer's region of the chunk's device
                            # buffer, which the previous group's gshard.add must have read
                            deps = self.grad_rs(v, m, L, deps + [prev_add])
                        on = self.add(Kind.GSHARD_ONLOAD, v, "W", m, layer=L, nbytes=shard,
                                      alloc=Mem(device=shard), deps=[prev_off])
                        self.start_deps[on] = [self.wgrads[(m, L)][0]]
                        add = prev_add = self.add(Kind.GSHARD_ADD, v, "W", m, layer=L, deps=deps + [on], nbytes=shard)
                        prev_off = last = self.add(Kind.GSHARD_OFFLOAD, v, "W", m, layer=L, deps=[add],
                                                   nbytes=shard, free=Mem(device=shard))
                    optim_deps.setdefault(stage, []).append(last)
                else:
                    deps = [w for m in mbs_of(v) for w in self.wgrads[(m, L)]]
                    if reduce:
                        deps = self.grad_rs(v, last_mb, L, deps)
                    if cfg.schedule.layer_optim:  # [Note: per-layer optimizer]
                        n = sum(cost.layer_params(L))
                        deps = [self.add(Kind.OPTIM, v, "W", None, layer=L, deps=deps, duration=cost.optim_us(n, 0))]
                        stepped[stage] = stepped.get(stage, 0) + n
                    optim_deps.setdefault(stage, []).extend(deps)
        for s in range(p.pp):
            deps = optim_deps.get(s, [])
            mine = [u for u in range(self.nv) if self._rank[u] == s]
            for u in mine:
                if self.is_first(u):
                    deps = deps + [format_task_id(s, Kind.EMBED_DW, mb=m, chunk=self._chunk[u]) for m in mbs_of(u)]
                if self.is_last(u):
                    deps = deps + [format_task_id(s, Kind.HEAD_DW, mb=m, chunk=self._chunk[u]) for m in mbs_of(u)]
            tid = self.optim_id(s, step)
            params, nonlayer = cost.stage_params([L for u in mine for L in self.layers[u]],
                                                 embed=any(self.is_first(u) for u in mine),
                                                 head=any(self.is_last(u) for u in mine))
            if self.bidir:
                deps = [self.mirror(s, deps, params)]
            self.tasks[tid] = Task(tid, Kind.OPTIM, LANE_OF[Kind.OPTIM], s, 0, None, None,
                                   duration_us=self.dur(Kind.OPTIM) + cost.optim_us(params - stepped.get(s, 0), nonlayer),
                                   deps=deps)
            # pipedream-2bw: step 0's optimizer ranks with the stage's last backward of the step
            self.unit[tid] = (self.nv, "W", 1 << 30) if last_mb is None or step == self.steps - 1 else (mine[0], "W", last_mb)
            self.topo[tid] = len(self.topo)

    # [Note: per-layer optimizer]
    # With ``schedule.layer_optim`` each layer's AdamW step is a task of its own,
    # ``s{s}/v{c}/L{l}/optim.run`` (the per-step, per-layer scope of [Note: task id grammar]), after
    # the layer's reduction (or its last WGrad without DP), costed as AdamW over the layer's
    # parameters (``CostModel.optim_us(n, 0)``). The gradient reduction of a stage ends after its
    # last backward (every micro-batch's WGrad of a layer precedes the layer's reduction), so on the
    # plain path the whole stage's AdamW waits for the last bucket of the last layer; per layer, all
    # but the last layer's step run beside the reductions after theirs. The stage's own optim.run
    # keeps the embedding, head and final norm (their all-reduce over the optim group included) and
    # waits for the per-layer steps, so it stays the stage's last task. AdamW is elementwise per
    # parameter, so the steps compute what one step over all of them does (the runtime steps one
    # param group per layer, runtime/stage/optimizer.py; tests/unit/k3sched/test_layer_optim.py compares).
    # The optimizer tail after a stage's last backward is then the last layer's step alone.

    def mirror(self, s: int, deps: list[str], params: int) -> str:
        """Chimera / DualPipe: ``s{s}/step/grad.mirror``, the all-reduce of stage ``s``'s gradients
        (its stages of both model copies) with stage pp-1-s, which holds the other copy of the same
        two model stages ([Note: replica gradient reduction] in runtime/stage/gradients.py). It
        waits for every gradient of the stage (``deps``, the optimizer's) and for the stage's P2P
        sends, so the collective lane has posted them before it blocks in the reduction."""
        pp = self.cfg.parallel.pp
        sends = [t for (v, _), t in [*self.send_f.items(), *self.send_b.items()] if self._rank[v] == s]
        nbytes = params * self.cost.b
        tid = format_task_id(s, Kind.GRAD_MIRROR)
        self.tasks[tid] = Task(tid, Kind.GRAD_MIRROR, LANE_OF[Kind.GRAD_MIRROR], s, 0, None, None,
                               duration_us=self.cost.duration_us(Kind.GRAD_MIRROR, nbytes=nbytes, stages=(s, pp - 1 - s)),
                               deps=deps + sends, bytes=nbytes)
        self.unit[tid] = (self.nv, "W", 1 << 30)
        self.topo[tid] = len(self.topo)
        return tid


def build_step(cfg: Config, offload: OffloadChoice | None = None) -> StepGraph:
    """The task DAG of one training step over all PP stages (see [Note: layer task graph])."""
    g = _Builder(cfg, offload).build()
    if cfg.parallel.seq_chunks > 1:
        _slice_deps(g, cfg.parallel.seq_chunks)
    return g


def _slice_deps(g: StepGraph, chunks: int) -> None:
    """In a sliced plan, a dependency on a whole micro-batch's task that exists only per slice
    (the optimizer's on embed.dw and head.dw) is one on each of its slices' tasks."""
    for t in g.tasks.values():
        if all(d in g.tasks for d in t.deps):
            continue
        deps: list[str] = []
        for d in t.deps:
            if d in g.tasks:
                deps.append(d)
                continue
            key = parse_task_id(d)
            ids = [str(replace(key, slice=j)) for j in range(chunks)]
            assert key.mb is not None and key.slice is None and all(i in g.tasks for i in ids), d
            deps.extend(ids)
        t.deps = deps
