"""Checkpoints (runtime/checkpoint.py) on 4 gloo ranks, PP 2 x EP 2, tiny shapes: a resumed run is
bitwise the run never stopped (plain, grad_offload, FP8 activations), a checkpoint loads into
another layout, a rank SIGKILLed while a checkpoint is being written stops the run with one line
and resuming from the latest complete checkpoint reaches the same losses, an interrupted write is
never taken as complete, and bad checkpoints are one line and exit 2 before anything launches."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from runtime import checkpoint as ck
from runtime.launch import run_command

from conftest import procs_with

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.yaml"
LIMIT_S = 200.0
SHAPES = ["model.seq_len=32", "model.micro_batch_size=2"]  # PP 2 x EP 2, 4 micro-batches as shipped

pytestmark = pytest.mark.slow


def _run(out: Path, steps: int, overrides: list[str] = (), **kw) -> int:
    return run_command(TINY, SHAPES + list(overrides), steps, None, out, False, None, timeout_s=LIMIT_S, quiet=True,
                       **kw)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[float]:
    """6 steps, never stopped, nothing saved: the reference losses."""
    out = tmp_path_factory.mktemp("straight")
    assert _run(out, 6) == 0
    s = _summary(out)
    assert s["first_step"] == 0 and len(s["losses"]) == 6
    return s["losses"]


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> Path:
    """3 steps, then a blocking save of step_3."""
    out = tmp_path_factory.mktemp("three")
    assert _run(out, 3, save_every=3, save_mode="blocking") == 0
    return out


def test_three_steps_save_resume_to_six_is_bitwise_the_straight_run(straight, three, tmp_path):
    s3 = _summary(three)
    assert s3["losses"] == straight[:3]
    assert [e["step"] for e in s3["checkpoint"]["saves"]] == [3] and s3["checkpoint"]["mode"] == "blocking"
    assert ck.latest(three) == three / "checkpoints" / "step_3"
    # resume into the same OUT (latest), saving asynchronously every step on the way
    assert _run(three, 6, resume="latest", save_every=1) == 0
    s = _summary(three)
    assert s["first_step"] == 3 and s["losses"] == straight[3:], (s["losses"], straight)
    assert s["resumed_from"].endswith("step_3")
    assert [e["step"] for e in s["checkpoint"]["saves"]] == [4, 5, 6] and s["checkpoint"]["mode"] == "async"
    assert s["checkpoint_s"] >= 0 and all(e["blocking_s"] <= e["total_s"] for e in s["checkpoint"]["saves"])
    assert [k for k, _ in ck.complete_checkpoints(three / "checkpoints")] == [3, 4, 5, 6]
    assert not list((three / "checkpoints").glob(".tmp-*"))
    marker = json.loads((three / "checkpoints" / "step_6" / ck.MARKER).read_text())
    assert marker["step"] == 6 and marker["data"] == {"kind": "synthetic", "position": 6}


def test_checkpoint_loads_into_another_layout(straight, three, tmp_path):
    """Saved with PP 2 x EP 2, resumed with PP 1 x EP 2 (2 ranks): the loss continues as the
    unchanged layout's does."""
    assert run_command(TINY, SHAPES + ["parallel.pp=1"], 6, None, tmp_path, False, None, timeout_s=LIMIT_S,
                       quiet=True, resume=str(three / "checkpoints" / "step_3")) == 0
    s = _summary(tmp_path)
    assert s["world"] == 2 and s["first_step"] == 3
    assert s["losses"] == pytest.approx(straight[3:], abs=1e-5, rel=0)


def test_per_layer_optimizer_resumes_a_plain_checkpoint_bitwise(straight, three, tmp_path):
    """``schedule.layer_optim`` (a param group per layer, each stepped after its reduction) resumes
    the plain optimizer's checkpoint, named per parameter, and computes bitwise what it does."""
    assert _run(tmp_path, 6, ["schedule.layer_optim=true"], resume=str(three / "checkpoints" / "step_3")) == 0
    s = _summary(tmp_path)
    assert s["first_step"] == 3 and s["losses"] == straight[3:], (s["losses"], straight)


def test_resume_is_bitwise_with_grad_offload_and_fp8_activations(tmp_path):
    """Host fp32 parameter shards and their AdamW state (grad_offload) and FP8 activation storage,
    in one run (each launch costs ~20 s of start-up here)."""
    switches = ["schedule.grad_offload=true", "schedule.act_quant=fp8"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert _run(a, 6, switches, save_every=3) == 0
    full = _summary(a)["losses"]
    assert _run(b, 6, switches, resume=str(a / "checkpoints" / "step_3")) == 0
    assert _summary(b)["losses"] == full[3:], (_summary(b)["losses"], full)
    from torch.distributed.checkpoint import FileSystemReader  # the host shards are in, per parameter and expert

    keys = FileSystemReader(str(a / "checkpoints" / "step_3")).read_metadata().state_dict_metadata
    assert {"master.layers.1.w1.e0", "master.layers.3.wqkv", "optim.layers.1.w1.e7.exp_avg"} <= set(keys)
    marker = json.loads((a / "checkpoints" / "step_3" / ck.MARKER).read_text())
    assert marker["grad_offload"] is True and marker["act_quant"] == "fp8"


def test_rank_killed_during_a_checkpoint_write_then_resume_latest(straight, tmp_path, capfd):
    """Rank 2 SIGKILLs itself after writing its share of step_4 (asynchronous save: the other
    ranks are in step 5 by then): every rank stops within 60 s, one line names rank 2, step_4 is
    never complete, --resume latest takes step_2 and reaches the straight run's losses."""
    t0 = time.monotonic()
    rc = _run(tmp_path, 6, save_every=2, env={ck.KILL_ENV: "2:4"})
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert rc == 1
    assert took < 60, f"took {took:.0f} s"
    last = [ln for ln in err.splitlines() if ln.startswith("error: ")][-1]
    assert "rank 2" in last and "SIGKILL" in last, err[-2000:]
    assert not procs_with(str(tmp_path)), "processes left behind"
    root = tmp_path / "checkpoints"
    assert not (root / "step_4").exists() and list(root.glob(".tmp-step_4-*"))
    assert ck.latest(tmp_path) == root / "step_2"
    assert _run(tmp_path, 6, resume="latest") == 0
    s = _summary(tmp_path)
    assert s["first_step"] == 2 and s["losses"] == straight[2:]


def test_latest_takes_only_complete_checkpoints(three, tmp_path):
    root = tmp_path / "checkpoints"
    good = three / "checkpoints" / "step_3"
    shutil.copytree(good, root / "step_3")
    shutil.copytree(good, root / ".tmp-step_9-123")  # renamed never: not a checkpoint, marker or not
    shutil.copytree(good, root / "step_7")
    (root / "step_7" / ck.MARKER).unlink()  # killed before its marker
    shutil.copytree(good, root / "step_8")  # a marker for another step
    (root / "step_5").mkdir()
    assert [k for k, _ in ck.complete_checkpoints(root)] == [3]
    assert ck.latest(tmp_path) == root / "step_3"


def _one_error(capfd) -> str:
    err = [ln for ln in capfd.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_checkpoints_are_one_line_and_exit_2(three, tmp_path, capfd):
    good = three / "checkpoints" / "step_3"
    out = tmp_path / "out"
    # missing
    assert _run(out, 6, resume=str(tmp_path / "nope")) == 2
    assert "no such checkpoint" in _one_error(capfd)
    assert _run(out, 6, resume="latest") == 2
    assert "no complete checkpoint" in _one_error(capfd)
    # incomplete: no marker
    inc = tmp_path / "incomplete"
    shutil.copytree(good, inc)
    (inc / ck.MARKER).unlink()
    assert _run(out, 6, resume=str(inc)) == 2
    assert "incomplete checkpoint" in _one_error(capfd)
    # corrupt: one byte of a data file changed, then a truncated file, then garbage metadata
    bad = tmp_path / "corrupt"
    shutil.copytree(good, bad)
    f = sorted(bad.glob("__*.distcp"))[0]
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert _run(out, 6, resume=str(bad)) == 2
    assert "fails its CRC32 check" in _one_error(capfd)
    f.write_bytes(bytes(raw[:100]))
    assert _run(out, 6, resume=str(bad)) == 2
    assert "corrupt checkpoint" in _one_error(capfd)
    (bad / ck.MARKER).write_text("{not json")
    assert _run(out, 6, resume=str(bad)) == 2
    assert "corrupt checkpoint" in _one_error(capfd)
    # another model shape
    assert _run(out, 6, ["model.hidden=32"], resume=str(good)) == 2
    line = _one_error(capfd)
    assert "another model shape" in line and "model.hidden" in line
    # nothing left to run
    assert _run(out, 3, resume=str(good)) == 2
    assert "leaves nothing to run" in _one_error(capfd)
    assert _run(out, 6, save_every=-1) == 2
    assert "--save-every" in _one_error(capfd)
    assert not (out / "summary.json").exists()
