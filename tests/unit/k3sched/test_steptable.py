"""The step table ([Note: step table] in k3sched/steptable.py) is the one description of a layer's
tasks: the graph builder, count_tasks, moe's task order and the runtime's dependencies follow it."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import CONFIGS
from k3sched import steptable
from k3sched.config import ConfigError, load_config
from k3sched.graph import OffloadChoice, build_step
from k3sched.limits import count_tasks
from k3sched.lowering import implied_edges
from k3sched.planner import backbone
from k3sched.tasks import Kind, parse_task_id
from moe import INTRA_LAYER_DEPS, microbatch_tasks
from runtime.executor import PlanTask
from runtime.stage.spec import model_args

TINY = CONFIGS / "tiny-cpu.yaml"


def _graph(overrides: list[str] = ()):
    cfg = load_config(TINY, list(overrides))
    return cfg, build_step(cfg, OffloadChoice(everything=cfg.schedule.offload != "none"))


def _runtime_deps(g) -> dict[str, set[str]]:
    """What each stage's executor waits for: the task's planned same-stage dependencies and
    :func:`k3sched.lowering.implied_edges` (as k3sched/lowering.py joins them)."""
    out: dict[str, set[str]] = {}
    for s in range(g.cfg.parallel.pp):
        lanes: dict[str, list[PlanTask]] = {}
        for t in g.tasks.values():
            if t.stage == s:
                lanes.setdefault(t.lane, []).append(PlanTask(t.id, t.kind, t.lane, t.stage, t.chunk, t.mb, t.layer,
                                                             deps=tuple(t.deps)))
        extra = implied_edges(lanes)
        for ts in lanes.values():
            for t in ts:
                out[t.id] = {d for d in t.deps if d.startswith(f"s{s}/")} | set(extra.get(t.id, ()))
    return out


def _with_row(monkeypatch, kind: Kind, **change) -> None:
    rows = tuple(dataclasses.replace(r, **change) if r.kind is kind else r for r in steptable.STEPS)
    monkeypatch.setattr(steptable, "STEPS", rows)


def _of(kind: Kind, tasks) -> list:
    return [t for t in tasks if t.kind is kind]


def test_one_edge_changes_the_plan_and_the_runtime_together(monkeypatch):
    cfg, before = _graph()
    run_before = _runtime_deps(before)
    _with_row(monkeypatch, Kind.ROUTER_BWD, deps=(Kind.DISPATCH_BWD,))  # drop router.bwd <- shared.dx
    _, after = _graph()
    run_after = _runtime_deps(after)
    routers = _of(Kind.ROUTER_BWD, before.tasks.values())
    assert routers
    for t in routers:
        sdx = t.id.replace("router.bwd", "shared.dx")
        assert sdx in t.deps and sdx in run_before[t.id]
        assert sdx not in after.tasks[t.id].deps and sdx not in run_after[t.id]
    assert Kind.SHARED_DX not in steptable.runtime_deps()[Kind.ROUTER_BWD]
    # no other edge moved, and the task count still follows the graph
    assert {k: t.deps for k, t in before.tasks.items() if t.kind is not Kind.ROUTER_BWD} == \
           {k: t.deps for k, t in after.tasks.items() if t.kind is not Kind.ROUTER_BWD}
    assert count_tasks(cfg).total == len(after.tasks) == len(before.tasks)


def test_one_row_changes_the_graph_the_count_and_the_runtime_together(monkeypatch):
    cfg, before = _graph()
    _with_row(monkeypatch, Kind.DISPATCH_RE, when=None)  # dispatch.re in every MoE layer
    _, after = _graph()
    moe_layers = cfg.model.layers - cfg.model.dense_layers
    added = cfg.parallel.microbatches * moe_layers
    assert count_tasks(cfg).total == len(after.tasks) == len(before.tasks) + added
    res = _of(Kind.DISPATCH_RE, after.tasks.values())
    assert len(res) == added and not _of(Kind.DISPATCH_RE, before.tasks.values())
    run_after = _runtime_deps(after)
    for t in res:
        assert t.id.replace("dispatch.re", "expert.fwd") in run_after[t.id]  # the implied edge
        assert t.id in after.tasks[t.id.replace("dispatch.re", "expert.dw")].deps
    args = model_args(cfg)
    assert sum(k is Kind.DISPATCH_RE for k, _ in microbatch_tasks(args).backward_dx) == moe_layers


@pytest.mark.parametrize("overrides", [[], ["schedule.dispatch_recompute=true", "parallel.seq_chunks=2"]])
def test_graph_edges_are_the_table_and_implied_edges_hold_in_the_plan(overrides):
    """Every same-layer dependency the builder adds is a planned edge of the table, and every
    implied edge is a path in the step's graph (it adds nothing to a plan)."""
    cfg, g = _graph(overrides)
    rows = {r.kind: r for r in steptable.STEPS}
    parents = {tid: t.deps for tid, t in g.tasks.items()}
    for t in g.tasks.values():
        if t.kind not in rows:
            continue
        key = parse_task_id(t.id)
        same = {parse_task_id(d).kind for d in t.deps
                if d in g.tasks and g.tasks[d].kind in rows and dataclasses.replace(parse_task_id(d), kind=key.kind) == key}
        assert same == {k for k in rows[t.kind].deps if t.id.replace(t.kind.value, k.value) in g.tasks}, t.id
        for k in rows[t.kind].implied:
            d = t.id.replace(t.kind.value, k.value)
            if d in g.tasks:
                assert _reaches(parents, t.id, d), (t.id, d)


def _reaches(parents: dict[str, list[str]], tid: str, target: str) -> bool:
    seen, todo = set(), [tid]
    while todo:
        for d in parents.get(todo.pop(), ()):
            if d == target:
                return True
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return False


@pytest.mark.parametrize("recompute", [False, True])
def test_moe_order_respects_every_edge_of_the_table(recompute):
    args = model_args(load_config(TINY, [f"schedule.dispatch_recompute={str(recompute).lower()}"]))
    assert args.dispatch_recompute is recompute
    tasks = microbatch_tasks(args)
    order = {task: i for i, task in enumerate(tasks.forward + tasks.backward_dx + tasks.wgrad)}
    assert len(order) == len(tasks.forward + tasks.backward_dx + tasks.wgrad)
    for (kind, layer), i in order.items():
        for k in INTRA_LAYER_DEPS.get(kind, ()):
            assert order.get((k, layer), -1) < i, (kind, k, layer)


PIPELINES = ["1f1b", "interleaved-1f1b", "zb-v", "dualpipe", "pipedream-2bw"]


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_count_tasks_is_the_graph_size_for_every_config(config):
    for pipeline in [None, *PIPELINES]:
        for extra in ([], ["schedule.dispatch_recompute=true"], ["schedule.layer_optim=true"]):
            ov = extra + ([f"schedule.pipeline={pipeline}"] if pipeline else [])
            try:
                cfg = load_config(CONFIGS / config, ov)
                backbone(cfg)
            except (ConfigError, ValueError):
                continue  # a shape this pipeline does not take (the planner refuses it)
            g = build_step(cfg, OffloadChoice(everything=cfg.schedule.offload != "none"))
            assert count_tasks(cfg).total == len(g.tasks), (config, ov)
