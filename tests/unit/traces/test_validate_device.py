"""Validation on the GPU timeline ([Note: device timeline] in traces/validate.py): synthetic Nsight
SQLite exports and Kineto traces with kernels (and memcpys) on one stream per lane. A fault whose
host order is right but whose device order is not is caught only on the device clock; the host
check (``clock="host"``, or the ranges alone) passes it."""

import json

import pytest

from traces import synth
from traces.chrome import read_trace
from traces.cli import validate_main
from traces.nsys import read_nsys_sqlite
from traces.schema import load_report
from traces.validate import validate

PLAN = synth.small_plan()
TASK = {t["id"]: t for t in synth.plan_tasks(PLAN)}
ATTN_FWD0 = "s0/mb0/L0/attn.fwd"
DISPATCH0 = "s0/mb0/L0/dispatch.fwd"
EXPERT_FWD0 = "s0/mb0/L0/expert.fwd"
EXPERT_DW1, ATTN_DW1 = "s0/mb1/L0/expert.dw", "s0/mb1/L0/attn.dw"


def _trace(tmp_path, fmt, **kw):
    """The event table of an ideal run with 3 GPU events per task, faults from ``kw``."""
    if fmt == "nsys":
        p = tmp_path / "run.sqlite"
        synth.nsys_sqlite(p, PLAN, kernels_per_task=3, **kw)
        return read_nsys_sqlite(p), [p]
    paths = []
    for s in (0, 1):
        p = tmp_path / f"kineto{s}.json"
        p.write_text(json.dumps(synth.kineto_trace(PLAN, s, kernels_per_task=3, **kw)))
        paths.append(p)
    from traces.events import EventTable
    return EventTable.concat([read_trace(p) for p in paths]), paths


def _ranges_only(t):
    return t.take(t.kind == "range")


def _swap_shift(a, b):
    d = TASK[b]["start_us"] - TASK[a]["start_us"]
    return {a: d, b: -d}


def test_ids_exist():
    for i in (ATTN_FWD0, DISPATCH0, EXPERT_FWD0, EXPERT_DW1, ATTN_DW1):
        assert i in TASK
    assert TASK[EXPERT_DW1]["lane"] == TASK[ATTN_DW1]["lane"] == "compute"
    assert TASK[EXPERT_DW1]["start_us"] < TASK[ATTN_DW1]["start_us"]


@pytest.mark.parametrize("fmt", ["nsys", "kineto"])
def test_ideal_device_trace_conforms_on_device(tmp_path, fmt):
    t, paths = _trace(tmp_path, fmt)
    assert set(t.kind.tolist()) >= {"range", "kernel", "nccl"}
    rep = validate(PLAN, t)
    assert rep.conforms, rep.render()
    n = len(TASK)
    assert rep.clock == "device" and rep.metrics["clock_counts"] == {"device": n, "host": 0}
    dev = rep.metrics["device"]
    assert dev["joined_events"] == dev["gpu_events"] == 3 * n and dev["wrong_stream_events"] == 0
    # one stream per lane per rank, inferred like the thread mapping
    for r in (0, 1):
        streams = dev["lane_stream"][r]
        assert len(set(streams.values())) == len(streams) >= 2
        assert streams["compute"] == 7
        # NCCL kernels run on the communicator's stream on real GPUs: not stream-checked
        assert "ep" not in streams and "collective" not in streams
    assert dev["nccl_events_not_stream_checked"] > 0
    doc = rep.to_json()
    assert doc["clock"] == "device" and doc["metrics"]["clock"] == "device"
    assert "clock: device (58 task instances" in rep.render()
    # through the CLI: the JSON report carries the clock and follows the report schema
    out = tmp_path / "rep.json"
    assert validate_main(_plan_file(tmp_path), [str(p) for p in paths],
                         json_out=str(out), out=open(tmp_path / "txt", "w")) == 0
    assert load_report(out).clock == "device"


def _plan_file(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(PLAN))
    return str(p)


@pytest.mark.parametrize("fmt", ["nsys", "kineto"])
def test_swapped_on_device_caught_only_by_device_check(tmp_path, fmt):
    t, _ = _trace(tmp_path, fmt, kernel_shift_us=_swap_shift(EXPERT_DW1, ATTN_DW1))
    host = validate(PLAN, t, clock="host")
    assert host.conforms and host.clock == "host", host.render()
    assert validate(PLAN, _ranges_only(t)).conforms
    rep = validate(PLAN, t)
    assert not rep.conforms and rep.clock == "device"
    order = rep.by_type("order")
    assert order and {v.task_id for v in order} <= {EXPERT_DW1, ATTN_DW1}, rep.render()
    assert all(v.rank == 0 and "on device" in v.detail for v in order)
    assert {v.type for v in rep.violations} <= {"order", "dependency"}, rep.render()


@pytest.mark.parametrize("fmt", ["nsys", "kineto"])
def test_missing_stream_wait_caught_only_by_device_check(tmp_path, fmt):
    # the ep stream runs dispatch.fwd late; expert.fwd's kernels (compute stream) do not wait
    # for it: the host launched expert.fwd after dispatch.fwd's range ended, as planned
    t, _ = _trace(tmp_path, fmt, kernel_shift_us={DISPATCH0: 60.0})
    assert validate(PLAN, t, clock="host").conforms
    assert validate(PLAN, _ranges_only(t)).conforms
    rep = validate(PLAN, t)
    assert {v.type for v in rep.violations} == {"dependency"}, rep.render()
    (v,) = rep.violations
    assert v.task_id == EXPERT_FWD0 and v.rank == 0 and DISPATCH0 in v.detail and "on device" in v.detail
    assert v.magnitude_us > 20
    # within tolerance it passes
    assert validate(PLAN, t, tolerance_us=v.magnitude_us + 1).conforms


@pytest.mark.parametrize("fmt", ["nsys", "kineto"])
def test_kernels_on_another_lanes_stream_reported(tmp_path, fmt):
    t, _ = _trace(tmp_path, fmt, kernel_lane={ATTN_FWD0: "offload_local"})
    assert validate(PLAN, t, clock="host").conforms
    rep = validate(PLAN, t)
    wrong = rep.by_type("wrong_lane")
    assert [v.task_id for v in wrong] == [ATTN_FWD0], rep.render()
    assert "3 of its 3 GPU events ran on stream 10 (lane offload_local)" in wrong[0].detail
    assert "planned lane compute (stream 7)" in wrong[0].detail
    assert rep.metrics["device"]["wrong_stream_events"] == 3


def test_nccl_kernels_are_not_stream_checked(tmp_path):
    # ProcessGroupNCCL runs collectives on its own stream: an ep task's NCCL kernels on the
    # compute stream are no wrong_lane
    t, _ = _trace(tmp_path, "nsys", kernel_lane={DISPATCH0: "compute"})
    rep = validate(PLAN, t)
    assert rep.conforms, rep.render()


def test_two_lanes_on_one_stream_is_a_lane_mapping_violation(tmp_path):
    shared = {i: "compute" for i, t in TASK.items() if t["lane"] == "offload_local" and t["stage"] == 0}
    t, _ = _trace(tmp_path, "nsys", kernel_lane=shared)
    rep = validate(PLAN, t)
    lm = rep.by_type("lane_mapping")
    assert len(lm) == 1 and lm[0].rank == 0 and "stream 7" in lm[0].detail, rep.render()
    assert not rep.by_type("wrong_lane")


def test_host_fallback_and_mixed_clock(tmp_path):
    # a runtime trace (no GPU events): host clock
    rep = validate(PLAN, read_trace(_runtime_file(tmp_path)), only_traced_stages=True)
    assert rep.conforms and rep.clock == "host", rep.render()
    assert rep.metrics["clock_counts"] == {"device": 0, "host": sum(t["stage"] == 0 for t in TASK.values())}
    # a task without GPU events: its (rank, lane) falls back to host ranges, the rest stays on device
    t, _ = _trace(tmp_path, "nsys")
    t = t.take(~((t.kind != "range") & (t.parent == ATTN_FWD0)))
    rep = validate(PLAN, t)
    assert rep.conforms and rep.clock == "mixed", rep.render()
    n_host = sum(x["stage"] == 0 and x["lane"] == "compute" for x in TASK.values())
    assert rep.metrics["clock_counts"] == {"device": len(TASK) - n_host, "host": n_host}
    assert "clock: mixed" in rep.render()
    # random kernels (some tasks without any) still conform
    p = tmp_path / "few.sqlite"
    synth.nsys_sqlite(p, PLAN, 40)
    assert validate(PLAN, read_nsys_sqlite(p)).conforms
    with pytest.raises(ValueError):
        validate(PLAN, read_nsys_sqlite(p), clock="gpu")


def _runtime_file(tmp_path):
    from traces.synth import runtime_trace_files, trace_from_plan

    files = runtime_trace_files(trace_from_plan(PLAN), PLAN)
    p = tmp_path / "trace_rank0.json"
    p.write_text(json.dumps(files[0]))
    return p


def test_overlap_metrics_on_device_times(tmp_path):
    # kernels covering [0.2, 0.8] of each range: measured busy time is the device time
    t, _ = _trace(tmp_path, "kineto")
    dev, host = validate(PLAN, t), validate(PLAN, t, clock="host")
    b_dev = dev.metrics["measured_by_rank"][0]["busy_us"]["compute"]
    b_host = host.metrics["measured_by_rank"][0]["busy_us"]["compute"]
    assert b_dev < b_host
    assert b_host == pytest.approx(sum(x["end_us"] - x["start_us"] for x in TASK.values()
                                       if x["stage"] == 0 and x["lane"] == "compute"))


def test_repeated_steps_keep_each_instance_own_gpu_events(tmp_path):
    # two steps of one rank: the second step's kernels are not folded into the first's span
    from traces.events import EventTable

    tabs = []
    for k, t0 in enumerate((1_000_000.0, 1_010_000.0)):
        p = tmp_path / f"step{k}.json"
        p.write_text(json.dumps(synth.kineto_trace(PLAN, 0, kernels_per_task=2, t0_us=t0)))
        tabs.append(read_trace(p))
    rep = validate(PLAN, EventTable.concat(tabs), only_traced_stages=True)
    n0 = sum(t["stage"] == 0 for t in TASK.values())
    assert rep.conforms and rep.clock == "device", rep.render()
    assert rep.metrics["repeated_instances"] == n0
    assert rep.metrics["device"]["joined_events"] == 2 * n0
    assert rep.metrics["step_time_us"]["measured"] < 10_000


def test_report_schema_clock(tmp_path):
    from traces.schema import SchemaError, check_report

    t, _ = _trace(tmp_path, "kineto")
    doc = validate(PLAN, t).to_json()
    old = {k: v for k, v in doc.items() if k != "clock"}  # a report written before the field
    assert check_report(old).clock is None
    with pytest.raises(SchemaError, match="clock"):
        check_report({**doc, "clock": "host"})
    with pytest.raises(SchemaError, match="clock"):
        check_report({**doc, "clock": "gpu"})


def test_cli_clock_option(tmp_path):
    """``k3sched validate --clock host`` checks host ranges only (the device fault passes, exit 0);
    the default catches it (exit 1); a bad value is one line, exit 2."""
    from typer.testing import CliRunner

    from k3sched.cli import app

    _, paths = _trace(tmp_path, "nsys", kernel_shift_us=_swap_shift(EXPERT_DW1, ATTN_DW1))
    args = ["validate", "--plan", _plan_file(tmp_path), *map(str, paths)]
    assert CliRunner().invoke(app, args + ["--clock", "host"]).exit_code == 0
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and "on device" in res.output
    res = CliRunner().invoke(app, args + ["--clock", "gpu"])
    assert res.exit_code == 2 and "--clock" in res.output
