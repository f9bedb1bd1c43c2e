"""Lower bounds on the step time (critical path, one task at a time per lane, memory-aware), and
where a plan's gap to them goes.

[Note: memory-aware lower bound]
``lower_bound_us`` ignores memory: every stage may run all of its forwards before its
first backward. Under a device budget a stage cannot: every forward compute task allocates its
saved activations at its start, and nothing that stage runs before its first backward frees
activation memory except activation offload (local or remote), whose lanes move at most
``rate`` bytes per µs. For stage r let

* ``h0`` = earliest start (DAG head) of any of its compute tasks, ``hB`` = earliest head of any
  of its backward (I or W) compute tasks: before ``hB`` its compute lane can only run forwards;
* ``H`` = budget - static device bytes of the stage (weights, gradients, optimizer state);
* ``O`` = bytes the stage's offload lanes can move in ``[h0, hB]`` (0 when offload is off).

The forward tasks that start in ``[h0, hB]`` have allocated their saved bytes at their start, at
most ``H + O`` of which can be on the device at ``hB`` or have left it, and each contributes at
most ``min(duration, hB - head)`` of work to the window. So the forward work X in the window is at
most the optimum of the fractional knapsack (the LP relaxation: value = that work, weight = its
allocation, capacity ``H + O``), solved greedily by allocation per µs, and at most ``hB - h0``.
The compute lane is therefore idle for at least ``(hB - h0) - X_max`` inside ``[h0, hB]``; all of
its work lies in ``[h0, T]`` and the last task is followed by at least the smallest tail of the
stage's compute tasks, so ``T >= h0 + busy + idle + min_tail``.

Round trips (offload off): a micro-batch holds all A bytes it allocates on stage r (its forward
tasks there, send buffers aside) from the start of the last of them, a, until the end of the
first task of its backward there that frees device bytes, f, which allocates its own output at its
start; that *core* [start(a), start(f)] lasts at least the longest DAG path from a's start to f's
start within the micro-batch. Where K+1 cores overlap they all overlap at the earliest of their
ends start(f), when the stage holds (K+1) A + alloc(f): so at most K = (budget - static -
alloc(f)) // A overlap, the cores split into K chains of disjoint intervals (interval graphs are
perfect) and one chain holds ceil(M/K) of them: ``T >= head(a) + ceil(M/K) core + dur(f) +
tail(f)`` (minima over the candidates for f: the freeing tasks no other freeing task precedes).
The bound is the largest of all these over stages and ``lower_bound_us``. Every step in the argument drops constraints (EP, P2P and
send-buffer allocations, the shared copy links, host capacity), so it stays a lower bound on any
schedule that meets the budget; recompute and FP8 storage enter through the saved bytes the cost
model gives each forward task. ``tests/unit/k3sched/test_bound.py`` checks it against CP-SAT optima with the
memory budget modeled (``exact.solve_exact(budget_bytes=...)``).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import TYPE_CHECKING

from .cost import CostModel
from .graph import StepGraph
from .tasks import P2P_KINDS, Kind

if TYPE_CHECKING:  # pragma: no cover
    from .planner import Plan


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


def _offload_rate(g: StepGraph) -> float:
    """Bytes per µs the activation offload lanes of one stage can move at most (0: offload off)."""
    cfg = g.cfg
    s = cfg.schedule
    if s.offload == "none" or not g.offload_sets:
        return 0.0
    cost = CostModel(cfg)
    big = max(g.offload_sets.values())
    if big <= 0:
        return 0.0
    rate = big / max(cost.duration_us(Kind.ACT_OFFLOAD, nbytes=big), 1e-9)
    if s.remote_offload or s.offload == "remote":
        rate += big / max(cost.duration_us(Kind.ACT_ROFFLOAD, nbytes=big), 1e-9)
    return rate


def stage_memory_bounds(g: StepGraph, budget_bytes: int | None = None, paths: tuple | None = None) -> list[dict]:
    """Per stage the quantities of [Note: memory-aware lower bound] and the stage's bound ``t_us``.
    ``paths``: ``path_bounds(g)`` when the caller has it."""
    cfg = g.cfg
    budget = cfg.budget_bytes if budget_bytes is None else budget_bytes
    _, head, tail = paths if paths is not None else path_bounds(g)
    rate = _offload_rate(g)
    by: dict[int, list] = defaultdict(list)
    for tid, t in g.tasks.items():
        if t.lane == "compute":
            by[t.stage].append(t)
    out = []
    for s in range(cfg.parallel.pp):
        ts = by.get(s, [])
        if not ts:
            out.append({"stage": s, "t_us": 0.0, "warmup_idle_us": 0.0, "max_forward_us": 0.0})
            continue
        h0 = min(head[t.id] for t in ts)
        back = [head[t.id] for t in ts if g.unit[t.id][1] in ("I", "W")]
        hB = min(back) if back else h0
        busy = sum(t.duration_us for t in ts)
        min_tail = min(tail[t.id] for t in ts)
        fwd = [t for t in ts if g.unit[t.id][1] == "F" and head[t.id] < hB]
        avail = sum(min(t.duration_us, hB - head[t.id]) for t in fwd)
        room = max(0, budget - g.static_device[s])
        cap = room + rate * max(0.0, hB - h0)
        # fractional knapsack (the LP relaxation): most forward work whose allocations fit in cap
        x_mem = 0.0
        for t in sorted(fwd, key=lambda t: t.alloc.device / max(min(t.duration_us, hB - head[t.id]), 1e-12)):
            value = min(t.duration_us, hB - head[t.id])
            if t.alloc.device <= cap:
                cap -= t.alloc.device
                x_mem += value
            else:
                x_mem += value * cap / t.alloc.device
                break
        x_max = min(avail, x_mem, hB - h0)
        idle = max(0.0, (hB - h0) - x_max)
        out.append({"stage": s, "t_us": h0 + busy + idle + min_tail, "first_start_us": h0,
                    "first_backward_us": hB, "busy_us": busy, "warmup_idle_us": idle,
                    "max_forward_us": x_max, "memory_limited": x_mem < min(avail, hB - h0)})
    return out


def _core_bounds(g: StepGraph, budget: int, head: dict, tail: dict) -> list[float]:
    """Per stage the round-trip bound of [Note: memory-aware lower bound] (offload off only)."""
    tasks = g.tasks
    pp = g.cfg.parallel.pp
    by_mb: dict[int, list[str]] = defaultdict(list)
    for tid, t in tasks.items():
        if t.mb is not None and t.mb >= 0:
            by_mb[t.mb].append(tid)
    succ: dict[str, list[str]] = defaultdict(list)
    for tid, t in tasks.items():
        for d in t.deps:
            succ[d].append(tid)
    out = [0.0] * pp
    groups: dict[int, list[int]] = defaultdict(list)  # route start vstage -> its micro-batches
    for m in sorted(by_mb):
        groups[g.unit[by_mb[m][0]][0]].append(m)
    per_stage: dict[int, list[tuple[float, float, float, int, int, int]]] = defaultdict(list)
    for same in groups.values():
        m = same[0]  # micro-batches of one route have the same tasks, durations and allocations
        ids = by_mb[m]
        for s in range(pp):
            allocs = [tid for tid in ids if tasks[tid].stage == s and g.unit[tid][1] == "F"
                      and tasks[tid].alloc.device > 0 and tasks[tid].kind is not Kind.FWD_SEND]
            frees = [tid for tid in ids if tasks[tid].stage == s and g.unit[tid][1] != "F" and tasks[tid].free.device > 0]
            if not allocs or not frees:
                continue
            a = max(allocs, key=lambda tid: head[tid])
            dist = {a: 0.0}  # longest path from a's start, within this micro-batch's tasks
            for tid in ids[ids.index(a):]:
                if tid not in dist:
                    continue
                e = dist[tid] + tasks[tid].duration_us
                for j in succ[tid]:
                    if tasks[j].mb == m and dist.get(j, -1.0) < e:
                        dist[j] = e
            # the first freeing task is one that no other freeing task of the stage precedes
            fset, after = set(frees), set()
            for tid in ids:
                if any(d in after or d in fset for d in tasks[tid].deps):
                    after.add(tid)
            firsts = [f for f in frees if f not in after and f in dist]
            if firsts:
                per_stage[s].append((min(dist[f] for f in firsts), head[a],
                                     min(tasks[f].duration_us + tail[f] for f in firsts),
                                     sum(tasks[t].alloc.device for t in allocs), len(same),
                                     min(tasks[f].alloc.device for f in firsts)))
    for s, items in per_stage.items():
        room = max(0, budget - g.static_device[s])
        length = min(it[0] for it in items)
        nbytes = min(it[3] for it in items)
        count = sum(it[4] for it in items)
        k = max(1, (room - min(it[5] for it in items)) // nbytes) if nbytes else count
        rounds = -(-count // k)
        out[s] = min(it[1] for it in items) + rounds * length + min(it[2] for it in items)
    return out


def memory_lower_bound_us(g: StepGraph, budget_bytes: int | None = None, lb: float | None = None,
                          paths: tuple | None = None) -> float:
    """Lower bound on the step time of any schedule of ``g`` that keeps every stage's device
    memory within ``budget_bytes`` (default: the config's budget); see
    [Note: memory-aware lower bound]. Never below ``lower_bound_us`` (``lb`` when given)."""
    if lb is None:
        lb = lower_bound_us(g)[0]
    stages = stage_memory_bounds(g, budget_bytes, paths)
    best = max([lb] + [st["t_us"] for st in stages])
    if _offload_rate(g) == 0.0:
        _, head, tail = paths if paths is not None else path_bounds(g)
        budget = g.cfg.budget_bytes if budget_bytes is None else budget_bytes
        best = max([best] + _core_bounds(g, budget, head, tail))
    return best


# -- where the gap goes ------------------------------------------------------------------------
_OFFLOAD = {Kind.ACT_OFFLOAD, Kind.ACT_ONLOAD, Kind.ACT_ROFFLOAD, Kind.ACT_RONLOAD, Kind.ACT_RSERVE,
            Kind.ACT_RSTORE}
CAUSES = ("warmup_cooldown", "p2p", "exposed_ep", "exposed_collective", "wgrad_placement", "offload",
          "pipeline", "other")


def _cause(plan: "Plan", tid: str, t0: float) -> str:
    """Why compute task ``tid`` (started at the end of an idle gap starting at ``t0``) waited:
    the latest-ending dependency, followed through P2P chains."""
    tasks = plan.tasks
    t = tasks[tid]
    deps = [tasks[d] for d in t.deps]
    deps += [tasks[d] for d in plan.graph.start_deps.get(tid, ()) if d in tasks]
    if not deps:
        return "other"
    d = max(deps, key=lambda x: x.end_us)
    if d.end_us <= t0 + 1e-9:
        return "other"  # ready before the gap: held by the backbone order or the memory gate
    if d.kind in P2P_KINDS:
        # a receive is exposed P2P if the transfer itself (not the producer upstream) ended late
        send = max((tasks[x] for x in d.deps), key=lambda x: x.end_us, default=None)
        if send is not None and send.kind in P2P_KINDS:
            prod = max((tasks[x] for x in send.deps), key=lambda x: x.end_us, default=None)
            if prod is not None and prod.end_us >= t0:
                return "pipeline"
        return "p2p"
    if d.lane == "ep":
        return "exposed_ep"
    if d.lane == "collective":
        return "exposed_collective"
    if d.kind in _OFFLOAD:
        return "offload"
    if d.stage != t.stage:
        return "pipeline"
    return "other"


def gap_report(plan: "Plan") -> dict:
    """Per stage, the compute lane's idle time split by cause: ``warmup_cooldown`` (before the
    stage's first and after its last compute task), ``p2p`` / ``exposed_ep`` /
    ``exposed_collective`` / ``offload`` (the next compute task waited on that transfer),
    ``pipeline`` (it waited for another stage's compute), ``wgrad_placement`` (a WGrad task was
    ready during the idle time and ran later), ``other``. With the step time, both bounds and the
    per-stage memory bound's warm-up idle."""
    g, tasks = plan.graph, plan.tasks
    step = plan.metrics.step_time_us
    membound = stage_memory_bounds(g)
    stages = []
    for s in range(plan.cfg.parallel.pp):
        order = [tasks[t] for t in plan.lane_orders.get((s, "compute"), []) if tasks[t].duration_us > 0]
        order.sort(key=lambda t: t.start_us)
        row = dict.fromkeys(CAUSES, 0.0)
        busy = sum(t.duration_us for t in order)
        if order:
            row["warmup_cooldown"] = order[0].start_us + (step - max(t.end_us for t in order))
            ws = [t for t in order if t.is_wgrad]
            end = order[0].end_us
            for t in order[1:]:
                if t.start_us > end + 1e-9:
                    gap0, gap1 = end, t.start_us
                    # WGrad ready in the gap (all deps done by its start) that ran later
                    ready_w = any(w.start_us >= gap1 - 1e-9 and
                                  max((tasks[d].end_us for d in w.deps), default=0.0) <= gap0 + 1e-9 for w in ws)
                    row["wgrad_placement" if ready_w else _cause(plan, t.id, gap0)] += gap1 - gap0
                end = max(end, t.end_us)
        stages.append({"stage": s, "busy_us": round(busy, 3), "idle_us": round(step - busy, 3),
                       **{k: round(v, 3) for k, v in row.items()},
                       "memory_warmup_idle_us": round(membound[s]["warmup_idle_us"], 3)})
    return {"step_time_us": step, "lower_bound_us": plan.metrics.lower_bound_us,
            "memory_lower_bound_us": plan.metrics.memory_lower_bound_us, "stages": stages}


def format_gap_report(plan: "Plan") -> str:
    """``gap_report`` as text lines (one per stage, ms and % of the step), for ``k3sched plan``."""
    rep = gap_report(plan)
    step = rep["step_time_us"] or 1.0
    mlb = rep["memory_lower_bound_us"]
    lines = [f"gap to the bound: step {step / 1e3:.3f} ms, lower bound {rep['lower_bound_us'] / 1e3:.3f} ms"
             + (f", memory-aware bound {mlb / 1e3:.3f} ms ({step / mlb:.3f}x)" if mlb else ""),
             "compute idle per stage, % of the step: " + ", ".join(CAUSES)]
    for st in rep["stages"]:
        cells = " ".join(f"{max(0.0, 100 * st[c] / step):5.1f}" for c in CAUSES)  # no "-0.0" from rounding
        lines.append(f"  stage {st['stage']:>3}: idle {100 * st['idle_us'] / step:5.1f}% = {cells}")
    return "\n".join(lines)
