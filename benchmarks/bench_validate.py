"""Read + validate a synthetic Nsight Systems export of 1,000,000 kernels.

The SQLite file uses the real export schema: the CREATE TABLE statements are copied at run time
from ../shared/traces/real/nsys/h100_2gpu_1s.sqlite (schema 3.25) when present, else a hard-coded
subset of the same columns. Two processes (= ranks, one per stage of a synthetic plan), one
thread per lane, one NVTX push/pop range per task, kernels launched from inside the ranges with
runtime rows and correlation ids. Prints build, read and validate times. Goal: read + validate
under 10 s on a 2-core machine.

    .venv/bin/python benchmarks/bench_validate.py [--kernels N] [--mb M]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3sched.tasks import LANES  # noqa: E402
from traces.nsys import read_nsys_sqlite  # noqa: E402
from traces.synth import plan_tasks, small_plan  # noqa: E402
from traces.validate import validate  # noqa: E402

REAL = ROOT / ".." / "shared" / "traces" / "real" / "nsys" / "h100_2gpu_1s.sqlite"
TABLES = ["StringIds", "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "META_DATA_EXPORT"]
FALLBACK_SCHEMA = {
    "StringIds": "CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL)",
    "NVTX_EVENTS": "CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, "
                   "rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, "
                   "endGlobalTid INTEGER, textId INTEGER, domainId INTEGER)",
    "CUPTI_ACTIVITY_KIND_KERNEL": "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT "
                                  "NULL, deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT "
                                  "NULL, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL, "
                                  "shortName INTEGER NOT NULL, gridX INTEGER NOT NULL)",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT "
                                   "NULL, eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, "
                                   "nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL, callchainId INTEGER)",
    "META_DATA_EXPORT": "CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT)",
}


def schema() -> tuple[dict[str, str], str]:
    if REAL.exists():
        con = sqlite3.connect(f"file:{REAL.resolve()}?mode=ro&immutable=1", uri=True)
        rows = dict(con.execute(f"SELECT name, sql FROM sqlite_master WHERE name IN ({','.join('?' * len(TABLES))})",
                                TABLES).fetchall())
        con.close()
        if set(rows) == set(TABLES):
            return rows, f"copied from {REAL.name}"
    return FALLBACK_SCHEMA, "hard-coded subset"


def insert(con, table: str, cols: dict[str, object], n: int) -> None:
    """Insert n rows: given columns (arrays or scalars); other NOT NULL columns get 0 / ''."""
    info = con.execute(f"PRAGMA table_info({table})").fetchall()
    names = [r[1] for r in info]
    data = []
    for name, typ, notnull in ((r[1], r[2], r[3]) for r in info):
        v = cols.get(name, None if not notnull else ("" if typ == "TEXT" else 0))
        data.append(v.tolist() if isinstance(v, np.ndarray) else [v] * n)
    con.executemany(f"INSERT INTO {table} ({','.join(names)}) VALUES ({','.join('?' * len(names))})", zip(*data))


def build(path: Path, plan: dict, n_kernels: int) -> None:
    ddl, _ = schema()
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    for t in TABLES:
        con.execute(ddl[t])
    tasks = plan_tasks(plan)
    ids = [t["id"] for t in tasks]
    n = len(tasks)
    insert(con, "StringIds", {"id": np.arange(n + 2), "value": np.array(ids + ["gemm_kernel", "cudaLaunchKernel"],
                                                                         dtype=object)}, n + 2)
    stage = np.array([t["stage"] for t in tasks])
    lane = np.array([LANES.index(t["lane"]) for t in tasks])
    pid = 1000 + 1000 * stage
    gtid = (pid << 24) | (pid + 1 + lane)
    t0 = 10**9
    start = t0 + (np.array([t["start_us"] for t in tasks]) * 1e3).astype(np.int64)
    end = t0 + (np.array([t["end_us"] for t in tasks]) * 1e3).astype(np.int64)
    insert(con, "NVTX_EVENTS", {"start": start, "end": end, "eventType": 59, "globalTid": gtid,
                                "textId": np.arange(n), "domainId": 0}, n)
    # kernels: spread over the task ranges, launched 100 ns apart inside each range
    owner = np.sort(np.random.default_rng(0).integers(0, n, n_kernels))
    first = np.searchsorted(owner, np.arange(n))
    k_in = np.arange(n_kernels) - first[owner]
    per = np.bincount(owner, minlength=n)
    span = (end - start)[owner]
    launch = start[owner] + (k_in + 1) * span // (per[owner] + 2)
    corr = np.arange(1, n_kernels + 1)
    kpid = pid[owner]
    insert(con, "CUPTI_ACTIVITY_KIND_RUNTIME", {"start": launch, "end": launch + 50, "eventClass": 1,
                                                "globalTid": gtid[owner], "correlationId": corr, "nameId": n + 1,
                                                "returnValue": 0}, n_kernels)
    kstart = launch + 2000
    insert(con, "CUPTI_ACTIVITY_KIND_KERNEL", {"start": kstart, "end": kstart + 500, "deviceId": stage[owner],
                                               "contextId": 1, "streamId": 7 + lane[owner], "correlationId": corr,
                                               "globalPid": kpid << 24, "demangledName": n, "shortName": n,
                                               "gridX": 1, "tensorSizeMinusOneElements": "[]"}, n_kernels)
    insert(con, "META_DATA_EXPORT", {"name": np.array(["EXPORT_SCHEMA_VERSION"], dtype=object),
                                     "value": np.array(["3.25.0"], dtype=object)}, 1)
    con.commit()
    con.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1_000_000)
    ap.add_argument("--mb", type=int, default=64, help="micro-batches of the synthetic plan")
    a = ap.parse_args(argv)
    plan = small_plan(n_mb=a.mb)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.sqlite"
        t = time.perf_counter()
        build(path, plan, a.kernels)
        t_build = time.perf_counter() - t
        t = time.perf_counter()
        events = read_nsys_sqlite(path)
        t_read = time.perf_counter() - t
        t = time.perf_counter()
        rep = validate(plan, events)
        t_val = time.perf_counter() - t
    n_k = int(np.isin(events.kind, ["kernel", "nccl"]).sum())
    in_range = int((events.parent[events.kind == "kernel"] != "").sum())
    print(f"schema: {schema()[1]}; plan: {len(plan_tasks(plan))} tasks; events: {len(events):,} "
          f"({n_k:,} kernels, {in_range:,} projected into a task range)")
    print(f"build {t_build:.2f} s (not timed)   read {t_read:.2f} s   validate {t_val:.2f} s   "
          f"read+validate {t_read + t_val:.2f} s (goal < 10 s)   conforms={rep.conforms}")
    return 0 if rep.conforms and in_range == n_k else 1


if __name__ == "__main__":
    sys.exit(main())
