"""k3sched tune on tiny configs: the search space, the cache, the Pareto front, the time limit,
the outputs and the Megatron comparison."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from k3sched.config import load_config
from k3sched.tune import Result, Tuner, megatron_overrides, pareto, search, shapes, tune_command

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def test_shapes_keep_tokens_per_step_and_start_with_the_config() -> None:
    cfg = load_config(TINY)
    ss = shapes(cfg)
    assert ss[0] == {"schedule.pipeline": "1f1b", "parallel.vpp": 1, "model.micro_batch_size": 4,
                     "parallel.microbatches": 4}
    seqs = cfg.model.micro_batch_size * cfg.parallel.microbatches
    assert all(s["model.micro_batch_size"] * s["parallel.microbatches"] == seqs for s in ss)
    assert {s["schedule.pipeline"] for s in ss} >= {"interleaved-1f1b", "dualpipev", "zb-v", "1f1b", "zb-h1"}
    assert len({tuple(sorted(s.items())) for s in ss}) == len(ss)


def test_pareto_front() -> None:
    rs = [Result({}, step_us=s, peak_device=m, lower_bound_us=1.0, exposed_ep_ratio=0.0, bubble=0.0)
          for s, m in ((10, 5), (9, 6), (11, 4), (12, 7), (9, 8))]
    front = pareto(rs)
    assert [(r.step_us, r.peak_device) for r in front] == [(9, 6), (10, 5), (11, 4)]
    assert [(r.step_us, r.peak_device) for r in pareto(rs, budget=5)] == [(10, 5), (11, 4)]


def test_search_caches_and_improves_on_the_config() -> None:
    cfg = load_config(TINY)
    tuner = Tuner(cfg, cfg.hardware.device_memory_gb, time_limit_s=120, jobs=1)
    search(tuner, None)
    own = tuner.results[0]
    assert own.overrides == {} and own.ok
    best = tuner.best()
    assert best.step_us <= own.step_us and best.peak_device <= tuner.budget_bytes
    assert tuner.cache_hits > 0  # the fine phase revisits what the coarse one planned
    assert len(tuner.results) == len(tuner.cache)


def test_time_limit_ends_the_search() -> None:
    cfg = load_config(TINY)
    tuner = Tuner(cfg, cfg.hardware.device_memory_gb, time_limit_s=0.5, jobs=1, reserve_s=0.0)
    t0 = time.perf_counter()
    search(tuner, None)
    assert tuner.timed_out and time.perf_counter() - t0 < 5


def test_megatron_default() -> None:
    ov = megatron_overrides(load_config(TINY))
    assert ov["schedule.pipeline"] == "interleaved-1f1b" and ov["parallel.vpp"] == 2
    assert ov["schedule.offload"] == "none" and not ov["schedule.recompute"]
    assert "parallel.microbatches" not in ov and "model.micro_batch_size" not in ov


def test_tune_command_writes_best_and_front(tmp_path) -> None:
    console = Console(width=120, record=True)
    rc = tune_command(TINY, ["parallel.microbatches=2"], None, 60.0, 2, tmp_path, console, progress=False)
    assert rc == 0
    text = console.export_text()
    assert "Pareto front" in text and "Megatron default" in text and "faster" in text
    assert "the config as given" in text
    assert max(len(line) for line in text.splitlines()) <= 120
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["format"] == "k3sched.tune/1" and doc["front"] and doc["best"]
    sets = [line.split(" ", 1)[1] for line in (tmp_path / "best" / "overrides.txt").read_text().splitlines()]
    plan_doc = json.loads((tmp_path / "best" / "plan.json").read_text())
    # the overrides reproduce the best plan
    assert plan_doc["metrics"]["step_time_us"] == doc["best"]["step_us"]
    cfg = load_config(TINY, ["parallel.microbatches=2"] + sets)
    assert plan_doc["config"] == cfg.to_dict()
    assert (tmp_path / "pareto.png").stat().st_size > 1000


def test_cli_tune_help_and_bad_option() -> None:
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "tune", str(TINY), "--time-limit", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--time-limit" in r.stderr


def test_workers_plan_in_processes_and_abandon_slow_plans() -> None:
    from k3sched.tune import Workers

    data = load_config(TINY).to_dict()
    w = Workers(2)
    w.submit("a", data)
    w.submit("b", data)
    done = []
    t0 = time.perf_counter()
    while not w.idle() and time.perf_counter() - t0 < 120:
        done += w.poll(float("inf"))
        time.sleep(0.02)
    assert sorted(k for k, _ in done) == ["a", "b"] and all(r["step_us"] > 0 for _, r in done)
    w.submit("slow", data)
    res = []
    while not w.idle():
        res += w.poll(0.0)
    assert res[0][1]["error"].startswith("abandoned")
    w.close()


def test_with_a_task_time_spread_the_search_minimises_the_expected_step(tmp_path) -> None:
    """[Note: ranking with a task-time spread]: every result carries its plan's expected step, the
    best is the feasible one with the least expected step, and the outputs say so."""
    from k3sched.config import config_from_dict
    from k3sched.planner import plan

    cfg = load_config(TINY, ["hardware.cpu_runner.task_time_cv=0.3", "parallel.microbatches=2"])
    tuner = Tuner(cfg, cfg.hardware.device_memory_gb, time_limit_s=120, jobs=1)
    search(tuner, None)
    ok = [r for r in tuner.results if r.ok and r.peak_device <= tuner.budget_bytes]
    assert ok and all(r.expected_us is not None and r.rank_us == r.expected_us for r in ok)
    best = tuner.best()
    assert best.expected_us == min(r.expected_us for r in ok)
    again = plan(config_from_dict(cfg.to_dict(), best.set_args())).metrics
    assert again.expected["step_time_us"] == best.expected_us and again.step_time_us == best.step_us
    assert [r.rank_us for r in pareto(tuner.results)] == sorted(r.rank_us for r in pareto(tuner.results))
    console = Console(width=120, record=True)
    assert tune_command(TINY, ["hardware.cpu_runner.task_time_cv=0.3", "parallel.microbatches=2"], None, 60.0, 2, tmp_path,
                        console, progress=False) == 0
    text = console.export_text()
    assert "expected ms" in text and "times below are expected steps" in text
    assert max(len(line) for line in text.splitlines()) <= 120
    assert json.loads((tmp_path / "tune.json").read_text())["best"]["expected_us"] > 0
