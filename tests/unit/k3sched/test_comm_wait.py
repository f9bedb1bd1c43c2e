"""[Note: a transfer beside compute] in k3sched/cpurunner.py: on the CPU runner a transfer's
wake-ups wait for the cores its rank's compute holds, so the planner lengthens every transfer by
``hardware.cpu_runner.comm_wait_us_per_call`` per call or ring step times the share of it compute overlaps;
``k3sched probe`` measures the wait, and calibration takes it out of the costs it fits."""

from __future__ import annotations

import json

import pytest

from k3sched import planfile
from k3sched.config import load_config
from k3sched.cost import CostModel
from k3sched.planner import plan
from k3sched.tasks import LANE_OF, Kind

from conftest import CONFIGS

EP_BOUND = ["parallel.pp=1", "parallel.ep=2", "hardware.gpus_per_node=1", "hardware.cpu_runner.host_cores=2",
            "hardware.internode_gbps=0.05", "hardware.cpu_runner.comm_cpu_ns_per_byte=0"]
WAIT = 1500.0


def _cfg(*extra: str):
    return load_config(CONFIGS / "tiny-cpu.yaml", EP_BOUND + list(extra))


def test_the_wait_is_per_call_or_ring_step_and_only_on_the_cpu_runner():
    on = CostModel(_cfg(f"hardware.cpu_runner.comm_wait_us_per_call={WAIT}"))
    gpu = CostModel(_cfg(f"hardware.cpu_runner.comm_wait_us_per_call={WAIT}", "hardware.cpu_runner.host_cores=0"))
    for kind, steps in ((Kind.DISPATCH_FWD, 2), (Kind.DISPATCH_RE, 2), (Kind.COMBINE_FWD, 1), (Kind.COMBINE_BWD, 1),
                        (Kind.DISPATCH_BWD, 1)):
        assert on.cpu.comm_wait_us(kind) == pytest.approx(WAIT * steps), kind
        assert gpu.cpu.comm_wait_us(kind) == 0.0, kind
    # a ring all-reduce over 2 ranks: 2 steps, as its latency is paid ([Note: wire model])
    assert on.cpu.comm_wait_us(Kind.GRAD_RS, 1) == pytest.approx(WAIT * on.grad_wire(1).steps)
    assert on.grad_wire(1).steps == 2
    assert on.cpu.comm_wait_us(Kind.ATTN_FWD) == 0.0 and on.cpu.comm_wait_us(Kind.ACT_OFFLOAD, nbytes=100) == 0.0
    assert on.cpu.comm_costs_cpu() and not gpu.cpu.comm_costs_cpu() and not CostModel(_cfg()).cpu.comm_costs_cpu()


def test_transfers_beside_compute_are_planned_longer_and_the_serial_plan_is_not():
    # launch_us 0: the EP tasks have no host-side work, whose CPU would stretch the compute beside them
    # once the plan charges contention at all ([Note: CPU cost of communication])
    base, waited = plan(_cfg("hardware.launch_us=0")), plan(_cfg("hardware.launch_us=0",
                                                                 f"hardware.cpu_runner.comm_wait_us_per_call={WAIT}"))
    cost = CostModel(_cfg(f"hardware.cpu_runner.comm_wait_us_per_call={WAIT}"))
    grown = []
    for tid, t in waited.tasks.items():
        b = base.tasks[tid].duration_us
        if LANE_OF[t.kind] in ("ep", "collective"):
            most = cost.cpu.comm_wait_us(t.kind, t.layer, t.bytes)
            assert most > 0, tid
            # lengthened by the wait times the share of it compute overlapped (in the schedule before
            # the last: [Note: CPU cost of communication]'s fixed point), never by more than the whole
            assert b - 1e-6 <= t.duration_us <= b + most + 1e-6, tid
            grown.append((t.duration_us - b) / most)
        else:  # the compute is not stretched: no CPU per byte or per call here
            assert t.duration_us == pytest.approx(b), tid
    # the transfers a k3 plan hides under compute are charged (nearly) the whole wait, exposed ones none
    assert sum(g > 0.9 for g in grown) >= 5 and sum(g < 0.1 for g in grown) >= 5, grown
    assert sum(grown) > 0.2 * len(grown), grown
    assert waited.metrics.step_time_us >= base.metrics.step_time_us
    # one task at a time: nothing runs beside a transfer, nothing waits
    s0, s1 = (plan(_cfg(f"hardware.cpu_runner.comm_wait_us_per_call={w}"), "serial") for w in (0, WAIT))
    assert [t.duration_us for t in s1.tasks.values()] == [t.duration_us for t in s0.tasks.values()]
    assert s1.metrics.step_time_us == s0.metrics.step_time_us


def test_without_a_wait_the_plan_file_does_not_name_it():
    text = planfile.dumps_plan(plan(_cfg()))
    assert "comm_wait_us_per_call" not in text
    doc = json.loads(planfile.dumps_plan(plan(_cfg(f"hardware.cpu_runner.comm_wait_us_per_call={WAIT}"))))
    assert doc["config"]["hardware"]["cpu_runner"]["comm_wait_us_per_call"] == WAIT


def test_probe_fit_is_the_median_extra_time_of_a_call_beside_compute():
    from runtime.probe import comm_wait_fit

    rows = [{"bytes": 16384, "idle_call_us": 400.0, "busy_call_us": 1600.0},
            {"bytes": 262144, "idle_call_us": 3000.0, "busy_call_us": 4000.0},
            {"bytes": 1048576, "idle_call_us": 11000.0, "busy_call_us": 13500.0}]
    assert comm_wait_fit({"groups": {"inter": {"contended": rows}}}) == pytest.approx(1200.0)
    faster = [dict(r, busy_call_us=r["idle_call_us"] - 10.0) for r in rows]  # noise: never below 0
    assert comm_wait_fit({"groups": {"inter": {"contended": faster}}}) == 0.0
    assert comm_wait_fit({"groups": {"inter": {}}}) is None
