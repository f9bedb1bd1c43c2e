"""The training ranks run under DeepSpeed's launcher as they do under torchrun (multi-node path)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("deepspeed", path=str(Path(sys.executable).parent)) is None,
                    reason="DeepSpeed's launcher is not installed in this environment (pip install deepspeed)")
def test_deepspeed_launcher_runs_the_training_ranks(tmp_path):
    ds = Path(sys.executable).parent / "deepspeed"
    r = subprocess.run([str(ds), "--num_gpus", "2", "--master_port", str(_free_port()), "runtime/train.py",
                        "configs/tiny-cpu.yaml", "--out", str(tmp_path), "--set", "parallel.pp=1", "--steps", "2",
                        "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["losses"]) == 2 and all(x == x for x in summary["losses"])  # finite
    assert sorted(p.name for p in tmp_path.glob("trace_rank*.json")) == ["trace_rank0.json", "trace_rank1.json"]
