"""[Note: the WGrad drain by layer] in k3sched/listsched.py: the WGrad tasks left for the end of a
stage run layer by layer, highest first, so each layer's gradient reduction starts as soon as its
last WGrad is done."""

from __future__ import annotations

import pytest

from k3sched import listsched
from k3sched.config import load_config
from k3sched.planner import plan
from k3sched.tasks import WGRAD_KINDS, Kind

from conftest import CONFIGS

# the EP-bound config of benchmarks/bench_overlap.py, on its shaped-link numbers
EP_BOUND = ["parallel.pp=1", "parallel.ep=2", "model.hidden=256", "model.expert_hidden=512",
            "model.dense_hidden=1024", "model.seq_len=128", "model.micro_batch_size=4", "parallel.microbatches=4",
            "hardware.gpus_per_node=1", "schedule.offload=none", "hardware.device_memory_gb=2",
            "hardware.host_cores=2", "hardware.internode_gbps=0.085"]


def _plan(monkeypatch, on: bool, extra: list[str], strategy: str | None = None):
    monkeypatch.setattr(listsched, "DRAIN_BY_LAYER", on)
    return plan(load_config(CONFIGS / "tiny-cpu.yaml", extra), strategy)


def _drain(p, stage: int = 0):
    """The stage's WGrad tasks that start after its last forward / backward compute task, in start order."""
    comp = sorted((t for t in p.tasks.values() if t.stage == stage and t.lane == "compute"
                   and t.kind is not Kind.OPTIM), key=lambda t: t.start_us)
    last_main = max(i for i, t in enumerate(comp) if t.kind not in WGRAD_KINDS)
    return comp[last_main + 1:]


def test_the_drain_runs_layer_by_layer_and_each_reduction_starts_earlier(monkeypatch):
    by_slot, by_layer = _plan(monkeypatch, False, EP_BOUND), _plan(monkeypatch, True, EP_BOUND)
    # 4 micro-batches, 1F1B, one stage: slots F0 B0 .. F3 B3 (0..7); at WGrad lag 4 the WGrad of B2
    # and B3 (slots 5 + 4, 7 + 4 > 7) are the drain's
    drain = [t for t in _drain(by_layer) if t.mb >= 2]
    assert len(drain) >= 8 and {t.mb for t in drain} == {2, 3}
    layers = [t.layer for t in drain if t.layer is not None]
    assert layers == sorted(layers, reverse=True), layers
    old = [t.layer for t in _drain(by_slot) if t.mb >= 2 and t.layer is not None]
    assert old != sorted(old, reverse=True), old  # before: micro-batch by micro-batch
    # every layer's reduction starts no later, the first-reached ones much earlier, and the step is shorter
    rs = {t.layer: t for t in by_layer.tasks.values() if t.kind is Kind.GRAD_RS}
    rs_old = {t.layer: t for t in by_slot.tasks.values() if t.kind is Kind.GRAD_RS}
    assert all(rs[L].start_us <= rs_old[L].start_us + 1e-6 for L in rs)
    top = max(rs)
    assert rs[top].start_us < rs_old[top].start_us - 10_000
    assert by_layer.metrics.step_time_us < by_slot.metrics.step_time_us - 5_000  # 2907 -> 2895 ms


@pytest.mark.parametrize("extra", [[], ["parallel.pp=4", "parallel.ep=1", "parallel.microbatches=8"],
                                   ["schedule.pipeline=zb-h1"], ["schedule.pipeline=interleaved-1f1b", "parallel.vpp=2"],
                                   ["schedule.pipeline=zb-v", "parallel.vpp=2"]],
                         ids=["tiny-cpu", "pp4", "zb-h1", "interleaved", "zb-v"])
def test_the_drain_by_layer_is_no_slower_and_serial_and_v_plans_are_untouched(monkeypatch, extra):
    v_shaped = "schedule.pipeline=zb-v" in extra  # keeps the order by slot (see the Note)
    for strategy in (None, "serial"):
        old, new = (_plan(monkeypatch, on, extra, strategy).metrics.step_time_us for on in (False, True))
        if strategy == "serial" or v_shaped:
            assert new == old
        else:
            assert new <= old * 1.001, (old, new)
