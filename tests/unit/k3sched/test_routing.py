"""Node-limited routing (model.max_route_nodes) and FP8 dispatch (schedule.fp8_dispatch) in the
EP all-to-all cost ([Note: node-limited routing] in k3sched/cost.py): bytes and times follow the
formulas, defaults change nothing, and the DSv3-like config plans with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3sched.config import ConfigError, load_config
from k3sched.cost import CostModel
from k3sched.tasks import Kind

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny-cpu.yaml"
DSV3 = ROOT / "configs" / "dsv3-like.yaml"
PLAIN = ["model.max_route_nodes=", "schedule.fp8_dispatch=false"]


def _cost(*over: str) -> CostModel:
    return CostModel(load_config(DSV3, PLAIN + list(over)))


def test_unlimited_bf16_bytes_match_the_flat_formula() -> None:
    c = _cost()
    m, ep, g = c.cfg.model, c.cfg.parallel.ep, c.cfg.hardware.gpus_per_node
    w = c.a2a_wire(Kind.DISPATCH_FWD)
    per_peer = c.T * m.top_k * m.hidden * 2 / ep
    assert dict((bw, b) for b, bw in w.terms) == pytest.approx(
        {c.cfg.hardware.nvlink_gbps: (g - 1) * per_peer, c.cfg.hardware.internode_gbps: (ep - g) * per_peer})
    assert c.a2a_bytes() == int(c.T * m.top_k * m.hidden * 2 * (ep - 1) / ep)


def test_node_limit_bounds_internode_bytes() -> None:
    base, lim = _cost(), _cost("model.max_route_nodes=4")
    m, hw = base.cfg.model, base.cfg.hardware
    nodes = base.cfg.parallel.ep / hw.gpus_per_node  # 8
    for kind in (Kind.DISPATCH_FWD, Kind.COMBINE_FWD, Kind.DISPATCH_BWD, Kind.COMBINE_BWD):
        terms = {bw: b for b, bw in lim.a2a_wire(kind).terms}
        assert terms[hw.internode_gbps] == pytest.approx(base.T * m.hidden * 2 * 4 * (nodes - 1) / nodes)
        assert terms[hw.nvlink_gbps] == pytest.approx(base.T * m.hidden * 2 * m.top_k * 7 / 8)
        b_nic = {bw: b for b, bw in base.a2a_wire(kind).terms}[hw.internode_gbps]
        assert terms[hw.internode_gbps] == pytest.approx(b_nic * 4 / m.top_k)  # M / k of the copies
        # the NIC sets the time: latency steps + NIC bytes / NIC rate
        w = lim.a2a_wire(kind)
        assert lim.wire_us(w, "ep") == pytest.approx(w.steps * hw.internode_latency_us
                                                     + terms[hw.internode_gbps] / (hw.internode_gbps * 1e3))
        assert lim.duration_us(kind) < base.duration_us(kind)
    assert lim.a2a_bytes(Kind.DISPATCH_FWD) == lim.a2a_wire(Kind.DISPATCH_FWD).nbytes


def test_node_limit_needs_more_than_one_node_and_at_most_top_k() -> None:
    tiny = load_config(TINY)  # ep 2 on 4 ranks per node: one node, nothing to limit
    limited = load_config(TINY, ["model.max_route_nodes=1"])
    for kind in (Kind.DISPATCH_FWD, Kind.COMBINE_FWD):
        assert CostModel(limited).a2a_wire(kind) == CostModel(tiny).a2a_wire(kind)
    with pytest.raises(ConfigError, match="max_route_nodes"):
        load_config(TINY, ["model.max_route_nodes=3"])  # top_k 2
    with pytest.raises(ConfigError, match="max_route_nodes"):
        load_config(TINY, ["model.max_route_nodes=0"])


def test_fp8_dispatch_halves_the_dispatch_payload_only() -> None:
    base, fp8 = _cost(), _cost("schedule.fp8_dispatch=true")
    ratio = (1 + 4 / 128) / 2
    for kind in (Kind.DISPATCH_FWD, Kind.DISPATCH_RE, Kind.COMBINE_BWD):
        assert fp8.a2a_payload_bytes(kind) == 1 + 4 / 128
        assert fp8.a2a_bytes(kind) == pytest.approx(base.a2a_bytes(kind) * ratio, rel=1e-6)
        lat = fp8.a2a_wire(kind).steps * fp8.cfg.hardware.internode_latency_us
        assert fp8.a2a_us(kind) - lat == pytest.approx((base.a2a_us(kind) - lat) * ratio)
    for kind in (Kind.COMBINE_FWD, Kind.DISPATCH_BWD):
        assert fp8.a2a_wire(kind) == base.a2a_wire(kind)


def test_defaults_leave_plan_json_config_unchanged() -> None:
    cfg = load_config(TINY)
    d = cfg.to_dict()
    assert "max_route_nodes" not in d["model"] and "fp8_dispatch" not in d["schedule"]
    d2 = load_config(TINY, ["model.max_route_nodes=2", "schedule.fp8_dispatch=true"]).to_dict()
    assert d2["model"]["max_route_nodes"] == 2 and d2["schedule"]["fp8_dispatch"] is True


def test_dsv3_like_runs_as_deepseek_did() -> None:
    cfg = load_config(DSV3)
    assert cfg.model.max_route_nodes == 4 and cfg.schedule.fp8_dispatch
    assert CostModel(cfg).a2a_us(Kind.DISPATCH_FWD) < _cost().a2a_us(Kind.DISPATCH_FWD) / 3


def test_plan_tasks_carry_each_all_to_all_kinds_own_bytes() -> None:
    """The bytes a dispatch task moves in the plan are its kind's (FP8 under fp8_dispatch), not
    the combine's (model dtype): calibration and the validator read them."""
    from k3sched.planner import plan

    p = plan(load_config(TINY, ["schedule.fp8_dispatch=true"]))
    cost = CostModel(p.cfg)
    seen = {}
    for t in p.tasks.values():
        if t.kind in (Kind.DISPATCH_FWD, Kind.COMBINE_FWD, Kind.COMBINE_BWD, Kind.DISPATCH_BWD):
            seen.setdefault(t.kind, set()).add(t.bytes)
    assert seen[Kind.DISPATCH_FWD] == {cost.a2a_bytes(Kind.DISPATCH_FWD)}
    assert seen[Kind.COMBINE_FWD] == {cost.a2a_bytes(Kind.COMBINE_FWD)}
    assert cost.a2a_bytes(Kind.DISPATCH_FWD) < cost.a2a_bytes(Kind.COMBINE_FWD)
