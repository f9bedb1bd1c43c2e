"""The lowering passes ([Note: lowering] in k3sched/lowering.py), each on a small hand-written
stage: input lanes -> expected dependencies; and the runtime's lowering of a real plan is the
P2P check's."""

from __future__ import annotations

import pytest

from k3sched.config import load_config
from k3sched.lowering import (LaneProgram, LoweringError, PlanTask, data_edges, implied_edges, link_tokens, lower,
                              lower_stage, plan_deps, rank_start_deps, read_lanes, serial_tokens, stage_lanes,
                              token_order)
from k3sched.planner import plan
from k3sched.planfile import plan_to_json
from k3sched.tasks import LANES, Kind, id_bucket, parse_task_id

from conftest import CONFIGS

KIND_OF = {"compute": Kind.ATTN_FWD, "ep": Kind.DISPATCH_FWD, "collective": Kind.FWD_SEND,
           "offload_local": Kind.ACT_OFFLOAD, "offload_remote": Kind.ACT_ROFFLOAD}


def _lanes(spec: str) -> dict[str, list[PlanTask]]:
    """Lanes from one line per lane: ``lane: id@start[<dep,dep] ...`` (``<`` marks a plan dep;
    ``^`` a start dep). Ids are short (``a``); tasks sit on stage 0 as ``s0/<id>``."""
    out = {lane: [] for lane in LANES}
    for line in spec.strip().splitlines():
        lane, _, tasks = line.partition(":")
        lane = lane.strip()
        for word in tasks.split():
            word, _, start = word.partition("^")
            word, _, deps = word.partition("<")
            tid, _, at = word.partition("@")
            out[lane].append(PlanTask(f"s0/{tid}", KIND_OF[lane], lane, 0, 0, 0, 0,
                                      deps=tuple(f"s0/{d}" if "/" not in d else d for d in deps.split(",") if d),
                                      start_deps=tuple(f"s0/{d}" for d in start.split(",") if d),
                                      start_us=float(at or 0), end_us=float(at or 0) + 1))
    return out


def _short(deps) -> dict[str, list[str]]:
    """Dependencies with the ``s0/`` prefix dropped, empty ones left out."""
    return {k[3:]: [d[3:] for d in ds] for k, ds in deps.items() if ds}


STAGE = """
compute: a@0 b@2<a c@4<b,s1/x,b
ep: d@1<a e@3<d^b
"""


def test_rank_start_deps_moves_the_peer_rserve_trigger_to_our_ronload():
    starts = {0: {"s0/mb0/L1/act.rstore": ["s0/mb0/L1/attn.dx", "s1/mb0/L1/attn.fwd"],
                  "s0/mb1/L1/act.ronload": ["s0/mb1/L2/attn.dx"]},
              1: {"s1/mb1/L1/act.rserve": ["s0/mb1/L3/attn.dx", "s1/mb1/L9/attn.dx"],
                  "s1/mb2/L1/act.rserve": ["s1/mb2/L9/attn.dx"],
                  "s1/mb3/L1/attn.fwd": ["s0/mb3/L3/attn.dx"]}}
    assert rank_start_deps(starts, 0) == {
        "s0/mb0/L1/act.rstore": ("s0/mb0/L1/attn.dx",),  # the other stage's dependency dropped
        "s0/mb1/L1/act.ronload": ("s0/mb1/L2/attn.dx", "s0/mb1/L3/attn.dx")}  # own first, then the trigger
    # stage 0's start dependencies name no rserve: nothing moves to stage 1; a task left without
    # a same-stage start dependency is left out
    assert rank_start_deps(starts, 1) == {"s1/mb1/L1/act.rserve": ("s1/mb1/L9/attn.dx",),
                                          "s1/mb2/L1/act.rserve": ("s1/mb2/L9/attn.dx",)}


def test_read_lanes_keeps_plan_order_and_attaches_start_deps():
    t = {"id": "s0/v0/L1/grad.rs.b2", "kind": "grad.rs", "lane": "collective", "stage": 0, "chunk": 0,
         "mb": None, "layer": 1, "deps": ["s0/mb0/L1/attn.dw"], "bytes": 8, "start_us": 1.5, "end_us": 2.5}
    u = dict(t, id="s0/v0/L0/grad.rs", layer=0, deps=[])
    lanes = read_lanes({"lanes": {"collective": [t, u]}}, {"s0/v0/L0/grad.rs": ("s0/v0/L1/grad.rs.b2",)})
    assert list(lanes) == list(LANES) and [x.id for x in lanes["collective"]] == [t["id"], u["id"]]
    a, b = lanes["collective"]
    assert (a.kind, a.bucket, a.deps, a.start_deps, a.bytes, a.start_us) == \
        (Kind.GRAD_RS, 2, ("s0/mb0/L1/attn.dw",), (), 8, 1.5)
    assert (b.bucket, b.start_deps) == (None, ("s0/v0/L1/grad.rs.b2",))


def test_id_bucket_is_the_parsed_bucket():
    for tid in ("s0/v0/L1/grad.rs.b2", "s0/v0/L1/grad.rs", "s3/mb2/L0/router.bwd", "s1/step/optim.run.b11",
                "s0/mb0q1/L2/combine.bwd"):
        assert id_bucket(tid) == parse_task_id(tid).bucket, tid


def test_plan_deps_keeps_same_stage_deps_once_each():
    assert _short(plan_deps(_lanes(STAGE), 0)) == {"b": ["a"], "c": ["b"], "d": ["a"], "e": ["d"]}


@pytest.mark.parametrize("spec,missing", [("compute: a<zz", "s0/zz"), ("compute: a^zz", "s0/zz")])
def test_plan_deps_refuses_a_same_stage_dependency_that_is_no_task(spec, missing):
    with pytest.raises(LoweringError, match=f"task s0/a: dependency {missing} is not a task of stage 0"):
        plan_deps(_lanes(spec), 0)


def test_data_edges_append_known_tasks_after_the_plan_deps():
    lanes = _lanes(STAGE)
    deps = data_edges(lanes, plan_deps(lanes, 0), {"s0/c": ("s0/d", "s0/b", "s0/zz"), "s0/zz": ("s0/a",),
                                                   "s0/a": ()})
    assert _short(deps) == {"b": ["a"], "c": ["b", "d"], "d": ["a"], "e": ["d"]}


def test_token_order_follows_planned_start_within_lane_and_dependency_order():
    lanes = _lanes(STAGE)
    assert [t[3:] for t in token_order(lanes, plan_deps(lanes, 0))] == ["a", "d", "b", "e", "c"]
    late = _lanes("compute: a@0 b@1\nep: d@0.5<b")  # a dependency against the planned times wins
    assert [t[3:] for t in token_order(late, plan_deps(late, 0))] == ["a", "b", "d"]
    cyc = _lanes("compute: a@0<b b@1")
    with pytest.raises(LoweringError, match="task s0/a: its lane order and same-stage dependencies form a cycle"):
        token_order(cyc, plan_deps(cyc, 0))


def test_serial_tokens_chain_every_task_of_the_rank():
    lanes = _lanes(STAGE)
    assert _short(serial_tokens(lanes, plan_deps(lanes, 0))) == {
        "d": ["a"], "b": ["a", "d"], "e": ["d", "b"], "c": ["b", "e"]}


def test_link_tokens_chain_each_group_and_leave_other_lanes_alone():
    lanes = _lanes("compute: a@0 b@9\nep: d@1 e@3\noffload_remote: r@2 q@4\ncollective: x@0 y@1")
    deps = link_tokens(lanes, plan_deps(lanes, 0), [("ep", "offload_remote")])
    assert _short(deps) == {"r": ["d"], "e": ["r"], "q": ["e"]}
    assert link_tokens(lanes, plan_deps(lanes, 0), []) == plan_deps(lanes, 0)


def test_lower_runs_the_passes_in_order():
    lanes = _lanes(STAGE)
    prog = lower(lanes, 0, extra={"s0/e": ("s0/a",)}, serial=True, shared_links=[("compute", "ep")])
    assert isinstance(prog, LaneProgram) and prog.stage == 0 and list(prog.lanes) == list(LANES)
    assert prog.lanes["compute"] == lanes["compute"] and list(prog.tasks()) == ["s0/a", "s0/b", "s0/c", "s0/d", "s0/e"]
    # plan deps, then the data edge, then the serial token (shared links ignored in a serial run)
    assert _short(prog.deps) == {"b": ["a", "d"], "c": ["b", "e"], "d": ["a"], "e": ["d", "a", "b"]}
    assert _short(lower(lanes, 0, shared_links=[("compute", "ep")]).deps) == _short(prog.deps) | {"e": ["d", "b"]}


def test_lower_stage_reads_strategy_and_links_from_the_plan():
    ov = ["parallel.pp=2", "parallel.ep=1", "parallel.microbatches=4", "model.layers=2", "model.seq_len=16",
          "model.micro_batch_size=1", "model.dense_layers=0"]
    for strategy in ("serial", "k3"):
        doc = plan_to_json(plan(load_config(CONFIGS / "tiny-cpu.yaml", ov), strategy))
        for s in (0, 1):
            lanes = stage_lanes(doc, s)
            want = lower(lanes, s, extra=implied_edges(lanes), serial=strategy == "serial",
                         shared_links=doc["shared_links"])
            assert implied_edges(lanes)  # the step table's implied edges are part of the default
            assert lower_stage(doc, s) == want
            assert lower_stage(doc, s, lanes) == want
            assert lower_stage(doc, s, lanes, {}) == lower(lanes, s, serial=strategy == "serial",
                                                           shared_links=doc["shared_links"])
        tids = [t["id"] for st in doc["stages"] for ts in st["lanes"].values() for t in ts]
        assert all(id_bucket(t) == parse_task_id(t).bucket for t in tids)


def test_the_executor_runs_a_program_as_lowered():
    from runtime.executor import Executor, noop_handlers

    lanes = _lanes(STAGE)
    prog = lower(lanes, 0, extra={"s0/e": ("s0/a",)}, serial=True)
    with Executor(prog, noop_handlers(), nvtx=False) as ex:
        assert ex.lanes == prog.lanes and ex.dependencies() == prog.deps
        rec = ex.run_step()
    assert [t.id[3:] for t in sorted(rec.timings, key=lambda t: t.start_us)] == ["a", "d", "b", "e", "c"]
    with pytest.raises(ValueError, match="a LaneProgram runs as lowered"):
        Executor(prog, noop_handlers(), serial=True)
