"""The k3 list scheduler against the exact optimum (CP-SAT) of the same task DAG.

Fixed suite of small instances derived from configs/tiny-cpu.yaml. The exact model ignores the
pipeline backbone and memory (see [Note: exact model scope] in k3sched/exact.py), so the gap
measures the heuristic *and its backbone* against the best any lane placement of the DAG can do.

Instances whose measured gap is above the 5% goal are marked xfail (strict) with the measured
gap and its cause in the reason: they are open findings for the planner, not hidden.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from k3sched.config import load_config
from k3sched.exact import MAX_TASKS, solve_exact
from k3sched.planner import plan

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml"
GOAL = 0.05
TIME_LIMIT_S = 4.0
HINT_PIPELINES = ("gpipe", "1f1b", "zb-h1", "zb-h2")

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

_FILL = ("WGrad fill: a ~2 ms dW (expert.dw/head.dw) starts on the compute lane while a ~0.15 ms EP "
         "a2a (dispatch.bwd) is in flight, delaying the critical-path router.bwd/attn.dx by the dW")
_BACKBONE = "1F1B backbone order (the memory-free optimum runs forwards ahead, zb-h1 on this DAG is near optimal)"
# Measured with tiny-cpu.yaml as of this commit: heuristic vs optimum (or vs CP-SAT bound).
KNOWN_GAPS = {
    "pp2-m4-1f1b": f"gap 7.4% vs best found (7.9% vs bound): {_BACKBONE}",
    "pp2-m4-dense-1f1b": f"gap 5.9% (OPTIMAL): {_BACKBONE}",
    "pp3-m3-1f1b": f"gap 16.8% (OPTIMAL): {_BACKBONE} plus {_FILL}",
    "pp3-m1-zbh1": f"gap 9.1% (OPTIMAL): {_FILL}",
    "pp4-m4-gpipe": f"gap 13.4% vs best found (14.6% vs bound): GPipe backbone (every dW after all "
                    f"backwards) and {_FILL}",
    "pp4-m8-1f1b": f"gap 11.2% vs best found (11.6% vs bound; k3 on zb-h2 is 7.8% shorter): {_BACKBONE}",
}
SERIAL_BEATS_K3 = {
    "pp3-m1-zbh1": f"k3 37.5 ms vs serial 35.5 ms: {_FILL}",
    "pp3-m6-zbh1-ep1": f"k3 194.3 ms vs serial 193.4 ms: {_FILL} (10-22 ms of such delays per stage)",
}


def _cfg(name: str, pipeline: str | None = None):
    pp, m, layers, dense, ep, pipe = INSTANCES[name]
    return load_config(TINY, [f"parallel.pp={pp}", f"parallel.microbatches={m}", f"model.layers={layers}",
                              f"model.dense_layers={dense}", f"parallel.ep={ep}",
                              f"schedule.pipeline={pipeline or pipe}", "schedule.offload=none",
                              "schedule.device_memory_budget=1000"])


@functools.lru_cache(maxsize=None)
def _solved(name: str):
    cfg = _cfg(name)
    heur = plan(cfg, "k3")
    hints = [heur] + [plan(_cfg(name, p), "k3") for p in HINT_PIPELINES if p != cfg.schedule.pipeline]
    return cfg, heur, solve_exact(cfg, time_limit_s=TIME_LIMIT_S, hint_plan=hints)


def _marks(known: dict[str, str]):
    return [pytest.param(n, marks=pytest.mark.xfail(reason=known[n], strict=True)) if n in known else n
            for n in INSTANCES]


@pytest.mark.parametrize("name", _marks(KNOWN_GAPS))
def test_k3_within_5pct_of_exact(name: str) -> None:
    _, heur, res = _solved(name)
    step = heur.metrics["step_time_us"]
    ref = res.makespan_us if res.optimal else res.bound_us
    gap = step / ref - 1
    print(f"{name}: {res.status} heuristic {step / 1e3:.3f} ms, exact best {res.makespan_us / 1e3:.3f} ms, "
          f"bound {res.bound_us / 1e3:.3f} ms, gap {gap * 100:.2f}% (vs best {step / res.makespan_us * 100 - 100:.2f}%), "
          f"{res.num_tasks} tasks, {res.wall_s:.1f} s")
    assert res.status in ("OPTIMAL", "FEASIBLE")
    assert gap <= GOAL, f"{name}: k3 {step:.0f} us is {gap * 100:.2f}% above the exact reference {ref:.0f} us"


@pytest.mark.parametrize("name", _marks(SERIAL_BEATS_K3))
def test_k3_never_worse_than_serial(name: str) -> None:
    cfg = _cfg(name)
    k3, serial = plan(cfg, "k3"), plan(cfg, "serial")
    assert k3.metrics["step_time_us"] <= serial.metrics["step_time_us"] + 1e-6, (
        f"{name}: k3 {k3.metrics['step_time_us']:.0f} us > serial {serial.metrics['step_time_us']:.0f} us")


@pytest.mark.parametrize("name", list(INSTANCES))
def test_planner_lower_bound_is_below_exact(name: str) -> None:
    """A valid lower bound never exceeds the optimum; the exact best schedule is >= the optimum."""
    _, heur, res = _solved(name)
    lb = heur.metrics["lower_bound_us"]
    assert lb <= res.makespan_us + 1e-6, f"{name}: planner lower bound {lb:.0f} > exact schedule {res.makespan_us:.0f}"
    # and CP-SAT's proven bound (rounding-corrected) never exceeds the schedule it found
    assert res.bound_us <= res.makespan_us + 1e-6


def test_exact_schedule_respects_dag_and_lanes() -> None:
    """The exact starts form a valid schedule of the DAG under the lane rules (checked directly)."""
    from k3sched.graph import build_step

    cfg, _, res = _solved("pp2-m4-dense-1f1b")
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


def test_too_large_instance_is_refused() -> None:
    cfg = load_config(TINY, ["parallel.pp=4", "parallel.microbatches=32", "model.layers=16",
                             "schedule.offload=none"])
    with pytest.raises(ValueError, match=f"limit of {MAX_TASKS}"):
        solve_exact(cfg, time_limit_s=1.0)
