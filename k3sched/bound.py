"""Memory-aware lower bound on the step time, and where a plan's gap to it goes.

[Note: memory-aware lower bound]
``planner.lower_bound_us`` ignores memory: every stage may run all of its forwards before its
first backward. Under a device budget a stage cannot: every forward compute task allocates its
saved activations at its start, and nothing that stage runs before its first backward frees
activation memory except activation offload (local or remote), whose lanes move at most
``rate`` bytes per µs. For stage r let

* ``h0`` = earliest start (DAG head) of any of its compute tasks, ``hB`` = earliest head of any
  of its backward (I or W) compute tasks: before ``hB`` its compute lane can only run forwards;
* ``H`` = budget - static device bytes of the stage (weights, gradients, optimizer state);
* ``rho`` = the smallest allocation per µs of compute among its forward tasks that allocate, ``Z``
  the total duration of its forward tasks that allocate nothing;
* ``O`` = bytes the stage's offload lanes can move in ``[h0, hB]`` (0 when offload is off).

Forward work X done in ``[h0, hB]`` has allocated at least ``rho * (X - Z)`` bytes (a task that
straddles ``hB`` allocated its whole share at its start), of which at most ``O`` left the device,
so ``X <= Z + (H + O) / rho`` and also ``X <= `` the forward work that can start before ``hB``.
The compute lane is therefore idle for at least ``(hB - h0) - X_max`` inside ``[h0, hB]``; all of
its work lies in ``[h0, T]`` and the last task is followed by at least the smallest tail of the
stage's compute tasks, so ``T >= h0 + busy + idle + min_tail``. The bound is the largest of these
over stages and ``lower_bound_us``. Every step in the argument drops constraints (EP, P2P and
send-buffer allocations, the shared copy links, host capacity), so it stays a lower bound on any
schedule that meets the budget; recompute and FP8 storage enter through the saved bytes the cost
model gives each forward task. ``tests/test_bound.py`` checks it against CP-SAT optima with the
memory budget modeled (``exact.solve_exact(budget_bytes=...)``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from .cost import CostModel
from .graph import StepGraph
from .tasks import Kind

if TYPE_CHECKING:  # pragma: no cover
    from .planner import Plan


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
    ``paths``: ``planner.path_bounds(g)`` when the caller has it."""
    from .planner import path_bounds

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
        zero = sum(t.duration_us for t in fwd if t.alloc.device <= 0)
        rhos = [t.alloc.device / t.duration_us for t in fwd if t.alloc.device > 0 and t.duration_us > 0]
        room = max(0, budget - g.static_device[s])
        moved = rate * max(0.0, hB - h0)
        x_mem = zero + (room + moved) / min(rhos) if rhos else float("inf")
        x_max = min(avail, x_mem, hB - h0)
        idle = max(0.0, (hB - h0) - x_max)
        out.append({"stage": s, "t_us": h0 + busy + idle + min_tail, "first_start_us": h0,
                    "first_backward_us": hB, "busy_us": busy, "warmup_idle_us": idle,
                    "max_forward_us": x_max, "memory_limited": x_mem < min(avail, hB - h0)})
    return out


def memory_lower_bound_us(g: StepGraph, budget_bytes: int | None = None, lb: float | None = None,
                          paths: tuple | None = None) -> float:
    """Lower bound on the step time of any schedule of ``g`` that keeps every stage's device
    memory within ``budget_bytes`` (default: the config's budget); see
    [Note: memory-aware lower bound]. Never below ``planner.lower_bound_us`` (``lb`` when given)."""
    from .planner import lower_bound_us

    if lb is None:
        lb = lower_bound_us(g)[0]
    return max([lb] + [st["t_us"] for st in stage_memory_bounds(g, budget_bytes, paths)])


# -- where the gap goes ------------------------------------------------------------------------
_P2P = {Kind.FWD_SEND, Kind.FWD_RECV, Kind.BWD_SEND, Kind.BWD_RECV}
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
    if d.kind in _P2P:
        # a receive is exposed P2P if the transfer itself (not the producer upstream) ended late
        send = max((tasks[x] for x in d.deps), key=lambda x: x.end_us, default=None)
        if send is not None and send.kind in _P2P:
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
    step = plan.metrics["step_time_us"]
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
    return {"step_time_us": step, "lower_bound_us": plan.metrics["lower_bound_us"],
            "memory_lower_bound_us": plan.metrics.get("memory_lower_bound_us"), "stages": stages}


def format_gap_report(plan: "Plan") -> str:
    """``gap_report`` as text lines (one per stage, ms and % of the step), for ``k3sched plan``."""
    rep = gap_report(plan)
    step = rep["step_time_us"] or 1.0
    mlb = rep["memory_lower_bound_us"]
    lines = [f"gap to the bound: step {step / 1e3:.3f} ms, lower bound {rep['lower_bound_us'] / 1e3:.3f} ms"
             + (f", memory-aware bound {mlb / 1e3:.3f} ms ({step / mlb:.3f}x)" if mlb else ""),
             "compute idle per stage, % of the step: " + ", ".join(CAUSES)]
    for st in rep["stages"]:
        cells = " ".join(f"{100 * st[c] / step:5.1f}" for c in CAUSES)
        lines.append(f"  stage {st['stage']:>3}: idle {100 * st['idle_us'] / step:5.1f}% = {cells}")
    return "\n".join(lines)
