"""Split backward (fwd / dX / deferred dW tasks) == plain autograd, single process, EP size 1."""

from __future__ import annotations

import pytest
import torch

from k3sched.tasks import Kind
from moe import MoEModel, MoEModelArgs, microbatch_tasks, run_microbatch_in_order, run_tasks

ARGS = MoEModelArgs(layers=3, dense_layers=1, hidden=16, heads=2, experts=4, top_k=2, shared_experts=1,
                    expert_hidden=8, dense_hidden=24, vocab=32, seq_len=8, aux_loss_coef=0.05, dtype="float64")


def _data(args: MoEModelArgs, n_mb: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, args.vocab, (batch, args.seq_len), generator=g),
             torch.randint(0, args.vocab, (batch, args.seq_len), generator=g)) for _ in range(n_mb)]


def _reference(args: MoEModelArgs, data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, dict]:
    """Plain autograd over all micro-batches at once (mean loss over equal-size micro-batches)."""
    ref = MoEModel.build(args, seed=0)
    tokens = torch.cat([t for t, _ in data])
    targets = torch.cat([t for _, t in data])
    loss = ref.forward_backward_reference(tokens, targets)
    return loss.item(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _run_split(args: MoEModelArgs, data: list[tuple[torch.Tensor, torch.Tensor]], order: str) -> tuple[float, dict]:
    model = MoEModel.build(args, seed=0)
    n = len(data)
    mbs = [model.new_microbatch(t, y, index=i, loss_scale=1.0 / n) for i, (t, y) in enumerate(data)]
    tasks = microbatch_tasks(args)
    if order == "in_order":
        for mb in mbs:
            run_microbatch_in_order(model, mb)
    elif order == "defer_all_dw":
        for mb in mbs:
            run_tasks(model, mb, tasks.forward)
            run_tasks(model, mb, tasks.backward_dx)
        for mb in mbs:
            run_tasks(model, mb, tasks.wgrad)
    elif order == "interleave":  # dW of micro-batch i after the forward of micro-batch i + 1
        run_tasks(model, mbs[0], tasks.forward)
        run_tasks(model, mbs[0], tasks.backward_dx)
        for prev, mb in zip(mbs, mbs[1:]):
            run_tasks(model, mb, tasks.forward)
            run_tasks(model, prev, tasks.wgrad)
            run_tasks(model, mb, tasks.backward_dx)
        run_tasks(model, mbs[-1], tasks.wgrad)
    else:
        raise ValueError(order)
    for mb in mbs:
        assert mb.all_saved_tensors() == {}, f"micro-batch {mb.index} still holds saved tensors"
    loss = sum(mb.loss.item() for mb in mbs) / n
    return loss, {name: p.grad for name, p in model.named_parameters()}


def _assert_close(ref: tuple[float, dict], got: tuple[float, dict], rtol: float) -> None:
    assert got[0] == pytest.approx(ref[0], rel=rtol, abs=0)
    assert ref[1].keys() == got[1].keys()
    for name, g_ref in ref[1].items():
        g = got[1][name]
        assert g is not None, f"{name}: no gradient from the split path"
        err = ((g - g_ref).abs().max() / g_ref.abs().max().clamp_min(1e-30)).item()
        assert err <= rtol, f"{name}: max relative error {err:.3g} > {rtol}"


@pytest.mark.parametrize("order", ["in_order", "defer_all_dw", "interleave"])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "dispatch_re"])
def test_split_backward_matches_autograd_fp64(order: str, recompute: bool) -> None:
    args = MoEModelArgs.from_mapping({**ARGS.__dict__, "dispatch_recompute": recompute})
    data = _data(args, n_mb=3, batch=2)
    _assert_close(_reference(args, data), _run_split(args, data, order), rtol=1e-10)


@pytest.mark.parametrize("variant", [
    {"normalize_topk": False, "top_k": 1, "shared_experts": 0},
    {"dense_layers": 0, "shared_experts": 2, "top_k": 3},
    {"dense_layers": 3},
])
def test_split_backward_matches_autograd_fp32(variant: dict) -> None:
    args = MoEModelArgs.from_mapping({**ARGS.__dict__, "dtype": "float32", **variant})
    data = _data(args, n_mb=2, batch=2)
    _assert_close(_reference(args, data), _run_split(args, data, "interleave"), rtol=1e-5)


def test_offload_roundtrip_through_saved_tensor_api() -> None:
    """Replacing every saved tensor by a copy (offload) and back (onload) keeps the gradients, and
    the original buffers are really released (the contexts hold no other reference)."""
    args = MoEModelArgs.from_mapping({**ARGS.__dict__, "dispatch_recompute": True})
    data = _data(args, n_mb=1, batch=2)
    ref = _reference(args, data)
    model = MoEModel.build(args, seed=0)
    mb = model.new_microbatch(*data[0])
    tasks = microbatch_tasks(args)
    run_tasks(model, mb, tasks.forward)
    for lc in mb.layers:
        saved = lc.saved_tensors()
        assert saved, f"layer {lc.layer} saved nothing"
        assert all(name.split(".")[0] in {"attn", "router", "dispatch", "shared", "expert", "combine", "mlp"}
                   for name in saved)
        host = {n: t.clone() for n, t in saved.items()}  # "offload": a copy in another buffer
        for n, t in host.items():
            lc.replace(n, t)
        del saved
        for n, t in lc.saved_tensors().items():
            assert t.data_ptr() == host[n].data_ptr()
        for n, t in host.items():  # "onload"
            lc.replace(n, t.clone())
        with pytest.raises(ValueError, match="expected"):
            name = next(iter(host))
            lc.replace(name, torch.zeros(1, 2, 3, dtype=torch.float64))
    moe_layer = mb.layers[1]
    assert moe_layer.recompute_name is not None
    assert moe_layer.recompute_name not in moe_layer.saved_tensors()  # evicted for dispatch recompute
    assert "dispatch.xn" in moe_layer.saved_tensors()  # the dispatch input is kept instead
    run_tasks(model, mb, tasks.backward_dx)
    # after every dX only WGrad state is left: inputs and grad_outputs of the deferred GEMMs
    for lc in mb.layers:
        for c in lc.sub_ops().values():
            users = {u for e in c.store._entries.values() for u in e.users}
            assert "graph" not in users, f"{c.op}: graph-saved tensors outlive its dX"
    run_tasks(model, mb, tasks.wgrad)
    got = (mb.loss.item(), {n: p.grad for n, p in model.named_parameters()})
    _assert_close(ref, got, rtol=1e-10)


def test_expert_dw_needs_dispatch_recompute_first() -> None:
    args = MoEModelArgs.from_mapping({**ARGS.__dict__, "dispatch_recompute": True, "layers": 1,
                                      "dense_layers": 0})
    model = MoEModel.build(args, seed=0)
    mb = model.new_microbatch(*_data(args, 1, 1)[0])
    tasks = microbatch_tasks(args)
    run_tasks(model, mb, tasks.forward)
    run_tasks(model, mb, tuple(t for t in tasks.backward_dx if t[0] is not Kind.DISPATCH_RE))
    with pytest.raises(RuntimeError, match="evicted for recompute"):
        model.run(Kind.EXPERT_DW, mb, 0)
    model.run(Kind.DISPATCH_RE, mb, 0)
    model.run(Kind.EXPERT_DW, mb, 0)


def test_run_rejects_misplaced_tasks() -> None:
    model = MoEModel.build(ARGS, seed=0)
    mb = model.new_microbatch(*_data(ARGS, 1, 1)[0])
    with pytest.raises(ValueError, match="layer must be given"):
        model.run(Kind.ATTN_FWD, mb)
    with pytest.raises(ValueError, match="no handler"):
        model.run(Kind.GRAD_RS, mb, None)
    model.run(Kind.EMBED_FWD, mb)
    model.run(Kind.ATTN_FWD, mb, 0)
    with pytest.raises(ValueError, match="dense layer"):
        model.run(Kind.ROUTER_FWD, mb, 0)
    with pytest.raises(RuntimeError, match="before its dX"):
        model.run(Kind.ATTN_DW, mb, 0)


def test_args_from_mapping_ignores_unknown_keys() -> None:
    args = MoEModelArgs.from_mapping({"layers": 4, "experts": 16, "dtype": torch.bfloat16, "pp": 4,
                                      "name": "k3-tiny"})
    assert (args.layers, args.experts, args.dtype, args.torch_dtype) == (4, 16, "bfloat16", torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of heads"):
        MoEModelArgs(hidden=10, heads=4)


def test_expert_sharding_slices_the_full_weights() -> None:
    full = MoEModel.build(ARGS, seed=3)
    for rank in range(2):
        shard = MoEModel.build(ARGS, seed=3, ep_rank=rank, ep_size=2)
        for name, p in shard.named_parameters():
            q = dict(full.named_parameters())[name]
            expect = q[rank * 2:(rank + 1) * 2] if MoEModel.is_expert_param(name) else q
            assert torch.equal(p, expect), name


def test_saved_store_forgets_addresses_of_evicted_replaced_and_dropped_entries() -> None:
    """A tensor that reuses the memory of an evicted / replaced / dropped entry must get its own
    entry (regression: a grad_output landing at an evicted expert input's address aliased it)."""
    from moe import SavedStore

    store = SavedStore("expert")
    t = torch.randn(4, 3)
    a = store.put(t, "w1")
    assert store.put(t.view(4, 3), "w3") == a  # a live alias shares the entry
    store.evict(a)
    b = store.put(t, "w2", name="expert.w2.grad_out")
    assert b != a
    store.replace(b, t.clone())
    c = store.put(t, "graph")
    assert c not in (a, b)
    store.release(c, "graph")
    assert c not in store.names()
    d = store.put(t, "graph")
    assert d != c and store.get(d) is not None
    with pytest.raises(RuntimeError, match="evicted"):
        store.get(a)


def test_bfloat16_runs_with_fp32_router() -> None:
    """bf16 weights/activations: routers and the loss run in fp32, every gradient is produced in
    bf16 and the loss stays near the fp32 loss of the same weights."""
    args = MoEModelArgs.from_mapping({**ARGS.__dict__, "dtype": "bfloat16"})
    data = _data(args, n_mb=1, batch=2)
    model = MoEModel.build(args, seed=0)
    loss = run_microbatch_in_order(model, model.new_microbatch(*data[0]))
    assert loss.dtype == torch.float32
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
        assert torch.isfinite(p.grad.float()).all(), name
    ref_loss, _ = _reference(MoEModelArgs.from_mapping({**ARGS.__dict__, "dtype": "float32"}), data)
    assert loss.item() == pytest.approx(ref_loss, rel=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_backward_matches_autograd_on_cuda() -> None:
    args = MoEModelArgs.from_mapping({**ARGS.__dict__, "dispatch_recompute": True})
    data = _data(args, n_mb=2, batch=2)
    ref = MoEModel.build(args, seed=0, device="cuda")
    tokens = torch.cat([t for t, _ in data]).cuda()
    targets = torch.cat([y for _, y in data]).cuda()
    ref_loss = ref.forward_backward_reference(tokens, targets).item()
    model = MoEModel.build(args, seed=0, device="cuda")
    mbs = [model.new_microbatch(t.cuda(), y.cuda(), index=i, loss_scale=0.5) for i, (t, y) in enumerate(data)]
    for mb in mbs:
        run_microbatch_in_order(model, mb)
    got = (sum(mb.loss.item() for mb in mbs) / 2, {n: p.grad for n, p in model.named_parameters()})
    _assert_close((ref_loss, {n: p.grad for n, p in ref.named_parameters()}), got, rtol=1e-9)
