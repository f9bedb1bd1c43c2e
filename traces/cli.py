"""``python -m traces.cli --plan plan.json TRACE... [--json OUT]``: validate recorded traces
against a plan. Exit status: 0 conforms, 1 does not, 2 unreadable input (one line on stderr)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from traces.chrome import read_trace
from traces.events import EventTable, TraceError
from traces.validate import DEFAULT_TOLERANCE_US, load_plan, validate


def validate_main(plan_path, trace_paths, json_out=None, tolerance_us: float = DEFAULT_TOLERANCE_US, *,
                  cross_rank_clocks: bool = False, only_traced_stages: bool = False, out=None) -> int:
    """Validate trace files (nsys .sqlite, runtime or Kineto .json / .json.gz, auto-detected)
    against a plan file; print the report; write its JSON to ``json_out`` if given. Returns the
    exit code (0 conforms, 1 does not, 2 unreadable input)."""
    out = out or sys.stdout
    try:
        plan = load_plan(plan_path)
        if not trace_paths:
            raise TraceError("no trace files given")
        events = EventTable.concat([read_trace(p) for p in trace_paths])
        report = validate(plan, events, tolerance_us, cross_rank_clocks=cross_rank_clocks,
                          only_traced_stages=only_traced_stages)
    except TraceError as e:
        print(f"k3sched validate: error: {e}", file=sys.stderr)
        return 2
    print(report.render(), file=out)
    if json_out:
        try:
            Path(json_out).write_text(json.dumps(report.to_json(), indent=1))
        except OSError as e:
            print(f"k3sched validate: error: {json_out}: cannot write ({e.strerror})", file=sys.stderr)
            return 2
    return 0 if report.conforms else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m traces.cli", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="plan.json written by the planner")
    ap.add_argument("traces", nargs="+", metavar="TRACE", help="trace files: .sqlite, .json, .json.gz")
    ap.add_argument("--json", dest="json_out", help="write the report as JSON here")
    ap.add_argument("--tolerance-us", type=float, default=DEFAULT_TOLERANCE_US)
    ap.add_argument("--cross-rank-clocks", action="store_true",
                    help="ranks share one clock: also check dependencies across ranks")
    ap.add_argument("--only-traced-stages", action="store_true",
                    help="do not report stages that no given trace ran")
    a = ap.parse_args(argv)
    return validate_main(a.plan, a.traces, a.json_out, a.tolerance_us, cross_rank_clocks=a.cross_rank_clocks,
                         only_traced_stages=a.only_traced_stages)


if __name__ == "__main__":
    sys.exit(main())
