"""Race detector of the runtime: ``k3sched run CONFIG --racecheck`` (and ``--drop-dep C=P``).

[Note: race detector]
The plan promises that two tasks touching the same data are ordered: same lane on the rank, or
a chain of plan dependencies (the executor waits on exactly those; on GPU the lanes' streams
wait on each other's events for exactly those). The detector checks that promise on the run
itself, per rank and per step:

- Recording. While a step runs, every hand-off point ([Note: race detector hooks] in
  moe/handoff.py: ``LayerCtx`` boundary tensors, ``MicroBatch.acts`` / ``grads``, saved-tensor
  entries, gradient accumulation, P2P and all-to-all buffers, offload / onload / FP8 pool
  buffers, gradient shards) reports an access: the task the lane thread runs (the executor
  enters and leaves it, :meth:`RaceChecker.enter`), read or write, and what: a *storage*
  (``untyped_storage`` identity plus a generation, and the byte range of the view) or a *cell*
  (a named slot tasks hand tensors through). A storage is identified by its ``StorageImpl``
  (held by a weak reference for the step, so the address is never recycled within it); a pool
  buffer handed out again starts a new generation (the pool's fence orders its lives). A
  storage's first sighting through a hand-off is its creation (a write); in-place writes are
  recorded where they happen (``param.grad`` accumulation, buffer copies) and, as a net, a
  task whose handed-over tensor's ``_version`` moved while it ran is counted as writing it.
- Happens-before. Task a happens before task b when a path of same-lane order and the
  executor's dependencies (the plan's same-rank ``deps``, the data edges the runtime adds,
  the serial / shared-link tokens; not ``start_deps``, which order starts only) leads from a
  to b, plus the orderings the runtime enforces outside the plan and reports
  (``sync_from``: a buffer fence a task waited on). Computed as ancestor bit sets.
- Verdict. Two accesses of one storage (overlapping bytes) or one cell by two tasks, at least
  one writing, neither task before the other: a race, one line naming both task ids, their
  lanes and the tensor. Every rank checks its own accesses after each step; any race ends the
  run with exit status 1; a clean run prints ``racecheck: N storages, M accesses, no race``
  (summed over ranks and steps).
- Dropped dependencies (``--drop-dep CONSUMER=PRODUCER``). The edge is removed from the
  executor's dependencies before the run (plan and runtime edges alike). A consumer that then
  reads a cell its producer has not filled yet usually fails on the missing value; the
  detector then blames the tasks the plan as given ordered before the consumer but the run
  did not, and that had not finished: a race line, not a traceback.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from k3sched.tasks import LANES

MAX_LINES = 20


@dataclass(frozen=True)
class Race:
    """Two unordered accesses (``a`` before ``b`` in the order they were recorded), or a read of
    an empty cell (``missing``: ``a`` the producer the plan expected, ``b`` the reader)."""

    a: str
    a_lane: str
    a_write: bool
    a_what: str
    b: str
    b_lane: str
    b_write: bool
    b_what: str
    kind: str  # "storage" | "cell" | "missing"
    nbytes: int = 0

    def line(self) -> str:
        if self.kind == "missing":
            return (f"race: {self.b} ({self.b_lane}) read {self.b_what} before {self.a} ({self.a_lane}) wrote it; "
                    f"no happens-before path between them")
        verb = lambda w: "writes" if w else "reads"  # noqa: E731
        same = f"the same storage ({self.nbytes} bytes)" if self.kind == "storage" else "the same cell"
        return (f"race: {self.a} ({self.a_lane}) {verb(self.a_write)} {self.a_what} and {self.b} ({self.b_lane}) "
                f"{verb(self.b_write)} {self.b_what}, {same}; no happens-before path between them")


class RaceFound(RuntimeError):
    """One or more races; the message is the first race's line, ``lines`` all of them."""

    def __init__(self, races: Sequence[Race]):
        self.races = list(races)
        self.lines = [r.line() for r in self.races]
        super().__init__(self.lines[0] if self.lines else "race")


@dataclass
class _Access:
    task: int
    write: bool
    lo: int
    hi: int
    what: str
    seq: int
    missing: bool = False


@dataclass
class StepReport:
    step: int
    races: list[Race]
    storages: int
    accesses: int
    cells: int
    cell_accesses: int


@dataclass
class _Totals:
    storages: int = 0
    accesses: int = 0
    cells: int = 0
    cell_accesses: int = 0
    steps: int = 0
    races: list[Race] = field(default_factory=list)


def _ancestors(ids: Sequence[str], preds: Mapping[str, Iterable[str]]) -> list[int]:
    """Bit set of the (transitive) predecessors of each task, by index in ``ids``; raises
    ValueError on a cycle."""
    index = {t: i for i, t in enumerate(ids)}
    pr = [sorted({index[p] for p in preds.get(t, ()) if p in index and p != t}) for t in ids]
    succ: list[list[int]] = [[] for _ in ids]
    left = [len(p) for p in pr]
    for i, ps in enumerate(pr):
        for p in ps:
            succ[p].append(i)
    anc = [0] * len(ids)
    todo = [i for i, n in enumerate(left) if n == 0]
    done = 0
    while todo:
        i = todo.pop()
        done += 1
        a = 0
        for p in pr[i]:
            a |= anc[p] | (1 << p)
        anc[i] = a
        for s in succ[i]:
            left[s] -= 1
            if left[s] == 0:
                todo.append(s)
    if done != len(ids):
        raise ValueError("the lane orders and dependencies form a cycle")
    return anc


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(lo < h and l2 < hi for lo, hi in a for l2, h in b)


def _first_conflict(mine: list[_Access], other: list[_Access]) -> _Access | None:
    """The access of ``mine`` that conflicts with one of ``other`` (it overlaps a write of
    ``other``, or it is a write overlapping any access of ``other``): its first such write,
    else its first such read (recorded order)."""
    w = [(a.lo, a.hi) for a in other if a.write]
    rw = [(a.lo, a.hi) for a in other]
    hits = [a for a in mine if _overlap([(a.lo, a.hi)], rw if a.write else w)]
    return next((a for a in hits if a.write), hits[0] if hits else None)


class RaceChecker:
    """Records one rank's accesses and checks them against the happens-before order of its
    tasks (see [Note: race detector]).

    ``lanes``: lane -> ordered tasks (objects with ``id``); ``deps``: task id -> the ids it waits
    for (the executor's own list); ``planned_deps``: the same before ``--drop-dep`` (blame of
    missing reads; default ``deps``)."""

    def __init__(self, lanes: Mapping[str, Sequence], deps: Mapping[str, Iterable[str]], *,
                 planned_deps: Mapping[str, Iterable[str]] | None = None, rank: int = 0) -> None:
        self.rank = rank
        self.ids: list[str] = [t.id for lane in LANES for t in lanes.get(lane, ())]
        self.index = {t: i for i, t in enumerate(self.ids)}
        self.lane_of = {t.id: lane for lane in LANES for t in lanes.get(lane, ())}
        self._lane_pred: dict[str, list[str]] = {t: [] for t in self.ids}
        for lane in LANES:
            ts = list(lanes.get(lane, ()))
            for a, b in zip(ts, ts[1:]):
                self._lane_pred[b.id].append(a.id)
        self._deps = {t: [d for d in deps.get(t, ()) if d in self.index] for t in self.ids}
        planned = deps if planned_deps is None else planned_deps
        self._planned = {t: [d for d in planned.get(t, ()) if d in self.index] for t in self.ids}
        self.anc = _ancestors(self.ids, self._preds(self._deps))
        self.planned_anc = self.anc if planned_deps is None else _ancestors(self.ids, self._preds(self._planned))
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._seq = itertools.count()
        self.totals = _Totals()
        self._reset()

    @classmethod
    def for_executor(cls, ex, planned_deps: Mapping[str, Iterable[str]] | None = None) -> RaceChecker:
        """The checker of an :class:`runtime.executor.Executor`'s lanes and dependencies."""
        return cls(ex.lanes, ex.dependencies(), planned_deps=planned_deps, rank=ex.rank)

    def _preds(self, deps: Mapping[str, list[str]]) -> dict[str, list[str]]:
        return {t: self._lane_pred[t] + deps.get(t, []) for t in self.ids}

    def _reset(self) -> None:
        self._acc: dict[tuple, list[_Access]] = {}
        self._live: dict[int, list] = {}  # StorageImpl address -> [weak ref, generation, nbytes]
        self._owners: dict[int, object] = {}
        self._dyn: list[tuple[str, str]] = []
        self._finished: dict[str, int] = {}
        self.step = None

    # -- installation ----------------------------------------------------------------------------
    def install(self) -> None:
        """Make this checker the process's recording hook (moe.handoff.HOOK)."""
        from moe import handoff

        handoff.HOOK = self

    def uninstall(self) -> None:
        from moe import handoff

        if handoff.HOOK is self:
            handoff.HOOK = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[RaceChecker]:
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    # -- task scope (the executor's lane threads) -------------------------------------------------
    def begin_step(self, step: int = 0) -> None:
        with self._lock:
            self._reset()
            self.step = step

    def enter(self, task_id: str) -> None:
        tls = self._tls
        tls.task, tls.stack, tls.reads = task_id, [], []

    def leave(self, task_id: str) -> None:
        """The lane thread finished ``task_id``: tensors it read whose ``_version`` moved while it
        ran were written in place (by it, or by a task running beside it: a race either way)."""
        tls = self._tls
        reads, tls.reads = getattr(tls, "reads", []), []
        for t, version, what in reads:
            try:
                moved = t._version != version
            except RuntimeError:  # inference tensors have no version counter
                moved = False
            if moved:
                self._record(t, "w", what, task_id)
        with self._lock:
            self._finished[task_id] = next(self._seq)
        tls.task = None

    def current(self) -> str | None:
        tls = self._tls
        stack = getattr(tls, "stack", None)
        if stack:
            return stack[-1]
        return getattr(tls, "task", None)

    @contextlib.contextmanager
    def acting_as(self, task_id: str) -> Iterator[None]:
        tls = self._tls
        if not hasattr(tls, "stack"):
            tls.stack = []
        tls.stack.append(task_id)
        try:
            yield
        finally:
            tls.stack.pop()

    # -- recording (moe.handoff calls these) ------------------------------------------------------
    def access(self, t, mode: str, what: str, handed: bool = False) -> None:
        task = self.current()
        if task is None or task not in self.index:
            return
        version = self._record(t, mode, what, task)
        if handed and version is not None and getattr(self._tls, "task", None) == task:
            self._tls.reads.append((t, version, what))

    def _record(self, t, mode: str, what: str, task: str):
        """Append one storage access; returns the tensor's version for a read (None otherwise)."""
        try:
            n = t.numel()
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, AttributeError):
            return None
        if n == 0:
            return None
        es = t.element_size()
        span = 1 + sum((s - 1) * abs(d) for s, d in zip(t.shape, t.stride()))
        lo = t.storage_offset() * es
        hi = lo + span * es
        with self._lock:
            cd = st._cdata
            ent = self._live.get(cd)
            if ent is None:
                from torch.multiprocessing.reductions import StorageWeakRef

                ent = self._live[cd] = [StorageWeakRef(st), 0, st.nbytes()]
            key = ("s", cd, ent[1])
            accs = self._acc.get(key)
            write = mode == "w" or (mode == "p" and not accs)
            if accs is None:
                accs = self._acc[key] = []
            accs.append(_Access(self.index[task], write, lo, hi, what, next(self._seq)))
        if write:
            return None
        try:
            return t._version
        except RuntimeError:
            return None

    def fresh(self, t, what: str) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, AttributeError):
            return
        with self._lock:
            ent = self._live.get(st._cdata)
            if ent is not None:
                ent[1] += 1

    def cell(self, owner, key, write: bool, what: str, present: bool = True) -> None:
        task = self.current()
        if task is None or task not in self.index:
            return
        with self._lock:
            self._owners[id(owner)] = owner  # the id stays this owner's for the step
            self._acc.setdefault(("c", id(owner), key), []).append(
                _Access(self.index[task], write, 0, 1, what, next(self._seq), missing=not write and not present))

    def sync_from(self, task_id: str) -> None:
        task = self.current()
        if task is not None and task_id in self.index and task in self.index:
            with self._lock:
                self._dyn.append((task_id, task))

    # -- verdict ----------------------------------------------------------------------------------
    def races(self, failed: bool = False) -> list[Race]:
        """The races of the step so far (``failed``: the step failed; also blame reads of empty
        cells on dependencies the run dropped)."""
        with self._lock:
            acc = {k: list(v) for k, v in self._acc.items()}
            dyn = list(self._dyn)
            finished = dict(self._finished)
            live = {cd: ent[2] for cd, ent in self._live.items()}
        anc = self.anc
        if dyn:
            deps = {t: list(ds) for t, ds in self._deps.items()}
            for a, b in dyn:
                deps[b].append(a)
            anc = _ancestors(self.ids, self._preds(deps))

        def ordered(i: int, j: int) -> bool:
            return bool((anc[j] >> i) & 1 or (anc[i] >> j) & 1)

        found: dict[tuple[int, int], tuple[int, Race]] = {}
        for key, accs in acc.items():
            if not any(a.write for a in accs):
                continue
            by_task: dict[int, list[_Access]] = {}
            for a in accs:
                by_task.setdefault(a.task, []).append(a)
            tasks = sorted(by_task, key=lambda i: by_task[i][0].seq)
            for x, y in itertools.combinations(tasks, 2):
                pair = (min(x, y), max(x, y))
                if pair in found or ordered(x, y):
                    continue
                ax, ay = by_task[x], by_task[y]
                fx, fy = _first_conflict(ax, ay), _first_conflict(ay, ax)
                if fx is None or fy is None:
                    continue
                kind = "cell" if key[0] == "c" else "storage"
                r = Race(self.ids[x], self.lane_of[self.ids[x]], fx.write, fx.what,
                         self.ids[y], self.lane_of[self.ids[y]], fy.write, fy.what, kind,
                         live.get(key[1], 0) if kind == "storage" else 0)
                found[pair] = (min(fx.seq, fy.seq), r)
        out = [r for _, r in sorted(found.values(), key=lambda sr: sr[0])]
        if failed and not out:
            out = self._blame_missing(acc, anc, finished)
        return out

    def _blame_missing(self, acc: Mapping[tuple, list[_Access]], anc: list[int], finished: Mapping[str, int]
                       ) -> list[Race]:
        """Reads of empty cells whose producer the plan (before ``--drop-dep``) ordered first but
        the run did not, and which had not finished when the cell was read."""
        out: list[Race] = []
        seen: set[tuple[int, int]] = set()
        for accs in acc.values():
            for a in accs:
                if not a.missing:
                    continue
                lost = self.planned_anc[a.task] & ~anc[a.task]
                cands = [i for i in range(len(self.ids)) if (lost >> i) & 1
                         and finished.get(self.ids[i], 1 << 62) > a.seq]
                # the nearest: a candidate no other candidate comes after
                near = [i for i in cands if not any((anc[j] >> i) & 1 for j in cands if j != i)]
                for i in near[:1]:
                    if (i, a.task) in seen:
                        continue
                    seen.add((i, a.task))
                    out.append(Race(self.ids[i], self.lane_of[self.ids[i]], True, a.what, self.ids[a.task],
                                    self.lane_of[self.ids[a.task]], False, a.what, "missing"))
        return out

    def end_step(self, failed: bool = False) -> StepReport:
        """Check the step; add its counts to :attr:`totals`; forget its accesses."""
        races = self.races(failed)
        with self._lock:
            storages = [k for k in self._acc if k[0] == "s"]
            cells = [k for k in self._acc if k[0] == "c"]
            rep = StepReport(self.step if self.step is not None else 0, races, len(storages),
                             sum(len(self._acc[k]) for k in storages), len(cells),
                             sum(len(self._acc[k]) for k in cells))
            self._reset()
        tt = self.totals
        tt.storages += rep.storages
        tt.accesses += rep.accesses
        tt.cells += rep.cells
        tt.cell_accesses += rep.cell_accesses
        tt.steps += 1
        tt.races += races
        return rep


def clean_line(storages: int, accesses: int) -> str:
    return f"racecheck: {storages} storages, {accesses} accesses, no race"


# -- --drop-dep ------------------------------------------------------------------------------------
def parse_drop(spec: str) -> tuple[str, str]:
    """``CONSUMER=PRODUCER`` (two task ids) -> (consumer, producer); ValueError naming the flag."""
    c, sep, p = spec.partition("=")
    c, p = c.strip(), p.strip()
    if not sep or not c or not p:
        raise ValueError(f"--drop-dep {spec!r}: expected CONSUMER=PRODUCER (two task ids, e.g. "
                         f"s0/mb0/L1/router.bwd=s0/mb0/L1/shared.dx)")
    return c, p


def check_drops(drops: Iterable[str], deps_of: Mapping[str, Iterable[str]]) -> list[tuple[str, str]]:
    """Validate ``--drop-dep`` specs against ``deps_of`` (task id -> same-stage dependencies the
    runtime waits on, over every stage); ValueError (one line) naming the first bad one."""
    out = []
    for spec in drops:
        c, p = parse_drop(spec)
        if c not in deps_of:
            raise ValueError(f"--drop-dep {spec}: the plan has no task {c}")
        if p not in set(deps_of[c]):
            have = ", ".join(sorted(deps_of[c])) or "none"
            raise ValueError(f"--drop-dep {spec}: {c} does not wait for {p} on its rank (its dependencies: {have})")
        out.append((c, p))
    return out


def apply_drops(lanes: Mapping[str, list], extra: Mapping[str, tuple[str, ...]], drops: Iterable[tuple[str, str]]
                ) -> tuple[dict[str, list], dict[str, tuple[str, ...]]]:
    """``lanes`` (PlanTask lists) and runtime ``extra`` dependencies without the dropped edges
    (edges of tasks not in ``lanes`` are ignored: another stage's)."""
    import dataclasses

    drop: dict[str, set[str]] = {}
    for c, p in drops:
        drop.setdefault(c, set()).add(p)
    new_lanes = {lane: [dataclasses.replace(t, deps=tuple(d for d in t.deps if d not in drop[t.id]),
                                            start_deps=tuple(d for d in t.start_deps if d not in drop[t.id]))
                        if t.id in drop else t for t in ts] for lane, ts in lanes.items()}
    new_extra = {tid: tuple(d for d in ds if d not in drop.get(tid, ())) for tid, ds in extra.items()}
    return new_lanes, new_extra


def same_stage_deps(lanes: Mapping[str, list], extra: Mapping[str, tuple[str, ...]], stage: int
                    ) -> dict[str, tuple[str, ...]]:
    """Task id -> the same-stage dependencies the executor will wait on (plan ``deps`` and
    ``start_deps`` on this stage, plus the runtime's ``extra``)."""
    prefix = f"s{stage}/"
    return {t.id: tuple(dict.fromkeys([d for d in t.deps if d.startswith(prefix)] + list(t.start_deps)
                                      + list(extra.get(t.id, ()))))
            for ts in lanes.values() for t in ts}


def launch_args(doc: Mapping, racecheck: bool, drops: Sequence[str] | None) -> list[str]:
    """``runtime.train`` arguments for ``--racecheck`` / ``--drop-dep`` (checked against the plan
    ``doc`` before launching: ValueError, one line, for an edge no rank waits on)."""
    out = ["--racecheck"] if racecheck else []
    if drops:
        from k3sched.lowering import stage_lanes
        from .stage import StageRunner

        deps: dict[str, tuple[str, ...]] = {}
        for st in doc["stages"]:
            lanes = stage_lanes(doc, st["stage"])
            deps.update(same_stage_deps(lanes, StageRunner.extra_deps(lanes), st["stage"]))
        check_drops(drops, deps)
        for d in drops:
            out += ["--drop-dep", d]
    return out


__all__ = ["Race", "RaceChecker", "RaceFound", "StepReport", "apply_drops", "check_drops", "clean_line",
           "launch_args", "parse_drop", "same_stage_deps"]
