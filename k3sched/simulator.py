"""Deterministic discrete-event evaluation of a given lane order.

Given every task's duration and dependencies and, per (stage, lane), the order in which the lane
runs its tasks, :func:`simulate` computes each task's start and end: a task starts when its lane
has finished the previous task in the order and every dependency has ended. That is a longest
path over the DAG formed by dependency edges plus lane-order edges, evaluated in one topological
sweep (O(tasks + edges)). A cycle means the order deadlocks; the error names the tasks on it.

:func:`memory_timeline` then replays the memory effects (``alloc`` at start, ``free`` at end) in
(time, frees-before-allocs, sequence) order, so ties break the same way every run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from .tasks import Task

LaneKey = tuple[int, str]  # (stage, lane)


class DeadlockError(RuntimeError):
    """The lane orders and dependencies form a cycle (the step would hang)."""


@dataclass
class MemoryTimeline:
    """Memory in use over time for one stage and one space (device / host / peer)."""

    times_us: np.ndarray
    bytes: np.ndarray
    base: int = 0

    @property
    def peak(self) -> int:
        return int(self.bytes.max()) if self.bytes.size else self.base


def simulate(tasks: Mapping[str, Task], lane_orders: Mapping[LaneKey, Sequence[str]]) -> float:
    """Set ``start_us``/``end_us`` of every task from the lane orders; returns the step time.

    Every task must appear in exactly one lane order. Raises :class:`DeadlockError` on a cycle and
    ``KeyError``/``ValueError`` naming the task when an order or dependency names an unknown task.
    """
    ids = list(tasks)
    index = {tid: i for i, tid in enumerate(ids)}
    n = len(ids)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = np.zeros(n, dtype=np.int64)
    seen = np.zeros(n, dtype=bool)
    for key, order in lane_orders.items():
        prev = -1
        for tid in order:
            i = index.get(tid)
            if i is None:
                raise KeyError(f"lane order {key} names unknown task {tid!r}")
            if seen[i]:
                raise ValueError(f"task {tid!r} appears twice in the lane orders")
            seen[i] = True
            if prev >= 0:
                succ[prev].append(i)
                indeg[i] += 1
            prev = i
    if not seen.all():
        missing = ids[int(np.argmin(seen))]
        raise ValueError(f"task {missing!r} is in no lane order")
    dur = np.empty(n)
    for i, tid in enumerate(ids):
        t = tasks[tid]
        dur[i] = t.duration_us
        for d in t.deps:
            j = index.get(d)
            if j is None:
                raise KeyError(f"task {tid!r} depends on unknown task {d!r}")
            succ[j].append(i)
            indeg[i] += 1
    start = np.zeros(n)
    end = np.zeros(n)
    queue = deque(int(i) for i in np.flatnonzero(indeg == 0))
    done = 0
    while queue:
        i = queue.popleft()
        end[i] = start[i] + dur[i]
        done += 1
        e = end[i]
        for j in succ[i]:
            if e > start[j]:
                start[j] = e
            indeg[j] -= 1
            if indeg[j] == 0:
                queue.append(j)
    if done != n:
        stuck = [ids[i] for i in np.flatnonzero(indeg > 0)[:6]]
        raise DeadlockError(f"lane order deadlocks: {n - done} tasks never become ready, e.g. {', '.join(stuck)}")
    for i, tid in enumerate(ids):
        tasks[tid].start_us = float(start[i])
        tasks[tid].end_us = float(end[i])
    return float(end.max()) if n else 0.0


SPACES = ("device", "host", "peer")


def memory_timeline(tasks: Iterable[Task], base: Mapping[tuple[int, str], int] | None = None
                    ) -> dict[tuple[int, str], MemoryTimeline]:
    """Bytes in use over time per (stage, space). Remote offload bytes count as ``peer`` memory
    of the stage that holds them (``task.peer_stage``), not of the stage that sent them; a task's
    ``release`` frees device bytes of another stage at its end (a receive, its send's buffer). Frees
    at an instant come before allocations at the same instant; then creation order (the events
    themselves: :class:`MemoryEvents`)."""
    tasks = list(tasks)
    for t in tasks:
        assert t.start_us is not None and t.end_us is not None, f"{t.id} not scheduled"
    return MemoryEvents(tasks).timeline([t.start_us for t in tasks], [t.end_us for t in tasks], (), base)


class MemoryEvents:
    """The memory events of a fixed list of tasks (an allocation at a task's start, a free at its
    end, per (stage, space)), laid out once as arrays, so that the timelines for new start and end
    times, and for the tasks not skipped, cost a few numpy passes: the planner's offload search
    schedules one graph many times (k3sched/planner.py ``_Search``). :func:`memory_timeline` is
    its one-shot use."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        codes: dict[tuple[int, str], int] = {}
        task: list[int] = []
        key: list[int] = []
        at_start: list[bool] = []
        delta: list[int] = []

        def event(i: int, k: tuple[int, str], start: bool, d: int) -> None:
            task.append(i)
            key.append(codes.setdefault(k, len(codes)))
            at_start.append(start)
            delta.append(d)

        for i, t in enumerate(tasks):  # the order of memory_timeline's appends
            a, f = t.alloc, t.free
            if a.device:
                event(i, (t.stage, "device"), True, a.device)
            if f.device:
                event(i, (t.stage, "device"), False, -f.device)
            if a.host:
                event(i, (t.stage, "host"), True, a.host)
            if f.host:
                event(i, (t.stage, "host"), False, -f.host)
            if t.release is not None and t.release[1]:
                event(i, (t.release[0], "device"), False, -t.release[1])
            owner = t.peer_stage if t.peer_stage is not None else t.stage
            if a.peer:
                event(i, (owner, "peer"), True, a.peer)
            if f.peer:
                event(i, (owner, "peer"), False, -f.peer)
        self.n = len(tasks)
        self.keys = list(codes)
        self.task = np.asarray(task, dtype=np.int64)
        self.key = np.asarray(key, dtype=np.int64)
        self.at_start = np.asarray(at_start, dtype=bool)
        self.delta = np.asarray(delta, dtype=np.int64)

    def timeline(self, start_us: Sequence[float], end_us: Sequence[float], skip: Iterable[int] = (),
                 base: Mapping[tuple[int, str], int] | None = None) -> dict[tuple[int, str], MemoryTimeline]:
        """``memory_timeline`` of the tasks not in ``skip``, task i running [start_us[i], end_us[i])."""
        base = dict(base or {})
        keep = np.ones(self.n, dtype=bool)
        skip = np.fromiter(skip, dtype=np.int64)
        keep[skip] = False
        sel = np.flatnonzero(keep[self.task])
        ti = self.task[sel]
        times = np.where(self.at_start[sel], np.asarray(start_us, dtype=float)[ti], np.asarray(end_us, dtype=float)[ti])
        keys, kinds = self.key[sel], self.at_start[sel].astype(np.int64)
        order = np.lexsort((sel, kinds, times, keys))  # by key, then (time, frees first, creation)
        keys, times, deltas = keys[order], times[order], self.delta[sel][order]
        bounds = np.searchsorted(keys, np.arange(len(self.keys) + 1))
        present = {self.keys[c]: (bounds[c], bounds[c + 1]) for c in range(len(self.keys)) if bounds[c + 1] > bounds[c]}
        out: dict[tuple[int, str], MemoryTimeline] = {}
        for k in sorted(set(present) | set(base)):
            b = base.get(k, 0)
            if k not in present:
                out[k] = MemoryTimeline(np.zeros(0), np.array([b]), base=b)
                continue
            lo, hi = present[k]
            out[k] = MemoryTimeline(times[lo:hi], b + np.cumsum(deltas[lo:hi]), base=b)
        return out
