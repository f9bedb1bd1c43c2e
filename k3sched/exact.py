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
(dW deferral is still unbounded). ``solve_free`` is the free mode with the device budget and the
storage of every activation set modeled ([Note: exact free-order model]; ``k3sched plan --exact
--exact-order free``).

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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence, Union

from .config import Config
from .graph import StepGraph, build_step
from .tasks import Kind, Mem, Task, format_task_id

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
    schedules left out because they violate the backbone gate (plans on another backbone); for
    ``solve_free``, plans left out because they do not map onto the model or exceed the budget.
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
    # solve_free only: the storage chosen per activation set (stage, mb, layer), the scheduled
    # tasks (base and added, start_us / end_us set, consumers' deps on the added tasks), the budget
    choices: dict[tuple[int, int, int], str] = field(default_factory=dict)
    tasks: dict[str, Task] = field(default_factory=dict, repr=False)
    budget_bytes: int | None = None

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


# -- free order with memory and activation decisions (OptPipe-style) ---------------------------
ACT_CHOICES = ("keep", "local", "remote", "recompute")
_FWD_KINDS = ("attn.fwd", "router.fwd", "dispatch.fwd", "expert.fwd", "shared.fwd", "combine.fwd", "mlp.fwd")


def _option_tasks(cfg: Config, g: StepGraph, choices: Sequence[str]
                  ) -> tuple[dict[tuple[int, int, int], dict[str, list[Task]]], dict[tuple[int, int, int], list[str]]]:
    """Per activation set (stage, mb, layer) the tasks each non-keep choice adds, and the base tasks
    that must wait for the choice's last task (the layer's first backward tasks, which wait for an
    onload in the planner's graph). See [Note: exact free-order model]."""
    from .cost import CostModel
    from .graph import OffloadChoice

    pp = cfg.parallel.pp
    sets = [k for k, b in g.offload_sets.items() if b > 0]
    gl = build_step(cfg, OffloadChoice(local=set(sets)))
    remote = {k: k[0] + 1 for k in sets if k[0] + 1 < pp}
    gr = build_step(cfg, OffloadChoice(remote=remote)) if "remote" in choices and remote else None
    cost = CostModel(cfg)
    ckpt = int(cost.T * cfg.model.hidden * cost.b)  # the layer input, kept under recompute
    fwd: dict[tuple[int, int, int], list[Task]] = {}
    for t in g.tasks.values():
        if t.kind.value in _FWD_KINDS and t.mb is not None and t.layer is not None:
            fwd.setdefault((t.stage, t.mb, t.layer), []).append(t)
    opts: dict[tuple[int, int, int], dict[str, list[Task]]] = {}
    consumers: dict[tuple[int, int, int], list[str]] = {}
    onload_of = {format_task_id(s, Kind.ACT_ONLOAD, mb=m, layer=L): (s, m, L) for s, m, L in sets}
    for tid, t in gl.tasks.items():
        for d in t.deps:
            if d in onload_of:
                consumers.setdefault(onload_of[d], []).append(tid)
    for key in sets:
        s, m, L = key
        o: dict[str, list[Task]] = {}
        off = gl.tasks[format_task_id(s, Kind.ACT_OFFLOAD, mb=m, layer=L)]
        if "local" in choices:
            o["local"] = [replace(off, deps=list(off.deps)),
                          replace(gl.tasks[format_task_id(s, Kind.ACT_ONLOAD, mb=m, layer=L)])]
        if gr is not None and key in remote:
            peer = remote[key]
            o["remote"] = [replace(gr.tasks[format_task_id(st, k, mb=m, layer=L)]) for st, k in (
                (s, Kind.ACT_ROFFLOAD), (peer, Kind.ACT_RSTORE), (peer, Kind.ACT_RSERVE), (s, Kind.ACT_RONLOAD))]
        if "recompute" in choices:
            nbytes = max(0, g.offload_sets[key] - ckpt)
            drop = Task(f"s{s}/mb{m}/L{L}/drop@re", off.kind, "none", s, off.chunk, m, L, 0.0,
                        deps=list(off.deps), free=Mem(device=nbytes))
            copies = {f.id: f"{f.id}@re" for f in fwd[key]}
            re = [drop]
            for i, f in enumerate(sorted(fwd[key], key=lambda f: g.topo[f.id])):
                re.append(replace(f, id=copies[f.id], deps=[copies.get(d, d) for d in f.deps] + [f.id, drop.id],
                                  alloc=Mem(device=nbytes if i == 0 else 0), free=Mem()))
            o["recompute"] = re
        opts[key] = o
    return opts, consumers


def _memory_pieces(g: StepGraph) -> dict[int, list[tuple[str, str | None, int, tuple[int, int, int] | None]]] | None:
    """Each stage's device allocations paired with the frees that return them: [(allocating task,
    freeing task or None (held to the end of the step), bytes, activation set of the allocating
    forward task or None)]. A free is paired only with allocations of its ancestors (so the piece's
    interval has a non-negative length in every schedule), an activation set's bytes only with frees
    of the same set. None when some free finds no such allocation (then memory is modeled as a
    reservoir of events). See [Note: memory as a cumulative]."""
    tasks = g.tasks
    bit: dict[str, int] = {}
    for tid, t in tasks.items():
        if t.alloc.device:
            bit[tid] = 1 << len(bit)
    anc: dict[str, int] = {}
    for tid in sorted(tasks, key=g.topo.__getitem__):
        x = 0
        for d in tasks[tid].deps:
            x |= anc[d] | bit.get(d, 0)
        anc[tid] = x
    key_of = {tid: (t.stage, t.mb, t.layer) if t.kind.value in _FWD_KINDS and t.layer is not None else None
              for tid, t in tasks.items()}
    left: dict[int, list[list]] = {}
    for tid in sorted(bit, key=g.topo.__getitem__):
        t = tasks[tid]
        left.setdefault(t.stage, []).append([tid, t.alloc.device])
    out: dict[int, list] = {}
    for tid in sorted(tasks, key=g.topo.__getitem__):
        t = tasks[tid]
        frees = []
        if t.free.device:
            frees.append((t.stage, t.free.device))
        if t.release is not None and t.release[1]:
            frees.append((t.release[0], t.release[1]))
        mine = (t.stage, t.mb, t.layer)
        for st, need in frees:
            pool = left.get(st, [])
            # the set's own allocations first, then other non-set ones, earliest first
            for want_set in (True, False):
                for slot in pool:
                    a, rem = slot
                    if need == 0:
                        break
                    if rem == 0 or not (a == tid or anc[tid] & bit[a]):
                        continue
                    k = key_of[a]
                    if (k == mine) != want_set or (k is not None and k != mine):
                        continue
                    take = min(rem, need)
                    slot[1] -= take
                    need -= take
                    out.setdefault(st, []).append((a, tid, take, k))
            if need:
                return None
    for st, pool in left.items():
        for a, rem in pool:
            if rem:
                out.setdefault(st, []).append((a, None, rem, key_of[a]))
    return out


def _stretch(plan: "Plan", dur: dict[str, int]) -> dict[str, int]:
    """Integer starts of ``plan``'s own schedule under the (rounded up) durations ``dur``: a monotone
    map of its event times (every start and end), so every event keeps its order (ties stay ties)
    and each task still fits between its start and its end. Dependencies, lanes and the order of
    allocations and frees (hence the memory levels, which can only fall as ends come earlier) are
    those of the plan."""
    times = sorted({x for t in plan.tasks.values() for x in (t.start_us, t.end_us)})
    pos = {x: i for i, x in enumerate(times)}
    ending: dict[int, list[str]] = {}
    for tid, t in plan.tasks.items():
        ending.setdefault(pos[t.end_us], []).append(tid)
    at = [0] * len(times)
    for i in range(len(times)):
        v = at[i - 1] + 1 if i else 0
        for tid in ending.get(i, ()):
            v = max(v, at[pos[plan.tasks[tid].start_us]] + dur[tid])
        at[i] = v
    return {tid: at[pos[t.start_us]] for tid, t in plan.tasks.items()}


def _last_of(key: tuple[int, int, int], choice: str, tasks: list[Task], g: StepGraph) -> list[str]:
    """The option tasks the set's consumers wait for: the onload, or the copies of the forward's
    last tasks (those the offload waits for)."""
    if choice == "keep":
        return []
    if choice != "recompute":
        return [tasks[-1].id]
    return [f"{d}@re" for d in tasks[0].deps]


def solve_free(cfg: Config, *, budget_bytes: int | None = None, choices: Sequence[str] = ACT_CHOICES,
               hint_plans: "Sequence[Plan]" = (), deterministic_time: float = 5.0, time_limit_s: float = 60.0,
               workers: int = 1, seed: int = 0, scale: int = 100,
               fixed: "dict[tuple[int, int, int], str] | None" = None, memory: str = "cumulative") -> ExactResult:
    """Minimise the step time of ``cfg`` with the compute order free, the device memory bounded
    by ``budget_bytes`` (default ``cfg.budget_bytes``) and each activation set's storage a
    decision ([Note: exact free-order model]). Stops on CP-SAT's deterministic time
    (``deterministic_time``, single worker, fixed seed: the result does not depend on machine load;
    ``time_limit_s`` is only a safety net). ``hint_plans``: heuristic plans of the same config
    (any backbone on the same placement and offload policy); each one's schedule, re-timed with the
    rounded durations, is a starting solution when it stays within the budget. ``fixed``: activation
    sets whose storage is given (set -> choice), the rest decided. ``memory``: ``cumulative`` ([Note:
    memory as a cumulative]) or ``reservoir`` (the same levels as events; slower, kept as a check).

    [Note: exact free-order model]
    OptPipe's formulation on the task DAG of ``graph.build_step`` (no activation offload tasks):
    * every lane of every stage runs one task at a time, in an order the solver picks (no backbone);
    * each activation set (stage, mb, layer) is, by a decision, kept on the device; offloaded to
      its host (act.offload after the layer's forward, act.onload before its backward, on the
      offload_local lane); offloaded to the next stage's memory (act.roffload, act.rstore,
      act.rserve, act.ronload on the offload_remote lanes; the last stage has no such peer); or
      recomputed (dropped at the end of the layer's forward except the layer input, then the
      layer's forward tasks re-run on their lanes, compute and ep, before its backward). The added
      tasks, their durations and their memory effects are the planner's graph's (a graph built
      with that choice); the prefetch trigger of the planner's onloads is left to the solver;
    * per stage a reservoir constraint keeps static bytes plus every present task's allocations
      (at its start) minus its frees (at its end), plus the bytes it holds for its peer, within the
      budget, as ``planner`` counts a stage's device peak (device + peer);
    * minimise the makespan (the step time).
    Durations are rounded up as in ``solve_exact``; found starts re-timed with the real durations
    stay a schedule within the budget. Host memory is not bounded, as the planner does not bound it.
    The bound of [Note: rounding] holds: its monotone shift keeps every allocation after the frees
    that preceded it, so memory levels can only fall.

    [Note: memory as a cumulative]
    Each stage's device allocations are paired with the frees that return them (``_memory_pieces``:
    a free takes bytes only from allocations of its ancestors in the DAG, an activation set's bytes
    only from its own backward), and each pair is an interval from the allocating task's start to
    the freeing task's end, its bytes the demand, in one cumulative per stage with capacity budget
    minus static bytes; bytes never freed are held to the makespan. A set's pieces exist in one
    version per choice: whole when kept; cut at the offload's end (the drop, for recompute) and
    resumed at the onload's start (the first re-run task's) otherwise; the peer holds a remotely
    offloaded set from the offload's start to the onload's end, and a recomputed set keeps its layer
    input between the drop and the re-run. Only the version of the chosen storage is present. The
    same levels as a reservoir of events, propagated far better by CP-SAT; if no pairing exists
    (a free with no ancestor allocation) the model falls back to ``add_reservoir_constraint``.
    """
    from ortools.sat.python import cp_model

    from .planner import lower_bound_us

    bad = [c for c in choices if c not in ACT_CHOICES]
    if bad or "keep" not in choices:
        raise ValueError(f"exact solve: activation choices must include keep and be among {', '.join(ACT_CHOICES)}; "
                         f"got {', '.join(choices)}")
    t0 = time.perf_counter()
    ecfg = _exact_config(cfg)
    budget = int(cfg.budget_bytes if budget_bytes is None else budget_bytes)
    g = build_step(ecfg)
    base = g.tasks
    if len(base) > MAX_TASKS:
        raise ValueError(f"exact solve: {len(base)} tasks exceed the limit of {MAX_TASKS} (use pp <= 4, "
                         f"microbatches <= 8, 1-2 layers per stage)")
    opts, consumers = _option_tasks(ecfg, g, choices)
    every: dict[str, Task] = dict(base)
    owner: dict[str, tuple[tuple[int, int, int], str]] = {}
    for key, o in opts.items():
        for c, ts in o.items():
            for t in ts:
                every[t.id] = t
                owner[t.id] = (key, c)
    dur = {tid: int(math.ceil(t.duration_us * scale - 1e-9)) for tid, t in every.items()}
    rounding_us = sum(dur[t] / scale - every[t].duration_us for t in every)

    def events(tid: str, t: Task, s: int) -> list[tuple[int, int, int]]:
        """(stage, time, delta) memory events of ``t`` started at ``s`` (peer bytes count on the peer)."""
        e, end = [], s + dur[tid]
        if t.alloc.device:
            e.append((t.stage, s, t.alloc.device))
        if t.free.device:
            e.append((t.stage, end, -t.free.device))
        if t.release is not None and t.release[1]:
            e.append((t.release[0], end, -t.release[1]))
        holder = t.peer_stage if t.peer_stage is not None else t.stage
        if t.alloc.peer:
            e.append((holder, s, t.alloc.peer))
        if t.free.peer:
            e.append((holder, end, -t.free.peer))
        return e

    def feasible(h: dict[str, int], present: set[str]) -> bool:
        ev: dict[int, list[tuple[int, int]]] = {}
        for tid in present:
            for st, x, d in events(tid, every[tid], h[tid]):
                ev.setdefault(st, []).append((x, d))
        for st, es in ev.items():
            level, room = 0, budget - g.static_device[st]
            for _, d in sorted(es):  # frees before allocations at one instant, as CP-SAT nets them
                level += d
                if level > room:
                    return False
        return True

    # hints: plans re-timed with rounded durations (their offload choice mapped), and one
    # micro-batch at a time with every set kept
    cands: list[tuple[dict[str, int], dict[tuple[int, int, int], str]]] = []
    order = sorted(base, key=lambda t: (base[t].mb if base[t].mb is not None else 1 << 30, g.topo[t]))
    seq, now = {}, 0
    for tid in order:
        seq[tid] = now
        now += dur[tid]
    cands.append((seq, {}))
    unusable = 0  # plans on another graph (durations, tasks) or with a storage the model lacks
    for p in hint_plans:
        pdur = _int_durations(p.graph, scale)
        if any(tid not in p.tasks or pdur[tid] != dur[tid] for tid in base):
            unusable += 1
            continue
        h = _stretch(p, pdur)
        ch: dict[tuple[int, int, int], str] = {}
        ok = True
        for tid, t in p.tasks.items():
            if tid in base:
                continue
            if tid not in every or owner[tid][1] not in choices:
                ok = False
                break
            ch[owner[tid][0]] = owner[tid][1]
        if ok:
            cands.append((h, ch))
        else:
            unusable += 1
    rejected, hint = unusable, None
    for i, (h, ch) in enumerate(cands):
        present = set(base) | {t.id for k, c in ch.items() for t in opts[k][c]}
        if not feasible(h, present):
            rejected += i > 0  # the plans' (the one-at-a-time start may not fit)
            continue
        span_h = max(h[t] + dur[t] for t in present)
        if hint is None or span_h < hint[2]:
            hint = (h, ch, span_h)
    head, tail = _heads_tails(g, {t: dur[t] for t in base})
    lb = max(max(head[t] + dur[t] + tail[t] for t in base), int(math.floor(lower_bound_us(g)[0] * scale + 1e-6)))
    horizon = hint[2] if hint is not None else sum(dur.values())
    lb = min(lb, horizon)
    m = cp_model.CpModel()
    start: dict[str, cp_model.IntVar] = {}
    lit: dict[tuple[tuple[int, int, int], str], cp_model.IntVar] = {}
    one = m.new_bool_var("one")
    m.add(one == 1)
    by_res: dict[tuple[int, str], list] = {}
    for tid, t in base.items():
        s = m.new_int_var(head[tid], max(head[tid], horizon - tail[tid] - dur[tid]), f"s:{tid}")
        start[tid] = s
        by_res.setdefault((t.stage, t.lane), []).append(m.new_fixed_size_interval_var(s, dur[tid], f"i:{tid}"))
    for key, o in opts.items():
        keep = m.new_bool_var(f"keep:{key}")
        lits = [keep]
        lit[(key, "keep")] = keep
        for c, ts in o.items():
            x = lit[(key, c)] = m.new_bool_var(f"{c}:{key}")
            lits.append(x)
            for t in ts:
                s = start[t.id] = m.new_int_var(0, max(0, horizon - dur[t.id]), f"s:{t.id}")
                if t.lane != "none":
                    by_res.setdefault((t.stage, t.lane), []).append(
                        m.new_optional_fixed_size_interval_var(s, dur[t.id], x, f"i:{t.id}"))
        m.add_exactly_one(lits)
        if fixed and key in fixed:
            if (key, fixed[key]) not in lit:
                raise ValueError(f"exact solve: activation set {key} cannot be {fixed[key]!r} here")
            m.add(lit[(key, fixed[key])] == 1)
    for tid, t in base.items():
        for d in t.deps:
            m.add(start[d] + dur[d] <= start[tid])
        for d in g.start_deps.get(tid, ()):
            m.add(start[d] <= start[tid])
    makespan = m.new_int_var(lb, horizon, "makespan")
    has_succ = {d for t in base.values() for d in t.deps}
    for tid in base:
        if tid not in has_succ:
            m.add(start[tid] + dur[tid] <= makespan)
    for key, o in opts.items():
        for c, ts in o.items():
            x = lit[(key, c)]
            for t in ts:
                for d in t.deps:
                    m.add(start[d] + dur[d] <= start[t.id]).only_enforce_if(x)
                m.add(start[t.id] + dur[t.id] <= makespan).only_enforce_if(x)
            for last in _last_of(key, c, ts, g):
                for cons in consumers.get(key, ()):
                    m.add(start[last] + dur[last] <= start[cons]).only_enforce_if(x)
    for ivs in by_res.values():
        if len(ivs) > 1:
            m.add_no_overlap(ivs)
    if memory not in ("cumulative", "reservoir"):
        raise ValueError(f"exact solve: memory must be cumulative or reservoir; got {memory!r}")
    pieces = _memory_pieces(g) if memory == "cumulative" else None
    if pieces is None:  # no pairing of allocations with frees: one reservoir per stage
        ev: dict[int, tuple[list, list, list]] = {}
        for tid, t in every.items():
            x = one if tid in base else lit[(owner[tid][0], owner[tid][1])]
            for st, when, d in events(tid, t, 0):
                e = ev.setdefault(st, ([], [], []))
                e[0].append(start[tid] + when)
                e[1].append(int(d))
                e[2].append(x)
        for st, (times, deltas, actives) in ev.items():
            m.add_reservoir_constraint_with_active(times, deltas, actives, -sum(abs(d) for d in deltas) - 1,
                                                   budget - int(g.static_device[st]))
    else:  # [Note: memory as a cumulative]
        cum: dict[int, tuple[list, list]] = {}

        def hold(st: int, a, b, nbytes: int, x, name: str) -> None:
            size = m.new_int_var(0, horizon, f"z:{name}")
            iv = (m.new_interval_var(a, size, b, f"h:{name}") if x is None
                  else m.new_optional_interval_var(a, size, b, x, f"h:{name}"))
            e = cum.setdefault(st, ([], []))
            e[0].append(iv)
            e[1].append(int(nbytes))

        end = lambda tid: start[tid] + dur[tid]  # noqa: E731
        for st, ps in pieces.items():
            for i, (a, f, nbytes, key) in enumerate(ps):
                stop = makespan if f is None else end(f)
                o = opts.get(key) if key is not None else None
                if not o:
                    hold(st, start[a], stop, nbytes, None, f"{st}:{i}")
                    continue
                hold(st, start[a], stop, nbytes, lit[(key, "keep")], f"{st}:{i}:keep")
                for c, ts in o.items():
                    x = lit[(key, c)]
                    if c == "recompute":  # dropped at the drop, back from the first copy's start
                        cut, back = start[ts[0].id], start[ts[1].id]
                    else:  # away from the offload's end to the onload's start
                        cut, back = end(ts[0].id), start[ts[-1].id]
                    hold(st, start[a], cut, nbytes, x, f"{st}:{i}:{c}:0")
                    hold(st, back, stop, nbytes, x, f"{st}:{i}:{c}:1")
        for key, o in opts.items():
            s_ = key[0]
            if "remote" in o:  # the peer holds the set from the offload's start to the onload's end
                ts = o["remote"]
                hold(ts[0].peer_stage, start[ts[0].id], end(ts[-1].id), ts[0].alloc.peer, lit[(key, "remote")],
                     f"peer:{key}")
            if "recompute" in o:  # the layer input stays while the rest is dropped
                ts = o["recompute"]
                kept = g.offload_sets[key] - ts[0].free.device
                if kept:
                    hold(s_, start[ts[0].id], start[ts[1].id], kept, lit[(key, "recompute")], f"ckpt:{key}")
        for st, (ivs, dem) in cum.items():
            m.add_cumulative(ivs, dem, budget - int(g.static_device[st]))
    m.minimize(makespan)
    if hint is not None:
        h, ch, span_h = hint
        for tid, s in h.items():
            if tid in start:
                m.add_hint(start[tid], s)
        for key, o in opts.items():
            for c in ("keep", *o):
                m.add_hint(lit[(key, c)], int(ch.get(key, "keep") == c))
        m.add_hint(makespan, span_h)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = float(deterministic_time)
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    code = solver.solve(m)
    status = _STATUS.get(int(code), str(code))
    if status in ("OPTIMAL", "FEASIBLE"):
        ch = {key: next(c for c in ("keep", *o) if solver.boolean_value(lit[(key, c)])) for key, o in opts.items()}
        starts_i = {tid: solver.value(start[tid]) for tid in base}
        for key, c in ch.items():
            for t in opts[key].get(c, ()):
                starts_i[t.id] = solver.value(start[t.id])
        bound_i = solver.best_objective_bound
    elif hint is not None:
        status, bound_i = "FEASIBLE", float(lb)
        ch = {key: hint[1].get(key, "keep") for key in opts}
        starts_i = {tid: s for tid, s in hint[0].items() if tid in base or tid in owner}
    else:
        return ExactResult(status, math.inf, max(0.0, lb / scale - rounding_us), time.perf_counter() - t0,
                           num_tasks=len(base), rounding_us=rounding_us, mode="free-memory",
                           bound_int=float(lb), hints_rejected=rejected, scale=scale, budget_bytes=budget)
    out: dict[str, Task] = {}
    for tid, s in starts_i.items():
        t = replace(every[tid], deps=list(every[tid].deps))
        t.start_us = s / scale
        t.end_us = t.start_us + t.duration_us
        out[tid] = t
    for key, c in ch.items():
        for last in _last_of(key, c, opts[key].get(c, []), g):
            for cons in consumers.get(key, ()):
                out[cons].deps.append(last)
    makespan_us = max(t.end_us for t in out.values())
    bound_us = max(0.0, bound_i / scale - rounding_us)
    return ExactResult(status, makespan_us, min(bound_us, makespan_us), time.perf_counter() - t0,
                       {tid: t.start_us for tid, t in out.items()}, len(base),
                       None if hint is None else hint[2] / scale, rounding_us, "free-memory", None, None,
                       max(s + dur[t] for t, s in starts_i.items()) / scale, max(float(bound_i), float(lb)), rejected,
                       starts_i, scale, choices=ch, tasks=out, budget_bytes=budget)


def free_report(cfg: Config, plan: "Plan", *, extra_hints: "Sequence[Plan]" = (), deterministic_time: float = 5.0,
                time_limit_s: float = 60.0) -> dict:
    """Solve ``cfg`` with ``solve_free`` under the config's budget (hinted with ``plan`` and
    ``extra_hints``) and compare ``plan`` with it, as ``exact_report`` does."""
    res = solve_free(cfg, hint_plans=[plan, *extra_hints], deterministic_time=deterministic_time,
                     time_limit_s=time_limit_s)
    heur = float(plan.metrics["step_time_us"])
    if not math.isfinite(res.makespan_us):
        raise ValueError(f"no schedule within the budget found in deterministic time {deterministic_time:g} "
                         f"(CP-SAT status {res.status})")
    ref = res.makespan_us if res.optimal else res.bound_us
    counts = {c: sum(1 for x in res.choices.values() if x == c) for c in ACT_CHOICES}
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
        "choices": counts,
        "budget_bytes": res.budget_bytes,
        "num_tasks": res.num_tasks,
        "rounding_us": res.rounding_us,
        "wall_s": res.wall_s,
    }
