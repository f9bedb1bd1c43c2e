"""Does a transfer slack above 3 pay on the shaped links? An A/B of the EP-bound row at comm:compute 0.5.

A: the look-ahead, WGrad lag and transfer slack whose k3 plan has the shortest expected step among
``benchmarks/bench_overlap.py``'s ``KNOBS`` with slack at most 3 (the bench's choice before
c4e77b6); B: the same choice over every slack of ``k3sched.tune.TRANSFER_SLACKS`` (its choice now;
[Note: transfer slack] in k3sched/planner.py). Both are k3 runs of the same model on the same
shaped links (``--emulate-links``), alternated A B B A per round so that a drift of the machine's
speed that is linear over a round cancels; each run's overlap is what the bench takes (rank 0's
median steady-step comm/compute overlap), its step the median steady step.

The hardware numbers come from a bench_overlap output (``--from DIR``: its ``bench_overlap.json``,
so the rate and the plans are those of that run) or from a fresh probe. Printed: each run, then per
side the mean step and overlap, the overlap's spread over runs, the planned and expected overlap,
and B over A. When A and B pick the same knobs there is nothing to compare and it says so.

Usage: ``.venv/bin/python benchmarks/bench_slack.py [--from DIR] [--rounds 3] [--out DIR]`` (root,
ip and tc needed; a round is four runs, about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overlap as B  # noqa: E402  (the bench's configs, probe, runs and overlap)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", type=Path, default=None,
                    help="a bench_overlap output directory: its probed hardware and link rate")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of A B B A (default 3)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit(f"bench_slack: --rounds must be at least 1; got {a.rounds}")
    from runtime.testbed import testbed_available

    why = testbed_available()
    if why:
        raise SystemExit(f"bench_slack: the shaped-link testbed is not available: {why}")
    out = a.out or Path(tempfile.mkdtemp(prefix="bench_slack_"))
    out.mkdir(parents=True, exist_ok=True)
    base = list(B.CONFIGS.values())[0]  # EP-bound
    if a.src is not None:
        f = a.src / "bench_overlap.json"
        if not f.is_file():
            raise SystemExit(f"bench_slack: {f} not found; --from takes a bench_overlap.py --out directory")
        try:
            d = json.loads(f.read_text())
            hw = d["hardware"]
            gbps = next((r["gbps"] for r in d["rows"] if r["config"].startswith("ep") and r["ratio"] == 0.5), None)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"bench_slack: {f} is not a bench_overlap.json (hardware and rows needed): {e!r}")
    else:
        hw = B.probe_hardware(out)
        gbps = None
    gbps = gbps or B.rate_for_ratio(base, hw, 0.5)
    if gbps is None:
        raise SystemExit("bench_slack: comm:compute 0.5 is not reachable with these hardware numbers")
    ov = B.overrides_for(base, hw, gbps)
    knobs = {"A": B.fastest_knobs(ov, max_slack=3), "B": B.fastest_knobs(ov)}
    print(f"bench_slack: EP-bound at {gbps * 1e3:.1f} MB/s; A (slack <= 3) {' '.join(knobs['A'])}; "
          f"B (slack <= {max(B.TRANSFER_SLACKS)}) {' '.join(knobs['B'])}", flush=True)
    if knobs["A"] == knobs["B"]:
        print("bench_slack: A and B pick the same knobs; nothing to compare")
        return
    res: dict[str, list[tuple[float, float, float, float]]] = {"A": [], "B": []}
    for i, side in enumerate(["A", "B", "B", "A"] * a.rounds):
        d = out / f"{i:02d}{side}"
        m = B.run("ep-bound", ov + knobs[side], "k3", a.steps, d)
        (planned, expected, measured), _ = B.overlap(d)
        res[side].append((m["measured_us"], measured, planned, expected))
        print(f"  {side} step {m['measured_us'] / 1e3:.0f} ms (predicted {m['predicted_us'] / 1e3:.0f}) overlap "
              f"planned {planned:.3f} expected {expected:.3f} measured {measured:.3f}", flush=True)
    mean = {s: (statistics.mean(x[0] for x in r), statistics.mean(x[1] for x in r)) for s, r in res.items()}
    for s, r in res.items():
        print(f"  {s}: {len(r)} runs, step {mean[s][0] / 1e3:.0f} ms, overlap measured {100 * mean[s][1]:.1f}% "
              f"(spread {100 * statistics.pstdev([x[1] for x in r]):.1f} points a run), planned {100 * r[0][2]:.1f}%, "
              f"expected {100 * r[0][3]:.1f}%")
    print(f"  B / A step x{mean['B'][0] / mean['A'][0]:.3f}, overlap {100 * (mean['B'][1] - mean['A'][1]):+.1f} points"
          f" (outputs under {out})")


if __name__ == "__main__":
    main()
