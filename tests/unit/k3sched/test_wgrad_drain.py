"""[Note: the WGrad drain by layer] in k3sched/listsched.py: the WGrad tasks left for the end of a
stage run layer by layer, highest first, so each layer's gradient reduction starts as soon as its
last WGrad is done."""

from __future__ import annotations

from k3sched.config import load_config
from k3sched.planner import plan
from k3sched.tasks import WGRAD_KINDS, Kind

from conftest import CONFIGS

# the EP-bound config of benchmarks/bench_overlap.py, on its shaped-link numbers
EP_BOUND = ["parallel.pp=1", "parallel.ep=2", "model.hidden=256", "model.expert_hidden=512",
            "model.dense_hidden=1024", "model.seq_len=128", "model.micro_batch_size=4", "parallel.microbatches=4",
            "hardware.gpus_per_node=1", "schedule.offload=none", "hardware.device_memory_gb=2",
            "hardware.cpu_runner.host_cores=2", "hardware.internode_gbps=0.085"]


def _plan(extra: list[str], strategy: str | None = None):
    return plan(load_config(CONFIGS / "tiny-cpu.yaml", extra), strategy)


def _drain(p, stage: int = 0):
    """The stage's WGrad tasks that start after its last forward / backward compute task, in start order."""
    comp = sorted((t for t in p.tasks.values() if t.stage == stage and t.lane == "compute"
                   and t.kind is not Kind.OPTIM), key=lambda t: t.start_us)
    last_main = max(i for i, t in enumerate(comp) if t.kind not in WGRAD_KINDS)
    return comp[last_main + 1:]


def test_the_drain_runs_layer_by_layer_and_each_reduction_starts_beside_it():
    p = _plan(EP_BOUND)
    # 4 micro-batches, 1F1B, one stage: slots F0 B0 .. F3 B3 (0..7); at WGrad lag 4 the WGrad of B2
    # and B3 (slots 5 + 4, 7 + 4 > 7) are the drain's
    drain = [t for t in _drain(p) if t.mb >= 2]
    assert len(drain) >= 8 and {t.mb for t in drain} == {2, 3}
    layers = [t.layer for t in drain if t.layer is not None]
    assert layers == sorted(layers, reverse=True), layers
    # each layer's reduction starts before the first drain WGrad of the layer below it ends, beside
    # the lower layers' WGrad (taken micro-batch by micro-batch, the top layer's reduction would wait
    # for the last micro-batch, after every layer's WGrad of the micro-batches before it)
    rs = {t.layer: t for t in p.tasks.values() if t.kind is Kind.GRAD_RS}
    for L in sorted(rs)[1:]:
        below = min(t.end_us for t in drain if t.layer == L - 1)
        assert rs[L].start_us < below, (L, rs[L].start_us, below)
