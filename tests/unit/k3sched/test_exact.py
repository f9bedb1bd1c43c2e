"""The k3 list scheduler against the exact optimum (CP-SAT) of the same task DAG.

Fixed suite of small instances derived from configs/tiny-cpu.yaml. The acceptance reference is the
*backbone-constrained* optimum (k3sched/exact/, [Note: backbone-constrained mode]): the best lane
placement given the plan's pipeline schedule (compute lane gated by the backbone slots with the
config's lookahead; WGrad, communication and copies free). The free optimum (no backbone, [Note:
exact model scope]) is solved too and its gap printed, not asserted. Memory is modeled by neither.

Per instance the gap (heuristic / optimum - 1, or / CP-SAT's proven bound when the time limit hits)
is printed (run with -s) and recorded as a junit property. Instances whose measured gap is above
the 5% goal are marked xfail (strict) with the measured gap and its cause: open findings for the
planner, not hidden.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from k3sched.config import load_config
from k3sched.exact import MAX_TASKS, backbone_pairs, gate_violations, plan_lookahead, solve_exact
from k3sched.planner import plan

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"
GOAL = 0.05
# CP-SAT limits in deterministic time with one worker and a fixed seed (not wall clock), so a result
# does not depend on machine load; the wall clock (20x) is only a safety net
DTIME = 3.0  # backbone-constrained solve (the acceptance reference)
FREE_DTIME = 2.0  # free solve (reported only; its bound also starts the constrained one's)
SOLVE = {"workers": 1, "seed": 0}
HINT_PIPELINES = ("gpipe", "1f1b", "zb-h1", "zb-h2")
HINT_WGRAD_LAG = 8  # k3 on the same backbone with dW deferred further: a feasible constrained schedule

# name: (pp, microbatches, layers, dense_layers, ep, pipeline)
INSTANCES = {
    "pp1-m1-dense-gpipe": (1, 1, 1, 1, 1, "gpipe"),
    "pp1-m4-moe-1f1b": (1, 4, 2, 0, 2, "1f1b"),
    "pp2-m2-gpipe-ep1": (2, 2, 2, 1, 1, "gpipe"),
    "pp2-m4-1f1b": (2, 4, 4, 1, 2, "1f1b"),
    "pp2-m8-zbh1": (2, 8, 2, 0, 2, "zb-h1"),
    "pp2-m4-dense-1f1b": (2, 4, 4, 4, 1, "1f1b"),
    "pp2-m8-gpipe": (2, 8, 4, 1, 2, "gpipe"),
    "pp3-m3-1f1b": (3, 3, 3, 1, 2, "1f1b"),
    "pp3-m6-zbh1-ep1": (3, 6, 6, 1, 1, "zb-h1"),
    "pp3-m1-zbh1": (3, 1, 3, 0, 2, "zb-h1"),
    "pp4-m4-gpipe": (4, 4, 4, 1, 2, "gpipe"),
    "pp4-m8-1f1b": (4, 8, 4, 1, 2, "1f1b"),
    "pp4-m8-zbh1-2l": (4, 8, 8, 1, 2, "zb-h1"),
    "pp4-m8-dense-gpipe": (4, 8, 4, 4, 1, "gpipe"),
}

# Instances whose measured gap is above the goal are listed here (strict xfail: measured gap and
# cause in the reason). None at present: the WGrad tie-break (backbone tasks win ties) and the
# default wgrad_lag 4 brought every instance within 2.7% of the backbone-constrained optimum.
KNOWN_GAPS: dict[str, str] = {}


def _cfg(name: str, pipeline: str | None = None):
    pp, m, layers, dense, ep, pipe = INSTANCES[name]
    return load_config(TINY, [f"parallel.pp={pp}", f"parallel.microbatches={m}", f"model.layers={layers}",
                              f"model.dense_layers={dense}", f"parallel.ep={ep}",
                              f"schedule.pipeline={pipeline or pipe}", "schedule.offload=none",
                              "schedule.device_memory_budget=1000"])


@functools.lru_cache(maxsize=None)
def _solved(name: str):
    """(cfg, k3 plan, backbone-constrained result, free result)."""
    cfg = _cfg(name)
    heur = plan(cfg, "k3")
    others = [plan(_cfg(name, p), "k3") for p in HINT_PIPELINES if p != cfg.schedule.pipeline]
    lagged = cfg.model_copy(deep=True)
    lagged.schedule.wgrad_lag = HINT_WGRAD_LAG
    free = solve_exact(cfg, mode="free", deterministic_time=FREE_DTIME, hint_plan=[heur, *others], **SOLVE)
    back = solve_exact(cfg, mode="backbone", ranks=heur.backbone, lookahead=plan_lookahead(heur),
                       deterministic_time=DTIME, hint_plan=[heur, plan(lagged, "k3")], lower=free, **SOLVE)
    return cfg, heur, back, free


def _marks(known: dict[str, str]):
    return [pytest.param(n, marks=pytest.mark.xfail(reason=known[n], strict=True)) if n in known else n
            for n in INSTANCES]


def _ref(res) -> float:
    return res.makespan_us if res.optimal else res.bound_us


@pytest.mark.parametrize("name", _marks(KNOWN_GAPS))
def test_k3_within_5pct_of_exact(name: str, record_property) -> None:
    _, heur, res, free = _solved(name)
    step = heur.metrics.step_time_us
    gap, gap_free = step / _ref(res) - 1, step / _ref(free) - 1
    record_property("gap_backbone", round(gap, 5))
    record_property("gap_free", round(gap_free, 5))
    print(f"\n{name}: k3 {step / 1e3:.3f} ms | backbone {res.status} best {res.makespan_us / 1e3:.3f} bound "
          f"{res.bound_us / 1e3:.3f} gap {gap * 100:.2f}% (vs best {(step / res.makespan_us - 1) * 100:.2f}%, "
          f"{res.wall_s:.1f} s) | free {free.status} best {free.makespan_us / 1e3:.3f} bound "
          f"{free.bound_us / 1e3:.3f} gap {gap_free * 100:.2f}% ({free.wall_s:.1f} s) | {res.num_tasks} tasks")
    assert res.status in ("OPTIMAL", "FEASIBLE")
    assert gap <= GOAL, f"{name}: k3 {step:.0f} us is {gap * 100:.2f}% above the backbone optimum/bound {_ref(res):.0f} us"


@pytest.mark.parametrize("name", list(INSTANCES))
def test_heuristic_is_feasible_for_backbone_model(name: str) -> None:
    """k3's own schedule follows the backbone gate (and its WGrad deadline), its re-timed lane orders
    are accepted as the constrained model's hint (an upper bound), and constraining never helps."""
    cfg, heur, res, free = _solved(name)
    pairs = backbone_pairs(heur.graph, heur.backbone, plan_lookahead(heur), cfg.schedule.wgrad_lag)
    assert not gate_violations(pairs, {t: x.start_us for t, x in heur.tasks.items()})
    assert res.hint_makespan_us is not None and res.hints_rejected == 0
    assert res.hint_makespan_us <= heur.metrics.step_time_us + res.num_tasks / res.scale + 1e-6
    assert res.makespan_us <= heur.metrics.step_time_us + res.rounding_us + 1e-6
    # constrained optimum >= free optimum: any constrained schedule is a free one
    assert res.makespan_us >= free.bound_us - 1e-6
    if res.optimal and free.optimal:
        assert res.objective_us >= free.objective_us - 1e-9


@pytest.mark.parametrize("name", list(INSTANCES))
def test_k3_never_worse_than_serial(name: str) -> None:
    cfg = _cfg(name)
    k3, serial = plan(cfg, "k3"), plan(cfg, "serial")
    assert k3.metrics.step_time_us <= serial.metrics.step_time_us + 1e-6, (
        f"{name}: k3 {k3.metrics.step_time_us:.0f} us > serial {serial.metrics.step_time_us:.0f} us")


@pytest.mark.parametrize("name", list(INSTANCES))
def test_planner_lower_bound_is_below_exact(name: str) -> None:
    """A valid lower bound never exceeds the optimum; the exact best schedule is >= the optimum."""
    _, heur, res, free = _solved(name)
    lb = heur.metrics.lower_bound_us
    for r in (res, free):
        assert lb <= r.makespan_us + 1e-6, f"{name}: planner lower bound {lb:.0f} > exact schedule {r.makespan_us:.0f}"
        # and CP-SAT's proven bound (rounding-corrected) never exceeds the schedule it found
        assert r.bound_us <= r.makespan_us + 1e-6


def test_exact_schedule_respects_dag_and_lanes() -> None:
    """The exact starts form a valid schedule of the DAG under the lane rules (checked directly)."""
    from k3sched.graph import build_step

    cfg, heur, res, _ = _solved("pp2-m4-dense-1f1b")
    g = build_step(cfg)
    tasks = g.tasks
    assert set(res.starts) == set(tasks)
    end = {t: res.starts[t] + tasks[t].duration_us for t in tasks}
    for tid, t in tasks.items():
        for d in t.deps:
            assert end[d] <= res.starts[tid] + 1e-6, (d, tid)
    lanes: dict = {}
    for tid, t in tasks.items():
        lanes.setdefault((t.stage, t.lane), []).append((res.starts[tid], end[tid]))
    for iv in lanes.values():
        iv.sort()
        for (_, e0), (s1, _) in zip(iv, iv[1:]):
            assert e0 <= s1 + 1e-6
    assert max(end.values()) == pytest.approx(res.makespan_us)
    # and the backbone gate
    assert not gate_violations(backbone_pairs(g, heur.backbone, plan_lookahead(heur)), res.starts, 1e-6)


def test_free_mode_may_leave_the_backbone() -> None:
    """The free solve on pp3-m3-1f1b runs tasks out of the 1F1B gate and is shorter than the
    constrained one; a schedule that breaks the gate is not used as the constrained model's hint."""
    from k3sched.graph import build_step

    cfg, heur, res, free = _solved("pp3-m3-1f1b")
    # FREE_DTIME leaves this free solve at the backbone's schedule; twice that leaves it: shorter than
    # the constrained result and within 0.5% of its own lower bound (proved optimal with the hints of
    # the WGrad drain by slot; with the drain by layer, [Note: the WGrad drain by layer], 0.13% short
    # of the proof at 2x and 4x the time)
    others = [plan(_cfg("pp3-m3-1f1b", p), "k3") for p in HINT_PIPELINES if p != cfg.schedule.pipeline]
    free = solve_exact(cfg, mode="free", deterministic_time=2 * FREE_DTIME, hint_plan=[heur, *others], **SOLVE)
    assert free.makespan_us < res.makespan_us and free.makespan_us <= 1.005 * free.bound_us, \
        (free.status, free.makespan_us, free.bound_us, res.makespan_us)
    g = build_step(cfg)
    assert gate_violations(backbone_pairs(g, heur.backbone, plan_lookahead(heur)), free.starts)
    other = solve_exact(cfg, deterministic_time=0.5, hint_plan=free, **SOLVE)  # the free optimum breaks the gate
    assert other.hints_rejected == 1 and other.hint_makespan_us is None
    with pytest.raises(ValueError, match="mode"):
        solve_exact(cfg, mode="nope")


def test_too_large_instance_is_refused() -> None:
    cfg = load_config(TINY, ["parallel.pp=4", "parallel.microbatches=32", "model.layers=16",
                             "schedule.offload=none"])
    with pytest.raises(ValueError, match=f"limit of {MAX_TASKS}"):
        solve_exact(cfg, deterministic_time=1.0, **SOLVE)
