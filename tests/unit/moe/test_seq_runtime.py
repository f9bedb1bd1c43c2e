"""Sequence slices in the model and the runtime (issue 17 item 2; [Note: sequence slices in the
model] in moe/model.py): a micro-batch run as S slices gives the unsliced model's loss and every
parameter gradient in one process (fp32, within 1e-5), slices run out of order are refused, and
sliced runs on 2 ranks (PP 2 under 1f1b and zb-v, EP 2; even and compute-split slices; strict P2P,
grad_offload, local and remote activation offload with debug checks) train 3 steps with the unsliced
reference's losses (runtime/reference.py) within 1e-5 and their traces validate against their plans."""

from __future__ import annotations

import pytest
import torch

from k3sched.tasks import Kind
from moe import MoEModel, MoEModelArgs, microbatch_tasks, run_microbatch_in_order, run_slices_in_order, run_tasks

# dense layer 0, MoE layers 1-2 with a shared expert; fp32
ARGS = MoEModelArgs(layers=3, dense_layers=1, hidden=16, heads=2, experts=4, top_k=2, shared_experts=1,
                    expert_hidden=8, dense_hidden=24, vocab=32, seq_len=12, aux_loss_coef=0.05, dtype="float32")
BOUNDS = {
    "s2_even": [(0, 6), (6, 12)],
    "s2_uneven": [(0, 8), (8, 12)],
    "s4_even": [(0, 3), (3, 6), (6, 9), (9, 12)],
    "s4_uneven": [(0, 5), (5, 8), (8, 10), (10, 12)],
}


def _data(args: MoEModelArgs, n_mb: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, args.vocab, (batch, args.seq_len), generator=g),
             torch.randint(0, args.vocab, (batch, args.seq_len), generator=g)) for _ in range(n_mb)]


def _unsliced(args: MoEModelArgs, data) -> tuple[float, dict, list]:
    model = MoEModel.build(args, seed=0)
    n = len(data)
    loss, aux = 0.0, []
    for i, (t, y) in enumerate(data):
        mb = model.new_microbatch(t, y, index=i, loss_scale=1.0 / n)
        loss += run_microbatch_in_order(model, mb).item() / n
        aux.append([lc.aux.item() for lc in mb.layers if lc.aux is not None])
    return loss, {name: p.grad.clone() for name, p in model.named_parameters()}, aux


def _sliced(args: MoEModelArgs, data, bounds) -> tuple[float, dict, list]:
    model = MoEModel.build(args, seed=0)
    n = len(data)
    loss, aux = 0.0, []
    for i, (t, y) in enumerate(data):
        slices = model.new_slices(t, y, bounds, index=i, loss_scale=1.0 / n)
        loss += run_slices_in_order(model, slices).item() / n
        for mb in slices:
            assert mb.all_saved_tensors() == {}, f"slice {mb.slice} still holds saved tensors"
        assert not slices[0].seq.kv and not slices[0].seq.grad_kv, "K / V or their gradients left behind"
        # each MoE layer's aux value is set once, on the slice that completed its routing (the last)
        aux.append([lc.aux.item() for lc in slices[-1].layers if lc.aux is not None])
        assert all(lc.aux is None for mb in slices[:-1] for lc in mb.layers)
    return loss, {name: p.grad for name, p in model.named_parameters()}, aux


def _assert_close(ref: tuple, got: tuple, tol: float) -> None:
    assert got[0] == pytest.approx(ref[0], rel=tol, abs=0)
    assert got[2] == [pytest.approx(a, rel=1e-6, abs=0) for a in ref[2]]
    assert ref[1].keys() == got[1].keys()
    for name, g_ref in ref[1].items():
        g = got[1][name]
        assert g is not None, f"{name}: no gradient from the sliced path"
        err = ((g - g_ref).abs().max() / g_ref.abs().max().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: max relative error {err:.3g} > {tol}"


@pytest.mark.parametrize("bounds", list(BOUNDS), ids=list(BOUNDS))
def test_slices_give_the_unsliced_loss_and_gradients_fp32(bounds: str) -> None:
    data = _data(ARGS, n_mb=2, batch=2)
    _assert_close(_unsliced(ARGS, data), _sliced(ARGS, data, BOUNDS[bounds]), tol=1e-5)


@pytest.mark.parametrize("variant", [
    {"recompute": True, "dispatch_recompute": True},
    {"normalize_topk": False, "top_k": 1, "shared_experts": 0, "dense_layers": 0},
    {"dense_layers": 3},
], ids=["recompute", "top1_no_shared", "dense"])
def test_slices_match_with_recompute_and_other_shapes(variant: dict) -> None:
    args = MoEModelArgs.from_mapping({**ARGS.__dict__, **variant})
    data = _data(args, n_mb=1, batch=3, seed=2)
    _assert_close(_unsliced(args, data), _sliced(args, data, BOUNDS["s4_uneven"]), tol=1e-5)


def test_slices_run_out_of_order_are_refused() -> None:
    model = MoEModel.build(ARGS, seed=0)
    t, y = _data(ARGS, n_mb=1, batch=1)[0]
    for bad in ([(0, 6)], [(0, 6), (7, 12)], [(0, 6), (6, 6), (6, 12)], [(1, 12)]):
        with pytest.raises(ValueError, match="contiguous non-empty"):
            model.new_slices(t, y, bad)
    s0, s1 = model.new_slices(t, y, BOUNDS["s2_even"])
    model.run(Kind.EMBED_FWD, s1)
    with pytest.raises(RuntimeError, match="attn.fwd of slice 1 of layer 0: needs the keys / values of slices 0..0"):
        model.run(Kind.ATTN_FWD, s1, 0)
    tasks = microbatch_tasks(ARGS)
    s0, s1 = model.new_slices(t, y, BOUNDS["s2_even"])
    run_tasks(model, s0, tasks.forward)
    run_tasks(model, s0, tasks.backward_dx[:3])  # head.dx, layer 2: combine.bwd, shared.dx
    with pytest.raises(RuntimeError, match="router.bwd of slice 0 of layer 2: .* 1 of 2 routed"):
        model.run(Kind.ROUTER_BWD, s0, 2)
    s0, s1 = model.new_slices(t, y, BOUNDS["s2_even"])
    run_tasks(model, s0, tasks.forward)
    run_tasks(model, s1, tasks.forward)
    first_attn_dx = tasks.backward_dx.index((Kind.ATTN_DX, 2))
    run_tasks(model, s0, tasks.backward_dx[:first_attn_dx])  # slice 0 first: the wrong order
    with pytest.raises(RuntimeError, match="attn.dx of slice 0 of layer 2: needs the key / value gradients of the "
                                           "1 later slice"):
        model.run(Kind.ATTN_DX, s0, 2)


# -- the runtime: sliced runs on 2 ranks (gloo, one torchrun launch, as tests/unit/k3sched/test_p2p.py does) ------------

BASE = ["parallel.microbatches=2", "model.layers=4", "model.dense_layers=1", "model.micro_batch_size=2",
        "schedule.offload=none"]
PP2 = BASE + ["parallel.ep=1", "parallel.pp=2"]
RUNS = {  # name -> (overrides, p2p mode, the slice bounds the run must use); 1f1b unless named
    "pp2_zbv_s2_even": (PP2 + ["schedule.pipeline=zb-v", "parallel.vpp=2", "model.seq_len=16", "parallel.seq_chunks=2"],
                        "buffered", [(0, 8), (8, 16)]),
    "pp2_s4_compute_strict_gradoffload": (PP2 + ["model.seq_len=18", "parallel.seq_chunks=4", "parallel.seq_split=compute",
                                                 "schedule.grad_offload=true"], "strict",
                                          [(0, 5), (5, 9), (9, 14), (14, 18)]),
    "ep2_s4_even": (BASE + ["parallel.ep=2", "parallel.pp=1", "model.seq_len=16", "parallel.seq_chunks=4"], "buffered",
                    [(0, 4), (4, 8), (8, 12), (12, 16)]),
}
LIMIT_S = 240.0


def _offload_runs(tiny) -> dict:
    """Two more runs whose device budgets make the planner offload slices' activation sets: to the
    host (S = 2, 95% of the peak without offload) and to the other stage (S = 4, schedule.offload
    remote, a budget between the two stages' peaks: stage 0 sends, stage 1 holds)."""
    from k3sched.config import load_config
    from k3sched.planner import plan

    def peaks(ov: list[str]) -> list[int]:
        return plan(load_config(tiny, ov + ["schedule.offload=none"])).metrics.peak_device_bytes

    local = [o for o in PP2 if o != "schedule.offload=none"] + ["model.seq_len=32", "parallel.seq_chunks=2"]
    remote = [o for o in PP2 if o not in ("schedule.offload=none", "model.dense_layers=1")] + [
        "model.dense_layers=0", "model.vocab=64", "model.seq_len=32", "parallel.seq_chunks=4"]
    p_local, p_remote = peaks(local), peaks(remote)
    assert p_remote[0] > p_remote[1], p_remote
    return {
        "pp2_s2_local_offload": (local + [f"schedule.device_memory_budget={max(p_local) * 0.95 / 2**30}"], "buffered",
                                 [(0, 16), (16, 32)], "local"),
        "pp2_s4_remote_offload": (remote + ["schedule.offload=remote",
                                            f"schedule.device_memory_budget={sum(p_remote) / 2 / 2**30}"],
                                  "buffered", [(0, 8), (8, 16), (16, 24), (24, 32)], "remote"),
    }


@pytest.mark.slow
def test_sliced_runs_train_like_the_unsliced_reference_and_their_traces_validate(tmp_path):
    import json
    import subprocess
    import sys

    from k3sched.config import load_config
    from k3sched.seqslice import slice_bounds
    from runtime.reference import reference_run

    from conftest import CONFIGS, ROOT, launch_p2p_worker

    tiny = CONFIGS / "tiny-cpu.yaml"
    runs = {**{n: (*r, None) for n, r in RUNS.items()}, **_offload_runs(tiny)}
    spec = {"runs": [{"out": str(tmp_path / n), "overrides": ov, "p2p": p2p, "steps": 3}
                     for n, (ov, p2p, _, _) in runs.items()], "timeout_s": 90}
    # offload debug: checksums of every offloaded set and residency checks before every backward read
    rc, out = launch_p2p_worker(spec, tmp_path, env={"K3SCHED_OFFLOAD_DEBUG": "1"}, limit_s=LIMIT_S)
    assert rc == 0, out[-3000:]
    for name, (ov, _, bounds, where) in runs.items():
        d = tmp_path / name
        cfg = load_config(tiny, ov)
        assert slice_bounds(cfg) == bounds, name
        doc = json.loads((d / "plan.json").read_text())
        sliced = {t["slice"] for s in doc["stages"] for ts in s["lanes"].values() for t in ts if "slice" in t}
        assert sliced == set(range(len(bounds))), name  # the plan's tasks are per slice
        summary = json.loads((d / "summary.json").read_text())
        if where is not None:  # slices' sets really went to the host / the other stage
            assert summary["offloaded_sets"][where] > 0, (name, summary["offloaded_sets"])
        losses = summary["losses"]
        ref = reference_run(cfg, 3)  # one process, whole sequences: the unsliced model
        assert losses == pytest.approx(ref.losses, rel=1e-5, abs=0), name
        traces = sorted(str(p) for p in d.glob("trace_rank*.json"))
        assert len(traces) == 2
        v = subprocess.run([sys.executable, "-m", "k3sched.cli", "validate", "--plan", str(d / "plan.json"), *traces],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert v.returncode == 0, name + ": " + v.stdout[-2000:] + v.stderr[-2000:]


# -- FP8 activation storage on slices, one rank in-process (as tests/unit/offload/test_quant_recompute.py runs it) ---------

ONE_RANK = ["parallel.pp=1", "parallel.ep=1", "parallel.microbatches=4", "model.layers=2", "model.seq_len=64",
            "model.micro_batch_size=2", "model.vocab=64", "schedule.offload=none", "schedule.pipeline=gpipe",
            "schedule.wgrad_lag=0"]


def _train_one_rank(overrides: list[str], steps: int = 3):
    """Train a one-rank plan in this process (``runtime.local.local_run``, offload debug checks
    on); returns (losses, step-0 grads, peak tracked device bytes)."""
    from k3sched.config import load_config
    from runtime.local import local_run
    from runtime.options import RuntimeOptions

    from conftest import CONFIGS

    cfg = load_config(CONFIGS / "tiny-cpu.yaml", ONE_RANK + overrides)
    run = local_run(cfg, steps, seed=0, capture_grads=True, options=RuntimeOptions(offload_debug=True))
    assert run.runner.acts.device_pool.stats.in_use == 0
    return run.losses, run.grads, max(run.peaks)


def test_fp8_storage_of_slices_trains_like_unsliced_fp8():
    """act_quant fp8 on slices (every slice's saved set quantized after its layer's forward, read
    back before its backward; offload debug checksums on): close to fp32 as unsliced FP8 is
    (tests/unit/offload/test_quant_recompute.py: loss within 1e-2, gradient error of e4m3 storage 0.06-0.11),
    with a lower peak. Before the attention mask of a slice was finite, its -inf entries (saved by
    SDPA for the backward) came back from FP8 as NaN."""
    import math

    ref, ref_grads, _ = _train_one_rank([])
    sliced, sliced_grads, sliced_peak = _train_one_rank(["parallel.seq_chunks=2"])
    assert sliced == pytest.approx(ref, rel=1e-5, abs=0)  # the in-process runtime path, fp32
    fp8, fp8_grads, fp8_peak = _train_one_rank(["parallel.seq_chunks=2", "schedule.act_quant=fp8"])
    assert all(math.isfinite(v) for v in fp8)
    assert fp8[0] == sliced[0]  # step 0's loss comes before any read-back
    assert max(abs(a - b) / abs(b) for a, b in zip(fp8, ref)) < 1e-2  # measured 3.8e-4
    num = sum(float((fp8_grads[k] - ref_grads[k]).double().pow(2).sum()) for k in ref_grads)
    den = sum(float(ref_grads[k].double().pow(2).sum()) for k in ref_grads)
    assert 0.06 < math.sqrt(num / den) < 0.11, math.sqrt(num / den)  # measured 0.0899 (unsliced FP8: 0.0898)
    assert fp8_peak < 0.8 * sliced_peak, (fp8_peak, sliced_peak)  # measured 8.2 vs 13.6 MB


def test_the_kept_keys_and_values_are_what_memory_accounting_sees():
    # runtime/stage/memory.py counts SequenceState.tensors() once per micro-batch: the K / V kept for
    # later slices and the K / V gradients handed back, until they are dropped
    import torch

    from moe.context import SequenceState

    seq = SequenceState(bounds=((0, 4), (4, 8), (8, 12)), batch=1)
    k0, v0, k1, v1 = (torch.randn(1, 2, 4, 3) for _ in range(4))
    seq.keep_kv(0, 0, (k0, v0))
    seq.keep_kv(0, 1, (k1, v1))
    gk, gv = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3)
    seq.add_grad_kv(0, 0, gk, gv)
    held = {id(t) for t in seq.tensors()}
    assert held == {id(k0), id(v0), id(k1), id(v1), id(gk), id(gv)}
    seq.keep_kv(0, 2, None)  # the last slice drops the layer's prefix
    assert {id(t) for t in seq.tensors()} == {id(gk), id(gv)}
