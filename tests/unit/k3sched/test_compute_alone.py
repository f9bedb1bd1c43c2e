"""[Note: compute alone] in k3sched/cpurunner.py: on the CPU runner a pipeline stage of one rank that
computes while no other stage does runs ``hardware.cpu_runner.compute_alone_factor`` of its profiled time; a
stage of several ranks (EP or DP replicas compute in step) and GPUs are unchanged; calibration
takes the speed-up back out of a PP source's spans (traces/calibrate.py ``_alone_back``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3sched.config import ConfigError, load_config
from k3sched.planner import plan

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"
CPU = ["hardware.cpu_runner.host_cores=2", "hardware.internode_gbps=0.02", "hardware.cpu_runner.comm_cpu_ns_per_byte=2",
       "hardware.cpu_runner.comm_cpu_us_per_call=300", "model.layers=4", "parallel.microbatches=4", "schedule.offload=none",
       "hardware.gpus_per_node=1"]
PP2 = ["parallel.pp=2", "parallel.ep=1"]


def _plan(extra: list[str]):
    return plan(load_config(TINY, CPU + extra))


def _tasks(p) -> dict:
    return {t.id: t for t in p.graph.tasks.values()}


@pytest.mark.parametrize("strategy", ["k3", "serial"])
def test_a_stage_computing_alone_runs_the_factor_of_its_time(strategy):
    # transfers that cost no CPU: the compute durations then differ by the factor alone
    extra = PP2 + ["hardware.cpu_runner.comm_cpu_ns_per_byte=0", "hardware.cpu_runner.comm_cpu_us_per_call=0"] \
        + (["schedule.strategy=serial"] if strategy == "serial" else [])
    base, fast = _plan(extra), _plan(extra + ["hardware.cpu_runner.compute_alone_factor=0.8"])
    assert fast.metrics.step_time_us < 0.97 * base.metrics.step_time_us
    b, f = _tasks(base), _tasks(fast)
    first = "s0/mb0/L0/attn.fwd"  # stage 1 has nothing to compute yet: alone for its whole span
    assert f[first].duration_us == pytest.approx(0.8 * b[first].duration_us, rel=1e-6)
    ratios = [f[i].duration_us / b[i].duration_us for i in b if b[i].lane == "compute" and b[i].duration_us > 0]
    assert min(ratios) >= 0.8 - 1e-9 and max(ratios) <= 1.0 + 1e-9
    assert any(r > 0.8 + 1e-3 for r in ratios)  # some ran beside the other stage's compute


@pytest.mark.parametrize("extra", [["parallel.pp=1", "parallel.ep=2"], ["parallel.pp=2", "parallel.ep=2"],
                                   PP2 + ["hardware.cpu_runner.host_cores=0"]],
                         ids=["one stage of two ranks", "stages of two ranks", "GPUs"])
def test_ranks_that_never_compute_alone_are_unchanged(extra):
    a, b = _plan(extra), _plan(extra + ["hardware.cpu_runner.compute_alone_factor=0.5"])
    assert a.metrics.step_time_us == b.metrics.step_time_us
    ta, tb = _tasks(a), _tasks(b)
    assert all(ta[i].duration_us == tb[i].duration_us for i in ta)


def test_plan_json_names_the_factor_only_when_set(tmp_path):
    from k3sched import planfile

    doc = json.loads(planfile.dumps_plan(_plan(PP2)))
    assert "compute_alone_factor" not in doc["config"]["hardware"]
    doc = json.loads(planfile.dumps_plan(_plan(PP2 + ["hardware.cpu_runner.compute_alone_factor=0.85"])))
    assert doc["config"]["hardware"]["cpu_runner"]["compute_alone_factor"] == 0.85


@pytest.mark.parametrize("bad", ["0", "1.2", "-0.5", "nan"])
def test_a_factor_outside_0_1_is_refused_in_one_line(bad):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"hardware.cpu_runner.compute_alone_factor={bad}"])
    assert "compute_alone_factor" in str(e.value) and "\n" not in str(e.value)


def test_calibration_from_a_pp_source_takes_the_speedup_back_out(tmp_path):
    """The ideal trace of a PP 2 x EP 1 plan made with the factor calibrates to durations that,
    planned with the same factor, predict the source and an EP target as the known profile does
    (within 1%); counting the speed-up twice would leave them short."""
    from k3sched import planfile
    from traces import synth
    from traces.calibrate import fit_profile, write_profile
    from traces.chrome import table_from_runtime

    source = PP2 + ["hardware.cpu_runner.compute_alone_factor=0.8"]
    pj = json.loads(planfile.dumps_plan(_plan(source)))
    table = table_from_runtime(synth.trace_from_plan(pj, rank_of_stage={0: [0], 1: [1]}))
    fit = fit_profile(pj, table)
    prof = write_profile(fit, tmp_path / "fitted.yaml")
    for name, extra in {"source": [], "serial": ["schedule.strategy=serial"],
                        "ep 2": ["parallel.pp=1", "parallel.ep=2"]}.items():
        known = _plan(source + extra).metrics.step_time_us
        predicted = _plan(source + extra + [f"schedule.profile={prof}"]).metrics.step_time_us
        assert predicted == pytest.approx(known, rel=0.01), name
