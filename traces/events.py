"""The one event table every reader returns, and the one error every reader raises.

[Note: event table]
``EventTable`` is a small column store: one numpy array per column, all of equal length.

========== ========= ================================================================
column     dtype     meaning
========== ========= ================================================================
name       object    range text (a task id for k3sched ranges), kernel or copy name
rank       int32     rank (process) the event belongs to, 0..n-1
device     int32     CUDA device of GPU events, -1 for CPU (NVTX / annotation) events
tid        int64     OS thread id for CPU events, CUDA stream id for GPU events
start_us   float64   start, microseconds on the trace's clock
end_us     float64   end, microseconds
kind       <U8       one of KINDS
bytes      int64     bytes moved (memcpy / memset / runtime task with ``args.bytes``), else 0
parent     object    innermost enclosing CPU range on the launching thread ('' if none)
========== ========= ================================================================

Tables are built column-wise (SQL result sets, numpy); nothing loops over rows in Python.
Besides the columns a table carries ``bad_events``: how many malformed events the reader dropped
(only when asked to, see [Note: malformed events]); ``concat`` sums it, row selections keep it.

[Note: malformed events]
Every reader checks the values it reads, column-wise, and counts each event with a broken value
once (the first broken value, by the checks' order, is its reason):

- times (``ts``, ``dur``, nsys ``start`` / ``end``): numbers, finite, ``0 <= t < 2**53`` µs
  (MAX_TIME_US: 285 years, where float64 is still exact to the µs), and end >= start;
- ranks (``otherData.rank``, ``distributedInfo.rank``, a ``pid`` read as a rank, an nsys
  ``k3sched.rank=N`` mark): integers ``0 <= rank < 2**20`` (MAX_RANK);
- task ids / names: strings; ``args``: an object (or absent / null); ``bytes``: an integer >= 0;
- thread, stream and device ids: integers that fit their column (Kineto and the runtime trace
  also accept a string label, as Chrome traces do); SQLite columns must not hold text or NULL
  where the reader needs a number;
- memory counters (``ph: "C"`` named ``memory``): every ``args`` value a finite number >= 0.

Events that are legitimately not tasks (metadata ``M``, other counters, instant / flow events,
kernels without an enclosing range, categories a reader does not read) are not checked and not
counted. A trace with malformed events raises one ``TraceError`` naming the file, the count and
the first bad event (its position and reason), unless the reader is called with
``skip_bad_events=True``: then they are dropped and counted in ``EventTable.bad_events``. When
nothing valid is left (every event it would read is malformed) it is a ``TraceError`` either way.
A file with no events at all reads as an empty table.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

KINDS: tuple[str, ...] = ("range", "gpurange", "kernel", "nccl", "memcpy", "memset")
NCCL_PREFIXES: tuple[str, ...] = ("ncclKernel", "ncclDevKernel")
COLUMNS: tuple[str, ...] = ("name", "rank", "device", "tid", "start_us", "end_us", "kind", "bytes", "parent")
MAX_RANK = 1 << 20
"""Ranks are integers 0 <= rank < MAX_RANK (2**20)."""
MAX_TIME_US = 2.0 ** 53
"""Times are finite, 0 <= t < MAX_TIME_US (2**53 µs, 285 years)."""
ALLOWED_TIME = "allowed: a finite number 0 <= t < 2^53 µs"
ALLOWED_RANK = f"allowed: an integer 0 <= rank < 2^20 = {MAX_RANK}"


class TraceError(Exception):
    """A trace (or plan) file that cannot be read. ``str(err)`` is one line naming the file."""


@dataclass
class EventTable:
    name: np.ndarray
    rank: np.ndarray
    device: np.ndarray
    tid: np.ndarray
    start_us: np.ndarray
    end_us: np.ndarray
    kind: np.ndarray
    bytes: np.ndarray
    parent: np.ndarray
    bad_events: int = 0
    """Malformed events the reader dropped (``skip_bad_events=True``); 0 when none."""

    def __post_init__(self) -> None:
        n = len(self.name)
        for c in COLUMNS:
            col = getattr(self, c)
            if len(col) != n:
                raise ValueError(f"EventTable column {c!r} has {len(col)} rows, expected {n}")

    def __len__(self) -> int:
        return len(self.name)

    @classmethod
    def build(cls, *, name, start_us, end_us, kind, rank=0, device=-1, tid=0, bytes=0,
              parent="") -> "EventTable":
        """Build from columns; scalars broadcast. ``kind`` may be a scalar string."""
        name = np.asarray(name, dtype=object)
        n = len(name)

        def col(v, dtype):
            a = np.asarray(v, dtype=dtype)
            return np.full(n, a, dtype=dtype) if a.ndim == 0 else a

        return cls(name=name, rank=col(rank, np.int32), device=col(device, np.int32), tid=col(tid, np.int64),
                   start_us=col(start_us, np.float64), end_us=col(end_us, np.float64),
                   kind=col(kind, "<U8"), bytes=col(bytes, np.int64), parent=col(parent, object))

    @classmethod
    def empty(cls) -> "EventTable":
        return cls.build(name=[], start_us=[], end_us=[], kind=[])

    @classmethod
    def concat(cls, tables: "list[EventTable]") -> "EventTable":
        if not tables:
            return cls.empty()
        return cls(**{c: np.concatenate([getattr(t, c) for t in tables]) for c in COLUMNS},
                   bad_events=sum(t.bad_events for t in tables))

    def take(self, idx) -> "EventTable":
        """Rows selected by a boolean mask or an index array (``bad_events`` is kept)."""
        return EventTable(**{c: getattr(self, c)[idx] for c in COLUMNS}, bad_events=self.bad_events)

    def sorted(self) -> "EventTable":
        """Rows ordered by (rank, start_us)."""
        return self.take(np.lexsort((self.start_us, self.rank)))

    def to_records(self) -> np.ndarray:
        """The table as one numpy structured array (names as Python str objects)."""
        dt = [(c, getattr(self, c).dtype) for c in COLUMNS]
        out = np.empty(len(self), dtype=dt)
        for c in COLUMNS:
            out[c] = getattr(self, c)
        return out

    def counts(self, *by: str) -> dict:
        """Row counts grouped by the given columns, e.g. ``t.counts("kind")`` or
        ``t.counts("device", "tid")``; keys are tuples (a scalar for one column)."""
        cols = [getattr(self, b) for b in by]
        if not len(self):
            return {}
        keys, cnt = np.unique(np.rec.fromarrays([c.astype(str) if c.dtype == object else c for c in cols]),
                              return_counts=True)
        out = {}
        for k, c in zip(keys.tolist(), cnt.tolist()):
            out[k[0] if len(by) == 1 else tuple(k)] = c
        return out


# ---- value checks shared by the readers ([Note: malformed events]) -----------------------

MISSING = object()
"""Placeholder for a key an event lacks (shown as ``missing``)."""

Check = tuple  # (bad mask over the rows, reason(row) -> str)


def show(v, sql: bool = False) -> str:
    """A value as the file has it, on one line, at most 40 characters (JSON spelling, or SQL's
    with ``sql``: NULL, 'text')."""
    if v is MISSING:
        return "missing"
    if sql:
        t = "NULL" if v is None else f"<{len(v)}-byte blob>" if isinstance(v, bytes) else repr(v)
    else:
        try:
            t = json.dumps(v)
        except (TypeError, ValueError):
            t = repr(v)
    return t if len(t) <= 40 else t[:37] + "..."


def as_float(vals: list) -> tuple[np.ndarray, np.ndarray]:
    """float64 column of Python values, and the mask of those that are not numbers (None, text,
    bool, containers: NaN there). An integer too large for a float becomes +-inf."""
    n = len(vals)
    if set(map(type, vals)) <= {int, float}:
        try:
            return np.array(vals, dtype=np.float64), np.zeros(n, bool)
        except OverflowError:
            pass
    out = np.full(n, np.nan)
    notnum = np.zeros(n, bool)
    for i, v in enumerate(vals):
        if isinstance(v, (bool, np.bool_)):
            notnum[i] = True
        elif isinstance(v, (int, np.integer)):
            try:
                out[i] = float(v)
            except OverflowError:
                out[i] = np.inf if v > 0 else -np.inf
        elif isinstance(v, (float, np.floating)):
            out[i] = float(v)
        else:
            notnum[i] = True
    return out, notnum


_I64 = (-(1 << 63), 1 << 63)


def to_int(v, labels: bool = False) -> int | None:
    """An integer, an integral finite float, or with ``labels`` a string (its digits, else a
    stable hash: Chrome traces name threads and streams by text too); None for anything else."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return int(v) if np.isfinite(v) and float(v).is_integer() else None
    if labels and isinstance(v, str):
        digits = "".join(ch for ch in v if "0" <= ch <= "9")
        x = int(digits) if digits else -1
        return x if 0 <= x < (1 << 31) else zlib.crc32(v.encode("utf-8", "replace")) & 0x7FFFFFFF
    return None


def as_int(vals: list, lo: int = _I64[0], hi: int = _I64[1], labels: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """int64 column of Python values, and the mask of those that are not integers in
    ``lo <= v < hi`` (see :func:`to_int`; 0 there)."""
    n = len(vals)
    if set(map(type, vals)) <= {int}:
        try:
            a = np.array(vals, dtype=np.int64)
        except OverflowError:
            a = None
        if a is not None:
            bad = np.zeros(n, bool)
            if lo > _I64[0]:
                bad |= a < lo
            if hi < _I64[1]:
                bad |= a >= hi
            return (np.where(bad, 0, a) if bad.any() else a), bad
    out = np.zeros(n, np.int64)
    bad = np.zeros(n, bool)
    for i, v in enumerate(vals):
        x = to_int(v, labels)
        if x is None or not lo <= x < hi:
            bad[i] = True
        else:
            out[i] = x
    return out, bad


def time_checks(label: str, vals: list, a: np.ndarray, notnum: np.ndarray, sql: bool = False,
                scale: float = 1.0) -> list[Check]:
    """Checks of a time column ``a`` (``scale`` file units per µs): a number, finite, >= 0,
    below MAX_TIME_US."""
    fin = np.isfinite(a)

    def why(what):
        return lambda i: (f"{label} is missing" if vals[i] is MISSING else f"{label} {show(vals[i], sql)} {what}") \
            + f" ({ALLOWED_TIME})"

    inf = why("is not finite")
    big = why("is too large")
    return [(notnum, why("is not a number")), (~notnum & ~fin, lambda i: (big if type(vals[i]) is int else inf)(i)),
            (fin & (a < 0), why("is negative")), (fin & (a >= MAX_TIME_US * scale), why("is too large"))]


class BadEvents:
    """The malformed events met while reading one file: how many, and the first one (by
    position) with its reason. See [Note: malformed events]."""

    def __init__(self, path) -> None:
        self.path = path
        self.count = 0
        self.first: tuple | None = None  # ((order, position), "event 17: dur -5 is negative (...)")

    def check(self, checks: list[Check], pos: np.ndarray, where: Callable[[int], str], order: int = 0) -> np.ndarray:
        """Count the rows any check flags (once each); remember the first by ``(order, pos)``,
        with the reason of its first failing check; ``where(pos)`` names a row ('event 17').
        Returns the mask of good rows."""
        bad = np.zeros(len(pos), bool)
        for m, _ in checks:
            bad |= m
        k = int(np.count_nonzero(bad))
        if k:
            self.count += k
            idx = np.flatnonzero(bad)
            i = int(idx[np.argmin(pos[idx])])
            key = (order, int(pos[i]))
            if self.first is None or key < self.first[0]:
                reason = next(r(i) for m, r in checks if m[i])
                self.first = (key, f"{where(int(pos[i]))}: {reason}")
        return ~bad

    def one(self, pos: int, where: Callable[[int], str], reason: str, order: int = 0) -> None:
        """Count one malformed event."""
        self.check([(np.ones(1, bool), lambda i: reason)], np.array([pos], np.int64), where, order)

    def finish(self, table: "EventTable", skip: bool) -> "EventTable":
        """The table read, with ``bad_events`` set; TraceError when events were malformed and
        ``skip`` is false, or when nothing valid is left."""
        if not self.count:
            return table
        n, first = self.count, self.first[1]
        if not len(table):
            raise TraceError(f"{self.path}: {n} malformed event{'s' * (n != 1)} and no valid event to read "
                             f"(first: {first})")
        if not skip:
            raise TraceError(f"{self.path}: {n} malformed event{'s' * (n != 1)} (first: {first}); "
                             f"pass --skip-bad-events to drop them")
        table.bad_events += n
        return table


def classify_kernels(names: np.ndarray) -> np.ndarray:
    """'nccl' for NCCL kernels (name starts with ncclKernel / ncclDevKernel, after an optional
    'void '), else 'kernel'. Each distinct name is classified once (a dict, not np.unique: kernel
    names are long, and sorting them as fixed-width unicode costs more than the whole read)."""
    memo: dict = {}

    def kind(n) -> str:
        s = str(n)
        return "nccl" if s.removeprefix("void ").startswith(NCCL_PREFIXES) else "kernel"

    return np.array([memo[n] if n in memo else memo.setdefault(n, kind(n)) for n in names.tolist()], dtype="<U8")


def innermost_enclosing(r_key: np.ndarray, r_start: np.ndarray, r_end: np.ndarray,
                        q_key: np.ndarray, q_t: np.ndarray) -> np.ndarray:
    """For each query (thread key, time) the index of the innermost range on the same thread
    enclosing the time (start <= t <= end), or -1.

    Ranges on one thread must nest (push/pop); the innermost enclosing range is then the latest
    started range containing t. Found by a binary search for the latest range started at or
    before t, then walking up the (precomputed) parent chain while that range ended before t:
    the walk is vectorised and takes at most the nesting depth in rounds.
    """
    nq = len(q_t)
    out = np.full(nq, -1, dtype=np.int64)
    if not len(r_start) or not nq:
        return out
    order = np.lexsort((-r_end, r_start, r_key))          # by thread, start, outer first
    k, s, e = r_key[order], r_start[order], r_end[order]
    parent = _nesting_parents(k, s, e)
    # composite search: rank keys to dense ints so (key, time) sorts lexicographically
    ukeys, kd = np.unique(k, return_inverse=True)
    qpos = np.searchsorted(ukeys, q_key)
    known = (qpos < len(ukeys)) & (ukeys[np.minimum(qpos, len(ukeys) - 1)] == q_key)
    span = max(float(np.max(e)) - float(np.min(s)), 1.0) * 4 + 4
    base = float(np.min(s)) - 1
    # offset every thread's times into its own disjoint window, then one searchsorted
    rkey_t = kd * span + (s - base)
    q_idx = np.nonzero(known)[0]
    qk = qpos[q_idx]
    qt = np.clip(q_t[q_idx] - base, 0, span / 2)
    cand = np.searchsorted(rkey_t, qk * span + qt, side="right") - 1
    cand[(cand < 0)] = -1
    cand[cand >= 0] = np.where(kd[cand[cand >= 0]] == qk[cand >= 0], cand[cand >= 0], -1)
    t = q_t[q_idx]
    while True:
        live = cand >= 0
        bad = np.zeros_like(live)
        bad[live] = e[cand[live]] < t[live]
        if not bad.any():
            break
        cand[bad] = parent[cand[bad]]
    ok = cand >= 0
    res = np.full(len(q_idx), -1, dtype=np.int64)
    res[ok] = order[cand[ok]]
    out[q_idx] = res
    return out


def _nesting_parents(k: np.ndarray, s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Parent index (in the given order: by thread, start, outer first) of each range, -1 at top
    level. One pass with a stack per thread; ranges, not kernels, so this loop is short."""
    parent = np.full(len(s), -1, dtype=np.int64)
    stack: list[int] = []
    prev_key = None
    kl, sl, el = k.tolist(), s.tolist(), e.tolist()
    for i in range(len(sl)):
        if kl[i] != prev_key:
            stack.clear()
            prev_key = kl[i]
        while stack and el[stack[-1]] < sl[i]:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent
