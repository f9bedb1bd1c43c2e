"""Offload benchmark (CPU, 4 gloo ranks, tiny config): step time and measured peak device memory
of local host offload and EP dispatch recompute as ratios to no offload on GPipe (every
micro-batch in flight), and of remote offload (stage 0's sets on stage 1) as ratios to no offload
on the same lean 1F1B schedule (look-ahead 0, WGrad lag 0): each row against a reference that
differs from it only in the offload, so the schedule's own effect is not in the figure.

    python benchmarks/bench_offload.py [--steps 4]

The planner reads saved bytes measured on the moe code (runtime.measure.write_profile). Step
time: median of the steps after the first. Peak: max over ranks of the measured device bytes
(+ bytes held for peers); the plan's prediction beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from k3sched.config import load_config  # noqa: E402
from runtime.measure import write_profile  # noqa: E402
from runtime.launch import run_command  # noqa: E402

TINY = REPO / "configs" / "tiny-cpu.yaml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_offload_"))
    prof = tmp / "saved.yaml"
    write_profile(load_config(TINY), prof)
    base = [f"schedule.profile={prof}", "schedule.pipeline=gpipe"]
    runs = {"no offload": base + ["schedule.offload=none"]}
    ref = _run(tmp / "none", runs["no offload"], args.steps)
    half = max(ref["peak_device_bytes_measured"]) / 2 / 2**30
    lean = [f"schedule.profile={prof}", "schedule.lookahead=0", "schedule.wgrad_lag=0"]
    lean_ref = _run(tmp / "none_lean", lean + ["schedule.offload=none"], args.steps)
    lean_budget = 0.98 * max(lean_ref["peak_device_bytes_planned"]) / 2**30
    rows = {  # name -> (summary, its reference's name)
        "no offload (GPipe)": (ref, "no offload (GPipe)"),
        "local offload (budget 1/2 peak)": (_run(tmp / "local", base + [f"schedule.device_memory_budget={half!r}"],
                                                 args.steps), "no offload (GPipe)"),
        "recompute (EP dispatch)": (_run(tmp / "recompute", base + ["schedule.offload=none",
                                                                    "schedule.dispatch_recompute=true"], args.steps),
                                    "no offload (GPipe)"),
        "no offload (1F1B lean)": (lean_ref, "no offload (1F1B lean)"),
        # a budget 2% under the lean schedule's own planned peak (the least this config plans with
        # remote offload): remote offload must make room; the highest stage is the budget's limit
        "remote offload (1F1B lean, s0->s1)": (_run(tmp / "remote", lean + [
            "schedule.offload=remote", f"schedule.device_memory_budget={lean_budget!r}"], args.steps),
            "no offload (1F1B lean)"),
    }
    print(f"{'mode':36s} {'step ms':>9s} {'x':>6s} {'peak MiB':>9s} {'x':>6s} {'plan MiB':>9s} {'sets l/r':>9s}  vs")
    for name, (s, ref_name) in rows.items():
        r = rows[ref_name][0]
        t, m = _step(s), max(s["peak_device_bytes_measured"])
        t0, m0 = _step(r), max(r["peak_device_bytes_measured"])
        off = s.get("offloaded_sets") or {}
        print(f"{name:36s} {t * 1e3:9.1f} {t / t0:6.2f} {m / 2**20:9.2f} {m / m0:6.2f} "
              f"{max(s['peak_device_bytes_planned']) / 2**20:9.2f} {off.get('local', 0):>4}/{off.get('remote', 0):<4}"
              f"  {ref_name}")
    return 0


def _run(out: Path, overrides: list[str], steps: int) -> dict:
    rc = run_command(TINY, overrides, steps, None, out, False, None, timeout_s=300, quiet=True)
    if rc != 0:
        raise SystemExit(f"bench run failed ({rc}): {overrides}")
    return json.loads((out / "summary.json").read_text())


def _step(s: dict) -> float:
    return statistics.median(s["step_time_s"][1:] or s["step_time_s"])


if __name__ == "__main__":
    sys.exit(main())
