"""[Note: CPU cost of communication] in k3sched/cpurunner.py: on the CPU runner a transfer costs the
rank's cores per byte and per call, and the compute it overlaps is planned longer by it."""

from __future__ import annotations

import pytest

from k3sched.config import load_config
from k3sched.cost import CostModel
from k3sched.planner import plan
from k3sched.tasks import LANE_OF, Kind

from conftest import CONFIGS

EP_BOUND = ["parallel.pp=1", "parallel.ep=2", "hardware.gpus_per_node=1", "hardware.cpu_runner.host_cores=2",
            "hardware.internode_gbps=0.05", "hardware.cpu_runner.comm_cpu_ns_per_byte=0"]


def _cfg(*extra: str):
    return load_config(CONFIGS / "tiny-cpu.yaml", EP_BOUND + list(extra))


def test_every_call_costs_the_rank_its_cpu_only_on_the_cpu_runner():
    on = CostModel(_cfg("hardware.cpu_runner.comm_cpu_us_per_call=100"))
    off = CostModel(_cfg("hardware.cpu_runner.comm_cpu_us_per_call=100", "hardware.cpu_runner.host_cores=0"))
    none = CostModel(_cfg())
    for kind, calls in ((Kind.DISPATCH_FWD, 2), (Kind.DISPATCH_RE, 2), (Kind.COMBINE_FWD, 1), (Kind.COMBINE_BWD, 1),
                        (Kind.DISPATCH_BWD, 1), (Kind.GRAD_RS, 1), (Kind.FWD_RECV, 1)):
        moved, host = on.cpu.comm_cpu_load(kind, 1000)
        moved0, host0 = none.cpu.comm_cpu_load(kind, 1000)
        assert moved == moved0 and host == pytest.approx(host0 + 100 * calls), kind
        assert off.cpu.comm_cpu_load(kind, 1000)[1] == host0, kind  # lanes are GPU streams: no per-call CPU
    assert on.cpu.comm_cpu_load(Kind.ATTN_FWD, 0) == (0.0, 0.0)
    assert on.cpu.comm_costs_cpu() and not off.cpu.comm_costs_cpu() and not CostModel(_cfg("hardware.cpu_runner.host_cores=0")).cpu.comm_costs_cpu()


def _lane_sum(p, lane: str) -> float:
    return sum(t.duration_us for t in p.tasks.values() if LANE_OF[t.kind] == lane)


def test_per_call_cpu_stretches_the_compute_a_transfer_overlaps_and_not_the_serial_plan():
    base, charged = (plan(_cfg(f"hardware.cpu_runner.comm_cpu_us_per_call={us}")) for us in (0, 2000))
    cost = CostModel(_cfg("hardware.cpu_runner.comm_cpu_us_per_call=2000"))
    # the transfers themselves are planned as before: the CPU they cost lengthens compute only
    for tid, t in charged.tasks.items():
        if LANE_OF[t.kind] != "compute":
            assert t.duration_us == pytest.approx(base.tasks[tid].duration_us), tid
    comm = [t for t in charged.tasks.values() if LANE_OF[t.kind] in ("ep", "collective")]
    calls_cpu = sum(2000.0 * cost.comm_calls(t.kind) for t in comm)
    # with the per-call CPU the planner also starts charging the EP tasks' host work (no per-byte CPU here)
    extra_cpu = sum(cost.cpu.comm_cpu_load(t.kind, t.bytes)[1] for t in comm)
    assert extra_cpu >= calls_cpu
    grown = _lane_sum(charged, "compute") - _lane_sum(base, "compute")
    # some of the calls overlap compute and slow it, never by more than the CPU they cost
    assert 0.1 * calls_cpu < grown <= extra_cpu + 1e-6, (grown, calls_cpu, extra_cpu)
    for tid, t in charged.tasks.items():
        if LANE_OF[t.kind] == "compute":
            assert t.duration_us >= base.tasks[tid].duration_us - 1e-6, tid
    assert charged.metrics.step_time_us > base.metrics.step_time_us
    # one task at a time: nothing overlaps, nothing is stretched
    s0, s1 = (plan(_cfg(f"hardware.cpu_runner.comm_cpu_us_per_call={us}"), "serial") for us in (0, 2000))
    assert s1.metrics.step_time_us == pytest.approx(s0.metrics.step_time_us)
