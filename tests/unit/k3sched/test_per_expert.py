"""[Note: per-expert cost] in k3sched/cost.py: an expert op's profiled time (every expert on one
rank) is a part per local expert (``per_expert_us``) plus a part that scales with the tokens; a
rank of ``ep`` ranks pays the token part times the busiest rank's factor and the per-expert part
for its own slots. The probe measures it from a second operator profile with one EP rank's
experts; calibration converts a source's spans back to the profile's terms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from k3sched.config import ConfigError, load_config
from k3sched.cost import CostModel
from k3sched.planner import plan
from k3sched.profile import load_profile
from k3sched.tasks import Kind

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"
BASE = ["model.layers=4", "parallel.microbatches=4", "schedule.offload=none", "hardware.gpus_per_node=1",
        "hardware.internode_gbps=0.05"]
EP2 = ["parallel.pp=1", "parallel.ep=2"]
DURATIONS = {"expert.fwd": 14400.0, "expert.dx": 15300.0, "expert.dw": 16300.0, "attn.fwd": 6000.0}
PER_EXPERT = {"expert.fwd": 225.0, "expert.dx": 450.0, "expert.dw": 1125.0}


def _profile(tmp_path: Path, per_expert: dict | None = PER_EXPERT, name: str = "ops.yaml") -> Path:
    doc = {"format": "k3sched.profile/1", "durations_us": DURATIONS}
    if per_expert is not None:
        doc["per_expert_us"] = per_expert
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc))
    return p


def _model(extra: list[str], prof: Path) -> CostModel:
    return CostModel(load_config(TINY, BASE + extra + [f"schedule.profile={prof}"]))


def test_one_rank_holding_every_expert_pays_the_profiled_time(tmp_path):
    m = _model(["parallel.pp=2", "parallel.ep=1"], _profile(tmp_path))
    assert m.local_experts() == 8
    for k, d in DURATIONS.items():
        assert m._one_core_us(Kind(k), None, 0) == pytest.approx(d)


@pytest.mark.parametrize("imbalance", [1.0, 1.2])
def test_an_ep_rank_pays_its_tokens_at_the_busiest_factor_and_its_own_experts(tmp_path, imbalance):
    m = _model(EP2 + [f"model.routing_imbalance={imbalance}"], _profile(tmp_path))
    old = _model(EP2 + [f"model.routing_imbalance={imbalance}"], _profile(tmp_path, None, "plain.yaml"))
    skew = m.skew_factors()[0]
    assert skew == pytest.approx(imbalance) and m.local_experts() == 4
    for k, per in PER_EXPERT.items():
        want = (DURATIONS[k] - 8 * per) * skew + 4 * per
        assert m._one_core_us(Kind(k), None, 0) == pytest.approx(want)
        assert old._one_core_us(Kind(k), None, 0) == pytest.approx(DURATIONS[k] * skew)  # without it: as before
    assert m._one_core_us(Kind.ATTN_FWD, None, 0) == pytest.approx(DURATIONS["attn.fwd"])  # not an expert op


def test_redundant_slots_are_paid_for(tmp_path):
    m = _model(EP2 + ["parallel.redundant_experts=2"], _profile(tmp_path))
    assert m.local_experts() == 6  # 8 / 2 experts and 2 replicas on each rank
    d = m._one_core_us(Kind.EXPERT_DW, None, 0)
    assert d == pytest.approx((DURATIONS["expert.dw"] - 8 * 1125.0) * m.skew_factors()[0] + 6 * 1125.0)


def test_a_sequence_slice_scales_the_token_part_only(tmp_path):
    m = _model(EP2, _profile(tmp_path))
    half = m.sliced(0, m.cfg.model.seq_len // 2)
    whole, part = m._one_core_us(Kind.EXPERT_DW, None, 0), half._one_core_us(Kind.EXPERT_DW, None, 0)
    fixed = 4 * 1125.0
    assert part - fixed == pytest.approx((whole - fixed) * half.flops(Kind.EXPERT_DW) / m.flops(Kind.EXPERT_DW))


def test_the_plan_of_an_ep_config_gets_shorter_expert_tasks(tmp_path):
    cfg = BASE + EP2
    with_it = plan(load_config(TINY, cfg + [f"schedule.profile={_profile(tmp_path)}"]))
    without = plan(load_config(TINY, cfg + [f"schedule.profile={_profile(tmp_path, None, 'plain.yaml')}"]))
    dw = lambda p: [t.end_us - t.start_us for t in p.graph.tasks.values() if t.kind is Kind.EXPERT_DW]  # noqa: E731
    assert max(dw(with_it)) < 0.75 * min(dw(without))
    assert with_it.metrics.step_time_us < without.metrics.step_time_us


@pytest.mark.parametrize("body, says", [
    ({"attn.fwd": 1.0}, "per_expert_us: attn.fwd is not a MoE expert kind; allowed: expert.fwd, expert.dx, expert.dw"),
    ({"expert.dw": -1.0}, "per_expert_us: expert.dw must be a finite number >= 0"),
    ({"expert.dw": True}, "(a YAML boolean)"),
    ([1.0], "per_expert_us must be a mapping of MoE expert kind: number"),
])
def test_a_bad_per_expert_entry_is_one_line(tmp_path, body, says):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"format": "k3sched.profile/1", "per_expert_us": body}))
    with pytest.raises(ConfigError) as e:
        load_profile(p)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_second_profile_point_is_one_ep_ranks_experts():
    from runtime.probe import per_expert_point

    assert per_expert_point(load_config(TINY, EP2)) == 4
    assert per_expert_point(load_config(TINY, ["parallel.pp=2", "parallel.ep=1"])) == 4  # ep 1: half
    assert per_expert_point(load_config(TINY, ["parallel.ep=4", "parallel.pp=1"])) == 2
    assert per_expert_point(load_config(TINY, ["parallel.ep=8", "parallel.pp=1"])) is None  # 1 expert < top_k 2
    assert per_expert_point(load_config(TINY, ["model.layers=2", "model.dense_layers=2", "parallel.pp=1"])) is None


def test_calibration_from_an_ep_source_recovers_the_profile(tmp_path):
    """The ideal trace of an EP 2 plan made with a per-expert profile calibrates back to the
    profile's durations (all experts on one rank) and keeps its ``per_expert_us``; the fitted
    profile predicts an EP 1 target as the known profile does. Dividing the EP 2 spans by the
    busiest rank's factor alone (the fit before the per-expert part) leaves them 7-30% short."""
    from k3sched import planfile
    from traces import synth
    from traces.calibrate import fit_profile, write_profile
    from traces.chrome import table_from_runtime

    prof = _profile(tmp_path)
    source = BASE + EP2 + ["model.routing_imbalance=1.1", f"schedule.profile={prof}"]
    pj = json.loads(planfile.dumps_plan(plan(load_config(TINY, source))))
    fit = fit_profile(pj, table_from_runtime(synth.trace_from_plan(pj)))
    for k, d in DURATIONS.items():
        assert fit.durations_us[k] == pytest.approx(d, rel=5e-3), k
    assert fit.per_expert_us == PER_EXPERT
    fitted = load_profile(write_profile(fit, tmp_path / "fitted.yaml"))
    assert fitted.per_expert_us == PER_EXPERT
    target = ["parallel.pp=2", "parallel.ep=1"]
    known = plan(load_config(TINY, BASE + target + [f"schedule.profile={prof}"])).metrics.step_time_us
    again = plan(load_config(TINY, BASE + target + [f"schedule.profile={tmp_path / 'fitted.yaml'}"]))
    assert again.metrics.step_time_us == pytest.approx(known, rel=0.01)


@pytest.mark.slow
def test_the_probe_measures_a_per_expert_part_that_plans(tmp_path):
    """The real measurement, one copy (in this process) at tiny-cpu's shapes (PP 2 x EP 2, its world
    size named: the fewer-experts profile runs at ep 1 all the same): a slope per expert kind, at
    least 0 and below the kind's own time over its experts; the written profile loads."""
    from runtime.probe import measure_fewer_experts, per_expert_slopes, write_ops_profile
    from runtime.probe.inprocess import measure_ops

    cfg = load_config(TINY, ["parallel.world_size=4"])
    ops = measure_ops(cfg)
    per = per_expert_slopes(cfg, ops, [measure_fewer_experts(cfg, 1)])
    assert set(per) == set(PER_EXPERT)
    for k, v in per.items():
        assert 0 <= v < ops[k] / (8 - 4), k  # the 4 experts' profile still costs its tokens
    p = write_ops_profile(ops, tmp_path / "ops.yaml", per)
    assert load_profile(p).per_expert_us == per
    assert plan(load_config(TINY, [f"schedule.profile={p}"])).metrics.step_time_us > 0
