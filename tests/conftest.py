"""Shared test helpers. Paths are resolved from this file, so tests run from any directory."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
REAL_TRACES = ROOT.parent / "shared" / "traces" / "real"


@pytest.fixture(autouse=True, scope="session")
def _deterministic_on_cuda():
    """Bitwise comparisons (k3 vs serial, resumed vs straight runs) need deterministic kernels on
    CUDA: in-process via ``torch.use_deterministic_algorithms``, in launched ranks via
    ``K3SCHED_DETERMINISTIC=1`` (runtime/train.py). Nothing changes on a CPU-only machine."""
    import os

    import torch

    if not torch.cuda.is_available():
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("K3SCHED_DETERMINISTIC", "1")
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield


def one_line(text: str, *needles: str) -> str:
    """A user error as the project promises it: one line, no traceback, naming each of ``needles``."""
    text = text.strip()
    assert text and "\n" not in text, text
    assert "Traceback" not in text
    for n in needles:
        assert n in text, text
    return text


def cli_exit(res, code: int, *needles: str) -> str:
    """A ``typer.testing.CliRunner`` result that exited ``code`` with one line on stderr naming
    ``needles``; returns that line."""
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    return one_line(res.stderr, *needles)


@pytest.fixture
def tiny_cfg():
    from k3sched.config import load_config

    return load_config(CONFIGS / "tiny-cpu.yaml")


def procs_with(marker: str) -> list:
    """Live processes whose command line contains ``marker`` (leftover checks)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


class FakeCtx:
    """A moe ``LayerCtx`` stand-in for offload tests: named saved tensors with ``replace`` (same
    shape and dtype, as the real store requires)."""

    def __init__(self, **t):
        self.t = dict(t)

    def saved_tensors(self):
        return dict(self.t)

    def replace(self, name, x):
        assert x.shape == self.t[name].shape and x.dtype == self.t[name].dtype
        self.t[name] = x


def launch_p2p_worker(spec: dict, work: Path, *, nproc: int = 2, env: dict | None = None,
                      limit_s: float = 240.0, what: str = "the runs") -> tuple[int, str]:
    """Run ``tests/p2p_worker.py`` with ``spec`` (written to ``work/spec.json``) under one torchrun
    launch of ``nproc`` ranks (gloo, a free loopback port, no restarts), as tests/unit/k3sched/test_p2p.py does;
    returns (exit code, combined output; on failure it ends with the ranks' ``error_rank*.txt``
    lines found under ``work``). Fails the test when it outlives ``limit_s``; the process group is
    killed either way."""
    import json
    import subprocess
    import sys

    from runtime.launch import _run_env, kill_group
    from runtime.testbed import free_port

    (work / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "runtime.launch", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           str(ROOT / "tests" / "p2p_worker.py"), str(work / "spec.json")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_run_env(env), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} took longer than {limit_s:.0f} s")
    finally:
        kill_group(proc)
    if proc.returncode:
        errors = sorted(f"{p}: {p.read_text().strip()}" for p in work.rglob("error_rank*.txt"))
        out += "\nerror files:\n" + "\n".join(errors)
    return proc.returncode, out


SMALL_PIPELINES = ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "dualpipev"]


def draw_pipeline_shape(draw) -> tuple[int, str, int, int]:
    """(pp, pipeline, vpp, micro-batches) of a small valid shape, for a hypothesis ``@st.composite``
    strategy's ``draw``: pp 1-3, vpp 2 for the interleaved and V schedules, micro-batches 1-4 (a
    multiple of pp for interleaved 1F1B, at least 2 pp for DualPipeV)."""
    import hypothesis.strategies as st

    pp = draw(st.integers(1, 3))
    pipeline = draw(st.sampled_from(SMALL_PIPELINES))
    vpp = 2 if pipeline in ("interleaved-1f1b", "zb-v", "dualpipev") else 1
    m = draw(st.integers(1, 4))
    if pipeline == "interleaved-1f1b":
        m = pp * draw(st.integers(1, 2))
    if pipeline == "dualpipev":
        m = max(m, 2 * pp)
    return pp, pipeline, vpp, m


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test (lanes are threads; on 2 cores more would oversubscribe)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def seeded_planner(monkeypatch):
    """k3sched.planner.plan returning a plan whose stage 0 waits for gradient 0 before sending
    activation 0: a lane-order deadlock under NCCL semantics (tests/unit/k3sched/test_p2p.py)."""
    import k3sched.planner as planner

    real = planner.plan

    def seeded(cfg, strategy=None, schedule=None):
        p = real(cfg, strategy, schedule)
        order = p.lane_orders[(0, "collective")]
        order.remove("s0/mb0/v0/grad.recv")
        order.insert(order.index("s0/mb0/v0/act.send"), "s0/mb0/v0/grad.recv")
        return p

    monkeypatch.setattr(planner, "plan", seeded)
