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
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

KINDS: tuple[str, ...] = ("range", "gpurange", "kernel", "nccl", "memcpy", "memset")
NCCL_PREFIXES: tuple[str, ...] = ("ncclKernel", "ncclDevKernel")


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

    def __post_init__(self) -> None:
        n = len(self.name)
        for f in fields(self):
            col = getattr(self, f.name)
            if len(col) != n:
                raise ValueError(f"EventTable column {f.name!r} has {len(col)} rows, expected {n}")

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
        return cls(**{f.name: np.concatenate([getattr(t, f.name) for t in tables]) for f in fields(cls)})

    def take(self, idx) -> "EventTable":
        """Rows selected by a boolean mask or an index array."""
        return EventTable(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def with_rank(self, rank) -> "EventTable":
        t = self.take(slice(None))
        t.rank = np.broadcast_to(np.asarray(rank, dtype=np.int32), (len(self),)).copy()
        return t

    def sorted(self) -> "EventTable":
        """Rows ordered by (rank, start_us)."""
        return self.take(np.lexsort((self.start_us, self.rank)))

    def to_records(self) -> np.ndarray:
        """The table as one numpy structured array (names as Python str objects)."""
        dt = [(f.name, getattr(self, f.name).dtype) for f in fields(self)]
        out = np.empty(len(self), dtype=dt)
        for f in fields(self):
            out[f.name] = getattr(self, f.name)
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


def classify_kernels(names: np.ndarray) -> np.ndarray:
    """'nccl' for NCCL kernels (name starts with ncclKernel / ncclDevKernel, after an optional
    'void '), else 'kernel'. Vectorised over unique names."""
    uniq, inv = np.unique(names.astype(str), return_inverse=True) if len(names) else (np.array([], str), np.array([], int))
    stripped = np.char.replace(uniq.astype(str), "void ", "", count=1) if len(uniq) else uniq
    is_nccl = np.zeros(len(uniq), dtype=bool)
    for p in NCCL_PREFIXES:
        is_nccl |= np.char.startswith(stripped.astype(str), p) if len(uniq) else is_nccl
    kinds = np.where(is_nccl, "nccl", "kernel").astype("<U8")
    return kinds[inv] if len(names) else np.array([], "<U8")


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
