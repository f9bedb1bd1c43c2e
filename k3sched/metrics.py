"""Metrics of a planned step: critical-path and resource lower bounds on the step time, the
per-stage device memory timeline and its peaks, and the plan's summary figures (``metrics`` in
plan.json, docs/formats.md)."""

from __future__ import annotations

import heapq
from collections import defaultdict

import numpy as np

from .graph import StepGraph
from .planfile import PlanMetrics
from .simulator import MemoryTimeline, memory_timeline
from .tasks import LANE_INDEX, LANES, Task

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
    return float(_covered_each(a, b).sum())


def _covered_each(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For each interval of a (any, n x 2), the length of it that merged intervals b cover: the
    length of b below its end minus that below its start (b's cumulative length at x is its
    whole intervals ending by x plus the part of the next one before x)."""
    if len(a) == 0 or len(b) == 0:
        return np.zeros(len(a))
    bs, be = b[:, 0], b[:, 1]
    cum = np.concatenate(([0.0], np.cumsum(be - bs)))
    last = len(b) - 1

    def below(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(be, x, side="right")
        return cum[k] + np.where(k <= last, np.maximum(x - bs[np.minimum(k, last)], 0.0), 0.0)

    return below(a[:, 1]) - below(a[:, 0])



def alone_shares(groups: dict) -> dict:
    """For each group's intervals (key -> n x 2 array, every end after its start), the share of each
    interval that no other group's intervals cover ([Note: compute alone] in k3sched/planner.py:
    the groups are ranks or stages, the intervals their compute)."""
    merged = {g: _merge(iv) for g, iv in groups.items()}
    out = {}
    for g, iv in groups.items():
        others = [v for h, v in merged.items() if h != g and len(v)]
        cov = _covered_each(iv, _merge(np.concatenate(others))) if others else np.zeros(len(iv))
        out[g] = np.maximum(0.0, 1.0 - cov / (iv[:, 1] - iv[:, 0]))
    return out


def path_bounds(g: StepGraph) -> tuple[float, dict[str, float], dict[str, float]]:
    """Critical path with unlimited lanes, and per task its earliest start (head) and the longest
    chain that must follow its end (tail). Start deps count as zero-length start-to-start edges."""
    tasks, start_deps = g.tasks, g.start_deps
    head: dict[str, float] = {}
    fin: dict[str, float] = {}  # head + duration
    for tid, t in tasks.items():  # creation order is topological
        s = 0.0
        for d in t.deps:
            e = fin[d]
            if e > s:
                s = e
        sd = start_deps.get(tid)
        if sd:
            for d in sd:
                if head[d] > s:
                    s = head[d]
        head[tid] = s
        fin[tid] = s + t.duration_us
    tail: dict[str, float] = dict.fromkeys(tasks, 0.0)
    for t in reversed(tasks.values()):
        after = tail[t.id] + t.duration_us  # chain from this task's start to the sink
        for d in t.deps:
            if after > tail[d]:
                tail[d] = after
    cp = max((fin[t] + tail[t] for t in tasks), default=0.0)
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


def compute_metrics(g: StepGraph, memory: dict[tuple[int, str], MemoryTimeline]) -> PlanMetrics:
    """The figures of a planned step that its graph and memory give; the planner adds its own
    (the device peaks with peer memory, the offload and budget fields)."""
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
    # the planner's own figures, not a file: built as they are, unchecked (the check is for files)
    return PlanMetrics.model_construct(
        step_time_us=round(step, 3),
        lower_bound_us=round(lb, 3),
        memory_lower_bound_us=round(mlb, 3),
        critical_path_us=round(cp, 3),
        max_lane_busy_us=round(lb_lanes, 3),
        bubble_ratio=bubble,
        exposed_comm_ratio=exposed,
        exposed_comm_us=exposed_us,
        exposed_ep_ratio=round(ep_exposed / (pp * step), 6) if step else 0.0,
        peak_device_bytes=peaks["device"],
        peak_host_bytes=peaks["host"],
        peak_peer_bytes=peaks["peer"],
        num_tasks=len(tasks),
    )


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
