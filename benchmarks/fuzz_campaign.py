"""A fuzz campaign over every front door of ``k3sched`` (issue: hardened front doors): seeded
mutations of configs, ``--set`` values, profiles, plans, runtime / Kineto / nsys traces and run
summaries (tests/fuzzcases.py), each run through the command's own entry point in this process.

Prints, per family: cases, exit codes, and the problems (traceback, internal error = exit 3,
garbage accepted, a refusal that is not one line, slower than 20 s), then every problem case.
Exit 1 when there is any problem. ``make fuzz`` runs it with the default 150 cases per family.

    .venv/bin/python benchmarks/fuzz_campaign.py [--per-family N] [--seed S] [--families a,b]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import fuzzcases  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-family", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", default=",".join(fuzzcases.FAMILIES))
    a = ap.parse_args(argv)
    fams = [f for f in a.families.split(",") if f]
    unknown = [f for f in fams if f not in fuzzcases.MAKERS]
    if unknown:
        print(f"error: unknown families {unknown}; allowed: {', '.join(fuzzcases.FAMILIES)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    fuzzcases.base()
    rows, problems = [], []
    with tempfile.TemporaryDirectory() as d:
        for fam in fams:
            codes, probs = collections.Counter(), collections.Counter()
            garbage = worst = 0.0
            for i in range(a.per_family):
                rnd = random.Random(f"{a.seed}/{fam}/{i}")
                case = fuzzcases.MAKERS[fam](rnd)
                out = fuzzcases.run_case(case, Path(d) / f"{fam}{i}")
                codes[out.code] += 1
                garbage += case.garbage
                worst = max(worst, out.seconds)
                p = fuzzcases.judge(case, out)
                if p:
                    probs[p] += 1
                    problems.append(f"{fam} #{i}: {case.what}: {p} (exit {out.code}, {out.seconds:.1f} s) "
                                    f"{out.err.strip()[-200:]}")
            rows.append((fam, a.per_family, int(garbage), codes, probs, worst))
            print(f"  {fam:<8} done", file=sys.stderr, flush=True)
    print(f"{'family':<8} {'cases':>5} {'garbage':>7} {'exit 0':>6} {'exit 1':>6} {'exit 2':>6} {'other':>5} "
          f"{'traceback':>9} {'internal':>8} {'accepted garbage':>16} {'not one line':>12} {'slow':>4} {'max s':>6}")
    tot = collections.Counter()
    for fam, n, g, codes, probs, worst in rows:
        other = n - codes[0] - codes[1] - codes[2]
        print(f"{fam:<8} {n:>5} {g:>7} {codes[0]:>6} {codes[1]:>6} {codes[2]:>6} {other:>5} {probs['traceback']:>9} "
              f"{probs['internal error']:>8} {probs['accepted garbage']:>16} {probs['not one line']:>12} "
              f"{probs['slow']:>4} {worst:>6.2f}")
        tot.update({"n": n, "g": g, **{f"c{k}": v for k, v in codes.items()}, **probs})
    print(f"{'all':<8} {tot['n']:>5} {tot['g']:>7} {tot['c0']:>6} {tot['c1']:>6} {tot['c2']:>6} "
          f"{tot['n'] - tot['c0'] - tot['c1'] - tot['c2']:>5} {tot['traceback']:>9} {tot['internal error']:>8} "
          f"{tot['accepted garbage']:>16} {tot['not one line']:>12} {tot['slow']:>4}")
    for p in problems:
        print("PROBLEM", p)
    print(f"({time.perf_counter() - t0:.0f} s; seed {a.seed})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
