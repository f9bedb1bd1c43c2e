"""Expert load balance without launching ranks (k3sched/balance.py, moe/model.py router skew and
replica split, k3sched/cost.py skew factors, k3sched balance / plan front doors): Zipf shares, the
EPLB-style placement (flat and hierarchical), the busiest-rank factors of the cost model, the
deterministic split of an expert's tokens over its replicas, the skewed router against the plain
autograd reference, and one-line exit-2 errors for bad placements and runs without routing stats.
The runs with replicas are in tests/e2e/test_balance_run.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3sched.balance import (Placement, balance, contiguous, imbalance, load_factors, placement_for, routing_imbalance,
                             zipf_shares)
from k3sched.config import ConfigError, load_config
from k3sched.cost import CostModel
from k3sched.tasks import Kind

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3sched.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def _one_line_exit_2(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


# -- shares and placements -----------------------------------------------------------------------

def test_zipf_shares() -> None:
    assert zipf_shares(8, 0.0) == pytest.approx([1 / 8] * 8)
    s = zipf_shares(8, 1.5)
    assert sum(s) == pytest.approx(1.0)
    assert s[0] / s[3] == pytest.approx(4 ** 1.5)
    assert all(a > b for a, b in zip(s, s[1:]))


def _valid(pl: Placement, E: int, ep: int, redundant: int) -> None:
    assert pl.ep == ep and all(len(row) == E // ep + redundant for row in pl.slots)
    assert all(len(set(row)) == len(row) for row in pl.slots)  # a replica is on another rank
    assert sorted({e for row in pl.slots for e in row}) == list(range(E))


@pytest.mark.parametrize("skew", [0.0, 1.0, 1.5, 3.0])
@pytest.mark.parametrize("ep,redundant", [(2, 1), (2, 2), (4, 1), (8, 1)])
def test_balance_places_every_expert_and_does_not_worsen(skew: float, ep: int, redundant: int) -> None:
    E = 16
    loads = [1000 * s for s in zipf_shares(E, skew)]
    pl = balance(loads, ep, redundant)
    _valid(pl, E, ep, redundant)
    before = imbalance(contiguous(E, ep).rank_loads(loads))
    after = imbalance(pl.rank_loads(loads))
    assert after <= before + 1e-12
    assert pl == balance(loads, ep, redundant)  # deterministic
    if skew == 1.5 and ep == 2:
        assert after < 1.1 < before  # what the redundant slots are for


def test_balance_replicates_the_heaviest_experts() -> None:
    loads = [100.0, 50.0, 10.0, 10.0, 10.0, 10.0, 5.0, 5.0]
    pl = balance(loads, 2, 1)
    assert pl.replicated() == [0, 1]
    assert pl.rank_loads(loads) == pytest.approx([100.0, 100.0])


def test_hierarchical_keeps_replicas_inside_a_node() -> None:
    E, ep, g = 16, 4, 2
    loads = [1000 * s for s in zipf_shares(E, 1.5)]
    pl = balance(loads, ep, 2, gpus_per_node=g)
    _valid(pl, E, ep, 2)
    node_of = {}
    for r, row in enumerate(pl.slots):
        for e in row:
            node_of.setdefault(e, set()).add(r // g)
    assert all(len(n) == 1 for n in node_of.values())  # no expert spans nodes
    assert imbalance(pl.rank_loads(loads)) < imbalance(contiguous(E, ep).rank_loads(loads))
    flat = balance(loads, ep, 2, gpus_per_node=8)  # one node: the flat algorithm
    assert imbalance(flat.rank_loads(loads)) <= imbalance(pl.rank_loads(loads)) + 1e-12
    # one rank per node, or a node too small for its replicas: balanced over the whole group
    assert balance(loads, ep, 2, gpus_per_node=1) == flat
    assert balance(loads, ep, 7, gpus_per_node=2) == balance(loads, ep, 7)


def test_balance_refuses_more_slots_than_experts() -> None:
    with pytest.raises(ValueError, match="redundant"):
        balance([1.0] * 8, 2, 5)


# -- configs and the cost model --------------------------------------------------------------------

def test_defaults_change_nothing() -> None:
    cfg = load_config(TINY)
    assert placement_for(cfg) == contiguous(8, 2)
    assert load_factors(cfg) == (1.0, 1.0)
    dumped = cfg.to_dict()
    assert "router_skew" not in dumped["model"] and "redundant_experts" not in dumped["parallel"]
    assert "expert_placement" not in dumped["schedule"]


def test_skew_costs_the_busiest_rank_and_replicas_recover_it() -> None:
    flat = CostModel(load_config(TINY))
    skew = CostModel(load_config(TINY, ["model.router_skew=1.5"]))
    s = zipf_shares(8, 1.5)
    hot = sum(s[:4])  # rank 0 holds experts 0..3
    gemm, a2a = skew.skew_factors()
    assert gemm == pytest.approx(2 * hot) and a2a == pytest.approx(max(hot, 1 - (1 - hot)) / 0.5)
    assert skew.flops(Kind.EXPERT_FWD) == pytest.approx(flat.flops(Kind.EXPERT_FWD) * gemm)
    assert skew.a2a_wire(Kind.DISPATCH_FWD).nbytes == pytest.approx(flat.a2a_wire(Kind.DISPATCH_FWD).nbytes * a2a,
                                                                     rel=1e-6)
    rep = CostModel(load_config(TINY, ["model.router_skew=1.5", "parallel.redundant_experts=1"]))
    assert 1.0 <= rep.skew_factors()[0] < 1.1
    assert rep.expert_params_local() == flat.expert_params_local() * 5 // 4
    # the replicas' gradients are summed in grad.rs: more bytes than without
    assert rep.grad_wire(1).nbytes > flat.grad_wire(1).nbytes


def test_routing_imbalance_is_the_mean_busiest_rank_share_per_call() -> None:
    # two calls over 8 experts on 2 ranks (experts 0-3 | 4-7): 8 vs 8 tokens, then 12 vs 4
    calls = [[2, 2, 2, 2, 2, 2, 2, 2], [3, 3, 3, 3, 1, 1, 1, 1]]
    assert routing_imbalance(calls, 2) == pytest.approx((1.0 + 12 / 8) / 2)
    assert routing_imbalance(calls, 1) == 1.0 and routing_imbalance([], 2) == 1.0
    assert routing_imbalance([[0] * 8, [2] * 8], 4) == 1.0  # a call that routed nothing does not count
    # calls that lean opposite ways sum to a balanced step, but each of them waits on its busiest rank
    assert routing_imbalance([[3, 3, 3, 3, 1, 1, 1, 1], [1, 1, 1, 1, 3, 3, 3, 3]], 2) == pytest.approx(1.5)


def test_routing_imbalance_scales_the_busiest_rank_on_top_of_the_modelled_loads() -> None:
    flat = CostModel(load_config(TINY))
    noisy = CostModel(load_config(TINY, ["model.routing_imbalance=1.2"]))
    assert noisy.skew_factors() == pytest.approx((1.2, 1.2))
    assert noisy.flops(Kind.EXPERT_FWD) == pytest.approx(flat.flops(Kind.EXPERT_FWD) * 1.2)
    assert noisy.a2a_wire(Kind.COMBINE_FWD).nbytes == pytest.approx(flat.a2a_wire(Kind.COMBINE_FWD).nbytes * 1.2,
                                                                     rel=1e-5)
    both = load_factors(load_config(TINY, ["model.router_skew=1.5", "model.routing_imbalance=1.2"]))
    alone = load_factors(load_config(TINY, ["model.router_skew=1.5"]))
    assert both == pytest.approx((min(2.0, alone[0] * 1.2), min(2.0, alone[1] * 1.2)))
    assert load_factors(load_config(TINY, ["model.routing_imbalance=3"])) == (2.0, 2.0)  # one rank gets all
    assert load_factors(load_config(TINY, ["parallel.ep=1", "model.routing_imbalance=1.5"])) == (1.0, 1.0)
    assert "routing_imbalance" not in load_config(TINY).to_dict()["model"]  # plan.json as before when unset
    assert load_config(TINY, ["model.routing_imbalance=1.2"]).to_dict()["model"]["routing_imbalance"] == 1.2


def test_config_refusals() -> None:
    with pytest.raises(ConfigError, match="parallel.redundant_experts.*ep"):
        load_config(TINY, ["parallel.ep=1", "parallel.redundant_experts=1"])
    with pytest.raises(ConfigError, match="parallel.redundant_experts: at most"):
        load_config(TINY, ["parallel.redundant_experts=5"])
    with pytest.raises(ConfigError, match="grad_offload"):
        load_config(TINY, ["parallel.redundant_experts=1", "schedule.grad_offload=true"])
    with pytest.raises(ConfigError, match="model.router_skew"):
        load_config(TINY, ["model.router_skew=-1"])
    with pytest.raises(ConfigError, match="model.routing_imbalance"):
        load_config(TINY, ["model.routing_imbalance=0.9"])


# -- placement files at the front door --------------------------------------------------------------

GOOD = {"format": "k3sched.placement/1", "experts": 8, "ep": 2, "redundant": 1,
        "slots": [[0, 1, 2, 6, 7], [0, 1, 3, 4, 5]], "loads": [50, 20, 8, 5, 5, 4, 4, 4]}


def _write(tmp: Path, doc) -> Path:
    p = tmp / "placement.yaml"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def test_good_placement_plans_with_its_loads(tmp_path: Path) -> None:
    p = _write(tmp_path, GOOD)
    cfg = load_config(TINY, ["parallel.redundant_experts=1", f"schedule.expert_placement={p}"])
    assert placement_for(cfg).slots == tuple(map(tuple, GOOD["slots"]))
    shares = placement_for(cfg).rank_shares(GOOD["loads"])
    assert load_factors(cfg)[0] == pytest.approx(2 * max(shares))
    from k3sched.planner import plan

    assert plan(cfg).metrics.step_time_us > 0


@pytest.mark.parametrize("doc,words", [
    ("slots: [[0, 1", ["placement.yaml"]),  # not YAML
    ({"slots": [[0]]}, ["format"]),
    ({**GOOD, "slots": [[0, 1, 2, 6, 9], [0, 1, 3, 4, 5]]}, ["slots[0][4]", "0..7", "9"]),  # no expert 9
    ({**GOOD, "slots": [[0, 1, 2, 6], [0, 1, 3, 4, 5]]}, ["slots[0]", "5 experts", "4 slots"]),  # wrong slot count
    ({**GOOD, "slots": [[0, 1, 2, 6, 7]]}, ["slots", "2 lists"]),
    ({**GOOD, "slots": [[0, 1, 2, 6, 6], [0, 1, 3, 4, 5]]}, ["expert 6 twice"]),
    ({**GOOD, "slots": [[0, 1, 2, 6, 3], [0, 1, 3, 4, 5]]}, ["expert 7 has no slot"]),
    ({**GOOD, "redundant": 2}, ["redundant", "the config has 1"]),
    ({**GOOD, "loads": [1, 2]}, ["loads"]),
    ({**GOOD, "extra": 1}, ["unknown field 'extra'"]),
])
def test_bad_placement_is_a_one_line_config_error(tmp_path: Path, doc, words: list[str]) -> None:
    p = _write(tmp_path, doc)
    cfg = load_config(TINY, ["parallel.redundant_experts=1", f"schedule.expert_placement={p}"])
    with pytest.raises(ConfigError) as err:
        CostModel(cfg).flops(Kind.EXPERT_FWD)  # the planner reads the file when it costs the experts
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("schedule.expert_placement: "), msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("doc", [GOOD["slots"], {**GOOD, "slots": [[0, 1, 2, 6, 9], [0, 1, 3, 4, 5]]},
                                 {**GOOD, "slots": [[0, 1, 2, 6], [0, 1, 3, 4, 5]]}],
                         ids=["malformed", "unknown-expert", "does-not-fit"])
def test_bad_placement_is_one_line_exit_2(tmp_path: Path, doc) -> None:
    p = _write(tmp_path, doc)
    r = _cli("plan", TINY, "--set", "parallel.redundant_experts=1", "--set", f"schedule.expert_placement={p}")
    _one_line_exit_2(r, "schedule.expert_placement")


def test_missing_placement_file_is_one_line_exit_2(tmp_path: Path) -> None:
    r = _cli("plan", TINY, "--set", f"schedule.expert_placement={tmp_path / 'nope.yaml'}")
    _one_line_exit_2(r, "nope.yaml")


# -- k3sched balance on summaries -------------------------------------------------------------------

def _summary(tmp: Path, routing: dict | None) -> Path:
    doc = {"format": "k3sched.run/1", "config": str(TINY), "overrides": [], "measured_step_time_us": 1000.0}
    if routing is not None:
        doc["routing"] = routing
    (tmp / "summary.json").write_text(json.dumps(doc))
    return tmp


def test_balance_without_routing_stats_says_so(tmp_path: Path) -> None:
    r = _cli("balance", _summary(tmp_path, None), "--redundant", "1")
    _one_line_exit_2(r, "no routing statistics")


def test_balance_prints_before_and_after_and_writes_a_plannable_file(tmp_path: Path) -> None:
    tpe = [[[3900, 2000, 770, 610, 320, 230, 310, 40]] * 3] * 2  # [step][layer][expert]
    routing = {"experts": 8, "ep": 2, "slots": [[0, 1, 2, 3], [4, 5, 6, 7]], "tokens_per_expert": tpe}
    out = tmp_path / "p.yaml"
    r = _cli("balance", _summary(tmp_path, routing), "--redundant", "1", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "before 1.780, after 1.005" in r.stdout, r.stdout
    cfg = load_config(TINY, ["model.router_skew=1.5", "parallel.redundant_experts=1",
                             f"schedule.expert_placement={out}"])
    assert placement_for(cfg).replicated() == [0, 1] and load_factors(cfg)[0] < 1.01
    r = _cli("balance", tmp_path, "--redundant", "9")
    _one_line_exit_2(r, "--redundant")


# -- the model: skewed router and replica split ----------------------------------------------------

def test_skewed_router_matches_reference_and_skews() -> None:
    import torch

    from moe import MoEModel, MoEModelArgs
    from moe.taskgraph import run_microbatch_in_order

    args = MoEModelArgs(layers=2, hidden=32, heads=4, experts=8, top_k=2, expert_hidden=16, seq_len=16,
                        router_skew=1.5, dtype="float64")
    model = MoEModel.build(args, seed=3)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, args.vocab, (4, 16), generator=g)
    tgt = torch.randint(0, args.vocab, (4, 16), generator=g)
    ref = model.reference_loss(tok, tgt)
    loss = run_microbatch_in_order(model, model.new_microbatch(tok, tgt))
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12, abs=0)
    counts = model.layers[0].routed_E
    assert int(counts.sum()) == 4 * 16 * 2
    assert counts[0] > counts[4] > 0 or counts[0] > 3 * counts[4:].sum()  # expert 0 is hot
    flat = MoEModel.build(MoEModelArgs(**{**args.__dict__, "router_skew": 0.0}), seed=3)
    run_microbatch_in_order(flat, flat.new_microbatch(tok, tgt))
    assert float(flat.layers[0].routed_E.max()) < float(counts.max())


def test_replica_split_is_even_and_deterministic() -> None:
    import torch

    from moe import MoEModelArgs
    from moe.model import Block

    args = MoEModelArgs(layers=1, experts=8, top_k=2)
    slots = ((0, 1, 2, 6, 7), (0, 1, 3, 4, 5))
    block = Block(args, 0, 0, 2, None, slots)
    g = torch.Generator().manual_seed(1)
    flat_P = torch.cat([torch.zeros(7, dtype=torch.int64), torch.randint(0, 8, (41,), generator=g)])
    flat_P = flat_P[torch.randperm(48, generator=g)]
    counts_E = torch.bincount(flat_P, minlength=8)
    slot_P = block.physical_slots(flat_P, counts_E)
    assert torch.equal(slot_P, block.physical_slots(flat_P, counts_E))
    L = 5
    expert_of = {r * L + s: e for r, row in enumerate(slots) for s, e in enumerate(row)}
    assert all(expert_of[int(g_)] == int(e) for g_, e in zip(slot_P, flat_P))  # a replica of its own expert
    per_slot = torch.bincount(slot_P, minlength=10)
    for e in (0, 1):  # replicated: on slots (0, e) and (1, e)
        a, b = int(per_slot[e]), int(per_slot[L + e])
        assert a + b == int(counts_E[e]) and abs(a - b) <= 1
    # token order: the first tokens of expert 0 go to the first replica (rank 0)
    first = [int(g_) for g_, e in zip(slot_P, flat_P) if int(e) == 0]
    assert first == sorted(first)
