"""Each conformance rule of traces/rules.py on its own ([Note: validation rules] in
traces/validate.py), and the trace join both validation and calibration use ([Note: trace join]
in traces/join.py): a tiny synthetic plan and trace where the rule fires and one where it does
not. The whole report is checked in tests/unit/traces/test_traces_faults.py and tests/unit/traces/test_validate_device.py."""

from __future__ import annotations

import numpy as np
import pytest

from traces import rules, synth
from traces.calibrate import fit_profile
from traces.chrome import table_from_runtime
from traces.join import SEND_OF, TRANSFER_KINDS, RankStages, is_transfer, ranges_by_name, send_of
from traces.nsys import read_nsys_sqlite
from traces.validate import validate

PLAN = synth.small_plan()
TWO_PER_STAGE = {0: [0, 1], 1: [2, 3]}
ATTN_FWD0, EXPERT_FWD0 = "s0/mb0/L0/attn.fwd", "s0/mb0/L0/expert.fwd"
EXPERT_DW0, EXPERT_DW1 = "s0/mb0/L0/expert.dw", "s0/mb1/L0/expert.dw"
RECV, SEND = "s1/mb0/v0/act.recv", "s0/mb0/v0/act.send"
ONLOAD, OFFLOAD = "s0/mb0/L0/act.onload", "s0/mb0/L0/act.offload"


def _ideal(ranks=None):
    return synth.trace_from_plan(PLAN, rank_of_stage=ranks, jitter=0.0)


def _join(events, **kw):
    return rules.join(PLAN, table_from_runtime(events), **kw)


def _found(vs, type_=None):
    """(type, task id, rank) of each finding."""
    assert all(isinstance(v, rules.Violation) for v in vs)
    return {(v.type, v.task_id, v.rank) for v in vs if type_ is None or v.type == type_}


@pytest.fixture(scope="module")
def ideal():
    return _join(_ideal())


@pytest.mark.parametrize("rule", rules.RULES, ids=lambda r: r.__name__)
def test_no_rule_fires_on_an_ideal_trace(ideal, rule):
    assert rule(ideal) == []


def test_every_rule_is_in_the_report_order_once():
    names = [r.__name__ for r in rules.RULES]
    assert len(names) == len(set(names)) == 11
    assert names.index("lane_mapping") < names.index("stream_mapping")  # ties in the report keep this order


def test_unplanned():
    ev = synth.add_task(_ideal(), "s0/mb9/L0/attn.fwd", 0, synth.lane_tid("compute"), 1e6 + 5.0)
    ev = synth.add_task(ev, "not-a-task-id", 0, synth.lane_tid("compute"), 1e6 + 7.0)
    got = rules.unplanned(_join(ev))
    assert _found(got) == {("unplanned", "s0/mb9/L0/attn.fwd", 0)}
    assert got[0].magnitude_us == pytest.approx(10.0)


def test_wrong_rank():
    ev = synth.add_task(_ideal(), "s1/mb0/L1/attn.fwd", 0, synth.lane_tid("compute"), 1e6 + 5.0)
    J = _join(ev)
    assert J.stages.stage_of == {0: 0, 1: 1}  # the majority keeps rank 0 on stage 0
    assert _found(rules.wrong_rank(J)) == {("wrong_rank", "s1/mb0/L1/attn.fwd", 0)}


def test_missing_task_and_missing_stage():
    assert _found(rules.missing(_join(synth.drop_task(_ideal(), EXPERT_DW1)))) == {("missing", EXPERT_DW1, 0)}
    stage0_only = [e for e in _ideal() if e["pid"] == 0]
    (v,) = rules.missing(_join(stage0_only))
    assert (v.task_id, v.rank) == ("s1/mb0/L1/attn.fwd", -1) and "no rank ran stage 1" in v.detail
    assert rules.missing(_join(stage0_only, only_traced_stages=True)) == []


def test_lane_mapping_two_lanes_on_one_tid():
    ep = synth.lane_tid("ep")
    ev = _ideal()
    for e in ev:  # every offload_local task of rank 0 on the ep lane's thread
        if e.get("ph") == "X" and e["pid"] == 0 and e["tid"] == synth.lane_tid("offload_local"):
            e["tid"] = ep
    got = rules.lane_mapping(_join(ev))
    assert _found(got) == {("lane_mapping", None, 0)}
    assert f"lanes ep and offload_local both run on tid {ep}" in got[0].detail


def test_lane_mapping_task_on_no_lanes_tid_and_wrong_lane_on_another_lanes():
    J = _join(synth.move_to_tid(_ideal(), ATTN_FWD0, 999))
    assert _found(rules.lane_mapping(J)) == {("lane_mapping", ATTN_FWD0, 0)}
    assert rules.wrong_lane(J) == []
    J = _join(synth.move_to_tid(_ideal(), ATTN_FWD0, synth.lane_tid("ep")))
    assert _found(rules.wrong_lane(J)) == {("wrong_lane", ATTN_FWD0, 0)}
    assert rules.lane_mapping(J) == []


def test_order():
    J = _join(synth.swap_tasks(_ideal(), EXPERT_DW0, EXPERT_DW1))
    got = _found(rules.order(J))
    assert got and got <= {("order", EXPERT_DW0, 0), ("order", EXPERT_DW1, 0)}


def test_dependency_start_before_producer_end():
    J = _join(synth.start_before_end_of(_ideal(), EXPERT_FWD0, "s0/mb0/L0/dispatch.fwd"))
    assert ("dependency", EXPERT_FWD0, 0) in _found(rules.dependency(J))


def test_dependency_receive_against_its_send_start():
    # posted early (before its send started) is how a receive runs: not reported
    J = _join(synth.post_early(_ideal(), RECV, SEND), cross_rank_clocks=True)
    assert rules.dependency(J) == []
    # ended before its send started: impossible, reported; skipped unless clocks are comparable
    ev = synth.end_before_start_of(_ideal(), RECV, SEND)
    J = _join(ev, cross_rank_clocks=True)
    assert ("dependency", RECV, 1) in _found(rules.dependency(J))
    assert "before its send " + SEND in " ".join(v.detail for v in rules.dependency(J))
    J = _join(ev)
    assert ("dependency", RECV, 1) not in _found(rules.dependency(J)) and J.dep_pairs.skipped > 0


def test_dependency_across_stages_uses_the_replica_matched_rank():
    ev = synth.end_before_start_of(_ideal(TWO_PER_STAGE), RECV, SEND, rank=3)
    J = _join(ev, cross_rank_clocks=True)
    assert J.stages.peer(3, 0) == 1 and J.stages.peer(2, 0) == 0
    assert _found(rules.dependency(J)) == {("dependency", RECV, 3)}


def test_onload_before_offload_checked_here_not_as_dependency():
    J = _join(synth.start_before_end_of(_ideal(), ONLOAD, OFFLOAD))
    assert _found(rules.onload_before_offload(J)) == {("onload_before_offload", ONLOAD, 0)}
    assert ("dependency", ONLOAD, 0) not in _found(rules.dependency(J))
    assert len(rules.onload_instances(J)) == len(PLAN["stages"]) * 2  # one local and one remote pair per mb


def test_collective_order():
    a, b = "s0/mb0/L0/combine.bwd", "s0/mb1/L0/combine.bwd"
    J = _join(synth.swap_tasks(_ideal(TWO_PER_STAGE), a, b, rank=1))
    got = rules.collective_order(J)
    assert _found(got) == {("collective_order", b, 1)} and "communicator deadlock" in got[0].detail
    # one rank per stage: nothing to compare against
    assert rules.collective_order(_join(synth.swap_tasks(_ideal(), a, b))) == []


@pytest.fixture(scope="module")
def nsys_file(tmp_path_factory):
    def make(name, **kw):
        p = tmp_path_factory.mktemp("nsys") / f"{name}.sqlite"
        synth.nsys_sqlite(p, PLAN, kernels_per_task=2, **kw)
        return read_nsys_sqlite(p)
    return make


def test_stream_mapping_two_lanes_on_one_stream(nsys_file):
    shared = {t["id"]: "compute" for t in synth.plan_tasks(PLAN) if t["lane"] == "offload_local"}
    t = nsys_file("shared", kernel_lane=shared)
    got = rules.stream_mapping(rules.join(PLAN, t))
    assert _found(got) == {("lane_mapping", None, 0)} and "stream 7" in got[0].detail
    assert rules.wrong_stream(rules.join(PLAN, t)) == []
    assert rules.stream_mapping(rules.join(PLAN, t, clock="host")) == []


def test_wrong_stream(nsys_file):
    t = nsys_file("wrong", kernel_lane={ATTN_FWD0: "offload_local"})
    J = rules.join(PLAN, t)
    got = rules.wrong_stream(J)
    assert _found(got) == {("wrong_lane", ATTN_FWD0, 0)}
    assert "2 of its 2 GPU events ran on stream 10 (lane offload_local)" in got[0].detail
    assert rules.stream_mapping(J) == [] and rules.wrong_lane(J) == []  # its host range is on the right thread
    assert rules.wrong_stream(rules.join(PLAN, t, clock="host")) == []
    assert rules.wrong_stream(rules.join(PLAN, nsys_file("ok"))) == []


# ---- the join ------------------------------------------------------------------------------

def test_rank_stages_majority_ties_and_peers():
    rs = RankStages.by_majority([0, 0, 0, 1, 1, 2, 2, 3], [0, 0, 1, 1, 0, 1, 1, 1], stages=[0, 1, 2])
    assert rs.stage_of == {0: 0, 1: 0, 2: 1, 3: 1}  # rank 1: a 1-1 tie goes to the lower stage
    assert rs.ranks_of == {0: [0, 1], 1: [2, 3], 2: []}
    assert [rs.peer(r, 1) for r in (0, 1)] == [2, 3] and [rs.peer(r, 0) for r in (2, 3)] == [0, 1]
    assert rs.peer(0, 2) is None
    one = RankStages.by_majority([0, 1, 2], [0, 0, 1])
    assert one.peer(0, 1) == 2 and one.peer(1, 1) == 2 and one.peer(2, 0) is None  # 2 ranks vs 1: unmatched


def test_transfer_pairs_are_one_table():
    assert is_transfer("act.recv", "act.send") and not is_transfer("act.send", "act.recv")
    assert not is_transfer("act.recv", "grad.send")
    assert TRANSFER_KINDS == set(SEND_OF) | set(SEND_OF.values())
    kinds = {t["id"]: t["kind"] for t in synth.plan_tasks(PLAN)}
    recv = next(t for t in synth.plan_tasks(PLAN) if t["id"] == RECV)
    assert send_of(recv["kind"], recv["deps"], kinds.get) == SEND
    assert send_of("attn.fwd", [SEND], kinds.get) is None
    assert send_of("act.recv", ["s0/mb0/L0/attn.fwd"], kinds.get) is None


def test_ranges_by_name():
    t = table_from_runtime(synth.add_task(_ideal(), "zz", 0, 100, 1e6))
    rows, names, inv = ranges_by_name(t)
    assert len(rows) == len(t) and list(names) == sorted(set(t.name.tolist()))
    assert [names[i] for i in inv] == t.name[rows].tolist()
    kindless = type("T", (), {"name": np.array(["a", "b", "a"], object)})()
    rows, names, inv = ranges_by_name(kindless)
    assert rows.tolist() == [0, 1, 2] and names.tolist() == ["a", "b"] and inv.tolist() == [0, 1, 0]


def test_calibration_joins_a_receive_to_its_send_on_the_replica_matched_rank():
    """The receive's cost starts at its send's end on the replica-matched rank ([Note: trace
    join]): posting rank 3's receive 500 us early leaves its cost at what it waited after the send."""
    base = fit_profile(PLAN, table_from_runtime(_ideal(TWO_PER_STAGE)))
    ev = synth.post_early(_ideal(TWO_PER_STAGE), RECV, SEND, by_us=500.0, rank=3)
    fit = fit_profile(PLAN, table_from_runtime(ev))
    assert fit.task_cost_us[RECV] == pytest.approx(base.task_cost_us[RECV])
    # validation accepts the same early post
    assert validate(PLAN, table_from_runtime(ev), cross_rank_clocks=True).conforms


def test_sync_wait_is_the_time_before_the_stage_s_last_rank_posts():
    """[Note: waiting for the last rank] in traces/validate.py: rank 1 posts an all-to-all late,
    so rank 0's span of it begins with that wait; the part of the wait beside rank 0's own compute
    is its covered share. Reported only with comparable clocks and dp = 1."""
    import copy

    from k3sched.intervals import overlap_length

    plan = copy.deepcopy(PLAN)
    plan["config"] = {"parallel": {"pp": 2, "ep": 2, "dp": 1}}
    task = "s0/mb0/L0/combine.fwd"  # beside mb1's attn.fwd in the plan: its wait is covered
    ev = copy.deepcopy(_ideal(TWO_PER_STAGE))
    late = next(e for e in ev if e.get("ph") == "X" and e["name"] == task and e["pid"] == 1)
    by = late["dur"] / 2
    late["ts"] += by
    late["dur"] -= by
    table = table_from_runtime(ev)
    m = validate(plan, table, cross_rank_clocks=True).metrics["measured_by_rank"]
    assert m[0]["sync_wait_us"] == pytest.approx(by)
    assert m[1]["sync_wait_us"] == 0.0 and m[2]["sync_wait_us"] == 0.0 and m[3]["sync_wait_us"] == 0.0
    t0 = late["ts"] - by
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and e["pid"] == 0 and e["cat"] == "compute"]
    want = overlap_length([t0], [t0 + by], [a for a, _ in comp], [b for _, b in comp])
    assert 0 < want and m[0]["sync_wait_covered_us"] == pytest.approx(want)
    assert "sync_wait_us" not in validate(plan, table).metrics["measured_by_rank"][0]  # clocks not comparable
    plan["config"]["parallel"]["dp"] = 2  # the stage's ranks would be several groups the trace does not name
    assert "sync_wait_us" not in validate(plan, table, cross_rank_clocks=True).metrics["measured_by_rank"][0]
