"""Seeded-fault suite: one fault in an otherwise conforming synthetic trace is reported with the
right type and task id; the unmutated trace conforms."""

import json

import numpy as np
import pytest

from traces import synth
from traces.chrome import table_from_runtime
from traces.cli import validate_main
from traces.events import EventTable
from k3sched.intervals import merge_intervals, overlap_length, union_length
from traces.validate import validate

PLAN = synth.small_plan()
TWO_RANKS_PER_STAGE = {0: [0, 1], 1: [2, 3]}


def _events(jitter=0.3, ranks=None):
    return synth.trace_from_plan(PLAN, rank_of_stage=ranks, jitter=jitter, seed=1)


def _check(events, **kw):
    return validate(PLAN, table_from_runtime(events), **kw)


def _ids(report, type_):
    return {v.task_id for v in report.by_type(type_)}


@pytest.mark.parametrize("ranks", [None, TWO_RANKS_PER_STAGE])
def test_unmutated_trace_conforms(ranks):
    rep = _check(_events(ranks=ranks))
    assert rep.conforms, rep.render()
    assert rep.metrics["matched_instances"] == len(synth.plan_tasks(PLAN)) * (1 if ranks is None else 2)
    assert "CONFORMS" in rep.render()


def test_conforms_with_cross_rank_clocks():
    rep = _check(_events(), cross_rank_clocks=True)
    assert rep.conforms, rep.render()
    assert rep.metrics["cross_rank_deps_skipped"] == 0


def test_swapped_tasks_reported_as_order():
    a, b = "s1/mb0/L1/expert.dw", "s1/mb1/L1/expert.dw"  # same lane, no dep between them
    rep = _check(synth.swap_tasks(_events(jitter=0.0), a, b))
    assert not rep.conforms
    got = _ids(rep, "order")
    assert got and got <= {a, b}, rep.render()
    assert all(v.rank == 1 for v in rep.by_type("order"))


def test_task_on_other_lanes_tid_reported_as_wrong_lane():
    tid = "s0/mb1/L0/expert.dx"
    rep = _check(synth.move_to_tid(_events(), tid, synth.lane_tid("ep")))
    assert _ids(rep, "wrong_lane") == {tid}, rep.render()
    assert rep.by_type("wrong_lane")[0].rank == 0


def test_task_on_stray_tid_reported_as_lane_mapping():
    tid = "s0/mb1/L0/expert.dx"
    rep = _check(synth.move_to_tid(_events(), tid, 9999))
    assert _ids(rep, "lane_mapping") == {tid}, rep.render()


def test_two_lanes_on_one_tid_reported_as_lane_mapping():
    ev = [dict(e, tid=synth.lane_tid("compute")) if e.get("cat") == "offload_local" else e for e in _events()]
    rep = _check(ev)
    assert any(v.task_id is None and "both run on tid" in v.detail for v in rep.by_type("lane_mapping")), rep.render()


def test_consumer_before_producer_reported_as_dependency():
    consumer, producer = "s1/mb0/L1/expert.fwd", "s1/mb0/L1/dispatch.fwd"
    rep = _check(synth.start_before_end_of(_events(), consumer, producer))
    deps = [v for v in rep.by_type("dependency") if v.task_id == consumer]
    assert deps and producer in deps[0].detail, rep.render()
    assert deps[0].magnitude_us > 20


def test_dependency_within_tolerance_is_not_reported():
    consumer, producer = "s1/mb0/L1/expert.fwd", "s1/mb0/L1/dispatch.fwd"
    ev = synth.start_before_end_of(_events(jitter=0.0), consumer, producer, by_us=3.0)
    assert not _check(ev, tolerance_us=5.0).by_type("dependency")
    assert _ids(_check(ev, tolerance_us=1.0), "dependency") == {consumer}


def test_cross_stage_dependency_needs_comparable_clocks():
    consumer, producer = "s1/mb0/v0/act.recv", "s0/mb0/v0/act.send"
    ev = synth.end_before_start_of(_events(jitter=0.0), consumer, producer, by_us=25.0)
    assert not _check(ev).by_type("dependency")
    assert _ids(_check(ev, cross_rank_clocks=True), "dependency") == {consumer}


RECV_SEND = [("s1/mb0/v0/act.recv", "s0/mb0/v0/act.send"), ("s0/mb1/v0/grad.recv", "s1/mb1/v0/grad.send")]
REMOTE = [("s0/mb0/L1/act.rstore", "s1/mb0/L1/act.roffload"), ("s1/mb1/L1/act.ronload", "s0/mb1/L1/act.rserve")]


@pytest.mark.parametrize("recv, send", RECV_SEND + REMOTE)
def test_receive_posted_before_its_send_conforms(recv, send):
    # a receive waits for its send: starting before the send (even before it starts) is legal
    plan = synth.with_remote_peer_tasks(PLAN) if (recv, send) in REMOTE else PLAN
    ev = synth.post_early(synth.trace_from_plan(plan), recv, send, by_us=25.0)
    rep = validate(plan, table_from_runtime(ev), cross_rank_clocks=True)
    assert rep.conforms, rep.render()


@pytest.mark.parametrize("recv, send", RECV_SEND + REMOTE)
def test_receive_ending_before_its_send_starts_is_dependency(recv, send):
    plan = synth.with_remote_peer_tasks(PLAN) if (recv, send) in REMOTE else PLAN
    ev = synth.end_before_start_of(synth.trace_from_plan(plan), recv, send, by_us=30.0)
    rep = validate(plan, table_from_runtime(ev), cross_rank_clocks=True)
    deps = [v for v in rep.by_type("dependency") if v.task_id == recv]
    assert deps and send in deps[0].detail and "before its send" in deps[0].detail, rep.render()
    assert deps[0].magnitude_us == pytest.approx(30.0)
    # different clocks: not compared
    assert recv not in _ids(validate(plan, table_from_runtime(ev)), "dependency")


def test_dropped_task_reported_as_missing():
    tid = "s0/mb1/L0/act.offload"
    rep = _check(synth.drop_task(_events(), tid))
    assert _ids(rep, "missing") == {tid}, rep.render()
    assert rep.by_type("missing")[0].rank == 0


def test_missing_stage_reported_once():
    ev = [e for e in _events() if e["pid"] != 1]
    rep = _check(ev)
    [v] = rep.by_type("missing")
    assert v.rank == -1 and "stage 1" in v.detail
    assert _check(ev, only_traced_stages=True).conforms


@pytest.mark.parametrize("onload, offload", [("s0/mb1/L0/act.onload", "s0/mb1/L0/act.offload"),
                                             ("s1/mb0/L1/act.ronload", "s1/mb0/L1/act.roffload")])
def test_onload_before_offload_end(onload, offload):
    rep = _check(synth.start_before_end_of(_events(), onload, offload))
    assert _ids(rep, "onload_before_offload") == {onload}, rep.render()
    assert offload in rep.by_type("onload_before_offload")[0].detail
    # reported under its own type, not also as a plain dependency
    assert onload not in _ids(rep, "dependency")


def test_onload_matched_by_scope_without_buffer():
    import copy
    plan = copy.deepcopy(PLAN)
    for t in synth.plan_tasks(plan):
        t["buffer"] = None
    ev = synth.start_before_end_of(synth.trace_from_plan(plan), "s0/mb0/L0/act.onload", "s0/mb0/L0/act.offload")
    rep = validate(plan, table_from_runtime(ev))
    assert _ids(rep, "onload_before_offload") == {"s0/mb0/L0/act.onload"}


def test_unplanned_task_reported():
    ev = synth.add_task(_events(), "s0/mb7/L0/attn.fwd", rank=0, tid=synth.lane_tid("compute"), ts=5e6)
    ev = synth.add_task(ev, "aten::mm", rank=0, tid=synth.lane_tid("compute"), ts=5e6)  # not a task id: ignored
    rep = _check(ev)
    assert _ids(rep, "unplanned") == {"s0/mb7/L0/attn.fwd"}
    assert len(rep.violations) == 1


def test_collective_order_differs_between_ranks_of_a_stage():
    a, b = "s0/mb0/L0/dispatch.bwd", "s0/mb1/L0/combine.bwd"
    ev = synth.swap_tasks(_events(jitter=0.0, ranks=TWO_RANKS_PER_STAGE), a, b, rank=1)
    rep = _check(ev)
    co = rep.by_type("collective_order")
    assert co and co[0].rank == 1 and co[0].task_id in {a, b}, rep.render()
    assert "deadlock" in co[0].detail


def test_report_json_render_and_worst_first():
    ev = synth.drop_task(synth.start_before_end_of(_events(), "s1/mb0/L1/expert.fwd", "s1/mb0/L1/dispatch.fwd"),
                         "s0/mb1/L0/act.offload")
    rep = _check(ev)
    js = json.loads(json.dumps(rep.to_json()))
    assert js["conforms"] is False and {v["type"] for v in js["violations"]} >= {"missing", "dependency"}
    mags = [v.magnitude_us for v in rep.violations]
    assert mags == sorted(mags, reverse=True)
    text = rep.render()
    assert "DOES NOT CONFORM" in text and "s0/mb1/L0/act.offload" in text
    assert text.index(rep.violations[0].task_id) < text.index(rep.violations[-1].task_id)


def test_metrics_planned_beside_measured():
    rep = _check(_events(jitter=0.0))
    m = rep.metrics
    assert m["step_time_us"]["planned"] == pytest.approx(PLAN["metrics"]["step_time_us"])
    assert m["step_time_us"]["measured"] == pytest.approx(m["step_time_us"]["planned"])
    for r, mr in m["measured_by_rank"].items():
        p = m["planned_by_stage"][mr["stage"]]
        assert mr["busy_us"] == pytest.approx(p["busy_us"])
        assert mr["comm_overlap_ratio"] == pytest.approx(p["comm_overlap_ratio"])
        assert 0 < p["comm_overlap_ratio"] < 1
    assert all(v == pytest.approx(1.0) for v in m["duration_ratio_by_kind"].values())
    half = _check(synth.trace_from_plan(PLAN, jitter=0.0)).metrics  # same; now stretch one kind
    ev = [dict(e, dur=e["dur"] * 0.5) if e.get("name", "").endswith("attn.dw") else e for e in _events(jitter=0.0)]
    assert _check(ev).metrics["duration_ratio_by_kind"]["attn.dw"] == pytest.approx(0.5)
    assert half["duration_ratio_by_kind"]["attn.fwd"] == pytest.approx(1.0)


def test_interval_sweep_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(50):
        a_s = rng.uniform(0, 100, 8); a_e = a_s + rng.uniform(0, 20, 8)  # noqa: E702
        b_s = rng.uniform(0, 100, 8); b_e = b_s + rng.uniform(0, 20, 8)  # noqa: E702
        grid = np.linspace(0, 130, 130_001)[:-1] + 0.0005
        in_a = ((grid[:, None] >= a_s) & (grid[:, None] < a_e)).any(1)
        in_b = ((grid[:, None] >= b_s) & (grid[:, None] < b_e)).any(1)
        assert union_length(a_s, a_e) == pytest.approx(in_a.sum() * 0.001, abs=0.01)
        assert overlap_length(a_s, a_e, b_s, b_e) == pytest.approx((in_a & in_b).sum() * 0.001, abs=0.01)
        ms, me = merge_intervals(a_s, a_e)
        assert np.all(ms[1:] > me[:-1])


def test_cli_exit_codes(tmp_path, capsys):
    plan_p = tmp_path / "plan.json"
    plan_p.write_text(json.dumps(PLAN))
    files = synth.runtime_trace_files(_events(), PLAN)
    good = []
    for r, obj in files.items():
        p = tmp_path / f"trace_rank{r}.json"
        p.write_text(json.dumps(obj))
        good.append(str(p))
    out = tmp_path / "report.json"
    assert validate_main(str(plan_p), good, json_out=str(out)) == 0
    assert json.loads(out.read_text())["conforms"] is True
    bad_files = synth.runtime_trace_files(synth.drop_task(_events(), "s0/mb0/L0/attn.fwd"), PLAN)
    (tmp_path / "bad0.json").write_text(json.dumps(bad_files[0]))
    assert validate_main(str(plan_p), [str(tmp_path / "bad0.json"), good[1]]) == 1
    capsys.readouterr()
    (tmp_path / "cut.json").write_text(json.dumps(files[0])[:500])
    assert validate_main(str(plan_p), [str(tmp_path / "cut.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cut.json" in err and "Traceback" not in err
    (tmp_path / "notaplan.json").write_text("{}")
    assert validate_main(str(tmp_path / "notaplan.json"), good) == 2
    assert "not a k3sched plan" in capsys.readouterr().err
    assert validate_main(str(plan_p), [str(tmp_path / "nope.json")]) == 2


def test_python_m_traces_cli(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[3]
    plan_p = tmp_path / "plan.json"
    plan_p.write_text(json.dumps(PLAN))
    files = synth.runtime_trace_files(synth.drop_task(_events(), "s1/mb0/L1/attn.fwd"), PLAN)
    paths = []
    for r, obj in files.items():
        (tmp_path / f"t{r}.json").write_text(json.dumps(obj))
        paths.append(str(tmp_path / f"t{r}.json"))
    p = subprocess.run([sys.executable, "-m", "traces.cli", "--plan", str(plan_p), *paths, "--json",
                        str(tmp_path / "r.json")], capture_output=True, text=True, cwd=root)
    assert p.returncode == 1, p.stderr
    assert "s1/mb0/L1/attn.fwd" in p.stdout
    assert json.loads((tmp_path / "r.json").read_text())["violations"][0]["type"] in ("missing", "dependency")
