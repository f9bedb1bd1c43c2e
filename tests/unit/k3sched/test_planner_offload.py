"""Remote offload across stages, measured-profile overrides, torch-pipelining CSV interop."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k3sched import schedules
from k3sched.config import load_config
from k3sched.cost import CostModel
from k3sched.profile import load_profile
from k3sched.planner import backbone, plan
from k3sched.planfile import plan_to_json
from k3sched.tasks import Kind

from conftest import CONFIGS, ROOT
from test_planner import check_plan_invariants

PP4 = ["parallel.pp=4", "parallel.microbatches=8", "model.layers=8", "model.dense_layers=0"]


def _budget_gib(overrides: list[str], frac: float) -> str:
    """A budget at ``frac`` of the largest no-offload stage peak."""
    free = plan(load_config(CONFIGS / "tiny-cpu.yaml", overrides + ["schedule.offload=none"]))
    return f"schedule.device_memory_budget={max(free.metrics.peak_device_bytes) * frac / 2**30}"


def test_remote_offload_evens_out_stage_memory():
    budget = _budget_gib(PP4, 0.7)
    local = plan(load_config(CONFIGS / "tiny-cpu.yaml", PP4 + [budget]))
    remote = plan(load_config(CONFIGS / "tiny-cpu.yaml", PP4 + [budget, "schedule.remote_offload=true"]))
    check_plan_invariants(remote, serial=False)
    m = remote.metrics
    assert m.offloaded_sets["remote"] > 0
    before = m.peak_device_bytes_before_offload
    assert before[0] > m.budget_bytes >= m.peak_device_bytes[0]  # stage 0 needed relief
    holders = [s for s, b in enumerate(m.peak_peer_bytes) if b > 0]
    assert holders and all(h > 0 for h in holders)  # held by later stages
    assert max(m.peak_device_bytes) <= m.budget_bytes
    t = remote.tasks
    ron = [x for x in t.values() if x.kind is Kind.ACT_RONLOAD]
    assert ron and all(x.lane == "offload_remote" and x.peer_stage in holders for x in ron)
    for x in ron:
        assert x.start_us >= t[x.id.replace("act.ronload", "act.roffload")].end_us
    assert local.metrics.offloaded_sets["remote"] == 0


def test_measured_profile_replaces_analytic_durations(tmp_path):
    prof = tmp_path / "profile.yaml"
    prof.write_text("durations_us:\n  attn.fwd: 1234.5\n  expert.dx: 99.0\nbandwidth_gbps:\n  ep: 1.0\n")
    cfg = load_config(CONFIGS / "tiny-cpu.yaml", [f"schedule.profile={prof}", "hardware.cpu_runner.host_cores=0"])
    p = plan(cfg)
    assert {x.duration_us for x in p.tasks.values() if x.kind is Kind.ATTN_FWD} == {1234.5}
    assert {x.duration_us for x in p.tasks.values() if x.kind is Kind.EXPERT_DX} == {99.0}
    # a profile holds one-core durations: 4 ranks on the shipped config's 2 cores take twice as long
    shared = plan(load_config(CONFIGS / "tiny-cpu.yaml", [f"schedule.profile={prof}"]))
    assert {x.duration_us for x in shared.tasks.values() if x.kind is Kind.ATTN_FWD} == {2 * 1234.5}
    base = CostModel(load_config(CONFIGS / "tiny-cpu.yaml"))
    assert CostModel(cfg).a2a_us() > base.a2a_us()  # slower measured EP bandwidth
    bad = tmp_path / "bad.yaml"
    bad.write_text("durations_us:\n  attn.sideways: 1\n")
    with pytest.raises(ValueError, match="unknown task kind 'attn.sideways'"):
        load_profile(bad)


@pytest.mark.parametrize("pipeline, extra", [("1f1b", []), ("zb-h1", []), ("gpipe", []),
                                             ("interleaved-1f1b", ["parallel.vpp=2", "model.layers=4"]),
                                             ("zb-v", ["parallel.vpp=2"]),
                                             ("dualpipev", ["parallel.vpp=2"])])
def test_torch_csv_export_import_plans_the_same(pipeline, extra, tmp_path):
    cfg = load_config(CONFIGS / "tiny-cpu.yaml", [f"schedule.pipeline={pipeline}", *extra])
    csv = tmp_path / "sched.csv"
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", str(CONFIGS / "tiny-cpu.yaml"),
                        "--set", f"schedule.pipeline={pipeline}", *sum((["--set", e] for e in extra), []),
                        "--torch-csv", str(csv)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = csv.read_bytes().decode()
    assert text == backbone(cfg).to_torch_csv()
    placement = "v" if pipeline in ("zb-v", "dualpipev") else "loop"
    imported = schedules.Schedule.from_torch_csv(text, cfg.parallel.pp, cfg.parallel.vpp,
                                                 cfg.parallel.microbatches, placement=placement)
    assert imported.to_torch_csv() == text
    a, b = plan(cfg), plan(cfg, schedule=imported)
    assert a.metrics.step_time_us == b.metrics.step_time_us
    ja, jb = plan_to_json(a), plan_to_json(b)
    assert jb.pop("pipeline") == "csv" and ja.pop("pipeline") == pipeline
    assert ja == jb


def test_from_torch_csv_cli_and_bad_csv(tmp_path):
    cfg = load_config(CONFIGS / "tiny-cpu.yaml")
    good = tmp_path / "g.csv"
    good.write_text(backbone(cfg).to_torch_csv(), newline="")
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", "configs/tiny-cpu.yaml", "--from-torch-csv",
                        str(good)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    bad = tmp_path / "b.csv"
    bad.write_text("0F0,0B0\n1B0,1F0\n")
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", "configs/tiny-cpu.yaml", "--from-torch-csv",
                        str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_remote_offload_has_peer_side_tasks():
    p = plan(load_config(CONFIGS / "tiny-cpu.yaml", PP4 + [_budget_gib(PP4, 0.7), "schedule.remote_offload=true"]))
    t = p.tasks
    stores = [x for x in t.values() if x.kind is Kind.ACT_RSTORE]
    assert stores
    for s in stores:
        off = t[next(d for d in s.deps)]
        assert off.kind is Kind.ACT_ROFFLOAD and off.peer_stage == s.stage and s.peer_stage == off.stage
        serve = next(x for x in t.values() if x.kind is Kind.ACT_RSERVE and s.id in x.deps)
        ron = next(x for x in t.values() if x.kind is Kind.ACT_RONLOAD and serve.id in x.deps)
        assert off.end_us <= s.start_us <= serve.start_us and serve.end_us <= ron.start_us
        assert serve.lane == s.lane == "offload_remote" and serve.stage == s.stage


@pytest.mark.parametrize("text, says", [
    ("durations_us: {attn.fwd: .nan}", "durations_us: attn.fwd must be a finite number >= 0"),
    ("durations_us: {attn.fwd: -1}", "durations_us: attn.fwd must be a finite number >= 0"),
    ("durations_us: {attn.fwd: fast}", "durations_us: attn.fwd must be a finite number"),
    ("durations_us: [1, 2]", "durations_us must be a mapping"),
    ("bandwidth_gbps: {ep: 0}", "bandwidth_gbps: ep must be a finite number > 0"),
    ("bandwidth_gbps: {nic: 1.0}", "unknown lane 'nic'"),
    ("latency_us: {ep: .inf}", "latency_us: ep must be a finite number >= 0"),
    ("link_efficiency: {ep: 1.5}", "link_efficiency: ep must be a finite number > 0 and <= 1"),
    ("overhead_us: {attn.sideways: 1}", "overhead_us: unknown task kind 'attn.sideways'"),
    ("comm_cpu_ns_per_byte: yes", "comm_cpu_ns_per_byte must be a finite number >= 0"),
])
def test_bad_profile_values_are_one_line_errors_naming_the_field(tmp_path, text, says):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text + "\n")
    with pytest.raises(ValueError) as e:
        load_profile(bad)
    assert says in str(e.value) and "\n" not in str(e.value)
