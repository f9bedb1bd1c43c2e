"""The backbone-constrained (and free, memory-less) exact model: ``solve_exact`` and
``exact_report`` ([Note: backbone-constrained mode], [Note: WGrad deadline], [Note: exact model
scope], [Note: exact memory model], all in k3sched/exact/__init__.py)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Sequence

from ..config import Config
from ..graph import StepGraph, build_step
from .common import (MODES, STATUS, ExactResult, Hint, check_size, exact_config, gap_fields, int_durations,
                     levels_fit, int_lower_bound, one_at_a_time, retime, Starts)

if TYPE_CHECKING:  # pragma: no cover
    from ..planner import Plan


def _slots(g: StepGraph, ranks: dict[int, list]):
    from ..listsched import prepare
    from ..planner import slot_index

    return prepare(g, slot_index(ranks))


def backbone_groups(g: StepGraph, ranks: dict[int, list]) -> dict[int, list[tuple[int, list[str]]]]:
    """Per rank, the main compute tasks (compute lane, not WGrad, not optim) grouped by backbone
    slot: [(slot, task ids)] in slot order, the groups of [Note: backbone-constrained mode]. Slots
    are assigned by ``listsched.prepare`` itself, so the gate is the heuristic's."""
    prep = _slots(g, ranks)
    by: dict[int, dict[int, list[str]]] = {}
    for i, tid in enumerate(prep.ids):
        if prep.main[i]:
            by.setdefault(prep.stage[i], {}).setdefault(prep.slot[i], []).append(tid)
    return {st: [(k, slots[k]) for k in sorted(slots)] for st, slots in sorted(by.items())}


def backbone_pairs(g: StepGraph, ranks: dict[int, list], lookahead: int, wgrad_lag: int | None = None
                   ) -> list[tuple[str, str]]:
    """The backbone constraints as pairs (u, t): ``start(u) <= start(t)``.

    Slot gate: u in group G_q, t in G_p, q = p-1-2*lookahead .. p-1-lookahead (with the gate of
    every group this implies t after all of G_0..G_{p-1-lookahead}, as the heuristic's gate).
    ``wgrad_lag`` (None: WGrad free): a compute-lane WGrad task of slot s starts no later than the
    main tasks of the groups with slot > s + wgrad_lag (the first 1 + lookahead such groups; the
    gate carries it to later ones), the heuristic's overdue-WGrad rule (see
    [Note: WGrad deadline])."""
    groups = backbone_groups(g, ranks)
    pairs: list[tuple[str, str]] = []
    for grps in groups.values():
        for p, (_, grp) in enumerate(grps):
            for q in range(max(0, p - 1 - 2 * lookahead), p - lookahead):
                pairs.extend((u, t) for u in grps[q][1] for t in grp)
    if wgrad_lag is not None:
        prep = _slots(g, ranks)
        for i, tid in enumerate(prep.ids):
            if not prep.wgrad[i] or prep.lane[i] != 0:
                continue
            grps = groups.get(prep.stage[i], [])
            first = next((k for k, (sl, _) in enumerate(grps) if sl > prep.slot[i] + wgrad_lag), None)
            if first is None:
                continue
            for _, grp in grps[first:first + 1 + lookahead]:
                pairs.extend((tid, t) for t in grp)
    return pairs


def gate_violations(pairs: Sequence[tuple[str, str]], starts: dict, tol: float = 0.0) -> list[tuple[str, str]]:
    """The pairs (u, t) of ``backbone_pairs`` that ``starts`` (task -> start, µs or integer)
    violates: t starts before u. Empty: the schedule follows the backbone."""
    return [(u, t) for u, t in pairs if starts[u] > starts[t] + tol]


def plan_lookahead(plan: "Plan") -> int:
    """The slot-gate lookahead ``plan`` was scheduled with (the planner uses 0 for the serial
    strategy and for memory-lean re-plans)."""
    if plan.strategy == "serial" or plan.metrics.memory_lean:
        return 0
    return int(plan.cfg.schedule.lookahead)


def solve_exact(cfg: Config, *, mode: str = "backbone", ranks: dict[int, list] | None = None,
                lookahead: int | None = None, wgrad_lag: int | None = None, time_limit_s: float = 10.0,
                hint_plan: "Hint | Sequence[Hint] | None" = None, lower: "ExactResult | None" = None,
                scale: int = 100, workers: int = 2, seed: int = 0, budget_bytes: int | None = None,
                deterministic_time: float | None = None) -> ExactResult:
    """Minimise the step time of ``cfg``'s task DAG under the lane rules (see module docstring).

    ``mode``: ``backbone`` (compute lane gated by the pipeline schedule, [Note: backbone-constrained
    mode]) or ``free`` ([Note: exact model scope]). ``ranks``: the backbone's slots per rank (default
    ``planner.backbone(cfg).ranks``; pass ``plan.backbone`` for a plan on a custom schedule).
    ``lookahead``: the gate's lookahead (default ``cfg.schedule.lookahead``). ``wgrad_lag``: also
    bound WGrad deferral as the heuristic does ([Note: WGrad deadline]; None: WGrad free).
    ``lower``: a solve of a relaxation of this model (e.g. the free mode of the same config, same
    ``scale``) whose proven bound starts the makespan's lower bound; the planner's
    ``lower_bound_us`` is always used too.
    ``hint_plan``: heuristic plans of the same config and/or earlier ExactResults (same ``scale``);
    each one's lane orders (or integer starts) give a feasible starting solution, the shortest one
    that is feasible for this mode is used and bounds the makespan from above. Raises ValueError for
    more than ``MAX_TASKS`` tasks or an unknown mode.
    ``budget_bytes``: also keep each stage's device memory (static bytes plus every task's
    allocations from its start and frees at its end, as ``simulator.memory_timeline`` counts them)
    within this budget, without offload ([Note: exact memory model]); hints over it are rejected.
    ``deterministic_time``: stop on CP-SAT's deterministic time instead of ``time_limit_s`` (the
    wall clock is then only a safety net at 20x), for results that do not depend on machine load.
    """
    if mode not in MODES:
        raise ValueError(f"exact solve: mode must be one of {', '.join(MODES)}; got {mode!r}")
    t0 = time.perf_counter()
    ecfg = exact_config(cfg)
    g = build_step(ecfg)
    n = len(g.tasks)
    check_size(n)
    tasks = g.tasks
    dur = int_durations(g, scale)
    rounding_us = sum(dur[t] / scale - tasks[t].duration_us for t in tasks)
    pairs: list[tuple[str, str]] = []
    if mode == "backbone":
        if ranks is None:
            from ..planner import backbone

            ranks = backbone(ecfg).ranks
        lookahead = int(cfg.schedule.lookahead if lookahead is None else lookahead)
        pairs = backbone_pairs(g, ranks, lookahead, wgrad_lag)
    else:
        lookahead = wgrad_lag = None
    hints = [hint_plan] if hint_plan is not None and not isinstance(hint_plan, Sequence) else list(hint_plan or [])
    hint, rejected = _best_hint(g, dur, hints, pairs, budget_bytes, scale)
    # lower bounds: the planner's and the longest chain, and a relaxation's proven bound
    head, tail, lb = int_lower_bound(g, dur, scale)
    if lower is not None and lower.scale == scale and math.isfinite(lower.bound_int):
        lb = max(lb, int(math.ceil(lower.bound_int - 1e-6)))
    # upper bound: the hint's makespan, else every task one after another
    horizon = max(hint[t] + dur[t] for t in tasks) if hint is not None else sum(dur.values())
    lb = min(lb, horizon)
    m, start = _backbone_model(cfg.parallel.pp, g, dur, head, tail, pairs, budget_bytes, lb, horizon, hint)
    status, starts_i, bound_i = _solve(m, start, hint, lb, time_limit_s=time_limit_s,
                                       deterministic_time=deterministic_time, workers=workers, seed=seed)
    starts = {tid: s / scale for tid, s in starts_i.items()}
    makespan_us = max((starts[t] + tasks[t].duration_us for t in starts), default=math.inf)
    objective_us = max((starts_i[t] + dur[t] for t in starts_i), default=math.inf) / scale
    bound_us = max(0.0, bound_i / scale - rounding_us)
    return ExactResult(status, makespan_us, min(bound_us, makespan_us), time.perf_counter() - t0, starts, n,
                       None if hint is None else horizon / scale, rounding_us, mode, lookahead, wgrad_lag,
                       objective_us, max(float(bound_i), float(lb)), rejected, starts_i, scale)


def _budget_events(g: StepGraph, dur: dict[str, int], h: dict) -> dict[int, list[tuple]]:
    """Per stage the memory events (time, delta) of the schedule ``h`` (task -> start, integers or
    CP-SAT expressions): allocations at starts, frees and releases at ends."""
    ev: dict[int, list[tuple]] = {}
    for tid, t in g.tasks.items():
        if t.alloc.device:
            ev.setdefault(t.stage, []).append((h[tid], t.alloc.device))
        if t.free.device:
            ev.setdefault(t.stage, []).append((h[tid] + dur[tid], -t.free.device))
        if t.release is not None and t.release[1]:
            ev.setdefault(t.release[0], []).append((h[tid] + dur[tid], -t.release[1]))
    return ev


def _best_hint(g: StepGraph, dur: dict[str, int], hints: list, pairs: list[tuple[str, str]],
               budget_bytes: int | None, scale: int) -> tuple[dict[str, int] | None, int]:
    """The shortest of ``hints`` (plans, ExactResults of the same ``scale``) that is a schedule of
    this model, re-timed with the rounded durations, and how many were left out for breaking the
    backbone gate or the budget. With a budget, one micro-batch at a time is a candidate too."""
    tasks = g.tasks
    if budget_bytes is not None:  # one micro-batch at a time: feasible whenever one fits
        hints = hints + [Starts(one_at_a_time(g, tasks, dur))]
    hint, best, rejected = None, None, 0
    for hp in hints:
        if isinstance(hp, Starts):
            h = dict(hp.starts)
        elif isinstance(hp, ExactResult):
            h = dict(hp.starts_int) if hp.scale == scale and set(hp.starts_int) == set(tasks) else None
        else:
            h = retime(g, dur, hp)
        if h is None:
            continue
        if (pairs and gate_violations(pairs, h)) or (
                budget_bytes is not None and not levels_fit(_budget_events(g, dur, h), budget_bytes, g.static_device)):
            rejected += 1
            continue
        span = max(h[t] + dur[t] for t in tasks)
        if hint is None or span < best:
            hint, best = h, span
    return hint, rejected


def _backbone_model(pp: int, g: StepGraph, dur: dict[str, int], head: dict[str, int], tail: dict[str, int],
                    pairs: list[tuple[str, str]], budget_bytes: int | None, lb: int, horizon: int,
                    hint: dict[str, int] | None):
    """The CP-SAT model of ``solve_exact``: a start and a fixed-size interval per task, precedence,
    one task at a time per (stage, lane), the backbone pairs, the budget's reservoirs ([Note: exact
    memory model]), the makespan minimised; hinted with ``hint``. Returns (model, starts)."""
    from ortools.sat.python import cp_model

    tasks = g.tasks
    m = cp_model.CpModel()
    start: dict[str, cp_model.IntVar] = {}
    by_res: dict[tuple[int, str], list] = {}
    for tid, t in tasks.items():
        hi = horizon - tail[tid] - dur[tid]
        s = m.new_int_var(head[tid], max(head[tid], hi), f"s:{tid}")
        start[tid] = s
        by_res.setdefault((t.stage, t.lane), []).append(m.new_fixed_size_interval_var(s, dur[tid], f"i:{tid}"))
    has_succ: set[str] = set()
    for tid, t in tasks.items():
        for d in t.deps:
            m.add(start[d] + dur[d] <= start[tid])
            has_succ.add(d)
        for d in g.start_deps.get(tid, ()):
            m.add(start[d] <= start[tid])
    for ivs in by_res.values():
        if len(ivs) > 1:
            m.add_no_overlap(ivs)
    for u, t in pairs:  # backbone gate (and WGrad deadlines)
        m.add(start[u] <= start[t])
    if budget_bytes is not None:  # [Note: exact memory model]
        ev: dict[int, list[tuple]] = {s_: [] for s_ in range(pp)}
        ev.update(_budget_events(g, dur, start))
        for s_, es in ev.items():
            if es:
                deltas = [int(d) for _, d in es]
                room = int(budget_bytes) - int(g.static_device[s_])
                m.add_reservoir_constraint([x for x, _ in es], deltas, -sum(abs(d) for d in deltas) - 1, room)
    makespan = m.new_int_var(lb, horizon, "makespan")
    for tid in tasks:
        if tid not in has_succ:
            m.add(start[tid] + dur[tid] <= makespan)
    m.minimize(makespan)
    if hint is not None:
        for tid, s in hint.items():
            m.add_hint(start[tid], s)
        m.add_hint(makespan, horizon)
    return m, start


def _solve(m, start: dict, hint: dict[str, int] | None, lb: int, *, time_limit_s: float,
           deterministic_time: float | None, workers: int, seed: int) -> tuple[str, dict[str, int], float]:
    """Run CP-SAT on ``solve_exact``'s model: (status, integer starts, proven bound). With no
    solution in time the hint (if any) is still a schedule: FEASIBLE with the lower bound ``lb``."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    if deterministic_time is not None:
        solver.parameters.max_deterministic_time = float(deterministic_time)
        solver.parameters.max_time_in_seconds = 20.0 * float(time_limit_s)
    solver.parameters.num_search_workers = workers
    solver.parameters.random_seed = seed
    code = solver.solve(m)
    status = STATUS.get(int(code), str(code))
    if status in ("OPTIMAL", "FEASIBLE"):
        return status, {tid: solver.value(v) for tid, v in start.items()}, solver.best_objective_bound
    if hint is not None:  # no better solution found in time: the hint is still a schedule
        return "FEASIBLE", hint, float(lb)
    return status, {}, float(lb)


def exact_report(cfg: Config, plan: "Plan", time_limit_s: float = 10.0, extra_hints: "Sequence[Hint]" = (),
                 mode: str = "backbone", wgrad_lag: int | None = None) -> dict:
    """Solve ``cfg`` exactly (hinted with ``plan`` and ``extra_hints``, e.g. plans on other backbones,
    which only the free mode can use) and compare ``plan`` with it. ``mode`` ``backbone`` (default)
    gates the compute lane by ``plan``'s own backbone and lookahead: the exact lane placement of the
    plan. ``gap`` is heuristic / optimum - 1 when the solve is OPTIMAL, heuristic / bound - 1
    otherwise (then an upper bound on the true gap); ``gap_vs_bound`` is always heuristic / bound - 1
    (conservative, valid in both cases); ``gap_vs_best`` is heuristic / best schedule found - 1 (a
    lower bound on the true gap)."""
    res = solve_exact(cfg, mode=mode, ranks=plan.backbone, lookahead=plan_lookahead(plan), wgrad_lag=wgrad_lag,
                      time_limit_s=time_limit_s, hint_plan=[plan, *extra_hints])
    heur = float(plan.metrics.step_time_us)
    return {
        **gap_fields(res, heur),
        "planner_lower_bound_us": float(plan.metrics.lower_bound_us),
        "strategy": plan.strategy,
        "pipeline": plan.pipeline,
        "num_tasks": res.num_tasks,
        "rounding_us": res.rounding_us,
        "wall_s": res.wall_s,
    }
