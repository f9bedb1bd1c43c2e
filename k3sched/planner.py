"""Planner: places every task of a step on the five lanes of its stage.

Strategy ``k3`` is an event-driven list scheduler over (stage, lane) resources:

* the pipeline backbone (one list of slots per PP rank, see :mod:`k3sched.schedules`) orders the
  compute lane: tasks of slot k+1 become eligible once every non-WGrad compute task of slot k has
  started; within a slot, ready tasks run in topological order (critical path first);
* WGrad (dW) tasks are *fill* work: the compute lane runs one whenever nothing of the current
  slot is ready (e.g. while an EP all-to-all is in flight), and must run one once it is
  ``schedule.wgrad_lag`` slots overdue;
* communication lanes (ep, collective) run ready tasks by backbone slot, so all-to-alls and P2P
  overlap independent compute of the same stage;
* offload runs as soon as the layer's last forward task ends; onload is released at layer
  granularity just ahead of its backward use (graph ``start_deps``);
* the device memory budget is met by offloading more activation sets (``schedule.offload``
  ``auto``), chosen among those resident at the peak; when even full offload does not fit the
  planner fails with the smallest feasible budget.

Strategy ``serial`` runs one task at a time per stage (all five lanes share one resource) in the
same backbone order, WGrad right after its dX: the no-overlap baseline.

Ties break on (time, priority, topological index), so the same config gives the same plan.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from . import schedules
from .config import GiB, Config
from .cost import CostModel
from .graph import OffloadChoice, StepGraph, build_step
from .simulator import DeadlockError, MemoryTimeline, memory_timeline
from .tasks import LANES, Kind, Task, format_task_id

LANE_INDEX = {lane: i for i, lane in enumerate(LANES)}


class InfeasibleBudget(ValueError):
    """The device memory budget cannot be met; the message gives the smallest feasible budget."""


@dataclass
class Plan:
    cfg: Config
    graph: StepGraph
    strategy: str
    pipeline: str
    lane_orders: dict[tuple[int, str], list[str]]
    memory: dict[tuple[int, str], MemoryTimeline]
    metrics: dict
    backbone: dict[int, list]  # per rank: slots (for display and export)

    @property
    def tasks(self) -> dict[str, Task]:
        return self.graph.tasks


# -- backbone ---------------------------------------------------------------------------------
def backbone(cfg: Config) -> "schedules.Schedule":
    """The pipeline schedule named by ``schedule.pipeline`` for this config."""
    p = cfg.parallel
    extra = cfg.schedule.warmup_extra if cfg.schedule.pipeline == "interleaved-1f1b" else 0
    if cfg.schedule.pipeline in ("dualpipe", "chimera"):
        # two copies of the model's pp stages, one of each per rank ([Note: dualpipe mapping])
        name = cfg.schedule.pipeline
        if p.vpp != 1:
            raise ValueError(f"parallel.vpp: {name} splits each of its two model copies into pp stages and "
                             f"places one stage of each copy per rank; set vpp 1, got {p.vpp}")
        return schedules.generate(name, p.pp, 2, p.microbatches)
    return schedules.generate(cfg.schedule.pipeline, p.pp, p.vpp, p.microbatches, warmup_extra=extra)


def _slot_index(ranks: dict[int, list]) -> dict[tuple[int, str, int], int]:
    """(vstage, unit, mb) -> position of its slot on its rank. 'B' covers I and W; a pair both."""
    idx: dict[tuple[int, str, int], int] = {}
    for _, slots in ranks.items():
        for pos, slot in enumerate(slots):
            if slot is None:
                continue
            acts = (slot.fwd, slot.bwd) if hasattr(slot, "fwd") else (slot,)
            for a in acts:
                units = ("I", "W") if a.op == "B" else (a.op,)
                for u in units:
                    idx[(a.vstage, u, a.mb)] = pos
    return idx


# -- list scheduler ---------------------------------------------------------------------------
_P2P = frozenset({Kind.FWD_SEND, Kind.FWD_RECV, Kind.BWD_SEND, Kind.BWD_RECV})
_BACKGROUND = frozenset({Kind.GRAD_RS, Kind.GSHARD_ONLOAD, Kind.GSHARD_OFFLOAD})


@dataclass
class _Prepared:
    """Per-task arrays of a step graph, built once and reused by every scheduling attempt."""

    ids: list[str]
    succ: list[list[int]]
    ssucc: list[list[int]]
    ndeps: list[int]
    nsdeps: list[int]
    stage: list[int]
    lane: list[int]
    slot: list[int]
    wgrad: list[bool]
    main: list[bool]
    p2p: list[bool]
    background: list[bool]
    dur: list[float]
    feeds_main: list[bool]  # a non-compute task whose end a main compute task of its stage waits on


_MAX_SLOT = 1 << 30


def _prepare(g: StepGraph, slots: dict[tuple[int, str, int], int]) -> _Prepared:
    tasks = g.tasks
    ids = list(tasks)  # creation order == topological order
    index = {t: i for i, t in enumerate(ids)}
    n = len(ids)
    succ: list[list[int]] = [[] for _ in range(n)]
    ssucc: list[list[int]] = [[] for _ in range(n)]
    ndeps, nsdeps, stage, lane, slot, wgrad, main, p2p, bg, dur = ([] for _ in range(10))
    for i, tid in enumerate(ids):
        t = tasks[tid]
        v, u, mb = g.unit[tid]
        s = slots.get((v, u, mb))
        if s is None:
            s = _MAX_SLOT if (t.kind is Kind.OPTIM or mb < 0) else slots.get((v, "I", mb), _MAX_SLOT)
        ln = LANE_INDEX[t.lane]
        wg = t.is_wgrad
        stage.append(t.stage)
        lane.append(ln)
        slot.append(s)
        wgrad.append(wg)
        main.append(ln == 0 and not wg and t.kind is not Kind.OPTIM)
        p2p.append(t.kind in _P2P)
        bg.append(t.kind in _BACKGROUND)
        dur.append(t.duration_us)
        for d in t.deps:
            succ[index[d]].append(i)
        ndeps.append(len(t.deps))
        sd = g.start_deps.get(tid, ())
        for d in sd:
            ssucc[index[d]].append(i)
        nsdeps.append(len(sd))
    feeds = [lane[i] != 0 and any(main[j] and stage[j] == stage[i] for j in succ[i]) for i in range(n)]
    return _Prepared(ids, succ, ssucc, ndeps, nsdeps, stage, lane, slot, wgrad, main, p2p, bg, dur, feeds)


def _resources(g: StepGraph, prep: _Prepared, serial: bool) -> tuple[list[int], list[int]]:
    """Resource id of every task and the compute resource of every stage. Communication and copy
    lanes come before compute, so a compute decision at an instant sees the transfers that start at
    that instant (gap-aware WGrad fill); lanes of one shared link are one resource
    ([Note: shared links]); under ``serial`` a stage is one resource."""
    nlanes, nstages = len(LANES), g.cfg.parallel.pp
    share = list(range(nlanes))  # lane -> the lane whose resource it uses
    for group in CostModel(g.cfg).shared_links():
        for lane in group[1:]:
            share[LANE_INDEX[lane]] = LANE_INDEX[group[0]]
    res = [st if serial else ((share[ln] - 1) % nlanes) * nstages + st for st, ln in zip(prep.stage, prep.lane)]
    res_compute = [st if serial else (nlanes - 1) * nstages + st for st in range(nstages)]
    return res, res_compute


def _priority_keys(prep: _Prepared, serial: bool, lag: int) -> list[int]:
    """Ready-queue key of every task: backbone slot first (a WGrad task counts ``lag`` slots later
    and loses ties; a background collective yields to everything on its lane), then index."""
    key = []
    for i in range(len(prep.ids)):
        if prep.background[i] and not serial:
            k = _MAX_SLOT
        elif prep.wgrad[i]:
            k = min(prep.slot[i] + lag, _MAX_SLOT)
        else:
            k = prep.slot[i]
        key.append((2 * k + (1 if prep.wgrad[i] else 0)) * (1 << 22) + i)
    return key


def _lane_orders(g: StepGraph, prep: _Prepared, orders: list[list[int]], start_t: list[float],
                 end_t: list[float]) -> dict[tuple[int, str], list[str]]:
    """Write the start and end times into the graph's tasks; the task ids per (stage, lane) in the
    order they started."""
    tasks, ids = g.tasks, prep.ids
    for i, tid in enumerate(ids):
        t = tasks[tid]
        t.start_us = start_t[i]
        t.end_us = end_t[i]
    lane_orders: dict[tuple[int, str], list[str]] = {(s, lane): [] for s in range(g.cfg.parallel.pp)
                                                      for lane in LANES}
    for order in orders:
        for i in order:
            t = tasks[ids[i]]
            lane_orders[(t.stage, t.lane)].append(t.id)
    return lane_orders


class _SlotGate:
    """Per rank, main tasks of slot s are eligible once all main tasks of the slots before the first
    unfinished one (plus ``lookahead`` slots) have started; a main task past its rank's gate is
    held until the gate opens."""

    def __init__(self, prep: _Prepared, skip: frozenset[int], nstages: int, lookahead: int) -> None:
        self.remaining: list[dict[int, int]] = [defaultdict(int) for _ in range(nstages)]
        for i in range(len(prep.ids)):
            if prep.main[i] and i not in skip:
                self.remaining[prep.stage[i]][prep.slot[i]] += 1
        self.slots = [sorted(r) for r in self.remaining]
        self.pos = [0] * nstages
        self.lookahead = lookahead
        self.held: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(nstages)]
        self.gates = [self._gate(st) for st in range(nstages)]

    def _gate(self, st: int) -> int:
        gs, pos = self.slots[st], self.pos[st] + self.lookahead
        return gs[pos] if pos < len(gs) else _MAX_SLOT

    def first_open(self, st: int) -> int:
        gs = self.slots[st]
        return gs[self.pos[st]] if self.pos[st] < len(gs) else _MAX_SLOT

    def started(self, st: int, slot: int) -> list[int]:
        """A main task of ``slot`` on rank ``st`` started: the held tasks the gate now releases."""
        rem, gs = self.remaining[st], self.slots[st]
        rem[slot] -= 1
        out: list[int] = []
        while self.pos[st] < len(gs) and rem[gs[self.pos[st]]] == 0:
            self.pos[st] += 1
            old, self.gates[st] = self.gates[st], self._gate(st)
            h = self.held[st]
            for s_ in [s_ for s_ in h if old < s_ <= self.gates[st]]:
                out.extend(h.pop(s_))
        return out


def _list_schedule(g: StepGraph, prep: _Prepared, serial: bool, wgrad_lag: int, lookahead: int = 0,
                   skip: frozenset[int] = frozenset()) -> dict[tuple[int, str], list[str]]:
    """Event-driven list scheduling (see module docstring). ``skip``: task indices left out (offload
    tasks not chosen in this attempt); a dependency on a skipped task counts as met."""
    n = len(prep.ids)
    stage_of, slot, succ, ssucc, dur = prep.stage, prep.slot, prep.succ, prep.ssucc, prep.dur
    is_main, is_p2p, is_bg, is_w, feeds = prep.main, prep.p2p, prep.background, prep.wgrad, prep.feeds_main
    nstages = g.cfg.parallel.pp
    res, res_compute = _resources(g, prep, serial)
    lag = 0 if serial else wgrad_lag
    key = _priority_keys(prep, serial, lag)
    npending = [a + b for a, b in zip(prep.ndeps, prep.nsdeps)]
    unstarted = list(prep.ndeps)  # deps not yet started (for the imminent-P2P rule)
    for i in skip:
        npending[i] = 1 << 40  # never becomes ready
        for j in succ[i]:
            npending[j] -= 1
            unstarted[j] -= 1
        for j in ssucc[i]:
            npending[j] -= 1
    gate = _SlotGate(prep, skip, nstages, lookahead)
    gates, held = gate.gates, gate.held
    nres = max(res) + 1 if n else 0
    ready: list[list[tuple[int, int]]] = [[] for _ in range(nres)]
    imminent = [0] * nres  # P2P tasks whose deps have all started but are not yet running
    busy = [False] * nres
    orders: list[list[int]] = [[] for _ in range(nres)]
    events: list[tuple[float, int, int]] = []
    heappush, heappop = heapq.heappush, heapq.heappop
    start_t = [0.0] * n
    end_t = [0.0] * n
    # [Note: gap-aware WGrad fill] A WGrad task fills compute idle time only if the idle gap it fills
    # (until the earliest in-flight transfer that a backbone (main) compute task of the stage waits
    # on ends) is at least as long as the delay it causes past that point (duration <= 2 x gap);
    # else another WGrad that qualifies is taken, or the lane waits. An overdue WGrad (more than
    # `wgrad_lag` slots behind the first unfinished slot) is never held back.
    feeding: list[list[float]] = [[] for _ in range(nstages)]

    def pick_fill(q: list[tuple[int, int]], top: int, t_now: float, st: int) -> int:
        fq = feeding[st]
        while fq and fq[0] <= t_now:
            heappop(fq)
        gap = fq[0] - t_now if fq else float("inf")
        if dur[top] <= 2 * gap or slot[top] + lag < gate.first_open(st):
            heappop(q)
            return top
        best = -1
        for k_, j in q:
            if is_w[j] and dur[j] <= 2 * gap and (best < 0 or k_ < key[best]):
                best = j
        if best >= 0:
            q.remove((key[best], best))
            heapq.heapify(q)
        return best

    def make_ready(i: int) -> None:
        st = stage_of[i]
        if is_main[i] and slot[i] > gates[st]:
            held[st][slot[i]].append(i)
        else:
            heappush(ready[res[i]], (key[i], i))

    # Resources that may be able to start a task now, visited in resource order (a heap plus a flag).
    pend_heap = list(range(nres))
    flagged = [True] * nres

    def wake(r: int) -> None:
        if not flagged[r]:
            flagged[r] = True
            heappush(pend_heap, r)

    seq = 0  # events at one instant pop in start order

    def start(i: int, r: int, now: float) -> None:
        nonlocal seq
        busy[r] = True
        orders[r].append(i)
        heappush(events, (now + dur[i], seq, i))
        seq += 1
        start_t[i] = now
        if feeds[i]:
            heappush(feeding[stage_of[i]], now + dur[i])
        if is_p2p[i]:
            imminent[r] -= 1
        for j in succ[i]:
            unstarted[j] -= 1
            if unstarted[j] == 0 and is_p2p[j]:
                imminent[res[j]] += 1
        for j in ssucc[i]:
            npending[j] -= 1
            if npending[j] == 0:
                make_ready(j)
                wake(res[j])
        if is_main[i]:
            for j in gate.started(stage_of[i], slot[i]):
                heappush(ready[res[j]], (key[j], j))
                wake(res[j])

    for i in range(n):
        if i in skip:
            continue
        if is_p2p[i] and unstarted[i] == 0:
            imminent[res[i]] += 1
        if npending[i] == 0:
            make_ready(i)
    now = 0.0
    started = 0
    while True:
        while pend_heap:
            r = heappop(pend_heap)
            flagged[r] = False
            q = ready[r]
            if busy[r] or not q:
                continue
            i = q[0][1]
            if is_bg[i] and imminent[r] and not serial:
                continue  # a P2P transfer is about to become ready: keep the lane for it
            if is_w[i] and not serial:
                i = pick_fill(q, i, now, stage_of[i])
                if i < 0:
                    continue  # every WGrad would delay the backbone task about to become ready
            else:
                heappop(q)
            start(i, r, now)
            started += 1
        if not events:
            break
        now, _, i = heappop(events)
        batch = [i]
        while events and events[0][0] == now:
            batch.append(heappop(events)[2])
        for i in batch:
            end_t[i] = now
            busy[res[i]] = False
            wake(res[i])
            wake(res_compute[stage_of[i]])  # a fill decision may change now
            for j in succ[i]:
                npending[j] -= 1
                if npending[j] == 0:
                    make_ready(j)
                    wake(res[j])
    if started != n - len(skip):
        stuck = [prep.ids[i] for i in range(n) if i not in skip and not any(i in o for o in orders)][:6]
        raise DeadlockError(f"plan deadlocks: {n - len(skip) - started} tasks never became ready, e.g. "
                            f"{', '.join(stuck)}")
    return _lane_orders(g, prep, orders, start_t, end_t)


# -- metrics ----------------------------------------------------------------------------------
def _merge(iv: np.ndarray) -> np.ndarray:
    """Union of [start, end) intervals (n x 2), sorted."""
    if len(iv) == 0:
        return iv.reshape(0, 2)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    ends = np.maximum.accumulate(iv[:, 1])
    new = np.empty(len(iv), dtype=bool)
    new[0] = True
    new[1:] = iv[1:, 0] > ends[:-1]
    starts = iv[new, 0]
    grp = np.cumsum(new) - 1
    gend = np.zeros(int(grp[-1]) + 1)
    np.maximum.at(gend, grp, ends)
    return np.stack([starts, gend], axis=1)


def _covered(a: np.ndarray, b: np.ndarray) -> float:
    """Length of merged intervals a intersected with merged intervals b."""
    if len(a) == 0 or len(b) == 0:
        return 0.0
    total = 0.0
    j = 0
    for s, e in a:
        while j < len(b) and b[j, 1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k, 0] < e:
            total += min(e, b[k, 1]) - max(s, b[k, 0])
            k += 1
    return total


def path_bounds(g: StepGraph) -> tuple[float, dict[str, float], dict[str, float]]:
    """Critical path with unlimited lanes, and per task its earliest start (head) and the longest
    chain that must follow its end (tail). Start deps count as zero-length start-to-start edges."""
    tasks = g.tasks
    head: dict[str, float] = {}
    for tid, t in tasks.items():  # creation order is topological
        s = 0.0
        for d in t.deps:
            e = head[d] + tasks[d].duration_us
            if e > s:
                s = e
        for d in g.start_deps.get(tid, ()):
            if head[d] > s:
                s = head[d]
        head[tid] = s
    tail: dict[str, float] = dict.fromkeys(tasks, 0.0)
    for tid in reversed(list(tasks)):
        t = tasks[tid]
        after = tail[tid] + t.duration_us  # chain from this task's start to the sink
        for d in t.deps:
            if after > tail[d]:
                tail[d] = after
    cp = max((head[t] + tasks[t].duration_us + tail[t] for t in tasks), default=0.0)
    return cp, head, tail


def _jackson_preemptive(jobs: list[tuple[float, float, float]]) -> float:
    """Makespan of the optimal preemptive one-machine schedule of jobs (release, duration, tail):
    run the released job with the longest tail (Jackson's rule). It is a lower bound on any
    non-preemptive schedule of the same jobs on that machine."""
    jobs = sorted(jobs)
    ready: list[tuple[float, float, int]] = []  # (-tail, remaining, index)
    t, i, best, n = 0.0, 0, 0.0, len(jobs)
    while i < n or ready:
        if not ready and t < jobs[i][0]:
            t = jobs[i][0]
        while i < n and jobs[i][0] <= t:
            heapq.heappush(ready, (-jobs[i][2], jobs[i][1], i))
            i += 1
        negq, rem, j = heapq.heappop(ready)
        nxt = jobs[i][0] if i < n else float("inf")
        run = min(rem, nxt - t)
        t += run
        if rem - run > 1e-12:
            heapq.heappush(ready, (negq, rem - run, j))
        else:
            best = max(best, t - negq)
    return best


def lower_bound_us(g: StepGraph, paths: tuple | None = None) -> tuple[float, float, float]:
    """(bound, critical path, max lane busy). ``paths``: ``path_bounds(g)`` if known. Each task gets its earliest start (head) and the
    chain that must follow it (tail) from the DAG; each (stage, lane) runs one task at a time, so
    the optimal preemptive schedule of its tasks with those heads and tails (Jackson's rule) bounds
    the step from below; so does the critical path."""
    cp, head, tail = paths if paths is not None else path_bounds(g)
    jobs: dict[tuple[int, str], list[tuple[float, float, float]]] = defaultdict(list)
    for tid, t in g.tasks.items():
        jobs[(t.stage, t.lane)].append((head[tid], t.duration_us, tail[tid]))
    busy = max((sum(j[1] for j in js) for js in jobs.values()), default=0.0)
    bound = max([cp] + [_jackson_preemptive(js) for js in jobs.values()])
    return bound, cp, busy


def compute_metrics(g: StepGraph, memory: dict[tuple[int, str], MemoryTimeline]) -> dict:
    pp = g.cfg.parallel.pp
    tasks = list(g.tasks.values())
    step = max((t.end_us for t in tasks), default=0.0)
    busy = np.zeros((pp, len(LANES)))
    iv: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for t in tasks:
        busy[t.stage, LANE_INDEX[t.lane]] += t.duration_us
        if t.duration_us > 0:
            iv[(t.stage, t.lane)].append((t.start_us, t.end_us))
    from .bound import memory_lower_bound_us

    paths = path_bounds(g)
    lb, cp, lb_lanes = lower_bound_us(g, paths)
    mlb = memory_lower_bound_us(g, lb=lb, paths=paths)
    bubble, exposed, exposed_us = [], [], []
    for s in range(pp):
        bubble.append({lane: round(float(1.0 - busy[s, i] / step), 6) if step else 0.0
                       for i, lane in enumerate(LANES)})
        comp = _merge(np.array(iv[(s, "compute")], dtype=float).reshape(-1, 2))
        per = {}
        for lane in ("ep", "collective"):
            m = _merge(np.array(iv[(s, lane)], dtype=float).reshape(-1, 2))
            length = float((m[:, 1] - m[:, 0]).sum()) if len(m) else 0.0
            per[lane] = round(float(length - _covered(m, comp)), 3)
        both = _merge(np.array(iv[(s, "ep")] + iv[(s, "collective")], dtype=float).reshape(-1, 2))
        comm_len = float((both[:, 1] - both[:, 0]).sum()) if len(both) else 0.0
        exp = comm_len - _covered(both, comp)
        exposed_us.append(per)
        exposed.append(round(float(exp / step), 6) if step else 0.0)
    peaks = {sp: [0] * pp for sp in ("device", "host", "peer")}
    for (s, sp), tl in memory.items():
        if sp in peaks:
            peaks[sp][s] = int(tl.peak)
    ep_exposed = sum(e["ep"] for e in exposed_us)
    return {
        "step_time_us": round(step, 3),
        "lower_bound_us": round(lb, 3),
        "memory_lower_bound_us": round(mlb, 3),
        "critical_path_us": round(cp, 3),
        "max_lane_busy_us": round(lb_lanes, 3),
        "bubble_ratio": bubble,
        "exposed_comm_ratio": exposed,
        "exposed_comm_us": exposed_us,
        "exposed_ep_ratio": round(ep_exposed / (pp * step), 6) if step else 0.0,
        "peak_device_bytes": peaks["device"],
        "peak_host_bytes": peaks["host"],
        "peak_peer_bytes": peaks["peer"],
        "num_tasks": len(tasks),
    }


def _device_memory(g: StepGraph, tasks: list[Task]) -> dict[tuple[int, str], MemoryTimeline]:
    base = {(s, "device"): d for s, d in enumerate(g.static_device)}
    base.update({(s, "host"): h for s, h in enumerate(g.static_host)})
    return memory_timeline(tasks, base)


def _device_peak_per_stage(mem: dict[tuple[int, str], MemoryTimeline], pp: int) -> list[int]:
    """Device bytes including what a stage holds for its peers (remote offload)."""
    out = []
    for s in range(pp):
        dev = mem.get((s, "device"))
        peer = mem.get((s, "peer"))
        if peer is None or not len(peer.times_us):
            out.append(dev.peak if dev else 0)
            continue
        times = np.concatenate([dev.times_us, peer.times_us])
        deltas_dev = np.concatenate([np.diff(np.concatenate([[dev.base], dev.bytes])), np.zeros(len(peer.times_us))])
        deltas_peer = np.concatenate([np.zeros(len(dev.times_us)), np.diff(np.concatenate([[peer.base], peer.bytes]))])
        order = np.argsort(times, kind="stable")
        total = dev.base + np.cumsum((deltas_dev + deltas_peer)[order])
        out.append(int(total.max()))
    return out


# -- offload selection ------------------------------------------------------------------------
def _select_offload(g: StepGraph, mem: MemoryTimeline, stage: int, chosen: OffloadChoice, target: int
                    ) -> list[tuple[int, int, int]]:
    """Activation sets of ``stage`` to offload so that its device curve, minus each chosen set's
    bytes over the span it is resident ([its attn.fwd end, its attn.dx start)), stays under
    ``target``. Greedy at the running peak, taking the set needed latest (longest away)."""
    if not len(mem.times_us):
        return []
    times = mem.times_us
    curve = mem.bytes.astype(np.int64).copy()
    spans = []
    for (s, m, L), nbytes in g.offload_sets.items():
        if s != stage or (s, m, L) in chosen or nbytes == 0:
            continue
        a = g.tasks[format_task_id(s, Kind.ATTN_FWD, mb=m, layer=L)].end_us
        b = g.tasks[format_task_id(s, Kind.ATTN_DX, mb=m, layer=L)].start_us
        spans.append((np.searchsorted(times, a, "left"), np.searchsorted(times, b, "left"), b, nbytes, (s, m, L)))
    picked: list[tuple[int, int, int]] = []
    used = [False] * len(spans)
    while int(curve.max()) > target:
        at = int(np.argmax(curve))
        best = -1
        for j, (lo, hi, b, _, _) in enumerate(spans):
            if not used[j] and lo <= at < hi and (best < 0 or b > spans[best][2]):
                best = j
        if best < 0:
            break
        used[best] = True
        lo, hi, _, nbytes, key = spans[best]
        curve[lo:hi] -= nbytes
        picked.append(key)
    return picked


def _remote_peer(cfg: Config, stage: int, peaks: list[int], budget: int) -> int | None:
    """Kimi K3: offload an early stage's activations to a later stage with headroom."""
    best = None
    for peer in range(cfg.parallel.pp - 1, stage, -1):
        head = budget - peaks[peer]
        if head > 0 and (best is None or head > budget - peaks[best]):
            best = peer
    return best


@dataclass
class _Attempt:
    graph: StepGraph
    lane_orders: dict[tuple[int, str], list[str]]
    memory: dict[tuple[int, str], MemoryTimeline]
    peaks: list[int]
    skip: frozenset[int] = frozenset()  # offload pairs of the base graph not chosen (fast search)


class _Search:
    """Runs scheduling attempts for growing offload choices. Without remote offload the graph is
    built once with an offload/onload pair for every activation set, and pairs not chosen are
    skipped; with remote offload each attempt rebuilds the graph (the lane of a set changes)."""

    def __init__(self, cfg: Config, slots: dict, serial: bool):
        self.cfg, self.slots, self.serial = cfg, slots, serial
        self.cost = CostModel(cfg)
        self.fast = not cfg.schedule.remote_offload and cfg.schedule.offload != "remote"
        offload = cfg.schedule.offload != "none"
        first = build_step(cfg, OffloadChoice(everything=offload and self.fast))
        self.all_sets = {k for k, b in first.offload_sets.items() if b} if offload else set()
        if self.fast:
            self.base = first
            self.prep = _prepare(self.base, slots)
            idx = {tid: i for i, tid in enumerate(self.prep.ids)}
            self.pair = {k: (idx[format_task_id(k[0], Kind.ACT_OFFLOAD, mb=k[1], layer=k[2])],
                             idx[format_task_id(k[0], Kind.ACT_ONLOAD, mb=k[1], layer=k[2])]) for k in self.all_sets}

    def run(self, chosen: OffloadChoice, lookahead: int, wgrad_lag: int) -> _Attempt:
        """One list schedule with the offload pairs of ``chosen``, at the given look-ahead and
        WGrad lag (the graph does not depend on them, so one search serves every memory level)."""
        la = 0 if self.serial else lookahead
        if self.fast:
            g, prep = self.base, self.prep
            skip = frozenset(i for k, pr in self.pair.items() if k not in chosen.local for i in pr)
        else:
            g = build_step(self.cfg, chosen)
            prep, skip = _prepare(g, self.slots), frozenset()
        lane_orders = _list_schedule(g, prep, self.serial, wgrad_lag, la, skip)
        if not self.serial and self.cost.comm_cpu_ns_per_byte():
            for _ in range(2):  # [Note: CPU cost of communication]: a fixed point in two rounds
                busy = replace(prep, dur=_cpu_contended(g, prep, skip, self.cost))
                lane_orders = _list_schedule(g, busy, self.serial, wgrad_lag, la, skip)
            for tid, d in zip(busy.ids, busy.dur):
                g.tasks[tid].duration_us = d
        keep = [g.tasks[prep.ids[i]] for i in range(len(prep.ids)) if i not in skip]
        mem = _device_memory(g, keep)
        return _Attempt(g, lane_orders, mem, _device_peak_per_stage(mem, self.cfg.parallel.pp), skip)

    def finish(self, att: _Attempt) -> StepGraph:
        """The attempt's graph with skipped offload pairs removed. Only once: the base graph is
        changed in place, so the search cannot run again afterwards."""
        if not self.fast or not att.skip:
            return att.graph
        g, prep = att.graph, self.prep
        gone = {prep.ids[i] for i in att.skip}
        for i in att.skip:
            for j in prep.succ[i]:
                t = g.tasks[prep.ids[j]]
                t.deps = [d for d in t.deps if d not in gone]
        for tid in gone:
            del g.tasks[tid]
            g.unit.pop(tid, None)
            g.topo.pop(tid, None)
            g.start_deps.pop(tid, None)
        return g


def _cpu_contended(g: StepGraph, prep: _Prepared, skip: frozenset[int], cost: CostModel) -> list[float]:
    """[Note: CPU cost of communication] On the CPU runner a transfer costs the rank's cores too:
    gloo's threads and the kernel's TCP path spend ``hardware.comm_cpu_ns_per_byte`` per byte a rank
    sends or receives (``k3sched probe`` measures it), and an EP task's host-side work (routing
    bookkeeping, permutes: its ``overhead_us``) runs on the same core. A compute task that overlaps a transfer
    shares its core with that work, so it takes longer by the CPU time the overlapping transfers
    spend during it (each transfer's CPU spread evenly over its planned span). Returns the
    durations of ``prep`` with compute tasks stretched by the overlaps of the last schedule (the
    tasks' start_us / end_us); the caller schedules again with them."""
    ns = cost.comm_cpu_ns_per_byte()
    dur = list(prep.dur)
    tasks, ids = g.tasks, prep.ids
    by_stage: dict[int, tuple[list[int], list[tuple[float, float, float]]]] = defaultdict(lambda: ([], []))
    for i, tid in enumerate(ids):
        if i in skip:
            continue
        t = tasks[tid]
        comp, comm = by_stage[t.stage]
        if t.lane == "compute":
            comp.append(i)
        elif t.end_us > t.start_us:
            moved, host_us = cost.comm_cpu_load(t.kind, t.bytes)
            cpu = moved * ns / 1e3 + host_us
            if cpu:
                comm.append((t.start_us, t.end_us, min(1.0, cpu / (t.end_us - t.start_us))))
    for comp, comm in by_stage.values():
        if not comm:
            continue
        ms = np.array([c[0] for c in comm])
        me = np.array([c[1] for c in comm])
        rate = np.array([c[2] for c in comm])
        for i in comp:
            t = tasks[ids[i]]
            ov = np.clip(np.minimum(me, t.end_us) - np.maximum(ms, t.start_us), 0.0, None)
            dur[i] = prep.dur[i] + float(ov @ rate)
    return dur


BISECTION_TASKS = 60_000  # tasks the infeasible-budget bisection may plan in all (about 3 s here)


def _bisection_plans(cfg: Config) -> int:
    """Bisection plans of :func:`_infeasible_message`: 5 for small configs, fewer as plans grow
    (tiny-cpu: 5; K2-like, 38k tasks: 1), by task count."""
    from .limits import count_tasks

    return max(0, min(5, BISECTION_TASKS // max(1, count_tasks(cfg).total)))


@dataclass
class _Outcome:
    """What meeting one budget at one memory level gave: the last attempt, its offload choice,
    the smallest peak per stage seen on the way and the peaks before anything was offloaded."""
    att: _Attempt
    chosen: OffloadChoice
    best_peak: list[int]
    first_peaks: list[int]
    budget: int

    @property
    def over(self) -> list[int]:
        return [s for s, p in enumerate(self.att.peaks) if p > self.budget]


def _meet_budget(search: _Search, budget: int, level: tuple[int, int]) -> _Outcome:
    """Offload activation sets (policy ``auto``/``remote``; ``all`` offloads every set, ``none``
    nothing) until every stage's device peak fits ``budget``, at the memory level ``level``
    (look-ahead, WGrad lag). Stops when the peaks fit, when offloading more no longer lowers them
    (three attempts without 1% progress), or after 64 attempts."""
    cfg = search.cfg
    policy, pp = cfg.schedule.offload, cfg.parallel.pp
    chosen = OffloadChoice(local=set(search.all_sets) if policy == "all" else set())
    best_peak: list[int] | None = None
    first_peaks: list[int] | None = None
    best_excess, stalled = None, 0
    for _ in range(64):
        att = search.run(chosen, *level)
        peaks = list(att.peaks)
        if first_peaks is None:
            first_peaks = list(peaks)
        best_peak = peaks if best_peak is None else [min(a, b) for a, b in zip(best_peak, peaks)]
        over = [s for s in range(pp) if peaks[s] > budget]
        if not over or policy not in ("auto", "remote"):
            break
        excess = sum(peaks[s] - budget for s in over)
        stalled = 0 if best_excess is None or excess < 0.99 * best_excess else stalled + 1
        best_excess = excess if best_excess is None else min(best_excess, excess)
        if stalled >= 3:  # offloading more no longer lowers the peaks (copies cannot keep up)
            break
        progressed = False
        for s in over:
            target = int(budget * 0.98)
            for key in _select_offload(att.graph, att.memory[(s, "device")], s, chosen, target):
                peer = _remote_peer(cfg, s, peaks, budget) if cfg.schedule.remote_offload else None
                nbytes = att.graph.offload_sets[key]
                if policy == "remote" and s + 1 < pp:  # forced placement: the next stage holds it
                    chosen.remote[key] = s + 1
                    peaks[s + 1] += nbytes
                elif peer is not None and nbytes < budget - peaks[peer]:
                    chosen.remote[key] = peer
                    peaks[peer] += nbytes
                else:
                    chosen.local.add(key)
                progressed = True
        if not progressed:
            break
    return _Outcome(att, chosen, best_peak, first_peaks, budget)


def _memory_levels(cfg: Config, strategy: str) -> list[tuple[int, int]]:
    """[Note: memory levels] The (look-ahead, WGrad lag) pairs the planner may use to meet a
    budget, configured first. Deferring WGrad and running ahead both hold memory, so under
    ``auto``/``remote`` offload the k3 strategy may trade that overlap for memory, a step at a time:
    halve the WGrad lag down to none, then drop the look-ahead too. The last level is the leanest."""
    sc = cfg.schedule
    levels = [(sc.lookahead, sc.wgrad_lag)]
    if sc.offload in ("auto", "remote") and strategy == "k3":
        la, lag = levels[0]
        while la or lag:
            la, lag = (la if lag else 0), lag // 2
            levels.append((la, lag))
    return levels


def _infeasible_message(cfg: Config, search: _Search, level: tuple[int, int], out: _Outcome,
                        best_peak: list[int]) -> str:
    """One line: which stage misses the budget and the smallest budget that plans.

    Every budget tried here is planned at the leanest memory level ``level`` with the same search
    (the step graph is built once): a budget that plans there also plans through :func:`plan`,
    which falls back to that level. The smallest peak seen while searching is a first candidate;
    it is confirmed by planning with it (raised while it does not plan), then a bisection between
    the failing budget and the confirmed one narrows it (to 1 MiB or 1%, at most
    :func:`_bisection_plans` more plans: a count fixed by the config, not a wall-clock limit, so
    the message is the same on a loaded machine). The value printed is a budget that was planned."""
    budget, peaks, policy = cfg.budget_bytes, out.att.peaks, cfg.schedule.offload
    s = max(range(len(peaks)), key=lambda i: peaks[i] - budget)
    ceil_gib = lambda b: math.ceil(b / GiB * 1000) / 1000  # noqa: E731 - printed with 3 decimals
    head = (f"schedule.device_memory_budget: {budget / GiB:.3f} GiB is infeasible: stage {s} peaks at "
            f"{peaks[s] / GiB:.3f} GiB with offload '{policy}'")

    def plans(gib: float) -> tuple[bool, int]:
        o = _meet_budget(search, int(gib * GiB), level)
        return not o.over, max(o.best_peak)

    hi, need = None, max(best_peak)
    for _ in range(3):
        cand = ceil_gib(need)
        ok, seen = plans(cand)
        if ok:
            hi = cand
            break
        need = max(int(cand * GiB * 1.25), seen)
    if hi is None:
        return f"{head}; no budget up to {need / GiB:.3f} GiB plans"
    lo = budget / GiB  # known not to plan
    for _ in range(_bisection_plans(cfg)):
        if hi - lo <= max(0.001, 0.01 * hi):
            break
        mid = ceil_gib((lo + hi) / 2 * GiB)
        if mid >= hi:
            break
        ok, _ = plans(mid)
        lo, hi = (lo, mid) if ok else (mid, hi)
    return f"{head}; the smallest feasible budget is {hi:.3f} GiB"


def plan(cfg: Config, strategy: str | None = None, schedule: "schedules.Schedule | None" = None) -> Plan:
    """Plan one training step on the backbone ``schedule`` (default: ``schedule.pipeline``).
    Raises InfeasibleBudget, DeadlockError or ConfigError."""
    from .limits import check_limits  # cheap up-front refusals (too many tasks, budget below a bound)

    check_limits(cfg)
    was_enabled = gc.isenabled()
    gc.disable()  # tens of thousands of small objects, no cycles: the cyclic GC only costs time
    try:
        return _plan(cfg, strategy, schedule)
    finally:
        if was_enabled:
            gc.enable()


def _plan(cfg: Config, strategy: str | None, schedule: "schedules.Schedule | None", confirm: bool = True) -> Plan:
    """:func:`plan` without the up-front limits; ``confirm=False`` skips the smallest-budget search
    of an infeasible budget (the error then carries the smallest peak seen)."""
    strategy = strategy or cfg.schedule.strategy
    if strategy not in ("k3", "serial"):
        raise ValueError(f"strategy: must be k3 or serial; got {strategy!r}")
    sched = schedule if schedule is not None else backbone(cfg)
    ranks = sched.ranks
    search = _Search(cfg, _slot_index(ranks), strategy == "serial")
    budget = cfg.budget_bytes
    policy = cfg.schedule.offload
    levels = _memory_levels(cfg, strategy)
    out, level = _meet_budget(search, budget, levels[0]), levels[0]
    best_peak = out.best_peak
    if out.over and len(levels) > 1:
        # [Note: memory levels] The leanest level decides feasibility (one search, not one per
        # level); only when it plans are the levels between tried, least lean first.
        lean = _meet_budget(search, budget, levels[-1])
        best_peak = [min(a, b) for a, b in zip(best_peak, lean.best_peak)]
        if lean.over:
            out = lean
        else:
            out, level = lean, levels[-1]
            for lv in levels[1:-1]:
                o = _meet_budget(search, budget, lv)
                if not o.over:
                    out, level = o, lv
                    break
            if level == levels[-1] and len(levels) > 2:  # the levels between ran on the same graph
                out.att = search.run(out.chosen, *level)
    if out.over:
        if not confirm:
            raise InfeasibleBudget("infeasible", max(best_peak))
        raise InfeasibleBudget(_infeasible_message(cfg, search, levels[-1], out, best_peak))
    att, chosen = out.att, out.chosen
    if level != levels[0]:
        cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(
            update={"lookahead": level[0], "wgrad_lag": level[1]})})
    g = search.finish(att)
    metrics = compute_metrics(g, att.memory)
    metrics["peak_device_bytes"] = att.peaks
    metrics["offloaded_sets"] = {"local": len(chosen.local), "remote": len(chosen.remote),
                                 "total": len(search.all_sets)}
    metrics["budget_bytes"] = budget
    # per-stage peak before the planner offloaded anything (policy auto; None otherwise)
    metrics["peak_device_bytes_before_offload"] = out.first_peaks if policy in ("auto", "remote") else None
    if level != levels[0]:
        metrics["memory_lean"] = {"lookahead": level[0], "wgrad_lag": level[1]}
    return Plan(cfg, g, strategy, sched.name, att.lane_orders, att.memory, metrics, ranks)
