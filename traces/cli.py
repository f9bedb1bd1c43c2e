"""``python -m traces.cli --plan plan.json TRACE... [--json OUT]``: validate recorded traces
against a plan. Exit status: 0 conforms, 1 does not, 2 unreadable input or a bad option (one
line on stderr), 3 an internal error (a bug: one line on stderr naming a file with the traceback)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from traces.chrome import read_trace
from traces.events import EventTable, TraceError
from traces.validate import DEFAULT_TOLERANCE_US, load_plan, validate

PROG = "k3sched validate"


def _err(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def writable_target(path, *, directory: bool = False) -> str | None:
    """Why ``path`` cannot be written (one phrase), or None: the one check of every output option
    of both command lines (``k3sched`` calls it too). ``directory``: the output is a directory to
    create or fill (``--out``), else a file."""
    import tempfile

    path = Path(path)
    if directory:
        if path.exists() and not path.is_dir():
            return "is a file, expected a directory"
        anc = path
    else:
        if path.is_dir():
            return "is a directory"
        if path.exists():
            return None if os.access(path, os.W_OK) else "is not writable"
        anc = path.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        return f"{anc} is not a directory"
    if not os.access(anc, os.W_OK | os.X_OK):
        return f"cannot create files under {anc}"
    try:  # access() says yes to root everywhere: try it (a file removed on close)
        with tempfile.TemporaryFile(dir=anc):
            pass
    except OSError as e:
        return f"cannot create files under {anc} ({e.strerror})"
    return None


def read_trace_files(paths, *, skip_bad_events: bool = False, prog: str = PROG) -> EventTable:
    """Read trace files (any format ``read_trace`` reads) into one table. Malformed events are a
    ``TraceError`` unless ``skip_bad_events``; then the readers drop them and the count of each
    file is said on stderr ("skipped N malformed events")."""
    if not paths:
        raise TraceError("no trace files given")
    tables = []
    for p in paths:
        t = read_trace(p, skip_bad_events=skip_bad_events)
        n = t.bad_events
        if n > 0:
            print(f"{prog}: {p}: skipped {n} malformed events", file=sys.stderr)
        tables.append(t)
    return EventTable.concat(tables)


def validate_main(plan_path, trace_paths, json_out=None, tolerance_us: float = DEFAULT_TOLERANCE_US, *,
                  cross_rank_clocks: bool = False, only_traced_stages: bool = False, out=None,
                  skip_bad_events: bool = False, clock: str = "auto") -> int:
    """Validate trace files (nsys .sqlite, runtime or Kineto .json / .json.gz, auto-detected)
    against a plan file; print the report; write its JSON to ``json_out`` if given. Returns the
    exit code (0 conforms, 1 does not, 2 unreadable input or a bad argument; checked before any
    work: the plan against its schema, ``json_out`` writable, ``tolerance_us`` finite and >= 0).
    Anything else raised is a bug (the CLIs' boundary turns it into exit 3)."""
    out = out or sys.stdout
    if clock not in ("auto", "host"):
        _err(f"--clock: must be auto (device times where a lane's tasks have GPU events) or host; got {clock!r}")
        return 2
    if isinstance(tolerance_us, bool) or not isinstance(tolerance_us, (int, float)) \
            or not math.isfinite(tolerance_us) or tolerance_us < 0:
        _err(f"--tolerance-us: must be a finite number of microseconds >= 0; got {tolerance_us}")
        return 2
    if json_out:
        why = writable_target(json_out)
        if why:
            _err(f"--json {json_out}: {why}")
            return 2
    try:
        plan = load_plan(plan_path, typed=True)
        events = read_trace_files(trace_paths, skip_bad_events=skip_bad_events)
    except TraceError as e:
        _err(str(e))
        return 2
    report = validate(plan, events, tolerance_us, cross_rank_clocks=cross_rank_clocks,
                      only_traced_stages=only_traced_stages, clock=clock)
    doc = report.to_json()  # checked against the report schema
    print(report.render(), file=out)
    if json_out:
        try:
            Path(json_out).write_text(json.dumps(doc, indent=1, allow_nan=False))
        except OSError as e:
            _err(f"--json {json_out}: cannot write ({e.strerror})")
            return 2
    return 0 if report.conforms else 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message)
        _err(f"{message} (see python -m traces.cli --help)")
        sys.exit(2)


def crash_report(exc: BaseException, prog: str) -> str:
    """Write ``exc``'s traceback (with the command line) to ``$TMPDIR/k3sched-crash-*.txt``;
    return the one-line report of an internal error (a bug). Both command lines use it."""
    import tempfile
    import time
    import traceback

    first = str(exc).splitlines()[0] if str(exc) else ""
    what = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    try:
        fd, name = tempfile.mkstemp(prefix=f"k3sched-crash-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"{prog} {' '.join(sys.argv[1:])}\n")
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=f)
        where = f"traceback in {name}"
    except OSError as e:
        where = f"the traceback could not be written ({e.strerror})"
    return f"internal error (a bug, not your input): {what}; {where}"


def internal_error(exc: BaseException, prog: str = PROG) -> int:
    """Report an unexpected exception (a bug) as one line naming a file with its traceback;
    returns exit code 3."""
    print(f"{prog}: {crash_report(exc, prog)}", file=sys.stderr)
    return 3


def main(argv=None) -> int:
    ap = _Parser(prog="python -m traces.cli", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="plan.json written by the planner")
    ap.add_argument("traces", nargs="+", metavar="TRACE", help="trace files: .sqlite, .json, .json.gz")
    ap.add_argument("--json", dest="json_out", help="write the report as JSON here")
    ap.add_argument("--tolerance-us", type=float, default=DEFAULT_TOLERANCE_US)
    ap.add_argument("--cross-rank-clocks", action="store_true",
                    help="ranks share one clock: also check dependencies across ranks")
    ap.add_argument("--only-traced-stages", action="store_true",
                    help="do not report stages that no given trace ran")
    ap.add_argument("--clock", choices=("auto", "host"), default="auto",
                    help="auto: device times for lanes whose tasks all have GPU events; host: host ranges only")
    ap.add_argument("--skip-bad-events", action="store_true",
                    help="drop malformed trace events (their count is said on stderr) instead of refusing the file")
    a = ap.parse_args(argv)
    try:
        return validate_main(a.plan, a.traces, a.json_out, a.tolerance_us, cross_rank_clocks=a.cross_rank_clocks,
                             only_traced_stages=a.only_traced_stages, skip_bad_events=a.skip_bad_events,
                             clock=a.clock)
    except KeyboardInterrupt:
        return 130
    except OSError as e:  # a user-named file that went away or cannot be read mid-run
        named = {str(Path(p)) for p in [a.plan, a.json_out, *a.traces] if p}
        if e.filename is not None and str(Path(str(e.filename))) in named:
            _err(f"{e.filename}: {e.strerror}")
            return 2
        return internal_error(e)
    except Exception as e:  # noqa: BLE001 - the boundary: a bug is exit 3, never 1 (= violations)
        return internal_error(e)


if __name__ == "__main__":
    sys.exit(main())
