"""Calibration ([Note: calibration] in k3sched/calibrate.py): fitting a profile from traces,
the ``k3sched calibrate`` command, and the end-to-end claim on this CPU runner: a profile fitted
from one run of the tiny config predicts the measured step time of a new run within 10%."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from k3sched.calibrate import Fit, fit_profile, write_profile
from k3sched.cli import app
from k3sched.cost import load_profile
from traces import synth
from traces.chrome import table_from_runtime

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-cpu.yaml"


def _synthetic():
    plan = synth.small_plan()
    return plan, table_from_runtime(synth.trace_from_plan(plan, rank_of_stage={0: [0, 1], 1: [2, 3]}))


def test_fit_recovers_lane_durations_of_an_ideal_trace():
    plan, events = _synthetic()
    fit = fit_profile(plan, events)
    # synth durations: compute 100 us, ep 40, collective 30, offload_local 50, offload_remote 60
    for kind in ("attn.fwd", "expert.fwd", "attn.dx", "expert.dw"):
        assert fit.durations_us[kind] == pytest.approx(100.0)
    for kind in ("dispatch.fwd", "combine.bwd"):
        assert fit.durations_us[kind] == pytest.approx(40.0)
    assert fit.durations_us["act.send"] == pytest.approx(30.0)
    assert fit.durations_us["act.offload"] == pytest.approx(50.0)
    assert fit.ranks == 4 and fit.steps_used == 1
    assert fit.samples["attn.fwd"] == 8  # 2 micro-batches x 4 ranks
    # bandwidth = bytes / cost on the byte lanes (synthetic plan: no config, so no fixed part)
    assert fit.bandwidth_gbps["ep"] == pytest.approx((1 << 22) / 40.0 / 1e3)


def test_receive_cost_excludes_waiting_for_the_send_and_collective_waits_for_the_last_rank():
    plan, _ = _synthetic()
    ev = synth.trace_from_plan(plan, rank_of_stage={0: [0, 1], 1: [2, 3]})
    for r in (2, 3):
        ev = synth.post_early(ev, "s1/mb0/v0/act.recv", "s0/mb0/v0/act.send", by_us=500.0, rank=r)
    # rank 1 enters dispatch 300 us late: rank 0's dispatch waited 300 us, which is no cost
    for e in ev:
        if e.get("name") == "s0/mb0/L0/dispatch.fwd":
            if e["pid"] == 1:
                e["ts"] += 300.0
            else:
                e["dur"] += 300.0
    fit = fit_profile(plan, table_from_runtime(ev))
    assert fit.task_cost_us["s1/mb0/v0/act.recv"] == pytest.approx(30.0)   # from the send's end
    assert fit.task_cost_us["s0/mb0/L0/dispatch.fwd"] == pytest.approx(40.0)
    assert fit.raw_median_us["act.recv"] > 30.0


def test_nsys_style_repeats_drop_the_warmup_step():
    plan, events = _synthetic()
    ev = synth.trace_from_plan(plan, rank_of_stage={0: [0, 1], 1: [2, 3]})
    later = copy.deepcopy([e for e in ev if e["ph"] == "X"])
    for e in later:
        e["ts"] += 1e6
    for e in ev:  # the first step is 3x slower (warm-up)
        if e["ph"] == "X":
            e["dur"] *= 3
    fit = fit_profile(plan, table_from_runtime(ev + later))
    assert fit.steps_used == 1 and fit.durations_us["attn.fwd"] == pytest.approx(100.0)


def test_profile_yaml_is_what_the_cost_model_reads(tmp_path):
    fit = Fit(durations_us={"attn.fwd": 812.0}, bandwidth_gbps={"ep": 1.5},
              saved_bytes={"attn.fwd": (10, 20)})
    path = write_profile(fit, tmp_path / "p.yaml", source="test")
    prof = load_profile(path)
    assert prof.durations_us == {"attn.fwd": 812.0} and prof.bandwidth_gbps == {"ep": 1.5}
    assert prof.saved_bytes == {"attn.fwd": (10, 20)}


def test_cli_unreadable_trace_is_one_line_exit_2(tmp_path):
    res = CliRunner().invoke(app, ["calibrate", str(tmp_path / "none.json"), "--plan", str(tmp_path / "plan.json"),
                                   "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code == 2
    assert "no such file" in res.output and not (tmp_path / "p.yaml").exists()


@pytest.mark.slow
def test_calibrated_plan_predicts_a_new_run_within_10_percent(tmp_path):
    """Run A (8 steps) -> its traces conform (cross-rank clocks) -> calibrate from its last step ->
    run B (8 steps) planned with the profile: B's measured median step is within 10% of B's
    predicted step. 8 steps, not 3: a step varies +-15% here; 2 ranks (PP 1 x EP 2) rather than the
    config's 4, because 4 ranks x 5 lane threads on this 2-core runner make the median of 7 steady
    steps vary up to 10% between back-to-back runs (measured: 0.90..1.08), 2 ranks about 5%. A load
    spike outside the test during run A (seen once: A 311 ms, B 245 ms) skews the whole comparison,
    so one fresh A/B pair is measured before failing; both pairs are in the failure message."""
    from runtime.launch import run_command
    from traces.cli import validate_main

    attempts = []
    for attempt in range(2):  # a second measurement only when load outside the test skewed the first
        info, ratio, changed = _calibrate_and_predict(tmp_path / f"try{attempt}", run_command, validate_main)
        attempts.append(info)
        print(info)
        assert changed  # the profile changed the prediction
        if abs(ratio - 1) <= 0.10:
            break
    assert abs(ratio - 1) <= 0.10, " | ".join(attempts)


def _calibrate_and_predict(d: Path, run_command, validate_main) -> tuple[str, float, bool]:
    """Run A, validate and calibrate from it, run B with the profile; (info, B measured/predicted,
    whether the profile changed the prediction)."""
    a, b = d / "a", d / "b"
    two_ranks = ["parallel.pp=1"]
    assert run_command(TINY, two_ranks, 8, None, a, False, None, timeout_s=180, quiet=True) == 0
    traces = sorted(a.glob("trace_rank*.json"))
    assert len(traces) == 2
    # the runtime's traces conform with comparable clocks (receives are posted early)
    with open(os.devnull, "w") as devnull:
        assert validate_main(a / "plan.json", traces, tolerance_us=50.0, cross_rank_clocks=True, out=devnull) == 0
    res = CliRunner().invoke(app, ["calibrate", *map(str, traces), "--plan", str(a / "plan.json"),
                                   "-o", str(d / "profile.yaml")])
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load((d / "profile.yaml").read_text())
    assert {"durations_us", "bandwidth_gbps"} <= doc.keys() and "attn.fwd" in doc["durations_us"]
    plan_a = json.loads((a / "plan.json").read_text())
    assert run_command(TINY, two_ranks + [f"schedule.profile={d / 'profile.yaml'}"], 8, None, b, False, None,
                       timeout_s=180, quiet=True) == 0
    sb = json.loads((b / "summary.json").read_text())
    predicted, measured = sb["predicted_step_time_us"], sb["measured_step_time_us"]
    sa = json.loads((a / "summary.json").read_text())
    info = (f"run A measured {sa['measured_step_time_us'] / 1e3:.1f} ms (predicted uncalibrated "
            f"{sa['predicted_step_time_us'] / 1e3:.1f} ms); run B predicted {predicted / 1e3:.1f} ms, measured "
            f"{measured / 1e3:.1f} ms, ratio {measured / predicted:.3f}; steps B {sb['step_time_s']}")
    return info, measured / predicted, plan_a["metrics"]["step_time_us"] != predicted
