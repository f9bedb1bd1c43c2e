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

from traces.nsys import read_nsys_sqlite  # noqa: E402
from traces.synth import NSYS_SCHEMA, NSYS_TABLES, nsys_sqlite, plan_tasks, small_plan  # noqa: E402
from traces.validate import validate  # noqa: E402

REAL = ROOT / ".." / "shared" / "traces" / "real" / "nsys" / "h100_2gpu_1s.sqlite"


def schema() -> tuple[dict[str, str], str]:
    if REAL.exists():
        con = sqlite3.connect(f"file:{REAL.resolve()}?mode=ro&immutable=1", uri=True)
        rows = dict(con.execute(f"SELECT name, sql FROM sqlite_master WHERE name IN ({','.join('?' * len(NSYS_TABLES))})",
                                NSYS_TABLES).fetchall())
        con.close()
        if set(rows) == set(NSYS_TABLES):
            return rows, f"copied from {REAL.name}"
    return NSYS_SCHEMA, "hard-coded subset"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1_000_000)
    ap.add_argument("--mb", type=int, default=64, help="micro-batches of the synthetic plan")
    a = ap.parse_args(argv)
    plan = small_plan(n_mb=a.mb)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.sqlite"
        t = time.perf_counter()
        nsys_sqlite(path, plan, a.kernels, ddl=schema()[0])
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
