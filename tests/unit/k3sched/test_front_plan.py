"""Front doors, files ([Note: front doors] in traces/schema.py): plan.json, summary.json and the
validation report are checked against strict typed schemas before anything reads them; a bad
file is one line (file, field path, value, what is allowed) and exit 2 from ``k3sched validate``
and ``k3sched calibrate``; what the planner and the runtime write still loads."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from conftest import ROOT, cli_exit
from k3sched.cli import app
from k3sched.tasks import LANES, Kind
from traces import synth
from traces.events import TraceError
from k3sched.planfile import KIND_VALUES, PlanFileError, check_plan_doc
from traces.schema import SchemaError, check_report, check_summary, load_report
from traces.validate import load_plan

GOLDEN = ROOT / "tests" / "golden" / "tiny-cpu.plan.json"
PLAN = synth.small_plan()
T = ("stages", 0, "lanes", "compute", 3)  # a compute task of stage 0: s0/mb1/L0/expert.fwd


def _write_run(tmp_path, plan=PLAN):
    """A plan.json and the conforming per-rank traces of it in tmp_path."""
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    paths = []
    for r, obj in synth.runtime_trace_files(synth.trace_from_plan(plan), plan).items():
        p = tmp_path / f"trace_rank{r}.json"
        p.write_text(json.dumps(obj))
        paths.append(str(p))
    return tmp_path / "plan.json", paths


def _at(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _one_line_exit_2(res, *needles):
    return cli_exit(res, 2, *needles)


def test_kind_and_lane_lists_are_the_task_model():
    assert KIND_VALUES == tuple(k.value for k in Kind)
    assert "gpu" not in LANES and len(LANES) == 5


def test_golden_synthetic_and_planner_plans_load(tmp_path):
    assert load_plan(GOLDEN)["format"] == "k3sched.plan/1"
    check_plan_doc(PLAN)
    check_plan_doc(synth.with_remote_peer_tasks(PLAN))
    for i, extra in enumerate([[], ["--strategy", "serial"], ["--set", "schedule.offload=all"],
                               ["--set", "schedule.grad_offload=true"], ["--set", "schedule.offload=remote"],
                               ["--set", "schedule.pipeline=zb-v", "--set", "parallel.vpp=2"]]):
        out = tmp_path / f"p{i}"
        res = CliRunner().invoke(app, ["plan", str(ROOT / "configs" / "tiny-cpu.yaml"), "--out", str(out), *extra])
        assert res.exit_code == 0, res.output
        plan = load_plan(out / "plan.json", typed=True)
        assert sum(len(ts) for st in plan.stages for ts in st.lanes.values()) == plan.metrics.num_tasks


NAN, INF = float("nan"), float("inf")
# (what, path into the plan, value or a function of the document, field path in the message)
BAD_PLANS = [
    ("deps a number", T + ("deps",), 5, "stages[0].lanes.compute[3].deps"),
    ("deps a string", T + ("deps",), "xyz", "stages[0].lanes.compute[3].deps"),
    ("kind a list", T + ("kind",), ["attn.fwd"], "stages[0].lanes.compute[3].kind"),
    ("id a list", T + ("id",), ["s0/mb0/L0/attn.fwd"], "stages[0].lanes.compute[3].id"),
    ("bogus kind", T + ("kind",), "attn.sideways", "stages[0].lanes.compute[3].kind"),
    ("NaN start", T + ("start_us",), NAN, "stages[0].lanes.compute[3].start_us"),
    ("infinite start", T + ("start_us",), INF, "stages[0].lanes.compute[3].start_us"),
    ("end before start", T + ("end_us",), lambda t: t["start_us"] - 1.0, "stages[0].lanes.compute[3].end_us"),
    ("bool stage", T + ("stage",), True, "stages[0].lanes.compute[3].stage"),
    ("stage a string", T + ("stage",), "0", "stages[0].lanes.compute[3].stage"),
    ("stage of another list", T + ("stage",), 1, "stages[0].lanes.compute[3].stage"),
    ("bogus lane", T + ("lane",), "gpu", "stages[0].lanes.compute[3].lane"),
    ("lane of another list", T + ("lane",), "ep", "stages[0].lanes.compute[3].lane"),
    ("kind of another id", T + ("kind",), "attn.fwd", "stages[0].lanes.compute[3].kind"),
    ("unknown dep", T + ("deps",), ["s9/mb0/L0/attn.fwd"], "stages[0].lanes.compute[3].deps[0]"),
    ("negative bytes", T + ("bytes",), -1, "stages[0].lanes.compute[3].bytes"),
    ("float mem", T + ("mem", "alloc", "device"), 1.5, "stages[0].lanes.compute[3].mem.alloc.device"),
    ("metrics a list", ("metrics",), [1], "metrics"),
    ("step time a string", ("metrics", "step_time_us"), "fast", "metrics.step_time_us"),
    ("negative step time", ("metrics", "step_time_us"), -5.0, "metrics.step_time_us"),
    ("NaN step time", ("metrics", "step_time_us"), NAN, "metrics.step_time_us"),
    ("unknown lane key", ("stages", 0, "lanes", "gpu"), [], "stages[0].lanes"),
    ("lanes a string", ("lanes",), "compute", "lanes"),
]


def _mutate(plan, path, value):
    doc = copy.deepcopy(plan)
    parent = _at(doc, path[:-1])
    parent[path[-1]] = value(parent[path[-1]] if not callable(value) else parent) if callable(value) else value
    return doc


@pytest.mark.parametrize("what, path, value, field", BAD_PLANS, ids=[b[0] for b in BAD_PLANS])
def test_validate_refuses_a_malformed_plan_in_one_line(tmp_path, what, path, value, field):
    plan_p, traces = _write_run(tmp_path)
    plan_p.write_text(json.dumps(_mutate(PLAN, path, value)))
    res = CliRunner().invoke(app, ["validate", "--plan", str(plan_p), *traces])
    err = _one_line_exit_2(res, str(plan_p), field + ":")
    assert "CONFORMS" not in res.stdout
    assert "got" in err or "missing" in err


def test_plan_error_names_what_is_allowed():
    with pytest.raises(PlanFileError,
                       match=r"kind: must be one of 'attn\.fwd', .*'optim\.run'; got \"attn\.sideways\""):
        check_plan_doc(_mutate(PLAN, T + ("kind",), "attn.sideways"), "p.json")
    with pytest.raises(PlanFileError, match=r"deps: must be a list of task ids \(strings\); got \"xyz\""):
        check_plan_doc(_mutate(PLAN, T + ("deps",), "xyz"), "p.json")
    with pytest.raises(PlanFileError, match=r"end_us: must not be before start_us"):
        check_plan_doc(_mutate(PLAN, T + ("end_us",), lambda t: t["start_us"] - 1.0), "p.json")
    with pytest.raises(PlanFileError, match="appears twice"):
        doc = copy.deepcopy(PLAN)
        _at(doc, T[:-1]).append(copy.deepcopy(_at(doc, T)))
        check_plan_doc(doc)
    with pytest.raises(PlanFileError, match="not a k3sched plan"):
        check_plan_doc({"format": "k3sched.plan/2", "lanes": [], "stages": []})


@pytest.mark.parametrize("field", ["id", "kind", "lane", "stage"])
def test_calibrate_refuses_a_task_missing_a_field(tmp_path, field):
    plan_p, traces = _write_run(tmp_path)
    doc = copy.deepcopy(PLAN)
    del _at(doc, T)[field]
    plan_p.write_text(json.dumps(doc))
    res = CliRunner().invoke(app, ["calibrate", *traces, "--plan", str(plan_p), "-o", str(tmp_path / "p.yaml")])
    _one_line_exit_2(res, f"stages[0].lanes.compute[3].{field}: missing")
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("field, value", [("stage", "zero"), ("stage", 7), ("stage", -1), ("lane", "gpu"),
                                          ("lane", "offload_local"), ("kind", "foo.bar"), ("kind", 3)])
def test_calibrate_refuses_a_garbage_stage_lane_or_kind(tmp_path, field, value):
    plan_p, traces = _write_run(tmp_path)
    plan_p.write_text(json.dumps(_mutate(PLAN, T + (field,), value)))
    res = CliRunner().invoke(app, ["calibrate", *traces, "--plan", str(plan_p), "-o", str(tmp_path / "p.yaml")])
    _one_line_exit_2(res, f"stages[0].lanes.compute[3].{field}:")
    assert not (tmp_path / "p.yaml").exists()


def test_calibrate_of_a_good_synthetic_run_writes_a_profile(tmp_path):
    plan_p, traces = _write_run(tmp_path)
    res = CliRunner().invoke(app, ["calibrate", *traces, "--plan", str(plan_p), "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p.yaml").exists()


SUMMARY = {"format": "k3sched.run/1", "config": "configs/tiny-cpu.yaml", "overrides": [], "strategy": "k3",
           "pipeline": "1f1b", "world": 4, "device": "cpu", "pp": 2, "dp": 1, "ep": 2, "microbatches": 4,
           "steps": 5, "seed": 0, "lr": 1e-3, "losses": [6.9, 6.8], "step_time_s": [0.5, 0.4],
           "tokens_per_step": 512, "tokens_per_s": [1024.0, 1280.0], "predicted_step_time_us": 250000.0,
           "measured_step_time_us": 400000.0, "measured_over_predicted": 1.6, "perturbed": None,
           "budget_bytes": 268435456, "peak_device_bytes_planned": [1, 2], "peak_device_bytes_measured": [1, 2, 3, 4],
           "peak_host_bytes_measured": [0, 0, 0, 0], "peak_peer_bytes_measured": [0, 0, 0, 0],
           "stage_of_rank": [0, 0, 1, 1], "offloaded_sets": {"local": 0, "remote": 0, "total": 16},
           "testbed": {"internode_gbps": 1.0}}


def test_a_runner_summary_passes():
    assert check_summary(SUMMARY).measured_step_time_us == 400000.0
    assert check_summary(dict(SUMMARY, losses=[NAN])).losses[0] != 0  # a diverged loss is data


@pytest.mark.parametrize("change, field", [({"measured_step_time_us": NAN}, "measured_step_time_us"),
                                           ({"measured_step_time_us": -1.0}, "measured_step_time_us"),
                                           ({"measured_step_time_us": 0}, "measured_step_time_us"),
                                           ({"measured_step_time_us": "400000"}, "measured_step_time_us"),
                                           ({"measured_step_time_us": None}, "measured_step_time_us"),
                                           ({"format": "something/1"}, "format"),
                                           ({"world": True}, "world"),
                                           ({"step_time_s": "fast"}, "step_time_s")])
def test_calibrate_refuses_a_bad_summary_beside_the_traces(tmp_path, change, field):
    plan_p, traces = _write_run(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps(dict(SUMMARY, **change)))
    res = CliRunner().invoke(app, ["calibrate", *traces, "--plan", str(plan_p), "-o", str(tmp_path / "p.yaml")])
    _one_line_exit_2(res, "summary.json", f"{field}:")
    assert not (tmp_path / "p.yaml").exists()


def test_measured_step_from_summary(tmp_path):
    from traces.calibrate import measured_step_from_summary

    p = tmp_path / "summary.json"
    p.write_text(json.dumps(SUMMARY))
    assert measured_step_from_summary(p) == 400000.0
    p.write_text('{"format": "k3sched.run/1", "measured_step_time_us": NaN}')
    with pytest.raises(TraceError, match=r"summary.json: measured_step_time_us: must be a finite number; got nan"):
        measured_step_from_summary(p)
    p.write_text("{}")
    with pytest.raises(TraceError, match="not a k3sched run summary"):
        measured_step_from_summary(p)
    with pytest.raises(TraceError, match="no such file"):
        measured_step_from_summary(tmp_path / "none.json")


def test_report_written_by_validate_json_follows_its_schema(tmp_path):
    plan_p, traces = _write_run(tmp_path)
    res = CliRunner().invoke(app, ["validate", "--plan", str(plan_p), *traces, "--json", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    rep = load_report(tmp_path / "r.json")
    assert rep.conforms and rep.violations == []
    doc = json.loads((tmp_path / "r.json").read_text())
    bad = dict(doc, conforms=False)
    with pytest.raises(SchemaError, match="conforms: must be True with 0 violation"):
        check_report(bad)
    v = {"type": "missing", "task_id": "s0/mb0/L0/attn.fwd", "rank": 0, "detail": "x", "magnitude_us": 1.0}
    check_report(dict(doc, conforms=False, violations=[v]))
    for change, field in [({"type": "late"}, "violations[0].type"), ({"rank": "0"}, "violations[0].rank"),
                          ({"magnitude_us": NAN}, "violations[0].magnitude_us")]:
        with pytest.raises(SchemaError, match=field.replace("[", r"\[").replace("]", r"\]")):
            check_report(dict(doc, conforms=False, violations=[dict(v, **change)]))
