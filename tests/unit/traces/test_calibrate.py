"""Calibration ([Note: calibration] in traces/calibrate.py): fitting a profile from traces,
the ``k3sched calibrate`` command, and the end-to-end claim on the shaped-link testbed: a profile
fitted from one run predicts the measured step time of other configs within 10%."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from traces.calibrate import Fit, fit_profile, write_profile
from k3sched.cli import app
from k3sched.profile import load_profile
from traces import synth
from traces.chrome import table_from_runtime

REPO = Path(__file__).resolve().parents[3]
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


def test_a_kind_costs_its_mean_not_its_median():
    """[Note: mean, not median]: a step adds task durations, so a right-skewed kind is charged its mean."""
    plan, _ = _synthetic()
    events = synth.trace_from_plan(plan, rank_of_stage={0: [0, 1], 1: [2, 3]})
    slow = [e for e in events if e.get("ph") == "X" and e["name"].endswith("attn.fwd")]
    slow[0]["dur"] *= 4  # one of the 8 attn.fwd instances preempted: 400 us instead of 100
    fit = fit_profile(plan, table_from_runtime(events))
    assert fit.durations_us["attn.fwd"] == pytest.approx((7 * 100.0 + 400.0) / 8)
    assert fit.durations_us["expert.fwd"] == pytest.approx(100.0)


def test_receive_cost_excludes_waiting_for_the_send_and_collective_cost_carries_the_typical_wait():
    plan, _ = _synthetic()
    ev = synth.trace_from_plan(plan, rank_of_stage={0: [0, 1], 1: [2, 3]})
    for r in (2, 3):
        ev = synth.post_early(ev, "s1/mb0/v0/act.recv", "s0/mb0/v0/act.send", by_us=500.0, rank=r)
    # rank 1 enters dispatch 300 us late: rank 0's dispatch waited 300 us; the cost is the median
    # over the ranks (here the mean of 340 and 40): the typical wait is part of a synchronising task
    for e in ev:
        if e.get("name") == "s0/mb0/L0/dispatch.fwd":
            if e["pid"] == 1:
                e["ts"] += 300.0
            else:
                e["dur"] += 300.0
    fit = fit_profile(plan, table_from_runtime(ev))
    assert fit.task_cost_us["s1/mb0/v0/act.recv"] == pytest.approx(30.0)   # from the send's end
    assert fit.task_cost_us["s0/mb0/L0/dispatch.fwd"] == pytest.approx(190.0)
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


SMALL = ["parallel.pp=1", "parallel.ep=2", "model.hidden=128", "model.expert_hidden=256", "model.dense_hidden=512",
         "model.seq_len=128", "model.micro_batch_size=4", "parallel.microbatches=4", "hardware.gpus_per_node=1",
         "schedule.offload=none", "hardware.cpu_runner.host_cores=2", "hardware.internode_gbps=0.025",
         "hardware.device_memory_gb=2"]
BOUND = 0.30  # |measured / predicted - 1| of the source; of a target, relative to the source (docstring)
TARGETS = {"microbatches x2": ["parallel.microbatches=8"], "serial": ["schedule.strategy=serial"],
           "pp 2 x ep 1": ["parallel.pp=2", "parallel.ep=1"], "half link rate": ["hardware.internode_gbps=0.0125"]}


@pytest.mark.parametrize("model_extra", [[], ["hardware.cpu_runner.comm_cpu_us_per_call=300", "model.routing_imbalance=1.2"],
                                         ["hardware.cpu_runner.comm_wait_us_per_call=1500"]],
                         ids=["per-byte", "per-call-and-routing-imbalance", "transfers-wait-beside-compute"])
def test_calibration_inverts_the_cost_model_and_transfers_to_four_other_configs(tmp_path, model_extra):
    """[Note: calibration] is the inverse of the cost model: the ideal trace of a plan made with a
    known profile (link latency and efficiency per lane, CPU cost per transferred byte) calibrates to
    that profile, and the fitted profile predicts the four targets of the shaped-link test as the
    known one plans them, within 1%. Also with a CPU cost per call and a routing imbalance in the
    source's config, which the fit must divide out of what it measured (the expert ops' busiest-rank
    factor, the calls' share of the compute stretch), not count twice; and with a wait of transfers
    beside compute ([Note: a transfer beside compute]), which the fit takes out of their costs.
    Deterministic; the measured counterpart is the next test."""
    import json

    from k3sched import planfile
    from k3sched.config import load_config
    from k3sched.planner import plan

    truth = tmp_path / "truth.yaml"
    truth.write_text("format: k3sched.profile/1\nlatency_us: {ep: 700.0, collective: 300.0}\n"
                     "link_efficiency: {ep: 0.6, collective: 0.8}\n")
    source = SMALL + ["hardware.cpu_runner.comm_cpu_ns_per_byte=5", f"schedule.profile={truth}"] + model_extra
    pj = json.loads(planfile.dumps_plan(plan(load_config(TINY, source))))
    table = table_from_runtime(synth.trace_from_plan(pj, rank_of_stage={0: [0, 1]}))
    fit = fit_profile(pj, table)
    # the plan's (the probe's) is the least slope; the regression finds about the one the trace was made with
    assert fit.comm_cpu_ns_per_byte >= 5.0 and fit.comm_cpu_fitted == (fit.comm_cpu_ns_per_byte > 5.0)
    # a plan without a measured cost per byte: the regression finds the one the trace was made with
    blind = json.loads(json.dumps(pj))
    blind["config"]["hardware"]["cpu_runner"]["comm_cpu_ns_per_byte"] = 0.0
    refit = fit_profile(blind, table)
    assert refit.comm_cpu_fitted and refit.comm_cpu_ns_per_byte == pytest.approx(5.0, rel=0.1)
    # with the wait beside compute the plan's transfer durations carry the compute share of the schedule
    # before the last ([Note: CPU cost of communication]'s two rounds), the fit takes out the share of
    # the trace's (the last one's): the gradient reductions' latency (2 ring steps, 3 ms of wait at
    # most against 0.6 ms of latency) is off by up to 15%, the targets still within 1%
    waits = any(x.startswith("hardware.cpu_runner.comm_wait_us_per_call") for x in model_extra)
    assert fit.latency_us["ep"] == pytest.approx(700.0, rel=0.01 if waits else 1e-3)
    assert fit.latency_us["collective"] == pytest.approx(300.0, rel=0.15 if waits else 1e-3)
    assert fit.link_efficiency == pytest.approx({"ep": 0.6, "collective": 0.8}, rel=0.005 if waits else 1e-3)
    assert fit.comm_cpu_ns_per_byte == pytest.approx(5.0, rel=0.1)
    fitted = write_profile(fit, tmp_path / "fitted.yaml")
    for name, extra in {"source": [], **TARGETS}.items():
        known = plan(load_config(TINY, source + extra)).metrics.step_time_us
        predicted = plan(load_config(TINY, source + extra + [f"schedule.profile={fitted}"])).metrics.step_time_us
        assert predicted == pytest.approx(known, rel=0.01), name


def test_cpu_steal_slope_is_the_runs_own_bounded_by_the_operator_profile_and_the_probes():
    """The CPU cost per transferred byte is the least-squares slope of the compute spans on the
    bytes their rank's transfers moved beside them, one base per kind, after the EP tasks' host work
    is taken out; a slope that would leave the ops, together, faster than the operator profile
    measured them with every core busy is lowered to the largest that does not (a kind in no
    operator profile, optim.run, neither blocks nor moves that bound); the plan's cost per byte (the
    probe's) is the least slope ([Note: calibration], ``_cpu_steal``)."""
    from traces.calibrate import _cpu_steal
    from k3sched.config import load_config
    from k3sched.cost import CostModel
    from k3sched.tasks import Kind

    model = CostModel(load_config(TINY, SMALL))
    tasks = {"c": {"kind": "attn.fwd", "lane": "compute", "bytes": 0},
             "x": {"kind": "dispatch.fwd", "lane": "ep", "bytes": 1000}}
    occ = {}
    overlaps = (0.0, 100.0, 200.0, 400.0)  # µs of the transfer inside the compute span
    for k, overlap in enumerate(overlaps):
        occ[(0, "c", k)] = (0.0, 1000.0 + 20.0 * overlap)      # 20 µs of span per µs of overlap
        occ[(0, "x", k)] = (1000.0 + 20.0 * overlap - overlap, 1000.0 + 20.0 * overlap - overlap + 400.0)
    _, host_us = model.cpu.comm_cpu_load(Kind.DISPATCH_FWD, 1000)  # the EP task's host work, taken out first
    bytes_in = [2000.0 * ov / 400.0 for ov in overlaps]        # 2 x 1000 bytes over 400 µs
    spans = [1000.0 + 20.0 * ov for ov in overlaps]
    free, steal = _cpu_steal(occ, tasks, model)
    assert free == pytest.approx((20.0 - host_us / 400.0) * 400.0 / 2000.0 * 1e3)  # the regression
    assert all(s - steal[(0, "c", k)] == pytest.approx(1000.0) for k, s in enumerate(spans))  # the base
    floored, steal = _cpu_steal(occ, tasks, model, {"attn.fwd": 2000.0})
    assert floored == pytest.approx((sum(spans) - host_us / 400.0 * 700.0 - 4 * 2000.0) / sum(bytes_in) * 1e3)
    assert floored < 0.9 * free
    assert sum(s - steal[(0, "c", k)] for k, s in enumerate(spans)) == pytest.approx(4 * 2000.0)
    # a kind without a floor (optim.run is in no operator profile) neither blocks nor moves the bound
    tasks["o"] = {"kind": "optim.run", "lane": "compute", "bytes": 0}
    occ.update({(0, "o", k): (5e4, 5e4 + 300.0 + 10.0 * k) for k in range(4)})
    assert _cpu_steal(occ, tasks, model, {"attn.fwd": 2000.0})[0] == pytest.approx(floored)
    # a cost per byte the plan already has (the probe measured it beside a GEMM loop) is the least
    # slope, also against the floor: the run's ops may lose more to a transfer than the probe's GEMM, never less
    assert _cpu_steal(occ, tasks, model, {"attn.fwd": 2000.0}, known_ns=0.5 * floored)[0] == pytest.approx(floored)
    least, steal = _cpu_steal(occ, tasks, model, {"attn.fwd": 2000.0}, known_ns=2.0 * floored)
    assert least == pytest.approx(2.0 * floored)
    for k, (ov, b) in enumerate(zip(overlaps, bytes_in)):
        assert steal[(0, "c", k)] == pytest.approx(2.0 * floored * 1e-3 * b + host_us / 400.0 * ov)


@pytest.mark.slow
def test_calibration_from_one_run_predicts_four_other_configs_on_shaped_links(tmp_path):
    """[Note: calibration] on measured runs: a profile fitted from one run (k3, PP 1 x EP 2, on the
    shaped-link testbed) predicts how the measured step changes for four other configs: twice the
    micro-batches, the serial plan, PP 2 x EP 1, half the link rate. The compute side starts from
    the probe's operator profile and the CPU cost per byte measured in the testbed (``k3sched
    probe``'s measurements); nothing is fitted to the target runs.

    What is checked is each target's prediction relative to the source's (measured target / the mean
    of the source runs just before and after it, against predicted target / predicted source:
    [Note: bracketed transfer] in runtime/transfer.py), within ``BOUND``, and the fit's residual on
    the source within ``BOUND``: the planner exists to compare configs and schedules, and the
    source's residual (+8 to +15% in CI's runs on record) is shared by every run of the machine
    of the moment. The absolute goal, 10%, is tracked by ``benchmarks/bench_overlap.py`` (README).
    This 2-core machine's identical runs drift 5-20% within minutes (the source runs beside each
    target cancel its linear part), so a new measurement is taken when one misses, two tries at
    most (as many runs as three tries without the source runs between). A wrong model misses by more: per-kind durations for communication
    miss half the link rate by about 50%. Worst on record (CI, a fitted CPU-steal slope with no
    working bound in ``_cpu_steal``): PP 2 x EP 1 at x1.24-1.33 of the source's. Against the source's
    first run alone, PP 2 x EP 1 once measured x0.677 of the source's while the source's second run
    measured 0.843 of its first (the machine faster during the targets: against a linear drift,
    about x0.77). With the slope fitted between the floors and the probe's and the source runs
    between, two runs, each passed at its first try (118-121 s): x1.103, x0.906, x0.856, x0.996 of
    the source's beside each (9.1 ns per byte), and, before the floors counted, x0.896, x1.070,
    x1.006, x0.969 (8.1 ns). With the compute-alone factor measured beside (0.993 at this config's
    small ops; 0.834 at the bench's): x1.088, x0.893, x0.722, x0.876, first try, 136 s."""
    from runtime.testbed import Testbed, testbed_available

    why = testbed_available()
    if why:
        pytest.skip(f"the shaped-link testbed is not available: {why}")
    from k3sched.config import load_config
    from runtime.probe import (comm_cpu_ns_per_byte, compute_alone_factor, measure_collectives,
                               measure_ops_concurrent, per_expert_slopes, write_ops_profile)
    from runtime.transfer import SOURCE_AGAIN, transfer_check

    cfg = load_config(TINY, SMALL)
    fewer: list = []  # with one EP rank's experts, around the one-copy round ([Note: per-expert cost])
    alone, ops = compute_alone_factor(cfg, 2, measure_ops_concurrent(cfg, 2, work_dir=tmp_path / "ops"),
                                      work_dir=tmp_path / "ops", fewer=fewer)  # [Note: compute alone]: PP 2 x EP 1
    per_expert = per_expert_slopes(cfg, ops, fewer)
    ops = write_ops_profile(ops, tmp_path / "ops.yaml", per_expert)
    coll = measure_collectives(2, sizes=[1 << 20, 4 << 20], reps=2, testbed=Testbed(cfg.hardware, 2),
                               work_dir=tmp_path / "coll")
    source = SMALL + [f"schedule.profile={ops}", f"hardware.cpu_runner.comm_cpu_ns_per_byte={comm_cpu_ns_per_byte(coll):.4g}",
                      f"hardware.cpu_runner.compute_alone_factor={alone:.4g}"]
    attempts = []
    for attempt in range(2):  # a new measurement only when the last missed (load outside the test)
        d = tmp_path / f"try{attempt}"
        residual, rows, _ = transfer_check(TINY, source, TARGETS, 4, d, bracket=True)
        assert [r.name for r in rows] == [*TARGETS, SOURCE_AGAIN]
        again = rows.pop()  # the source config's last run, after the last target: predicted as the source
        runs = [json.loads((d / name / "summary.json").read_text())["measured_step_time_us"]
                for name in ["source", *(f"source_after_{i + 1}" for i in range(len(TARGETS)))]]
        assert again.predicted_us == pytest.approx(runs[0] / (1 + residual)) and again.measured_us == runs[-1]
        for i, r in enumerate(rows):  # each target against the mean of the source runs just before and after it
            assert r.source_around_us == pytest.approx((runs[i] + runs[i + 1]) / 2)
            assert r.bracketed_ratio == pytest.approx(r.ratio / (r.source_around_us / again.predicted_us))
        fitted = load_profile(d / "profile.yaml")
        relative = {r.name: r.bracketed_ratio for r in rows}
        info = (f"source residual {residual:+.3f} (CPU per byte {fitted.comm_cpu_ns_per_byte} ns, alone x{alone:.3f}, "
                f"per expert {per_expert}; "
                f"the source's runs "
                + " ".join(f"x{m / runs[0]:.3f}" for m in runs[1:]) + " of its first); " + "; ".join(
            f"{r.name}: predicted {r.predicted_us / 1e3:.0f} ms, measured {r.measured_us / 1e3:.0f} ms "
            f"(x{r.ratio:.3f}, x{r.ratio / (1 + residual):.3f} of the source's first, x{relative[r.name]:.3f} "
            f"of the source's beside it)" for r in rows))
        print(info)
        attempts.append(info)
        assert len(rows) == 4
        if abs(residual) <= BOUND and all(abs(v - 1) <= BOUND for v in relative.values()):
            break
    assert abs(residual) <= BOUND, " | ".join(attempts)
    assert all(abs(v - 1) <= BOUND for v in relative.values()), " | ".join(attempts)
