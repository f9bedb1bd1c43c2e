"""Failures stop every rank, bounded by the ranks' --timeout (issue 10, part 4): gloo on CPU,
tiny shapes, PP 2 (2 ranks). A rank hanging in a receive no rank sends and a rank SIGKILLed in a
step each stop every rank within 60 s with one line naming the rank and its error, and leave no
process or torchrun log folder behind. A rank that raises: tests/unit/runtime/test_runtime_dist.py::
test_failing_rank_stops_every_rank_with_one_clear_line (one SIGKILLed while writing a checkpoint:
tests/unit/runtime/test_checkpoint.py). In-process: an executor whose lane fails before it is ready, or whose
task never returns, raises in bounded time instead of hanging."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from k3sched.tasks import Kind
from runtime.executor import Executor, PlanTask, TaskError
from runtime.launch import run_command

from conftest import procs_with

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.yaml"
PP2 = ["parallel.pp=2", "parallel.ep=1", "parallel.microbatches=2", "model.seq_len=16", "model.micro_batch_size=1"]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _fail_run(tmp_path: Path, env: dict, capfd) -> tuple[int, float, str, str]:
    before = _children()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    t0 = time.monotonic()
    rc = run_command(TINY, PP2, 2, None, tmp_path / "run", False, None, timeout_s=150.0, quiet=True, device="cpu",
                     env={"K3SCHED_TIMEOUT_S": "10", "TMPDIR": str(scratch), **env})
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert lines, err[-2000:]
    assert not procs_with(str(tmp_path)), "processes left behind"
    assert _children() <= before, "child processes left behind"
    # nor torchrun's log folder (a torchelastic_* folder per launch before runtime.launch gave it one)
    assert not [p.name for p in scratch.iterdir() if p.name.startswith(("torchelastic_", "k3sched_torchrun_"))]
    return rc, took, lines[-1], err


@pytest.mark.slow
def test_rank_hanging_in_a_collective_stops_every_rank(tmp_path, capfd):
    rc, took, line, err = _fail_run(tmp_path, {"K3SCHED_FAIL_RANK": "1", "K3SCHED_FAIL_SIGNAL": "HANG"}, capfd)
    assert rc == 1
    assert took < 60, f"took {took:.0f} s"
    # the hung rank names its own stuck task, or its peer names the transfer it waited 10 s for
    assert ("rank 1: task s1/" in line and "still running" in line) or ("rank " in line and "waited" in line) \
        or "rank " in line and "imed out" in line, err[-2000:]
    assert "run timed out" not in line


@pytest.mark.slow
def test_rank_killed_by_sigkill_stops_every_rank(tmp_path, capfd):
    rc, took, line, err = _fail_run(tmp_path, {"K3SCHED_FAIL_RANK": "1", "K3SCHED_FAIL_SIGNAL": "KILL"}, capfd)
    assert rc == 1
    assert took < 60, f"took {took:.0f} s"
    assert "rank 1" in line and "SIGKILL" in line, err[-2000:]


def _t(tid: str, kind: Kind, lane: str, deps=()) -> PlanTask:
    return PlanTask(id=tid, kind=kind, lane=lane, stage=0, chunk=0, mb=0, layer=0, deps=tuple(deps))


def _lanes(*tasks: PlanTask) -> dict[str, list[PlanTask]]:
    out: dict[str, list[PlanTask]] = {}
    for t in tasks:
        out.setdefault(t.lane, []).append(t)
    return out


def test_a_task_that_never_returns_is_named_within_the_timeout():
    a = _t("s0/mb0/L0/attn.fwd", Kind.ATTN_FWD, "compute")
    gate = threading.Event()
    with Executor(_lanes(a), {Kind.ATTN_FWD: lambda t: gate.wait(30)}, perturb=None, nvtx=False,
                  dep_timeout_s=0.4) as ex:
        ex.abort_grace_s = 0.2
        t0 = time.monotonic()
        with pytest.raises(TaskError, match=r"^task s0/mb0/L0/attn.fwd: still running after \d+ s \(lane compute"):
            ex.run_step(0)
        assert time.monotonic() - t0 < 5
        gate.set()


def test_a_lane_that_fails_before_it_is_ready_does_not_hang_the_executor():
    """On GPU each lane thread selects the device and its stream before the start-up barrier; a
    failure there (here: CUDA calls on a CPU build) is reported at once, not waited for."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine where CUDA calls fail (CPU build of torch)")
    a = _t("s0/mb0/L0/attn.fwd", Kind.ATTN_FWD, "compute")
    ex = Executor(_lanes(a), {Kind.ATTN_FWD: lambda t: None}, perturb=None, nvtx=False, dep_timeout_s=30)

    class FakeCuda:
        device = torch.device("cuda", 0)

        def stream(self, lane):  # pragma: no cover - set_device fails first
            raise AssertionError

    ex._cuda = FakeCuda()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank 0: a lane thread failed to start \("):
        ex.run_step(0)
    assert time.monotonic() - t0 < 5
    ex.close()
