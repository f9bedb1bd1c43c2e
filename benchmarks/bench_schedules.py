"""Backbone comparison on the full-size configs, with the issue's goals printed beside the numbers.

Run: .venv/bin/python benchmarks/bench_schedules.py [CONFIG ...]   (default: k2-like, dsv3-like)

Goals (from the issue), printed as measured vs goal, never adjusted:
  * the full K2-like step is planned in under 1 s (its own pipeline, k3 strategy; CPU time of this
    process, best of 3 runs, as bench_planner.py measures it);
  * k3 on the best backbone is at most 1.03x its lower bound;
  * exposed EP all-to-all under 3% of the step (on the best backbone).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console

from k3sched.compare import best_row, compare, render_table
from k3sched.config import load_config
from k3sched.planner import plan

ROOT = Path(__file__).resolve().parents[1]
GOAL_PLAN_S, GOAL_RATIO, GOAL_EP = 1.0, 1.03, 0.03


def plan_cpu_s(cfg, n: int = 3) -> float:
    best = None
    for _ in range(n):
        t0 = time.process_time()
        plan(cfg)
        dt = time.process_time() - t0
        best = dt if best is None else min(best, dt)
    return best


def verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def main(paths: list[str]) -> None:
    console = Console(width=220)
    for path in paths:
        cfg = load_config(path)
        t0 = time.perf_counter()
        rows = compare(cfg)
        total = time.perf_counter() - t0
        console.print(render_table(rows, f"{cfg.model.name} ({Path(path).name}): pp {cfg.parallel.pp}, ep "
                                         f"{cfg.parallel.ep}, {cfg.parallel.microbatches} micro-batches; "
                                         f"compare took {total:.1f} s wall"))
        own = plan_cpu_s(cfg)
        best = best_row(rows)
        print(f"  plan {cfg.schedule.pipeline} (own pipeline, k3): {own:.3f} s cpu (best of 3)"
              + (f"   goal < {GOAL_PLAN_S:.1f} s: {verdict(own < GOAL_PLAN_S)}" if "k2" in Path(path).name else ""))
        if best is None:
            print("  no schedule planned")
            continue
        print(f"  best backbone {best.schedule} (vpp {best.vpp}): step {best.step_us / 1e3:.2f} ms, "
              f"x{best.ratio_to_bound:.3f} its lower bound   goal <= {GOAL_RATIO}: "
              f"{verdict(best.ratio_to_bound <= GOAL_RATIO)}")
        print(f"  exposed EP on it: {best.exposed_ep_ratio * 100:.2f}% of step   goal < {GOAL_EP * 100:.0f}%: "
              f"{verdict(best.exposed_ep_ratio < GOAL_EP)}")
        failed = [f"{r.label}: {r.error}" for r in rows if not r.ok]
        for f in failed:
            print(f"  not planned: {f}")
        print()


if __name__ == "__main__":
    main(sys.argv[1:] or [str(ROOT / "configs" / "k2-like.yaml"), str(ROOT / "configs" / "dsv3-like.yaml")])
