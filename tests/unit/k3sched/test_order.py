"""Rank order (``parallel.order``, k3sched/placement.py [Note: rank order]): the rank map, the
links the cost model prices from it, the plan's and compare's reports, bad values, and a torchrun
run per order on gloo giving identical losses."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from k3sched.config import ConfigError, load_config
from k3sched.cost import CostModel
from k3sched.placement import ALL_ORDERS, RankOrder, group_placement, order_error, stage_pair_crosses
from k3sched.tasks import Kind

from conftest import ROOT

TINY = ROOT / "configs" / "tiny-cpu.yaml"
K2 = ROOT / "configs" / "k2-like.yaml"


def test_default_order_is_the_old_layout():
    ro = RankOrder(3, 2, 4)
    for p, d, e in itertools.product(range(3), range(2), range(4)):
        r = (p * 2 + d) * 4 + e
        assert ro.rank_of(p, d, e) == r and ro.coords(r) == (p, d, e)


@pytest.mark.parametrize("order", ALL_ORDERS)
def test_every_order_is_a_bijection_and_groups_keep_their_coordinate_order(order):
    ro = RankOrder(3, 2, 4, order)
    coords = list(itertools.product(range(3), range(2), range(4)))
    assert sorted(ro.rank_of(*c) for c in coords) == list(range(24))
    assert all(ro.coords(ro.rank_of(*c)) == c for c in coords)
    assert ro.rank_of(0, 0, 1) == 1 if order.startswith("ep") else ro.rank_of(0, 0, 1) > 1
    # a group's local rank (its sorted position) is its own coordinate: EP chunk i goes to ep_idx i
    for g in ro.groups()["ep"]:
        assert g == sorted(g)
    for g in ro.groups()["pp"]:
        assert g == sorted(g)


@pytest.mark.parametrize("bad, says", [
    ("ep-dp-tp", "unknown dimension 'tp'"), ("pp-ep-pp", "dimension 'pp' given twice"),
    ("ep-dp", "missing dimension 'pp'"), ("EP-PP-DP-ep", "dimension 'ep' given twice")])
def test_bad_orders_are_one_line_config_errors(bad, says):
    assert says in order_error(bad)
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"parallel.order={bad}"])
    msg = str(e.value)
    assert "parallel.order" in msg and says in msg and "allowed:" in msg and "\n" not in msg


def test_cli_refuses_a_bad_order_with_exit_2_and_one_line():
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", str(TINY), "--set", "parallel.order=ep-xx-pp"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    err = (r.stdout + r.stderr).strip()
    assert "parallel.order: unknown dimension 'xx'" in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_k2_links_follow_the_order():
    """K2-like (PP 16 x EP 16 x DP 8, 8 GPUs per node): today's order puts every adjacent stage pair
    on different nodes; pp innermost keeps 7 of each 8 pairs of a column in one node and moves the
    EP groups across nodes (one rank per node)."""
    cfg = load_config(K2)
    nic = (cfg.hardware.internode_gbps, cfg.hardware.internode_latency_us)
    nvl = (cfg.hardware.nvlink_gbps, cfg.hardware.nvlink_latency_us)
    today = CostModel(cfg)
    assert [today.p2p_link(s, s + 1) for s in range(15)] == [nic] * 15
    assert today.place["ep"].ranks_per_node == 8
    pp_in = CostModel(load_config(K2, ["parallel.order=pp-ep-dp"]))
    assert [pp_in.p2p_link(s, s + 1) for s in range(15)] == [nvl] * 7 + [nic] + [nvl] * 7
    assert pp_in.p2p_link(15, 0) == nic
    assert pp_in.place["ep"].ranks_per_node == 1 and pp_in.ep_link == nic
    assert (pp_in.duration_us(Kind.FWD_RECV, stages=(0, 1)) < today.duration_us(Kind.FWD_RECV, stages=(0, 1)))
    assert pp_in.a2a_us(Kind.DISPATCH_FWD) > today.a2a_us(Kind.DISPATCH_FWD)


def test_pp_pair_crossing_counts_every_column():
    ro = RankOrder(4, 1, 2)  # ep-dp-pp: stage s on ranks 2s, 2s+1; nodes of 4 ranks
    assert [stage_pair_crosses(ro, 4, s, s + 1) for s in range(3)] == [False, True, False]
    pl = group_placement(ro, 4)
    assert (pl["p2p"].groups, pl["p2p"].crossing) == (6, 2) and not pl["ep"].crosses


def test_plan_prints_which_groups_cross_nodes_and_compare_lists_orders():
    """tiny-cpu with 2 ranks per node: ep-dp-pp keeps EP in a node and sends P2P over the NIC,
    pp-ep-dp the reverse; compare --orders lists all six with a predicted step."""
    env_set = ["--set", "hardware.gpus_per_node=2"]
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", str(TINY), *env_set], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "rank order ep-dp-pp" in r.stdout
    text = " ".join(r.stdout.split())
    assert "EP all-to-all 2 ranks within a node" in text
    assert "PP P2P 1 pairs NVLink: 0; NIC: 1 (0->1)" in text
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", str(TINY), *env_set, "--set",
                        "parallel.order=pp-ep-dp"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "EP all-to-all 2 ranks crosses nodes (2 of 2 groups; NIC; 1 of a group per node)" in text
    assert "PP P2P 1 pairs NVLink: 1 (0->1); NIC: 0" in text
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "compare", str(TINY), *env_set, "--orders"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if any(f"│ {o}" in ln for o in ALL_ORDERS)]
    assert len(lines) == 6 and "ep-dp-pp (current)" in r.stdout
    from k3sched.compare import compare_orders

    rows = {row.order: row for row in compare_orders(load_config(TINY, ["hardware.gpus_per_node=2"]))}
    assert rows["ep-dp-pp"].links["ep"] == "NVLink" and rows["pp-ep-dp"].links["ep"] == "NIC 1/node"
    assert (rows["ep-dp-pp"].p2p_nic_pairs, rows["pp-ep-dp"].p2p_nvlink_pairs) == (1, 1)
    assert rows["ep-dp-pp"].step_us != rows["pp-ep-dp"].step_us  # priced from different links
    assert rows["ep-dp-pp"].step_us == rows["ep-pp-dp"].step_us  # dp 1: the same placement


def test_default_order_is_left_out_of_plan_json():
    cfg = load_config(TINY)
    assert "order" not in cfg.to_dict()["parallel"]
    assert load_config(TINY, ["parallel.order=pp-ep-dp"]).to_dict()["parallel"]["order"] == "pp-ep-dp"


@pytest.mark.slow
def test_orders_give_identical_losses_on_gloo(tmp_path):
    """PP 2 x EP 2 on 4 gloo ranks under today's order and pp innermost: the ranks hold other
    coordinates (stage_of_rank differs), every loss is bitwise the same."""
    from runtime.launch import run_command

    runs = {}
    for order in ("ep-dp-pp", "pp-ep-dp"):
        out = tmp_path / order
        rc = run_command(TINY, [f"parallel.order={order}", "model.seq_len=16", "parallel.microbatches=2"], 2, None,
                         out, False, None, timeout_s=150.0, quiet=True)
        assert rc == 0
        runs[order] = json.loads((out / "summary.json").read_text())
    a, b = runs["ep-dp-pp"], runs["pp-ep-dp"]
    assert a["stage_of_rank"] == [0, 0, 1, 1] and b["stage_of_rank"] == [0, 1, 0, 1]
    assert len(a["losses"]) == 2 and a["losses"] == b["losses"]
