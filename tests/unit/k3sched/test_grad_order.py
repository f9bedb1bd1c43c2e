"""[Note: gradient accumulation order] in k3sched/graph.py: every plan of a pipeline adds each
weight gradient's micro-batch contributions in one order, so a co-scheduled run computes the same
bits as the serial one."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml

from k3sched.config import load_config
from k3sched.graph import PIPELINE_TABLE
from k3sched.planner import plan
from k3sched.planfile import plan_to_json

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"
GRAD_KINDS = {"attn.dw", "shared.dw", "expert.dw", "mlp.dw", "head.dw", "embed.dw", "router.bwd"}

# An operator profile and hardware section as `k3sched probe` wrote them on the 2-core machine
# (tiny-cpu at hidden 128, one rank). With them the k3 plan once ran embed.dw of micro-batch 2
# before that of micro-batch 1: its step-1 loss differed from the serial run's in the 7th digit.
PROFILE = {
    "format": "k3sched.profile/1", "source": "k3sched probe",
    "durations_us": {"attn.dw": 1718.0, "attn.dx": 4982.0, "attn.fwd": 3580.0, "embed.dw": 548.8,
                     "embed.fwd": 520.8, "expert.dw": 2850.0, "expert.dx": 4093.0, "expert.fwd": 3552.0,
                     "head.dw": 1833.0, "head.dx": 3162.0, "head.fwd": 3091.0, "mlp.dw": 2034.0, "mlp.dx": 3035.0,
                     "mlp.fwd": 2870.0, "router.bwd": 1416.0, "router.fwd": 1307.0, "shared.dw": 1372.0,
                     "shared.dx": 1927.0, "shared.fwd": 1992.0},
    "overhead_us": {"combine.bwd": 1195.0, "combine.fwd": 1010.0, "dispatch.bwd": 717.1, "dispatch.fwd": 1019.0},
    "per_expert_us": {"expert.fwd": 62.25, "expert.dx": 5.75, "expert.dw": 24.88},
}
HARDWARE = {"cpu_runner": {"comm_cpu_ns_per_byte": 0.4941, "comm_cpu_us_per_call": 514.2,
                           "comm_wait_us_per_call": 1856.0, "compute_alone_factor": 0.98, "host_cores": 2,
                           "task_time_cv": 0.3996},
            "hbm_gbps": 17.02, "internode_gbps": 1.28,
            "internode_latency_us": 392.8, "launch_us": 29.05, "mfu": 1.0, "nvlink_gbps": 1.28,
            "nvlink_latency_us": 392.8, "optim_ns_per_param": 8.589, "pcie_gbps": 30.0, "pcie_latency_us": 1.374,
            "peak_tflops": 0.08169}


def probed_config(tmp_path: Path, *extra: str):
    prof = tmp_path / "ops.yaml"
    prof.write_text(yaml.safe_dump(PROFILE))
    return load_config(TINY, ["parallel.pp=1", "parallel.ep=1", "parallel.dp=1", "model.hidden=128",
                              "schedule.offload=all", f"schedule.profile={prof}",
                              *(f"hardware.{k}={v}" for k, v in HARDWARE.items()), *extra])


def grad_orders(doc: dict) -> dict[tuple, list[str]]:
    """Per (stage, kind, layer, chunk): the ids of the tasks adding to that gradient, in lane order."""
    out: dict[tuple, list[str]] = defaultdict(list)
    for st in doc["stages"]:
        for lane, tasks in st["lanes"].items():
            for t in tasks:
                if t["kind"] in GRAD_KINDS:
                    assert lane == "compute", t["id"]
                    out[(st["stage"], t["kind"], t["layer"], t["chunk"])].append(t["id"])
    return dict(out)


def test_the_probed_profile_keeps_the_serial_order_and_each_add_waits_for_the_one_before(tmp_path):
    cfg = probed_config(tmp_path)
    serial, k3 = (plan_to_json(plan(cfg, s)) for s in ("serial", "k3"))
    orders = grad_orders(k3)
    assert orders == grad_orders(serial)
    assert orders[(0, "embed.dw", None, 0)] == [f"s0/mb{m}/v0/embed.dw" for m in range(4)]
    deps = {t["id"]: t["deps"] for st in k3["stages"] for ts in st["lanes"].values() for t in ts}
    for ids in orders.values():
        for before, after in zip(ids, ids[1:]):
            assert before in deps[after], (before, after)


def test_k3_and_serial_runs_of_the_probed_profile_are_bitwise_equal(tmp_path):
    """The numerics: two steps in-process, the k3 plan against the serial one."""
    from runtime.local import local_run

    cfg = probed_config(tmp_path)
    runs = {s: local_run(cfg, 2, strategy=s, capture_grads=True) for s in ("serial", "k3")}
    assert runs["k3"].losses == runs["serial"].losses
    ref = runs["serial"].grads
    assert ref and all(torch.equal(g, ref[n]) for n, g in runs["k3"].grads.items())


def _pipelines():
    for name, entry in PIPELINE_TABLE.items():
        vpp = 2 if entry.chunks == 0 else 1 if entry.copies == 2 else entry.chunks
        yield pytest.param(name, [f"parallel.vpp={vpp}", "parallel.microbatches=4"], id=name)
    yield pytest.param("1f1b", ["parallel.seq_chunks=2"], id="1f1b-seq-slices")
    yield pytest.param("1f1b", ["schedule.grad_offload=true", "schedule.offload=all"], id="1f1b-offload")


@pytest.mark.parametrize("pipeline,extra", list(_pipelines()))
@pytest.mark.parametrize("knobs", [["schedule.wgrad_lag=0", "schedule.lookahead=1"],
                                   ["schedule.wgrad_lag=8", "schedule.lookahead=4"]], ids=["lag0", "lag8-la4"])
def test_every_pipeline_adds_gradients_in_its_serial_order(pipeline, extra, knobs):
    cfg = load_config(TINY, [f"schedule.pipeline={pipeline}", *extra, *knobs])
    serial, k3 = (plan_to_json(plan(cfg, s)) for s in ("serial", "k3"))
    assert grad_orders(k3) == grad_orders(serial)
