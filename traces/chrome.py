"""Chrome-trace JSON readers: the runtime's per-rank trace (docs/formats.md) and Kineto
(PyTorch profiler) traces, plain or gzip-compressed; and the format-sniffing ``read_trace``.

Kineto mapping: ``user_annotation`` -> 'range' (CPU thread), ``gpu_user_annotation`` ->
'gpurange', ``kernel`` -> 'kernel' / 'nccl', ``gpu_memcpy`` -> 'memcpy', ``gpu_memset`` ->
'memset' (GPU events: ``device`` = args.device, ``tid`` = args.stream). The rank is
``distributedInfo.rank`` (0 when absent). A GPU event's ``parent`` is the innermost
``user_annotation`` enclosing its ``cuda_runtime`` launch (joined on args.correlation).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path

import numpy as np

from traces.events import (ALLOWED_RANK, ALLOWED_TIME, MAX_RANK, MAX_TIME_US, MISSING, BadEvents, EventTable,
                           TraceError, as_float, as_int, classify_kernels, innermost_enclosing, show,
                           time_checks, to_int)

RUNTIME_FORMAT = "k3sched.trace/1"
_I64 = (-(1 << 63), 1 << 63)
_ALLOWED_ID = "a thread id (allowed: an integer or a string label)"
_ALLOWED_PID = "a process id (allowed: an integer -2^31 <= pid < 2^31)"
_ALLOWED_CORR = "a correlation id (allowed: an integer)"
_KINETO_GPU = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset", "gpu_user_annotation": "gpurange"}


def load_json(path: str | os.PathLike):
    """Parse a .json or .json.gz file; TraceError (one line) for a missing, truncated or
    invalid file."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read ({e.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except EOFError:
            raise TraceError(f"{path}: gzip stream truncated (file cut short?)") from None
        except (gzip.BadGzipFile, zlib.error, OSError) as e:
            raise TraceError(f"{path}: corrupt gzip data ({e})") from None
    if not raw.strip():
        raise TraceError(f"{path}: empty file")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not JSON (binary content)") from None
    except RecursionError:
        raise TraceError(f"{path}: JSON nested too deep to be a trace (a trace is an object holding a "
                         "traceEvents list of flat event objects)") from None
    except json.JSONDecodeError as e:
        what = "JSON truncated" if e.pos >= len(raw.rstrip()) - 1 else "JSON invalid"
        raise TraceError(f"{path}: {what} at line {e.lineno} column {e.colno}: {e.msg}") from None


def _what(v) -> str:
    """The JSON kind of a value, for messages ('a list', 'a string', ...)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    return {dict: "an object", list: "a list", str: "a string"}.get(type(v), type(v).__name__)


def _events_of(obj, path) -> list:
    """The event list: a bare JSON list, or an object's ``traceEvents`` list; else TraceError."""
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        ev = obj.get("traceEvents")
        if isinstance(ev, list):
            return ev
        if "traceEvents" in obj:
            raise TraceError(f"{path}: 'traceEvents' is {_what(ev)}, expected a list of event objects")
        raise TraceError(f"{path}: not a Chrome trace (no 'traceEvents' list; expected an object with one, "
                         f"or a list of event objects)")
    raise TraceError(f"{path}: not a Chrome trace (the file holds {_what(obj)}; expected an object with a "
                     f"'traceEvents' list, or a list of event objects)")


def _section(obj, key: str, path) -> dict:
    """``obj[key]`` when an object; {} when absent or null; TraceError for any other value."""
    v = obj.get(key) if isinstance(obj, dict) else None
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TraceError(f"{path}: '{key}' is {_what(v)} {show(v)}, expected an object")
    return v


def _file_rank(v, what: str, path) -> int | None:
    """A rank stated once for the whole file (None when absent); TraceError when not a rank."""
    if v is None:
        return None
    r = to_int(v)
    if r is None or not 0 <= r < MAX_RANK:
        raise TraceError(f"{path}: {what} {show(v)} is not a rank ({ALLOWED_RANK})")
    return r


def is_runtime_trace(obj) -> bool:
    """True for the k3sched runtime's trace (``otherData.format`` = k3sched.trace/*)."""
    other = obj.get("otherData") if isinstance(obj, dict) else None
    return isinstance(other, dict) and str(other.get("format", "")).startswith("k3sched.trace/")


def is_kineto_trace(obj) -> bool:
    if not isinstance(obj, dict):
        return False
    if "distributedInfo" in obj or "schemaVersion" in obj or "deviceProperties" in obj:
        return True
    ev = obj.get("traceEvents")
    return isinstance(ev, list) and any(isinstance(e, dict) and e.get("cat") in _KINETO_MARK_CATS
                                        for e in ev[:2000])


_KINETO_MARK_CATS = ("kernel", "cuda_runtime", "cpu_op", "user_annotation")


# ---- per-event checks -----------------------------------------------------------------------

def _where(p: int) -> str:
    return f"event {p}"


def _scan(ev: list, bad: BadEvents) -> list:
    """Each event's ``ph`` (None for a malformed entry, counted: not an object, ``ph`` missing
    or not a string)."""
    phs = [e.get("ph", MISSING) if type(e) is dict else _NOT_OBJECT for e in ev]
    if set(map(type, phs)) <= {str}:
        return phs
    broken = [i for i, p in enumerate(phs) if type(p) is not str]
    for i in broken:
        p = phs[i]
        if p is _NOT_OBJECT:
            why = f"is {_what(ev[i])} {show(ev[i])} (allowed: an event object)"
        else:
            why = ("ph is missing" if p is MISSING else f"ph {show(p)} is not a string") + \
                " (allowed: a Chrome event phase such as \"X\", \"M\", \"C\")"
        bad.one(i, _where, why)
        phs[i] = None
    return phs


_NOT_OBJECT = object()


class _Group:
    """Events of one kind (a reader reads them alike): their positions in ``traceEvents``, and
    the checks of the values read from them, in order."""

    def __init__(self, ev: list, idx: list[int]) -> None:
        self.ev = [ev[i] for i in idx]
        self.pos = np.asarray(idx, dtype=np.int64)
        self.checks: list = []

    def __len__(self) -> int:
        return len(self.ev)

    def vals(self, key: str, default=MISSING) -> list:
        return [e.get(key, default) for e in self.ev]

    def name(self) -> np.ndarray:
        v = self.vals("name")
        if not set(map(type, v)) <= {str}:
            m = np.fromiter((type(x) is not str for x in v), bool, len(v))
            orig = v
            self.checks.append((m, lambda i: ("name is missing" if orig[i] is MISSING else
                                              f"name {show(orig[i])} is not a string")
                                + " (allowed: a task id or event name, as a string)"))
            v = [x if type(x) is str else "" for x in v]
        return np.array(v + [None], dtype=object)[:-1]

    def time(self, key: str, vals: list | None = None) -> np.ndarray:
        v = self.vals(key) if vals is None else vals
        a, notnum = as_float(v)
        self.checks += time_checks(key, v, a, notnum)
        return a

    def span(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) from ``ts`` and ``dur``: both valid times, end within range."""
        ts, dur = self.time("ts"), self.time("dur")
        end = ts + dur
        self.checks.append((np.isfinite(ts) & np.isfinite(dur) & (end >= MAX_TIME_US),
                            lambda i: f"ts + dur = {end[i]:.17g} is too large ({ALLOWED_TIME})"))
        return ts, end

    def ints(self, label: str, v: list, lo: int, hi: int, allowed: str, labels: bool = False) -> np.ndarray:
        a, m = as_int(v, lo, hi, labels)
        if m.any():
            self.checks.append((m, lambda i: f"{label} is missing; expected {allowed}" if v[i] is MISSING
                                else f"{label} {show(v[i])} is not {allowed}"))
        return a

    def args(self) -> list[dict]:
        """Each event's ``args`` object ({} when absent or null)."""
        v = self.vals("args", None)
        if set(map(type, v)) <= {dict}:
            return v
        m = np.fromiter((x is not None and type(x) is not dict for x in v), bool, len(v))
        self.checks.append((m, lambda i: f"args is {_what(v[i])} {show(v[i])} (allowed: an object, or absent)"))
        return [x if type(x) is dict else {} for x in v]

    def nbytes(self, args: list[dict]) -> np.ndarray:
        """``args.bytes`` (0 when absent or null)."""
        v = [0 if (x := a.get("bytes")) is None else x for a in args]
        return self.ints("args.bytes", v, 0, 1 << 63, "a byte count (allowed: an integer >= 0)")

    def done(self, bad: BadEvents) -> np.ndarray:
        """Count the malformed events of this group; the mask of the good ones."""
        return bad.check(self.checks, self.pos, _where)


def _check_memory_counters(ev: list, phs: list, bad: BadEvents) -> None:
    """``ph: "C"`` events named ``memory``: every ``args`` value a finite number >= 0 (the
    counter's own ``ts`` must be a finite number; it is not a task time, see docs/formats.md)."""
    idx = [i for i, p in enumerate(phs) if p == "C" and ev[i].get("name") == "memory"]
    if not idx:
        return
    g = _Group(ev, idx)
    ts = g.vals("ts")
    a, notnum = as_float(ts)
    g.checks.append((notnum | ~np.isfinite(a), lambda i: f"memory counter ts {show(ts[i])} is not a finite number"))
    args = g.vals("args", None)
    why = {}
    for i, x in enumerate(args):
        if type(x) is not dict:
            why[i] = f"memory counter args is {_what(x)} {show(x)} (allowed: an object of byte counts)"
            continue
        for k, b in x.items():
            f = float(b) if isinstance(b, (int, float)) and not isinstance(b, bool) and abs(b) < 1e300 else None
            if f is None or not np.isfinite(f) or f < 0:
                why[i] = f"memory counter {k} {show(b)} is not a byte count (allowed: a finite number >= 0)"
                break
    if why:
        m = np.zeros(len(g), bool)
        m[list(why)] = True
        g.checks.append((m, lambda i: why[i]))
    g.done(bad)


# ---- readers --------------------------------------------------------------------------------

def table_from_runtime(obj, path="<memory>", skip_bad_events: bool = False) -> EventTable:
    """Runtime trace (or a bare list of Chrome events) -> EventTable of 'range' events: one per
    ``ph: "X"`` event; rank = ``otherData.rank`` when given, else the event's ``pid``.
    Malformed events: see [Note: malformed events] (``traces.events``)."""
    ev = _events_of(obj, path)
    other = _section(obj, "otherData", path)
    fmt = other.get("format")
    if fmt is not None and not isinstance(fmt, str):
        raise TraceError(f"{path}: 'otherData.format' is {_what(fmt)} {show(fmt)}, expected a string "
                         "(k3sched.trace/1 for the runtime's trace)")
    rank = _file_rank(other.get("rank"), "otherData.rank", path)
    bad = BadEvents(path)
    phs = _scan(ev, bad)
    g = _Group(ev, [i for i, p in enumerate(phs) if p == "X"])
    names = g.name()
    ts, end = g.span()
    if rank is None:
        ranks = g.ints("pid", g.vals("pid"), 0, MAX_RANK, f"a rank ({ALLOWED_RANK}; no otherData.rank given)")
    else:  # the rank is the file's; each event's pid must still be a process id
        g.ints("pid", g.vals("pid"), -(1 << 31), 1 << 31, _ALLOWED_PID)
    tids = g.ints("tid", g.vals("tid", 0), *_I64, _ALLOWED_ID, labels=True)
    nbytes = g.nbytes(g.args())
    ok = g.done(bad)
    _check_memory_counters(ev, phs, bad)
    t = EventTable.build(name=names[ok], start_us=ts[ok], end_us=end[ok], kind="range",
                         rank=ranks[ok] if rank is None else rank, device=-1, tid=tids[ok], bytes=nbytes[ok])
    return bad.finish(t, skip_bad_events)


def table_from_kineto(obj, path="<memory>", skip_bad_events: bool = False) -> EventTable:
    """Kineto (PyTorch profiler) trace -> EventTable (module docstring: the mapping).
    Malformed events: see [Note: malformed events] (``traces.events``)."""
    ev = _events_of(obj, path)
    rank = _file_rank(_section(obj, "distributedInfo", path).get("rank"), "distributedInfo.rank", path) or 0
    bad = BadEvents(path)
    phs = _scan(ev, bad)
    by_cat: dict[str, list[int]] = {}
    odd = []
    for i, p in enumerate(phs):
        if p == "X":
            c = ev[i].get("cat")
            if type(c) is str:
                by_cat.setdefault(c, []).append(i)
            elif c is not None:
                odd.append(i)
    for i in odd:
        bad.one(i, _where, f"cat {show(ev[i]['cat'])} is not a string (allowed: a category name)")
    _check_memory_counters(ev, phs, bad)

    # CPU ranges
    g = _Group(ev, by_cat.get("user_annotation", []))
    a_name = g.name()
    a_start, a_end = g.span()
    a_pid = g.ints("pid", g.vals("pid"), -(1 << 31), 1 << 31, _ALLOWED_PID)
    a_tid = g.ints("tid", g.vals("tid"), *_I64, _ALLOWED_ID, labels=True)
    ok = g.done(bad)
    a_name, a_start, a_end, a_pid, a_tid = a_name[ok], a_start[ok], a_end[ok], a_pid[ok], a_tid[ok]
    a_key = (a_pid << 32) | (a_tid & 0xFFFFFFFF)
    parts = [EventTable.build(name=a_name, start_us=a_start, end_us=a_end, kind="range", rank=rank, device=-1,
                              tid=a_tid)]

    # launches: runtime / driver calls with a correlation id (a call without one is not read)
    rt_idx = sorted(i for c in ("cuda_runtime", "cuda_driver") for i in by_cat.get(c, []))
    g = _Group(ev, rt_idx)
    g.args()  # checks that args is an object
    ok = g.done(bad)
    g = _Group(ev, [i for i, o in zip(rt_idx, ok.tolist()) if o and (ev[i].get("args") or {}).get("correlation")
                    is not None])
    c_id = g.ints("args.correlation", [e["args"]["correlation"] for e in g.ev], *_I64, _ALLOWED_CORR)
    r_ts = g.time("ts")
    r_pid = g.ints("pid", g.vals("pid"), -(1 << 31), 1 << 31, _ALLOWED_PID)
    r_tid = g.ints("tid", g.vals("tid"), *_I64, _ALLOWED_ID, labels=True)
    ok = g.done(bad)
    launch = dict(zip(c_id[ok].tolist(), zip(((r_pid[ok] << 32) | (r_tid[ok] & 0xFFFFFFFF)).tolist(),
                                             r_ts[ok].tolist())))

    for cat, kind in _KINETO_GPU.items():
        if not by_cat.get(cat):
            continue
        g = _Group(ev, by_cat[cat])
        names = g.name()
        start, end = g.span()
        args = g.args()
        corr = g.ints("args.correlation", [-1 if (c := a.get("correlation")) is None else c for a in args], *_I64,
                      _ALLOWED_CORR)
        dev = g.ints("device", [a.get("device", e.get("pid", -1)) for a, e in zip(args, g.ev)], -1, 1 << 31,
                     "a device (allowed: an integer -1 <= device < 2^31, or a string label)", labels=True)
        stream = g.ints("stream", [a.get("stream", e.get("tid", 0)) for a, e in zip(args, g.ev)], *_I64,
                        "a stream id (allowed: an integer or a string label)", labels=True)
        g.ints("pid", g.vals("pid", -1), -(1 << 31), 1 << 31, _ALLOWED_PID + " or a string label", labels=True)
        g.ints("tid", g.vals("tid", 0), *_I64, _ALLOWED_ID, labels=True)
        nbytes = g.nbytes(args)
        ok = g.done(bad)
        names, start, end, corr, dev, stream, nbytes = (x[ok] for x in (names, start, end, corr, dev, stream, nbytes))
        kinds = classify_kernels(names) if kind == "kernel" else kind
        lk = [launch.get(c, (-1, np.nan)) for c in corr.tolist()]
        q_key = np.array([k for k, _ in lk], dtype=np.int64)
        q_t = np.array([t for _, t in lk], dtype=np.float64)
        par = innermost_enclosing(a_key, a_start, a_end, q_key, q_t)
        parent = np.where(par >= 0, a_name[np.maximum(par, 0)] if len(a_name) else "", "").astype(object)
        parts.append(EventTable.build(name=names, start_us=start, end_us=end, kind=kinds, rank=rank,
                                      device=dev.astype(np.int32), tid=stream, bytes=nbytes, parent=parent))
    return bad.finish(EventTable.concat(parts), skip_bad_events)


def read_runtime_trace(path, skip_bad_events: bool = False) -> EventTable:
    return table_from_runtime(load_json(path), path, skip_bad_events)


def read_kineto(path, skip_bad_events: bool = False) -> EventTable:
    return table_from_kineto(load_json(path), path, skip_bad_events)


def detect_format(path) -> str:
    """'nsys', 'runtime' or 'kineto' (by extension, then by content)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    with open(p, "rb") as f:
        head = f.read(16)
    if head.startswith(b"SQLite format 3") or p.suffix in (".sqlite", ".db"):
        return "nsys"
    obj = load_json(p)
    return "runtime" if is_runtime_trace(obj) or not is_kineto_trace(obj) else "kineto"


def read_trace(path, skip_bad_events: bool = False) -> EventTable:
    """Read any supported trace: an nsys SQLite export (.sqlite), or a Chrome JSON (.json,
    .json.gz) that is the runtime's trace or a Kineto trace (told apart by content).

    Malformed events ([Note: malformed events] in ``traces.events``) raise one TraceError
    naming the file, their count and the first; with ``skip_bad_events`` they are dropped and
    counted in the returned table's ``bad_events``."""
    from traces.nsys import read_nsys_sqlite

    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if p.is_dir():
        raise TraceError(f"{p}: is a directory, expected a trace file")
    with open(p, "rb") as f:
        head = f.read(16)
    if head.startswith(b"SQLite format 3") or p.suffix in (".sqlite", ".db"):
        return read_nsys_sqlite(p, skip_bad_events=skip_bad_events)
    if p.suffix == ".nsys-rep" or p.suffix == ".qdstrm":
        raise TraceError(f"{p}: raw Nsight Systems report; export it first: nsys export --type sqlite {p}")
    obj = load_json(p)
    if is_runtime_trace(obj) or not is_kineto_trace(obj):
        return table_from_runtime(obj, p, skip_bad_events)
    return table_from_kineto(obj, p, skip_bad_events)


def read_traces(paths, skip_bad_events: bool = False) -> EventTable:
    """:func:`read_trace` of each path, concatenated (``bad_events`` summed)."""
    return EventTable.concat([read_trace(p, skip_bad_events) for p in paths])
