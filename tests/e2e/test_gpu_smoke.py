"""scripts/gpu_smoke.py (``make gpu-check``) on CPU, reduced matrix: serial vs k3 in one process,
with a random delay injected before every task of one lane, losses and gradients bitwise, traces
conforming. The full matrix: ``make gpu-check DEVICE=cpu``; on a GPU: ``make gpu-check``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_smoke.py"


def _smoke(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "smoke.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return p, (json.loads(out.read_text()) if out.exists() else None)


def test_gpu_smoke_quick_matrix_on_cpu(tmp_path):
    p, doc = _smoke(tmp_path, "--device", "cpu", "--quick")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert doc["passed"] and doc["device"] == "cpu"
    runs = {(r["case"], r["run"]) for r in doc["runs"]}
    assert {("plain", "k3"), ("offload", "k3"), ("fp8", "k3")} <= runs
    assert any("+delay:" in r for _, r in runs)  # every case has one delayed run
    assert all(r["compare"] == "bitwise" for r in doc["runs"])  # CPU: the schedule never changes the math
    assert "passed" in p.stdout.splitlines()[-1]


def test_gpu_smoke_refuses_cuda_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the refusal is for machines without one")
    p, doc = _smoke(tmp_path, "--device", "cuda", timeout=60)
    assert p.returncode == 2 and doc is None
    assert p.stderr.strip().splitlines() == ["error: --device cuda: torch sees no CUDA device here (a CPU build of "
                                             "torch, or no GPU)"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch here is a CPU build)")
def test_gpu_smoke_on_cuda(tmp_path):
    p, doc = _smoke(tmp_path, "--device", "cuda", timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert doc["passed"]


def _profile_device(monkeypatch) -> tuple[dict, list]:
    """``measure_ops`` at tiny-cpu's shapes, with the device its in-process run used and the devices
    its parameters lived on."""
    import runtime.local
    from k3sched.config import load_config
    from runtime.probe.inprocess import measure_ops

    seen: list = []
    real = runtime.local.local_run

    def spy(cfg, steps, **kw):
        run = real(cfg, steps, **kw)
        seen.append((kw.get("device"), {p.device.type for p in run.runner.model.parameters()}))
        return run

    monkeypatch.setattr(runtime.local, "local_run", spy)
    ops = measure_ops(load_config(REPO / "configs" / "tiny-cpu.yaml"))
    return ops, seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch here is a CPU build)")
def test_the_operator_profile_runs_on_the_gpu(monkeypatch):
    """``k3sched probe`` on a GPU machine times the operators on the GPU (CUDA events), not on the host."""
    ops, seen = _profile_device(monkeypatch)
    assert [(d.type, kinds) for d, kinds in seen] == [("cuda", {"cuda"})]
    assert {"attn.fwd", "mlp.fwd", "dispatch.fwd"} <= set(ops) and all(v > 0 for v in ops.values())


def test_the_operator_profile_runs_on_the_cpu_without_a_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the profile runs there (the test above)")
    ops, seen = _profile_device(monkeypatch)
    assert [(d.type, kinds) for d, kinds in seen] == [("cpu", {"cpu"})]
    assert {"attn.fwd", "mlp.fwd", "dispatch.fwd"} <= set(ops) and all(v > 0 for v in ops.values())


def test_gpu_smoke_catches_a_missing_wait(tmp_path):
    """Self-test: when compute stops waiting for the offload_local lane's onloads, the run with
    that lane delayed fails (the undelayed runs may pass)."""
    p, doc = _smoke(tmp_path, "--device", "cpu", "--cases", "offload", "--break-waits", "offload_local")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    bad = [r for r in doc["runs"] if not r["passed"]]
    assert [r["run"] for r in bad] == ["k3+delay:offload_local"], doc["runs"]


# -- devices: --device, the GPU run environment, the NVTX fallback (fast, in-process) --------------

def test_resolve_device_and_the_too_few_gpus_line(monkeypatch):
    from runtime import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.resolve_device(None, 2) == "cuda"
    assert launch.resolve_device(None, 4) == "cpu"  # not every rank would have its own GPU
    assert launch.resolve_device("cpu", 1) == "cpu"
    assert launch.resolve_device("cuda", 2) == "cuda"
    with pytest.raises(ValueError, match=r"^--device cuda: the config needs 4 ranks, one GPU each, but this machine "
                                         r"has 2 GPU\(s\) visible to torch; use --device cpu"):
        launch.resolve_device("cuda", 4)
    with pytest.raises(ValueError, match="^--device: must be cpu or cuda"):
        launch.resolve_device("gpu", 1)


def test_cli_run_device_cuda_without_gpus_is_one_line_and_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    p = subprocess.run([sys.executable, "-m", "k3sched.cli", "run", str(REPO / "configs" / "tiny-cpu.yaml"),
                        "--device", "cuda", "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: --device cuda: the config needs 4 ranks, one GPU each, but this "
                                             "machine has 0 GPU(s) visible to torch; use --device cpu or a smaller "
                                             "pp*ep*dp"]


def test_gpu_run_environment(tmp_path, monkeypatch):
    from runtime.launch import gpu_env

    env = gpu_env(tmp_path)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] != "0" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "TORCH_NCCL_BLOCKING_WAIT" not in env
    assert int(env["CUDA_DEVICE_MAX_CONNECTIONS"]) >= 6  # 5 lane streams + the current one, each its own queue
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(tmp_path.resolve()))


def test_nvtx_fallback_is_a_noop_with_one_notice_on_cpu(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("with CUDA the fallback is torch.cuda.nvtx")
    from runtime import executor as exm
    from k3sched.tasks import Kind

    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    assert exm.load_nvtx() is None
    monkeypatch.setattr(exm, "_nvtx", None)
    monkeypatch.setattr(exm, "_nvtx_notice", [False])
    t = exm.PlanTask(id="s0/mb0/L0/attn.fwd", kind=Kind.ATTN_FWD, lane="compute", stage=0, chunk=0, mb=0, layer=0)
    for _ in range(2):
        with exm.Executor({"compute": [t]}, {Kind.ATTN_FWD: lambda task: None}, perturb=None) as ex:
            assert not ex.use_nvtx
            ex.run_step(0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3sched: NVTX ranges off"), err
