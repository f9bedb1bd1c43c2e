"""The step and the overlap a plan should expect when task durations spread.

[Note: task-time spread]
The planner's schedule gives every task exactly its costed duration. On a real machine a compute
task's duration spreads from instance to instance (preemption, the transfers beside it, caches,
the tokens the router sent this rank), and a fixed-order schedule is a max-plus system: where two
chains join (a task waiting on a dependency and on its lane), the expected start is the expected
*maximum* of the two, which is above the maximum of the expected times whenever both vary. So
the deterministic step is a biased prediction of the mean step, and the bias grows with every
join where the two sides are close: an all-to-all hidden under another micro-batch's compute of
about its length is exposed whenever that compute runs long. The planned overlap is optimistic
for the same reason.

``expected`` replays the plan's lane orders (each lane runs its tasks in plan order, each task
starts once its dependencies and its lane predecessor have ended, as the executor does) with
sampled durations:

- every compute-lane task's duration is its planned one times a log-normal factor of mean 1 and
  coefficient of variation ``cv(kind)``: the spread of the kind while a transfer runs beside it,
  the profile's ``time_cv[kind]`` when a calibration measured it, else ``hardware.cpu_runner.task_time_cv``
  (``k3sched probe`` measures it beside all-to-alls); drawn independently per rank, sample and
  task. The spread is what the transfers' wake-ups, softirqs and cache traffic do to the compute
  thread. It applies to every compute task of a co-scheduled stage that has transfers, not only
  to those the plan puts beside one, and to a serial plan's alike ([Note: spread of a task the
  plan puts alone]);
- the ranks of a stage are replayed side by side (``R = min(ep * dp, 8)`` of them): the plan is
  the same for all of them, but their samples differ, and an all-to-all, a gradient reduction or
  a replica reduction starts only when every rank has posted it (the others wait), which is the
  rank drift a one-rank schedule cannot show; P2P transfers pair rank r of one stage with rank r
  of the next;
- communication durations are not sampled: their wire time is modelled and their waits come from
  the sync above;
- the executor's tokens are replayed too: a serial plan's ranks run one task at a time in the
  planned order, and lanes that share a NIC pass their transfers one at a time (the order of
  :func:`k3sched.lowering.linear_extension`, as the runtime).

``SAMPLES`` samples with a fixed seed (the replay is deterministic for a plan), reporting the
mean step, its 10th and 90th percentiles and, per stage, rank 0's mean comm/compute overlap (the
share of communication-lane time that overlaps compute, as ``k3sched validate`` measures it) and
its mean wait for the last rank at the synchronising transfers (``sync_wait_us``, as ``k3sched
validate`` measures it: [Note: waiting for the last rank] in traces/validate.py).
This is a prediction of what a run of the *same* lane orders costs; it does not re-plan around the
spread. A transfer's own slowdown beside compute enters only through its planned duration
([Note: a transfer beside compute] in k3sched/cpurunner.py: the plan's share of compute beside it,
not resampled). Left out: the start-dependencies of gradient-shard onloads (a start waiting for
another's start). Checked against
the shaped-link testbed's runs in benchmarks/bench_overlap.py and tests/unit/k3sched/test_variability.py.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .cpurunner import task_time_cv
from .intervals import covered, merge
from .tasks import LANE_OF, LANES, SYNC_KINDS, Kind, Task

if TYPE_CHECKING:  # pragma: no cover
    from .config import Config
    from .cost import CostModel

SAMPLES = 32
"""Replays per plan: the mean step's standard error is then about std / 5.7."""
SEED = 0
MAX_RANKS = 8
"""Ranks of a stage replayed side by side at most (the expected maximum of 8 draws is within a few
percent of that of 16 for the spreads seen)."""


def time_cvs(cfg: "Config", cost: "CostModel") -> dict[Kind, float]:
    """cv of each compute-lane kind: the profile's ``time_cv`` where it has one, else the
    CPU runner's ``task_time_cv`` (0: exact, and on GPUs)."""
    hw = task_time_cv(cfg)
    prof = cost.profile.time_cv
    return {k: float(prof.get(k.value, hw)) for k in Kind if LANE_OF[k] == "compute"}


def spread_active(cfg: "Config", cost: "CostModel") -> bool:
    """Whether any compute kind has a spread (the plan then reports :func:`expected`)."""
    return any(v > 0 for v in time_cvs(cfg, cost).values())


class _Slot:
    """What :func:`k3sched.lowering.linear_extension` reads of a task."""

    __slots__ = ("id", "start_us", "end_us", "start_deps")

    def __init__(self, t: Task):
        self.id, self.start_us, self.end_us, self.start_deps = t.id, t.start_us, t.end_us, ()


def _token_edges(tasks: Mapping[str, Task], lane_orders: Mapping[tuple[int, str], Sequence[str]],
                 groups: Sequence[tuple[str, ...]]) -> list[tuple[str, str]]:
    """(previous, next) pairs of the token the executor passes among the lanes of each group on
    every stage: all lanes in a serial run ([Note: serial execution] in runtime/executor.py), the
    lanes that share a NIC otherwise ([Note: shared links] in k3sched/cost.py); same order as the
    executor's (:func:`k3sched.lowering.linear_extension`)."""
    from .lowering import linear_extension

    edges: list[tuple[str, str]] = []
    stages = sorted({s for s, _ in lane_orders})
    for s in stages:
        prefix = f"s{s}/"
        for group in groups:
            lanes = {ln: [_Slot(tasks[t]) for t in lane_orders.get((s, ln), ())] for ln in group}
            deps = {t.id: tuple(d for d in tasks[t.id].deps if d.startswith(prefix)) for ts in lanes.values() for t in ts}
            order, stuck = linear_extension(lanes, deps)
            if stuck is not None:
                raise ValueError(f"expected: task {stuck}: its lane order and dependencies form a cycle")
            edges += list(zip(order, order[1:]))
    return edges


def _by_stage(tl: Sequence[Task]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per stage, the positions of its transfers (``ep`` / ``collective`` lanes) and of its compute
    tasks."""
    comm: dict[int, list[int]] = {}
    comp: dict[int, list[int]] = {}
    for i, t in enumerate(tl):
        if t.lane in ("ep", "collective", "compute"):
            (comp if t.lane == "compute" else comm).setdefault(t.stage, []).append(i)
    return {s: (np.array(comm.get(s, []), dtype=np.int64), np.array(comp.get(s, []), dtype=np.int64))
            for s in sorted({t.stage for t in tl})}


def _spread_tasks(tl: Sequence[Task], stages: Mapping[int, tuple[np.ndarray, np.ndarray]]) -> set[int]:
    """[Note: spread of a task the plan puts alone] The compute tasks (by position) whose duration
    spreads: every one of a stage with a transfer of non-zero duration, in a co-scheduled plan and
    in a serial one.

    Once a run's ranks drift apart, its transfers no longer land where the plan put them, and on
    a shared host a rank's compute also shares cores with the other ranks' transfer threads, so a
    task the plan puts alone spreads about as much as one the plan puts beside a transfer.
    Spreading only the planned-beside share would under-predict both the wait for the last rank
    ([Note: waiting for the last rank] in traces/validate.py) and the lost overlap; so every
    compute task of a stage with transfers is spread, with the kind's ``cv``.

    A serial plan runs one task at a time on every rank, nothing beside its own transfers, but its
    ranks share the host's cores with the other ranks' transfers and with each other, so its tasks
    spread as a co-scheduled run's do, and its all-to-alls wait for the later rank the same way.
    Replayed exact, its expected step would be its planned one, below what its runs take; so it
    is spread as a co-scheduled plan is. The figures behind this choice are in docs/results.md."""
    out: set[int] = set()
    for comm_i, comp_i in stages.values():
        if any(tl[i].duration_us > 0 for i in comm_i.tolist()):
            out.update(comp_i.tolist())
    return out


def _order(tasks: Sequence[Task], index: Mapping[str, int], lane_prev: Sequence[int],
           token_prev: Mapping[int, int]) -> tuple[list[int], list[np.ndarray]]:
    """Topological order over dependencies, lane predecessors and token predecessors, and each
    task's predecessors."""
    n = len(tasks)
    preds: list[np.ndarray] = []
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i, t in enumerate(tasks):
        p = [index[d] for d in t.deps]
        if lane_prev[i] >= 0:
            p.append(lane_prev[i])
        if token_prev.get(i, -1) >= 0:
            p.append(token_prev[i])
        preds.append(np.array(p, dtype=np.int64))
        indeg[i] = len(p)
        for j in p:
            succ[j].append(i)
    queue = deque(i for i in range(n) if indeg[i] == 0)
    order: list[int] = []
    while queue:
        i = queue.popleft()
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                queue.append(j)
    if len(order) != n:
        raise ValueError("expected: the lane orders deadlock")
    return order, preds


def expected(tasks: Mapping[str, Task], lane_orders: Mapping[tuple[int, str], Sequence[str]], cfg: "Config",
             cost: "CostModel", samples: int = SAMPLES, seed: int = SEED, serial: bool = False) -> dict:
    """[Note: task-time spread]: the mean step (and its 10th / 90th percentiles) and rank 0's mean
    comm/compute overlap per stage over ``samples`` replays of the lane orders with sampled
    compute durations. ``serial``: a serial plan, whose ranks run one task at a time in the
    planned order whatever the lane ([Note: serial execution] in runtime/executor.py)."""
    ids = list(tasks)
    tl = [tasks[t] for t in ids]
    index = {t: i for i, t in enumerate(ids)}
    n = len(ids)
    lane_prev = [-1] * n
    for order in lane_orders.values():
        for a, b in zip(order, order[1:]):
            lane_prev[index[b]] = index[a]
    tokens = _token_edges(tasks, lane_orders, [tuple(LANES)] if serial else cost.shared_links())
    order, preds = _order(tl, index, lane_prev, {index[b]: index[a] for a, b in tokens})
    p = cfg.parallel
    R = max(1, min(p.ep * p.dp, MAX_RANKS))
    S = samples
    cvs = time_cvs(cfg, cost)
    stages = _by_stage(tl)
    spread = _spread_tasks(tl, stages)
    rng = np.random.default_rng(seed)
    end = np.zeros((n, S, R))
    start0 = np.zeros((n, S))  # rank 0's starts (its overlap)
    zero = np.zeros((S, R))
    wait0: dict[int, np.ndarray] = {}  # per stage, rank 0's wait for the last rank, per sample
    for i in order:
        t = tl[i]
        pr = preds[i]
        st = zero if len(pr) == 0 else end[pr[0]] if len(pr) == 1 else end[pr].max(axis=0)
        start0[i] = st[:, 0]  # rank 0 posts here; a collective's span includes its wait for the others
        if t.kind in SYNC_KINDS and R > 1:
            last = st.max(axis=1)
            wait0[t.stage] = wait0.get(t.stage, 0.0) + (last - st[:, 0])
            st = np.broadcast_to(last[:, None], (S, R))
        cv = cvs.get(t.kind, 0.0) if i in spread else 0.0
        if cv <= 0 or t.duration_us <= 0:
            end[i] = st + t.duration_us
        else:
            sg = math.sqrt(math.log1p(cv * cv))
            end[i] = st + t.duration_us * rng.lognormal(-sg * sg / 2, sg, size=(S, R))
    steps = end.reshape(n, -1).max(axis=0).reshape(S, R).max(axis=1)
    overlap: list[float | None] = []
    dur = np.array([t.duration_us for t in tl])
    for comm, comp in stages.values():
        comm, comp = comm[dur[comm] > 0], comp[dur[comp] > 0]
        ratios = []
        for k in range(S):
            c = merge(np.stack([start0[comm, k], end[comm, k, 0]], axis=1))
            length = float((c[:, 1] - c[:, 0]).sum()) if len(c) else 0.0
            if length <= 0:
                continue
            w = merge(np.stack([start0[comp, k], end[comp, k, 0]], axis=1))
            ratios.append(covered(c, w) / length)
        overlap.append(round(float(np.mean(ratios)), 6) if ratios else None)
    return {"task_time_cv": task_time_cv(cfg),
            "time_cv": {k.value: round(v, 6) for k, v in cvs.items() if v > 0 and v != task_time_cv(cfg)},
            "samples": S, "ranks": R, "seed": seed,
            "step_time_us": round(float(steps.mean()), 3),
            "step_time_p10_us": round(float(np.percentile(steps, 10)), 3),
            "step_time_p90_us": round(float(np.percentile(steps, 90)), 3),
            "comm_overlap_ratio": overlap,
            "sync_wait_us": [round(float(np.mean(wait0[s])), 3) if s in wait0 else None for s in stages]}
