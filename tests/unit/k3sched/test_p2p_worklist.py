"""The P2P check's worklist ([Note: P2P check worklist] in k3sched/p2pcheck.py) against the sweep
it replaces (every lane visited every sweep), on planned and seeded-fault plans; and ``k3sched
plan --out`` refusing a deadlocking plan writes nothing ([Note: parallel outputs] in
k3sched/render.py)."""

from __future__ import annotations

import copy
import random

import pytest

from k3sched import p2pcheck
from k3sched.config import load_config
from k3sched.planner import plan
from k3sched.planfile import plan_to_json
from k3sched.tasks import LANES

from conftest import CONFIGS

TINY = CONFIGS / "tiny-cpu.yaml"
SMALL = ["parallel.ep=1", "model.seq_len=16", "model.micro_batch_size=1", "model.dense_layers=0"]


class _EverySweep(p2pcheck._Run):
    """The reference: every lane visited in every sweep, whether anything woke it or not."""

    def execute(self) -> list[str]:
        order = [(s, lane) for s in self.v.lanes for lane in LANES]
        pos = dict.fromkeys(order, 0)
        changed = True
        while changed:
            changed = False
            for key in order:
                i, began = self._advance_lane(key, self.v.lanes[key[0]][key[1]], pos[key])
                if began or i != pos[key]:
                    pos[key], changed = i, True
            changed = self._complete_heads() or changed
        return [tid for tid in self.task if tid not in self.done or (tid in self.comm and tid not in self.complete)]


def _state(run_cls, doc, comms):
    """analyse()'s run of ``doc`` with ``run_cls``: what the check reports and the final state."""
    real = p2pcheck._Run
    runs = []

    class Recording(run_cls):
        def execute(self):
            runs.append(self)
            return super().execute()

    p2pcheck._Run = Recording
    try:
        r = p2pcheck.analyse(doc, comms)
    finally:
        p2pcheck._Run = real
    if not runs:  # refused before the run (a mismatch)
        return r.error, r.cycle, r.transfers, None
    run = runs[0]
    return r.error, r.cycle, r.transfers, (run.started, run.done, run.complete,
                                          {k: list(q) for k, q in run.queues.items()})


def _seeded(doc: dict, rng: random.Random) -> dict:
    """``doc`` with one to three tasks moved within their lanes (deadlocks and mismatches of every kind)."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        st = rng.choice(doc["stages"])
        ts = rng.choice([ts for ts in st["lanes"].values() if len(ts) > 1])
        ts.insert(rng.randrange(len(ts)), ts.pop(rng.randrange(len(ts))))
    return doc


def _remote(name: str) -> list[str]:
    """tiny-cpu on 4 stages with remote offload at 70% of the device peak (act.rserve start dependencies)."""
    ov = [f"schedule.pipeline={name}", "parallel.pp=4", "parallel.vpp=1", "parallel.microbatches=8",
          "model.layers=8", "model.dense_layers=0", "schedule.remote_offload=true"]
    free = plan(load_config(TINY, ov + ["schedule.offload=none"]))
    return ov + [f"schedule.device_memory_budget={max(free.metrics.peak_device_bytes) * 0.7 / 2**30}"]


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2), ("dualpipev", 2),
                                      ("1f1b", "remote")])
def test_worklist_finds_what_every_sweep_finds(name, vpp):
    if vpp == "remote":
        ov = _remote(name)
    else:
        ov = SMALL + [f"schedule.pipeline={name}", "parallel.pp=2", f"parallel.vpp={vpp}", "parallel.microbatches=4",
                      f"model.layers={4 * vpp}"]
    rng = random.Random(f"{name} {vpp}")
    deadlocks = 0
    for strategy in ("k3", "serial"):
        doc = plan_to_json(plan(load_config(TINY, ov), strategy))
        if vpp == "remote":  # the start dependencies the worklist wakes on a start
            assert any(st["start_deps"] for st in doc["stages"])
        for doc in [doc] + [_seeded(doc, rng) for _ in range(8)]:
            for comms in p2pcheck.COMM_POLICIES:
                got = _state(p2pcheck._Run, doc, comms)
                assert got == _state(_EverySweep, doc, comms), (name, strategy, comms, got[0])
                deadlocks += got[1] is not None
    assert deadlocks  # the seeded faults reach the run, not only the refusals before it


def test_plan_out_refusing_a_deadlocking_plan_writes_nothing(seeded_planner, tmp_path):
    from typer.testing import CliRunner

    from k3sched.cli import app

    ov = SMALL + ["schedule.pipeline=1f1b", "parallel.pp=2", "parallel.vpp=1", "parallel.microbatches=4",
                  "model.layers=2"]
    args = ["plan", str(TINY), "--out", str(tmp_path / "out")] + [a for o in ov for a in ("--set", o)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "P2P deadlock under NCCL semantics" in r.output, r.output
    assert not (tmp_path / "out").exists()
