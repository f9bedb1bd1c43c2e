"""Redundant experts in real runs (4 gloo ranks, PP 1 x DP 2 x EP 2, torchrun via run_command, 3 steps):
a skewed run (model.router_skew=1.5) records its routing in summary.json and the traces;
``k3sched balance`` places one redundant expert per rank from it; the run with that placement
trains the same model (losses within 1e-5, every expert weight within 1e-4 of the run without
replicas after 3 AdamW steps), keeps each replicated expert's replicas bitwise identical (across EP
ranks and DP replicas: the DP sum is not counted twice), and measures a lower imbalance. The reference is the run without replicas, itself checked against the
one-process model in tests/unit/runtime/test_runtime_dist.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.launch import run_command

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.yaml"
SKEW = ["model.router_skew=1.5", "parallel.pp=1", "parallel.dp=2", "parallel.ep=2"]

pytestmark = pytest.mark.slow


def _run(out: Path, overrides: list[str]) -> dict:
    rc = run_command(TINY, overrides, 3, None, out, False, None, timeout_s=240.0, quiet=True,
                     extra_args=["--dump-params", "--dump-grads"])
    err = sorted(out.glob("error_rank*.txt"))
    assert rc == 0, err[0].read_text() if err else rc
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("balance_run")
    plain = _run(base / "plain", SKEW)
    placement = base / "placement.yaml"
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "balance", str(base / "plain"), "--redundant", "1",
                        "-o", str(placement)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    replicas = _run(base / "replicas", SKEW + ["parallel.redundant_experts=1",
                                               f"schedule.expert_placement={placement}"])
    return {"base": base, "plain": plain, "replicas": replicas, "balance_stdout": r.stdout}


def test_routing_is_recorded(runs) -> None:
    rt = runs["plain"]["routing"]
    assert rt["ep"] == 2 and rt["layers"] == [1, 2, 3] and len(rt["tokens_per_expert"]) == 3
    tokens = 4 * 4 * 128 * 2  # microbatches x micro_batch_size x seq_len x top_k, per rank
    for step in rt["tokens_per_expert"]:
        for layer in step:
            assert sum(layer) == 4 * tokens and layer[0] == max(layer)  # expert 0 is the hot one
    assert rt["imbalance_mean"] > 1.5 and rt["imbalance"] == rt["imbalance_contiguous"]
    for r in range(4):
        trace = json.loads((runs["base"] / "plain" / f"trace_rank{r}.json").read_text())
        layers = trace["otherData"]["routing"]
        assert sorted(layers) == ["1", "2", "3"]
        assert all(sum(v["tokens_per_expert"]) == tokens for v in layers.values())
    assert "before 1.7" in runs["balance_stdout"] or "before 1.8" in runs["balance_stdout"]


def test_replica_gradients_are_the_expert_gradient(runs) -> None:
    """First step's gradients as AdamW sees them (after grad.rs): every replica of an expert holds
    that expert's gradient of the run without replicas (AdamW is nearly scale-free, so this is what
    catches a sum counted twice, e.g. over the DP replicas)."""
    base, slots = runs["base"], runs["replicas"]["routing"]["slots"]
    ga = [torch.load(base / "plain" / f"grads_rank{r}.pt") for r in range(4)]
    gb = [torch.load(base / "replicas" / f"grads_rank{r}.pt") for r in range(4)]
    checked = 0
    for dp in (0, 1):
        for name in ga[2 * dp]:
            if name.rsplit(".", 1)[-1] not in ("w1", "w2", "w3"):
                continue
            full = torch.cat([ga[2 * dp][name], ga[2 * dp + 1][name]])
            for r in (0, 1):
                for s, e in enumerate(slots[r]):
                    got, want = gb[2 * dp + r][name][s], full[e]
                    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
                    assert err < 1e-5, (dp, name, r, e, err)
                    checked += 1
    assert checked == 2 * 3 * 3 * 10  # dp x MoE layers x (w1, w3, w2) x slots


def test_replicas_train_the_same_model(runs) -> None:
    a, b = runs["plain"], runs["replicas"]
    assert b["losses"] == pytest.approx(a["losses"], abs=1e-5, rel=0)
    assert b["routing"]["imbalance_mean"] < 1.15 < a["routing"]["imbalance_mean"]
    slots = b["routing"]["slots"]
    replicated = sorted({e for e in slots[0] if e in slots[1]})
    assert replicated
    base = runs["base"]
    pa = [torch.load(base / "plain" / f"params_rank{r}.pt") for r in range(4)]  # rank = dp * 2 + ep
    pb = [torch.load(base / "replicas" / f"params_rank{r}.pt") for r in range(4)]
    for dp in (0, 1):
        ra, rb = pa[2 * dp:2 * dp + 2], pb[2 * dp:2 * dp + 2]
        for name in ra[0]:
            if name.rsplit(".", 1)[-1] not in ("w1", "w2", "w3"):
                assert torch.allclose(rb[0][name], ra[0][name], rtol=0, atol=1e-4), name
                continue
            full = torch.cat([ra[0][name], ra[1][name]])  # contiguous: EP rank 0 holds 0..3, rank 1 4..7
            for r in (0, 1):
                assert rb[r][name].shape[0] == 5
                assert torch.equal(rb[r][name], pb[r][name])  # the DP replicas stay identical
                for s, e in enumerate(slots[r]):
                    assert torch.allclose(rb[r][name][s], full[e], rtol=0, atol=1e-4), (name, r, e)
            for e in replicated:  # the expert replicas stay identical, bit for bit
                assert torch.equal(rb[0][name][slots[0].index(e)], rb[1][name][slots[1].index(e)]), (name, e)
