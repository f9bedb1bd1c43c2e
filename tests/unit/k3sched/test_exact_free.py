"""The exact free-order model (``k3sched.exact.solve_free``, [Note: exact free-order model]) against
every plain schedule under the same device-memory budget.

Fixed suite of small instances derived from configs/tiny-cpu.yaml, each with a budget that binds
(static bytes plus ``room`` times the largest micro-batch's activation sets on one stage). Per
instance the plain schedules are k3 plans of each backbone on the same placement (gpipe, 1f1b,
zb-h1, zb-h2) and the serial plan, all with offload ``auto`` under that budget; a backbone whose
plan cannot meet the budget has no step under it and is left out. CP-SAT stops on deterministic
time with one worker and a fixed seed (``DTIME``), so the result does not depend on machine load.
Each found schedule is checked directly against the DAG, the lanes and the budget (memory counted
by ``simulator.memory_timeline``, the planner's own accounting), not through the solver.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import pytest

from k3sched.config import load_config
from k3sched.exact import ACT_CHOICES, solve_exact, solve_free
from k3sched.graph import build_step
from k3sched.limits import InfeasibleBudget
from k3sched.metrics import device_peak_per_stage
from k3sched.planner import plan
from k3sched.simulator import memory_timeline

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"
GiB = 2**30
DTIME = 0.3  # CP-SAT deterministic time per solve (one worker, seed 0)
PLAIN = ("gpipe", "1f1b", "zb-h1", "zb-h2")

# name: (pp, microbatches, layers per stage, dense layers, ep, room)
INSTANCES = {
    "pp2-m2-dense": (2, 2, 1, 2, 1, 2.0),
    "pp2-m2-dense-loose": (2, 2, 1, 2, 1, 3.0),
    "pp2-m4-dense": (2, 4, 1, 2, 1, 2.0),
    "pp2-m4-moe": (2, 4, 1, 0, 2, 1.5),
    "pp2-m4-moe-loose": (2, 4, 1, 0, 2, 2.5),
    "pp3-m3-dense": (3, 3, 1, 3, 1, 2.0),
    "pp2-m2-2l-moe": (2, 2, 2, 1, 2, 1.5),
    "pp3-m4-moe": (3, 4, 1, 1, 2, 2.5),
    "pp4-m4-dense": (4, 4, 1, 4, 1, 2.5),
}


def instance_config(name: str, pipeline: str = "1f1b", budget_gib: float | None = None):
    """The config of instance ``name`` with ``pipeline``; its budget from ``room`` unless given."""
    pp, m, lps, dense, ep, room = INSTANCES[name]
    over = [f"parallel.pp={pp}", f"parallel.microbatches={m}", f"model.layers={pp * lps}",
            f"model.dense_layers={dense}", f"parallel.ep={ep}", f"schedule.pipeline={pipeline}",
            "schedule.offload=auto"]
    if budget_gib is None:
        g = build_step(load_config(TINY, over + ["schedule.offload=none"]))
        per: Counter = Counter()
        for (s, mb, _), b in g.offload_sets.items():
            per[(s, mb)] += b
        budget_gib = (max(g.static_device) + room * max(per.values())) / GiB
    return load_config(TINY, over + [f"schedule.device_memory_budget={budget_gib!r}"])


def plain_plans(name: str) -> dict:
    """Every plain schedule's plan under the instance's budget (those that meet it)."""
    cfg = instance_config(name)
    gib = cfg.schedule.device_memory_budget
    out = {}
    for pipe in PLAIN:
        try:
            out[pipe] = plan(instance_config(name, pipe, gib), "k3")
        except InfeasibleBudget:
            pass
    try:
        out["serial"] = plan(cfg, "serial")
    except InfeasibleBudget:
        pass
    return out


@functools.lru_cache(maxsize=None)
def _solved(name: str):
    cfg = instance_config(name)
    plains = plain_plans(name)
    return cfg, plains, solve_free(cfg, hint_plans=list(plains.values()), deterministic_time=DTIME)


def check_schedule(cfg, res) -> None:
    """``res.tasks`` is a schedule of the DAG (every dependency, one task at a time per lane) whose
    device memory, counted by the planner's accounting (device plus bytes held for peers), stays
    within the budget."""
    tasks = res.tasks
    assert set(build_step(cfg).tasks) <= set(tasks)
    for tid, t in tasks.items():
        for d in t.deps:
            assert tasks[d].end_us <= t.start_us + 1e-6, (d, tid)
    lanes: dict = {}
    for t in tasks.values():
        if t.lane != "none":
            lanes.setdefault((t.stage, t.lane), []).append((t.start_us, t.end_us))
    for iv in lanes.values():
        iv.sort()
        for (_, e0), (s1, _) in zip(iv, iv[1:]):
            assert e0 <= s1 + 1e-6
    g = build_step(cfg)
    mem = memory_timeline(tasks.values(), {(s, "device"): d for s, d in enumerate(g.static_device)})
    peaks = device_peak_per_stage(mem, cfg.parallel.pp)
    assert max(peaks) <= res.budget_bytes, (peaks, res.budget_bytes)
    assert max(t.end_us for t in tasks.values()) == pytest.approx(res.makespan_us)


@pytest.mark.parametrize("name", list(INSTANCES))
def test_free_optimum_never_above_a_plain_schedule(name: str, record_property) -> None:
    cfg, plains, res = _solved(name)
    assert plains, f"{name}: no plain schedule meets the budget; the instance tests nothing"
    assert res.status in ("OPTIMAL", "FEASIBLE")
    # every plain plan, mapped onto the model and re-timed, is a schedule of it within the budget: the
    # model's lanes, dependencies and memory accounting agree with the planner's on each of them
    assert res.hints_rejected == 0 and res.hint_makespan_us is not None
    check_schedule(cfg, res)
    steps = {k: p.metrics.step_time_us for k, p in plains.items()}
    record_property("best_plain_us", min(steps.values()))
    record_property("exact_us", res.makespan_us)
    print(f"\n{name}: exact {res.status} {res.makespan_us / 1e3:.3f} ms (bound {res.bound_us / 1e3:.3f}), "
          f"choices {dict(Counter(res.choices.values()))} | "
          + ", ".join(f"{k} {v / 1e3:.3f}" for k, v in steps.items()))
    for k, step in steps.items():
        # the durations are rounded up to 10 ns in the model: a plain schedule is at worst that much longer there
        assert res.makespan_us <= step + res.rounding_us + 1e-6, (
            f"{name}: exact {res.makespan_us:.0f} us > {k} {step:.0f} us")
    assert res.bound_us <= res.makespan_us + 1e-6
    assert res.bound_us <= min(steps.values()) + 1e-6


def test_free_model_without_a_budget_is_the_free_order_optimum() -> None:
    """With memory unbounded, keeping every set is optimal and the model is the free-order one of
    ``solve_exact(mode="free")``: both prove the same optimum on the rounded durations."""
    cfg = instance_config("pp2-m2-dense", budget_gib=1000.0)
    free = solve_exact(cfg, mode="free", deterministic_time=DTIME, workers=1)
    mine = solve_free(cfg, deterministic_time=DTIME)
    assert free.optimal and mine.optimal
    assert mine.objective_us == pytest.approx(free.objective_us)
    assert set(mine.choices.values()) == {"keep"}


def test_a_tight_budget_is_met_by_moving_activations() -> None:
    """Under a budget that keeping every set in the one-micro-batch-at-a-time order cannot meet,
    the model still finds a schedule within it, by offloading or recomputing sets."""
    name = "pp2-m4-moe"
    cfg, plains, res = _solved(name)
    g = build_step(instance_config(name, budget_gib=1000.0))
    per: Counter = Counter()
    for (s, mb, _), b in g.offload_sets.items():
        per[(s, mb)] += b
    assert res.budget_bytes < max(g.static_device) + 2 * max(per.values())
    moved = Counter(res.choices.values())
    assert moved["keep"] < len(res.choices), moved
    check_schedule(cfg, res)


def test_recompute_only_and_keep_only() -> None:
    """Each storage choice is a real alternative: limited to keep and recompute, the model meets a
    budget the plain schedules meet only by offloading, and every non-kept set is recomputed; the
    result is never better than with every choice open (same search limit, hinted the same)."""
    name = "pp2-m4-dense"
    cfg, plains, res = _solved(name)
    rec = solve_free(cfg, choices=("keep", "recompute"), deterministic_time=DTIME)
    assert rec.status in ("OPTIMAL", "FEASIBLE")
    assert set(rec.choices.values()) <= {"keep", "recompute"}
    check_schedule(cfg, rec)
    assert rec.bound_us <= res.makespan_us + 1e-6  # a bound of a restriction is no bound of the whole
    with pytest.raises(ValueError, match="keep"):
        solve_free(cfg, choices=("local",))
    assert ACT_CHOICES == ("keep", "local", "remote", "recompute")


def test_every_storage_choice_is_scheduled_and_counted() -> None:
    """Fixed choices (stage 0's sets to stage 1's memory, stage 1's recomputed): the added tasks are
    in the schedule on their lanes, the peer's bytes count on stage 1, the re-run forwards follow
    their originals, and the step is no shorter than the free optimum that keeps everything."""
    cfg = instance_config("pp2-m2-dense", budget_gib=1000.0)
    sets = [k for k, b in build_step(cfg).offload_sets.items() if b]
    fixed = {k: "remote" if k[0] == 0 else "recompute" for k in sets}
    res = solve_free(cfg, fixed=fixed, deterministic_time=DTIME)
    keep = solve_free(cfg, deterministic_time=DTIME)
    assert res.optimal and keep.optimal and res.choices == fixed
    check_schedule(cfg, res)
    kinds = Counter((t.stage, t.kind.value, t.lane) for t in res.tasks.values() if t.id.endswith("@re")
                    or t.kind.value.startswith("act.r"))
    assert kinds[(0, "act.roffload", "offload_remote")] == kinds[(0, "act.ronload", "offload_remote")] == 2
    assert kinds[(1, "act.rstore", "offload_remote")] == kinds[(1, "act.rserve", "offload_remote")] == 2
    assert kinds[(1, "attn.fwd", "compute")] == kinds[(1, "mlp.fwd", "compute")] == 2
    peer = memory_timeline(res.tasks.values())[(1, "peer")]
    assert 0 < peer.peak <= sum(b for (s, _, _), b in build_step(cfg).offload_sets.items() if s == 0)
    assert res.objective_us >= keep.objective_us
    with pytest.raises(ValueError, match="cannot be 'remote'"):
        solve_free(cfg, fixed={(1, 0, 1): "remote"}, deterministic_time=DTIME)  # the last stage has no peer


def test_cli_plan_exact_order_free() -> None:
    from typer.testing import CliRunner

    from k3sched.cli import app

    cfg = instance_config("pp2-m2-dense")
    args = ["plan", str(TINY), "--set", "parallel.microbatches=2", "--set", "model.layers=2", "--set",
            "model.dense_layers=2", "--set", "parallel.ep=1", "--set",
            f"schedule.device_memory_budget={cfg.schedule.device_memory_budget!r}", "--exact", "--exact-order", "free",
            "--exact-time-limit", str(DTIME)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # the console wraps long lines
    assert "exact, order free, budget" in text and "activation sets keep" in text and "% vs" in text
    bad = CliRunner().invoke(app, args[:-4] + ["--exact-order", "sideways"])
    assert bad.exit_code == 2 and "--exact-order: must be backbone or free" in bad.output


def test_reservoir_fallback_agrees_with_the_cumulative() -> None:
    """The same memory levels as a reservoir of events (the fallback when allocations and frees do
    not pair): its schedule is valid too and never shorter than the optimum the cumulative proves, so
    the pairing into intervals does not cut off schedules the events allow."""
    cfg = instance_config("pp2-m2-dense-loose")
    cum = solve_free(cfg, deterministic_time=0.5)
    res = solve_free(cfg, deterministic_time=0.5, memory="reservoir")
    assert cum.optimal and res.status in ("OPTIMAL", "FEASIBLE")
    check_schedule(cfg, res)
    assert res.objective_us >= cum.objective_us
