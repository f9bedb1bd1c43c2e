"""Metrics of a planned step: the per-stage device memory timeline and its peaks, and the plan's
summary figures (``metrics`` in plan.json, docs/formats.md) with the lower bounds of
k3sched/bound.py."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .bound import lower_bound_us, memory_lower_bound_us, path_bounds
from .graph import StepGraph
from .intervals import covered, merge
from .planfile import PlanMetrics
from .simulator import MemoryTimeline, memory_timeline
from .tasks import LANE_INDEX, LANES, Task

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
    paths = path_bounds(g)
    lb, cp, lb_lanes = lower_bound_us(g, paths)
    mlb = memory_lower_bound_us(g, lb=lb, paths=paths)
    bubble, exposed, exposed_us = [], [], []
    for s in range(pp):
        bubble.append({lane: round(float(1.0 - busy[s, i] / step), 6) if step else 0.0
                       for i, lane in enumerate(LANES)})
        comp = merge(np.array(iv[(s, "compute")], dtype=float).reshape(-1, 2))
        per = {}
        for lane in ("ep", "collective"):
            m = merge(np.array(iv[(s, lane)], dtype=float).reshape(-1, 2))
            length = float((m[:, 1] - m[:, 0]).sum()) if len(m) else 0.0
            per[lane] = round(float(length - covered(m, comp)), 3)
        both = merge(np.array(iv[(s, "ep")] + iv[(s, "collective")], dtype=float).reshape(-1, 2))
        comm_len = float((both[:, 1] - both[:, 0]).sum()) if len(both) else 0.0
        exp = comm_len - covered(both, comp)
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


def device_memory(g: StepGraph, tasks: list[Task]) -> dict[tuple[int, str], MemoryTimeline]:
    base = {(s, "device"): d for s, d in enumerate(g.static_device)}
    base.update({(s, "host"): h for s, h in enumerate(g.static_host)})
    return memory_timeline(tasks, base)


def device_peak_per_stage(mem: dict[tuple[int, str], MemoryTimeline], pp: int) -> list[int]:
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
