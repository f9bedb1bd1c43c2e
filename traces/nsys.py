"""Nsight Systems: read SQLite exports into an EventTable, and record a command under nsys.

Tables and columns are discovered (``sqlite_master``, ``PRAGMA table_info``), never assumed, so
export schema 3.0.0 (nsys 2022.4, metadata table ``EXPORT_META_DATA``) up to 3.25 (2026.x,
``META_DATA_EXPORT``) read alike.

[Note: nsys ranks]
A rank is a process: pid = (globalTid >> 24) & 0xFFFFFF, tid = globalTid & 0xFFFFFF. Processes
that own at least one NVTX range or GPU activity row become ranks 0..n-1 in pid order, unless
the process emitted an NVTX range or mark whose text is ``k3sched.rank=N`` (the runtime emits
one per rank), which wins.

[Note: kernel projection]
Kernels, memcpys and memsets keep their device and stream (``tid`` = streamId). Their ``parent``
is the innermost NVTX range enclosing the launching CUDA runtime call on the launching thread:
the runtime row is found by ``correlationId`` within the same process (``globalPid =
runtime.globalTid & 0xFFFFFFFFFF000000``).
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from traces.events import (ALLOWED_RANK, MAX_RANK, BadEvents, EventTable, TraceError, as_float, as_int,
                           classify_kernels, innermost_enclosing, show, time_checks)

NVTX_PUSHPOP = 59
NVTX_STARTEND = 60
NVTX_MARK = 34
RANK_MARK_PREFIX = "k3sched.rank="
RANK_MARK_RE = re.compile(r"^k3sched\.rank=([0-9]+)$")
QDSTRM_IMPORTER = "/usr/lib/nsight-systems/host-linux-x64/QdstrmImporter"
_PID_MASK = -0x1000000  # 0xFFFFFFFFFF000000 as a signed 64-bit SQLite integer


def _connect(path: Path) -> sqlite3.Connection:
    uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro&immutable=1"
    return sqlite3.connect(uri, uri=True)


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in con.execute(f'PRAGMA table_info("{table}")')}


def export_info(path: str | os.PathLike) -> dict[str, str]:
    """The export's metadata (EXPORT_META_DATA or META_DATA_EXPORT) as a dict, e.g.
    ``EXPORT_SCHEMA_VERSION``; empty when the file has neither table."""
    path = Path(path)
    _check_file(path)
    try:
        con = _connect(path)
        try:
            tables = _tables(con)
            for t in ("META_DATA_EXPORT", "EXPORT_META_DATA"):
                if t in tables:
                    return {str(n): str(v) for n, v in con.execute(f'SELECT name, value FROM "{t}"')}
            return {}
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise TraceError(f"{path}: not a readable SQLite database ({e})") from None


def _tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}


def _check_file(path: Path) -> None:
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise TraceError(f"{path}: empty file")
    with open(path, "rb") as f:
        head = f.read(16)
    if head != b"SQLite format 3\x00":
        raise TraceError(f"{path}: not an SQLite database (bad header)")


def read_nsys_sqlite(path: str | os.PathLike, *, kernel_names: str = "demangled",
                     skip_bad_events: bool = False) -> EventTable:
    """Read an ``nsys export --type sqlite`` file: NVTX push/pop and start/end ranges (kind
    'range', device -1, tid = OS thread), kernels ('kernel' or 'nccl'), memcpy, memset (device,
    tid = stream, ``parent`` = enclosing NVTX range, see [Note: kernel projection]).
    ``kernel_names``: 'demangled' or 'short'. Raises TraceError for an unreadable file, and for
    malformed rows ([Note: malformed events] in ``traces.events``: text or NULL where a number is
    needed, NULL / negative / reversed times, a ``k3sched.rank=N`` mark that names no rank) unless
    ``skip_bad_events``, which drops them and counts them in the table's ``bad_events``."""
    path = Path(path)
    _check_file(path)
    try:
        con = _connect(path)
        try:
            return _read(con, path, kernel_names, skip_bad_events)
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise TraceError(f"{path}: corrupt or truncated SQLite database ({e})") from None


def _fetch(con: sqlite3.Connection, sql: str, ncols: int) -> list[list]:
    """The result set as one Python list per column (values as SQLite has them)."""
    rows = con.execute(sql).fetchall()
    if not rows:
        return [[] for _ in range(ncols)]
    return [list(c) for c in zip(*rows)]


def _rowid(con: sqlite3.Connection, table: str, alias: str) -> str:
    """``alias.rowid`` where the table has one (not a view, not WITHOUT ROWID), else NULL."""
    try:
        con.execute(f'SELECT rowid FROM "{table}" LIMIT 0')
        return f"{alias}.rowid"
    except sqlite3.OperationalError:
        return "NULL"


def _positions(rowids: list) -> np.ndarray:
    """Row positions for messages: the rowid, else the place in the result set."""
    if set(map(type, rowids)) <= {int}:
        return np.array(rowids, dtype=np.int64)
    return np.array([r if type(r) is int else i for i, r in enumerate(rowids)], dtype=np.int64)


def _span_checks(s: list, e: list) -> tuple[list, np.ndarray, np.ndarray]:
    """Checks of ``start`` / ``end`` columns in ns (numbers, finite, >= 0, end >= start); and
    both in µs."""
    sf, s_nn = as_float(s)
    ef, e_nn = as_float(e)
    checks = time_checks("start", s, sf, s_nn, sql=True, scale=1e3) + time_checks("end", e, ef, e_nn, sql=True,
                                                                                    scale=1e3)
    checks.append((np.isfinite(sf) & np.isfinite(ef) & (ef < sf),
                   lambda i: f"end {e[i]!r} is before start {s[i]!r} (allowed: end >= start)"))
    return checks, sf / 1e3, ef / 1e3


def _int_check(label: str, v: list, allowed: str, lo: int = -(1 << 63), hi: int = 1 << 63,
               nullable: bool = False) -> tuple[list, np.ndarray]:
    """Checks of an integer column ``lo <= v < hi`` (with ``nullable``, NULL is allowed and
    reads as -1), and its values."""
    a, m = as_int(v, lo, hi)
    if nullable and None in v:
        null = np.fromiter((x is None for x in v), bool, len(v))
        m &= ~null
        a[null] = -1
    checks = [(m, lambda i: f"{label} {show(v[i], sql=True)} is not {allowed}")] if m.any() else []
    return checks, a


# A CUPTI_ACTIVITY_KIND_RUNTIME row the kernels' projection may use: the columns it reads are
# integers, the start a time (ns, 0 <= t < 2^53 µs). Checked in SQL (one scan, no rows brought
# into Python unless they are bad); a bad row is a malformed event, and it is never joined.
_RUNTIME_ROW_OK = ("(typeof(r.correlationId) = 'integer' AND typeof(r.globalTid) = 'integer' "
                   "AND typeof(r.start) = 'integer' AND r.start >= 0 AND r.start < 9007199254740992000)")


def _check_runtime_rows(con: sqlite3.Connection, bad: BadEvents) -> None:
    sql = (f"SELECT {_rowid(con, 'CUPTI_ACTIVITY_KIND_RUNTIME', 'r')}, r.correlationId, r.globalTid, r.start "
           f"FROM CUPTI_ACTIVITY_KIND_RUNTIME r WHERE NOT {_RUNTIME_ROW_OK} AND r.correlationId IS NOT NULL")
    rows = con.execute(sql).fetchall()
    if not rows:
        return
    pos = _positions([r[0] for r in rows])
    cols = ("correlationId", "globalTid", "start")
    bad.check([(np.ones(len(rows), bool),
                lambda i: "runtime call with " + ", ".join(f"{c} {show(rows[i][k + 1], sql=True)}"
                                                           for k, c in enumerate(cols))
                + " (allowed: integers, start a time 0 <= t < 2^53 µs in ns)")],
              pos, lambda p: f"CUPTI_ACTIVITY_KIND_RUNTIME row {p}", order=len(_GPU_ORDER))


_GPU_ORDER = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")


@dataclass
class _Ranges:
    """NVTX ranges (push/pop and start/end) and the ``k3sched.rank=N`` marks ([Note: nsys ranks])."""

    gtid: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))   # globalTid
    start: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))  # µs
    end: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))
    text: np.ndarray = field(default_factory=lambda: np.empty(0, object))
    rank_marks: dict[int, int] = field(default_factory=dict)  # pid -> the rank its mark names


def _read(con: sqlite3.Connection, path: Path, kernel_names: str, skip_bad_events: bool = False) -> EventTable:
    tables = _tables(con)
    gpu_tables = [t for t in _GPU_ORDER if t in tables]
    if "NVTX_EVENTS" not in tables and not gpu_tables:
        found = ", ".join(sorted(tables)[:6]) or "none"
        raise TraceError(f"{path}: missing required tables: neither NVTX_EVENTS nor CUPTI_ACTIVITY_KIND_* "
                         f"(tables found: {found}); is this an nsys export?")
    has_strings = "StringIds" in tables
    bad = BadEvents(path)
    ranges = _read_ranges(con, path, has_strings, bad) if "NVTX_EVENTS" in tables else _Ranges()
    runtime_cols = _columns(con, "CUPTI_ACTIVITY_KIND_RUNTIME") if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables else set()
    can_project = {"correlationId", "globalTid", "start"} <= runtime_cols
    if can_project:
        _check_runtime_rows(con, bad)
    gpu = [g for order, table in enumerate(gpu_tables, start=1)
           if (g := _read_gpu(con, path, table, order, kernel_names, has_strings, can_project, bad)) is not None]
    _name_gpu(con, tables, gpu, has_strings)
    return bad.finish(_to_table(ranges, gpu), skip_bad_events)


def _read_ranges(con: sqlite3.Connection, path: Path, has_strings: bool, bad: BadEvents) -> _Ranges:
    """The NVTX ranges and rank marks of NVTX_EVENTS, malformed rows checked ([Note: malformed
    events] in traces/events.py)."""
    cols = _columns(con, "NVTX_EVENTS")
    need = {"start", "end", "eventType", "globalTid"}
    if not need <= cols:
        raise TraceError(f"{path}: NVTX_EVENTS lacks columns {sorted(need - cols)}")
    text = "n.text" if "text" in cols else "NULL"
    join = ""
    if "textId" in cols and has_strings:
        text = f"COALESCE({text}, s.value)"
        join = "LEFT JOIN StringIds s ON s.id = n.textId"
    text_id = "n.textId" if "textId" in cols else "NULL"
    sql = (f"SELECT {_rowid(con, 'NVTX_EVENTS', 'n')}, n.eventType, n.start, n.end, n.globalTid, {text}, "
           f"{text_id} FROM NVTX_EVENTS n {join} WHERE n.eventType IN ({NVTX_PUSHPOP}, {NVTX_STARTEND}) "
           f"OR (n.eventType = {NVTX_MARK} AND {text} LIKE '{RANK_MARK_PREFIX}%')")
    rid, et, s, e, g, t, tid_ = _fetch(con, sql, 7)
    is_range = np.fromiter((x != NVTX_MARK for x in et), bool, len(et))
    checks, sf, ef = _span_checks(s, e)
    checks = [(m & is_range, r) for m, r in checks]
    gc, gi = _int_check("globalTid", g, "a thread id (allowed: an integer)")
    checks += gc
    checks += _int_check("textId", tid_, "a StringIds id (allowed: an integer or NULL)", nullable=True)[0]
    if not set(map(type, t)) <= {str, type(None)}:
        checks.append((np.fromiter((x is not None and type(x) is not str for x in t), bool, len(t)),
                       lambda i: f"text {show(t[i], sql=True)} is not a string (allowed: text or NULL)"))
    mark_rank, mark_check = _rank_marks(t)
    checks += mark_check
    ok = bad.check(checks, _positions(rid), lambda p: f"NVTX_EVENTS row {p}", order=0)
    sel = ok & is_range
    return _Ranges(gi[sel], sf[sel], ef[sel],
                   np.array([x or "" for x, k in zip(t, sel.tolist()) if k] + [None], dtype=object)[:-1],
                   {(int(gi[i]) >> 24) & 0xFFFFFF: r for i, r in mark_rank.items() if ok[i]})


def _rank_marks(t: list) -> tuple[dict[int, int], list]:
    """Row -> rank of each ``k3sched.rank=N`` mark among the texts ``t``, and the check of the
    marks that name no rank."""
    marks = {i: x for i, x in enumerate(t) if type(x) is str and x.startswith(RANK_MARK_PREFIX)}
    mark_rank = {}
    for i, x in marks.items():
        m = RANK_MARK_RE.match(x)
        if m and int(m[1]) < MAX_RANK:
            mark_rank[i] = int(m[1])
    if len(mark_rank) == len(marks):
        return mark_rank, []
    mm = np.zeros(len(t), bool)
    mm[[i for i in marks if i not in mark_rank]] = True
    return mark_rank, [(mm, lambda i: f"rank mark {show(t[i], sql=True)} names no rank ({ALLOWED_RANK})")]


def _gpu_sql(con: sqlite3.Connection, table: str, cols: set[str], kernel_names: str, has_strings: bool,
             can_project: bool) -> tuple[str, str]:
    """The query of one GPU activity table (12 columns: rowid, start, end, device, stream, bytes,
    name id, copy kind, globalPid, the launching runtime call's globalTid and start, correlation
    id; [Note: kernel projection]), and the name column's expression."""
    dev = "a.deviceId" if "deviceId" in cols else "-1"
    nbytes = "a.bytes" if "bytes" in cols else "0"
    if table.endswith("KERNEL"):
        ncol = {"demangled": "demangledName", "short": "shortName"}[kernel_names]
        if ncol not in cols:
            ncol = "shortName" if "shortName" in cols else ("demangledName" if "demangledName" in cols else None)
        name = f"a.{ncol}" if ncol and has_strings else "NULL"
        extra = "0"
    elif table.endswith("MEMCPY"):
        name, extra = "NULL", ("a.copyKind" if "copyKind" in cols else "0")
    else:
        name, extra = "NULL", "0"
    pid_of = "a.globalPid" if "globalPid" in cols else "NULL"
    rid = _rowid(con, table, "a")
    corr = "a.correlationId" if "correlationId" in cols else "NULL"
    head = f"SELECT {rid}, a.start, a.end, {dev}, a.streamId, {nbytes}, {name}, {extra}, {pid_of}, "
    if can_project and "correlationId" in cols:
        on = f"r.correlationId = a.correlationId AND {_RUNTIME_ROW_OK}"
        if "globalPid" in cols:
            on += f" AND (r.globalTid & {_PID_MASK}) = a.globalPid"
        return head + f"r.globalTid, r.start, {corr} FROM {table} a LEFT JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON {on}", name
    return head + f"NULL, NULL, {corr} FROM {table} a", name


def _read_gpu(con: sqlite3.Connection, path: Path, table: str, order: int, kernel_names: str, has_strings: bool,
              can_project: bool, bad: BadEvents) -> dict | None:
    """The rows of one GPU activity table as columns, malformed rows checked (None when empty)."""
    cols = _columns(con, table)
    need = {"start", "end", "streamId"}
    if not need <= cols:
        raise TraceError(f"{path}: {table} lacks columns {sorted(need - cols)}")
    sql, name = _gpu_sql(con, table, cols, kernel_names, has_strings, can_project)
    v = _fetch(con, sql, 12)
    if not v[0]:
        return None
    checks, start, end = _span_checks(v[1], v[2])
    c, device = _int_check("deviceId", v[3], "a device (allowed: an integer -1 <= id < 2^31)", -1, 1 << 31)
    checks += c
    c, stream = _int_check("streamId", v[4], "a stream id (allowed: an integer)")
    checks += c
    c, nb = _int_check("bytes", v[5], "a byte count (allowed: an integer >= 0)", 0)
    checks += c
    c, nameid = _int_check(name.removeprefix("a."), v[6], "a StringIds id (allowed: an integer)",
                           nullable=name == "NULL")
    checks += c
    c, kindid = _int_check("copyKind", v[7], "a copy kind (allowed: an integer)")
    checks += c
    c, gpid = _int_check("globalPid", v[8], "a process id (allowed: an integer or NULL)", nullable=True)
    checks += c
    checks += _int_check("correlationId", v[11], "a correlation id (allowed: an integer 0 <= id < 2^63 or NULL)",
                         0, nullable=True)[0]
    c, rgtid = _int_check("launching runtime call's globalTid", v[9], "a thread id (allowed: an integer)",
                          nullable=True)
    checks += c
    rs, rs_nn = as_float(v[10])
    null_rs = np.fromiter((x is None for x in v[10]), bool, len(v[10]))
    checks.append((rs_nn & ~null_rs, lambda i: f"launching runtime call's start {show(v[10][i], sql=True)} "
                                               f"is not a number"))
    ok = bad.check(checks, _positions(v[0]), lambda p, table=table: f"{table} row {p}", order=order)
    return {"table": table, "start": start[ok], "end": end[ok], "device": device[ok].astype(np.int32),
            "stream": stream[ok], "bytes": nb[ok], "nameid": nameid[ok], "extra": kindid[ok],
            "gpid": gpid[ok], "rgtid": rgtid[ok], "rstart": rs[ok] / 1e3}


def _name_gpu(con: sqlite3.Connection, tables: set[str], gpu: list[dict], has_strings: bool) -> None:
    """Each GPU event's name and kind: kernels by their StringIds name (``kernel`` or ``nccl``),
    copies by their copy kind's label, memsets as such."""
    copy_names = {}
    if "ENUM_CUDA_MEMCPY_OPER" in tables and {"id", "label"} <= _columns(con, "ENUM_CUDA_MEMCPY_OPER"):
        copy_names = {i: str(lbl) for i, lbl in con.execute("SELECT id, label FROM ENUM_CUDA_MEMCPY_OPER")
                      if type(i) is int}
    for g in gpu:
        if g["table"].endswith("KERNEL"):
            uniq, inv = np.unique(g["nameid"], return_inverse=True)
            lookup = dict(con.execute(f"SELECT id, value FROM StringIds WHERE id IN ({','.join(map(str, uniq.tolist()))})")
                          ) if has_strings and len(uniq) else {}
            names = np.array([v if type(v := lookup.get(i)) is str else "kernel" for i in uniq.tolist()] + [None],
                             dtype=object)[:-1]
            g["name"] = names[inv]
            g["kind"] = classify_kernels(g["name"])
        elif g["table"].endswith("MEMCPY"):
            uniq, inv = np.unique(g["extra"], return_inverse=True)
            names = np.array([f"Memcpy {copy_names.get(k, k)}" for k in uniq.tolist()], dtype=object)
            g["name"], g["kind"] = names[inv], np.full(len(inv), "memcpy", "<U8")
        else:
            g["name"], g["kind"] = np.full(len(g["start"]), "Memset", object), np.full(len(g["start"]), "memset", "<U8")


def _rank_lookup(ranges: _Ranges, gpu: list[dict]):
    """pid -> rank ([Note: nsys ranks]) as a vectorised function of a pid array (-1: no rank)."""
    pids = [(ranges.gtid >> 24) & 0xFFFFFF] + [np.where(g["gpid"] >= 0, (g["gpid"] >> 24) & 0xFFFFFF, -1)
                                               for g in gpu]
    allp = np.unique(np.concatenate(pids)) if pids else np.empty(0, np.int64)
    allp = allp[allp >= 0]
    rank_of = {int(p): i for i, p in enumerate(allp.tolist())}
    if ranges.rank_marks:
        rank_of.update(ranges.rank_marks)

    def to_rank(p: np.ndarray) -> np.ndarray:
        if not len(p):
            return np.empty(0, np.int32)
        keys = np.array(sorted(rank_of), dtype=np.int64)
        vals = np.array([rank_of[k] for k in keys.tolist()], dtype=np.int32)
        pos = np.clip(np.searchsorted(keys, p), 0, max(len(keys) - 1, 0))
        return np.where((len(keys) > 0) & (keys[pos] == p), vals[pos], -1).astype(np.int32)

    return to_rank


def _to_table(ranges: _Ranges, gpu: list[dict]) -> EventTable:
    """The ranges, then each GPU table's events with their ranks and parent ranges ([Note:
    kernel projection]), as one EventTable."""
    to_rank = _rank_lookup(ranges, gpu)
    r_gtid, r_text = ranges.gtid, ranges.text
    parts = [EventTable.build(name=r_text, start_us=ranges.start, end_us=ranges.end, kind="range",
                              rank=to_rank((r_gtid >> 24) & 0xFFFFFF), device=-1, tid=r_gtid & 0xFFFFFF)]
    for g in gpu:
        par = innermost_enclosing(r_gtid, ranges.start, ranges.end, g["rgtid"], g["rstart"])
        parent = np.where(par >= 0, r_text[np.maximum(par, 0)] if len(r_text) else "", "").astype(object)
        gp = np.where(g["gpid"] >= 0, (g["gpid"] >> 24) & 0xFFFFFF, (g["rgtid"] >> 24) & 0xFFFFFF)
        parts.append(EventTable.build(name=g["name"], start_us=g["start"], end_us=g["end"], kind=g["kind"],
                                      rank=to_rank(gp), device=g["device"], tid=g["stream"], bytes=g["bytes"],
                                      parent=parent))
    return EventTable.concat(parts)


# ---- recording -------------------------------------------------------------------------

class CaptureHung(TraceError):
    """``nsys profile`` hung past its timeout on every attempt (nsys 2022.4, intermittent)."""


def record(cmd: list[str], out_prefix: str | os.PathLike, trace: str = "nvtx", *,
           timeout_s: float = 600.0, retries: int = 1, env: dict | None = None,
           options: list[str] | tuple[str, ...] = (), echo: bool = False, cwd: str | os.PathLike | None = None,
           before_attempt=None) -> Path:
    """Run ``cmd`` under ``nsys profile --trace=TRACE [OPTIONS] -o OUT_PREFIX`` and export the
    capture to ``OUT_PREFIX.sqlite``; returns that path.

    Works with nsys 2022.4 (Debian), whose automatic import of the raw ``.qdstrm`` capture fails:
    when no ``.nsys-rep`` appears, ``QdstrmImporter -i OUT_PREFIX.qdstrm`` is run, then ``nsys
    export --type sqlite``. A capture that hangs past ``timeout_s`` (seen intermittently with 2022.4)
    is killed (nsys, the profiled processes, the agent) and retried ``retries`` times; when every
    attempt hung, :class:`CaptureHung` says so. Raises TraceError (one line, with the failing step's
    last stderr line) when nsys is missing or a step fails.
    ``echo``: print the profiled command's stdout / stderr once each nsys step ends (they are
    captured while it runs). ``before_attempt(i)`` is called before each capture attempt (e.g. to
    clear a previous attempt's outputs).
    """
    nsys = shutil.which("nsys")
    if nsys is None:
        raise TraceError("nsys: not found on PATH (install nsight-systems)")
    out = Path(out_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    rep, qd, sql = (out.with_name(out.name + ext) for ext in (".nsys-rep", ".qdstrm", ".sqlite"))
    for p in (rep, qd, sql):
        p.unlink(missing_ok=True)

    def run(step: str, args: list[str]) -> None:
        # no new session or process group: nsys 2022.4 hangs under either
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=cwd)
        try:
            stdout, stderr = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # nsys 2022.4 can hang when the profiled program exits at once; end what we started
            _end_session(p)
            raise TraceError(f"{out}: {step} timed out after {timeout_s:.0f} s") from None
        if args[1] == "profile":
            _end_session(p, agents_only=True)  # 2022.4 leaves its agent spinning after the capture
        if echo and args[1] == "profile":
            import sys

            sys.stdout.write(stdout)
            sys.stdout.flush()
            sys.stderr.write(stderr)
            sys.stderr.flush()
        if p.returncode != 0:
            last = (stderr.strip().splitlines() or stdout.strip().splitlines() or ["no output"])[-1]
            raise TraceError(f"{out}: {step} failed (exit {p.returncode}): {last}")

    profile = [nsys, "profile", f"--trace={trace}", *options, "--force-overwrite=true", "-o", str(out), *cmd]
    for attempt in range(retries + 1):
        if before_attempt is not None:
            before_attempt(attempt)
        try:
            run("nsys profile", profile)
            break
        except TraceError as e:
            # nsys 2022.4 intermittently hangs at the start of a capture on this VM; a retry works
            if "timed out" not in str(e):
                raise
            if attempt == retries:
                raise CaptureHung(f"{out}: nsys profile hung on all {retries + 1} attempt(s) (each killed after "
                                  f"{timeout_s:.0f} s; nsys 2022.4 hangs intermittently)") from None
            for p in (rep, qd, sql):
                p.unlink(missing_ok=True)
    if not rep.exists():
        if not qd.exists():
            raise TraceError(f"{out}: nsys profile wrote neither {rep.name} nor {qd.name}")
        importer = QDSTRM_IMPORTER if Path(QDSTRM_IMPORTER).exists() else shutil.which("QdstrmImporter")
        if importer is None:
            raise TraceError(f"{qd}: needs QdstrmImporter to import, not found at {QDSTRM_IMPORTER}")
        run("QdstrmImporter", [importer, "-i", str(qd)])
        if not rep.exists():
            raise TraceError(f"{qd}: QdstrmImporter produced no {rep.name}")
    run("nsys export", [nsys, "export", "--type", "sqlite", "--force-overwrite=true", "-o", str(sql), str(rep)])
    if not sql.exists():
        raise TraceError(f"{rep}: nsys export produced no {sql.name}")
    return sql


def _end_session(p: subprocess.Popen, agents_only: bool = False) -> None:
    """Kill a timed-out nsys step we started: its process, its descendants, and the profiling
    agent it daemonised (found by its session name ``profile-*-<nsys pid>``), each by pid."""
    import signal

    parents: dict[int, int] = {}
    agents = []
    suffix = f"-{p.pid}".encode()
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if b"--start-agent" in argv and any(a.startswith(b"--session-name=profile-") and a.endswith(suffix)
                                            for a in argv):
            agents.append(int(d.name))
    victims, frontier = [], ([] if agents_only else [p.pid])
    while frontier:
        kids = [c for c, pp in parents.items() if pp in frontier]
        victims += kids
        frontier = kids
    for pid in ([] if agents_only else [p.pid]) + victims + agents:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if not agents_only:
        p.communicate()
