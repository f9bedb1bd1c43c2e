"""Front doors, command line ([Note: CLI error boundary] in k3sched/cli.py): a user error is one
line on stderr and exit 2, checked before any work; a bug is exit 3 with one line naming a
traceback file (so ``validate``'s exit 1 always means violations); Ctrl-C is 130."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import ROOT, cli_exit
from k3sched import cli as k3cli
from k3sched.cli import app
from traces import cli as tcli
from traces import synth

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
PLAN = synth.small_plan()


@pytest.fixture
def run_dir(tmp_path):
    """plan.json and conforming traces of the synthetic plan."""
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    paths = []
    for r, obj in synth.runtime_trace_files(synth.trace_from_plan(PLAN), PLAN).items():
        p = tmp_path / f"trace_rank{r}.json"
        p.write_text(json.dumps(obj))
        paths.append(str(p))
    return tmp_path, paths


def _invoke(args):
    return CliRunner().invoke(app, [str(a) for a in args])


_one_line = cli_exit


def _unwritable_dir(tmp_path) -> Path:
    """A directory this process cannot create files in (root: /sys refuses; else a chmod 500 dir)."""
    if os.geteuid() == 0:
        return Path("/sys")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    return d


def _proc(code: str, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


# ---- output paths, checked before any work --------------------------------------------------

def test_plan_out_naming_an_existing_file(tmp_path):
    (tmp_path / "f").write_text("x")
    res = _invoke(["plan", TINY, "--out", tmp_path / "f"])
    _one_line(res, 2, "--out", "is a file, expected a directory")
    assert "lower bound" not in res.stdout  # refused before planning


def test_plan_out_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    res = _invoke(["plan", TINY, "--out", tmp_path / "f" / "sub"])
    _one_line(res, 2, f"{tmp_path / 'f'} is not a directory")
    assert "lower bound" not in res.stdout


def test_plan_out_in_an_unwritable_place(tmp_path):
    res = _invoke(["plan", TINY, "--out", _unwritable_dir(tmp_path) / "k3sched-out"])
    _one_line(res, 2, "--out", "cannot create files under")
    assert "lower bound" not in res.stdout


def test_plan_torch_csv_naming_a_directory(tmp_path):
    res = _invoke(["plan", TINY, "--torch-csv", tmp_path, "--out", tmp_path / "o"])
    _one_line(res, 2, "--torch-csv", "is a directory")
    assert not (tmp_path / "o").exists() and "lower bound" not in res.stdout


def test_compare_and_run_out_naming_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    _one_line(_invoke(["compare", TINY, "--out", tmp_path / "f"]), 2, "--out", "is a file")
    res = _invoke(["run", TINY, "--out", tmp_path / "f"])  # refused before torch is even imported
    _one_line(res, 2, "--out", "is a file")


def test_calibrate_o_and_validate_json_targets(run_dir):
    d, traces = run_dir
    res = _invoke(["calibrate", *traces, "--plan", d / "plan.json", "-o", d])
    _one_line(res, 2, "-o", "is a directory")
    res = _invoke(["calibrate", *traces, "--plan", d / "plan.json", "-o", d / "plan.json" / "p.yaml"])
    _one_line(res, 2, "is not a directory")
    res = _invoke(["validate", "--plan", d / "plan.json", *traces, "--json", d])
    _one_line(res, 2, "--json", "is a directory")
    assert "CONFORMS" not in res.stdout  # refused before validating
    res = _invoke(["validate", "--plan", d / "plan.json", *traces, "--json", _unwritable_dir(d) / "r.json"])
    _one_line(res, 2, "--json", "cannot create files under")


def test_writable_target_answers(tmp_path):
    """One check for every output option of both command lines (k3sched's calls traces')."""
    (tmp_path / "f").write_text("x")
    w = k3cli._writable_target
    assert w(tmp_path) == "is a directory" and w(tmp_path / "f") is None
    assert w(tmp_path / "new.json") is None and w(tmp_path / "a" / "b" / "c.json") is None
    assert w(tmp_path / "f" / "x.json").endswith("is not a directory")
    assert w(_unwritable_dir(tmp_path) / "x.json").startswith("cannot create files under")
    assert w(tmp_path, directory=True) is None and w(tmp_path / "new", directory=True) is None
    assert w(tmp_path / "f", directory=True) == "is a file, expected a directory"
    assert tcli.writable_target(tmp_path / "f" / "x.json") == w(tmp_path / "f" / "x.json")


# ---- numeric options -----------------------------------------------------------------------

@pytest.mark.parametrize("args, opt", [
    (["plan", TINY, "--exact-time-limit", "-1"], "--exact-time-limit"),
    (["plan", TINY, "--exact-time-limit", "nan"], "--exact-time-limit"),
    (["run", TINY, "--steps", "0"], "--steps"),
    (["run", TINY, "--warmup-steps", "-1"], "--warmup-steps"),
    (["run", TINY, "--nproc", "0"], "--nproc"),
    (["run", TINY, "--timeout", "nan"], "--timeout"),
    (["run", TINY, "--timeout", "-3"], "--timeout"),
    (["probe", "--timeout", "inf"], "--timeout"),
])
def test_numeric_options_are_range_checked(args, opt):
    res = _invoke(args)
    _one_line(res, 2, opt, "must be")
    assert "lower bound" not in res.stdout


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_validate_tolerance_must_be_finite(run_dir, value):
    d, traces = run_dir
    res = _invoke(["validate", "--plan", d / "plan.json", *traces, "--tolerance-us", value])
    _one_line(res, 2, "--tolerance-us", "finite")
    assert "CONFORMS" not in res.stdout
    # the standalone entry point too
    argv = ["--plan", str(d / "plan.json"), *traces, "--tolerance-us", value]
    p = _proc(f"import sys; from traces.cli import main; sys.exit(main({argv!r}))")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--tolerance-us" in p.stderr, p.stderr


# ---- the boundary: user errors 2, bugs 3, Ctrl-C 130 ---------------------------------------

def test_validate_exit_codes_keep_their_meaning(run_dir):
    d, traces = run_dir
    assert _invoke(["validate", "--plan", d / "plan.json", *traces]).exit_code == 0
    bad = synth.runtime_trace_files(synth.drop_task(synth.trace_from_plan(PLAN), "s0/mb0/L0/attn.fwd"), PLAN)
    (d / "bad0.json").write_text(json.dumps(bad[0]))
    assert _invoke(["validate", "--plan", d / "plan.json", d / "bad0.json", traces[1]]).exit_code == 1
    _one_line(_invoke(["validate", "--plan", d / "none.json", *traces]), 2, "no such file")


def test_internal_error_in_a_command_is_exit_3_with_a_traceback_file(run_dir, monkeypatch):
    d, traces = run_dir
    monkeypatch.setattr(tempfile, "tempdir", str(d))

    def boom(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(tcli, "validate", boom)
    res = _invoke(["validate", "--plan", d / "plan.json", *traces])
    err = _one_line(res, 3, "internal error", "ZeroDivisionError: division by zero", "traceback in")
    crash = Path(err.rsplit("traceback in ", 1)[1].strip())
    assert crash.parent == d and crash.name.startswith("k3sched-crash-")
    assert "ZeroDivisionError" in crash.read_text() and "Traceback" in crash.read_text()


def test_main_boundary_internal_error_and_interrupt(tmp_path):
    code = ("import sys, k3sched.planner as p\n"
            "def boom(*a, **k):\n    raise {exc}\n"
            "p.plan = boom\n"
            "from k3sched.cli import main\n"
            f"sys.argv = ['k3sched', 'plan', {TINY!r}]\n"
            "main()\n")
    r = _proc(code.format(exc="AttributeError('no such thing')"), env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "AttributeError: no such thing" in r.stderr and str(tmp_path) in r.stderr
    [crash] = list(tmp_path.glob("k3sched-crash-*.txt"))
    assert "AttributeError" in crash.read_text()
    r = _proc(code.format(exc="KeyboardInterrupt()"))
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr
    # a user error raised where no command expects it (here: printing the summary) is still 2
    user = code.replace("p.plan = boom", "import k3sched.cli as c; c.summary_table = boom")
    r = _proc(user.format(exc="p.InfeasibleBudget('schedule.device_memory_budget: too small')"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "too small" in r.stderr, r.stderr
    r = _proc(user.format(exc="__import__('k3sched.config').config.ConfigError('model.hidden: bad')"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "model.hidden: bad" in r.stderr, r.stderr


def test_traces_cli_main_boundary(run_dir):
    d, traces = run_dir
    args = ["--plan", str(d / "plan.json"), *traces]
    code = ("import sys, traces.cli as c\n"
            "def boom(*a, **k):\n    raise RuntimeError('bug')\n"
            "c.validate = boom\n"
            f"sys.exit(c.main({args!r}))\n")
    r = _proc(code, env={"TMPDIR": str(d)})
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and "RuntimeError: bug" in r.stderr, r.stderr
    assert list(d.glob("k3sched-crash-*.txt"))
    r = _proc(f"import sys, traces.cli as c; sys.exit(c.main({['--plan', str(d / 'plan.json')]!r}))")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "TRACE" in r.stderr, r.stderr


def test_usage_errors_are_one_line_from_main():
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", TINY, "--bogus"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--bogus" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "run", TINY, "--steps", "x"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--steps" in r.stderr, r.stderr


def test_oserror_on_a_user_named_path_is_2_elsewhere_3(tmp_path, monkeypatch):
    def denied(p, out, png=True, before=None):
        raise PermissionError(13, "Permission denied", str(out / "plan.json"))

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(k3cli, "write_outputs", denied)
    _one_line(_invoke(["plan", TINY, "--out", tmp_path / "o"]), 2, "plan.json: Permission denied")

    def elsewhere(p, out, png=True, before=None):
        raise PermissionError(13, "Permission denied", "/usr/share/somewhere")

    monkeypatch.setattr(k3cli, "write_outputs", elsewhere)
    _one_line(_invoke(["plan", TINY, "--out", tmp_path / "o"]), 3, "internal error", "PermissionError")


# ---- --skip-bad-events ----------------------------------------------------------------------

def test_skip_bad_events_is_passed_and_the_count_said(run_dir, monkeypatch):
    d, traces = run_dir
    real = tcli.read_trace
    seen = []

    def reader(path, skip_bad_events=False):
        seen.append(skip_bad_events)
        t = real(path)
        t.bad_events = 3 if skip_bad_events else 0
        return t

    monkeypatch.setattr(tcli, "read_trace", reader)
    res = _invoke(["validate", "--plan", d / "plan.json", *traces, "--skip-bad-events"])
    assert res.exit_code == 0, res.output
    assert seen == [True, True] and res.stderr.count("skipped 3 malformed events") == 2
    seen.clear()
    res = _invoke(["calibrate", *traces, "--plan", d / "plan.json", "-o", d / "p.yaml", "--skip-bad-events"])
    assert res.exit_code == 0, res.output
    assert seen == [True, True] and "skipped 3 malformed events" in res.stderr
    seen.clear()
    res = _invoke(["validate", "--plan", d / "plan.json", *traces])
    assert res.exit_code == 0 and seen == [False, False] and "skipped" not in res.stderr


def test_malformed_event_refused_unless_skipped(run_dir):
    d, traces = run_dir
    obj = json.loads(Path(traces[0]).read_text())
    obj["traceEvents"].append({"ph": "X", "name": "s0/mb0/L0/attn.fwd", "ts": "soon", "dur": 1, "pid": 0,
                               "tid": 100, "args": {}})
    Path(traces[0]).write_text(json.dumps(obj))
    res = _invoke(["validate", "--plan", d / "plan.json", *traces])
    _one_line(res, 2, Path(traces[0]).name)
    res = _invoke(["validate", "--plan", d / "plan.json", *traces, "--skip-bad-events"])
    assert res.exit_code == 0, res.output
    assert "skipped 1 malformed events" in res.stderr
