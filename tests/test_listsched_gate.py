"""The list scheduler's slot gate ([Note: compute tasks outside the backbone gate] in
k3sched/listsched.py): a gshard.add waiting on its layer's DP reduce-scatter does not hold the
later backbone slots of its rank."""

from pathlib import Path

import pytest

from k3sched.config import load_config
from k3sched.planner import _slot_index, plan
from k3sched.tasks import Kind

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"
BACKBONE_OUTSIDE_GATE = (Kind.OPTIM, Kind.GSHARD_ADD)


@pytest.mark.parametrize("extra", [[], ["parallel.pp=4", "parallel.ep=1", "model.layers=8",
                                        "parallel.microbatches=8"]])
def test_gshard_add_does_not_hold_later_slots(extra):
    cfg = load_config(TINY, ["schedule.grad_offload=true", *extra])
    p = plan(cfg)
    slots = _slot_index(p.backbone)
    la = cfg.schedule.lookahead

    def slot(t):
        v, u, mb = p.graph.unit[t.id]
        return slots.get((v, u, mb), slots.get((v, "I", mb)))

    adds = [t for t in p.tasks.values() if t.kind is Kind.GSHARD_ADD]
    assert adds
    backbone = [t for t in p.tasks.values() if t.lane == "compute" and not t.is_wgrad
                and t.kind not in BACKBONE_OUTSIDE_GATE and slot(t) is not None]
    passed = 0
    for a in adds:
        s = slot(a)
        # Under the gate a task more than `lookahead` slots later could not start before it.
        passed += any(t.stage == a.stage and slot(t) > s + la and t.start_us < a.start_us for t in backbone)
        # Still after what it accumulates (its reduce-scatter, WGrad and onload).
        assert all(p.tasks[d].end_us <= a.start_us + 1e-6 for d in a.deps)
    assert passed >= 1, "every gshard.add ran before the slots after its own: it gated them"
    assert all(t.start_us >= 0 for t in p.tasks.values())
