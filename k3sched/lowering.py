"""Lowering: one rank's part of plan.json -> the :class:`LaneProgram` its executor runs (no torch).

[Note: lowering]
plan.json lists, per PP stage, each lane's tasks in order, their ``deps`` (on any stage) and the
stage's ``start_deps``. What a rank runs differs from that in a few set ways; each is a named
pass here, and the runtime's executor (runtime/executor.py) and the P2P check
(k3sched/p2pcheck.py) both take the result, so the check replays exactly what runs:

1. :func:`rank_start_deps`: the start dependencies of this rank, same-rank ones only. The
   prefetch trigger of a remote onload is planned as a start dependency of the peer's
   act.rserve on the owner's backward task, which the peer cannot wait on: the owner's
   act.ronload waits for it instead (its receive then completes once the peer has served).
2. :func:`read_lanes`: the stage's lanes as :class:`PlanTask` lists (plan order), each task
   carrying its start dependencies from pass 1 (:func:`stage_lanes` is passes 1 and 2).
3. :func:`plan_deps`: each task's ``deps`` on this rank, once each. Dependencies on other
   stages are satisfied by the P2P task itself (a receive waits for its send); a same-rank
   dependency or start dependency that names no task of the rank is an error.
4. :func:`data_edges`: more same-rank data edges the plan leaves implicit, after the plan's:
   :func:`implied_edges`, the step table's edges the plan implies only through other stages
   ([Note: step table] in k3sched/steptable.py). The runtime's executor and the P2P check both
   lower with them; a debug run may drop some (``--drop-dep``, runtime/racecheck.py).
5. :func:`serial_tokens` (strategy ``serial``: one task at a time on the rank) or
   :func:`link_tokens` (the lanes of each plan.json ``shared_links`` group one at a time): a
   token passed along :func:`token_order` of the group's tasks, as one more dependency of each
   task on the one before it ([Note: serial execution] in runtime/executor.py).

:func:`lower` runs passes 3 to 5 on lanes the caller may have changed (a perturbed lane order or
dropped edges, runtime debug switches); :func:`lower_stage` lowers a plan.json stage with the
plan's strategy and shared links.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .planfile import PlanTask
from .steptable import runtime_deps
from .tasks import LANES


class LoweringError(ValueError):
    """A stage the lowering cannot turn into a lane program; one line naming the task."""


Lanes = Mapping[str, Sequence[PlanTask]]
Deps = dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class LaneProgram:
    """One rank's lowered lanes ([Note: lowering]): what its executor runs, what the P2P check replays.

    ``lanes``: every lane of :data:`~k3sched.tasks.LANES`, its tasks in run order; a task's
    ``start_deps`` are the same-rank tasks that must have started before it starts. ``deps``: task
    id -> the same-rank tasks it waits to finish (plan deps, data edges, then tokens), once each."""

    stage: int
    lanes: dict[str, list[PlanTask]]
    deps: Deps

    def tasks(self) -> dict[str, PlanTask]:
        return {t.id: t for ts in self.lanes.values() for t in ts}


def rank_start_deps(start_deps: Mapping[int, Mapping[str, Sequence[str]]], stage: int) -> Deps:
    """Pass 1: task id -> its start dependencies on ``stage``, from every stage's plan.json
    ``start_deps`` (stage -> task id -> ids); a peer's act.rserve trigger on this stage moves to
    this stage's act.ronload of the same set, after the ronload's own."""
    prefix = f"s{stage}/"
    start = {tid: list(ds) for tid, ds in start_deps.get(stage, {}).items()}
    for other, deps in start_deps.items():
        if other == stage:
            continue
        for tid, ds in deps.items():
            if tid.endswith("/act.rserve"):
                mine = [d for d in ds if d.startswith(prefix)]
                if mine:
                    ron = prefix + tid.split("/", 1)[1].replace("act.rserve", "act.ronload")
                    start[ron] = start.get(ron, []) + mine
    out = {tid: tuple(d for d in ds if d.startswith(prefix)) for tid, ds in start.items()}
    return {tid: ds for tid, ds in out.items() if ds}


def read_lanes(entry: Mapping, start: Mapping[str, tuple[str, ...]]) -> dict[str, list[PlanTask]]:
    """Pass 2: a plan.json stage entry's lanes (every lane of LANES, plan order) as PlanTasks with
    the start dependencies ``start`` (:func:`rank_start_deps`)."""
    return {lane: [PlanTask.from_json(t, tuple(start.get(t["id"], ()))) for t in entry["lanes"].get(lane, [])]
            for lane in LANES}


def stage_lanes(plan: Mapping, stage: int) -> dict[str, list[PlanTask]]:
    """The ordered tasks of each lane of ``stage`` from a plan.json dict (passes 1 and 2)."""
    entry = next((s for s in plan["stages"] if s["stage"] == stage), None)
    if entry is None:
        raise ValueError(f"plan has no stage {stage} (stages: {[s['stage'] for s in plan['stages']]})")
    starts = {int(s["stage"]): s.get("start_deps") or {} for s in plan["stages"]}
    return read_lanes(entry, rank_start_deps(starts, stage))


def plan_deps(lanes: Lanes, stage: int) -> Deps:
    """Pass 3: task id -> its plan ``deps`` on ``stage`` (plan order, once each). Raises
    :class:`LoweringError` for a same-stage dependency or start dependency that is no task here."""
    prefix = f"s{stage}/"
    tasks = {t.id for ts in lanes.values() for t in ts}
    out: Deps = {}
    for ts in lanes.values():
        for t in ts:
            local = tuple(dict.fromkeys(d for d in t.deps if d.startswith(prefix)))
            missing = [d for d in local + tuple(t.start_deps) if d not in tasks]
            if missing:
                raise LoweringError(f"task {t.id}: dependency {missing[0]} is not a task of stage {stage}")
            out[t.id] = local
    return out


def data_edges(lanes: Lanes, deps: Mapping[str, tuple[str, ...]], extra: Mapping[str, Sequence[str]]) -> Deps:
    """Pass 4: ``deps`` with the ``extra`` data edges (task id -> ids) that name tasks of
    ``lanes`` appended, once each."""
    tasks = {t.id for ts in lanes.values() for t in ts}
    out = dict(deps)
    for tid, ds in extra.items():
        if tid in out:
            out[tid] = tuple(dict.fromkeys(out[tid] + tuple(d for d in ds if d in tasks)))
    return out


def linear_extension(lanes: Mapping[str, Sequence], deps: Mapping[str, tuple[str, ...]]
                     ) -> tuple[list[str], str | None]:
    """One order of every task of ``lanes`` that keeps each lane's order and every dependency
    among them (``deps`` plus each task's ``start_deps``), earliest planned start first; ties by
    planned (start, end), then lane, then position. Reads ``id``, ``start_us``, ``end_us`` and
    ``start_deps`` of a task. Returns (order, None), or (the order so far, a task on a cycle)
    when the precedences cycle."""
    pos = {t.id: (li, i) for li, lane in enumerate(LANES) for i, t in enumerate(lanes.get(lane, []))}
    task = {t.id: t for ts in lanes.values() for t in ts}
    preds: dict[str, set[str]] = {tid: set() for tid in task}
    for ts in lanes.values():
        for a, b in zip(ts, ts[1:]):
            preds[b.id].add(a.id)
    for tid, t in task.items():
        preds[tid].update(d for d in list(deps.get(tid, ())) + list(t.start_deps) if d in task)
    succs: dict[str, list[str]] = {tid: [] for tid in task}
    for tid, ps in preds.items():
        for d in ps:
            succs[d].append(tid)
    left = {tid: len(ps) for tid, ps in preds.items()}

    def key(tid: str) -> tuple:
        t = task[tid]
        return (t.start_us, t.end_us, *pos[tid], tid)

    heap = [key(tid) for tid, n in left.items() if n == 0]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        tid = heapq.heappop(heap)[-1]
        order.append(tid)
        for s in succs[tid]:
            left[s] -= 1
            if left[s] == 0:
                heapq.heappush(heap, key(s))
    if len(order) != len(task):
        return order, min((tid for tid, n in left.items() if n), key=key)
    return order, None


def token_order(lanes: Lanes, deps: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The order a token visits the tasks of ``lanes`` (:func:`linear_extension`); raises
    :class:`LoweringError` naming a task when the lane orders and dependencies cycle."""
    order, stuck = linear_extension(lanes, deps)
    if stuck is not None:
        raise LoweringError(f"task {stuck}: its lane order and same-stage dependencies form a cycle "
                            "(no token order exists)")
    return order


def tokens(lanes: Lanes, deps: Mapping[str, tuple[str, ...]], group: Sequence[str]) -> Deps:
    """``deps`` with one token passed among the lanes of ``group``: each task of them also waits
    for the task before it in :func:`token_order` (so they run one at a time)."""
    out = dict(deps)
    order = token_order({lane: lanes[lane] for lane in group}, out)
    for prev, tid in zip(order, order[1:]):
        if prev not in out[tid]:
            out[tid] += (prev,)
    return out


def serial_tokens(lanes: Lanes, deps: Mapping[str, tuple[str, ...]]) -> Deps:
    """Pass 5, strategy ``serial``: one token over every lane (one task at a time on the rank)."""
    return tokens(lanes, deps, LANES)


def link_tokens(lanes: Lanes, deps: Mapping[str, tuple[str, ...]], shared_links: Sequence[Sequence[str]]) -> Deps:
    """Pass 5, other strategies: one token per group of lanes that share a link ([Note: shared
    links] in k3sched/cost.py), group after group (a later group's order sees the earlier tokens)."""
    out = dict(deps)
    for group in shared_links:
        out = tokens(lanes, out, tuple(group))
    return out


def implied_edges(lanes: Lanes) -> Deps:
    """The data edges of pass 4 that the step table knows and ``lanes`` lack: each task's
    same-(mb, layer) dependencies of :func:`k3sched.steptable.runtime_deps` (planned and implied
    edges) that its planned ``deps`` do not list. The plan implies them only transitively, often
    through another stage, which one rank's program does not see."""
    ids = {t.id for ts in lanes.values() for t in ts}
    table = runtime_deps()
    out: Deps = {}
    for ts in lanes.values():
        for t in ts:
            if t.mb is None or t.layer is None:
                continue
            prefix = t.id.rsplit("/", 1)[0]
            extra = tuple(d for d in (f"{prefix}/{k.value}" for k in table.get(t.kind, ()))
                          if d in ids and d not in t.deps)
            if extra:
                out[t.id] = extra
    return out


def lower(lanes: Lanes, stage: int, *, extra: Mapping[str, Sequence[str]] | None = None, serial: bool = False,
          shared_links: Sequence[Sequence[str]] = ()) -> LaneProgram:
    """Passes 3 to 5 on ``lanes`` (per lane, in run order) of ``stage``: the lane program.
    ``extra``: data edges for :func:`data_edges`; ``serial``: :func:`serial_tokens`, else
    :func:`link_tokens` over ``shared_links``."""
    full = {lane: list(lanes.get(lane, [])) for lane in LANES}
    deps = data_edges(full, plan_deps(full, stage), extra or {})
    deps = serial_tokens(full, deps) if serial else link_tokens(full, deps, shared_links)
    return LaneProgram(stage, full, deps)


def lower_stage(plan: Mapping, stage: int, lanes: Lanes | None = None,
                extra: Mapping[str, Sequence[str]] | None = None) -> LaneProgram:
    """The lane program of ``stage`` of a plan.json dict, with the plan's strategy and shared links.
    ``lanes``: the stage's lanes when the caller changed them (default :func:`stage_lanes`);
    ``extra``: the data edges of pass 4 (default :func:`implied_edges` of the lanes)."""
    lanes = stage_lanes(plan, stage) if lanes is None else lanes
    return lower(lanes, stage, extra=implied_edges(lanes) if extra is None else extra,
                 serial=plan.get("strategy") == "serial", shared_links=plan.get("shared_links", ()))
