"""Activation manager units: pools (size classes, reuse, fences), storage-level dedup with
aliasing kept, FP8 error, debug checksums, the slowed copy lane (bitwise, only slower), the
measured saved-bytes profile."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from k3sched.config import load_config
from k3sched.cost import CostModel
from k3sched.profile import load_profile
from k3sched.tasks import Kind
from offload import ActivationManager, BufferPool, OffloadCorruption, PolicyTable, size_class
from offload.manager import KEEP, OFFLOAD, OFFLOAD_FP8
from runtime.measure import saved_bytes_profile, write_profile
from offload.quant import dequantize, quantize
from runtime.local import local_run
from runtime.options import RuntimeOptions

from conftest import FakeCtx

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.yaml"
ONE_RANK = ["parallel.pp=1", "parallel.ep=1", "parallel.microbatches=2", "model.layers=2", "model.seq_len=16",
            "model.micro_batch_size=1", "schedule.offload=all"]




def test_pool_reuses_size_classes_and_never_hands_out_a_fenced_buffer():
    assert size_class(1) == 4096 and size_class(4097) == 8192 and size_class(100_000) % 4096 == 0
    assert size_class(100_000) < 100_000 * 1.13
    pool = BufferPool("device")
    a = pool.acquire(10_000)
    pool.release(a)
    b = pool.acquire(9_000)  # same class: reused, no allocation
    assert b.data_ptr() == a.data_ptr() and pool.stats.allocs == 1 and pool.stats.reuses == 1
    copying = threading.Event()  # a copy still in flight on b
    pool.release(b, copying)
    c = pool.acquire(10_000)
    assert c.data_ptr() != b.data_ptr() and pool.stats.fenced_skips == 1 and pool.stats.allocs == 2
    copying.set()
    d = pool.acquire(10_000)
    assert d.data_ptr() == b.data_ptr()
    assert pool.stats.in_use == 2 * size_class(10_000) and pool.held() == pool.stats.in_use
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(torch.empty(4096, dtype=torch.uint8))


def test_aliased_names_are_copied_once_and_come_back_aliased():
    x = torch.randn(8, 64)
    ids = torch.arange(16)
    lc = FakeCtx(**{"shared.xn": x, "dispatch.xn": x, "dispatch.xn_t": x.t(), "router.idx": ids})
    m = ActivationManager("cpu", debug=True)
    moved = m.offload_local("s0/mb0/L1/act", lc, "s0/mb0/L1/act.offload")
    assert moved < 2 * x.numel() * 4  # x once, not three times
    assert all(t.untyped_storage().nbytes() <= t.element_size() for t in lc.t.values())  # placeholders
    assert not m.is_resident("s0/mb0/L1/act")
    m.onload_local("s0/mb0/L1/act", lc, "s0/mb0/L1/act.onload")
    assert torch.equal(lc.t["shared.xn"], x) and torch.equal(lc.t["dispatch.xn_t"], x.t())
    assert torch.equal(lc.t["router.idx"], ids)
    assert lc.t["shared.xn"].data_ptr() == lc.t["dispatch.xn"].data_ptr()  # still one storage
    m.release("s0/mb0/L1/act")
    assert m.device_pool.stats.in_use == 0 and m.host_pool.stats.in_use == 0


def test_keep_policy_leaves_a_tensor_on_the_device():
    a, b = torch.randn(64), torch.randn(64)
    lc = FakeCtx(**{"attn.q": a, "router.w": b})
    m = ActivationManager("cpu", table=PolicyTable([("router.*", KEEP), ("*", OFFLOAD)]))
    m.offload_local("x", lc)
    assert lc.t["router.w"] is b and lc.t["attn.q"].untyped_storage().nbytes() <= 4
    m.onload_local("x", lc)
    assert torch.equal(lc.t["attn.q"], a)


def test_fp8_blockwise_error_is_small_and_bounded():
    torch.manual_seed(0)
    x = torch.randn(3, 1000) * torch.logspace(-2, 2, 1000)  # tiles with very different ranges
    y = dequantize(quantize(x)).view_as(x)
    tiles = torch.nn.functional.pad(x.reshape(-1), (0, 3072 - 3000)).view(-1, 128)
    tile_max = tiles.abs().amax(1).repeat_interleave(128)[:3000].view_as(x)
    rel_to_tile = ((x - y).abs() / tile_max).max().item()
    assert rel_to_tile <= 2 ** -4  # e4m3: 3 mantissa bits, scaled per 1x128 tile
    rel = ((x - y).norm() / x.norm()).item()
    assert 0 < rel < 0.05, rel
    # composed with offload: fp8 + local host, the host copy is about a quarter of fp32
    lc = FakeCtx(**{"expert.h": x})
    m = ActivationManager("cpu", table=PolicyTable([("*", OFFLOAD_FP8)]), debug=True)
    moved = m.offload_local("x", lc)
    assert moved < x.numel() * 4 * 0.3
    m.onload_local("x", lc)
    assert torch.equal(lc.t["expert.h"], y)


def test_debug_checksum_names_task_and_tensor_on_corruption():
    lc = FakeCtx(**{"attn.q": torch.randn(256)})
    m = ActivationManager("cpu", debug=True)
    m.offload_local("s0/mb1/L0/act", lc, "s0/mb1/L0/act.offload")
    m._sets["s0/mb1/L0/act"].host[3] += 1  # a byte flips in the host copy
    with pytest.raises(OffloadCorruption, match=r"task s0/mb1/L0/act.onload: onloaded tensor attn.q differs"):
        m.onload_local("s0/mb1/L0/act", lc, "s0/mb1/L0/act.onload")


def test_slowed_copy_lane_stays_bitwise_only_slower():
    cfg = load_config(TINY, ONE_RANK)
    fast = local_run(cfg, 2, capture_grads=True)
    # checksums + residency checks on every task; every copy task sleeps 50 ms after its copy
    slow_opts = RuntimeOptions.from_env({"K3SCHED_OFFLOAD_DEBUG": "1", "K3SCHED_OFFLOAD_DELAY_S": "0.05"}, 0)
    assert (slow_opts.offload_debug, slow_opts.copy_delay_s) == (True, 0.05)
    t0 = time.perf_counter()
    slow = local_run(cfg, 2, capture_grads=True, options=slow_opts)
    took = time.perf_counter() - t0
    n_copies = len(slow.plan["stages"][0]["lanes"]["offload_local"])
    assert n_copies > 0
    assert slow.losses == fast.losses
    assert all(torch.equal(slow.grads[k], fast.grads[k]) for k in fast.grads)
    per_step = [r.wall_s for r in slow.records]
    assert min(per_step) > 0.05 * n_copies * 0.9  # the copy lane's sleeps are on the step's path
    assert took > sum(r.wall_s for r in fast.records)


def test_measured_profile_feeds_the_cost_model(tmp_path):
    cfg = load_config(TINY)
    prof = saved_bytes_profile(cfg)
    assert prof["expert.fwd"][1] > 0 and prof["attn.dx"] > 0
    path = tmp_path / "p.yaml"
    write_profile(cfg, path)
    loaded = load_profile(path)
    cm = CostModel(load_config(TINY, [f"schedule.profile={path}"]))
    assert cm.saved_bytes(Kind.EXPERT_FWD) == tuple(prof["expert.fwd"]) == loaded.saved_bytes["expert.fwd"]
    assert cm.grad_out_bytes(Kind.ATTN_DX) == prof["attn.dx"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host pool, copy streams, CUDA-event "
                                                         "fences")
def test_cuda_offload_round_trip_is_bitwise_with_pinned_host_buffers():
    dev = torch.device("cuda")
    x = torch.randn(64, 128, device=dev)
    idx = torch.arange(64, device=dev)
    xn = x.clone()
    lc = FakeCtx(**{"shared.xn": xn, "dispatch.xn": xn, "router.idx": idx.clone()})  # an alias, as moe keeps
    m = ActivationManager(dev, debug=True)
    m.offload_local("s0/mb0/L1/act", lc, "s0/mb0/L1/act.offload")
    torch.cuda.synchronize()
    assert not m.is_resident("s0/mb0/L1/act")
    m.onload_local("s0/mb0/L1/act", lc, "s0/mb0/L1/act.onload")
    torch.cuda.synchronize()
    assert lc.t["shared.xn"].is_cuda and torch.equal(lc.t["shared.xn"], x) and torch.equal(lc.t["router.idx"], idx)
    assert lc.t["shared.xn"].data_ptr() == lc.t["dispatch.xn"].data_ptr()
    m.release("s0/mb0/L1/act")


def test_memory_tracker_counts_send_buffers_in_flight_once():
    # [Note: measured memory]: a P2P send's buffer counts until the send completed, and a buffer
    # that is also a live saved tensor is not counted twice
    from offload.memory import MemoryTracker

    saved = torch.zeros(1024)
    sending = [saved, torch.zeros(2048)]
    tracker = MemoryTracker(lambda: (), lambda: (saved,), ActivationManager("cpu"), torch.device("cpu"),
                            in_flight=lambda: list(sending))
    assert tracker.sample()[1] == (1024 + 2048) * 4
    sending.clear()  # the sends completed
    assert tracker.sample()[1] == 1024 * 4 and tracker.peak_device == (1024 + 2048) * 4
