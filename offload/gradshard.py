"""Sharded gradients with host accumulation (Kimi K3 Pipeline ZeRO-2), executed by planned tasks.

[Note: sharded gradients]
With ``schedule.grad_offload`` the plan flushes each layer's gradient once per group of
micro-batches (``grad.rs`` buckets on the collective lane, then ``gshard.onload`` ->
``gshard.add`` -> ``gshard.offload``; ``optim.run`` after the last offload of every layer).
:class:`GradShards` executes those tasks:

- Accumulators. The dW tasks (and router.bwd, which applies the router's dW) of micro-batch ``mb``
  and layer ``L`` run inside :meth:`GradShards.accumulating`: the layer's ``param.grad`` is
  swapped to the accumulator of the flush group of ``mb`` (the group ends at the ``mb`` of the
  layer's next ``gshard.add``), so the dW of the next group never writes what a reduce-scatter
  is reading, and what each flush sums is fixed by the plan (runs are bitwise repeatable
  whatever the lanes' timing).
- Layout. A layer's parameters (sorted by name) are split into the plan's buckets as the plain
  path splits them; each bucket has a *dense* segment (non-expert params, reduced over the
  ``dense`` group: ep*dp ranks) and an *expert* segment (over the ``expert`` group: dp ranks).
  A segment of ``n`` elements over ``G`` ranks is padded to ``G*k`` (``k = ceil(n/G)``) and the
  rank of group index ``i`` owns elements ``[i*k, (i+1)*k)``. The layer's shard is the
  concatenation of its segments' parts (``shard_numel``); without a group (size 1) the part is
  the whole segment.
- Device double buffer. Two flat fp32 buffers; chunk ``c`` uses buffer ``c % 2``, its layers'
  shards laid out one after the other (``region``). ``grad.rs`` packs the group accumulator of a
  bucket segment into a device-pool temporary and ``reduce_scatter`` s it into the segment's part
  of the layer region; ``gshard.add`` reads the region. Before writing a range of a buffer, a
  ``grad.rs`` waits for the fence of every earlier use of an overlapping range (signalled by the
  ``gshard.add`` that consumed it; a thread event, plus a CUDA event on GPU): a buffer is never
  reused while the accumulation of what it holds is pending. The plan also orders each layer's
  ``grad.rs`` after its previous ``gshard.add`` (k3sched.graph), so the wait normally finds the
  fence signalled; ``stats.fence_waits`` counts the times it had to block.
- Host shards. One fp32 gradient shard per layer in host memory (pinned on GPU), zero at the
  start of a step. ``gshard.onload`` copies it into a device-pool buffer, ``gshard.add`` adds the
  reduced region into it (compute lane), ``gshard.offload`` copies it back and returns the device
  buffer to the pool (the H2D/D2H copies run on the offload_local lane; ``copy_delay_s`` /
  ``K3SCHED_OFFLOAD_DELAY_S`` slows them, as for activations).
- Optimizer. fp32 master shards (host) of the same layout, AdamW over them with the host
  gradient shards (optimizer state on the host); ``optim.run`` then all-gathers every updated
  segment into the parameters over the compute lane's own communicators (``optim`` for dense
  segments: same members and order as ``dense``; ``optim_expert`` for expert segments: as
  ``expert``). Without a reduction (dp = ep = 1) the plan has no grad.rs: ``gshard.add`` packs
  the accumulator itself and the shard is the whole layer.
- Race detector ([Note: race detector hooks] in moe/handoff.py): each task reports the
  accumulators, buffer ranges and shards it reads and writes; a ``grad.rs`` that waits on the
  fence of an earlier use reports that ordering (``sync_from`` the ``gshard.add`` that signalled it).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe import handoff

from .pool import BufferPool

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Segment:
    """One bucket's dense or expert parameters of one layer and this rank's part of them."""

    layer: int
    bucket: int
    expert: bool
    params: list[nn.Parameter]
    numel: int  # unpadded elements
    world: int  # ranks of the reducing group (1: no group)
    index: int  # this rank's index in it
    k: int  # elements this rank owns (numel padded to world * k)
    offset: int = 0  # in the layer's shard


@dataclass
class GradShardStats:
    fence_waits: int = 0  # grad.rs that blocked on an earlier use of its buffer range
    flushes: int = 0  # gshard.add executed
    reduce_scatters: int = 0
    buffers: int = 0  # device chunk buffers allocated (at most 2)


@dataclass
class _Use:
    slot: int
    start: int
    end: int
    done: threading.Event = field(default_factory=threading.Event)
    cuda: object = None  # CUDA event recorded after the consuming add (GPU)
    task: str | None = None  # the task that signalled it (race detector)


class GradShards:
    """Executes grad.rs / gshard.onload / gshard.add / gshard.offload and the sharded AdamW step
    (see [Note: sharded gradients]).

    ``layers``: layer index -> its module (this rank's layers); ``chunk_of``: layer -> local chunk;
    ``is_expert``: parameter name -> whether it is an expert (EP-sharded) parameter; ``device_pool``:
    the activation manager's device pool (temporaries); ``rs_groups``: (dense, expert) groups of
    the collective lane; ``ag_groups``: (optim, optim_expert) groups of the compute lane (None: one
    rank)."""

    def __init__(self, layers: Mapping[int, nn.Module], chunk_of: Mapping[int, int], *,
                 is_expert: Callable[[str], bool], device: torch.device, device_pool: BufferPool,
                 rs_groups: tuple = (None, None), ag_groups: tuple = (None, None), lr: float = 1e-3,
                 weight_decay: float = 0.01, copy_delay_s: float = 0.0, fence_timeout_s: float = 300.0
                 ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = device_pool
        self.is_expert = is_expert
        self.rs_groups, self.ag_groups = rs_groups, ag_groups
        self.lr, self.weight_decay = lr, weight_decay
        self.copy_delay_s = copy_delay_s
        self.fence_timeout_s = fence_timeout_s
        self.chunk_of = dict(chunk_of)
        self.named = {L: sorted(m.named_parameters(), key=lambda kv: kv[0]) for L, m in layers.items()}
        self.params = {L: [p for _, p in named] for L, named in self.named.items()}
        self.stats = GradShardStats()
        self._lock = threading.Lock()
        self._acc: dict[tuple[int, int], list[Tensor | None]] = {}  # (flush mb, layer) -> grads
        self._flush_of: dict[tuple[int, int], int] = {}  # (layer, mb) -> the mb ending its group
        self._rs_left: dict[tuple[int, int], int] = {}
        self._nbuckets: dict[int, int] = {}
        self._reduced: set[int] = set()  # layers the plan reduces (grad.rs tasks)
        self._uses: list[_Use] = []
        self._use_of: dict[tuple[int, int], _Use] = {}
        self._onloaded: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (mb, layer) -> (pool buf, view)
        self.bound = False

    # -- plan binding ------------------------------------------------------------------------------
    def bind(self, lanes: Mapping[str, list]) -> None:
        """Read the plan: buckets of each layer's grad.rs and the flush groups (gshard.add mbs);
        build the shard layout, the host shards, the master shards and their AdamW, the buffers."""
        from k3sched.tasks import Kind

        ends: dict[int, list[int]] = {}
        for ts in lanes.values():
            for t in ts:
                if t.kind is Kind.GRAD_RS and t.layer in self.params:
                    self._nbuckets[t.layer] = max(self._nbuckets.get(t.layer, 0), (t.bucket or 0) + 1)
                    self._reduced.add(t.layer)
                elif t.kind is Kind.GSHARD_ADD and t.layer in self.params:
                    ends.setdefault(t.layer, []).append(t.mb)
        missing = sorted(set(self.params) - set(ends))
        if missing:
            raise ValueError(f"plan has no gshard.add task for layer(s) {missing} of this stage")
        for L, ms in ends.items():
            ms = sorted(ms)
            lo = 0
            for m in ms:
                for mb in range(lo, m + 1):
                    self._flush_of[(L, mb)] = m
                lo = m + 1
        self.segments: dict[int, list[Segment]] = {}
        self.shard_numel: dict[int, int] = {}
        for L, named in self.named.items():
            nb = self._nbuckets.get(L, 1)
            size = -(-len(named) // nb)
            segs, off = [], 0
            for b in range(nb):
                bucket = named[b * size:(b + 1) * size]
                for expert in (False, True):
                    ps = [p for n, p in bucket if self.is_expert(n) == expert]
                    if not ps:
                        continue
                    n = sum(p.numel() for p in ps)
                    group = self.rs_groups[int(expert)] if L in self._reduced else None
                    world = dist.get_world_size(group) if group is not None else 1
                    index = dist.get_rank(group) if group is not None else 0
                    k = math.ceil(n / world)
                    segs.append(Segment(L, b, expert, ps, n, world, index, k, off))
                    off += k
            self.segments[L] = segs
            self.shard_numel[L] = off
        # device double buffer: chunk c -> buffer c % 2, its layers one after the other
        self.region: dict[int, tuple[int, int, int]] = {}  # layer -> (slot, start, end)
        need = [0, 0]
        for c in sorted(set(self.chunk_of[L] for L in self.params)):
            slot, off = c % 2, 0
            for L in sorted(L for L in self.params if self.chunk_of[L] == c):
                self.region[L] = (slot, off, off + self.shard_numel[L])
                off += self.shard_numel[L]
            need[slot] = max(need[slot], off)
        self.buffers = [torch.zeros(n, dtype=torch.float32, device=self.device) if n else None for n in need]
        self.stats.buffers = sum(b is not None for b in self.buffers)
        pin = self.cuda
        self.host = {L: torch.zeros(n, dtype=torch.float32, pin_memory=pin) for L, n in self.shard_numel.items()}
        self.master = {L: self._master_shard(L) for L in self.params}
        self.optimizer = torch.optim.AdamW(list(self.master.values()), lr=self.lr, weight_decay=self.weight_decay)
        self.bound = True

    def _master_shard(self, L: int) -> Tensor:
        out = torch.zeros(self.shard_numel[L], dtype=torch.float32, pin_memory=self.cuda)
        with torch.no_grad():
            for s in self.segments[L]:
                flat = self._flat([p.detach() for p in s.params], s.world * s.k, torch.float32)
                out[s.offset:s.offset + s.k].copy_(flat[s.index * s.k:(s.index + 1) * s.k])
        return out

    @staticmethod
    def _flat(ts: list[Tensor | None], n: int, dtype, like: list[Tensor] | None = None, out: Tensor | None = None
              ) -> Tensor:
        """Concatenate ``ts`` (None: zeros shaped like ``like[i]``) into ``n`` elements, zero padded."""
        if out is None:
            out = torch.empty(n, dtype=dtype, device=(ts[0] if ts[0] is not None else like[0]).device)
        off = 0
        for i, t in enumerate(ts):
            m = (like[i] if t is None else t).numel()
            if t is None:
                out[off:off + m].zero_()
            else:
                out[off:off + m].copy_(t.reshape(-1))
            off += m
        out[off:n].zero_()
        return out

    # -- accumulators (compute lane) ---------------------------------------------------------------
    def group_end(self, layer: int, mb: int) -> int:
        return self._flush_of[(layer, mb)]

    @contextmanager
    def accumulating(self, mb: int, layer: int) -> Iterator[None]:
        """Run a task that writes ``param.grad`` of ``layer`` for ``mb`` into its group's accumulator."""
        params = self.params.get(layer)
        if params is None:
            yield
            return
        key = (self._flush_of[(layer, mb)], layer)
        with self._lock:
            acc = self._acc.get(key) or [None] * len(params)
        handoff.cell(self._acc, key, False, f"L{layer} group mb{key[0]} accumulator")
        for p, g in zip(params, acc):
            p.grad = g
        try:
            yield
        finally:
            with self._lock:
                self._acc[key] = [p.grad for p in params]
            handoff.cell(self._acc, key, True, f"L{layer} group mb{key[0]} accumulator")
            for p in params:
                p.grad = None

    def _take(self, key: tuple[int, int]) -> list[Tensor | None]:
        with self._lock:
            acc = self._acc.get(key)
        handoff.cell(self._acc, key, False, f"L{key[1]} group mb{key[0]} accumulator", acc is not None)
        return acc or [None] * len(self.params[key[1]])

    # -- buffer fences -----------------------------------------------------------------------------
    def _claim(self, key: tuple[int, int], start: int, end: int) -> None:
        """Before writing [start, end) of the layer's buffer: wait for earlier overlapping uses."""
        L = key[1]
        slot, r0, r1 = self.region[L]
        with self._lock:
            self._uses = [u for u in self._uses if not u.done.is_set() or (u.cuda is not None and not u.cuda.query())]
            waits = [u for u in self._uses if u.slot == slot and u.start < end and start < u.end
                     and self._use_of.get(key) is not u]
            if key not in self._use_of:
                u = self._use_of[key] = _Use(slot, r0, r1)
                self._uses.append(u)
        blocked = False
        for u in waits:
            if not u.done.is_set():
                blocked = True
                if not u.done.wait(self.fence_timeout_s):
                    raise TimeoutError(f"layer {L}: device gradient buffer {slot} range [{start}, {end}) still "
                                       f"pending after {self.fence_timeout_s:.0f} s")
            if u.cuda is not None:
                torch.cuda.current_stream(self.device).wait_event(u.cuda)
            handoff.sync_from(u.task)
        if blocked:
            with self._lock:
                self.stats.fence_waits += 1

    def _release_region(self, key: tuple[int, int]) -> None:
        with self._lock:
            u = self._use_of.pop(key, None)
        if u is None:
            return
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            u.cuda = ev
        u.task = handoff.current_task()
        u.done.set()

    def _pool_fence(self):
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return None

    def _temp(self, n: int) -> tuple[Tensor, Tensor]:
        raw = self.pool.acquire(4 * max(1, n), torch.float32)
        handoff.fresh(raw, "gradient shard temporary")
        return raw, raw[:n]

    # -- reduce-scatter into the chunk buffer --------------------------------------------------------
    def _consume(self, key: tuple[int, int], bucket: int | None) -> None:
        """Reduce-scatter (or copy) the group accumulator's segments of ``bucket`` (None: all) into
        the layer's buffer region; drop the accumulator after its last bucket."""
        L = key[1]
        slot, r0, _ = self.region[L]
        acc = self._take(key)
        index = {id(p): i for i, p in enumerate(self.params[L])}
        buf = self.buffers[slot]
        for s in self.segments[L]:
            if bucket is not None and s.bucket != bucket:
                continue
            self._claim(key, r0 + s.offset, r0 + s.offset + s.k)
            out = buf[r0 + s.offset:r0 + s.offset + s.k]
            grads = [acc[index[id(p)]] for p in s.params]
            if self.cuda:
                for g in grads:
                    if g is not None:
                        g.record_stream(torch.cuda.current_stream(self.device))
            for g in grads:
                handoff.read(g, f"L{L} group mb{key[0]} accumulated grad")
            raw, flat = self._temp(s.world * s.k)
            self._flat(grads, s.world * s.k, torch.float32, like=s.params, out=flat)
            handoff.write(flat, f"L{L} packed grads")
            handoff.write(out, f"L{L} chunk buffer {slot} region")
            group = self.rs_groups[int(s.expert)]
            if s.world > 1:
                _reduce_scatter(out, flat, group=group)
                with self._lock:
                    self.stats.reduce_scatters += 1
            else:
                out.copy_(flat[:s.k])
            self.pool.release(raw, self._pool_fence())
        with self._lock:
            done = True
            if bucket is not None:
                left = self._rs_left.get(key, self._nbuckets.get(L, 1)) - 1
                done = left <= 0
                if not done:
                    self._rs_left[key] = left
            if done:
                self._rs_left.pop(key, None)
                self._acc.pop(key, None)
        if done:
            handoff.cell(self._acc, key, True, f"L{L} group mb{key[0]} accumulator")

    def grad_rs(self, t) -> None:
        """grad.rs(.bN) of group (t.mb, t.layer) on the collective lane."""
        self._consume((t.mb, t.layer), t.bucket or 0)

    # -- onload / add / offload --------------------------------------------------------------------
    def _delay(self) -> None:
        if self.copy_delay_s > 0:
            time.sleep(self.copy_delay_s)

    def onload(self, t) -> None:
        """gshard.onload: host shard of the layer -> a device-pool buffer (offload_local lane)."""
        L = t.layer
        raw, dev = self._temp(self.shard_numel[L])
        dev.copy_(self.host[L], non_blocking=self.cuda)
        handoff.read(self.host[L], f"L{L} host gradient shard")
        handoff.write(dev, f"L{L} onloaded gradient shard")
        self._delay()
        with self._lock:
            self._onloaded[(t.mb, L)] = (raw, dev)
        handoff.cell(self._onloaded, (t.mb, L), True, f"L{L} onloaded gradient shard (mb{t.mb})")

    def add(self, t) -> None:
        """gshard.add: shard += the group's reduced gradient (compute lane); frees the buffer range."""
        key, L = (t.mb, t.layer), t.layer
        if L not in self._reduced:
            self._consume(key, None)
        slot, r0, r1 = self.region[L]
        with self._lock:
            got = self._onloaded.get(key)
        handoff.cell(self._onloaded, key, False, f"L{L} onloaded gradient shard (mb{t.mb})", got is not None)
        if got is None:
            raise RuntimeError(f"layer {L}: no onloaded gradient shard for micro-batch {t.mb} (gshard.onload not run)")
        _, dev = got
        dev.add_(self.buffers[slot][r0:r1])
        handoff.read(self.buffers[slot][r0:r1], f"L{L} chunk buffer {slot} region")
        handoff.write(dev, f"L{L} onloaded gradient shard")
        self._release_region(key)
        with self._lock:
            self.stats.flushes += 1

    def offload(self, t) -> None:
        """gshard.offload: the accumulated shard back to host memory; device buffer to the pool."""
        key, L = (t.mb, t.layer), t.layer
        with self._lock:
            got = self._onloaded.pop(key, None)
        handoff.cell(self._onloaded, key, False, f"L{L} onloaded gradient shard (mb{t.mb})", got is not None)
        if got is None:
            raise RuntimeError(f"layer {L}: no onloaded gradient shard for micro-batch {t.mb} (gshard.onload not run)")
        handoff.cell(self._onloaded, key, True, f"L{L} onloaded gradient shard (mb{t.mb})")
        raw, dev = got
        self.host[L].copy_(dev, non_blocking=False)
        handoff.read(dev, f"L{L} onloaded gradient shard")
        handoff.write(self.host[L], f"L{L} host gradient shard")
        self.pool.release(raw, self._pool_fence())
        self._delay()

    def handlers(self) -> dict:
        from k3sched.tasks import Kind

        return {Kind.GRAD_RS: self.grad_rs, Kind.GSHARD_ONLOAD: self.onload, Kind.GSHARD_ADD: self.add,
                Kind.GSHARD_OFFLOAD: self.offload}

    # -- optimizer (compute lane) ------------------------------------------------------------------
    def _gather(self, shards: Mapping[int, Tensor], dtype=None) -> dict[int, list[Tensor]]:
        """All-gather each segment of ``shards`` (per layer, shard layout) over the compute lane's
        groups; returns per layer, per segment, the full (unpadded) flat tensor on the device."""
        out: dict[int, list[Tensor]] = {}
        for L in sorted(self.segments):
            res = []
            for s in self.segments[L]:
                dt = dtype or s.params[0].dtype
                part = shards[L][s.offset:s.offset + s.k].to(self.device, dtype=dt)
                if s.world > 1:
                    full = torch.empty(s.world * s.k, dtype=dt, device=self.device)
                    _all_gather(full, part.contiguous(), group=self.ag_groups[int(s.expert)])
                else:
                    full = part
                res.append(full[:s.numel])
            out[L] = res
        return out

    def step(self) -> None:
        """optim.run: AdamW on the host master shards with the host gradient shards, all-gather the
        updated parameters, zero the gradient shards."""
        for L, m in self.master.items():
            m.grad = self.host[L]
            handoff.write(self.host[L], f"L{L} host gradient shard")  # read, then zeroed below
        self.optimizer.step()
        for m in self.master.values():
            m.grad = None
        for h in self.host.values():
            h.zero_()
        full = self._gather(self.master)
        with torch.no_grad():
            for L, segs in self.segments.items():
                for s, flat in zip(segs, full[L]):
                    off = 0
                    for p in s.params:
                        p.copy_(flat[off:off + p.numel()].view_as(p))
                        off += p.numel()

    def full_grads(self) -> dict[tuple[int, str], Tensor]:
        """The step's accumulated gradients (all-gathered from the host shards; call before
        :meth:`step` on every rank of the stage): (layer, name within the layer) -> tensor."""
        full = self._gather(self.host, torch.float32)
        out = {}
        for L, segs in self.segments.items():
            names = {id(p): n for n, p in self.named[L]}
            for s, flat in zip(segs, full[L]):
                off = 0
                for p in s.params:
                    out[(L, names[id(p)])] = flat[off:off + p.numel()].view_as(p).to(p.dtype).clone()
                    off += p.numel()
        return out

    # -- accounting --------------------------------------------------------------------------------
    def device_tensors(self) -> list[Tensor]:
        """Device buffers (the two chunk buffers) and live group accumulators."""
        out = [b for b in getattr(self, "buffers", []) if b is not None]
        with self._lock:
            for acc in self._acc.values():
                out += [g for g in acc if g is not None]
        return out

    def host_bytes(self) -> int:
        """Host gradient shards, fp32 master shards and their AdamW state."""
        if not self.bound:
            return 0
        n = sum(h.numel() * 4 for h in self.host.values()) + sum(m.numel() * 4 for m in self.master.values())
        for st in self.optimizer.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, Tensor) and v.dim() > 0)
        return n

    def end_step(self) -> None:
        """Every group was flushed (the plan's last gshard.add of each layer ran)."""
        with self._lock:
            left = [k for k, acc in self._acc.items() if any(g is not None for g in acc)]
            self._acc.clear()
            self._rs_left.clear()
        if left:
            raise RuntimeError(f"gradients of (group, layer) {sorted(left)} were never flushed")
