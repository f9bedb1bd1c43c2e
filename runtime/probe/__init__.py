"""Measure this machine's hardware numbers for the cost model (``k3sched probe``).

[Note: what the probe measures]
Every number is the median of several repetitions after a warm-up; a repetition times a loop of
calls long enough (``min_s``) that the timer's resolution does not matter. Each maps to one field
of the config's ``hardware`` section (:class:`k3sched.config.HardwareConfig`, units as there):

- ``peak_tflops`` (written with ``mfu: 1.0``): the *achieved* GEMM rate at the model's shapes and
  dtype in ONE thread (``torch.set_num_threads(1)``: the runtime's ranks run one compute thread
  each, ``OMP_NUM_THREADS=1``). The shapes are those the cost model counts per layer (attention
  projections T x h x h, router T x h x E, routed experts at T k ep / E tokens per local expert,
  shared expert and dense SwiGLU T x h x f / F and back), each timed as forward (x @ W), dX
  (g @ W^T) and dW (x^T @ g); the rate is total FLOPs over total time, every shape weighted by how
  often one step runs it. The output head (T x h x V, once per stage) is left out. On a slow
  device M (tokens) is cut so one call takes ~``target_s`` and W is cut to ``max_weight_bytes``;
  the table names the shape actually timed. ``peak_tflops * mfu`` is what the cost model divides
  FLOPs by, so ``mfu: 1.0`` keeps the measured rate as is.
- ``launch_us``: the fixed per-task overhead the cost model adds to every task: one tiny (8 x 8)
  matmul call plus the executor's own cost per task (``runtime.executor.Executor`` with no-op
  handlers running stage 0 of the tiny EP 2 plan).
- ``hbm_gbps``: ``dst.copy_(src)`` of a large buffer, counting bytes read + written (2 x size) as
  the cost model counts memory traffic (``gshard.add`` moves 3 x size: two reads, one write); an
  in-place add (3 x size) is shown as a cross-check.
- ``pcie_gbps`` / ``pcie_latency_us``: the offload copy. On CPU the offload lanes copy from the
  device pool into the host pool (two tensors in the same RAM, ``offload/pool.py``): a memcpy. On
  CUDA: pinned host <-> device, both directions, the slower one kept. Copies at several sizes,
  fitted to ``latency + bytes / bandwidth`` (:func:`fit_latency_bandwidth`).
- ``nvlink_*`` / ``internode_*``: collectives over real process groups: ``nproc`` ranks under
  torchrun (gloo on CPU, NCCL with one GPU per rank), each running ``python -m runtime.probe
  worker``; all_to_all_single, all_reduce and a ring send/recv at message sizes 4 KiB .. 16 MiB,
  timed on every rank and the slowest rank kept (a collective ends when its last rank does).
  Reported as nccl-tests does: algbw = size / time, busbw = algbw x factor (all_reduce
  2(n-1)/n, all_to_all (n-1)/n, send/recv 1), and fitted to ``latency + factor x size / busbw``,
  which is the form of the cost model's link terms. A link's bandwidth is the median busbw of the
  three fits, its latency the median fitted latency. Without the testbed every rank is on this
  machine (one node, loopback): both the NVLink and the inter-node fields get the loopback numbers.
  In the shaped-link testbed (``testbed=``, ``runtime/testbed.py``) the ranks of one emulated node
  (rank // gpus_per_node) give the NVLink fields and one rank per node the inter-node fields.
- On CPU, the ``hardware.cpu_runner`` section (``host_cores`` and what follows; on CUDA none):
  ``comm_cpu_ns_per_byte`` / ``comm_cpu_us_per_call``: what concurrent all-to-alls cost
  a computing thread of the same rank, per byte sent and received and per call ([Note: what a call
  costs a computing thread] in ``runtime/probe/collectives.py``); without that measurement, rank
  0's process CPU time per byte in the largest all-to-alls.
- ``comm_wait_us_per_call`` (CPU only, from the same measurement): how much longer an all-to-all
  call takes while the GEMM loop runs beside it than alone ([Note: a transfer beside compute] in
  ``k3sched/cpurunner.py``).
- With a config: the operator profile ([Note: operator profile] in ``inprocess.py``), with a MoE
  model its ``per_expert_us`` (the profile again with one EP rank's experts: [Note: per-expert
  cost] in ``k3sched/cost.py``), and ``model.routing_imbalance``, the router's busiest over mean EP
  rank per dispatch at its initial weights (:func:`measure_routing`, [Note: routing imbalance] in
  ``k3sched/balance.py``).

What the numbers do not show: on CPU the ranks share the machine's cores with each other and with
their lane threads; loopback "bandwidth" is the CPU's memcpy through the kernel's TCP stack, not a
wire; the GEMM rate is one thread alone, with no other lane competing.

Python API (package ``runtime.probe``: :mod:`.inprocess` measures this process, :mod:`.collectives`
the process groups): :func:`probe` (everything; returns a :class:`ProbeResult`), :func:`hardware_yaml` /
:func:`write_hardware` (the YAML), and the parts :func:`measure_compute`, :func:`measure_launch`,
:func:`measure_hbm`, :func:`measure_pcie`, :func:`measure_collectives`, :func:`launch_workers`,
:func:`fit_latency_bandwidth`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


KiB, MiB = 1 << 10, 1 << 20
from .collectives import (
    CHUNK_S, collective_groups, comm_cpu_fit, comm_cpu_ns_per_byte, link_numbers, measure_collectives,
    comm_wait_fit, task_time_cv_fit)
from .inprocess import (
    TORCH_DTYPES, Fit, GemmTiming, Knobs, MiB, sig_digits, size_label, bus_factor, gemm_shapes, measure_adamw,
    measure_compute, compute_alone_factor, measure_hbm, measure_launch, measure_ops_concurrent, measure_pcie,
    measure_fewer_experts, measure_routing, per_expert_point, per_expert_slopes, write_ops_profile)

# -- everything ------------------------------------------------------------------------------------

@dataclass
class Row:
    """One line of the probe's report."""

    what: str
    value: str
    how: str
    residual: float | None = None


@dataclass
class ProbeResult:
    hardware: dict[str, Any]
    """The measured ``hardware`` section (every HardwareConfig field)."""
    rows: list[Row]
    collectives: dict[str, Any]
    """:func:`measure_collectives`' result (fits as :class:`Fit`)."""
    gemms: list[GemmTiming]
    device: str
    nproc: int
    emulated: bool
    notes: list[str] = field(default_factory=list)
    ops_us: dict[str, float] = field(default_factory=dict)
    """:func:`measure_ops` (with a config): µs per compute task kind, one core."""
    per_expert_us: dict[str, float] = field(default_factory=dict)
    """:func:`per_expert_slopes` (with a MoE config): µs of each expert kind per local expert."""
    routing_imbalance: float = 1.0
    """:func:`measure_routing` (with a config): the model's ``model.routing_imbalance`` over its EP ranks."""



def _mem_gib(key: str) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / 2 ** 30
    return None


def probe(cfg=None, *, nproc: int = 2, quick: bool = False, testbed: Any = None, timeout_s: float = 300.0,
          work_dir: str | Path | None = None, progress: Callable[[str], None] | None = None,
          knobs: Knobs | None = None) -> ProbeResult:
    """Measure this machine (see [Note: what the probe measures]). ``cfg``: a
    :class:`k3sched.config.Config` whose model gives the GEMM shapes and dtype and whose hardware
    section supplies what is not measured (memory sizes, ``gpus_per_node``, name); None: a default
    GEMM and sizes from this machine. ``testbed``: run the collectives in the shaped-link testbed
    (``runtime/testbed.py``). ``knobs``: repetitions and loop lengths (default ``Knobs.of(quick)``).
    Raises ProbeError (one line) when a measurement fails."""
    say = progress or (lambda s: None)
    knobs = knobs or Knobs.of(quick)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    rows: list[Row] = []
    notes: list[str] = []
    hw: dict[str, Any] = {}
    gemms = _probe_compute(cfg, device, knobs, rows, hw, say)
    _probe_launch(device, knobs, rows, notes, hw, say)
    _probe_memory(device, knobs, rows, hw, say)
    ops: dict[str, float] = {}
    if cfg is not None:
        say("operators: one serial in-process step of the model at its shapes")
        copies = max(1, min(nproc, os.cpu_count() or 1)) if device.type == "cpu" else 1
        ops = measure_ops_concurrent(cfg, copies, timeout_s, work_dir)
        fewer: list[dict[str, float]] = []  # [Note: per-expert cost] in k3sched/cost.py
        if copies > 1:  # [Note: compute alone] in k3sched/cpurunner.py
            say("operators: one copy alone (with one EP rank's experts before and after), then every copy again")
            alone, ops = compute_alone_factor(cfg, copies, ops, timeout_s, work_dir, fewer)
            hw["compute_alone_factor"] = alone
            rows.append(Row("compute_alone_factor", f"{alone:.3g}", f"the operator profile timed by one process "
                            f"alone over the same timed by {copies} at once (before and after it, mean), at most 1"))
        else:
            one = measure_fewer_experts(cfg, copies, timeout_s, work_dir and Path(work_dir) / "fewer")
            fewer.extend([one] if one else [])
        per_expert = per_expert_slopes(cfg, ops, fewer)
        if per_expert:
            rows.append(Row("per_expert_us", ", ".join(f"{k} {v:.3g}" for k, v in per_expert.items()),
                            f"the operator profile with {per_expert_point(cfg)} of the {cfg.model.experts} experts "
                            f"(the same tokens; {len(fewer)} round(s)): µs per local expert, the slope between "
                            "the two"))
        rows.append(Row("operator profile", f"{len(ops)} kinds", f"one rank, pp=ep=dp=1, serial, {copies} copies at "
                        "once, median µs per task" + (" (mean of two rounds)" if copies > 1 else "") + ": "
                        + ", ".join(f"{k} {v:.3g}" for k, v in ops.items())))
        imb = sig_digits(measure_routing(cfg))
        if cfg.parallel.ep > 1:
            rows.append(Row("model.routing_imbalance", f"{imb:.4g}", f"the router at its initial weights, one step at "
                            f"EP 1: busiest over mean routed tokens of {cfg.parallel.ep} EP ranks per dispatch, mean "
                            "over the calls ([Note: routing imbalance] in k3sched/balance.py)"))
    hw_base = cfg.hardware if cfg is not None else None
    gpn = hw_base.gpus_per_node if hw_base is not None else (torch.cuda.device_count() if cuda else nproc)
    tb_links = getattr(testbed, "links", None)  # runtime.testbed.Links: the shaped rates
    if tb_links is not None:
        gpn = tb_links.gpus_per_node
    coll = _probe_links(nproc, gpn, testbed, knobs, timeout_s, work_dir, device, rows, notes, hw, say)
    hardware = _hardware(hw_base, cuda, nproc, gpn, hw)
    if device.type == "cpu":
        wire = ("the shaped veths cap the rate, but the bytes still move by CPU memcpy through the kernel's TCP "
                "stack" if testbed is not None else "loopback bandwidth is memcpy through the kernel's TCP stack, "
                "not a wire")
        notes.append(f"CPU: the {nproc} ranks share {os.cpu_count()} core(s); {wire}")
    return ProbeResult(hardware, rows, coll, gemms, device.type, nproc, testbed is not None, notes, ops,
                       per_expert if cfg is not None else {}, imb if cfg is not None else 1.0)


def _probe_compute(cfg, device: torch.device, knobs: Knobs, rows: list[Row], hw: dict[str, Any],
                   say: Callable[[str], None]) -> list[GemmTiming]:
    """``peak_tflops``: the GEMM rate at the model's shapes, one thread."""
    dtype_name = cfg.model.dtype if cfg is not None else ("bf16" if device.type == "cuda" else "fp32")
    say("compute: timing the model's GEMMs in one thread")
    tflops, gemms = measure_compute(gemm_shapes(cfg), TORCH_DTYPES[dtype_name], device, knobs)
    src = "the config's model" if cfg is not None else "a default square GEMM"
    rows.append(Row("peak_tflops (mfu 1.0)", f"{tflops:.4g} TFLOP/s",
                    f"torch.matmul fwd/dX/dW at {len(gemms)} shape(s) of {src}, {dtype_name}, 1 thread; "
                    f"FLOP-weighted"))
    for t in gemms:
        m, k, n = t.timed
        cut = "" if (m, n) == (t.shape.m, t.shape.n) else f" (model {t.shape.m}x{t.shape.k}x{t.shape.n})"
        rows.append(Row(f"  {t.shape.name}", f"{t.tflops * 1e3:.4g} GFLOP/s", f"{m}x{k}x{n}{cut}, x{t.shape.weight:g}"
                        " per step"))
    hw.update(peak_tflops=tflops, mfu=1.0)
    return gemms


def _probe_launch(device: torch.device, knobs: Knobs, rows: list[Row], notes: list[str], hw: dict[str, Any],
                  say: Callable[[str], None]) -> None:
    """``launch_us``: a tiny op plus the executor's own cost per task."""
    say("launch: tiny op and executor overhead per task")
    tiny_us, exec_us, exec_note = measure_launch(device, knobs)
    launch = tiny_us + (exec_us or 0.0)
    ex_txt = f"{exec_us:.3g} µs/task ({exec_note})" if exec_us is not None else f"not measured: {exec_note}"
    rows.append(Row("launch_us", f"{launch:.3g} µs", f"8x8 matmul {tiny_us:.3g} µs + executor {ex_txt}"))
    if exec_us is None:
        notes.append(f"launch_us is the tiny op alone: {exec_note}")
    hw["launch_us"] = launch


def _probe_memory(device: torch.device, knobs: Knobs, rows: list[Row], hw: dict[str, Any],
                  say: Callable[[str], None]) -> None:
    """``hbm_gbps``, ``optim_ns_per_param``, ``host_cores`` and the offload copy (``pcie_*``)."""
    say("hbm: large copy_")
    hbm, add_gbps, hbm_bytes = measure_hbm(device, knobs)
    rows.append(Row("hbm_gbps", f"{hbm:.4g} GB/s", f"copy_ of {hbm_bytes // MiB} MiB, 2 x size (read + write)"))
    rows.append(Row("  add_ cross-check", f"{add_gbps:.4g} GB/s", "in-place add, 3 x size (gshard.add's count)"))
    adam_ns = measure_adamw(device, knobs)
    rows.append(Row("optim_ns_per_param", f"{adam_ns:.3g} ns", "torch.optim.AdamW step of 1M fp32 parameters, "
                    "1 thread"))
    host_cores = 0 if device.type == "cuda" else (os.cpu_count() or 1)
    rows.append(Row("host_cores", str(host_cores), "0 on CUDA (a device per rank); on CPU the cores the ranks share"))
    say("pcie: offload copies at several sizes")
    pc = measure_pcie(device, knobs)
    pfit: Fit = pc["fit"]
    sizes_txt = f"{len(knobs.copy_sizes)} sizes {size_label(knobs.copy_sizes[0])}..{size_label(knobs.copy_sizes[-1])}"
    rows.append(Row("pcie_gbps", f"{pfit.gbps:.4g} GB/s", f"{pc['how']}, {sizes_txt}, fit", pfit.residual))
    rows.append(Row("pcie_latency_us", f"{pfit.latency_us:.3g} µs", "intercept of the same fit", pfit.residual))
    hw.update(hbm_gbps=hbm, optim_ns_per_param=adam_ns, host_cores=host_cores, pcie_gbps=pfit.gbps,
              pcie_latency_us=pfit.latency_us)


def _probe_links(nproc: int, gpn: int, testbed: Any, knobs: Knobs, timeout_s: float, work_dir, device: torch.device,
                 rows: list[Row], notes: list[str], hw: dict[str, Any], say: Callable[[str], None]) -> dict:
    """``nvlink_*``, ``internode_*`` and ``comm_cpu_ns_per_byte`` from the collectives; returns
    :func:`measure_collectives`' result."""
    tb_links = getattr(testbed, "links", None)
    groups = collective_groups(nproc, gpn if testbed is not None else None)
    where = "in the shaped-link testbed" if testbed is not None else "on this machine (loopback)"
    say(f"collectives: {nproc} ranks {where}, {len(knobs.coll_sizes)} sizes")
    coll = measure_collectives(nproc, sizes=knobs.coll_sizes, reps=knobs.coll_reps, min_s=knobs.coll_min_s,
                               timeout_s=timeout_s, testbed=testbed, groups=groups, work_dir=work_dir,
                               contended_s=knobs.contended_s if device.type == "cpu" else 0.0,
                               contended_reps=knobs.contended_reps)
    backend = coll.get("backend", "?")
    links: dict[str, tuple[float, float]] = {}
    for name, fits in coll["fits"].items():
        links[name] = link_numbers(fits)
        n = len(coll["groups"][name]["ranks"])
        for op, f in fits.items():
            rows.append(Row(f"  {name} {op}", f"busbw {f.gbps:.4g} GB/s, lat {f.latency_us:.3g} µs",
                            f"{backend}, {n} ranks, busbw factor {bus_factor(op, n):.3g}, fit over "
                            f"{f.points} sizes", f.residual))
    if testbed is None:
        (bw, lat), = links.values()
        intra = inter = (bw, lat)
        how = ihow = "loopback (one machine): median of the 3 fits above; same for both links"
        notes.append("all ranks ran on this machine (one node): nvlink_* and internode_* are both the loopback "
                     "numbers")
    else:
        intra = links.get("intra") or links.get("inter")
        inter = links.get("inter") or links.get("intra")
        how = ("testbed, ranks of emulated node 0: median of the intra fits" if "intra" in links else
               "testbed: no two ranks share a node; the inter-node numbers")
        ihow = ("testbed, rank 0 of every emulated node: median of the inter fits" if "inter" in links else
                "testbed: one emulated node only; the intra-node numbers")
        if tb_links is not None:
            for name, shaped in (("intra", tb_links.nvlink_gbps), ("inter", tb_links.internode_gbps)):
                if name in links:
                    got = links[name][0]
                    rows.append(Row(f"  {name} shaped vs measured", f"{shaped:.4g} vs {got:.4g} GB/s",
                                    f"tc HTB payload rate vs the measured busbw (TCP/IP and gloo included): "
                                    f"{got / shaped * 100:.0f}%"))
        notes.append("testbed: link latency is not emulated (no netem); the latencies are the per-call cost of "
                     "gloo over TCP through the namespaces' veths")
    cpu_ns, call_us = (comm_cpu_ns_per_byte(coll), 0.0) if device.type == "cpu" else (0.0, 0.0)
    fit = comm_cpu_fit(coll) if device.type == "cpu" else None
    if fit is not None:
        for r in next(g["contended"] for g in coll["groups"].values() if g.get("contended")):
            rows.append(Row(f"  all_to_all {size_label(r['bytes'])} beside compute",
                            f"{r['stretch_us']:.3g} µs lost per call",
                            f"a GEMM loop's extra time per concurrent call; the call itself {r['busy_call_us']:.3g} µs "
                            f"(alone {r['idle_call_us']:.3g} µs)"))
        cpu_ns, call_us = fit
        how = ("what concurrent all_to_alls cost a computing thread of the same rank, fitted over 3 sizes "
               "([Note: what a call costs a computing thread] in runtime/probe/collectives.py)")
        rows.append(Row("comm_cpu_ns_per_byte", f"{cpu_ns:.3g} ns", f"per byte sent + received: {how}"))
        rows.append(Row("comm_cpu_us_per_call", f"{call_us:.3g} µs", "per call: the same fit's intercept"))
        wait = comm_wait_fit(coll)
        if wait is not None:
            hw["comm_wait_us_per_call"] = round(wait, 1)
            rows.append(Row("comm_wait_us_per_call", f"{wait:.3g} µs", "an all_to_all call's time beside that GEMM "
                            "loop less its time alone, median over the sizes ([Note: a transfer beside compute] "
                            "in k3sched/planner.py)"))
        cv = task_time_cv_fit(coll)
        if cv is not None:
            hw["task_time_cv"] = round(cv, 4)
            rows.append(Row("task_time_cv", f"{cv:.3g}", f"std / mean of {CHUNK_S * 1e3:g} ms pieces of that GEMM loop "
                            "beside the all_to_alls, median over the sizes ([Note: task-time spread] in "
                            "k3sched/variability.py)"))
    else:
        rows.append(Row("comm_cpu_ns_per_byte", f"{cpu_ns:.3g} ns", "process CPU time of rank 0 during its "
                        "largest all_to_alls / bytes it sent and received (gloo threads, kernel TCP); 0 on CUDA"))
    rows.append(Row("nvlink_gbps", f"{intra[0]:.4g} GB/s", how))
    rows.append(Row("nvlink_latency_us", f"{intra[1]:.3g} µs", how))
    rows.append(Row("internode_gbps", f"{inter[0]:.4g} GB/s", ihow))
    rows.append(Row("internode_latency_us", f"{inter[1]:.3g} µs", ihow))
    hw.update(nvlink_gbps=intra[0], nvlink_latency_us=intra[1], internode_gbps=inter[0],
              internode_latency_us=inter[1], comm_cpu_ns_per_byte=cpu_ns, comm_cpu_us_per_call=call_us)
    return coll


def _hardware(hw_base, cuda: bool, nproc: int, gpn: int, hw: dict[str, Any]) -> dict[str, Any]:
    """The ``hardware`` section: the measured numbers (4 significant digits) and, from the config
    (or this machine), what the probe does not measure."""
    if hw_base is not None:
        dev_gb, host_gb, name = hw_base.device_memory_gb, hw_base.host_memory_gb, hw_base.name
    elif cuda:
        dev_gb = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
        host_gb = (_mem_gib("MemTotal") or 256.0) / max(1, torch.cuda.device_count())
        name = torch.cuda.get_device_name(0)
    else:
        avail = (_mem_gib("MemAvailable") or 4.0 * nproc) / nproc
        dev_gb = host_gb = avail
        name = f"cpu-{os.cpu_count()}core"
    m = {k: sig_digits(v) for k, v in hw.items() if k not in ("mfu", "host_cores")}
    return {
        "name": f"probe {name}" if not str(name).startswith("probe ") else name,
        "peak_tflops": m["peak_tflops"], "mfu": 1.0, "hbm_gbps": m["hbm_gbps"],
        "device_memory_gb": sig_digits(dev_gb), "host_memory_gb": sig_digits(host_gb), "gpus_per_node": int(gpn),
        "nvlink_gbps": m["nvlink_gbps"], "nvlink_latency_us": m["nvlink_latency_us"],
        "internode_gbps": m["internode_gbps"], "internode_latency_us": m["internode_latency_us"],
        "pcie_gbps": m["pcie_gbps"], "pcie_latency_us": m["pcie_latency_us"], "launch_us": m["launch_us"],
        "optim_ns_per_param": m["optim_ns_per_param"],
        **({"cpu_runner": {  # on CPU only: the ranks share the host's cores ([Note: the CPU-runner model] in k3sched/cpurunner.py)
            "host_cores": hw["host_cores"],
            "comm_cpu_ns_per_byte": m["comm_cpu_ns_per_byte"], "comm_cpu_us_per_call": m["comm_cpu_us_per_call"],
            **({"comm_wait_us_per_call": m["comm_wait_us_per_call"]} if m.get("comm_wait_us_per_call") else {}),
            **({"task_time_cv": m["task_time_cv"]} if m.get("task_time_cv") else {}),
            **({"compute_alone_factor": m["compute_alone_factor"]}
               if m.get("compute_alone_factor", 1.0) < 1.0 else {}),
        }} if hw["host_cores"] else {}),
    }


# -- output ----------------------------------------------------------------------------------------

_FIELD_HOW = {
    "peak_tflops": "measured: achieved GEMM rate at the model's shapes, 1 thread (not the datasheet peak)",
    "mfu": "1.0: peak_tflops is already the achieved rate",
    "hbm_gbps": "measured: large copy_, bytes read + written",
    "nvlink_gbps": "measured: median busbw of all_to_all / all_reduce / send-recv",
    "nvlink_latency_us": "measured: median fitted latency of the same",
    "internode_gbps": "measured: as nvlink_gbps",
    "internode_latency_us": "measured: as nvlink_latency_us",
    "pcie_gbps": "measured: offload copy, latency + bytes / bandwidth fit",
    "pcie_latency_us": "measured: intercept of the same fit",
    "launch_us": "measured: tiny matmul + executor overhead per task",
    "optim_ns_per_param": "measured: AdamW step per parameter, 1 thread",
    "host_cores": "os.cpu_count() on CPU (ranks' lanes share them), 0 on CUDA",
    "comm_cpu_ns_per_byte": "measured: compute time lost per byte a concurrent all_to_all sends + receives (CPU)",
    "comm_cpu_us_per_call": "measured: compute time lost per concurrent all_to_all call, beside its bytes (CPU)",
    "comm_wait_us_per_call": "measured: how much longer an all_to_all call takes beside compute (CPU)",
    "task_time_cv": "measured: std / mean of 5 ms pieces of compute beside all_to_alls (CPU)",
    "compute_alone_factor": "measured: the operator profile timed by one process alone over all at once (CPU)",
    "device_memory_gb": "not measured",
    "host_memory_gb": "not measured",
    "gpus_per_node": "not measured",
}


def hardware_block(result: ProbeResult, config_given: bool) -> str:
    """The ``hardware:`` mapping as YAML text, one commented line per field."""
    lines = ["hardware:"]
    for key, value in result.hardware.items():
        if key == "cpu_runner":  # its own mapping, one commented line per field
            lines.append("  cpu_runner:  # the CPU runner's model (k3sched/cpurunner.py)")
            lines += [f"    {k}: {yaml_scalar(v)}  # {_FIELD_HOW[k]}" for k, v in value.items()]
            continue
        how = _FIELD_HOW.get(key, "")
        if key in ("device_memory_gb", "host_memory_gb", "gpus_per_node", "name"):
            how = "from --config" if config_given else "this machine"
        if result.emulated and key in ("nvlink_gbps", "nvlink_latency_us", "internode_gbps", "internode_latency_us"):
            how += " (shaped-link testbed)"
        elif key.startswith(("nvlink", "internode")):
            how += " (loopback: all ranks on one machine)"
        text = yaml_scalar(value)
        lines.append(f"  {key}: {text}" + (f"  # {how}" if how else ""))
    return "\n".join(lines) + "\n"


def yaml_scalar(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def hardware_yaml(result: ProbeResult, config_path: str | Path | None = None,
                  overrides: Sequence[str] | None = None) -> str:
    """YAML text: with ``config_path``, that config (with ``overrides``, ``SECTION.KEY=VALUE``
    strings, applied) with its ``hardware`` section replaced by the measured one (other sections as
    the file has them, comments dropped); else a file whose only key is ``hardware``. Checked to
    load (a full config also validates: :class:`k3sched.config.ConfigError` otherwise)."""
    import yaml

    from k3sched.config import HardwareConfig, config_from_dict, parse_overrides

    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    head = [f"# k3sched probe, {stamp}, host {platform.node()}, {result.device}, {result.nproc} ranks"
            + (" in the shaped-link testbed" if result.emulated else "")]
    head += [f"# note: {n}" for n in result.notes]
    if config_path is None:
        head.append("# merge this hardware section into a config (or pass each field with --set hardware.KEY=VALUE)")
        text = "\n".join(head) + "\n" + hardware_block(result, False)
        HardwareConfig.model_validate(yaml.safe_load(text)["hardware"])
        return text
    raw = yaml.safe_load(Path(config_path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a mapping with sections model, parallel, hardware, schedule")
    for key, value in parse_overrides(list(overrides or [])):
        section, _, name = key.partition(".")
        if section != "hardware":
            raw.setdefault(section, {})[name] = value
    sets = "".join(f" --set {o}" for o in overrides or [])
    head.append(f"# {config_path}{sets} with its hardware section replaced by the measured numbers")
    parts = ["\n".join(head) + "\n"]
    keys = list(raw) if "hardware" in raw else [*raw, "hardware"]
    for key in keys:
        if key == "hardware":
            parts.append(hardware_block(result, True))
        else:
            parts.append(yaml.safe_dump({key: raw[key]}, sort_keys=False, default_flow_style=False))
    text = "".join(parts)
    config_from_dict(yaml.safe_load(text))  # raises ConfigError if the result would not load
    return text


def write_hardware(result: ProbeResult, path: str | Path, config_path: str | Path | None = None,
                   overrides: Sequence[str] | None = None) -> Path:
    """Write :func:`hardware_yaml` to ``path`` (parent folders created). With a config and an
    operator profile, the profile goes to ``PATH.ops.yaml`` and the config's ``schedule.profile``
    names it."""
    p = Path(path)
    if config_path is not None and result.ops_us:
        ops = write_ops_profile(result.ops_us, p.with_name(p.stem + ".ops.yaml"), result.per_expert_us)
        overrides = list(overrides or []) + [f"schedule.profile={ops.resolve()}"]
        if result.routing_imbalance != 1.0:
            overrides.append(f"model.routing_imbalance={result.routing_imbalance:.4g}")
    text = hardware_yaml(result, config_path, overrides)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p
