"""``k3sched probe``: the latency/bandwidth fit, the YAML it writes (loads and plans), user errors,
and real short probes (``--quick``, 2 gloo ranks; one inside the shaped-link testbed when usable)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from conftest import CONFIGS, ROOT

TINY = CONFIGS / "tiny-cpu.yaml"


# -- the fit ---------------------------------------------------------------------------------------

def test_fit_recovers_exact_latency_and_bandwidth():
    from runtime.probe.inprocess import fit_latency_bandwidth

    sizes = [4096 * 4 ** i for i in range(7)]
    times = [12.5 + s / (3.2 * 1e3) for s in sizes]  # 12.5 µs + bytes / 3.2 GB/s
    f = fit_latency_bandwidth(sizes, times)
    assert f.latency_us == pytest.approx(12.5, rel=1e-9)
    assert f.gbps == pytest.approx(3.2, rel=1e-9)
    assert f.residual < 1e-9 and f.points == 7
    assert f.time_us(1e6) == pytest.approx(12.5 + 1e6 / 3.2e3)


def test_fit_noise_is_reported_and_intercept_clamped():
    from runtime.probe.inprocess import fit_latency_bandwidth

    sizes = np.array([1e3, 1e4, 1e5, 1e6])
    noisy = (5.0 + sizes / 2e3) * np.array([1.1, 0.9, 1.1, 0.9])
    f = fit_latency_bandwidth(sizes, noisy)
    assert 0.05 < f.residual < 0.2 and f.latency_us >= 0 and 1.5 < f.gbps < 2.7
    # a pure-bandwidth line whose noise would give a negative intercept: clamped to 0, refit
    f0 = fit_latency_bandwidth([1e3, 1e6], [0.4, 1000.0])
    assert f0.latency_us == 0.0 and f0.gbps > 0
    # flat times (sizes too small to see the bandwidth): best measured throughput, no negative slope
    flat = fit_latency_bandwidth([1e3, 2e3, 4e3], [10.0, 10.0, 9.9])
    assert flat.gbps == pytest.approx(4e3 / 9.9 / 1e3) and flat.latency_us >= 0
    with pytest.raises(ValueError):
        fit_latency_bandwidth([4096], [1.0])
    with pytest.raises(ValueError):
        fit_latency_bandwidth([4096, 8192], [1.0, -1.0])


def test_bus_factors_and_groups():
    from runtime.probe import bus_factor, collective_groups

    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("sendrecv", 8) == 1.0
    assert collective_groups(3) == {"loopback": [0, 1, 2]}
    assert collective_groups(8, 4) == {"intra": [0, 1, 2, 3], "inter": [0, 4]}
    assert collective_groups(2, 1) == {"inter": [0, 1]}
    assert collective_groups(2, 4) == {"intra": [0, 1]}


def test_gemm_shapes_follow_the_cost_model(tiny_cfg):
    from runtime.probe import gemm_shapes

    by = {g.name: g for g in gemm_shapes(tiny_cfg)}
    T = 4 * 128
    assert (by["attn proj"].m, by["attn proj"].k, by["attn proj"].n, by["attn proj"].weight) == (T, 64, 64, 16)
    # 2 ranks' routed tokens (T k) over 4 local experts, balanced
    assert (by["expert up"].m, by["expert up"].n, by["expert up"].weight) == (T * 2 * 2 // 8, 128, 2 * 4 * 3)
    assert by["dense down"].k == 256 and by["dense down"].weight == 1
    assert len(gemm_shapes(None)) == 1


# -- the YAML ------------------------------------------------------------------------------------------

def _fake_result(nproc: int = 2):
    from runtime.probe import Fit, ProbeResult, Row

    hw = {"name": "probe cpu-2core", "peak_tflops": 0.07, "mfu": 1.0, "hbm_gbps": 15.0, "device_memory_gb": 0.25,
          "host_memory_gb": 4.0, "gpus_per_node": 4, "nvlink_gbps": 0.9, "nvlink_latency_us": 300.0,
          "internode_gbps": 0.9, "internode_latency_us": 300.0, "pcie_gbps": 20.0, "pcie_latency_us": 1.5,
          "launch_us": 15.0, "optim_ns_per_param": 7.5, "cpu_runner": {"host_cores": 2, "comm_cpu_ns_per_byte": 3.0,
          "comm_cpu_us_per_call": 250.0}}
    coll = {"groups": {}, "fits": {"loopback": {"sendrecv": Fit(300.0, 0.9, 0.05, 4)}}}
    return ProbeResult(hw, [Row("x", "1", "y")], coll, [], "cpu", nproc, False, ["a note"])


def test_written_config_loads_and_plans(tmp_path):
    from k3sched.config import HardwareConfig, load_config
    from k3sched.planner import plan
    from runtime.probe import write_hardware

    res = _fake_result()
    full = write_hardware(res, tmp_path / "sub" / "probed.yaml", TINY, ["parallel.microbatches=2"])
    cfg = load_config(full)
    assert cfg.hardware.model_dump() == res.hardware
    assert cfg.parallel.microbatches == 2 and cfg.model == load_config(TINY).model
    p = plan(cfg)
    assert p.metrics.step_time_us > 0
    text = full.read_text()
    assert text.startswith("# k3sched probe") and "# note: a note" in text and "mfu: 1.0  #" in text

    only = write_hardware(res, tmp_path / "hw.yaml")
    doc = yaml.safe_load(only.read_text())
    assert list(doc) == ["hardware"]
    assert HardwareConfig.model_validate(doc["hardware"]).model_dump() == res.hardware
    flat = {**{k: v for k, v in doc["hardware"].items() if k != "cpu_runner"},
            **{f"cpu_runner.{k}": v for k, v in doc["hardware"]["cpu_runner"].items()}}
    merged = load_config(TINY, [f"hardware.{k}={v}" for k, v in flat.items()])
    assert merged.hardware.model_dump() == res.hardware


def _contended(points):
    return {"groups": {"inter": {"ranks": [0, 1], "ops": {}, "contended": [
        {"bytes": int(m / 2), "moved_bytes": m, "stretch_us": s} for m, s in points]}}}


def test_comm_cpu_fit_splits_the_loss_into_per_call_and_per_byte():
    from runtime.probe import comm_cpu_fit

    # 300 µs a call plus 1.5 ns a byte, exactly
    pts = [(m, 300.0 + 1.5e-3 * m) for m in (16384.0, 262144.0, 1048576.0)]
    ns, call = comm_cpu_fit(_contended(pts))
    assert ns == pytest.approx(1.5) and call == pytest.approx(300.0)
    # noise that tilts the line below 0 at 0 bytes: no negative per-call part, the bytes carry it
    ns, call = comm_cpu_fit(_contended([(16384.0, 5.0), (262144.0, 200.0), (1048576.0, 2000.0)]))
    assert call == 0.0 and ns > 0
    # a loss that falls with size: no negative per-byte part, the calls carry it
    ns, call = comm_cpu_fit(_contended([(16384.0, 500.0), (262144.0, 400.0), (1048576.0, 450.0)]))
    assert ns == 0.0 and call == pytest.approx(450.0)
    assert comm_cpu_fit({"groups": {"inter": {"ranks": [0, 1], "ops": {}}}}) is None


# -- user errors: one line, exit 2, nothing measured -----------------------------------------------------

def _cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3sched.cli", "probe", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=None if env is None else {**os.environ, **env})


@pytest.mark.parametrize("args, says", [
    (["--nproc", "1"], "--nproc: the collective measurements need at least 2 ranks; got 1"),
    (["--nproc", "0"], "--nproc:"),
    (["-o", "{tmp}"], "is a directory"),
    (["-o", "{tmp}/file/hw.yaml"], "is not a directory"),
    (["--config", "{tmp}/missing.yaml"], "cannot read config"),
    (["--config", "{tmp}/bad.yaml"], "parallel.ep: must divide model.experts"),
    (["--set", "hardware.mfu=0.5"], "--set: needs --config"),
    (["--emulate-links"], "--emulate-links: needs --config"),
    (["--timeout", "0"], "--timeout: must be a finite number > 0"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, says):
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.yaml").write_text(TINY.read_text().replace("ep: 2", "ep: 3"))
    r = _cli(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


# -- real probes -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_quick_probe_on_two_ranks_writes_a_config_that_plans(tmp_path):
    from k3sched.config import load_config
    from k3sched.planner import plan

    out = tmp_path / "probed.yaml"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    r = _cli("--nproc", "2", "--config", str(TINY), "--quick", "-o", str(out), timeout=180, env={"TMPDIR": str(scratch)})
    assert r.returncode == 0, r.stderr[-3000:]
    # the operator profiles' scratch folders go with the probe (they were left in /tmp before)
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("k3sched_ops_")]
    assert f"wrote {out}" in r.stdout.replace("\n", "")
    for what in ("peak_tflops", "launch_us", "hbm_gbps", "pcie_gbps", "loopback all_to_all", "loopback all_reduce",
                 "loopback sendrecv", "busbw GB/s"):
        assert what in r.stdout, what
    cfg = load_config(out)
    hw, cr = cfg.hardware, cfg.hardware.cpu_runner
    assert hw.mfu == 1.0 and hw.nvlink_gbps == hw.internode_gbps and hw.gpus_per_node == 4
    assert 1e-4 < hw.peak_tflops < 10 and 0.05 < hw.hbm_gbps < 1e3 and 0.01 < hw.nvlink_gbps < 100
    assert 0 < hw.launch_us < 1e4 and hw.pcie_gbps > 0.05
    # what concurrent all-to-alls cost a computing thread, measured on CPU and fitted per call and byte
    assert "beside compute" in r.stdout and "comm_cpu_us_per_call" in r.stdout
    assert 0 <= cr.comm_cpu_us_per_call < 1e5 and 0 <= cr.comm_cpu_ns_per_byte < 1e3
    assert cr.comm_cpu_us_per_call + cr.comm_cpu_ns_per_byte > 0
    # the router's spread over tiny-cpu's 2 EP ranks, measured at EP 1 and written into the model section
    assert "model.routing_imbalance" in r.stdout and 1.0 < cfg.model.routing_imbalance < 2.0
    # the operator profile timed alone against two copies at once ([Note: compute alone]): written when below 1
    assert "compute_alone_factor" in r.stdout and 0.3 < cr.compute_alone_factor <= 1.0
    # each expert op's part per local expert, from a second profile with one EP rank's 4 experts
    from k3sched.profile import load_profile

    assert "per_expert_us" in r.stdout and "with 4 of the 8" in r.stdout.replace("\n", " ")
    per = load_profile(cfg.schedule.profile).per_expert_us
    assert set(per) == {"expert.fwd", "expert.dx", "expert.dw"} and all(v >= 0 for v in per.values())
    assert plan(cfg).metrics.step_time_us > 0


@pytest.mark.slow
def test_a_failing_rank_is_one_line():
    from runtime.probe import measure_collectives
    from runtime.probe.inprocess import ProbeError

    with pytest.raises(ProbeError) as e:  # rank 5 does not exist: new_group fails on every rank
        measure_collectives(2, sizes=(4096, 65536), reps=1, min_s=0.0, timeout_s=60, groups={"bad": [0, 5]})
    msg = str(e.value)
    assert msg.startswith("probe rank ") and "\n" not in msg


@pytest.mark.slow
def test_contended_measurement_takes_the_samples_asked_for(tmp_path):
    """[Note: what a call costs a computing thread]: ``contended_reps`` samples per size (the
    bench asks for more than the quick probe's 3: the per-byte cost rests on them)."""
    from runtime.probe import Knobs, comm_cpu_fit, measure_collectives

    assert Knobs.of(True).contended_reps == 3 and Knobs.of(False).contended_reps > 3
    coll = measure_collectives(2, sizes=(4096, 16384), reps=1, min_s=0.0, timeout_s=120, work_dir=tmp_path,
                               device="cpu", contended_s=0.05, contended_reps=5)
    rows = next(g["contended"] for g in coll["groups"].values() if g.get("contended"))
    assert [len(r["samples_us"]) for r in rows] == [5] * len(rows) and len(rows) == 3
    assert comm_cpu_fit(coll) is not None


@pytest.mark.slow
def test_emulated_links_hold_the_shaped_rate():
    testbed = pytest.importorskip("runtime.testbed")
    reason = testbed.testbed_available()
    if reason is not None:
        pytest.skip(f"testbed: {reason}")
    from runtime.probe import collective_groups, measure_collectives

    hw = {"internode_gbps": 0.05, "nvlink_gbps": 1.0, "gpus_per_node": 1}  # 2 ranks on 2 nodes, 50 MB/s NICs
    tb = testbed.Testbed(hw, 2)  # not started: measure_collectives opens it around the launch only
    res = measure_collectives(2, sizes=(1 << 20, 4 << 20), reps=2, min_s=0.0, timeout_s=120, testbed=tb,
                              groups=collective_groups(2, 1))
    top = {op: rows[-1]["busbw_gbps"] / 0.05 for op, rows in res["groups"]["inter"]["ops"].items()}  # 4 MiB
    # The shaped rate caps every collective. all_reduce held it here (1.0x); all_to_all and the ring
    # send/recv, which push both directions between the two ranks at once, got about half of it per
    # direction (0.5-0.7x; a one-way send alone 1.0x): a property of the testbed's shaping.
    assert all(0.4 < r < 1.15 for r in top.values()), top
    assert top["all_reduce"] > 0.8, top
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"k3sched-{tb.tag}-" not in left and not tb.open
