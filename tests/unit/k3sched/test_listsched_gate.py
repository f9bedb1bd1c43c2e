"""The list scheduler's slot gate ([Note: compute tasks outside the backbone gate] in
k3sched/listsched.py): a gshard.add waiting on its layer's DP reduce-scatter does not hold the
later backbone slots of its rank."""

from pathlib import Path

import pytest

from k3sched.config import load_config
from k3sched.planner import slot_index, plan
from k3sched.tasks import Kind

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"
BACKBONE_OUTSIDE_GATE = (Kind.OPTIM, Kind.GSHARD_ADD)


@pytest.mark.parametrize("extra", [[], ["parallel.pp=4", "parallel.ep=1", "model.layers=8",
                                        "parallel.microbatches=8"]])
def test_gshard_add_does_not_hold_later_slots(extra):
    cfg = load_config(TINY, ["schedule.grad_offload=true", *extra])
    p = plan(cfg)
    slots = slot_index(p.backbone)
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


def _ran_ahead(p, slot_of):
    """Main compute tasks that started while a task of an earlier slot of their rank had not:
    (all of them, the forward ones)."""
    ahead, fwd = 0, 0
    for st in range(p.cfg.parallel.pp):
        main = sorted((t for t in p.tasks.values() if t.stage == st and t.lane == "compute" and not t.is_wgrad
                       and t.kind not in BACKBONE_OUTSIDE_GATE and slot_of(t) is not None),
                      key=lambda t: (t.start_us, t.id))
        later_min = float("inf")
        for t in reversed(main):  # started before a task of an earlier slot that starts after it
            if later_min < slot_of(t):
                ahead += 1
                fwd += p.graph.unit[t.id][1] == "F"
            later_min = min(later_min, slot_of(t))
    return ahead, fwd


K2 = TINY.parent / "k2-like.yaml"


@pytest.mark.parametrize("strategy", ["k3", "serial"])
def test_lookahead_zero_lets_backward_slots_go_one_ahead(strategy):
    """[Note: backward look-ahead at look-ahead 0]: at look-ahead 0 a k3 plan lets a slot without
    forwards start before the slot ahead of it has; never a forward, never in a serial plan."""
    cfg = load_config(K2, ["schedule.lookahead=0", "schedule.wgrad_lag=0"])
    p = plan(cfg, strategy)
    slots = slot_index(p.backbone)

    def slot(t):
        v, u, mb = p.graph.unit[t.id]
        return slots.get((v, u, mb), slots.get((v, "I", mb)))

    ahead, fwd = _ran_ahead(p, slot)
    assert fwd == 0
    assert (ahead > 0) == (strategy == "k3"), ahead
