"""What both exact models share: the result, the config they are built from, integer durations,
re-timed hints, heads and tails, and how CP-SAT is run ([Note: rounding] in k3sched/exact/__init__.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from ..config import Config
from ..graph import StepGraph
from ..tasks import Task

if TYPE_CHECKING:  # pragma: no cover
    from ..planner import Plan

MAX_TASKS = 3000
MODES = ("backbone", "free")
STATUS = {0: "UNKNOWN", 1: "MODEL_INVALID", 2: "FEASIBLE", 3: "INFEASIBLE", 4: "OPTIMAL"}


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


def exact_config(cfg: Config) -> Config:
    """The config the exact model is built from: no activation offload, memory unconstrained."""
    c = cfg.model_copy(deep=True)
    c.schedule.offload = "none"
    c.schedule.remote_offload = False
    return c


def int_durations(g: StepGraph, scale: int) -> dict[str, int]:
    return {tid: int(math.ceil(t.duration_us * scale - 1e-9)) for tid, t in g.tasks.items()}


def retime(g: StepGraph, dur: dict[str, int], plan: "Plan") -> dict[str, int] | None:
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



@dataclass
class Starts:
    """Integer starts of a schedule built here (a hint)."""

    starts: dict[str, int]


Hint = Union["Plan", ExactResult]


def check_size(n: int) -> None:
    if n > MAX_TASKS:
        raise ValueError(f"exact solve: {n} tasks exceed the limit of {MAX_TASKS} (use pp <= 4, microbatches <= 8, "
                         f"1-2 layers per stage)")


def one_at_a_time(g: StepGraph, tasks, dur: dict[str, int]) -> dict[str, int]:
    """Integer starts of ``tasks`` run one after another, micro-batch by micro-batch (a hint that is
    within a budget whenever one micro-batch fits)."""
    order = sorted(tasks, key=lambda t: (tasks[t].mb if tasks[t].mb is not None else 1 << 30, g.topo[t]))
    seq, now = {}, 0
    for tid in order:
        seq[tid] = now
        now += dur[tid]
    return seq


def levels_fit(ev: dict[int, list[tuple[int, int]]], budget: int, static: list) -> bool:
    """Whether each stage's memory events (time, delta) stay within ``budget`` minus its static
    bytes; frees before allocations at one instant, as CP-SAT nets them."""
    for s_, es in ev.items():
        level, room = 0, budget - static[s_]
        for _, d in sorted(es):
            level += d
            if level > room:
                return False
    return True


def int_lower_bound(g: StepGraph, dur: dict[str, int], scale: int) -> tuple[dict[str, int], dict[str, int], int]:
    """Heads, tails and a lower bound on the rounded makespan: the longest chain and the planner's
    bound (valid for D, so for D' >= D)."""
    from ..bound import lower_bound_us

    head, tail = _heads_tails(g, dur)
    cp_len = max(head[t] + dur[t] + tail[t] for t in g.tasks)
    return head, tail, max(cp_len, int(math.floor(lower_bound_us(g)[0] * scale + 1e-6)))


def gap_fields(res, heur: float) -> dict:
    """The report fields every exact mode shares: status, optimum / best / bound and the heuristic's
    gap to the optimum (to the bound when not proven), to the bound and to the best found."""
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
    }
