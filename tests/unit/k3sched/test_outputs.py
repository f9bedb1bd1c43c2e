"""Plan outputs: golden plan.json, Perfetto trace, PNG, ASCII timeline, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from k3sched.planner import plan
from k3sched.planfile import PLAN_FORMAT, dumps_plan
from k3sched.render import ascii_timeline, perfetto_trace, png_timeline
from k3sched.tasks import LANES, parse_task_id

from conftest import ROOT

GOLDEN = ROOT / "tests" / "golden" / "tiny-cpu.plan.json"
# Regenerate after an intended planner change:
#   K3SCHED_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/k3sched/test_outputs.py -k golden


def test_golden_plan_json_for_tiny_cpu(tiny_cfg):
    text = dumps_plan(plan(tiny_cfg))
    if os.environ.get("K3SCHED_REGEN_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "plan changed: see the regenerate note at the top of this file"


def test_plan_json_follows_the_contract(tiny_cfg):
    doc = json.loads(dumps_plan(plan(tiny_cfg)))
    assert doc["format"] == PLAN_FORMAT == "k3sched.plan/1"
    assert doc["lanes"] == list(LANES)
    assert set(doc["config"]) == {"model", "parallel", "hardware", "schedule"}
    assert len(doc["stages"]) == tiny_cfg.parallel.pp
    ids = set()
    for st in doc["stages"]:
        assert set(st["lanes"]) == set(LANES)
        for lane, tasks in st["lanes"].items():
            starts = [t["start_us"] for t in tasks]
            assert starts == sorted(starts)
            for t in tasks:
                assert t["lane"] == lane and t["stage"] == st["stage"]
                assert str(parse_task_id(t["id"])) == t["id"]
                assert set(t["mem"]) == {"alloc", "free"}
                ids.add(t["id"])
    for st in doc["stages"]:
        for tasks in st["lanes"].values():
            assert all(d in ids for t in tasks for d in t["deps"])
    m = doc["metrics"]
    for key in ("step_time_us", "lower_bound_us", "bubble_ratio", "exposed_comm_ratio", "peak_device_bytes"):
        assert key in m
    assert m["lower_bound_us"] <= m["step_time_us"]


def test_perfetto_trace_and_png_are_produced_and_parse(tiny_cfg, tmp_path):
    p = plan(tiny_cfg)
    tr = json.loads(json.dumps(perfetto_trace(p)))
    ev = tr["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == len(p.tasks)
    assert {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"} == set(LANES)
    flows = [e for e in ev if e["ph"] in ("s", "f")]
    assert flows and len(flows) % 2 == 0
    assert any(e["ph"] == "C" for e in ev)
    png = png_timeline(p, tmp_path / "t.png")
    import matplotlib.image as mpimg

    img = mpimg.imread(png)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200


def test_ascii_timeline_rows(tiny_cfg):
    p = plan(tiny_cfg)
    text = ascii_timeline(p, 80)
    rows = [line for line in text.splitlines() if line.startswith("s")]
    assert any(r.startswith("s0  compute") for r in rows)
    assert all(len(r.split("|")[1]) == 80 for r in rows)


def test_cli_plan_writes_outputs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", "configs/tiny-cpu.yaml", "--out", str(tmp_path),
                        "--timeline"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "lower bound" in r.stdout and "s0  compute" in r.stdout
    for name in ("plan.json", "plan.trace.json", "timeline.txt", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "plan.json").read_text())["format"] == "k3sched.plan/1"


@pytest.mark.parametrize("sub", ["plan", "validate"])
def test_help_explains_itself(sub):
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", sub, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "Usage" in r.stdout


def test_parallel_outputs_match_sequential_and_report_child_errors(tiny_cfg, tmp_path):
    from k3sched.render import write_outputs

    p = plan(tiny_cfg)
    seq = write_outputs(p, tmp_path / "seq", parallel=False)
    par = write_outputs(p, tmp_path / "par", parallel=True)
    assert [x.name for x in seq] == [x.name for x in par] == ["plan.json", "plan.trace.json", "timeline.txt",
                                                              "timeline.png"]
    for a, b in zip(seq, par):
        assert a.read_bytes() == b.read_bytes(), a.name
    bad = tmp_path / "bad"
    (bad / "plan.trace.json").mkdir(parents=True)  # the child cannot write the trace
    with pytest.raises(OSError):
        write_outputs(p, bad, parallel=True)
    assert (bad / "plan.json").stat().st_size > 0


@pytest.mark.parametrize("overrides", [[], ["parallel.seq_chunks=2", "schedule.offload=all",
                                             "schedule.remote_offload=true"]])
def test_plan_json_as_written_is_the_plain_document(overrides):
    # [Note: plan.json as written]: the tasks handed to orjson as they are (Kind, Mem, deps lists)
    # give the bytes of the plain document, slices and every memory space included
    import orjson

    from k3sched.config import load_config
    from k3sched.planfile import dumps_plan_bytes, plan_to_json

    p = plan(load_config(ROOT / "configs" / "tiny-cpu.yaml", overrides))
    plain = plan_to_json(p)
    assert json.loads(json.dumps(plain)) == plain  # plain JSON types only
    assert dumps_plan_bytes(p) == orjson.dumps(plain, option=orjson.OPT_INDENT_2) + b"\n"


@pytest.mark.parametrize("overrides", [[], ["hardware.cpu_runner.task_time_cv=0.3"]])
def test_plan_json_reads_back_as_the_planner_wrote_it(overrides):
    # k3sched.planfile writes plan.json and reads it back: the metrics read are the plan's, the
    # expected step only where the plan has a task-time spread, and the plan ranked by it there
    from k3sched.config import load_config
    from k3sched.planfile import check_plan_doc

    p = plan(load_config(ROOT / "configs" / "tiny-cpu.yaml", overrides))
    raw = json.loads(dumps_plan(p))
    doc = check_plan_doc(raw)
    assert doc.metrics.to_json() == p.metrics.to_json() == raw["metrics"]
    assert doc.metrics.ranking_step_us == p.metrics.ranking_step_us
    if overrides:
        assert p.metrics.ranking_step_us == p.metrics.expected_step_us > p.metrics.step_time_us
    else:
        assert "expected" not in raw["metrics"] and "memory_lean" not in raw["metrics"]
        assert p.metrics.expected_step_us is None and p.metrics.ranking_step_us == p.metrics.step_time_us


@pytest.mark.parametrize("parallel", [False, True])
def test_outputs_are_written_only_after_before_returns(tiny_cfg, tmp_path, parallel):
    from k3sched.render import write_outputs

    p = plan(tiny_cfg)
    out = tmp_path / "o"
    seen = []

    def check():
        seen.append(out.exists())

    assert [x.name for x in write_outputs(p, out, parallel=parallel, before=check)][0] == "plan.json"
    assert seen == [False] and all(x.stat().st_size > 0 for x in out.iterdir()) and len(list(out.iterdir())) == 4

    def refuse():
        raise ValueError("the plan would hang")

    with pytest.raises(ValueError, match="would hang"):
        write_outputs(p, tmp_path / "refused", parallel=parallel, before=refuse)
    assert not (tmp_path / "refused").exists()
    (tmp_path / "there").mkdir()
    with pytest.raises(ValueError, match="would hang"):
        write_outputs(p, tmp_path / "there", parallel=parallel, before=refuse)
    assert list((tmp_path / "there").iterdir()) == []  # the child, told no go, wrote nothing either
