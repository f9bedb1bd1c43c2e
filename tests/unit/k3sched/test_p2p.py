"""NCCL-safe P2P: the plan-time check ([Note: NCCL P2P model] in k3sched/p2pcheck.py), the
directed communicators and their warm-up ([Note: NCCL-safe P2P] in runtime/groups.py), and
``--p2p strict`` ([Note: strict P2P] in runtime/stage/p2p.py).

The static tests plan every generated pipeline schedule on small shapes of tiny-cpu.yaml (PP 2
and 4, k3 and serial, with and without remote offload) and seed faults into plan dicts by editing
lane orders. The distributed tests train every schedule the runtime runs (PP 2, one launch for all
of them, see tests/p2p_worker.py) in both modes and compare the losses, and run one real
``run_command(p2p="strict")``; the whole file takes about a minute here."""

from __future__ import annotations

import copy
import json

import pytest

from k3sched.config import PIPELINES, load_config
from k3sched.p2pcheck import COMM_POLICIES, P2PDeadlock, analyse, check_p2p_transfers
from k3sched.planner import plan
from k3sched.planfile import plan_to_json
from k3sched.schedules import GENERATORS
from runtime.launch import PLANNED_ONLY

from conftest import CONFIGS, launch_p2p_worker

TINY = CONFIGS / "tiny-cpu.yaml"
SMALL = ["parallel.ep=1", "model.seq_len=16", "model.micro_batch_size=1", "model.dense_layers=0"]
V2 = ("interleaved-1f1b", "zb-v", "dualpipev", "v-half", "v-min")


def shape(name: str, pp: int, layers_per_chunk: int = 1) -> list[str]:
    """--set overrides of a small valid shape for ``name`` (as tests/unit/k3sched/test_schedules.py picks them:
    vpp 2 for interleaved / V schedules, micro-batches a multiple of pp and >= 2*pp)."""
    vpp = 2 if name in V2 else 1
    return SMALL + [f"schedule.pipeline={name}", f"parallel.pp={pp}", f"parallel.vpp={vpp}",
                    f"parallel.microbatches={2 * pp}", f"model.layers={pp * vpp * layers_per_chunk}"]


def _doc(overrides: list[str], strategy: str | None = None) -> dict:
    return plan_to_json(plan(load_config(TINY, overrides), strategy))


def _budget(overrides: list[str], frac: float) -> str:
    free = plan(load_config(TINY, overrides + ["schedule.offload=none"]))
    return f"schedule.device_memory_budget={max(free.metrics.peak_device_bytes) * frac / 2**30}"


# -- every plan the planner makes passes ------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["k3", "serial"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_schedule_plans_pass_the_nccl_check(name, pp, strategy):
    p = plan(load_config(TINY, shape(name, pp, 2)), strategy)
    doc = plan_to_json(p)
    n = check_p2p_transfers(doc)
    assert n == len([t for s in doc["stages"] for t in s["lanes"]["collective"] if t["kind"].endswith(".send")])
    assert check_p2p_transfers(p) == n  # the Plan object and its plan.json read the same


@pytest.mark.parametrize("name,pp", [("1f1b", 4), ("interleaved-1f1b", 4), ("zb-h1", 4), ("zb-v", 4)])
def test_plans_with_remote_offload_pass(name, pp):
    # tiny-cpu's own sequence and batch (saved activations worth offloading), EP 2
    ov = [o for o in shape(name, pp, 2) if o not in SMALL] + ["model.dense_layers=0", "schedule.remote_offload=true"]
    for strategy in ("k3", "serial"):
        doc = _doc(ov + [_budget(ov, 0.7)], strategy)
        check_p2p_transfers(doc)
    remote = [t for s in doc["stages"] for t in s["lanes"]["offload_remote"]]
    assert remote or name == "zb-v"  # the pipelines before zb-v do offload remotely at this budget


def test_grad_offload_and_ep_dp_plans_pass():
    for name in ("1f1b", "dualpipev"):
        ov = [o for o in shape(name, 2) if o != "parallel.ep=1"] + ["parallel.ep=2", "parallel.dp=2",
                                                                   "schedule.grad_offload=true"]
        check_p2p_transfers(_doc(ov))


def test_every_configured_pipeline_is_checked_or_not_planned():
    for name in PIPELINES:
        if name in GENERATORS:
            continue
        with pytest.raises(ValueError, match="not supported"):  # dualpipe: refused before any plan exists
            plan(load_config(TINY, shape(name, 2)))


def test_shipped_configs_pass():
    check_p2p_transfers(plan(load_config(TINY)))


# -- what the check catches ----------------------------------------------------------------------

def _lane(doc: dict, stage: int, lane: str = "collective") -> list[dict]:
    return doc["stages"][stage]["lanes"][lane]


def _move(doc: dict, stage: int, tid: str, before: str, lane: str = "collective") -> dict:
    """A copy of ``doc`` with task ``tid`` moved just before ``before`` on ``stage``'s lane."""
    doc = copy.deepcopy(doc)
    ts = _lane(doc, stage, lane)
    t = ts.pop(next(i for i, x in enumerate(ts) if x["id"] == tid))
    ts.insert(next(i for i, x in enumerate(ts) if x["id"] == before), t)
    return doc


@pytest.fixture(scope="module")
def one_f_one_b() -> dict:
    doc = _doc(shape("1f1b", 2))
    assert [t["id"] for t in _lane(doc, 0)][:4] == ["s0/mb0/v0/act.send", "s0/mb1/v0/act.send",
                                                     "s0/mb2/v0/act.send", "s0/mb0/v0/grad.recv"]
    return doc


def test_seeded_crossing_on_one_communicator_is_rejected_naming_the_cycle(one_f_one_b):
    # stage 1 sends gradient 0 before it receives activation 2, while stage 0 sends activation 2
    # before it receives gradient 0: both send first. On one communicator per stage pair (the
    # single pp group, or NCCL's pair communicator) each send waits behind the other's.
    doc = _move(one_f_one_b, 1, "s1/mb0/v0/grad.send", before="s1/mb2/v0/act.recv")
    for comms in ("shared",):
        with pytest.raises(P2PDeadlock) as e:
            check_p2p_transfers(doc, comms)
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(f"P2P deadlock under NCCL semantics (communicators: {comms}), stages 0, 1: ")
        r = analyse(doc, comms)
        assert set(r.cycle) == {"s0/mb2/v0/act.send", "s1/mb0/v0/grad.send"} and r.cycle[0] == r.cycle[-1]
        assert "s1/mb2/v0/act.recv" in msg and "s0/mb0/v0/grad.recv" in msg and "pp 0<->1" in msg
    # the runtime's directed communicators: each send waits only for its own receive
    assert analyse(doc, "directed").error is None
    assert analyse(doc, "kind").error is None  # acts and grads apart (the earlier pp / pp_grad) is enough here


def test_v_placement_crosses_activations_on_a_per_kind_communicator():
    # zb-v on 2 stages: activations go 0->1 (chunk 0) and 1->0 (chunk 1); with one activation
    # communicator per stage pair (the earlier pp group) the planner's own order deadlocks
    doc = _doc(shape("zb-v", 2))
    r = analyse(doc, "kind")
    assert r.error is not None and "stages 0, 1" in r.error and "<->" in r.error, r.error
    kinds = {t.rsplit("/", 1)[1] for t in r.cycle}
    assert kinds <= {"act.send", "grad.send", "act.recv", "grad.recv"}
    assert analyse(doc, "directed").error is None


def test_seeded_lane_order_deadlock_is_rejected_under_every_policy(one_f_one_b):
    # stage 0 waits for gradient 0 before it sends activation 0: consistent per direction (the
    # start-up pairing check passes it) but no communicator layout can run it
    doc = _move(one_f_one_b, 0, "s0/mb0/v0/grad.recv", before="s0/mb0/v0/act.send")
    for comms in COMM_POLICIES:
        r = analyse(doc, comms)
        assert r.error is not None and r.cycle[0] == r.cycle[-1]
        assert {"s0/mb0/v0/grad.recv", "s0/mb0/v0/act.send", "s1/mb0/v0/act.recv", "s1/mb0/v0/grad.send"} <= set(r.cycle)
        assert "before it on the collective lane" in r.error and "its matching send, not posted" in r.error


def test_order_mismatch_is_reported(one_f_one_b):
    doc = _move(one_f_one_b, 1, "s1/mb1/v0/act.recv", before="s1/mb0/v0/act.recv")
    with pytest.raises(P2PDeadlock, match=r"communicator act 0->1: transfer #0 from stage 0 to stage 1 is "
                                          r"s0/mb0/v0/act.send on stage 0 but s1/mb1/v0/act.recv on stage 1"):
        check_p2p_transfers(doc)


def test_unmatched_send_is_reported(one_f_one_b):
    doc = copy.deepcopy(one_f_one_b)
    ts = _lane(doc, 1)
    ts[:] = [t for t in ts if t["id"] != "s1/mb3/v0/act.recv"]
    for t in (t for lane in doc["stages"][1]["lanes"].values() for t in lane):
        t["deps"] = [d for d in t["deps"] if d != "s1/mb3/v0/act.recv"]
    with pytest.raises(P2PDeadlock, match="s0/mb3/v0/act.send .*no stage receives it"):
        check_p2p_transfers(doc)


def _remote_task(stage, kind, mb, layer, peer, deps=()):
    return {"id": f"s{stage}/mb{mb}/L{layer}/{kind}", "kind": kind, "lane": "offload_remote", "stage": stage,
            "chunk": 0, "mb": mb, "layer": layer, "deps": list(deps), "peer_stage": peer, "start_us": 0.0,
            "end_us": 0.0}


def test_seeded_crossing_on_the_remote_communicator_is_rejected():
    # each stage offloads a set to the other, then stores the other's: both send first on the
    # offload_remote lane's one communicator, and a remote send blocks its lane (gloo hangs too)
    a = _remote_task(0, "act.roffload", 0, 0, 1)
    b = _remote_task(1, "act.roffload", 0, 1, 0)
    lanes = {0: [a, _remote_task(0, "act.rstore", 0, 1, 1, [b["id"]])],
             1: [b, _remote_task(1, "act.rstore", 0, 0, 0, [a["id"]])]}
    doc = {"strategy": "k3", "shared_links": [],
           "stages": [{"stage": s, "lanes": {"offload_remote": lanes[s]}, "start_deps": {}} for s in (0, 1)]}
    r = analyse(doc)
    assert r.error is not None and set(r.cycle) == {t["id"] for ts in lanes.values() for t in ts}, r.error
    assert "its matching receive, not posted" in r.error and "before it on the offload_remote lane" in r.error
    doc["stages"][1]["lanes"]["offload_remote"].reverse()  # stage 1 receives first: fine
    assert analyse(doc).error is None


def test_the_check_replays_the_program_the_executor_runs():
    """p2pcheck reads each stage as the runtime's executor runs it ([Note: lowering]): the same
    lanes, start dependencies and same-stage dependencies, the step table's implied edges and tokens included."""
    from runtime.executor import Executor, noop_handlers

    from k3sched import p2pcheck
    from k3sched.lowering import implied_edges, stage_lanes

    doc = _doc(shape("1f1b", 2), "serial")
    v = p2pcheck._view(doc)
    for s in (0, 1):
        lanes = stage_lanes(doc, s)
        assert implied_edges(lanes)
        with Executor(lanes, noop_handlers(), stage=s, perturb=None, nvtx=False, extra_deps=implied_edges(lanes),
                      serial=doc["strategy"] == "serial", shared_links=doc["shared_links"]) as ex:
            assert ex.lanes == v.lanes[s]
            assert ex.dependencies() == {tid: v.deps[tid] for tid in ex.tasks}
            assert any(len(ds) > len({d for d in ex.tasks[tid].deps if d.startswith(f"s{s}/")})
                       for tid, ds in ex.dependencies().items())  # the serial token is among them


# -- plan time and run time refuse a deadlocking plan ------------------------------------------

def test_k3sched_plan_refuses_a_deadlocking_plan(seeded_planner, capsys):
    from typer.testing import CliRunner

    from k3sched.cli import app

    args = ["plan", str(TINY)] + sum((["--set", o] for o in shape("1f1b", 2)), [])
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    err = r.stderr if hasattr(r, "stderr") and r.stderr else r.output
    assert "P2P deadlock under NCCL semantics" in err and "s0/mb0/v0/grad.recv" in err


def test_run_refuses_a_deadlocking_plan_before_launch(seeded_planner, tmp_path, capsys):
    from runtime.launch import run_command

    rc = run_command(TINY, shape("1f1b", 2), 1, None, tmp_path / "run", quiet=True, timeout_s=30)
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "P2P deadlock under NCCL semantics" in err
    assert not (tmp_path / "run" / "plan.json").exists()  # nothing launched


def test_run_rejects_an_unknown_p2p_mode(tmp_path, capsys):
    from runtime.launch import run_command

    assert run_command(TINY, shape("1f1b", 2), 1, None, tmp_path, quiet=True, p2p="eager") == 2
    assert "--p2p: must be buffered or strict" in capsys.readouterr().err


def test_p2p_edges():
    from runtime.groups import p2p_edges

    assert p2p_edges([0, 1]) == [("act", 0, 1), ("grad", 1, 0)]
    assert p2p_edges([0, 1, 1, 0]) == [("act", 0, 1), ("act", 1, 0), ("grad", 0, 1), ("grad", 1, 0)]  # V
    assert p2p_edges([0, 1, 2, 0, 1, 2]) == [("act", 0, 1), ("act", 1, 2), ("act", 2, 0), ("grad", 0, 2),
                                             ("grad", 1, 0), ("grad", 2, 1)]  # interleaved: 2 -> 0 too


# -- distributed: every schedule in strict mode ---------------------------------------------------

# every generated schedule the runtime executes (tiny shapes, PP 2; runtime.launch.PLANNED_ONLY lists
# those it does not)
RUNTIME_SCHEDULES = sorted(set(GENERATORS) - set(PLANNED_ONLY))
LIMIT_S = 240.0


@pytest.mark.slow
def test_every_schedule_trains_identically_in_strict_mode(tmp_path):
    runs = [{"out": str(tmp_path / f"{name}-{mode}"), "overrides": shape(name, 2), "p2p": mode, "steps": 2}
            for name in RUNTIME_SCHEDULES for mode in ("buffered", "strict")]
    rc, out = launch_p2p_worker({"runs": runs, "timeout_s": 60, "crossing": str(tmp_path), "crossing_timeout_s": 3.0},
                                tmp_path, limit_s=LIMIT_S, what="the P2P worker")
    assert rc == 0, f"worker exited {rc}: {out[-3000:]}"
    for name in RUNTIME_SCHEDULES:
        a, b = (json.loads((tmp_path / f"{name}-{mode}" / "summary.json").read_text()) for mode in ("buffered", "strict"))
        assert (a["pipeline"], a["p2p"], b["p2p"]) == (name, "buffered", "strict")
        assert b["losses"] == a["losses"], name  # bit for bit: the same arithmetic, only the transport differs
    # a crossing order on one communicator: gloo's buffering completes it, strict mode refuses it
    for rank in (0, 1):
        res = json.loads((tmp_path / f"crossing_rank{rank}.json").read_text())
        assert res["buffered"] == [float(2 - rank)] * 4
        assert "strict" not in res and "ready token" in res["strict_error"], res
        assert res["strict_s"] < 3.0 * 2 + 5


@pytest.mark.slow
def test_k3sched_run_strict_end_to_end(tmp_path):
    from runtime.launch import run_command

    rc = run_command(TINY, shape("zb-v", 2), 1, None, tmp_path, quiet=True, timeout_s=150, p2p="strict")
    assert rc == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["p2p"] == "strict" and s["pipeline"] == "zb-v" and len(s["losses"]) == 1


def test_run_refuses_dualpipe_with_host_gradient_shards_in_one_line(tmp_path):
    # dualpipe runs (tests/e2e/test_bidir_run.py), but not with the host gradient shards: its two model
    # copies' gradients are summed on the device ([Note: replica gradient reduction])
    from typer.testing import CliRunner

    from k3sched.cli import app

    res = CliRunner().invoke(app, ["run", str(TINY), "--out", str(tmp_path / "o"), "--set",
                                   "schedule.pipeline=dualpipe", "--set", "parallel.vpp=1", "--set",
                                   "schedule.grad_offload=true"])
    assert res.exit_code == 2 and "dualpipe" in res.output and "schedule.grad_offload" in res.output, res.output
