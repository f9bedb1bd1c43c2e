"""The expected step and overlap with task-time spread ([Note: task-time spread] in
k3sched/variability.py): the replay's sync and serial semantics against closed forms, where the
spread comes from (hardware, profile, calibration, probe), and that plans without it are as before."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest

from k3sched.config import load_config
from k3sched.cost import CostModel
from k3sched.planner import plan
from k3sched.profile import Profile
from k3sched.tasks import Kind, Task
from k3sched.variability import expected, time_cvs

from conftest import CONFIGS

TINY = CONFIGS / "tiny-cpu.yaml"


def _two_task_step(cv: float, ep: int):
    """A compute task (1 ms) then the all-to-all that needs it on every EP rank (no wire time);
    another micro-batch's all-to-all (1 us, so the stage has a transfer and its compute spreads)
    is planned beside the compute task."""
    cfg = load_config(TINY, ["parallel.pp=1", f"parallel.ep={ep}", f"hardware.cpu_runner.task_time_cv={cv}"])
    a = Task("s0/mb0/L1/attn.fwd", Kind.ATTN_FWD, "compute", 0, 0, 0, 1, duration_us=1000.0,
             start_us=0.0, end_us=1000.0)
    c = Task("s0/mb1/L1/combine.fwd", Kind.COMBINE_FWD, "ep", 0, 0, 1, 1, duration_us=1.0, start_us=0.0, end_us=1.0)
    d = Task("s0/mb0/L1/dispatch.fwd", Kind.DISPATCH_FWD, "ep", 0, 0, 0, 1, duration_us=0.0, deps=[a.id],
             start_us=1000.0, end_us=1000.0)
    return cfg, {a.id: a, c.id: c, d.id: d}, {(0, "compute"): [a.id], (0, "ep"): [c.id, d.id]}


def test_every_task_of_a_co_scheduled_stage_with_transfers_spreads():
    """[Note: spread of a task the plan puts alone]: the task the plan puts beside the transfer and
    the one it puts alone both spread; a stage without a transfer that takes time stays exact."""
    from k3sched.variability import _by_stage, _spread_tasks

    a = Task("s0/mb0/L1/attn.fwd", Kind.ATTN_FWD, "compute", 0, 0, 0, 1, duration_us=1000.0, start_us=0.0,
             end_us=1000.0)
    b = Task("s0/mb0/L1/router.fwd", Kind.ROUTER_FWD, "compute", 0, 0, 0, 1, duration_us=1000.0, start_us=1000.0,
             end_us=2000.0)
    c = Task("s0/mb1/L1/combine.fwd", Kind.COMBINE_FWD, "ep", 0, 0, 1, 1, duration_us=250.0, start_us=750.0,
             end_us=1000.0)
    d = Task("s1/mb0/L2/attn.fwd", Kind.ATTN_FWD, "compute", 1, 0, 0, 2, duration_us=1000.0, start_us=0.0,
             end_us=1000.0)
    e = Task("s1/mb1/L2/combine.fwd", Kind.COMBINE_FWD, "ep", 1, 0, 1, 2, duration_us=0.0, start_us=0.0, end_us=0.0)
    tl = [a, b, c, d, e]
    assert _spread_tasks(tl, _by_stage(tl)) == {0, 1}


def test_an_all_to_all_starts_at_the_expected_maximum_of_its_ranks():
    """Two ranks, each a log-normal compute of mean 1 ms: the all-to-all waits for the later one,
    E[max(X1, X2)] = 2 Phi(sigma / sqrt 2) ms for mean-1 log-normals; one rank waits for no one."""
    cv = 0.3
    sigma = math.sqrt(math.log1p(cv * cv))
    cfg, tasks, lanes = _two_task_step(cv, 2)
    got = expected(tasks, lanes, cfg, CostModel(cfg), samples=20000)
    assert got["ranks"] == 2
    assert got["step_time_us"] == pytest.approx(2000 * NormalDist().cdf(sigma / math.sqrt(2)), rel=0.01)
    # rank 0's wait for the later rank: E[max(X1, X2)] - E[X1] ([Note: waiting for the last rank])
    assert got["sync_wait_us"] == [pytest.approx(1000 * (2 * NormalDist().cdf(sigma / math.sqrt(2)) - 1), rel=0.03)]
    cfg1, tasks1, lanes1 = _two_task_step(cv, 1)
    one = expected(tasks1, lanes1, cfg1, CostModel(cfg1), samples=20000)
    assert one["ranks"] == 1 and one["step_time_us"] == pytest.approx(1000.0, rel=0.01)
    assert one["sync_wait_us"] == [None]  # one rank: nothing to wait for


def test_without_spread_the_replay_is_the_plan_and_plans_carry_no_expected_block():
    cfg = load_config(TINY)
    p = plan(cfg)
    assert p.metrics.expected is None and "task_time_cv" not in cfg.model_dump(mode="json")["hardware"]
    got = expected(p.tasks, p.lane_orders, cfg, CostModel(cfg), samples=2)
    assert got["step_time_us"] == pytest.approx(p.metrics.step_time_us, rel=1e-9)


def test_spread_raises_the_step_lowers_the_overlap_and_replays_the_same_each_time():
    cfg = load_config(TINY, ["hardware.cpu_runner.task_time_cv=0.3"])
    a, b = plan(cfg), plan(cfg)
    e = a.metrics.expected
    assert e == b.metrics.expected  # seeded: a plan's expectation is reproducible
    assert e["step_time_us"] > a.metrics.step_time_us
    assert e["step_time_p10_us"] <= e["step_time_us"] <= e["step_time_p90_us"]
    planned = plan(load_config(TINY)).metrics
    assert a.metrics.step_time_us == planned.step_time_us  # the schedule itself is unchanged
    c0 = load_config(TINY)
    p0 = plan(c0)
    exact = expected(p0.tasks, p0.lane_orders, c0, CostModel(c0), samples=1)["comm_overlap_ratio"]
    assert len(e["comm_overlap_ratio"]) == 2
    assert all(0.0 <= got < was for got, was in zip(e["comm_overlap_ratio"], exact))
    assert all(w > 0 for w in e["sync_wait_us"])  # the ranks drift apart between all-to-alls
    assert expected(p0.tasks, p0.lane_orders, c0, CostModel(c0), samples=1)["sync_wait_us"] == [0.0, 0.0]


def test_a_serial_plan_replays_one_task_at_a_time():
    cfg = load_config(TINY, ["hardware.cpu_runner.task_time_cv=0.3"])
    e = plan(cfg, "serial").metrics.expected
    assert e["comm_overlap_ratio"] == [0.0, 0.0]


def test_a_serial_plans_tasks_spread_and_its_ranks_wait_for_each_other():
    """[Note: spread of a task the plan puts alone]: a serial plan's compute spreads as a
    co-scheduled one's (measured so on the testbed), so its EP ranks wait for each other at every
    all-to-all and its expected step is above the planned one; without a spread it is the plan."""
    cfg = load_config(TINY, ["hardware.cpu_runner.task_time_cv=0.3"])
    p = plan(cfg, "serial")
    e = p.metrics.expected
    assert e["step_time_us"] > 1.02 * p.metrics.step_time_us
    assert all(w is not None and w > 0 for w in e["sync_wait_us"])
    assert plan(load_config(TINY), "serial").metrics.expected is None


def test_a_profile_spread_replaces_the_hardware_one_for_its_kinds():
    cfg = load_config(TINY, ["hardware.cpu_runner.task_time_cv=0.1"])
    cvs = time_cvs(cfg, CostModel(cfg, Profile(time_cv={"expert.fwd": 0.4})))
    assert cvs[Kind.EXPERT_FWD] == 0.4 and cvs[Kind.ATTN_FWD] == 0.1
    assert Kind.DISPATCH_FWD not in cvs  # communication is not sampled: its waits come from the sync


def test_calibration_fits_each_kinds_spread_beside_transfers(tmp_path):
    """Only instances that ran beside their rank's transfers count (the replay spreads a task by
    the share of it beside a transfer); the profile carries the result."""
    from traces.calibrate import Fit, _spread_beside_transfers, write_profile

    from k3sched.profile import load_profile

    tasks = {"s0/mb0/L1/attn.fwd": {"kind": "attn.fwd", "lane": "compute"},
             "s0/mb1/L1/attn.fwd": {"kind": "attn.fwd", "lane": "compute"},
             "s0/mb2/L1/attn.fwd": {"kind": "attn.fwd", "lane": "compute"},
             "s0/mb0/L1/expert.fwd": {"kind": "expert.fwd", "lane": "compute"},
             "s0/mb0/L1/dispatch.fwd": {"kind": "dispatch.fwd", "lane": "ep"}}
    occ = {(0, "s0/mb0/L1/dispatch.fwd", 0): (0.0, 1000.0),   # the transfer: 0..1000 us on rank 0
           (0, "s0/mb0/L1/attn.fwd", 0): (0.0, 100.0),        # beside it
           (0, "s0/mb1/L1/attn.fwd", 0): (100.0, 400.0),      # beside it
           (0, "s0/mb2/L1/attn.fwd", 0): (2000.0, 3000.0),    # alone: not counted
           (0, "s0/mb0/L1/expert.fwd", 0): (400.0, 500.0)}    # beside, but one instance only
    cv = _spread_beside_transfers(tasks, occ)
    mean, std = 200.0, 100.0  # spans 100 and 300
    assert cv == {"attn.fwd": pytest.approx(std / mean)}
    prof = load_profile(write_profile(Fit(durations_us={"attn.fwd": 1.0}, time_cv=cv), tmp_path / "p.yaml"))
    assert prof.time_cv == {"attn.fwd": pytest.approx(0.5)}


def test_probe_spread_is_the_median_chunk_spread_of_the_contended_rows():
    from runtime.probe import task_time_cv_fit

    rows = [{"bytes": 1, "moved_bytes": 2, "stretch_us": 1.0, "chunk_cv": cv, "chunks": 50} for cv in (0.3, 0.1, 0.2)]
    assert task_time_cv_fit({"groups": {"inter": {"ranks": [0, 1], "ops": {}, "contended": rows}}}) == 0.2
    assert task_time_cv_fit({"groups": {"inter": {"ranks": [0, 1], "ops": {}}}}) is None
