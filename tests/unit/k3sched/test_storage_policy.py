"""``schedule.storage``: storage policies per sub-op from the config ([Note: storage policies from
the config] in k3sched/config.py), costed by the planner and applied by the runtime's policy table
with the same rules."""

from __future__ import annotations

import pytest
import torch

from conftest import CONFIGS, FakeCtx, one_line
from k3sched.config import STORAGE_OPS, ConfigError, load_config
from k3sched.cost import CostModel
from k3sched.graph import OffloadChoice, build_step
from k3sched.planner import plan
from k3sched.planfile import plan_to_json
from k3sched.tasks import Kind

TINY = CONFIGS / "tiny-cpu.yaml"
ONE_RANK = ["parallel.pp=1", "parallel.ep=1", "parallel.microbatches=2", "model.layers=2", "model.seq_len=16",
            "model.micro_batch_size=1", "schedule.offload=all"]
LAYER_KINDS = (Kind.ATTN_FWD, Kind.ROUTER_FWD, Kind.DISPATCH_FWD, Kind.EXPERT_FWD, Kind.SHARED_FWD, Kind.COMBINE_FWD)


def _set_bytes(cfg) -> int:
    """Bytes of one MoE layer's offload set in the step graph (every set of a layer is the same)."""
    g = build_step(cfg, OffloadChoice(everything=True))
    return max(g.offload_sets.values())


def test_storage_ops_are_the_moe_sub_ops():
    from moe.context import OPS

    assert STORAGE_OPS == OPS


@pytest.mark.parametrize("value, says", [
    ("{attn.q: keep}", "per-tensor patterns are not modelled"),
    ("{nope: keep}", "'nope' matches no sub-op; allowed: globs over attn, router"),
    ("{attn: stash}", "schedule.storage"),
])
def test_bad_rules_are_one_line(value, says):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"schedule.storage={value}"])
    one_line(str(e.value), says)


def test_kept_ops_stay_out_of_the_offload_set_and_fp8_ops_shrink():
    base = load_config(TINY, ONE_RANK)
    cost = CostModel(base)
    full = _set_bytes(base)
    assert full == sum(sum(cost.saved_bytes(k)) for k in LAYER_KINDS)
    kept = load_config(TINY, ONE_RANK + ["schedule.storage={attn: keep, 'sh*': keep}"])
    assert _set_bytes(kept) == full - sum(cost.saved_bytes(Kind.ATTN_FWD)) - sum(cost.saved_bytes(Kind.SHARED_FWD))
    fp8 = load_config(TINY, ONE_RANK + ["schedule.storage={expert: offload+fp8}"])
    c8 = CostModel(fp8)
    assert sum(c8.saved_bytes(Kind.EXPERT_FWD)) < 0.6 * sum(cost.saved_bytes(Kind.EXPERT_FWD))
    assert c8.saved_bytes(Kind.ATTN_FWD) == cost.saved_bytes(Kind.ATTN_FWD)  # first match only
    # under act_quant fp8 a rule still wins over the default
    q = CostModel(load_config(TINY, ONE_RANK + ["schedule.act_quant=fp8", "schedule.storage={attn: offload}"]))
    assert q.saved_bytes(Kind.ATTN_FWD) == cost.saved_bytes(Kind.ATTN_FWD)
    assert q.stored_fp8(Kind.EXPERT_FWD) and not q.stored_fp8(Kind.ATTN_FWD)


def test_keeping_everything_leaves_nothing_to_offload_and_costs_peak_memory():
    off = plan(load_config(TINY, ONE_RANK))
    keep = plan(load_config(TINY, ONE_RANK + ["schedule.storage={'*': keep}"]))
    assert off.metrics.offloaded_sets["local"] > 0 and keep.metrics.offloaded_sets["total"] == 0
    assert max(keep.metrics.peak_device_bytes) > max(off.metrics.peak_device_bytes)
    assert plan_to_json(keep)["config"]["schedule"]["storage"] == {"*": "keep"}
    assert "storage" not in plan_to_json(off)["config"]["schedule"]  # left out when empty


def test_the_runtime_table_applies_the_same_rules():
    from offload import ActivationManager, PolicyTable
    from offload.manager import KEEP, OFFLOAD, OFFLOAD_FP8

    cfg = load_config(TINY, ONE_RANK + ["schedule.act_quant=fp8", "schedule.storage={attn: keep, 'r*': offload}"])
    table = PolicyTable.from_config(cfg)
    assert [table.policy(n) for n in ("attn.q", "router.w", "expert.h")] == [KEEP, OFFLOAD, OFFLOAD_FP8]
    a, b = torch.randn(64), torch.randn(64)
    lc = FakeCtx(**{"attn.q": a, "router.w": b})
    m = ActivationManager("cpu", table=table)
    m.offload_local("x", lc)
    assert lc.t["attn.q"] is a and lc.t["router.w"].untyped_storage().nbytes() <= 4  # kept / offloaded
    m.onload_local("x", lc)
    assert torch.equal(lc.t["router.w"], b)


def test_a_mixed_policy_trains_exactly_like_offloading_everything():
    from runtime.local import local_run

    ref = local_run(load_config(TINY, ONE_RANK), 2, capture_grads=True)
    mixed = local_run(load_config(TINY, ONE_RANK + ["schedule.storage={attn: keep, expert: keep}"]), 2,
                      capture_grads=True)
    assert mixed.losses == ref.losses
    assert all(torch.equal(mixed.grads[k], ref.grads[k]) for k in ref.grads)
