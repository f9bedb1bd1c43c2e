"""``schedule.layer_optim`` ([Note: per-layer optimizer] in k3sched/graph.py): one AdamW task per
layer after its reduction, the stage's optim.run last; the refusals; and a one-rank run that must
compute bitwise what the plain optimizer step does (and what the reference does)."""

from __future__ import annotations

import pytest
import torch

from k3sched.config import ConfigError, load_config
from k3sched.planner import plan
from k3sched.tasks import Kind

from conftest import CONFIGS

TINY = CONFIGS / "tiny-cpu.yaml"


def _optims(p) -> dict[int, list]:
    out: dict[int, list] = {}
    for t in p.tasks.values():
        if t.kind is Kind.OPTIM:
            out.setdefault(t.stage, []).append(t)
    return out


def test_each_layer_steps_after_its_reduction_and_the_stage_optimizer_runs_last():
    plain = plan(load_config(TINY))
    per = plan(load_config(TINY, ["schedule.layer_optim=true"]))
    tasks = per.tasks
    for s, ts in _optims(per).items():
        stage_opt = [t for t in ts if t.layer is None]
        layer_opts = {t.layer: t for t in ts if t.layer is not None}
        assert len(stage_opt) == 1 and stage_opt[0].id == f"s{s}/step/optim.run"
        layers = {t.layer for t in tasks.values() if t.stage == s and t.kind is Kind.ATTN_FWD}
        assert set(layer_opts) == layers
        for L, t in layer_opts.items():
            assert t.lane == "compute" and t.id == f"s{s}/v{t.chunk}/L{L}/optim.run"
            rs = {u.id for u in tasks.values() if u.kind is Kind.GRAD_RS and u.stage == s and u.layer == L}
            assert rs and set(t.deps) == rs  # every bucket of the layer's reduction, nothing else
            assert t.start_us >= max(tasks[d].end_us for d in rs)
            assert stage_opt[0].start_us >= t.end_us and t.id in stage_opt[0].deps
        # the work is the same AdamW, split: the durations add up to the plain plan's optimizer
        before = plain.tasks[f"s{s}/step/optim.run"].duration_us
        assert sum(t.duration_us for t in ts) == pytest.approx(before, rel=1e-9)
    assert "layer_optim" not in plain.cfg.model_dump(mode="json")["schedule"]


def test_without_dp_the_layer_steps_after_its_last_wgrad():
    cfg = load_config(TINY, ["parallel.ep=1", "parallel.dp=1", "schedule.layer_optim=true"])
    p = plan(cfg)
    for t in p.tasks.values():
        if t.kind is Kind.OPTIM and t.layer is not None:
            assert t.deps and all(p.tasks[d].kind.value.endswith(".dw") and p.tasks[d].layer == t.layer
                                  for d in t.deps)


def test_layer_optim_shortens_the_tuned_k2_like_step():
    """K2-like with the tuned knobs (README tune row): the middle stages' optimizer tail was the
    whole stage's AdamW after its last reduction bucket."""
    knobs = ["parallel.seq_chunks=4", "schedule.grad_offload=false", "schedule.lookahead=2", "schedule.wgrad_lag=64"]
    plain = plan(load_config(CONFIGS / "k2-like.yaml", knobs)).metrics
    per = plan(load_config(CONFIGS / "k2-like.yaml", knobs + ["schedule.layer_optim=true"])).metrics
    assert per.step_time_us < plain.step_time_us - 20e3
    assert per.memory_lower_bound_us <= per.step_time_us


@pytest.mark.parametrize("extra, named", [
    (["schedule.grad_offload=true"], "schedule.grad_offload"),
    (["schedule.pipeline=pipedream-2bw"], "pipedream-2bw"),
    (["schedule.pipeline=dualpipe"], "dualpipe"),
])
def test_refused_where_the_step_is_not_per_layer(extra, named):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["schedule.layer_optim=true", *extra])
    msg = str(e.value)
    assert "schedule.layer_optim" in msg and named in msg and "\n" not in msg


ONE_RANK = ["parallel.pp=1", "parallel.ep=1", "parallel.microbatches=4", "model.layers=3", "model.seq_len=32",
            "model.micro_batch_size=2", "model.vocab=64"]


@pytest.mark.usefixtures("one_thread")
def test_one_rank_run_is_bitwise_the_plain_optimizer_and_matches_the_reference():
    from runtime.local import local_run
    from runtime.reference import reference_run

    runs = {}
    for on in (False, True):
        cfg = load_config(TINY, ONE_RANK + [f"schedule.layer_optim={str(on).lower()}"])
        runs[on] = local_run(cfg, 3, seed=0, capture_grads=True)
    plain, per = runs[False], runs[True]
    ids = [e["name"] for e in per.traces[0]["traceEvents"] if e.get("ph") == "X" and "optim.run" in e["name"]]
    assert sorted(ids) == ["s0/step/optim.run", "s0/v0/L0/optim.run", "s0/v0/L1/optim.run", "s0/v0/L2/optim.run"]
    assert per.losses == plain.losses
    assert per.grads.keys() == plain.grads.keys()
    assert all(torch.equal(per.grads[n], g) for n, g in plain.grads.items())
    a, b = dict(plain.runner.model.named_parameters()), dict(per.runner.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    sa, sb = plain.runner.optimizer.state, per.runner.optimizer.state
    assert all(torch.equal(sa[a[n]]["exp_avg_sq"], sb[b[n]]["exp_avg_sq"]) for n in a)
    ref = reference_run(load_config(TINY, ONE_RANK), 3)
    assert per.losses == pytest.approx(ref.losses, rel=1e-5, abs=0)
