"""Exact lane placement for small instances (OR-Tools CP-SAT): how far is the heuristic from optimal?

The model takes the same task DAG the list scheduler places (``graph.build_step(cfg)``, without
activation offload tasks) and asks for the shortest step under the lane rules:

* one fixed-size interval per task; integer durations are the task's µs scaled by
  ``scale`` (default 100: 10 ns resolution) and rounded *up*;
* NoOverlap per (stage, lane) resource (a lane runs one task at a time);
* ``end(dep) <= start(task)`` for every dependency; ``graph.start_deps`` are start-to-start
  (``start(trigger) <= start(task)``);
* in ``backbone`` mode (the default), the pipeline schedule's slot gate on the compute lane (see
  [Note: backbone-constrained mode]);
* minimise the makespan, bounded above by the heuristic's makespan (its lane orders re-timed with
  the rounded durations, which is a feasible solution given to CP-SAT as a hint).

[Note: backbone-constrained mode]
The issue asks for the exact *lane placement of a plan*: the optimum given the chosen pipeline
schedule. ``mode="backbone"`` constrains the compute lane the way the heuristic's slot gate does
(``planner._list_schedule``): per rank, the *main* compute tasks (compute lane, not WGrad, not
optim; slot from ``planner._slot_index`` of the backbone and the graph's ``unit`` map, exactly as
``planner._prepare`` assigns it) are grouped by slot G_0, G_1, ... (slots with main tasks, in
order); a task of G_p may start only once every task of G_0..G_{p-1-lookahead} has started. It is
written as the linear constraints ``start(t) >= start(u)`` for t in G_p and u in
G_{p-1-lookahead-j}, j = 0..lookahead: by induction on p they imply the gate on every earlier group.
WGrad, optimizer and non-compute tasks (EP all-to-alls, P2P, collectives) are free, so the
model still chooses when each dW fills the compute lane and how transfers interleave.
``lookahead`` is the one the plan used (``schedule.lookahead``; 0 for serial or memory-lean plans).
Any schedule the heuristic produces on that backbone satisfies the gate, so its makespan is an
upper bound (hinted); plans on another backbone generally violate it and are not used as hints.

[Note: WGrad deadline]
The heuristic also bounds dW deferral (``schedule.wgrad_lag``, a memory policy: a deferred dW keeps
its activations and output gradient alive): a WGrad of slot s has priority key s + wgrad_lag, so
once ready it is never bypassed by a main task of a later slot; with wgrad_lag >= lookahead it is
ready by then (its dX, of slot s, has run). ``solve_exact(wgrad_lag=k)`` adds that as
``start(dW of slot s) <= start(t)`` for main tasks t of slots > s + k: the optimum given the
backbone *and* the deferral bound. The default (None) leaves WGrad free, as the acceptance
test does.

[Note: exact model scope]
``mode="free"`` drops the gate: the exact model may interleave forwards, dX and dW in any order the
DAG allows (e.g. run forwards ahead of the 1F1B order). That gap measures the heuristic *and its
backbone* against the best any lane placement of the DAG can do. In both modes *memory is not
modeled*: no device budget, no activation lifetimes, so the free optimum may hold every
micro-batch's activations at once (a GPipe-like order with every dW deferred). The free optimum is
a bound on what any schedule of this DAG can reach, not a memory-feasible plan; the backbone
optimum keeps the schedule's forward/backward order, which is what bounds memory in practice
(dW deferral is still unbounded).

[Note: rounding]
Let D be the real durations and D' = ceil(D * scale) / scale. Starts that are feasible under D'
stay feasible under D, so ``makespan_us`` (the found starts re-evaluated with the real durations)
is achievable. Conversely an optimal schedule under D becomes feasible under D' by shifting every
task by the sum of the rounding increments of the tasks started before it (the shift is monotone
in the start time, so start-to-start constraints such as the backbone gate stay satisfied), so
OPT(D) >= OPT(D') - sum(D' - D): ``bound_us`` is the CP-SAT bound minus that sum, a valid lower
bound on the real optimum. With n tasks the two differ by at most n / scale µs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence, Union

from .config import Config
from .graph import StepGraph, build_step

if TYPE_CHECKING:  # pragma: no cover
    from .planner import Plan

MAX_TASKS = 3000
MODES = ("backbone", "free")
_STATUS = {0: "UNKNOWN", 1: "MODEL_INVALID", 2: "FEASIBLE", 3: "INFEASIBLE", 4: "OPTIMAL"}


@dataclass
class ExactResult:
    """Outcome of one CP-SAT solve.

    ``status``: OPTIMAL (``makespan_us`` is the optimum up to the rounding of [Note: rounding]),
    FEASIBLE (time limit hit; ``bound_us`` is the best proven lower bound), UNKNOWN (no solution
    within the time limit and no hint). ``starts``: task id -> start (µs) of the best schedule found.
    ``objective_us``: that schedule's makespan under the rounded durations (what CP-SAT minimised;
    two modes solved with the same ``scale`` compare exactly on it). ``hints_rejected``: hint
    schedules left out because they violate the backbone gate (plans on another backbone).
    """

    status: str
    makespan_us: float
    bound_us: float
    wall_s: float
    starts: dict[str, float] = field(default_factory=dict)
    num_tasks: int = 0
    hint_makespan_us: float | None = None
    rounding_us: float = 0.0  # sum of rounding increments (D' - D), see [Note: rounding]
    mode: str = "backbone"
    lookahead: int | None = None  # the gate's lookahead (backbone mode)
    wgrad_lag: int | None = None  # WGrad deadline (backbone mode; None: WGrad free)
    objective_us: float = math.inf
    bound_int: float = -math.inf  # CP-SAT's proven bound on the objective, in 1/scale µs
    hints_rejected: int = 0
    starts_int: dict[str, int] = field(default_factory=dict, repr=False)  # CP-SAT's integer starts
    scale: int = 100

    @property
    def optimal(self) -> bool:
        return self.status == "OPTIMAL"


def _exact_config(cfg: Config) -> Config:
    """The config the exact model is built from: no activation offload, memory unconstrained."""
    c = cfg.model_copy(deep=True)
    c.schedule.offload = "none"
    c.schedule.remote_offload = False
    return c


def _int_durations(g: StepGraph, scale: int) -> dict[str, int]:
    return {tid: int(math.ceil(t.duration_us * scale - 1e-9)) for tid, t in g.tasks.items()}


def _retime(g: StepGraph, dur: dict[str, int], plan: "Plan") -> dict[str, int] | None:
    """Integer starts of ``plan``'s lane orders under durations ``dur`` (a feasible schedule of the
    exact model), or None when the plan does not cover the graph's tasks. Tasks the graph lacks
    (offload/onload) are dropped from the orders: the remaining order stays acyclic."""
    tasks = g.tasks
    prev: dict[str, str] = {}
    covered = 0
    for order in plan.lane_orders.values():
        last = None
        for tid in order:
            if tid not in tasks:
                continue
            covered += 1
            if last is not None:
                prev[tid] = last
            last = tid
    if covered != len(tasks):
        return None
    # Kahn over dependency + start-dep + lane-order edges.
    succ: dict[str, list[str]] = {t: [] for t in tasks}
    indeg = dict.fromkeys(tasks, 0)
    for tid, t in tasks.items():
        for d in list(t.deps) + list(g.start_deps.get(tid, ())):
            succ[d].append(tid)
            indeg[tid] += 1
        if tid in prev:
            succ[prev[tid]].append(tid)
            indeg[tid] += 1
    start = dict.fromkeys(tasks, 0)
    stack = [t for t, k in indeg.items() if k == 0]
    seen = 0
    while stack:
        tid = stack.pop()
        seen += 1
        t = tasks[tid]
        s = 0
        for d in t.deps:
            s = max(s, start[d] + dur[d])
        for d in g.start_deps.get(tid, ()):
            s = max(s, start[d])
        if tid in prev:
            s = max(s, start[prev[tid]] + dur[prev[tid]])
        start[tid] = s
        for j in succ[tid]:
            indeg[j] -= 1
            if indeg[j] == 0:
                stack.append(j)
    return start if seen == len(tasks) else None


def _heads_tails(g: StepGraph, dur: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """Earliest start (precedence only) and the longest chain after each task's end."""
    tasks = g.tasks
    head: dict[str, int] = {}
    for tid, t in tasks.items():  # creation order is topological
        s = max((head[d] + dur[d] for d in t.deps), default=0)
        for d in g.start_deps.get(tid, ()):
            s = max(s, head[d])
        head[tid] = s
    tail = dict.fromkeys(tasks, 0)
    for tid in reversed(list(tasks)):
        after = tail[tid] + dur[tid]
        for d in tasks[tid].deps:
            if after > tail[d]:
                tail[d] = after
    return head, tail


def _slots(g: StepGraph, ranks: dict[int, list]):
    from .planner import _prepare, _slot_index

    return _prepare(g, _slot_index(ranks))


def backbone_groups(g: StepGraph, ranks: dict[int, list]) -> dict[int, list[tuple[int, list[str]]]]:
    """Per rank, the main compute tasks (compute lane, not WGrad, not optim) grouped by backbone
    slot: [(slot, task ids)] in slot order, the groups of [Note: backbone-constrained mode]. Slots
    are assigned by ``planner._prepare`` itself, so the gate is the heuristic's."""
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


@dataclass
class _Starts:
    """Integer starts of a schedule built here (a hint)."""

    starts: dict[str, int]


Hint = Union["Plan", ExactResult]


def plan_lookahead(plan: "Plan") -> int:
    """The slot-gate lookahead ``plan`` was scheduled with (the planner uses 0 for the serial
    strategy and for memory-lean re-plans)."""
    if plan.strategy == "serial" or plan.metrics.get("memory_lean"):
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

    [Note: exact memory model]
    With ``budget_bytes`` a reservoir constraint per stage adds each task's ``alloc.device`` at its
    start and subtracts ``free.device`` (and a receive's ``release`` of its sender's buffer) at its
    end; the level (on top of the stage's static bytes) stays within the budget. CP-SAT nets events
    at one instant together, as the planner's timeline puts frees before allocations. Found starts
    re-timed with the real (shorter) durations free memory no later, so ``makespan_us`` is a
    schedule within the budget. Hints (e.g. a k3 plan under the same budget) are re-timed with the
    rounded durations and used only if they stay within it.
    """
    from ortools.sat.python import cp_model

    if mode not in MODES:
        raise ValueError(f"exact solve: mode must be one of {', '.join(MODES)}; got {mode!r}")
    t0 = time.perf_counter()
    ecfg = _exact_config(cfg)
    g = build_step(ecfg)
    n = len(g.tasks)
    if n > MAX_TASKS:
        raise ValueError(f"exact solve: {n} tasks exceed the limit of {MAX_TASKS} (use pp <= 4, microbatches <= 8, "
                         f"1-2 layers per stage)")
    tasks = g.tasks
    dur = _int_durations(g, scale)
    rounding_us = sum(dur[t] / scale - tasks[t].duration_us for t in tasks)
    pairs: list[tuple[str, str]] = []
    if mode == "backbone":
        if ranks is None:
            from .planner import backbone

            ranks = backbone(ecfg).ranks
        lookahead = int(cfg.schedule.lookahead if lookahead is None else lookahead)
        pairs = backbone_pairs(g, ranks, lookahead, wgrad_lag)
    else:
        lookahead = wgrad_lag = None
    hints = [hint_plan] if hint_plan is not None and not isinstance(hint_plan, Sequence) else list(hint_plan or [])
    hint = None
    rejected = 0

    def span(h: dict[str, int]) -> int:
        return max(h[t] + dur[t] for t in tasks)

    def within_budget(h: dict[str, int]) -> bool:
        if budget_bytes is None:
            return True
        ev: dict[int, list[tuple[int, int]]] = {}
        for tid, t in tasks.items():
            if t.alloc.device:
                ev.setdefault(t.stage, []).append((h[tid], t.alloc.device))
            if t.free.device:
                ev.setdefault(t.stage, []).append((h[tid] + dur[tid], -t.free.device))
            if t.release is not None and t.release[1]:
                ev.setdefault(t.release[0], []).append((h[tid] + dur[tid], -t.release[1]))
        for s_, es in ev.items():
            level, room = 0, budget_bytes - g.static_device[s_]
            for _, d in sorted(es):  # frees before allocations at one instant, as CP-SAT nets them
                level += d
                if level > room:
                    return False
        return True

    if budget_bytes is not None:  # one micro-batch at a time: feasible whenever one fits
        order = sorted(tasks, key=lambda t: (tasks[t].mb if tasks[t].mb is not None else 1 << 30, g.topo[t]))
        seq, now = {}, 0
        for tid in order:
            seq[tid] = now
            now += dur[tid]
        hints.append(_Starts(seq))
    for hp in hints:
        if isinstance(hp, _Starts):
            h = dict(hp.starts)
        elif isinstance(hp, ExactResult):
            h = dict(hp.starts_int) if hp.scale == scale and set(hp.starts_int) == set(tasks) else None
        else:
            h = _retime(g, dur, hp)
        if h is None:
            continue
        if (pairs and gate_violations(pairs, h)) or not within_budget(h):
            rejected += 1
            continue
        if hint is None or span(h) < span(hint):
            hint = h
    head, tail = _heads_tails(g, dur)
    cp_len = max(head[t] + dur[t] + tail[t] for t in tasks)
    from .planner import lower_bound_us

    # lower bounds: the planner's (valid for D, so for D' >= D) and a relaxation's proven bound
    lb = max(cp_len, int(math.floor(lower_bound_us(g)[0] * scale + 1e-6)))
    if lower is not None and lower.scale == scale and math.isfinite(lower.bound_int):
        lb = max(lb, int(math.ceil(lower.bound_int - 1e-6)))
    # upper bound: the hint's makespan, else every task one after another
    horizon = span(hint) if hint is not None else sum(dur.values())
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
        ev: dict[int, tuple[list, list]] = {s_: ([], []) for s_ in range(cfg.parallel.pp)}
        for tid, t in tasks.items():
            if t.alloc.device:
                ev[t.stage][0].append(start[tid])
                ev[t.stage][1].append(int(t.alloc.device))
            if t.free.device:
                ev[t.stage][0].append(start[tid] + dur[tid])
                ev[t.stage][1].append(-int(t.free.device))
            if t.release is not None and t.release[1]:
                ev[t.release[0]][0].append(start[tid] + dur[tid])
                ev[t.release[0]][1].append(-int(t.release[1]))
        for s_, (times, deltas) in ev.items():
            if times:
                room = int(budget_bytes) - int(g.static_device[s_])
                m.add_reservoir_constraint(times, deltas, -sum(abs(d) for d in deltas) - 1, room)
    lb = min(lb, horizon)
    makespan = m.new_int_var(lb, horizon, "makespan")
    for tid in tasks:
        if tid not in has_succ:
            m.add(start[tid] + dur[tid] <= makespan)
    m.minimize(makespan)
    if hint is not None:
        for tid, s in hint.items():
            m.add_hint(start[tid], s)
        m.add_hint(makespan, horizon)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    if deterministic_time is not None:
        solver.parameters.max_deterministic_time = float(deterministic_time)
        solver.parameters.max_time_in_seconds = 20.0 * float(time_limit_s)
    solver.parameters.num_search_workers = workers
    solver.parameters.random_seed = seed
    code = solver.solve(m)
    status = _STATUS.get(int(code), str(code))
    if status in ("OPTIMAL", "FEASIBLE"):
        starts_i = {tid: solver.value(v) for tid, v in start.items()}
        bound_i = solver.best_objective_bound
    elif hint is not None:  # no better solution found in time: the hint is still a schedule
        status, starts_i, bound_i = "FEASIBLE", hint, float(lb)
    else:
        starts_i, bound_i = {}, float(lb)
    starts = {tid: s / scale for tid, s in starts_i.items()}
    makespan_us = max((starts[t] + tasks[t].duration_us for t in starts), default=math.inf)
    objective_us = max((starts_i[t] + dur[t] for t in starts_i), default=math.inf) / scale
    bound_us = max(0.0, bound_i / scale - rounding_us)
    return ExactResult(status, makespan_us, min(bound_us, makespan_us), time.perf_counter() - t0, starts, n,
                       None if hint is None else horizon / scale, rounding_us, mode, lookahead, wgrad_lag,
                       objective_us, max(float(bound_i), float(lb)), rejected, starts_i, scale)


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
    heur = float(plan.metrics["step_time_us"])
    ref = res.makespan_us if res.optimal else res.bound_us
    return {
        "mode": res.mode,
        "status": res.status,
        "optimum_us": res.makespan_us if res.optimal else None,
        "best_us": res.makespan_us,
        "bound_us": res.bound_us,
        "heuristic_us": heur,
        "gap": heur / ref - 1.0 if ref > 0 else math.inf,
        "gap_vs_bound": heur / res.bound_us - 1.0 if res.bound_us > 0 else math.inf,
        "gap_vs_best": heur / res.makespan_us - 1.0,
        "planner_lower_bound_us": float(plan.metrics["lower_bound_us"]),
        "strategy": plan.strategy,
        "pipeline": plan.pipeline,
        "num_tasks": res.num_tasks,
        "rounding_us": res.rounding_us,
        "wall_s": res.wall_s,
    }
