"""offload.gradshard.GradShards in one process (no torch.distributed): the device double buffer's
fences (a chunk buffer range is never rewritten while the gshard.add that reads it is pending,
for the same chunk's next group and for chunk c + 2 sharing buffer c % 2), host accumulation
across groups, the AdamW step on host shards, and a one-rank run equal to the plain path."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from k3sched.config import load_config
from k3sched.tasks import Kind
from offload.gradshard import GradShards
from offload.pool import BufferPool
from runtime.executor import PlanTask
from runtime.local import local_run

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.yaml"


def _task(kind: Kind, mb: int, layer: int, chunk: int, bucket: int | None = None) -> PlanTask:
    b = "" if bucket is None else f".b{bucket}"
    return PlanTask(f"s0/mb{mb}/L{layer}/{kind.value}{b}", kind, "x", 0, chunk, mb, layer, bucket=bucket)


def _shards(chunk_of: dict[int, int], groups_end: list[int], reduce: bool = True):
    torch.manual_seed(0)
    layers = {L: nn.Linear(4 + L, 3) for L in chunk_of}
    gs = GradShards(layers, chunk_of, is_expert=lambda n: False, device=torch.device("cpu"),
                    device_pool=BufferPool("device"), copy_delay_s=0.0, fence_timeout_s=10.0)
    lanes = {"collective": [], "compute": []}
    for L, c in chunk_of.items():
        for m in groups_end:
            if reduce:
                lanes["collective"].append(_task(Kind.GRAD_RS, m, L, c, 0))
            lanes["compute"].append(_task(Kind.GSHARD_ADD, m, L, c))
    gs.bind(lanes)
    return gs, layers


def _dw(gs: GradShards, layers, mb: int, L: int, seed: int) -> list[torch.Tensor]:
    """A fake dW task of (mb, L): accumulates a random gradient into param.grad; returns it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with gs.accumulating(mb, L):
        for _, p in sorted(layers[L].named_parameters()):
            d = torch.randn(p.shape, generator=g)
            p.grad = d.clone() if p.grad is None else p.grad + d
            out.append(d)
    return out


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _in_thread(fn, *args) -> threading.Thread:
    th = threading.Thread(target=fn, args=args, daemon=True)
    th.start()
    return th


def test_next_group_waits_for_the_pending_add_and_shards_accumulate():
    gs, layers = _shards({0: 0}, [1, 3])
    assert gs.stats.buffers == 1 and gs.group_end(0, 0) == 1 and gs.group_end(0, 2) == 3
    g0 = [a + b for a, b in zip(_dw(gs, layers, 0, 0, 1), _dw(gs, layers, 1, 0, 2))]
    gs.grad_rs(_task(Kind.GRAD_RS, 1, 0, 0, 0))
    gs.onload(_task(Kind.GSHARD_ONLOAD, 1, 0, 0))
    slot, a, b = gs.region[0]
    held = gs.buffers[slot][a:b].clone()
    assert torch.equal(held, _flat(g0))
    g1 = [a + b for a, b in zip(_dw(gs, layers, 2, 0, 3), _dw(gs, layers, 3, 0, 4))]
    # the next group's reduce-scatter would overwrite the region the pending add reads: it must wait
    th = _in_thread(gs.grad_rs, _task(Kind.GRAD_RS, 3, 0, 0, 0))
    time.sleep(0.3)
    assert th.is_alive(), "grad.rs rewrote the chunk buffer before the previous gshard.add ran"
    assert torch.equal(gs.buffers[slot][a:b], held)
    gs.add(_task(Kind.GSHARD_ADD, 1, 0, 0))
    th.join(5)
    assert not th.is_alive() and gs.stats.fence_waits == 1
    gs.offload(_task(Kind.GSHARD_OFFLOAD, 1, 0, 0))
    assert torch.equal(gs.host[0], _flat(g0))
    for k in (Kind.GSHARD_ONLOAD, Kind.GSHARD_ADD, Kind.GSHARD_OFFLOAD):
        gs.handlers()[k](_task(k, 3, 0, 0))
    assert torch.allclose(gs.host[0], _flat(g0) + _flat(g1), rtol=0, atol=1e-6)
    gs.end_step()
    # AdamW on the host shard == AdamW on the full parameters with the summed gradient
    ref = nn.Linear(4, 3)
    ref.load_state_dict(layers[0].state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for (_, p), x, y in zip(sorted(ref.named_parameters()), g0, g1):
        p.grad = x + y
    opt.step()
    gs.step()
    for (n, p), (_, q) in zip(sorted(ref.named_parameters()), sorted(layers[0].named_parameters())):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), n
    assert not gs.host[0].any()
    assert gs.host_bytes() >= 4 * 4 * gs.shard_numel[0]  # grad shard + master + two moments


def test_chunk_two_waits_for_chunk_zero_in_the_shared_buffer():
    gs, layers = _shards({0: 0, 1: 1, 2: 2}, [0])
    assert gs.stats.buffers == 2
    assert gs.region[0][0] == gs.region[2][0] == 0 and gs.region[1][0] == 1
    _dw(gs, layers, 0, 0, 1)
    gs.grad_rs(_task(Kind.GRAD_RS, 0, 0, 0, 0))
    gs.onload(_task(Kind.GSHARD_ONLOAD, 0, 0, 0))
    _dw(gs, layers, 0, 1, 2)
    gs.grad_rs(_task(Kind.GRAD_RS, 0, 1, 1, 0))  # buffer 1: free, no wait
    _dw(gs, layers, 0, 2, 3)
    th = _in_thread(gs.grad_rs, _task(Kind.GRAD_RS, 0, 2, 2, 0))  # buffer 0, overlaps layer 0's region
    time.sleep(0.3)
    assert th.is_alive()
    gs.add(_task(Kind.GSHARD_ADD, 0, 0, 0))
    th.join(5)
    assert not th.is_alive() and gs.stats.fence_waits == 1
    for L in (0, 1, 2):
        if L:
            gs.onload(_task(Kind.GSHARD_ONLOAD, 0, L, L))
            gs.add(_task(Kind.GSHARD_ADD, 0, L, L))
        gs.offload(_task(Kind.GSHARD_OFFLOAD, 0, L, L))
    assert torch.equal(gs.host[0], _flat(_dw_values(layers, 0, 1)))
    assert torch.equal(gs.host[2], _flat(_dw_values(layers, 2, 3)))


def _dw_values(layers, L: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for _, p in sorted(layers[L].named_parameters())]


def test_without_reduce_add_consumes_the_accumulator():
    gs, layers = _shards({0: 0}, [0, 1], reduce=False)
    _dw(gs, layers, 0, 0, 1)
    for m in (0, 1):
        if m:
            _dw(gs, layers, 1, 0, 2)
        for k in (Kind.GSHARD_ONLOAD, Kind.GSHARD_ADD, Kind.GSHARD_OFFLOAD):
            gs.handlers()[k](_task(k, m, 0, 0))
    want = _flat([a + b for a, b in zip(_dw_values(layers, 0, 1), _dw_values(layers, 0, 2))])
    assert torch.allclose(gs.host[0], want, rtol=0, atol=1e-6)
    assert gs.device_tensors() == [gs.buffers[0]]  # accumulators dropped once flushed


def test_one_rank_grad_offload_matches_the_plain_path():
    ov = ["parallel.pp=1", "parallel.ep=1", "model.seq_len=16", "model.micro_batch_size=1", "model.layers=2"]
    plain = local_run(load_config(TINY, ov), 2, capture_grads=True)
    sharded = local_run(load_config(TINY, ov + ["schedule.grad_offload=true"]), 2, capture_grads=True)
    kinds = {t["kind"] for ts in sharded.plan["stages"][0]["lanes"].values() for t in ts}
    assert {"gshard.onload", "gshard.add", "gshard.offload"} <= kinds
    assert sharded.losses == pytest.approx(plain.losses, rel=1e-6, abs=0)
    assert sharded.grads.keys() == plain.grads.keys()
    for k, g in plain.grads.items():
        assert (sharded.grads[k] - g).norm() <= 1e-6 * g.norm().clamp_min(1e-30), k
