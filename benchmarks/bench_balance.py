"""Redundant experts on shaped links: does placing replicas of hot experts shorten a skewed step?

On the shaped-link testbed (``runtime/testbed.py``, ``k3sched run --emulate-links``: one network
namespace per rank, each rank its own emulated node, its NIC rate-limited with tc), for an
EP-bound config (tiny-cpu at pp 1 x ep 2 with narrow experts, ``--gbps`` per rank) and router skews 0, 1.0 and 1.5
(``model.router_skew``, [Note: router skew] in k3sched/balance.py), measured side by side:

- **without**: the run without redundant experts (contiguous placement); its ``summary.json``
  routing statistics feed ``k3sched balance --redundant R``;
- **with**: the run with the placement ``balance`` wrote (``parallel.redundant_experts=R``,
  ``schedule.expert_placement``);
- the step time of both (median of the steady steps of ``--pairs`` alternating runs each), the
  gain, the routing imbalance (max over mean tokens per EP rank) each run measured, and the step
  each plan predicts.

Predictions: ``plan`` is what the run itself printed (the config's uncalibrated hardware numbers);
``calibrated`` plans with a profile fitted (``k3sched calibrate``) on the skew-0 run without
replicas, so every other row is a prediction for a config the profile was not fitted to (the skew
0 "without" row is the fit's own residual). The "without" plans assume Zipf shares, the "with"
plans the loads measured by the run ``balance`` read (from the placement file).

Usage: ``.venv/bin/python benchmarks/bench_balance.py [--steps 5] [--pairs 2] [--skews 0,1.0,1.5]
[--redundant 1] [--gbps 0.005] [--out DIR]`` (root, ip and tc needed; 2 x pairs runs per skew, about
a minute each on 2 cores). The machine is shared: each variant's figure is the median of all its
runs' steady steps (steps 2..N), and the table shows their spread.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TINY = REPO / "configs" / "tiny-cpu.yaml"
BASE = ["parallel.pp=1", "parallel.ep=2", "hardware.gpus_per_node=1", "schedule.offload=none",
        "model.expert_hidden=32", "model.dense_hidden=64", "model.vocab=64"]
"""tiny-cpu at pp 1 x ep 2 with narrow experts, dense MLP and vocabulary: the all-to-alls (T k h
bytes per rank, unchanged) dominate the step, so the shared 2-core machine's CPU noise moves it less."""


def cli(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", *map(str, args)], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"k3sched {' '.join(map(str, args[:2]))}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def run(out: Path, overrides: list[str], steps: int, reuse: bool = False) -> dict:
    """One run on the testbed (``reuse``: read the summary of a finished run in ``out`` instead;
    a run that fails is tried once more: the machine is shared)."""
    from runtime.launch import run_command

    t0 = time.perf_counter()
    rc = 0 if reuse and (out / "summary.json").exists() else None
    for _ in range(2):
        if rc == 0:
            break
        rc = run_command(TINY, overrides, steps, None, out, False, None, timeout_s=900, quiet=True,
                         emulate_links=True)
    if rc:
        err = sorted(out.glob("error_rank*.txt"))
        raise RuntimeError(f"run {out.name}: exit {rc}: {err[0].read_text().strip() if err else ''}")
    s = json.loads((out / "summary.json").read_text())
    steady = sorted(s["step_time_s"][1:] or s["step_time_s"])
    return {"measured_us": steady[len(steady) // 2] * 1e6, "plan_us": s["predicted_step_time_us"],
            "imbalance": s["routing"]["imbalance_mean"], "wall_s": time.perf_counter() - t0,
            "slots": s["routing"]["slots"], "steady_s": steady}


def pool(runs: list[dict]) -> dict:
    """The runs of one variant together: median of all their steady steps, mean imbalance."""
    steady = sorted(x for r in runs for x in r["steady_s"])
    return {"measured_us": steady[len(steady) // 2] * 1e6, "plan_us": runs[0]["plan_us"], "steady_s": steady,
            "imbalance": sum(r["imbalance"] for r in runs) / len(runs), "slots": runs[0]["slots"]}


def predict(overrides: list[str]) -> float:
    from k3sched.config import load_config
    from k3sched.planner import plan

    return float(plan(load_config(TINY, overrides)).metrics.step_time_us)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=2, help="without / with pairs per skew (alternating)")
    ap.add_argument("--skews", default="0,1.0,1.5")
    ap.add_argument("--redundant", type=int, default=1)
    ap.add_argument("--gbps", type=float, default=0.005, help="shaped NIC rate per rank, GB/s")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reuse", action="store_true", help="keep the finished runs already in --out (resume a "
                                                         "benchmark that stopped)")
    a = ap.parse_args()
    work = a.out or Path(tempfile.mkdtemp(prefix="bench_balance_"))
    work.mkdir(parents=True, exist_ok=True)
    skews = [float(x) for x in a.skews.split(",")]
    base = BASE + [f"hardware.internode_gbps={a.gbps:g}"]
    print(f"bench_balance: tiny-cpu pp 1 x ep 2 (expert hidden 32, dense hidden 64, vocab 64), one emulated node "
          f"per rank, NIC {a.gbps:g} GB/s, {a.redundant} redundant slot(s) per rank, {a.pairs} pair(s) of runs of "
          f"{a.steps} steps per skew; outputs in {work}", flush=True)
    rows = []
    profile = None
    for s in skews:
        skew = [f"model.router_skew={s:g}"]
        placement = work / f"skew{s:g}_placement.yaml"
        w_over = base + skew + [f"parallel.redundant_experts={a.redundant}", f"schedule.expert_placement={placement}"]
        wos, ws = [], []
        for rep in range(a.pairs):  # without, then with, side by side; the pairs alternate
            wo_dir, w_dir = work / f"skew{s:g}_without_{rep}", work / f"skew{s:g}_with_{rep}"
            wos.append(run(wo_dir, base + skew, a.steps, a.reuse))
            if rep == 0 and not (a.reuse and placement.exists()):  # balance reads the first run without replicas
                cli("balance", wo_dir, "--redundant", a.redundant, "-o", placement)
            ws.append(run(w_dir, w_over, a.steps, a.reuse))
            if profile is None:  # fitted on the first (skew 0) run without replicas
                profile = work / "profile.yaml"
                if not (a.reuse and profile.exists()):
                    cli("calibrate", *sorted(wo_dir.glob("trace_rank*.json")), "--plan", wo_dir / "plan.json",
                    "-o", profile, "--summary", wo_dir / "summary.json")
            print(f"skew {s:g} pair {rep + 1}: without {wos[-1]['measured_us'] / 1e3:7.1f} ms (imbalance "
                  f"{wos[-1]['imbalance']:.3f}) | with {ws[-1]['measured_us'] / 1e3:7.1f} ms (imbalance "
                  f"{ws[-1]['imbalance']:.3f}, slots {ws[-1]['slots']}) | runs {wos[-1]['wall_s']:.0f} s + "
                  f"{ws[-1]['wall_s']:.0f} s", flush=True)
        prof = [f"schedule.profile={profile}"]
        wo, w = pool(wos), pool(ws)
        wo["cal_us"], w["cal_us"] = predict(base + skew + prof), predict(w_over + prof)
        rows.append((s, wo, w))
    print()
    print(f"{'skew':>5} {'run':>8} {'measured ms':>12} {'steady steps ms':>17} {'imbalance':>10} {'plan ms':>9} "
          f"{'meas/plan':>9} {'calibrated ms':>14} {'meas/cal':>8}  gain (1 - with / without)")
    for s, wo, w in rows:
        for name, r in (("without", wo), ("with", w)):
            gain = "" if name == "without" else (f"measured {1 - w['measured_us'] / wo['measured_us']:+.1%}, "
                                                  f"calibrated {1 - w['cal_us'] / wo['cal_us']:+.1%}")
            spread = f"{min(r['steady_s']) * 1e3:.0f}-{max(r['steady_s']) * 1e3:.0f}"
            print(f"{s:>5g} {name:>8} {r['measured_us'] / 1e3:>12.1f} {spread:>17} {r['imbalance']:>10.3f} "
                  f"{r['plan_us'] / 1e3:>9.1f} {r['measured_us'] / r['plan_us']:>9.2f} {r['cal_us'] / 1e3:>14.1f} "
                  f"{r['measured_us'] / r['cal_us']:>8.2f}  {gain}")
    (work / "bench_balance.json").write_text(json.dumps(
        {"gbps": a.gbps, "redundant": a.redundant, "steps": a.steps, "pairs": a.pairs,
         "rows": [{"skew": s, "without": wo, "with": w} for s, wo, w in rows]}, indent=1))
    print(f"\nwrote {work / 'bench_balance.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
