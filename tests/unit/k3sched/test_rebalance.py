"""Stage rebalancing ([Note: profile split] in k3sched/rebalance.py): explicit per-stage layer counts,
``layer_split: profile``, per-layer times measured from trace events, ``k3sched rebalance`` and its
bad inputs, and a torchrun run of an uneven split rebalanced and run again (same losses)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from k3sched.config import ConfigError, load_config
from k3sched.planner import plan
from k3sched.layersplit import LayerTimes, profile_split, split_layers
from k3sched.rebalance import measure, stage_us, vstage_us
from k3sched.planfile import plan_to_json

from conftest import ROOT

TINY = ROOT / "configs" / "tiny-cpu.yaml"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3sched.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _events_as_planned(doc: dict, ranks_per_stage: int) -> SimpleNamespace:
    """Trace events of a run that followed ``doc`` exactly: every rank of a stage runs its tasks at
    their planned times."""
    name, rank, start, end = [], [], [], []
    for st in doc["stages"]:
        for r in range(ranks_per_stage):
            for ts in st["lanes"].values():
                for t in ts:
                    name.append(t["id"])
                    rank.append(st["stage"] * ranks_per_stage + r)
                    start.append(t["start_us"])
                    end.append(t["end_us"])
    return SimpleNamespace(name=np.array(name), rank=np.array(rank), start_us=np.array(start), end_us=np.array(end))


def test_stage_layers_sets_the_split_and_is_left_out_when_unset():
    cfg = load_config(TINY, ["parallel.stage_layers=[3,1]"])
    assert split_layers(cfg) == [[0, 1, 2], [3]]
    assert cfg.to_dict()["parallel"]["stage_layers"] == [3, 1]
    assert "stage_layers" not in load_config(TINY).to_dict()["parallel"]
    assert split_layers(load_config(TINY, ["parallel.stage_layers=[4,0]"])) == [[0, 1, 2, 3], []]


@pytest.mark.parametrize("bad", ["[2,1]", "[1,1,2]", "[5,-1]", "[2,0,2]"])
def test_bad_stage_layers_are_one_line(bad):
    over = ["parallel.stage_layers=" + bad] + (["parallel.pp=3", "parallel.ep=1"] if bad == "[2,0,2]" else [])
    with pytest.raises(ConfigError) as e:
        load_config(TINY, over)
    msg = str(e.value)
    assert "parallel.stage_layers" in msg and "\n" not in msg and ("allowed" in msg or "must be" in msg)


def test_profile_split_counts_embedding_head_and_receives():
    lt = LayerTimes([10.0, 10.0, 10.0, 10.0], embed_us=0.0, head_us=0.0, p2p_us=0.0, steps=1, ranks=1)
    assert profile_split(lt, 2) == [[0, 1], [2, 3]]
    heavy_head = LayerTimes([10.0] * 4, embed_us=0.0, head_us=25.0, p2p_us=0.0, steps=1, ranks=1)
    assert profile_split(heavy_head, 2) == [[0, 1, 2], [3]]
    heavy_first = LayerTimes([40.0, 10.0, 10.0, 10.0], embed_us=5.0, head_us=0.0, p2p_us=0.0, steps=1, ranks=1)
    assert profile_split(heavy_first, 2) == [[0], [1, 2, 3]]
    # an inner vstage pays two receives, the end ones one: receives push layers to the ends
    lt3 = LayerTimes([10.0] * 6, embed_us=0.0, head_us=0.0, p2p_us=10.0, steps=1, ranks=1)
    split = profile_split(lt3, 3)
    assert max(vstage_us(lt3, split)) == 40.0 == min(max(vstage_us(lt3, [list(range(0, a)), list(range(a, b)),
                                                                   list(range(b, 6))]))
                                             for a in range(0, 6) for b in range(a + 1, 6))


def test_measured_layer_times_are_the_planned_compute_of_each_layer():
    """A run that followed the plan exactly measures, per layer and micro-batch, the sum of the
    layer's planned compute durations plus the part of its EP tasks (at EP 1 only their launch)
    during which the stage's compute lane was idle (by brute force over the compute intervals)."""
    cfg = load_config(TINY, ["parallel.ep=1", "parallel.stage_layers=[3,1]"])
    doc = plan_to_json(plan(cfg))
    lt = measure(doc, _events_as_planned(doc, 1))
    tasks = [t for st in doc["stages"] for t in st["lanes"]["compute"]]

    def exposed(t):  # the task's time not covered by a compute task, on a grid of 20000 points
        comp = doc["stages"][t["stage"]]["lanes"]["compute"]
        a = np.array([c["start_us"] for c in comp])[:, None]
        b = np.array([c["end_us"] for c in comp])[:, None]
        x = np.linspace(t["start_us"], t["end_us"], 20001)[:-1] + (t["end_us"] - t["start_us"]) / 40000
        idle = int((~((a <= x) & (x < b)).any(0)).sum())
        return (t["end_us"] - t["start_us"]) * idle / 20000

    ep = [t for st in doc["stages"] for t in st["lanes"]["ep"]]
    for L in range(4):  # the median over micro-batches
        want = statistics.median(sum(t["duration_us"] for t in tasks if t["layer"] == L and t["mb"] == m)
                                 + sum(exposed(t) for t in ep if t["layer"] == L and t["mb"] == m) for m in range(4))
        assert lt.layer_us[L] == pytest.approx(want, abs=0.05)  # plan.json rounds times to ns; the grid
    assert lt.embed_us == pytest.approx(sum(t["duration_us"] for t in tasks if t["kind"].startswith("embed.")
                                            and t["mb"] == 0))
    assert lt.head_us == pytest.approx(sum(t["duration_us"] for t in tasks if t["kind"].startswith("head.")
                                           and t["mb"] == 0))
    assert lt.p2p_us >= 0 and lt.ranks == 2 and lt.steps == 1
    assert profile_split(lt, 2) == [[0, 1], [2, 3]]  # moves a layer off the loaded stage
    assert max(stage_us(cfg, lt, [[0, 1], [2, 3]])) < max(stage_us(cfg, lt, [[0, 1, 2], [3]]))


def test_measured_layer_times_count_only_exposed_all_to_all():
    cfg = load_config(TINY, ["parallel.stage_layers=[3,1]"])
    doc = plan_to_json(plan(cfg))
    lt = measure(doc, _events_as_planned(doc, 2))
    tasks = [t for st in doc["stages"] for ts in st["lanes"].values() for t in ts]
    for L in range(1, 4):  # MoE layers
        comp = sum(t["duration_us"] for t in tasks if t["layer"] == L and t["mb"] == 0 and t["lane"] == "compute")
        ep = sum(t["duration_us"] for t in tasks if t["layer"] == L and t["mb"] == 0 and t["lane"] == "ep")
        assert comp - 1e-6 <= lt.layer_us[L] <= comp + ep + 1e-6


def test_profile_split_from_a_profile_and_its_bad_inputs(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text("format: k3sched.profile/1\nlayer_us: [10, 10, 10, 10]\nhead_us: 25\n")
    cfg = load_config(TINY, ["parallel.layer_split=profile", f"schedule.profile={prof}"])
    assert split_layers(cfg) == [[0, 1, 2], [3]]
    assert plan(cfg).metrics.step_time_us > 0
    with pytest.raises(ConfigError, match="layer_split: profile needs schedule.profile"):
        load_config(TINY, ["parallel.layer_split=profile"])
    no_layers = tmp_path / "nolayers.yaml"
    no_layers.write_text("format: k3sched.profile/1\ndurations_us: {attn.fwd: 10.0}\n")
    r = _cli("plan", str(TINY), "--set", "parallel.layer_split=profile", "--set", f"schedule.profile={no_layers}")
    err = (r.stdout + r.stderr).strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "no per-layer times (layer_us)" in err
    short = tmp_path / "short.yaml"
    short.write_text("format: k3sched.profile/1\nlayer_us: [1, 2]\n")
    r = _cli("plan", str(TINY), "--set", "parallel.layer_split=profile", "--set", f"schedule.profile={short}")
    err = (r.stdout + r.stderr).strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "layer_us has 2 per-layer times" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: k3sched.profile/1\nlayer_us: [1, .nan]\n")
    r = _cli("plan", str(TINY), "--set", "parallel.layer_split=profile", "--set", f"schedule.profile={bad}")
    err = (r.stdout + r.stderr).strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "layer_us" in err and "allowed" in err


def test_rebalance_refuses_a_directory_without_a_run(tmp_path):
    r = _cli("rebalance", str(tmp_path), "-o", str(tmp_path / "c.yaml"))
    err = (r.stdout + r.stderr).strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "no plan.json and trace_rank*.json" in err
    r = _cli("rebalance", str(tmp_path / "missing"), "-o", str(tmp_path / "c.yaml"))
    assert r.returncode == 2 and "not a run directory" in r.stdout + r.stderr


@pytest.mark.slow
def test_rebalance_a_recorded_uneven_run_and_run_the_proposal(tmp_path):
    """PP 2 x EP 1 (one rank per core) with 8 layers split [7, 1]: rebalance moves layers off stage
    0 from the traces, with a shorter predicted step; the proposed config runs and computes the same
    losses (the split changes where layers run, not what they compute). The measured gain is
    benchmarks/bench_rebalance.py's."""
    from runtime.launch import run_command

    shape = ["parallel.ep=1", "model.layers=8", "model.seq_len=32", "parallel.microbatches=2"]
    a = tmp_path / "uneven"
    assert run_command(TINY, ["parallel.stage_layers=[7,1]", *shape], 2, None, a, False, None, timeout_s=150.0,
                       quiet=True) == 0
    new = tmp_path / "rebalanced.yaml"
    r = _cli("rebalance", str(a), "-o", str(new))
    assert r.returncode == 0, r.stderr
    counts = next(ln for ln in r.stdout.splitlines() if ln.startswith("layers per vstage"))
    assert counts.startswith("layers per vstage: before [7, 1], after [")
    after = [int(x) for x in counts.split("after [")[1].rstrip("]").split(",")]
    assert sum(after) == 8 and after[0] < 7
    step = next(ln for ln in r.stdout.splitlines() if ln.startswith("planner's predicted step"))
    before_ms, after_ms = (float(x) for x in step.split(":")[1].split("ms")[0].split("->"))
    assert after_ms < before_ms
    b = tmp_path / "rebalanced"
    assert run_command(new, [], 2, None, b, False, None, timeout_s=150.0, quiet=True) == 0
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sb["predicted_step_time_us"] < sa["predicted_step_time_us"]
    assert sb["losses"] == pytest.approx(sa["losses"], rel=1e-6, abs=0)
    doc = json.loads((b / "plan.json").read_text())
    assert doc["config"]["parallel"]["layer_split"] == "profile"
    assert len({t["layer"] for t in doc["stages"][0]["lanes"]["compute"] if t["layer"] is not None}) == after[0]
