"""Checkpoint benchmark (CPU, 4 gloo ranks, tiny config as shipped: PP 2 x EP 2): the step-time
cost of ``--save-every 1`` with asynchronous (``dcp.async_save``) and blocking (``dcp.save``)
saves, against the same run without checkpoints.

    python benchmarks/bench_checkpoint.py [--steps 8] [--repeat 1] [--set SECTION.KEY=VALUE ...]

Step wall time: from the step's start barrier to the end of its save call (what the training loop
waits for; summary.json ``step_wall_s``), median of the steps after the first, the median over
``--repeat`` runs. ``blocking`` is the seconds a save held training up (slowest rank), ``write``
the seconds until the checkpoint was complete (rank 0; asynchronous: in the background). On this
2-core machine the background write competes with the ranks' lane threads for the same cores, so
an asynchronous save is not free: it shows up as slower steps rather than as blocking time.
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

from runtime.launch import run_command  # noqa: E402

TINY = REPO / "configs" / "tiny-cpu.yaml"


def _run(out: Path, steps: int, sets: list[str], **kw) -> dict:
    rc = run_command(TINY, sets, steps, None, out, False, None, timeout_s=900, quiet=True, **kw)
    if rc != 0:
        raise SystemExit(f"bench_checkpoint: run failed ({rc}); see {out}")
    return json.loads((out / "summary.json").read_text())


def _median_after_first(xs: list[float]) -> float:
    return statistics.median(xs[1:] or xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    modes = {"no checkpoints": {}, "--save-every 1, async": {"save_every": 1, "save_mode": "async"},
             "--save-every 1, blocking": {"save_every": 1, "save_mode": "blocking"}}
    rows: dict[str, dict] = {}
    for rep in range(args.repeat):
        for name, kw in modes.items():  # interleaved, so a load change hits every mode alike
            s = _run(tmp / f"{rep}-{name.split(',')[-1].strip() or 'none'}".replace(" ", "_"), args.steps,
                     args.sets, **kw)
            saves = s["checkpoint"]["saves"]
            r = rows.setdefault(name, {"wall": [], "step": [], "blocking": [], "write": []})
            r["wall"].append(_median_after_first(s["step_wall_s"]))
            r["step"].append(_median_after_first(s["step_time_s"]))
            if saves:
                r["blocking"].append(s["checkpoint_s"] / len(saves))
                r["write"].append(statistics.median(e.get("total_s", 0.0) for e in saves))
    size = sum(f.stat().st_size for f in next(tmp.glob("*-async")).glob("checkpoints/step_1/*"))
    base = statistics.median(rows["no checkpoints"]["wall"])
    print(f"tiny-cpu {' '.join(args.sets)} | {args.steps} steps x {args.repeat} | checkpoint {size / 2**20:.1f} MiB "
          f"(DCP files, 4 ranks)")
    print(f"{'mode':28s} {'step wall ms':>12s} {'cost':>7s} {'train step ms':>13s} {'blocking ms':>11s} "
          f"{'write ms':>9s}")
    out = {}
    for name, r in rows.items():
        wall = statistics.median(r["wall"])
        blocking = statistics.median(r["blocking"]) if r["blocking"] else 0.0
        write = statistics.median(r["write"]) if r["write"] else 0.0
        print(f"{name:28s} {wall * 1e3:12.1f} {(wall / base - 1) * 100:+6.1f}% "
              f"{statistics.median(r['step']) * 1e3:13.1f} {blocking * 1e3:11.1f} {write * 1e3:9.1f}")
        out[name] = {"step_wall_s": wall, "cost": wall / base - 1, "blocking_s": blocking, "write_s": write}
    (tmp / "bench_checkpoint.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {tmp}/bench_checkpoint.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
