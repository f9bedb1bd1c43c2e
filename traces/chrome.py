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

from traces.events import EventTable, TraceError, classify_kernels, innermost_enclosing

RUNTIME_FORMAT = "k3sched.trace/1"
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
    except json.JSONDecodeError as e:
        what = "JSON truncated" if e.pos >= len(raw.rstrip()) - 1 else "JSON invalid"
        raise TraceError(f"{path}: {what} at line {e.lineno} column {e.colno}: {e.msg}") from None


def _events_of(obj, path) -> list:
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict) and isinstance(obj.get("traceEvents"), list):
        return obj["traceEvents"]
    raise TraceError(f"{path}: not a Chrome trace (no 'traceEvents' list)")


def is_runtime_trace(obj) -> bool:
    """True for the k3sched runtime's trace (``otherData.format`` = k3sched.trace/*)."""
    return isinstance(obj, dict) and str((obj.get("otherData") or {}).get("format", "")).startswith("k3sched.trace/")


def is_kineto_trace(obj) -> bool:
    if not isinstance(obj, dict):
        return False
    if "distributedInfo" in obj or "schemaVersion" in obj or "deviceProperties" in obj:
        return True
    ev = obj.get("traceEvents") or []
    return any(isinstance(e, dict) and e.get("cat") in ("kernel", "cuda_runtime", "cpu_op", "user_annotation")
               for e in ev[:2000])


def table_from_runtime(obj, path="<memory>") -> EventTable:
    """Runtime trace (or a bare list of Chrome events) -> EventTable of 'range' events: one per
    ``ph: "X"`` event; rank = ``otherData.rank`` when given, else the event's ``pid``."""
    ev = _events_of(obj, path)
    xs = [e for e in ev if isinstance(e, dict) and e.get("ph") == "X"]
    rank = (obj.get("otherData") or {}).get("rank") if isinstance(obj, dict) else None
    try:
        ts = np.array([float(e["ts"]) for e in xs], dtype=np.float64)
        dur = np.array([float(e.get("dur", 0.0)) for e in xs], dtype=np.float64)
        names = np.array([str(e.get("name", "")) for e in xs] + [None], dtype=object)[:-1]
        tids = np.array([_as_int(e.get("tid", 0)) for e in xs], dtype=np.int64)
        pids = np.array([_as_int(e.get("pid", 0)) for e in xs], dtype=np.int64)
        nbytes = np.array([int((e.get("args") or {}).get("bytes", 0) or 0) for e in xs], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{path}: malformed trace event ({type(e).__name__}: {e})") from None
    return EventTable.build(name=names, start_us=ts, end_us=ts + dur, kind="range",
                            rank=pids if rank is None else int(rank), device=-1, tid=tids, bytes=nbytes)


def table_from_kineto(obj, path="<memory>") -> EventTable:
    ev = _events_of(obj, path)
    rank = int(((obj.get("distributedInfo") or {}) if isinstance(obj, dict) else {}).get("rank", 0) or 0)
    by_cat: dict[str, list] = {}
    for e in ev:
        if isinstance(e, dict) and e.get("ph") == "X":
            by_cat.setdefault(e.get("cat"), []).append(e)
    try:
        ann = by_cat.get("user_annotation", [])
        a_start = np.array([float(e["ts"]) for e in ann], dtype=np.float64)
        a_end = a_start + np.array([float(e.get("dur", 0)) for e in ann], dtype=np.float64)
        a_key = np.array([(_as_int(e["pid"]) << 32) | (_as_int(e["tid"]) & 0xFFFFFFFF) for e in ann], dtype=np.int64)
        a_name = np.array([str(e.get("name", "")) for e in ann] + [None], dtype=object)[:-1]
        parts = [EventTable.build(name=a_name, start_us=a_start, end_us=a_end, kind="range", rank=rank, device=-1,
                                  tid=np.array([_as_int(e["tid"]) for e in ann], dtype=np.int64))]
        rt = by_cat.get("cuda_runtime", []) + by_cat.get("cuda_driver", [])
        launch = {}
        for e in rt:
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launch[c] = ((_as_int(e["pid"]) << 32) | (_as_int(e["tid"]) & 0xFFFFFFFF), float(e["ts"]))
        for cat, kind in _KINETO_GPU.items():
            xs = by_cat.get(cat, [])
            if not xs:
                continue
            args = [e.get("args") or {} for e in xs]
            start = np.array([float(e["ts"]) for e in xs], dtype=np.float64)
            end = start + np.array([float(e.get("dur", 0)) for e in xs], dtype=np.float64)
            names = np.array([str(e.get("name", "")) for e in xs] + [None], dtype=object)[:-1]
            kinds = classify_kernels(names) if kind == "kernel" else kind
            lk = [launch.get(a.get("correlation"), (-1, np.nan)) for a in args]
            q_key = np.array([k for k, _ in lk], dtype=np.int64)
            q_t = np.array([t for _, t in lk], dtype=np.float64)
            par = innermost_enclosing(a_key, a_start, a_end, q_key, q_t)
            parent = np.where(par >= 0, a_name[np.maximum(par, 0)] if len(a_name) else "", "").astype(object)
            parts.append(EventTable.build(
                name=names, start_us=start, end_us=end, kind=kinds, rank=rank,
                device=np.array([_as_int(a.get("device", e.get("pid", -1))) for a, e in zip(args, xs)], dtype=np.int32),
                tid=np.array([_as_int(a.get("stream", e.get("tid", 0))) for a, e in zip(args, xs)], dtype=np.int64),
                bytes=np.array([int(a.get("bytes", 0) or 0) for a in args], dtype=np.int64), parent=parent))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{path}: malformed Kineto event ({type(e).__name__}: {e})") from None
    return EventTable.concat(parts)


def _as_int(v) -> int:
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, float):
        return int(v)
    s = str(v)
    digits = "".join(ch for ch in s if ch.isdigit())
    return int(digits) if digits else (abs(hash(s)) & 0x7FFFFFFF)


def read_runtime_trace(path) -> EventTable:
    obj = load_json(path)
    return table_from_runtime(obj, path)


def read_kineto(path) -> EventTable:
    obj = load_json(path)
    return table_from_kineto(obj, path)


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


def read_trace(path) -> EventTable:
    """Read any supported trace: an nsys SQLite export (.sqlite), or a Chrome JSON (.json,
    .json.gz) that is the runtime's trace or a Kineto trace (told apart by content)."""
    from traces.nsys import read_nsys_sqlite

    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if p.is_dir():
        raise TraceError(f"{p}: is a directory, expected a trace file")
    with open(p, "rb") as f:
        head = f.read(16)
    if head.startswith(b"SQLite format 3") or p.suffix in (".sqlite", ".db"):
        return read_nsys_sqlite(p)
    if p.suffix == ".nsys-rep" or p.suffix == ".qdstrm":
        raise TraceError(f"{p}: raw Nsight Systems report; export it first: nsys export --type sqlite {p}")
    obj = load_json(p)
    if is_runtime_trace(obj) or not is_kineto_trace(obj):
        return table_from_runtime(obj, p)
    return table_from_kineto(obj, p)


def read_traces(paths) -> EventTable:
    return EventTable.concat([read_trace(p) for p in paths])
