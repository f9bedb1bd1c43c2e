"""Chimera and DualPipe executed: two model copies per rank, their gradients summed between the
copies by grad.mirror ([Note: replica gradient reduction] in runtime/stage/gradients.py).

Planner (fast): one ``s{r}/step/grad.mirror`` per stage on the collective lane, after every
gradient of the stage and before its optimizer, priced as a two-rank ring all-reduce of the
stage's gradient bytes on the link between ranks r and pp-1-r; other schedules have none. Runtime
(slow; torchrun + gloo running tests/p2p_worker.py, as tests/e2e/test_schedules_run.py runs V-Half and
V-Min): chimera on PP 4 and dualpipe on PP 2 x EP 2 train 3 steps with the losses of
the one-process synchronous reference (runtime/reference.py), their traces validate against their
plans, and the two copies of every model stage are bitwise equal after the 3 steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3sched.config import load_config
from k3sched.cost import CostModel
from k3sched.planner import plan
from k3sched.tasks import WGRAD_KINDS, Kind

from conftest import CONFIGS, ROOT, launch_p2p_worker

TINY = CONFIGS / "tiny-cpu.yaml"
SMALL = ["parallel.vpp=1", "parallel.microbatches=4", "model.layers=4", "model.seq_len=16",
         "model.micro_batch_size=1"]


def _plan(name: str, pp: int, extra: list[str] = ()):
    cfg = load_config(TINY, SMALL + ["parallel.ep=1", f"schedule.pipeline={name}", f"parallel.pp={pp}",
                                     f"parallel.microbatches={2 * pp}", *extra])
    return cfg, plan(cfg)


@pytest.mark.parametrize("name", ["chimera", "dualpipe"])
@pytest.mark.parametrize("gpus_per_node", [2, 4])
def test_one_mirror_reduction_per_stage_after_its_gradients_before_its_optimizer(name, gpus_per_node):
    pp = 4
    cfg, p = _plan(name, pp, ["hardware.cpu_runner.host_cores=0", f"hardware.gpus_per_node={gpus_per_node}"])
    tasks = p.graph.tasks
    mirrors = {t.stage: t for t in tasks.values() if t.kind is Kind.GRAD_MIRROR}
    assert sorted(mirrors) == list(range(pp))
    hw, b = cfg.hardware, cfg.model.dtype_bytes
    # ranks s and pp-1-s share a node of 4 GPUs; with 2 per node both pairs (0, 3) and (1, 2) cross
    gbps, lat = (hw.nvlink_gbps, hw.nvlink_latency_us) if gpus_per_node == 4 else (hw.internode_gbps,
                                                                                    hw.internode_latency_us)
    cost = CostModel(cfg)
    for s, m in mirrors.items():
        assert m.id == f"s{s}/step/grad.mirror" and m.lane == "collective"
        wgrads = {t.id for t in tasks.values() if t.stage == s and t.kind in WGRAD_KINDS}
        assert wgrads and wgrads <= set(m.deps)  # after every weight gradient of both copies' stages
        assert tasks[f"s{s}/step/optim.run"].deps == [m.id]  # the optimizer waits for it, and only it
        layers = [L for v, ls in enumerate(p.graph.layers) if p.graph.placement.locate(v)[0] == s for L in ls]
        params = cost.stage_params(layers, embed=s in (0, pp - 1), head=s in (0, pp - 1))[0]
        assert m.bytes == params * b == mirrors[pp - 1 - s].bytes  # the two copies of the same stages
        # two-rank ring all-reduce: the bytes leave each rank once, in two latency-bound steps
        assert m.duration_us == pytest.approx(hw.launch_us + 2 * lat + m.bytes / (gbps * 1e3))
        ends = [tasks[d].end_us for d in m.deps]
        assert m.start_us >= max(ends) - 1e-6 and tasks[f"s{s}/step/optim.run"].start_us >= m.end_us - 1e-6


@pytest.mark.parametrize("name,pp,ep,dp,offload,grad_offload,M", [
    ("chimera", 2, 1, 1, "none", False, 4), ("chimera", 4, 2, 1, "auto", False, 12),
    ("chimera", 4, 1, 2, "none", True, 12), ("dualpipe", 2, 2, 2, "auto", True, 4),
    ("dualpipe", 4, 1, 1, "auto", False, 8)])
def test_task_count_is_exact_for_two_copies(name, pp, ep, dp, offload, grad_offload, M):
    # k3sched/limits.py counts what the graph builds: a micro-batch crosses pp-1 stage boundaries,
    # each layer has a grad.rs (or gradient-shard group) per copy, one grad.mirror per stage
    from k3sched.graph import OffloadChoice, build_step
    from k3sched.limits import count_tasks

    cfg = load_config(TINY, SMALL + [f"schedule.pipeline={name}", f"parallel.pp={pp}", f"parallel.ep={ep}",
                                     f"parallel.dp={dp}", f"parallel.microbatches={M}", "model.layers=8",
                                     f"schedule.offload={offload}", f"schedule.grad_offload={str(grad_offload).lower()}",
                                     "schedule.grad_bucket_mb=0.05"])
    g = build_step(cfg, OffloadChoice(everything=offload != "none"))
    assert count_tasks(cfg).total == len(g.tasks)


def test_one_copy_schedules_have_no_mirror_reduction():
    for name, vpp in (("1f1b", 1), ("dualpipev", 2), ("zb-v", 2)):
        _, p = _plan(name, 2, [f"parallel.vpp={vpp}"])
        assert not [t for t in p.graph.tasks.values() if t.kind is Kind.GRAD_MIRROR], name


def test_stage_spec_holds_one_stage_of_each_copy():
    from runtime.stage import StageSpec

    cfg = load_config(TINY, SMALL + ["schedule.pipeline=chimera", "parallel.pp=4", "parallel.microbatches=8",
                                     "model.layers=8"])
    specs = [StageSpec.of(cfg, r) for r in range(4)]
    assert [s.layers for s in specs] == [[0, 1, 6, 7], [2, 3, 4, 5], [2, 3, 4, 5], [0, 1, 6, 7]]
    # the end ranks run the first stage of one copy and the last of the other: embedding and head
    assert [(s.has_embed, s.has_head) for s in specs] == [(True, True), (False, False), (False, False), (True, True)]
    s = specs[0]
    assert s.copies == 2 and s.model_stages == 4 and s.chunk_vstage == {0: 0, 1: 7}
    # the up copy's vstage 4 + k reads and writes the model's activations where model stage k does
    assert [s.input_index(v) for v in range(9)] == [0, 2, 4, 6, 0, 2, 4, 6, 8]


def test_mirror_groups_pair_stage_s_with_stage_pp_minus_1_minus_s():
    from runtime.groups import Layout, mirror_pairs

    lo = Layout(4, 2, 2, 0)
    pairs = mirror_pairs(lo)
    assert sorted(r for pr in pairs for r in pr) == list(range(16))  # every rank in exactly one pair
    for a, b in pairs:
        (pa, da, ea), (pb, db, eb) = lo.ranks.coords(a), lo.ranks.coords(b)
        assert pa + pb == 3 and (da, ea) == (db, eb)


# -- runs ---------------------------------------------------------------------------------------

LIMIT_S = 300.0


def _launch(tmp: Path, nproc: int, runs: dict[str, list[str]]) -> None:

    spec = {"runs": [{"out": str(tmp / n), "overrides": ov, "p2p": "buffered", "steps": 3,
                      "args": ["--dump-params"]} for n, ov in runs.items()], "timeout_s": 120}
    rc, out = launch_p2p_worker(spec, tmp, nproc=nproc, limit_s=LIMIT_S)
    assert rc == 0, out[-3000:]


def _check(d: Path, overrides: list[str]) -> None:
    import torch

    from runtime.groups import Layout
    from runtime.reference import reference_run

    cfg = load_config(TINY, overrides)
    p = cfg.parallel
    summary = json.loads((d / "summary.json").read_text())
    assert summary["pipeline"] == cfg.schedule.pipeline and len(summary["losses"]) == 3
    ref = reference_run(cfg, 3)
    assert summary["losses"] == pytest.approx(ref.losses, rel=1e-5, abs=0), d.name
    traces = sorted(str(t) for t in d.glob("trace_rank*.json"))
    assert len(traces) == p.world
    v = subprocess.run([sys.executable, "-m", "k3sched.cli", "validate", "--plan", str(d / "plan.json"), *traces],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, d.name + ": " + v.stdout[-2000:] + v.stderr[-2000:]
    # the copies of each model stage: rank (s, dp, ep) and rank (pp-1-s, dp, ep), bitwise equal
    params = {r: torch.load(d / f"params_rank{r}.pt") for r in range(p.world)}
    for r in range(p.world):
        lo = Layout(p.pp, p.dp, p.ep, r, p.order)
        twin = lo.rank_of(p.pp - 1 - lo.pp_idx, lo.dp_idx, lo.ep_idx)
        assert params[r].keys() == params[twin].keys() and params[r]
        for n, t in params[r].items():
            assert torch.equal(t, params[twin][n]), f"{d.name}: {n} differs between ranks {r} and {twin}"


@pytest.mark.slow
def test_chimera_pp4_and_dualpipe_pp2_ep2_train_like_the_reference(tmp_path):
    # one launch of 4 ranks (a launch costs ~10 s here): chimera's mirror pairs (0, 3) and (1, 2) are
    # not pipeline neighbours; dualpipe's PP 2 pair is, and with EP 2 each pair is one EP slice
    runs = {"chimera-pp4": SMALL + ["schedule.pipeline=chimera", "parallel.pp=4", "parallel.ep=1",
                                    "model.dense_layers=0"],
            "dualpipe-pp2-ep2": SMALL + ["schedule.pipeline=dualpipe", "parallel.pp=2", "parallel.ep=2"]}
    _launch(tmp_path, 4, runs)
    for name, ov in runs.items():
        _check(tmp_path / name, ov)
