"""Sequence slices in the model and the runtime (issue 17 item 2; [Note: sequence slices in the
model] in moe/model.py): a micro-batch run as S slices gives the unsliced model's loss and every
parameter gradient, in one process (fp32, within 1e-5)."""

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
