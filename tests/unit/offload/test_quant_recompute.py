"""Storage policies the planner models, executed by the runtime:

* ``schedule.act_quant: fp8`` on sets the plan keeps on the device ([Note: FP8 on the device] in
  ``offload/manager.py``): quantized after the layer's last forward task, read back per backward
  task; trains close to full precision with a lower measured peak; off by default.
* ``schedule.recompute: true`` (element-wise recompute in ``moe``, [Note: element-wise recompute]
  in ``moe/model.py``): bitwise identical to storing, fewer saved bytes.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from k3sched.config import load_config
from k3sched.planner import plan
from k3sched.planfile import plan_to_json
from offload import ActivationManager, PolicyTable
from offload.manager import OFFLOAD_FP8
from offload.quant import dequantize, quantize
from k3sched.lowering import stage_lanes
from runtime.groups import Layout, build_groups
from runtime.local import local_run
from runtime.options import RuntimeOptions
from runtime.stage import StageRunner, StageSpec

from conftest import FakeCtx

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.yaml"
# One rank, GPipe (every micro-batch's sets in flight at the end of the forward), WGrad right
# behind its dX (so the backward phase does not pile up grad_outputs and dominate the peak).
ONE_RANK = ["parallel.pp=1", "parallel.ep=1", "parallel.microbatches=4", "model.layers=2", "model.seq_len=64",
            "model.micro_batch_size=2", "model.vocab=64", "schedule.offload=none", "schedule.pipeline=gpipe",
            "schedule.wgrad_lag=0"]




def _train(overrides: list[str], steps: int = 3, debug: bool = False):
    """Train a one-rank plan in-process (``runtime.local.local_run``); returns (losses, step-0
    grads, measured peaks, runner)."""
    cfg = load_config(TINY, ONE_RANK + overrides)
    run = local_run(cfg, steps, seed=0, capture_grads=True, options=RuntimeOptions(offload_debug=debug))
    return run.losses, run.grads, run.peaks, run.runner


# -- (a) FP8 on the device -------------------------------------------------------------------------
def test_quantize_resident_keeps_indices_exact_and_reads_back_per_name():
    torch.manual_seed(0)
    x = torch.randn(64, 128) * 3
    idx = torch.arange(40)
    lc = FakeCtx(**{"shared.xn": x, "router.xn": x, "shared.h": torch.randn(3000), "router.idx": idx})
    m = ActivationManager("cpu", table=PolicyTable([("*", OFFLOAD_FP8)]), debug=True)
    nbytes = m.quantize_resident("b", lc, "L1/combine.fwd")
    assert 0 < nbytes < (x.numel() + 3000) * 4 * 0.3  # FP8 + scales: about a quarter of fp32
    assert lc.t["router.idx"] is idx  # integer storages are never touched
    assert lc.t["shared.xn"].untyped_storage().nbytes() <= 4 and not m.is_resident("b")
    assert not m.resident_for("b", "router") and m.resident_for("b", "attn")
    m.dequantize_resident("b", lc, "L1/router.bwd", "router", names={"router.xn"})  # one storage, two names
    assert torch.equal(lc.t["router.xn"], dequantize(quantize(x)).view_as(x))
    assert lc.t["shared.xn"].data_ptr() == lc.t["router.xn"].data_ptr()  # aliases come back aliased
    assert lc.t["shared.h"].untyped_storage().nbytes() <= 4 and m.device_pool.stats.in_use > 0  # still FP8
    m.dequantize_resident("b", lc, "L1/shared.dw", "shared")
    assert m.is_resident("b") and m.device_pool.stats.in_use == 0  # FP8 buffer back in the pool
    m.release("b", lc)
    m.end_step()


def test_fp8_on_device_is_off_by_default_and_skips_offloaded_sets():
    for over, expect in (([], False), (["schedule.act_quant=fp8"], True),
                         (["schedule.act_quant=fp8", "schedule.offload=all"], False)):
        cfg = load_config(TINY, ONE_RANK + over)
        runner = StageRunner(cfg, StageSpec.of(cfg, 0), build_groups(Layout(1, 1, 1, 0)))
        runner.bind_plan(stage_lanes(plan_to_json(plan(cfg, None)), 0))
        assert bool(runner.offload._quantized) is expect, over
        assert not runner.offload._quantized & runner.offload._offloaded


def test_fp8_on_device_trains_close_to_fp32_with_a_lower_peak():
    ref_losses, ref_grads, ref_peaks, _ = _train([])
    losses, grads, peaks, runner = _train(["schedule.act_quant=fp8"], debug=True)  # checksums + residency checks
    assert all(math.isfinite(v) for v in losses)
    # step 0's loss comes before any backward read of a saved tensor: identical
    assert losses[0] == ref_losses[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    assert max(rel) < 1e-2, rel  # measured: 0, 8.8e-4, 5.1e-4
    num = sum(float((grads[k] - ref_grads[k]).double().pow(2).sum()) for k in ref_grads)
    den = sum(float(ref_grads[k].double().pow(2).sum()) for k in ref_grads)
    grad_rel = math.sqrt(num / den)
    # e4m3 (3 mantissa bits) on every saved float; deterministic on CPU: measured 0.0898
    assert 0.06 < grad_rel < 0.11, grad_rel
    assert max(peaks) < 0.8 * max(ref_peaks), (peaks, ref_peaks)  # measured: 5.9 vs 10.2 MiB (0.58)
    assert runner.acts.device_pool.stats.in_use == 0


# -- (b) element-wise recompute --------------------------------------------------------------------
RC_ARGS = dict(layers=3, dense_layers=1, hidden=32, heads=2, experts=4, top_k=2, shared_experts=1, expert_hidden=16,
               dense_hidden=48, vocab=32, seq_len=16, dtype="float32")


def _split_run(recompute: bool, dispatch_recompute: bool):
    from moe import MoEModel, MoEModelArgs, microbatch_tasks, run_tasks

    args = MoEModelArgs(**RC_ARGS, recompute=recompute, dispatch_recompute=dispatch_recompute)
    model = MoEModel.build(args, seed=0)
    g = torch.Generator().manual_seed(1)
    mbs = [model.new_microbatch(torch.randint(0, 32, (2, 16), generator=g), torch.randint(0, 32, (2, 16), generator=g),
                                index=i, loss_scale=0.5) for i in range(2)]
    tasks = microbatch_tasks(args)
    saved = []
    for mb in mbs:
        run_tasks(model, mb, tasks.forward)
        saved.append(mb.saved_nbytes())
    for mb in mbs:  # every dX before any dW: WGrad inputs must survive the dX task
        run_tasks(model, mb, tasks.backward_dx)
    for mb in mbs:
        run_tasks(model, mb, tasks.wgrad)
        assert mb.all_saved_tensors() == {}
    return [mb.loss.item() for mb in mbs], {n: p.grad for n, p in model.named_parameters()}, saved


@pytest.mark.parametrize("dispatch_recompute", [False, True], ids=["keep", "dispatch_re"])
def test_elementwise_recompute_is_bitwise_and_saves_bytes(dispatch_recompute):
    loss, grads, saved = _split_run(False, dispatch_recompute)
    loss_rc, grads_rc, saved_rc = _split_run(True, dispatch_recompute)
    assert loss_rc == loss
    assert grads.keys() == grads_rc.keys()
    for k in grads:
        assert torch.equal(grads[k], grads_rc[k]), k
    assert max(saved_rc) < 0.75 * min(saved)  # measured: 173764 vs 255684 bytes after the forward (0.68)


def test_recompute_profile_and_runtime_follow_the_config():
    from runtime.measure import saved_bytes_profile

    on = saved_bytes_profile(load_config(TINY, ["schedule.recompute=true"]))
    off = saved_bytes_profile(load_config(TINY))
    for kind in ("attn.fwd", "mlp.fwd", "shared.fwd", "expert.fwd", "head.fwd"):
        assert on[kind][0] == off[kind][0] and on[kind][1] < off[kind][1], kind  # w kept, x smaller
        assert on[kind.replace("fwd", "dx")] == off[kind.replace("fwd", "dx")]  # after dX: the same
    # measured on tiny-cpu (bytes, x part): attn 667648 -> 274432, mlp 1572864 -> 524288,
    # shared 1179648 -> 655360, expert 2375680 -> 1327104
    assert on["mlp.fwd"][1] * 3 == off["mlp.fwd"][1]
    # the runtime builds its model from the config, and trains bitwise like without recompute
    ref = _train([], steps=2)
    got = _train(["schedule.recompute=true"], steps=2)
    assert got[3].args.recompute and not ref[3].args.recompute
    assert got[0] == ref[0]
    assert all(torch.equal(got[1][k], ref[1][k]) for k in ref[1])
    assert max(got[2]) < max(ref[2])
