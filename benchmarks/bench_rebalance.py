"""Rebalance benchmark (CPU, 2 gloo ranks, tiny config at PP 2 x EP 1 with 8 layers and 8
micro-batches, one rank per core): a run with a deliberately uneven layer split
(``parallel.stage_layers`` [6, 2]: stage 0 holds the embedding and six layers, stage 1 two layers
and the head) is rebalanced by ``k3sched rebalance`` from its own traces; the proposed config
(``layer_split: profile``) is then run, and the two configs are measured side by side,
alternating, ``--rounds`` times each.

    python benchmarks/bench_rebalance.py [--steps 5] [--rounds 2]

Printed: the proposal (per-stage measured-time estimate before / after, the planner's predicted
step before / after) and per round the measured step of each config (median of the steps after
the first) with their ratio. What it does not show: a gain on GPUs or on the shaped-link testbed,
or with more ranks than cores (4 ranks on 2 cores share them, and a lighter stage's idle time
goes to the loaded stage's threads, which hides most of an imbalance).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.launch import run_command  # noqa: E402

TINY = REPO / "configs" / "tiny-cpu.yaml"
SHAPE = ["parallel.ep=1", "model.layers=8", "parallel.microbatches=8"]
UNEVEN = SHAPE + ["parallel.stage_layers=[6,2]"]


def _run(config: Path, overrides: list[str], out: Path, steps: int) -> dict:
    rc = run_command(config, overrides, steps, None, out, False, None, timeout_s=600.0, quiet=True)
    if rc != 0:
        raise SystemExit(f"run of {config} {overrides} failed (exit {rc}); see {out}")
    return json.loads((out / "summary.json").read_text())


def _step_ms(summary: dict) -> float:
    times = summary["step_time_s"]
    return statistics.median(times[1:] or times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_rebalance_"))
    first = _run(TINY, UNEVEN, tmp / "uneven0", args.steps)
    new = tmp / "rebalanced.yaml"
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "rebalance", str(tmp / "uneven0"), "-o", str(new)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    print(r.stdout, end="")
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return 1
    rows = []
    for i in range(args.rounds):
        a = first if i == 0 else _run(TINY, UNEVEN, tmp / f"uneven{i}", args.steps)
        b = _run(new, [], tmp / f"rebalanced{i}", args.steps)
        rows.append((_step_ms(a), _step_ms(b), a["predicted_step_time_us"] / 1e3, b["predicted_step_time_us"] / 1e3))
    print(f"\nmeasured step (median of steps 2..{args.steps}), tiny-cpu PP 2 x EP 1, 8 layers, 2 gloo ranks:")
    print("round   uneven [6,2] ms   rebalanced ms   rebalanced/uneven   predicted uneven -> rebalanced ms")
    for i, (a, b, pa, pb) in enumerate(rows):
        print(f"{i + 1:>5} {a:>17.1f} {b:>15.1f} {b / a:>19.3f}   {pa:.1f} -> {pb:.1f}")
    ratios = [b / a for a, b, _, _ in rows]
    print(f"median ratio rebalanced/uneven: {statistics.median(ratios):.3f} over {len(rows)} round(s); "
          f"outputs in {tmp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
