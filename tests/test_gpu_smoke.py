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

REPO = Path(__file__).resolve().parents[1]
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


def test_gpu_smoke_catches_a_missing_wait(tmp_path):
    """Self-test: when compute stops waiting for the offload_local lane's onloads, the run with
    that lane delayed fails (the undelayed runs may pass)."""
    p, doc = _smoke(tmp_path, "--device", "cpu", "--cases", "offload", "--break-waits", "offload_local")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    bad = [r for r in doc["runs"] if not r["passed"]]
    assert [r["run"] for r in bad] == ["k3+delay:offload_local"], doc["runs"]
