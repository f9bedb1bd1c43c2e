"""Multi-process runtime tests (gloo, CPU) through ``runtime.launch.run_command`` (torchrun):
EP numerics vs the single-process reference, PP 2 x EP 2 training vs the reference, traces,
start-up order check, failing rank, user errors. Every launch has a wall-clock limit and
run_command kills the launched process group, so no test can hang or leave processes behind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from k3sched.config import load_config
from runtime.launch import run_command
from runtime.reference import reference_run

from conftest import procs_with

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.yaml"
LIMIT_S = 150.0
EP2 = ["parallel.pp=1", "parallel.ep=2", "parallel.microbatches=2", "model.layers=2", "model.seq_len=16",
       "model.micro_batch_size=1"]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # one_thread: tests/conftest.py


def _run(out: Path, overrides: list[str], steps: int, **kw) -> int:
    return run_command(TINY, overrides, steps, None, out, False, None, timeout_s=LIMIT_S, quiet=True, **kw)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The tiny config as shipped (PP 2 x EP 2, 4 ranks), 3 steps, the first two warm-up, with the
    traces of the measured steps."""
    out = tmp_path_factory.mktemp("tiny")
    assert _run(out, [], 3, warmup_steps=2, trace_steps=True) == 0
    return out


def test_ep2_matches_reference_loss_and_gradients(tmp_path):
    assert _run(tmp_path, EP2, 1, extra_args=["--dump-grads"]) == 0
    cfg = load_config(TINY, EP2)
    ref = reference_run(cfg, 1)
    loss = json.loads((tmp_path / "summary.json").read_text())["losses"][0]
    assert loss == pytest.approx(ref.losses[0], rel=1e-5)
    E, ep = cfg.model.experts, 2
    for r in range(ep):
        got = torch.load(tmp_path / f"grads_rank{r}.pt")
        assert got.keys() == ref.grads.keys()
        for name, g in ref.grads.items():
            if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
                g = g[r * E // ep:(r + 1) * E // ep]
            err = (got[name] - g).norm() / g.norm().clamp_min(1e-30)
            assert err <= 1e-5, f"rank {r} {name}: relative error {err:.3g}"


def test_pp2_ep2_trains_like_the_reference(tiny_run):
    summary = json.loads((tiny_run / "summary.json").read_text())
    ref = reference_run(load_config(TINY), 3)
    assert summary["losses"] == pytest.approx(ref.losses, rel=1e-5, abs=0)
    assert summary["losses"][-1] < summary["losses"][0]
    assert summary["predicted_step_time_us"] > 0 and summary["measured_step_time_us"] > 0
    assert len(summary["step_time_s"]) == 3 and len(summary["tokens_per_s"]) == 3
    # --warmup-steps 2: the measured step is the third one's, not the median of the last two
    assert summary["warmup_steps"] == 2
    assert summary["measured_step_time_us"] == pytest.approx(summary["step_time_s"][2] * 1e6, rel=1e-12)


def test_steady_step_leaves_out_the_warmup_steps():
    from runtime.train import steady_step_s

    times = [3.0, 2.2, 1.7, 1.8, 1.6]
    assert steady_step_s(times, 1) == 1.8  # the upper median of 2.2, 1.7, 1.8, 1.6
    assert steady_step_s(times, 2) == 1.7
    assert steady_step_s(times, 0) == 1.8
    assert steady_step_s(times, 5) == 1.8  # nothing left: every step
    assert steady_step_s([], 1) == 0.0


def test_traces_hold_every_planned_task_once_on_its_lane_thread(tiny_run):
    plan = json.loads((tiny_run / "plan.json").read_text())
    assert plan["format"] == "k3sched.plan/1"
    for rank in range(4):
        trace = json.loads((tiny_run / f"trace_rank{rank}.json").read_text())
        other = trace["otherData"]
        assert other["format"] == "k3sched.trace/1" and other["rank"] == rank
        stage = rank // 2  # ep innermost: ranks 0, 1 hold stage 0
        assert other["stage"] == stage
        planned = {t["id"]: lane for lane, ts in plan["stages"][stage]["lanes"].items() for t in ts}
        lane_of_tid = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        names = [e["name"] for e in xs]
        assert len(names) == len(set(names)) and set(names) == set(planned)
        for e in xs:
            assert e["pid"] == rank and e["args"]["lane"] == planned[e["name"]] == lane_of_tid[e["tid"]]
            assert e["dur"] >= 0 and e["ts"] >= 0
        # each lane ran in plan order
        for lane, ts in plan["stages"][stage]["lanes"].items():
            ran = [e["name"] for e in sorted(xs, key=lambda e: e["ts"]) if e["args"]["lane"] == lane]
            assert ran == [t["id"] for t in ts]


def test_trace_steps_hold_the_last_warmup_step_and_the_measured_ones_on_one_clock(tiny_run):
    """[Note: traces of the measured steps] in runtime/steplog.py: with 3 steps, 2 of them warm-up,
    trace_steps_rank{R}.json holds steps 1 and 2; its step 2 is trace_rank{R}.json's (same spans, one
    shift for every rank: both are aligned to the earliest task of any rank, of step 1 and of step 2),
    and calibrating from it drops step 1 as warm-up, so it fits exactly what the last step's traces
    fit."""
    from traces.calibrate import fit_profile
    from traces.chrome import table_from_runtime

    plan = json.loads((tiny_run / "plan.json").read_text())
    shifts = set()
    steps, last = [], []
    for rank in range(4):
        trace = json.loads((tiny_run / f"trace_rank{rank}.json").read_text())
        both = json.loads((tiny_run / f"trace_steps_rank{rank}.json").read_text())
        assert both["otherData"]["steps"] == [1, 2] and both["otherData"]["rank"] == rank
        assert both["otherData"]["format"] == trace["otherData"]["format"]
        xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        bx = [e for e in both["traceEvents"] if e["ph"] == "X"]
        assert len(bx) == 2 * len(xs) and {e["args"]["step"] for e in bx} == {1, 2}
        second = {e["name"]: e for e in bx if e["args"]["step"] == 2}
        first_end = max(e["ts"] + e["dur"] for e in bx if e["args"]["step"] == 1)
        for e in xs:
            s = second[e["name"]]
            assert s["dur"] == e["dur"] and s["tid"] == e["tid"] and s["ts"] > first_end - 1.0
            shifts.add(round(s["ts"] - e["ts"], 0))
        steps.append(table_from_runtime(both))
        last.append(table_from_runtime(trace))
    assert len(shifts) <= 2, shifts  # one shift (rounding of the two alignments aside)
    from traces.events import EventTable

    fit_steps = fit_profile(plan, EventTable.concat(steps))
    fit_last = fit_profile(plan, EventTable.concat(last))
    assert fit_steps.steps_used == fit_last.steps_used == 1
    assert fit_steps.durations_us == pytest.approx(fit_last.durations_us, rel=1e-6)
    assert fit_steps.latency_us == pytest.approx(fit_last.latency_us, rel=1e-6)


def test_summary_gives_each_ranks_lane_busy_and_overlap_per_step_as_its_trace_does(tiny_run):
    """``lane_busy_s``: per lane, rank and step the seconds the rank's tasks ran; the last step's
    equals the sum of the rank's trace spans (the traced step), and the plan's sums sit beside it;
    ``comm_overlap_ratio``: the last step's is the validator's on the trace."""
    from traces.schema import RunSummary

    summary = json.loads((tiny_run / "summary.json").read_text())
    RunSummary.model_validate(summary)
    plan = json.loads((tiny_run / "plan.json").read_text())
    busy, planned = summary["lane_busy_s"], summary["lane_busy_planned_s"]
    assert {"compute", "ep", "collective"} <= set(busy) and set(busy) == set(planned)
    for lane, per_stage in planned.items():
        assert per_stage == pytest.approx([sum(t["end_us"] - t["start_us"] for t in st["lanes"][lane]) / 1e6
                                           for st in plan["stages"]])
    for lane, ranks in busy.items():
        assert len(ranks) == 4 and all(len(steps) == 3 for steps in ranks)
        for rank in range(4):
            trace = json.loads((tiny_run / f"trace_rank{rank}.json").read_text())
            spans = sum(e["dur"] for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["lane"] == lane)
            assert ranks[rank][-1] == pytest.approx(spans / 1e6, abs=1e-6)
    assert all(s > 0 for steps in busy["compute"] for s in steps)
    # the last step's overlap is what the validator measures on the trace
    from traces.chrome import read_trace
    from traces.events import EventTable
    from traces.validate import load_plan, validate

    ev = EventTable.concat([read_trace(tiny_run / f"trace_rank{r}.json") for r in range(4)])
    measured = validate(load_plan(tiny_run / "plan.json"), ev).metrics["measured_by_rank"]
    ratios = summary["comm_overlap_ratio"]
    assert len(ratios) == 4 and all(len(steps) == 3 for steps in ratios)
    for rank in range(4):
        assert 0 < ratios[rank][-1] <= 1
        assert ratios[rank][-1] == pytest.approx(measured[rank]["comm_overlap_ratio"], abs=1e-4)


def test_compute_ratios_take_each_ranks_median_steady_step_against_its_stage():
    from runtime.transfer import compute_ratios

    summary = {"lane_busy_s": {"compute": [[9.0, 2.2, 1.8, 2.0], [9.0, 1.0, 1.2, 1.1], [1.5, 1.5, 1.5, 1.5]]},
               "lane_busy_planned_s": {"compute": [2.0, 1.0]}, "stage_of_rank": [0, 0, 1]}
    # rank 0: median of 2.2, 1.8, 2.0 = 2.0 / 2.0; rank 1: 1.1 / 2.0; rank 2 (stage 1): 1.5 / 1.0
    assert compute_ratios(summary, 1) == pytest.approx((0.55, 1.5))
    assert compute_ratios(summary, 0)[0] == pytest.approx(1.15 / 2.0)  # warm-up kept: 1.0, 1.1, 1.2, 9.0
    assert compute_ratios({"lane_busy_s": {}}, 1) is None


def test_failing_rank_stops_every_rank_with_one_clear_line(tmp_path, capfd):
    t0 = time.monotonic()
    rc = _run(tmp_path, ["parallel.pp=2", "parallel.ep=1", "parallel.microbatches=2", "model.seq_len=16",
                         "model.micro_batch_size=1"], 2, env={"K3SCHED_FAIL_RANK": "1"})
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert rc == 1
    assert took < 60, f"took {took:.0f} s"
    last = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert last and "rank 1" in last[-1] and "injected failure (K3SCHED_FAIL_RANK=1)" in last[-1], err[-2000:]
    assert "task s1/" in last[-1]
    assert not procs_with(str(tmp_path)), "processes left behind"


def test_comm_lane_perturbation_fails_fast_naming_the_mismatch(tmp_path, capfd):
    # swapping the collective lane's first two tasks (act.send mb0, mb1) on rank 0 only breaks
    # the order stage 1 receives in: the start-up check names it before any step runs
    rc = _run(tmp_path, ["parallel.pp=2", "parallel.ep=1", "parallel.microbatches=2", "model.seq_len=16",
                         "model.micro_batch_size=1"], 1, env={"K3SCHED_PERTURB": "collective:0@0"})
    err = capfd.readouterr().err
    assert rc == 1
    line = [ln for ln in err.splitlines() if ln.startswith("error: ")][-1]
    assert "pp group: transfer #0 from stage" in line, err[-2000:]
    assert not procs_with(str(tmp_path))


def test_user_error_exits_2_before_launch(tmp_path, capfd):
    assert _run(tmp_path, ["parallel.ep=3"], 1) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "parallel.ep" in err[0]
    assert not list(tmp_path.iterdir())
    assert run_command(TINY, [], 1, 3, tmp_path, False, None) == 2
    assert "needs pp*ep*dp" in capfd.readouterr().err


@pytest.mark.skipif(__import__("shutil").which("nsys") is None, reason="needs nsys (Debian nsight-systems)")
def test_nsys_records_one_nvtx_range_per_task_on_the_lane_threads(tmp_path, capfd):
    from traces.nsys import read_nsys_sqlite

    rc = run_command(TINY, EP2, 1, None, tmp_path, True, None, timeout_s=LIMIT_S, quiet=True)
    err = capfd.readouterr().err
    if rc != 0 and "nsys profile hung on all" in err:
        pytest.skip("nsys 2022.4 itself hung on every attempt: " + err.strip().splitlines()[-1])
    assert rc == 0, err[-2000:]
    table = read_nsys_sqlite(tmp_path / "profile.sqlite")
    plan = json.loads((tmp_path / "plan.json").read_text())
    planned = {t["id"]: lane for lane, ts in plan["stages"][0]["lanes"].items() for t in ts}
    for rank in range(2):
        trace = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        tid_of = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        names = [str(n) for n, t in zip(table.name, table.tid) if int(t) in tid_of.values()]
        assert sorted(names) == sorted(planned)  # each task once, pushed on a lane thread of this rank
        for n, t in zip(table.name, table.tid):
            if int(t) in tid_of.values():
                assert tid_of[planned[str(n)]] == int(t)


def test_serial_run_is_serial_on_every_rank_and_trains_like_k3(tiny_run, tmp_path):
    """The serial baseline runs one task at a time per rank (PP 2 x EP 2: sends wait for their
    receipt), and computes what the co-schedule computes."""
    from test_runtime_executor import overlapping_pairs  # tests/ is on sys.path (rootdir conftest)

    assert run_command(TINY, [], 2, None, tmp_path, False, "serial", timeout_s=LIMIT_S, quiet=True) == 0
    for rank in range(4):
        trace = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        assert overlapping_pairs(trace) == [], f"rank {rank}"
    k3 = json.loads((tiny_run / "summary.json").read_text())["losses"][:2]
    assert json.loads((tmp_path / "summary.json").read_text())["losses"] == pytest.approx(k3, rel=1e-6, abs=0)
