"""Planner and simulator: properties over random small configs, exposure, budgets, determinism."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3sched.config import GiB, config_from_dict, load_config
from k3sched.limits import InfeasibleBudget
from k3sched.planfile import dumps_plan
from k3sched.planner import plan
from k3sched.simulator import DeadlockError, simulate
from k3sched.tasks import Kind, Mem, Task

from conftest import CONFIGS, draw_pipeline_shape

EPS = 1e-6


def check_plan_invariants(p, serial: bool) -> None:
    tasks = p.tasks
    # every task in exactly one lane order, on its own lane and stage
    seen = [tid for order in p.lane_orders.values() for tid in order]
    assert sorted(seen) == sorted(tasks)
    for (s, lane), order in p.lane_orders.items():
        assert all(tasks[t].stage == s and tasks[t].lane == lane for t in order)
        # one task at a time per lane, in the lane's order
        for a, b in zip(order, order[1:]):
            assert tasks[b].start_us >= tasks[a].end_us - EPS, (a, b)
    if serial:  # one task at a time per stage, across all lanes
        by_stage = defaultdict(list)
        for t in tasks.values():
            by_stage[t.stage].append(t)
        for ts in by_stage.values():
            ts.sort(key=lambda t: (t.start_us, t.end_us))
            for a, b in zip(ts, ts[1:]):
                assert b.start_us >= a.end_us - EPS, (a.id, b.id)
    for t in tasks.values():
        assert abs(t.end_us - t.start_us - t.duration_us) < 1e-3
        for d in t.deps:
            assert t.start_us >= tasks[d].end_us - EPS, (d, t.id)
        for d in p.graph.start_deps.get(t.id, ()):
            assert t.start_us >= tasks[d].start_us - EPS, (d, t.id)
    # device memory (what a stage holds for itself and for its peers) within the budget
    assert max(p.metrics.peak_device_bytes) <= p.cfg.budget_bytes
    assert p.metrics.lower_bound_us <= p.metrics.step_time_us + 1e-3
    assert p.metrics.lower_bound_us <= p.metrics.memory_lower_bound_us <= p.metrics.step_time_us + 1e-3
    # the simulator, evaluating the planner's lane orders, never needs longer than the plan
    fresh = {tid: Task(t.id, t.kind, t.lane, t.stage, t.chunk, t.mb, t.layer, t.duration_us, list(t.deps))
             for tid, t in tasks.items()}
    step = simulate(fresh, p.lane_orders)
    assert step <= p.metrics.step_time_us + 1e-3  # metrics are rounded to ns
    check_receives_in_send_order(p)


def check_receives_in_send_order(p) -> None:
    """NCCL pairs the k-th send from a to b with b's k-th receive on their communicator (one per
    kind and direction in the runtime): b's receives from a, in b's lane order, are a's sends to b
    in a's lane order ([Note: receives in send order] in k3sched/listsched.py)."""
    tasks = p.tasks
    recvd = defaultdict(list)  # (kind, a, b) -> the sends whose receives b posted, in b's order
    for order in p.lane_orders.values():
        for tid in order:
            t = tasks[tid]
            if t.kind in (Kind.FWD_RECV, Kind.BWD_RECV):
                (send,) = (d for d in t.deps if tasks[d].kind in (Kind.FWD_SEND, Kind.BWD_SEND))
                recvd[(t.kind, tasks[send].stage, t.stage)].append(send)
    for (kind, a, b), sends in recvd.items():
        mine = set(sends)
        own = [tid for tid in p.lane_orders[(a, tasks[sends[0]].lane)] if tid in mine]
        k = next((k for k, (x, y) in enumerate(zip(sends, own)) if x != y), None)
        assert k is None, f"{kind.value} {a}->{b}: transfer #{k} is {own[k]} but stage {b} receives {sends[k]}"


def test_k2_like_at_40_gib_posts_receives_in_send_order():
    """K2-like at a 40 GiB budget: stage 9 ran mb31's backward before mb30's and stage 8 posted
    mb30's gradient receive first (refused: NCCL would deliver the wrong tensor); the planner now
    holds a receive until the one sent before it was posted."""
    from k3sched.p2pcheck import check_p2p_transfers

    p = plan(load_config(CONFIGS / "k2-like.yaml", ["schedule.device_memory_budget=40"]))
    check_receives_in_send_order(p)
    check_p2p_transfers(p)


@st.composite
def small_configs(draw):
    base = load_config(CONFIGS / "tiny-cpu.yaml").to_dict()
    pp, pipeline, vpp, m = draw_pipeline_shape(draw)
    base["parallel"].update(pp=pp, vpp=vpp, ep=draw(st.sampled_from([1, 2])), dp=draw(st.sampled_from([1, 2])),
                            microbatches=m)
    base["model"].update(layers=pp * vpp * draw(st.integers(1, 2)), dense_layers=draw(st.integers(0, 1)))
    base["schedule"].update(pipeline=pipeline, offload=draw(st.sampled_from(["none", "auto", "all"])),
                            dispatch_recompute=draw(st.booleans()), grad_offload=draw(st.booleans()),
                            remote_offload=draw(st.booleans()), lookahead=draw(st.integers(0, 2)),
                            wgrad_lag=draw(st.integers(0, 3)))
    base["hardware"]["device_memory_gb"] = 4.0
    frac = draw(st.sampled_from([None, 0.5, 0.8]))
    return config_from_dict(base), frac


@settings(max_examples=int(os.environ.get("K3SCHED_HYPOTHESIS_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(small_configs(), st.sampled_from(["k3", "serial"]))
def test_plan_properties_on_random_small_configs(cfg_frac, strategy):
    cfg, frac = cfg_frac
    if frac is not None:  # a budget below the no-offload peak: offload must make it fit, or fail cleanly
        free = plan(cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"offload": "none"})}), strategy)
        cfg.schedule.device_memory_budget = max(free.metrics.peak_device_bytes) * frac / GiB
    try:
        p = plan(cfg, strategy)
    except InfeasibleBudget as e:
        assert cfg.schedule.offload != "all" or frac is not None
        assert "smallest feasible budget" in str(e) or "no budget" in str(e)
        return
    check_plan_invariants(p, strategy == "serial")
    assert dumps_plan(p) == dumps_plan(plan(cfg, strategy))  # same config in, byte-identical plan out


def test_same_config_gives_byte_identical_plan(tiny_cfg):
    assert dumps_plan(plan(tiny_cfg)) == dumps_plan(plan(tiny_cfg))


def ep_bound_config(**sched):
    """EP all-to-all shorter than the independent compute around it (fast EP link)."""
    return load_config(CONFIGS / "tiny-cpu.yaml", ["parallel.pp=2", "parallel.microbatches=8",
                                                   "hardware.nvlink_gbps=8", "schedule.offload=none",
                                                   *[f"schedule.{k}={v}" for k, v in sched.items()]])


def test_k3_hides_ep_communication_that_serial_exposes():
    cfg = ep_bound_config()
    k3, serial = plan(cfg, "k3"), plan(cfg, "serial")
    ep_total = [sum(t.duration_us for t in serial.tasks.values() if t.stage == s and t.lane == "ep")
                for s in range(cfg.parallel.pp)]
    ep_compute = sum(t.duration_us for t in k3.tasks.values() if t.lane == "compute")
    assert sum(ep_total) < ep_compute
    assert k3.metrics.exposed_ep_ratio < 0.05, k3.metrics.exposed_ep_ratio
    for s in range(cfg.parallel.pp):
        assert serial.metrics.exposed_comm_us[s]["ep"] == pytest.approx(ep_total[s], rel=1e-6)
    assert k3.metrics.step_time_us < serial.metrics.step_time_us


def test_wgrad_fills_compute_idle_and_dx_precedes_dw():
    p = plan(ep_bound_config())
    t = p.tasks
    for tid, task in t.items():
        if task.kind in (Kind.ATTN_DW, Kind.EXPERT_DW, Kind.SHARED_DW, Kind.MLP_DW):
            dx = tid.replace(".dw", ".dx")
            assert task.start_us >= t[dx].end_us
    # some WGrad ran later than right after its dX: it was deferred to fill idle compute
    deferred = [task for tid, task in t.items() if task.kind is Kind.EXPERT_DW
                and task.start_us > t[tid.replace(".dw", ".dx")].end_us + 1e-6]
    assert deferred


def test_infeasible_budget_names_the_smallest_feasible_one(tiny_cfg):
    tiny_cfg.schedule.device_memory_budget = 0.001
    with pytest.raises(InfeasibleBudget) as e:
        plan(tiny_cfg)
    msg = str(e.value)
    assert "\n" not in msg and "smallest feasible budget is" in msg
    smallest = float(msg.split("smallest feasible budget is ")[1].split()[0])
    tiny_cfg.schedule.device_memory_budget = smallest
    p = plan(tiny_cfg)  # the budget named is one that plans
    assert max(p.metrics.peak_device_bytes) <= p.cfg.budget_bytes


def test_budget_below_no_offload_peak_offloads_and_fits(tiny_cfg):
    free = plan(tiny_cfg.model_copy(update={"schedule": tiny_cfg.schedule.model_copy(update={"offload": "none"})}))
    peak = max(free.metrics.peak_device_bytes)
    tiny_cfg.schedule.device_memory_budget = 0.8 * peak / GiB
    p = plan(tiny_cfg)
    assert p.metrics.offloaded_sets["local"] > 0
    assert max(p.metrics.peak_device_bytes) <= 0.8 * peak + 1
    kinds = {t.kind for t in p.tasks.values()}
    assert {Kind.ACT_OFFLOAD, Kind.ACT_ONLOAD} <= kinds
    check_plan_invariants(p, serial=False)
    for t in p.tasks.values():  # onload only after its offload, consumers only after onload
        if t.kind is Kind.ACT_ONLOAD:
            off = t.id.replace("act.onload", "act.offload")
            assert t.start_us >= p.tasks[off].end_us


def test_simulator_computes_starts_and_detects_deadlock():
    def T(tid, lane, dur, deps=()):
        return Task(tid, Kind.ATTN_FWD, lane, 0, 0, 0, 0, dur, list(deps))

    tasks = {"a": T("a", "compute", 2), "b": T("b", "ep", 3, ["a"]), "c": T("c", "compute", 1),
             "d": T("d", "compute", 1, ["b"])}
    step = simulate(tasks, {(0, "compute"): ["a", "c", "d"], (0, "ep"): ["b"]})
    assert (tasks["c"].start_us, tasks["b"].start_us, tasks["d"].start_us, step) == (2, 2, 5, 6)
    with pytest.raises(DeadlockError, match="deadlocks"):
        simulate(tasks, {(0, "compute"): ["d", "a", "c"], (0, "ep"): ["b"]})
    with pytest.raises(ValueError, match="in no lane order"):
        simulate(tasks, {(0, "compute"): ["a", "c", "d"]})


def test_memory_timeline_frees_before_allocs_at_the_same_instant():
    from k3sched.simulator import memory_timeline

    a = Task("a", Kind.ATTN_FWD, "compute", 0, 0, 0, 0, 1, [], alloc=Mem(device=10), free=Mem(device=10))
    b = Task("b", Kind.ATTN_FWD, "compute", 0, 0, 0, 0, 1, [], alloc=Mem(device=7))
    a.start_us, a.end_us, b.start_us, b.end_us = 0, 1, 1, 2
    tl = memory_timeline([a, b], {(0, "device"): 100})[(0, "device")]
    assert tl.peak == 110


def test_plan_metrics_for_k2_like_full_step():
    cfg = load_config(CONFIGS / "k2-like.yaml")
    p = plan(cfg)
    m = p.metrics
    assert cfg.parallel.microbatches >= 32 and len(m.peak_device_bytes) == 16
    assert m.lower_bound_us <= m.step_time_us
    assert max(m.peak_device_bytes) <= cfg.budget_bytes
    assert m.step_time_us < plan(cfg, "serial").metrics.step_time_us
    json.loads(dumps_plan(p))


def test_balanced_layer_split_leaves_room_for_the_head():
    from k3sched.layersplit import min_max_split, split_layers

    cfg = load_config(CONFIGS / "k2-like.yaml")
    split = split_layers(cfg)
    assert sum(map(len, split)) == 61 and [L for part in split for L in part] == list(range(61))
    assert split[-1] == []  # the output head alone costs as much as two layers
    even = load_config(CONFIGS / "k2-like.yaml", ["parallel.layer_split=even"])
    assert [len(p) for p in split_layers(even)] == [2] * 29 + [1] * 3
    assert plan(cfg).metrics.step_time_us < plan(even).metrics.step_time_us
    # brute force agrees with the DP on a small case
    import itertools

    w, parts = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0], 3
    got = min_max_split(w, parts, first_extra=2.0, last_extra=6.0)
    cost = lambda s: max(sum(w[i] for i in g) + (2.0 if k == 0 else 0) + (6.0 if k == parts - 1 else 0)  # noqa: E731
                         for k, g in enumerate(s))
    best = min(cost([range(0, a), range(a, b), range(b, len(w))])
               for a, b in itertools.combinations(range(len(w) + 1), 2) if a < b)
    assert cost(got) == best


def test_balanced_split_gives_the_first_vstage_the_fewest_layers_that_keep_the_largest():
    """[Note: a light first vstage]: among the min-max splits, group 0 holds the fewest items, at
    least one; brute force over every split of small cases, and K2-like's split."""
    import itertools
    import random

    from k3sched.layersplit import min_max_split, split_layers

    rng = random.Random(7)
    for _ in range(200):
        n, parts = rng.randint(2, 7), rng.randint(2, 4)
        w = [float(rng.choice([1, 1, 2, 3])) for _ in range(n)]
        fe, le = float(rng.choice([0, 1, 2])), float(rng.choice([0, 1, 4]))

        def cost(s):
            return max(sum(w[i] for i in g) + (fe if k == 0 else 0) + (le if k == parts - 1 else 0)
                       for k, g in enumerate(s))

        splits = []
        for cuts in itertools.combinations(range(n + 1), parts - 1):
            b = (0, *cuts, n)
            s = [range(b[k], b[k + 1]) for k in range(parts)]
            if all(len(g) for g in s[1:-1]):  # inner groups hold at least one item
                splits.append(s)
        best = min(cost(s) for s in splits)
        got = min_max_split(w, parts, first_extra=fe, last_extra=le)
        assert [i for g in got for i in g] == list(range(n)) and cost(got) == best
        firsts = [len(s[0]) for s in splits if cost(s) == best]
        if len(got[0]):  # non-empty group 0: the smallest non-empty one any optimal split has
            assert len(got[0]) == min(f for f in firsts if f)
        else:  # the plain DP's empty group 0 is kept
            assert 0 in firsts
    k2 = split_layers(load_config(CONFIGS / "k2-like.yaml"))
    assert [len(p) for p in k2] == [1] + [2] * 30 + [0]


def test_lower_bound_is_jackson_preemptive_bound():
    from k3sched.bound import _jackson_preemptive

    # two jobs released at 0 and 1: run the long-tail one first, preempting
    assert _jackson_preemptive([(0.0, 4.0, 0.0), (1.0, 1.0, 10.0)]) == 12.0
    assert _jackson_preemptive([(0.0, 2.0, 1.0)]) == 3.0


def test_send_buffer_stays_on_the_sender_until_its_receive_ends(tiny_cfg):
    """A P2P send holds its buffer (T h b bytes) on the sending stage until the matching receive
    on the other stage has ended (``release``), as the runtime holds the isend's tensor."""
    from k3sched.simulator import memory_timeline

    p = plan(tiny_cfg)
    sends = [t for t in p.tasks.values() if t.kind is Kind.FWD_SEND]
    recv = {t.deps[0]: t for t in p.tasks.values() if t.kind is Kind.FWD_RECV}
    assert sends
    nbytes = sends[0].bytes
    assert nbytes == tiny_cfg.model.tokens * tiny_cfg.model.hidden * tiny_cfg.model.dtype_bytes
    for s in sends:
        r = recv[s.id]
        assert s.alloc.device == nbytes and r.release == (s.stage, nbytes)
    # on the sender, device memory during [send start, receive end) includes the buffer: replaying
    # without the releases leaves every send buffer allocated to the end of the step
    mem = memory_timeline(p.tasks.values())[(0, "device")]
    kept = memory_timeline([Task(**{**t.__dict__, "release": None}) for t in p.tasks.values()])[(0, "device")]
    assert kept.bytes[-1] - mem.bytes[-1] == nbytes * len([s for s in sends if s.stage == 0])


def test_dualpipe_plans_with_two_parameter_copies():
    """Bidirectional DualPipe ([Note: dualpipe mapping]): every rank holds one stage of each model
    copy, so twice DualPipeV's parameters; each micro-batch runs the pp stages of its direction."""
    base = ["parallel.pp=2", "parallel.microbatches=8", "model.layers=4"]
    dual = plan(load_config(CONFIGS / "tiny-cpu.yaml", base + ["schedule.pipeline=dualpipe", "parallel.vpp=1"]))
    check_plan_invariants(dual, serial=False)
    v = plan(load_config(CONFIGS / "tiny-cpu.yaml", base + ["schedule.pipeline=dualpipev", "parallel.vpp=2"]))
    assert dual.pipeline == "dualpipe"
    assert all(d > x for d, x in zip(dual.graph.static_device, v.graph.static_device))  # two copies
    down = {t.stage for t in dual.tasks.values() if t.kind is Kind.EMBED_FWD and t.mb < 4}
    up = {t.stage for t in dual.tasks.values() if t.kind is Kind.EMBED_FWD and t.mb >= 4}
    assert down == {0} and up == {1}  # fed from both ends
    assert sum(1 for t in dual.tasks.values() if t.kind is Kind.HEAD_FWD) == 8
    with pytest.raises(ValueError, match="vpp 1"):
        plan(load_config(CONFIGS / "tiny-cpu.yaml", base + ["schedule.pipeline=dualpipe", "parallel.vpp=2"]))


def test_memory_levels_share_one_graph_and_the_leanest_decides_feasibility(tiny_cfg, monkeypatch):
    # [Note: memory levels]: one step graph per plan() call, whatever the levels and budgets tried
    import k3sched.planner as planner_mod

    tiny_cfg.schedule.lookahead, tiny_cfg.schedule.wgrad_lag = 1, 4
    assert planner_mod._memory_levels(tiny_cfg, "k3") == [(1, 4), (1, 2), (1, 1), (1, 0), (0, 0)]
    assert planner_mod._memory_levels(tiny_cfg, "serial") == [(1, 4)]
    builds = []
    real = planner_mod.build_step
    monkeypatch.setattr(planner_mod, "build_step", lambda *a, **k: builds.append(1) or real(*a, **k))
    tiny_cfg.schedule.device_memory_budget = 0.001
    with pytest.raises(InfeasibleBudget) as e:
        plan(tiny_cfg)
    assert len(builds) == 1
    smallest = float(str(e.value).split("smallest feasible budget is ")[1].split()[0])
    tiny_cfg.schedule.device_memory_budget = smallest
    p = plan(tiny_cfg)  # the budget named plans, at the leanest level or a level between
    assert max(p.metrics.peak_device_bytes) <= p.cfg.budget_bytes
    level = (p.cfg.schedule.lookahead, p.cfg.schedule.wgrad_lag)
    assert level != (1, 4) and p.metrics.memory_lean == {"lookahead": level[0], "wgrad_lag": level[1]}
    check_plan_invariants(p, serial=False)
    # the plan returned is the attempt of its own level (re-run after the levels between)
    again = planner_mod._plan(tiny_cfg.model_copy(update={"schedule": p.cfg.schedule}), None, None)
    assert again.metrics.step_time_us == pytest.approx(p.metrics.step_time_us)


def test_a_budget_the_leanest_level_misses_skips_the_configured_levels_search(tiny_cfg, monkeypatch):
    import k3sched.planner as planner_mod

    # [Note: fast infeasible budgets]: near the cheap bound, one list schedule at the leanest level with
    # everything offloaded comes first; when it misses, the configured level is never searched
    tiny_cfg.schedule.lookahead, tiny_cfg.schedule.wgrad_lag = 1, 4
    tiny_cfg.schedule.device_memory_budget = 0.001
    levels = []
    real = planner_mod._Search.run
    monkeypatch.setattr(planner_mod._Search, "run",
                        lambda self, chosen, la, lag: levels.append((la, lag)) or real(self, chosen, la, lag))
    with pytest.raises(InfeasibleBudget, match="smallest feasible budget is "):
        plan(tiny_cfg)
    assert levels and set(levels) == {(0, 0)}


def test_the_leanest_level_check_does_not_change_a_plan_that_fits(tiny_cfg, monkeypatch):
    import k3sched.planner as planner_mod

    tiny_cfg.schedule.lookahead, tiny_cfg.schedule.wgrad_lag = 1, 4
    tiny_cfg.schedule.device_memory_budget = 0.001
    with pytest.raises(InfeasibleBudget) as e:
        plan(tiny_cfg)
    smallest = float(str(e.value).split("smallest feasible budget is ")[1].split()[0])
    docs = []
    for near in (0.0, 1e9):  # never / always checked first
        monkeypatch.setattr(planner_mod, "NEAR_BOUND", near)
        for budget in (smallest, 2 * smallest):
            tiny_cfg.schedule.device_memory_budget = budget
            docs.append(dumps_plan(plan(tiny_cfg)))
    assert docs[:2] == docs[2:]


@pytest.mark.parametrize("over", [["schedule.offload=all"], ["schedule.offload=remote",
                                                                 "schedule.device_memory_budget=0.0255"], []])
def test_memory_events_give_memory_timelines_exactly(tiny_cfg, over):
    # k3sched/simulator.py MemoryEvents (the offload search's arrays; memory_timeline uses them too)
    # against a plain replay, on a planned step with local, remote (peer bytes) and P2P (release)
    # effects, for several skip sets
    import random
    from types import SimpleNamespace

    import numpy as np

    from k3sched.simulator import MemoryEvents

    def memory_timeline(kept, base):  # the simple reference: events sorted per (stage, space)
        events = defaultdict(list)
        for n, t in enumerate(kept):
            owner = t.stage if t.peer_stage is None else t.peer_stage
            effects = [((t.stage, "device"), True, t.alloc.device), ((t.stage, "device"), False, -t.free.device),
                       ((t.stage, "host"), True, t.alloc.host), ((t.stage, "host"), False, -t.free.host),
                       ((owner, "peer"), True, t.alloc.peer), ((owner, "peer"), False, -t.free.peer)]
            if t.release is not None:
                effects.append(((t.release[0], "device"), False, -t.release[1]))
            for key, at_start, delta in effects:
                if delta:
                    events[key].append((t.start_us if at_start else t.end_us, int(at_start), n, delta))
        out = {}
        for key in sorted(set(events) | set(base)):
            evs = sorted(events.get(key, []))
            b0 = base.get(key, 0)
            out[key] = SimpleNamespace(base=b0, times_us=np.array([e[0] for e in evs], dtype=float),
                                       bytes=b0 + np.cumsum(np.array([e[3] for e in evs], dtype=np.int64))
                                       if evs else np.array([b0]))
        return out

    cfg = load_config(CONFIGS / "tiny-cpu.yaml", over)
    p = plan(cfg)
    tasks = list(p.tasks.values())
    assert any(t.release for t in tasks)
    if "schedule.offload=remote" in over:
        assert any(t.alloc.peer for t in tasks)
    ev = MemoryEvents(tasks)
    base = {(s, "device"): 1000 + s for s in range(cfg.parallel.pp)}
    rng = random.Random(0)
    for skip in (set(), set(range(0, len(tasks), 3)), set(rng.sample(range(len(tasks)), len(tasks) // 2))):
        want = memory_timeline([t for i, t in enumerate(tasks) if i not in skip], base)
        got = ev.timeline([t.start_us for t in tasks], [t.end_us for t in tasks], skip, base)
        assert list(got) == list(want)
        for k in want:
            assert got[k].base == want[k].base
            assert got[k].times_us.tolist() == want[k].times_us.tolist()
            assert got[k].bytes.tolist() == want[k].bytes.tolist() and got[k].bytes.dtype == want[k].bytes.dtype
