"""Race detector ([Note: race detector] in runtime/racecheck.py) and cross-lane hand-off.

- the detector on hand-built two-lane steps: a shared buffer with and without the edge, disjoint
  byte ranges, a pool buffer's two lives, a consumer that fails on a cell its dropped producer
  never filled (a race line, not a traceback);
- ``moe.handoff.handoff``: a no-op on CPU, ``record_stream`` per consuming stream on CUDA (a
  stand-in tensor); the device pool gets the compute stream;
- one-rank steps in this process (k3, serial, offload, FP8, sharded gradients): clean, and the
  detector changes no number;
- the known race (shared.dx and dispatch.bwd adding into one input-gradient buffer from two
  lanes): with the plan order that leaves them unordered, the detector names both tasks when the
  fix is switched off (``K3SCHED_UNSAFE_SHARED_DX=1``), and the fixed runtime is clean and gives
  the same numbers;
- ``k3sched run --racecheck`` under torchrun: PP2 x EP2 with remote offload clean (its one
  line), the known race without the fix, a dropped edge caught naming both tasks, a bad
  ``--drop-dep`` refused before launch.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from k3sched.config import load_config
from k3sched.lowering import implied_edges
from k3sched.planner import plan
from k3sched.planfile import plan_to_json
from k3sched.tasks import Kind
from moe import handoff
from k3sched.lowering import stage_lanes
from runtime.executor import Executor, PlanTask, TaskError
from runtime.groups import Layout, build_groups
from runtime.launch import run_command
from runtime.racecheck import (RaceChecker, apply_drops, check_drops, clean_line, parse_drop, same_stage_deps)
from runtime.options import UNSAFE_SHARED_DX_ENV, RuntimeOptions
from runtime.stage import StageRunner, StageSpec

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.yaml"
LIMIT_S = 150.0
SMALL = ["model.seq_len=16", "model.micro_batch_size=1", "model.layers=2"]
ONE = ["parallel.pp=1", "parallel.ep=1", *SMALL]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -- hand-built steps --------------------------------------------------------------------------------
A = "s0/mb0/L0/attn.fwd"
B = "s0/mb0/L0/dispatch.fwd"
S = "s0/mb0/L0/router.fwd"


def _step(lanes: dict, handlers: dict, planned: dict | None = None):
    """Run one step of ``lanes`` under a checker; returns (its report, the step's error or None)."""
    ex = Executor(lanes, handlers, perturb=None, nvtx=False, dep_timeout_s=30.0)
    rc = ex.racecheck = RaceChecker.for_executor(ex, planned)
    err = None
    with ex, rc.installed():
        rc.begin_step(0)
        try:
            ex.run_step(0)
        except TaskError as e:
            err = e
        rep = rc.end_step(failed=err is not None)
    return rep, err


def _two_lanes(edge: bool) -> dict:
    a = PlanTask(A, Kind.ATTN_FWD, "compute", 0, 0, 0, 0)
    b = PlanTask(B, Kind.DISPATCH_FWD, "ep", 0, 0, 0, 0, deps=(A,) if edge else ())
    return {"compute": [a], "ep": [b]}


@pytest.mark.parametrize("edge", [True, False])
def test_a_shared_buffer_races_without_the_edge(edge):
    buf = torch.zeros(16)

    def writer(t):
        buf.add_(1.0)
        handoff.write(buf, "buf")

    rep, err = _step(_two_lanes(edge), {Kind.ATTN_FWD: writer, Kind.DISPATCH_FWD: lambda t: handoff.read(buf, "buf")})
    assert err is None and rep.storages == 1 and rep.accesses == 2
    if edge:
        assert rep.races == []
    else:
        (race,) = rep.races
        line = race.line()
        assert line.startswith("race: ") and A in line and B in line and "buf" in line and "\n" not in line
        assert {race.a_lane, race.b_lane} == {"compute", "ep"}


def test_disjoint_bytes_of_one_storage_and_a_pool_buffers_two_lives_do_not_race():
    buf = torch.zeros(16)

    def writer(t):
        handoff.write(buf[:8], "low half")
        handoff.fresh(buf, "pool buffer handed out again")

    def other(t):
        time.sleep(0.05)  # after the writer's fresh(): a new life of the buffer
        handoff.write(buf[8:], "high half")

    def reader_of_the_new_life(t):
        time.sleep(0.05)
        handoff.read(buf, "new life")

    rep, _ = _step(_two_lanes(False), {Kind.ATTN_FWD: writer, Kind.DISPATCH_FWD: other})
    assert rep.races == []
    rep, _ = _step(_two_lanes(False), {Kind.ATTN_FWD: writer, Kind.DISPATCH_FWD: reader_of_the_new_life})
    assert rep.races == []


def test_an_unrecorded_in_place_write_to_a_handed_tensor_is_seen_through_its_version():
    t = torch.zeros(4)

    def sneaky(task):
        handoff.read(t, "t", handed=True)
        t.mul_(2.0)  # no write recorded: t._version moves

    def reader(task):
        time.sleep(0.05)
        handoff.read(t, "t")

    rep, _ = _step(_two_lanes(False), {Kind.ATTN_FWD: sneaky, Kind.DISPATCH_FWD: reader})
    (race,) = rep.races
    assert race.a == A and race.a_write and race.b == B and not race.b_write


def test_a_consumer_failing_on_a_cell_its_dropped_producer_never_filled_is_a_race():
    """C (compute) needs P (ep, behind a slow task); the edge is dropped: C reads the empty cell
    and fails, the step aborts before P runs. The verdict blames P, not a traceback."""
    box: dict = {}
    gate = threading.Event()

    def slow(t):
        gate.wait(5.0)

    def producer(t):
        box["x"] = torch.ones(4)
        handoff.cell(box, "x", True, "box.x")

    def consumer(t):
        v = box.get("x")
        handoff.cell(box, "x", False, "box.x", v is not None)
        try:
            v.sum()
        finally:
            gate.set()

    c = PlanTask(A, Kind.ATTN_FWD, "compute", 0, 0, 0, 0)
    s = PlanTask(S, Kind.ROUTER_FWD, "ep", 0, 0, 0, 0)
    p = PlanTask(B, Kind.DISPATCH_FWD, "ep", 0, 0, 0, 0)
    rep, err = _step({"compute": [c], "ep": [s, p]},
                     {Kind.ATTN_FWD: consumer, Kind.ROUTER_FWD: slow, Kind.DISPATCH_FWD: producer},
                     planned={A: (B,)})
    assert err is not None and err.task_id == A
    (race,) = rep.races
    assert race.kind == "missing" and race.line() == (f"race: {A} (compute) read box.x before {B} (ep) wrote it; "
                                                      "no happens-before path between them")


def test_drop_dep_specs_are_checked():
    deps = {A: (S,), B: ()}
    assert check_drops([f"{A}={S}"], deps) == [(A, S)]
    for bad, msg in ((f"{A}", "expected CONSUMER=PRODUCER"), (f"s0/mb9/L0/attn.fwd={S}", "the plan has no task"),
                     (f"{A}={B}", "does not wait for")):
        with pytest.raises(ValueError, match=msg):
            check_drops([bad], deps)
    t = PlanTask(A, Kind.ATTN_FWD, "compute", 0, 0, 0, 0, deps=(S, "s1/mb0/v0/act.send"))
    lanes, extra = apply_drops({"compute": [t]}, {A: (B,)}, [parse_drop(f"{A}={S}"), (A, B)])
    assert lanes["compute"][0].deps == ("s1/mb0/v0/act.send",) and extra[A] == ()
    assert same_stage_deps({"compute": [t]}, {A: (B,)}, 0) == {A: (S, B)}


# -- hand-off ------------------------------------------------------------------------------------------
class _FakeCudaTensor:
    is_cuda = True

    def __init__(self):
        self.recorded = []

    def record_stream(self, s):
        self.recorded.append(s)


def test_handoff_is_a_noop_on_cpu_and_records_each_consuming_stream_on_cuda():
    assert handoff.handoff(None) == 0 and handoff.handoff(torch.zeros(3)) == 0
    t = _FakeCudaTensor()
    s1, s2 = object(), object()
    assert handoff.handoff(t, [s1, None, s2, s1]) == 2
    assert t.recorded == [s1, s2]


def test_the_device_pool_allocates_on_the_compute_stream():
    cfg = load_config(TINY, ONE + ["parallel.microbatches=1"])
    groups = build_groups(Layout(1, 1, 1, 0))
    first, compute = object(), object()
    runner = StageRunner(cfg, StageSpec.of(cfg, 0), groups, compute_stream=first)
    assert runner.acts.device_pool.alloc_stream is first
    runner.bind_streams({"compute": compute, "ep": object()})
    assert runner.acts.device_pool.alloc_stream is compute and len(runner.offload.lane_streams) == 2
    runner.bind_streams({})  # CPU: no streams
    assert runner.acts.device_pool.alloc_stream is None and runner.offload.lane_streams == []


# -- one rank in this process ----------------------------------------------------------------------------
def _move_after(lanes: dict, lane: str, task: str, after: str) -> None:
    ts = lanes[lane]
    i = next(k for k, t in enumerate(ts) if t.id == task)
    t = ts.pop(i)
    j = next(k for k, t2 in enumerate(ts) if t2.id == after)
    ts.insert(j + 1, t)


def _local(overrides: list[str], *, strategy: str | None = None, steps: int = 1, reorder=None, check: bool = True,
           drops: tuple[str, ...] = (), unsafe_shared_dx: bool = False):
    """Train ``steps`` steps of the one-rank config in this process (what ``runtime.train`` does
    per rank), under the race detector when ``check``; returns (losses, grads of step 0, reports).
    A step that fails ends the run with its report (``failed``)."""
    cfg = load_config(TINY, ONE + overrides)
    doc = plan_to_json(plan(cfg, strategy))
    lanes = stage_lanes(doc, 0)
    runner = StageRunner(cfg, StageSpec.of(cfg, 0), build_groups(Layout(1, 1, 1, 0)), seed=cfg.schedule.seed,
                         options=RuntimeOptions(unsafe_shared_dx=unsafe_shared_dx))
    runner.bind_plan(lanes)
    if reorder:
        reorder(lanes)
    extra = implied_edges(lanes)
    planned = same_stage_deps(lanes, extra, 0)
    lanes, extra = apply_drops(lanes, extra, check_drops(drops, planned))
    ex = Executor(lanes, runner.handlers(), perturb=None, extra_deps=extra, dep_timeout_s=60.0,
                  serial=doc["strategy"] == "serial", shared_links=doc.get("shared_links", ()), nvtx=False)
    rc = RaceChecker.for_executor(ex, planned) if check else None
    ex.racecheck = rc
    losses, reports, grads = [], [], None
    with ex:
        if rc is not None:
            rc.install()
        try:
            for step in range(steps):
                runner.optim.capture_grads = step == 0
                runner.begin_step(step)
                if rc is not None:
                    rc.begin_step(step)
                try:
                    ex.run_step(step)
                    losses.append(runner.end_step())
                except Exception:
                    if rc is None:
                        raise
                    reports.append(rc.end_step(failed=True))
                    break
                grads = grads or runner.optim.captured
                if rc is not None:
                    reports.append(rc.end_step())
        finally:
            if rc is not None:
                rc.uninstall()
    return losses, grads, reports


@pytest.mark.parametrize("strategy, overrides", [
    ("k3", ["parallel.microbatches=2"]),
    ("serial", ["parallel.microbatches=2", "schedule.offload=all"]),
    ("k3", ["parallel.microbatches=2", "schedule.offload=all", "schedule.act_quant=fp8"]),
    ("k3", ["parallel.microbatches=2", "schedule.act_quant=fp8", "schedule.dispatch_recompute=true",
            "schedule.recompute=true"]),
    ("k3", ["parallel.microbatches=2", "schedule.grad_offload=true"]),
    ("k3", ["parallel.microbatches=2", "schedule.offload=none"]),
    ("serial", ["parallel.microbatches=2"]),
], ids=["k3", "serial-offload-all", "offload-all-fp8", "fp8-kept-recompute", "grad-offload", "offload-none",
        "serial"])  # offload auto (the config's), none, all here; remote on PP2xEP2 below
def test_one_rank_steps_are_clean_and_the_detector_changes_no_number(strategy, overrides):
    losses, grads, reports = _local(overrides, strategy=strategy, steps=2)
    for rep in reports:
        assert rep.races == [], rep.races[0].line()
        assert rep.storages > 0 and rep.accesses > rep.storages and rep.cell_accesses > 0
    plain_losses, plain_grads, _ = _local(overrides, strategy=strategy, steps=2, check=False)
    assert losses == plain_losses
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[k], plain_grads[k]) for k in grads)


def _shared_dx_after_expert_dx(lanes: dict) -> None:
    """A plan order the plan's edges allow: shared.dx after expert.dx on the compute lane, so
    nothing orders it with dispatch.bwd on the ep lane."""
    c = lanes["compute"]
    sdx = next(t.id for t in c if t.kind is Kind.SHARED_DX)
    _move_after(lanes, "compute", sdx, sdx.replace("shared.dx", "expert.dx"))


def test_the_shared_dx_dispatch_bwd_race_is_caught_without_the_fix_and_gone_with_it():
    over = ["parallel.microbatches=1"]
    unsafe_losses, unsafe_grads, (rep,) = _local(over, reorder=_shared_dx_after_expert_dx, unsafe_shared_dx=True)
    lines = [r.line() for r in rep.races]
    assert any("s0/mb0/L1/shared.dx (compute)" in ln and "s0/mb0/L1/dispatch.bwd (ep)" in ln
               and "grad_xn_TD" in ln for ln in lines), lines
    losses, grads, (rep,) = _local(over, reorder=_shared_dx_after_expert_dx)
    assert rep.races == [], rep.races[0].line()
    # partial sums summed by router.bwd: the very numbers of the one shared buffer
    assert losses == unsafe_losses and all(torch.equal(grads[k], unsafe_grads[k]) for k in grads)


# -- k3sched run --racecheck (torchrun) ------------------------------------------------------------------

def _run(out: Path, overrides: list[str], steps: int = 1, **kw) -> int:
    return run_command(TINY, overrides, steps, None, out, False, None, timeout_s=LIMIT_S, quiet=True, **kw)


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("error: ")]


@pytest.mark.slow
def test_run_racecheck_pp2_ep2_with_remote_offload_is_clean(tmp_path, capfd):
    over = ["parallel.microbatches=2", "model.seq_len=16", "model.micro_batch_size=1", "model.layers=3",
            "schedule.offload=remote", "schedule.device_memory_budget=0.004"]
    assert _run(tmp_path, over, racecheck=True) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world"] == 4 and summary["offloaded_sets"]["remote"] > 0
    rc = summary["racecheck"]
    assert rc["races"] == 0 and rc["storages"] > 0 and rc["accesses"] > 0
    out = capfd.readouterr().out
    assert clean_line(rc["storages"], rc["accesses"]) in out.splitlines()


@pytest.mark.slow
def test_run_racecheck_catches_the_shared_dx_race_without_the_fix(tmp_path, capfd):
    over = ONE + ["parallel.microbatches=1"]
    c = [t["id"] for t in plan_to_json(plan(load_config(TINY, over)))["stages"][0]["lanes"]["compute"]]
    i = next(k for k, t in enumerate(c) if t.endswith("/shared.dx"))
    assert c[i + 1] == c[i].replace("shared.dx", "expert.dx")  # K3SCHED_PERTURB=compute:i swaps the two
    rc = _run(tmp_path, over, racecheck=True, env={UNSAFE_SHARED_DX_ENV: "1", "K3SCHED_PERTURB": f"compute:{i}"})
    (line,) = _errors(capfd.readouterr().err)
    assert rc == 1 and "race: " in line and "s0/mb0/L1/shared.dx" in line and "s0/mb0/L1/dispatch.bwd" in line, line
    assert "grad_xn_TD" in line


@pytest.mark.slow
def test_run_racecheck_names_both_tasks_of_a_dropped_edge(tmp_path, capfd):
    over = ONE + ["parallel.microbatches=1"]
    rc = _run(tmp_path, over, racecheck=True, drop_deps=["s0/mb0/v0/head.fwd=s0/mb0/L1/combine.fwd"])
    (line,) = _errors(capfd.readouterr().err)
    assert rc == 1 and "race: " in line and "s0/mb0/v0/head.fwd (compute)" in line, line
    assert "s0/mb0/L1/combine.fwd (ep)" in line and "mb0.acts[2]" in line and "Traceback" not in line


def test_run_refuses_a_drop_dep_the_plan_does_not_have(tmp_path, capfd):
    rc = _run(tmp_path, ONE + ["parallel.microbatches=1"], racecheck=True,
              drop_deps=["s0/mb0/L1/attn.dx=s0/mb0/L0/attn.fwd"])
    (line,) = _errors(capfd.readouterr().err)
    assert rc == 2 and "--drop-dep s0/mb0/L1/attn.dx=s0/mb0/L0/attn.fwd" in line and "does not wait for" in line
    assert not (tmp_path / "summary.json").exists()
