"""The memory-aware lower bound (k3sched/bound.py, [Note: memory-aware lower bound]) against CP-SAT
optima with the device budget modeled (k3sched/exact/, [Note: exact memory model]).

Deterministic CP-SAT settings: 2 workers, a deterministic time limit (not wall clock), seed 0.
A valid lower bound is never above a schedule within the budget, so it is checked against the
schedule CP-SAT found (re-timed with the real durations) and, where CP-SAT proves optimality,
that is the optimum.
"""

from __future__ import annotations

import functools
from pathlib import Path
from collections import Counter

import pytest

from k3sched.bound import format_gap_report, gap_report, lower_bound_us, memory_lower_bound_us, stage_memory_bounds
from k3sched.config import GiB, load_config
from k3sched.exact import solve_exact
from k3sched.graph import build_step
from k3sched.planner import plan

from conftest import CONFIGS

# (pp, microbatches, layers, dense layers, ep)
# (CP-SAT proves these optimal within the deterministic limit; pp2-m4-moe and pp4-m4-dense were
# checked once by hand against the schedules CP-SAT found, FEASIBLE in 3 minutes: too slow here)
INSTANCES = {"pp2-m3-dense": (2, 3, 2, 2, 1), "pp3-m3-dense": (3, 3, 3, 3, 1)}
ROOMS = (1.5, 1.8, 2.5)  # budget = largest static bytes + this many of the largest micro-batch's forward sets


def _cfg(inst: tuple, budget_gib: float):
    pp, m, layers, dense, ep = inst
    return load_config(CONFIGS / "tiny-cpu.yaml", [
        f"parallel.pp={pp}", f"parallel.microbatches={m}", f"model.layers={layers}", f"model.dense_layers={dense}",
        f"parallel.ep={ep}", "schedule.pipeline=1f1b", "schedule.offload=none",
        f"schedule.device_memory_budget={budget_gib}"])


@functools.lru_cache(maxsize=None)
def _case(name: str, room: float):
    inst = INSTANCES[name]
    g = build_step(_cfg(inst, 1000))
    per: Counter = Counter()
    for t in g.tasks.values():
        if g.unit[t.id][1] == "F":
            per[(t.stage, t.mb)] += t.alloc.device
    budget = (max(g.static_device) + room * max(per.values())) / GiB
    cfg = _cfg(inst, budget)
    g = build_step(cfg)
    res = solve_exact(cfg, mode="free", budget_bytes=cfg.budget_bytes, deterministic_time=2.0, workers=1,
                      seed=0, time_limit_s=60.0)
    return cfg, g, res


@pytest.mark.parametrize("room", ROOMS)
@pytest.mark.parametrize("name", list(INSTANCES))
def test_memory_bound_never_above_cpsat_optimum(name, room):
    cfg, g, res = _case(name, room)
    mlb = memory_lower_bound_us(g)
    print(f"\n{name} room {room}: lower bound {lower_bound_us(g)[0]:.0f} us, memory-aware {mlb:.0f} us, "
          f"CP-SAT {res.status} {res.makespan_us:.0f} us")
    assert res.status in ("OPTIMAL", "FEASIBLE")
    assert mlb >= lower_bound_us(g)[0] - 1e-6
    assert mlb <= res.makespan_us + 1e-6


def test_memory_bound_binds_under_a_tight_budget():
    """With room for about one micro-batch the bound rises above the memory-blind one (and stays
    below the optimum); with ample room it is the memory-blind one."""
    cfg, g, res = _case("pp3-m3-dense", 1.5)
    assert res.optimal
    assert lower_bound_us(g)[0] < memory_lower_bound_us(g) <= res.makespan_us + 1e-6
    big = build_step(_cfg(INSTANCES["pp3-m3-dense"], 1000))
    assert memory_lower_bound_us(big) == pytest.approx(lower_bound_us(big)[0])


def test_offload_only_lowers_the_bound():
    cfg, g, _ = _case("pp3-m3-dense", 1.5)
    off = cfg.model_copy(deep=True)
    off.schedule.offload = "auto"
    assert memory_lower_bound_us(build_step(off)) <= memory_lower_bound_us(g) + 1e-6
    assert all(st["warmup_idle_us"] >= 0 for st in stage_memory_bounds(g))


def test_plan_reports_memory_bound_and_gap_causes():
    p = plan(load_config(CONFIGS / "tiny-cpu.yaml", []))
    m = p.metrics
    assert m.lower_bound_us <= m.memory_lower_bound_us <= m.step_time_us + 1e-3
    rep = gap_report(p)
    for st in rep["stages"]:
        causes = sum(v for k, v in st.items() if k not in ("stage", "busy_us", "idle_us", "memory_warmup_idle_us"))
        assert causes == pytest.approx(st["idle_us"], abs=1.0)  # every idle µs has a cause
    text = format_gap_report(p)
    assert "memory-aware bound" in text and "stage   0" in text


def test_plan_gap_option_prints_each_stage():
    from typer.testing import CliRunner

    from k3sched.cli import app

    res = CliRunner().invoke(app, ["plan", str(Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"),
                                   "--gap"])
    assert res.exit_code == 0, res.output
    assert "memory-aware bound" in res.output and "stage   0: idle" in res.output and "stage   1: idle" in res.output
    assert "-0.0" not in res.output
