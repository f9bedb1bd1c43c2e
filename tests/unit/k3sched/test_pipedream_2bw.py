"""PipeDream-2BW ([Note: pipedream-2bw] in k3sched/schedule_generators.py): its backbone's bubble
against the paper's no-flush steady state, the two-step plan (ids, optimizer dependencies, the
second weight version's bytes, ``compare``), its config rules, the delayed-update reference
(runtime/reference.py) against the update rule written out by hand, and 3 runs of the plan (6
training steps) on 2 ranks (gloo, torchrun, as tests/e2e/test_schedules_run.py runs V-Half and V-Min)
with the delayed reference's losses and traces that validate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from k3sched.compare import compare
from k3sched.config import load_config
from k3sched.cost import CostModel
from k3sched.pipelines import TABLE
from k3sched.planner import plan
from k3sched.schedules import Action, generate, simulate_uniform
from k3sched.tasks import Kind, format_task_id, parse_task_id

from conftest import CONFIGS, ROOT, launch_p2p_worker, one_line

TINY = CONFIGS / "tiny-cpu.yaml"
SMALL = ["parallel.ep=1", "model.seq_len=16", "model.micro_batch_size=1", "schedule.offload=none"]


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (3, 5)])
@pytest.mark.parametrize("F,B", [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
def test_bubble_is_one_fill_and_one_drain_per_two_steps(p, m, F, B):
    # Narayanan et al., ICML 2021 (PipeDream-2BW): no pipeline flush, so the steady state idles 0;
    # a plan of two steps (2m micro-batches) idles (p-1)(F+B) per rank, the bubble ratio is
    # (p-1)/(2m+p-1), and it is one drain shorter than two 1F1B steps.
    s = generate("pipedream-2bw", p, 1, m)
    assert s.microbatches == 2 * m
    res = simulate_uniform(s, F, B)
    assert res.step_time == pytest.approx((2 * m + p - 1) * (F + B))
    for r in range(p):
        assert res.idle[r] == pytest.approx((p - 1) * (F + B))
        assert res.bubble[r] == pytest.approx((p - 1) / (2 * m + p - 1))
    one = simulate_uniform(generate("1f1b", p, 1, m), F, B)
    assert 2 * one.step_time - res.step_time == pytest.approx((p - 1) * (F + B))


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 6), (8, 8)])
def test_steady_state_has_no_idle_across_the_step_boundary(p, m):
    # between a rank's first backward and its last forward (which spans step t's micro-batch m-1
    # and step t+1's micro-batch m) every slot starts when the previous one ends: step t+1's
    # forwards fill what 1F1B would leave as step t's drain
    F, B = 1.0, 2.0
    s = generate("pipedream-2bw", p, 1, m)
    res = simulate_uniform(s, F, B)
    for r in range(p):
        slots = s.ranks[r]
        first_b = next(i for i, a in enumerate(slots) if a.op == "B")
        last_f = max(i for i, a in enumerate(slots) if a.op == "F")
        t = res.starts[(r, first_b)]
        for i in range(first_b, last_f + 1):
            assert res.starts[(r, i)] == pytest.approx(t), (r, i)
            t += F if slots[i].op == "F" else B
    # and step t+1's first forward enters rank 0 before step t's last backward left it
    r0 = s.ranks[0]
    assert r0.index(Action(0, "F", m)) < r0.index(Action(0, "B", m - 1))


def test_step_ids_round_trip_and_stay_within_the_grammar():
    assert format_task_id(0, Kind.OPTIM) == "s0/step/optim.run"
    assert format_task_id(3, Kind.OPTIM, step=1) == "s3/step1/optim.run"
    assert parse_task_id("s3/step1/optim.run").step == 1 and parse_task_id("s3/step/optim.run").step is None
    for bad in ("s0/step0/optim.run", "s0/step01/optim.run", "s0/stepx/optim.run"):
        with pytest.raises(ValueError, match="task id"):
            parse_task_id(bad)
    with pytest.raises(ValueError, match="step"):
        format_task_id(0, Kind.ATTN_FWD, mb=1, layer=0, step=1)


def test_plan_spans_two_steps_with_delayed_optimizers_and_two_weight_versions():
    M, pp = 4, 2
    cfg = load_config(TINY, SMALL + ["schedule.pipeline=pipedream-2bw"])
    p = plan(cfg)
    tasks = p.graph.tasks
    assert {t.mb for t in tasks.values() if t.mb is not None} == set(range(2 * M))
    for s in range(pp):
        o0, o1 = tasks[f"s{s}/step/optim.run"], tasks[f"s{s}/step1/optim.run"]
        # each optimizer waits for its own step's weight gradients on the stage, and only those
        mbs = lambda t: {tasks[d].mb for d in t.deps}  # noqa: E731
        assert mbs(o0) == set(range(M)) and mbs(o1) == set(range(M, 2 * M))
        assert o0.end_us <= o1.start_us
        # one gradient buffer: step t+1's weight gradients start after step t's optimizer
        wg = [t for t in tasks.values() if t.stage == s and t.is_wgrad and t.mb >= M]
        assert wg and all(o0.id in t.deps and t.start_us >= o0.end_us for t in wg)
        assert not any(t.is_wgrad and t.mb < M and o0.id in t.deps for t in tasks.values())
        # no flush: step t+1's first forward on the stage starts before step t's optimizer
        f = min(t.start_us for t in tasks.values() if t.stage == s and t.kind is Kind.ATTN_FWD and t.mb >= M)
        assert f < o0.start_us
    # the second weight version: static bytes = 1F1B's + one more copy of the weights
    one = plan(load_config(TINY, SMALL + ["schedule.pipeline=1f1b"]))
    cost = CostModel(cfg)
    for s in range(pp):
        layers = one.graph.layers[s]
        extra = cost.weight_bytes(layers, embed=s == 0, head=s == pp - 1)
        assert extra > 0 and p.graph.static_device[s] == one.graph.static_device[s] + extra
    # two 2BW steps take less than two 1F1B steps (one drain fewer), more than one
    assert one.metrics.step_time_us < p.metrics.step_time_us < 2 * one.metrics.step_time_us


def test_plan_out_validates_and_compare_lists_it_per_step(tmp_path):
    from typer.testing import CliRunner

    from k3sched.cli import app

    out = tmp_path / "plan"
    res = CliRunner().invoke(app, ["plan", str(TINY), "--out", str(out), "--set", "schedule.pipeline=pipedream-2bw"])
    assert res.exit_code == 0, res.output
    import json

    from k3sched.planfile import check_plan_doc

    doc = check_plan_doc(json.loads((out / "plan.json").read_text()))
    ids = {t.id for st in doc.stages for ts in st.lanes.values() for t in ts}
    assert {"s0/step/optim.run", "s0/step1/optim.run", "s1/step1/optim.run"} <= ids
    ov = SMALL + ["parallel.pp=4", "model.layers=8", "parallel.microbatches=8"]
    rows = {r.schedule: r for r in compare(load_config(TINY, ov), ["1f1b", "pipedream-2bw"]) if r.strategy == "k3"}
    assert rows["pipedream-2bw"].ok, rows["pipedream-2bw"].error
    # per training step: below 1F1B's step (no flush), above half of it
    assert 0.5 * rows["1f1b"].step_us < rows["pipedream-2bw"].step_us < rows["1f1b"].step_us
    assert "pipedream-2bw" in TABLE and TABLE["pipedream-2bw"].steps == 2


@pytest.mark.parametrize("sets,match", [
    (["parallel.microbatches=1"], "parallel.microbatches: pipedream-2bw needs at least pp = 2"),
    (["schedule.grad_offload=true"], "schedule.grad_offload: pipedream-2bw"),
])
def test_bad_configs_are_one_line(sets, match, tmp_path):
    from typer.testing import CliRunner

    from k3sched.cli import app

    res = CliRunner().invoke(app, ["plan", str(TINY), "--out", str(tmp_path / "o"), "--set",
                                   "schedule.pipeline=pipedream-2bw", *[a for s in sets for a in ("--set", s)]])
    assert res.exit_code == 2, res.output
    one_line(res.output, match)


@pytest.mark.parametrize("extra", [["--save-every", "1"], ["--set", "data.path=tokens.bin"]])
def test_run_refuses_checkpoints_and_token_files_in_one_line(extra, tmp_path):
    from typer.testing import CliRunner

    from k3sched.cli import app

    res = CliRunner().invoke(app, ["run", str(TINY), "--out", str(tmp_path / "o"), "--set",
                                   "schedule.pipeline=pipedream-2bw", *extra])
    assert res.exit_code == 2, res.output
    one_line(res.output, "pipedream-2bw", "second weight version")


def test_delayed_reference_is_the_2bw_update_rule():
    # W_{t+1} = AdamW(W_t, grad L_t(W_{t-1})), W_{-1} = W_0, written out with two plain models
    from moe import MoEModel
    from runtime.reference import reference_run
    from runtime.stage import model_args, synthetic_batch

    cfg = load_config(TINY, SMALL + ["model.layers=2", "parallel.microbatches=2"])
    steps, lr, wd = 4, 1e-2, 0.01
    got = reference_run(cfg, steps, lr=lr, weight_decay=wd, delayed=True)
    sync = reference_run(cfg, steps, lr=lr, weight_decay=wd)
    args, seed, m, M = model_args(cfg), cfg.schedule.seed, cfg.model, cfg.parallel.microbatches
    versions = [MoEModel.build(args, seed)]  # W_0, W_1, ...
    opt_model = MoEModel.build(args, seed)
    opt = torch.optim.AdamW(opt_model.parameters(), lr=lr, weight_decay=wd)
    want = []
    for t in range(steps):
        on = versions[max(t - 1, 0)]
        on.zero_grad(set_to_none=True)
        loss = sum(float(on.forward_backward_reference(*synthetic_batch(seed, t, 0, mb, m.micro_batch_size, m.seq_len,
                                                                         m.vocab), loss_scale=1.0 / M))
                   for mb in range(M)) / M
        want.append(loss)
        for w, q in zip(opt_model.parameters(), on.parameters()):
            w.grad = None if q.grad is None else q.grad.clone()
        opt.step()
        nxt = MoEModel.build(args, seed)
        nxt.load_state_dict(opt_model.state_dict())
        versions.append(nxt)
    assert got.losses == pytest.approx(want, rel=1e-6, abs=1e-7)
    # the same as synchronous training on step 0 only: stale weights change the losses after it
    assert got.losses[0] == pytest.approx(sync.losses[0], rel=1e-7)
    assert all(abs(a - b) > 1e-6 for a, b in zip(got.losses[1:], sync.losses[1:]))


@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (4, 4), (4, 16), (8, 32)])
def test_valid_and_round_trips_through_torch_csv(p, m):
    from k3sched.schedules import Schedule, validate

    s = generate("pipedream-2bw", p, 1, m)
    assert validate(s) == []
    back = Schedule.from_torch_csv(s.to_torch_csv(), p, 1, 2 * m, placement=s.placement, name=s.name)
    assert back.ranks == s.ranks and validate(back) == []


RUN = ["parallel.ep=1", "parallel.pp=2", "parallel.vpp=1", "parallel.microbatches=4", "model.layers=4",
       "model.seq_len=16", "model.micro_batch_size=1", "model.dense_layers=0", "schedule.pipeline=pipedream-2bw"]
LIMIT_S = 240.0


@pytest.mark.slow
def test_runs_like_the_delayed_reference_and_its_traces_validate(tmp_path):
    from runtime.reference import reference_run

    d = tmp_path / "run"
    spec = {"runs": [{"out": str(d), "overrides": RUN, "p2p": "buffered", "steps": 3}], "timeout_s": 90}
    rc, out = launch_p2p_worker(spec, tmp_path, limit_s=LIMIT_S, what="the run")
    assert rc == 0, out[-3000:]
    summary = json.loads((d / "summary.json").read_text())
    # three runs of the two-step plan: six training steps, each with its loss
    assert summary["pipeline"] == "pipedream-2bw" and len(summary["losses"]) == 6
    cfg = load_config(TINY, RUN)
    ref = reference_run(cfg, 6, delayed=True)
    assert summary["losses"] == pytest.approx(ref.losses, rel=1e-5, abs=0)
    # and not synchronous training's: stale weights from step 1 on
    sync = reference_run(cfg, 6)
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(summary["losses"][1:], sync.losses[1:]))
    # the measured memory holds both weight versions, as the plan does (one version: about 17% less here)
    for measured, planned in zip(summary["peak_device_bytes_measured"], summary["peak_device_bytes_planned"]):
        assert measured >= 0.9 * planned
    traces = sorted(str(p) for p in d.glob("trace_rank*.json"))
    assert len(traces) == 2
    v = subprocess.run([sys.executable, "-m", "k3sched.cli", "validate", "--plan", str(d / "plan.json"), *traces],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]
