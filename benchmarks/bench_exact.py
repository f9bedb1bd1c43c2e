"""The k3 heuristic against the exact free-order model with memory (k3sched/exact/free.py, ``solve_free``).

Run: .venv/bin/python benchmarks/bench_exact.py [--dtime 10] [--only NAME ...] [--big]

Instances: the suite of tests/unit/k3sched/test_exact_free.py (small configs from configs/tiny-cpu.yaml, each
with a device budget that binds), and with ``--big`` two of the size the issue names (4 stages,
8 micro-batches, 2 layers per stage, MoE and dense). Per instance: the plain schedules' steps under
the budget (k3 on gpipe / 1f1b / zb-h1 / zb-h2 and serial, offload auto; a backbone that cannot meet
the budget is left out), the heuristic (k3 on the config's 1f1b backbone), and CP-SAT's best
schedule and proven bound after ``--dtime`` deterministic time (one worker, seed 0), hinted with the
plain plans. The gap is heuristic / optimum - 1 when CP-SAT proves the optimum; otherwise it lies
between heuristic / best - 1 (lower) and heuristic / bound - 1 (upper), and both are printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "k3sched"))

import test_exact_free as suite  # noqa: E402  (the instance table and budgets of the test)

from k3sched.exact import solve_free  # noqa: E402

BIG = {  # (pp, microbatches, layers per stage, dense layers, ep, room)
    "pp4-m8-2l-moe": (4, 8, 2, 1, 2, 2.5),
    "pp4-m8-2l-dense": (4, 8, 2, 8, 1, 2.5),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtime", type=float, default=10.0, help="CP-SAT deterministic time per instance")
    ap.add_argument("--only", nargs="*", help="instance names")
    ap.add_argument("--big", action="store_true", help="also the 4-stage, 8-micro-batch, 2-layer instances")
    a = ap.parse_args()
    if a.big:
        suite.INSTANCES.update(BIG)
    names = a.only or list(suite.INSTANCES)
    print(f"deterministic time {a.dtime:g} per instance, one worker, seed 0")
    print("| instance | tasks | plain steps under the budget, ms | k3 (1f1b) ms | exact status | best ms | bound ms "
          "| choices | gap vs best | gap vs bound | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    worst_lo = worst_hi = 0.0
    for name in names:
        cfg = suite.instance_config(name)
        plains = suite.plain_plans(name)
        if not plains:
            print(f"| {name} | | none meets the budget | | | | | | | | |")
            continue
        t0 = time.perf_counter()
        res = solve_free(cfg, hint_plans=list(plains.values()), deterministic_time=a.dtime, time_limit_s=3600)
        wall = time.perf_counter() - t0
        suite.check_schedule(cfg, res)
        steps = {k: p.metrics.step_time_us for k, p in plains.items()}
        heur = steps.get("1f1b")
        assert all(res.makespan_us <= s + res.rounding_us + 1e-6 for s in steps.values())
        lo = heur / res.makespan_us - 1 if heur else None
        hi = heur / res.bound_us - 1 if heur else None
        if heur:
            worst_lo, worst_hi = max(worst_lo, lo), max(worst_hi, hi)
        ch = Counter(res.choices.values())
        gaps = f" | {lo * 100:.2f}% | {hi * 100:.2f}% |" if heur else " | (1f1b over budget) | |"
        plain = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in steps.items())
        k3 = f"{heur / 1e3:.2f}" if heur else "-"
        chosen = " ".join(f"{k} {ch[k]}" for k in ("keep", "local", "remote", "recompute") if ch[k])
        print(f"| {name} | {res.num_tasks} | {plain} | {k3} | {res.status} | {res.makespan_us / 1e3:.2f} | "
              f"{res.bound_us / 1e3:.2f} | {chosen}{gaps} {wall:.0f} |",
              flush=True)
    print(f"largest heuristic gap: at least {worst_lo * 100:.2f}% (vs the best schedule found), at most "
          f"{worst_hi * 100:.2f}% (vs CP-SAT's proven bound)")


if __name__ == "__main__":
    main()
