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
  handlers running stage 0 of the tiny EP 2 plan; ~13 µs here).
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

What the numbers do not show: on CPU the ranks share the machine's cores with each other and with
their lane threads; loopback "bandwidth" is the CPU's memcpy through the kernel's TCP stack, not a
wire; the GEMM rate is one thread alone, with no other lane competing.

Python API: :func:`probe` (everything; returns a :class:`ProbeResult`), :func:`hardware_yaml` /
:func:`write_hardware` (the YAML), and the parts :func:`measure_compute`, :func:`measure_launch`,
:func:`measure_hbm`, :func:`measure_pcie`, :func:`measure_collectives`, :func:`launch_workers`,
:func:`fit_latency_bandwidth`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.launch import REPO, first_error, free_port, kill_group

KiB, MiB = 1 << 10, 1 << 20
COLL_SIZES = tuple(4 * KiB * 4 ** i for i in range(7))  # 4 KiB .. 16 MiB
QUICK_COLL_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB)
COPY_SIZES = tuple(4 * KiB * 4 ** i for i in range(8))  # 4 KiB .. 64 MiB
QUICK_COPY_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)
OPS = ("all_to_all", "all_reduce", "sendrecv")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RESULT_FILE = "collectives.json"


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor of ``op`` on ``n`` ranks."""
    return {"all_reduce": 2 * (n - 1) / n, "all_to_all": (n - 1) / n, "sendrecv": 1.0}[op]


class ProbeError(RuntimeError):
    """A measurement failed; ``str(err)`` is one line."""


# -- fitting ---------------------------------------------------------------------------------------

@dataclass
class Fit:
    """``time_us = latency_us + nbytes / (gbps * 1e3)`` fitted to measured points."""

    latency_us: float
    gbps: float
    residual: float
    """RMS of the relative residuals (predicted / measured - 1) over the points."""
    points: int

    def time_us(self, nbytes: float) -> float:
        return self.latency_us + nbytes / (self.gbps * 1e3)


def fit_latency_bandwidth(nbytes: Sequence[float], times_us: Sequence[float]) -> Fit:
    """Least-squares fit of ``t = a + b * bytes`` (a: latency µs, 1 / (1e3 b): GB/s) minimizing
    the *relative* error, so small messages (latency) weigh as much as large ones (bandwidth).
    A negative intercept is clamped to 0 (refit through the origin); a non-positive slope (sizes
    too small to resolve the bandwidth) falls back to the best measured throughput."""
    x = np.asarray(nbytes, dtype=float)
    t = np.asarray(times_us, dtype=float)
    if x.shape != t.shape or x.size < 2 or len(set(x.tolist())) < 2:
        raise ValueError("fit_latency_bandwidth: needs at least two distinct sizes with one time each")
    if not np.all(np.isfinite(t)) or np.any(t <= 0) or np.any(x <= 0):
        raise ValueError("fit_latency_bandwidth: sizes and times must be positive and finite")
    w = 1.0 / t
    a_mat = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(a_mat, t * w, rcond=None)
    if b <= 0:
        b = float(np.min(t / x))
        a = max(0.0, float(np.sum(w * w * (t - b * x)) / np.sum(w * w)))
    elif a < 0:
        a = 0.0
        b = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    pred = a + b * x
    residual = float(np.sqrt(np.mean((pred / t - 1.0) ** 2)))
    return Fit(latency_us=float(a), gbps=float(1.0 / (b * 1e3)), residual=residual, points=int(x.size))


# -- timing ----------------------------------------------------------------------------------------

def _sync_of(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_call(fn: Callable[[], Any], *, sync: Callable[[], None] = lambda: None, reps: int = 5,
              min_s: float = 0.005, warmup: int = 1) -> float:
    """Seconds per call of ``fn``: the median of ``reps`` repetitions after ``warmup`` calls, each
    repetition a loop of n calls (n grown until a loop lasts ``min_s``)."""
    for _ in range(warmup):
        fn()
    sync()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        dt = time.perf_counter() - t0
        if dt >= min_s or n >= 1 << 20:
            break
        n = min(1 << 20, max(2 * n, int(n * min_s / max(dt, 1e-9) * 1.2)))
    samples = [dt / n]
    for _ in range(reps - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


@dataclass
class Knobs:
    """Repetitions and loop lengths (``quick``: fewer, shorter; for tests)."""

    reps: int = 7
    min_s: float = 0.01
    gemm_target_s: float = 0.02
    hbm_bytes_cpu: int = 64 * MiB
    hbm_bytes_cuda: int = 1 << 30
    copy_sizes: tuple[int, ...] = COPY_SIZES
    coll_sizes: tuple[int, ...] = COLL_SIZES
    coll_reps: int = 5
    coll_min_s: float = 0.005

    @classmethod
    def of(cls, quick: bool) -> Knobs:
        if not quick:
            return cls()
        return cls(reps=3, min_s=0.002, gemm_target_s=0.005, hbm_bytes_cpu=32 * MiB, hbm_bytes_cuda=256 * MiB,
                   copy_sizes=QUICK_COPY_SIZES, coll_sizes=QUICK_COLL_SIZES, coll_reps=3, coll_min_s=0.002)


# -- compute ---------------------------------------------------------------------------------------

@dataclass
class GemmShape:
    """One GEMM of a layer, ``(m x k) @ (k x n)``; ``weight``: how many of it one step runs."""

    name: str
    m: int
    k: int
    n: int
    weight: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def gemm_shapes(cfg=None) -> list[GemmShape]:
    """The GEMM shapes of ``cfg`` (a :class:`k3sched.config.Config`) the cost model counts, or one
    default square GEMM (1024 on CPU, 8192 on CUDA) without a config. Identical shapes merge."""
    if cfg is None:
        s = 8192 if torch.cuda.is_available() else 1024
        return [GemmShape(f"square {s}", s, s, s)]
    m, ep = cfg.model, cfg.parallel.ep
    T, h, f, F, k, E = m.tokens, m.hidden, m.expert_hidden, m.ffn_dense_hidden, m.top_k, m.experts
    moe, dense = m.layers - m.dense_layers, m.dense_layers
    e_loc = E // ep
    te = max(1, round(T * k * ep / E))  # tokens per local expert, balanced routing
    raw = [GemmShape("attn proj", T, h, h, 4 * m.layers)]
    if moe:
        raw += [GemmShape("router", T, h, E, moe), GemmShape("expert up", te, h, f, 2 * e_loc * moe),
                GemmShape("expert down", te, f, h, e_loc * moe)]
        if m.shared_experts:
            raw += [GemmShape("shared up", T, h, f, 2 * m.shared_experts * moe),
                    GemmShape("shared down", T, f, h, m.shared_experts * moe)]
    if dense:
        raw += [GemmShape("dense up", T, h, F, 2 * dense), GemmShape("dense down", T, F, h, dense)]
    merged: dict[tuple[int, int, int], GemmShape] = {}
    for g in raw:
        if (g.m, g.k, g.n) in merged:
            old = merged[(g.m, g.k, g.n)]
            old.name += f" + {g.name}"
            old.weight += g.weight
        else:
            merged[(g.m, g.k, g.n)] = g
    return list(merged.values())


@dataclass
class GemmTiming:
    shape: GemmShape
    timed: tuple[int, int, int]
    """(m, k, n) actually timed (m, n cut on a slow device or for a huge weight)."""
    us: dict[str, float]
    """Seconds x 1e6 per call of the forward, dX and dW GEMM at the timed shape."""

    @property
    def tflops(self) -> float:
        m, k, n = self.timed
        return 3 * 2.0 * m * k * n / (sum(self.us.values()) * 1e-6) / 1e12


def measure_gemm(g: GemmShape, dtype: torch.dtype, device: torch.device, knobs: Knobs) -> GemmTiming:
    sync = _sync_of(device)
    b = torch.tensor([], dtype=dtype).element_size()
    max_weight = (1 << 30) if device.type == "cuda" else 64 * MiB
    k, n = g.k, g.n
    if k * n * b > max_weight:
        n = max(16, max_weight // (k * b))
    first_flops = 1e11 if device.type == "cuda" else 2e7
    m = min(g.m, max(16, int(first_flops / (2.0 * k * n))))
    for _ in range(2):  # a trial call at a small m, then m scaled to ~target_s (never above the model's)
        x = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(k, n, dtype=dtype, device=device)
        torch.matmul(x, w)
        sync()
        t0 = time.perf_counter()
        torch.matmul(x, w)
        sync()
        dt = time.perf_counter() - t0
        want = min(g.m, max(16, int(m * knobs.gemm_target_s / max(dt, 1e-9))))
        if want == m or (want > m and m == g.m):
            break
        m = want
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(k, n, dtype=dtype, device=device)
    gy = torch.randn(m, n, dtype=dtype, device=device)
    us = {
        "fwd": time_call(lambda: torch.matmul(x, w), sync=sync, reps=knobs.reps, min_s=knobs.min_s) * 1e6,
        "dx": time_call(lambda: torch.matmul(gy, w.t()), sync=sync, reps=knobs.reps, min_s=knobs.min_s) * 1e6,
        "dw": time_call(lambda: torch.matmul(x.t(), gy), sync=sync, reps=knobs.reps, min_s=knobs.min_s) * 1e6,
    }
    return GemmTiming(g, (m, k, n), us)


def measure_compute(shapes: Sequence[GemmShape], dtype: torch.dtype, device: torch.device,
                    knobs: Knobs | None = None) -> tuple[float, list[GemmTiming]]:
    """Achieved TFLOP/s over ``shapes`` in one thread: sum of weight x FLOPs over the sum of
    weight x FLOPs / rate (each shape's rate from forward + dX + dW)."""
    knobs = knobs or Knobs()
    with _one_thread():
        timings = [measure_gemm(g, dtype, device, knobs) for g in shapes]
    work = sum(t.shape.weight * t.shape.flops for t in timings)
    time_s = sum(t.shape.weight * t.shape.flops / (t.tflops * 1e12) for t in timings)
    return work / time_s / 1e12, timings


@contextlib.contextmanager
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def executor_overhead_us(steps: int = 10) -> tuple[float, str]:
    """Executor cost per task with no-op handlers (stage 0 of the tiny config's EP 2 plan), and
    how it was measured. Raises ProbeError when the executor cannot be run."""
    try:
        from k3sched.config import load_config
        from k3sched.planner import plan
        from k3sched.render import plan_to_json
        from runtime.executor import Executor, noop_handlers, stage_lanes

        cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["parallel.pp=1", "parallel.ep=2"])
        lanes = stage_lanes(plan_to_json(plan(cfg)), 0)
        n = sum(len(v) for v in lanes.values())
        with Executor(lanes, noop_handlers(), perturb=None) as ex:
            for i in range(3):
                ex.run_step(i)
            walls = [ex.run_step(i).wall_s for i in range(steps)]
    except Exception as e:  # noqa: BLE001 - any failure: report it, launch_us falls back to the op alone
        first = str(e).splitlines()[0] if str(e) else ""
        raise ProbeError(f"executor overhead not measured ({type(e).__name__}: {first})") from None
    return statistics.median(walls) / n * 1e6, f"no-op executor, {n} tasks/step, median of {steps} steps"


def measure_launch(device: torch.device, knobs: Knobs | None = None) -> tuple[float, float | None, str]:
    """(tiny 8 x 8 matmul µs per call, executor µs per task or None, note)."""
    knobs = knobs or Knobs()
    a = torch.randn(8, 8, device=device)
    with _one_thread():
        tiny = time_call(lambda: torch.matmul(a, a), sync=_sync_of(device), reps=knobs.reps, min_s=knobs.min_s) * 1e6
    try:
        ex, note = executor_overhead_us(5 if knobs.reps < 5 else 10)
    except ProbeError as e:
        return tiny, None, str(e)
    return tiny, ex, note


# -- memory ----------------------------------------------------------------------------------------

def measure_hbm(device: torch.device, knobs: Knobs | None = None) -> tuple[float, float, int]:
    """(copy_ GB/s counting 2 x size, in-place add GB/s counting 3 x size, size in bytes)."""
    knobs = knobs or Knobs()
    nbytes = knobs.hbm_bytes_cuda if device.type == "cuda" else knobs.hbm_bytes_cpu
    numel = nbytes // 4
    src = torch.ones(numel, device=device)
    dst = torch.zeros(numel, device=device)
    sync = _sync_of(device)
    with _one_thread():
        t_copy = time_call(lambda: dst.copy_(src), sync=sync, reps=knobs.reps, min_s=knobs.min_s)
        t_add = time_call(lambda: dst.add_(src), sync=sync, reps=knobs.reps, min_s=knobs.min_s)
    return 2 * numel * 4 / t_copy / 1e9, 3 * numel * 4 / t_add / 1e9, numel * 4


def measure_adamw(device: torch.device, knobs: Knobs | None = None, numel: int = 1 << 20) -> float:
    """ns per parameter of one ``torch.optim.AdamW`` step (the runtime's optimizer) in one thread."""
    knobs = knobs or Knobs()
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn(numel, device=device)
    opt = torch.optim.AdamW([p], lr=1e-3)
    opt.step()  # allocates the moments
    with _one_thread():
        t = time_call(opt.step, sync=_sync_of(device), reps=knobs.reps, min_s=knobs.min_s)
    return t * 1e9 / numel


def measure_ops(cfg, steps: int = 2) -> dict[str, float]:
    """[Note: operator profile] Median duration (µs, one core, one rank) of each compute task kind
    of the config's model at its shapes: an in-process step of the same model with pp = ep = dp = 1
    (no communication, no other rank), run serially, steps after the first. The cost model's
    FLOP count covers GEMMs only; norms, softmax, routing (top-k, sorting, index ops) and autograd
    bookkeeping are what make a CPU task cost 2-20x its GEMM time, and they are measured here, not
    guessed. The EP kinds at ep 1 move nothing: their time is the host-side work of a dispatch or
    combine (routing bookkeeping, permutes), the profile's ``overhead_us``. Not measured: anything of the target layout (ranks, links); that is what
    ``k3sched calibrate`` fits from a run."""
    from k3sched.config import config_from_dict
    from k3sched.tasks import LANE_OF, Kind, parse_task_id

    from .local import local_run

    data = cfg.to_dict()
    data["parallel"] = {**data["parallel"], "pp": 1, "vpp": 1, "ep": 1, "dp": 1, "world_size": None,
                        "layer_split": "even"}
    data["schedule"] = {**data["schedule"], "pipeline": "1f1b", "offload": "none", "profile": None,
                        "device_memory_budget": 1 << 20, "grad_offload": False, "remote_offload": False}
    one = config_from_dict(data)
    with _one_thread():
        run = local_run(one, steps, strategy="serial")
    spans: dict[str, list[float]] = {}
    for trace in run.traces[1:] or run.traces:
        for e in trace["traceEvents"]:
            if e.get("ph") == "X":
                kind = parse_task_id(e["name"]).kind
                if (LANE_OF[kind] == "compute" and kind is not Kind.OPTIM) or LANE_OF[kind] == "ep":
                    spans.setdefault(kind.value, []).append(float(e["dur"]))
    return {k: _sig(statistics.median(v)) for k, v in sorted(spans.items())}


def measure_ops_concurrent(cfg, copies: int, timeout_s: float = 300.0, work_dir: str | Path | None = None
                           ) -> dict[str, float]:
    """:func:`measure_ops` in ``copies`` processes at once (the ranks that share this node's
    cores in a run: measured alone, a task runs faster than beside another rank's compute, e.g. on
    SMT siblings or a shared memory bus); per kind, the median over the copies."""
    if copies <= 1:
        return measure_ops(cfg)
    d = Path(work_dir or tempfile.mkdtemp(prefix="k3sched_ops_"))
    d.mkdir(parents=True, exist_ok=True)
    (d / "ops_config.json").write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")] if p)}
    procs = [subprocess.Popen([sys.executable, "-m", "runtime.probe", "ops", str(d / "ops_config.json"),
                               str(d / f"ops_{i}.json")], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i in range(copies)]
    try:
        for pr in procs:
            _, err = pr.communicate(timeout=timeout_s)
            if pr.returncode != 0:
                raise ProbeError(f"operator profile failed: {err.strip().splitlines()[-1] if err.strip() else pr.returncode}")
    except subprocess.TimeoutExpired:
        raise ProbeError(f"operator profile did not finish within {timeout_s:.0f} s") from None
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
    runs = [json.loads((d / f"ops_{i}.json").read_text()) for i in range(copies)]
    return {k: _sig(statistics.median(r[k] for r in runs)) for k in runs[0]}


def write_ops_profile(ops_us: dict[str, float], path: str | Path) -> Path:
    """The operator profile as a ``schedule.profile`` YAML (``durations_us``)."""
    import yaml

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    from k3sched.tasks import LANE_OF, Kind

    compute = {k: v for k, v in ops_us.items() if LANE_OF[Kind(k)] == "compute"}
    overhead = {k: v for k, v in ops_us.items() if LANE_OF[Kind(k)] != "compute"}
    p.write_text("# k3sched probe: operator profile ([Note: operator profile] in runtime/probe.py), µs per task "
                 "on one core;\n# overhead_us: the EP tasks' host-side work at ep 1 (the wire time comes on top)\n"
                 + yaml.safe_dump({"format": "k3sched.profile/1", "source": "k3sched probe", "durations_us": compute,
                                   "overhead_us": overhead}, sort_keys=False))
    return p


def measure_pcie(device: torch.device, knobs: Knobs | None = None) -> dict[str, Any]:
    """Offload copies at ``knobs.copy_sizes``; returns ``{"fit": Fit, "direction": str, "points":
    {direction: [(bytes, µs)]}, "how": str}`` (on CUDA the slower direction's fit)."""
    knobs = knobs or Knobs()
    sync = _sync_of(device)
    points: dict[str, list[tuple[int, float]]] = {}
    with _one_thread():
        for size in knobs.copy_sizes:
            if device.type == "cuda":
                host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                dev = torch.empty(size, dtype=torch.uint8, device=device)
                pairs = {"device->host": (host, dev), "host->device": (dev, host)}
            else:
                pairs = {"device pool->host pool": (torch.empty(size, dtype=torch.uint8),
                                                     torch.empty(size, dtype=torch.uint8))}
            for name, (dst, src) in pairs.items():
                nb = device.type == "cuda"
                us = time_call(lambda d=dst, s=src: d.copy_(s, non_blocking=nb), sync=sync, reps=knobs.reps,
                               min_s=knobs.min_s) * 1e6
                points.setdefault(name, []).append((size, us))
    fits = {d: fit_latency_bandwidth([p[0] for p in pts], [p[1] for p in pts]) for d, pts in points.items()}
    slow = min(fits, key=lambda d: fits[d].gbps)
    how = ("pinned host <-> device copy_, slower direction" if device.type == "cuda"
           else "CPU tensor copy_ (device pool -> host pool: a memcpy)")
    return {"fit": fits[slow], "direction": slow, "fits": fits, "points": points, "how": how}


# -- collectives -----------------------------------------------------------------------------------

def collective_groups(nproc: int, gpus_per_node: int | None = None) -> dict[str, list[int]]:
    """Rank groups the collective probe measures. Without emulated nodes (``gpus_per_node`` None):
    one group of every rank (``loopback``). With nodes of ``gpus_per_node`` ranks: ``intra`` (the
    ranks of node 0) and ``inter`` (rank 0 of every node), each when it has two ranks or more."""
    if gpus_per_node is None:
        return {"loopback": list(range(nproc))}
    out = {}
    intra = list(range(min(gpus_per_node, nproc)))
    if len(intra) >= 2:
        out["intra"] = intra
    inter = list(range(0, nproc, gpus_per_node))
    if len(inter) >= 2:
        out["inter"] = inter
    return out


def launch_workers(nproc: int, worker_args: Sequence[str], out_dir: Path, *, timeout_s: float,
                   testbed: Any = None, env: dict[str, str] | None = None) -> None:
    """Run ``python -m runtime.probe worker WORKER_ARGS`` on ``nproc`` ranks under torchrun (in a
    new session, killed as a group on every exit path, as :func:`runtime.launch.run_command`
    does); inside ``testbed`` (an open :class:`runtime.testbed.Testbed`: torchrun in its hub
    namespace, each rank in its own namespace, ``GLOO_SOCKET_IFNAME`` its shaped NIC) when given.
    torchrun's output goes to ``out_dir/torchrun.log``. Raises ProbeError (one line: the failing
    rank's error) on failure or timeout."""
    worker = [sys.executable, "-m", "runtime.probe", "worker", *worker_args]
    if testbed is not None:
        cmd = testbed.torchrun_command(worker, nproc=nproc)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
               "--no-python", *worker]
    run_env = {**os.environ, **(env or {}), **(testbed.env() if testbed is not None else {})}
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), run_env.get("PYTHONPATH", "")] if p)
    run_env["OMP_NUM_THREADS"] = "1"
    run_env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    log_path = out_dir / "torchrun.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=run_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ProbeError(f"the collective probe timed out after {timeout_s:.0f} s; stopped every rank") from None
        finally:
            kill_group(proc)
    if rc != 0:
        line = first_error(out_dir)
        if not line:
            tail = [s for s in log_path.read_text(errors="replace").splitlines() if s.strip()]
            line = f"torchrun exited with status {rc}" + (f": {tail[-1].strip()}" if tail else "")
        raise ProbeError(line)


def measure_collectives(nproc: int, *, sizes: Sequence[int] = COLL_SIZES, reps: int = 5, min_s: float = 0.005,
                        timeout_s: float = 300.0, testbed: Any = None, groups: dict[str, list[int]] | None = None,
                        work_dir: str | Path | None = None, device: str | None = None) -> dict[str, Any]:
    """Launch the collective probe on ``nproc`` ranks and return the ranks' result: ``{"world",
    "backend", "groups": {name: {"ranks": [...], "ops": {op: [{"bytes", "time_us", "algbw_gbps",
    "busbw_gbps", "iters", "samples_us"}]}}}}`` plus ``"fits": {group: {op: Fit}}`` (busbw fits).
    ``groups`` defaults to :func:`collective_groups` (one loopback group). ``testbed``: a
    :class:`runtime.testbed.Testbed` for ``nproc`` ranks, open (the caller closes it) or not yet
    started (opened around the launch; :class:`runtime.testbed.TestbedError` when refused)."""
    if nproc < 2:
        raise ValueError(f"--nproc: the collective probe needs at least 2 ranks; got {nproc}")
    groups = groups or collective_groups(nproc)
    device = device or ("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "cpu")
    tmp = None
    if work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="k3sched_probe_")
        work_dir = tmp.name
    out = Path(work_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("error_rank*.txt")) + [out / RESULT_FILE]:
        stale.unlink(missing_ok=True)
    args = ["--out", str(out), "--sizes", ",".join(str(s) for s in sizes), "--reps", str(reps), "--min-s",
            str(min_s), "--timeout", str(max(10.0, timeout_s)), "--groups", json.dumps(groups), "--device", device]
    # A Testbed not yet started is opened around the launch only (and deleted again on every exit).
    own = testbed is not None and not getattr(testbed, "open", True)
    try:
        with testbed if own else contextlib.nullcontext():
            launch_workers(nproc, args, out, timeout_s=timeout_s, testbed=testbed)
        try:
            res = json.loads((out / RESULT_FILE).read_text())
        except (OSError, ValueError) as e:
            raise ProbeError(f"the collective probe wrote no readable {RESULT_FILE} ({e})") from None
    finally:
        if tmp is not None:
            tmp.cleanup()
    res["fits"] = {}
    for name, g in res["groups"].items():
        n = len(g["ranks"])
        res["fits"][name] = {op: fit_latency_bandwidth([r["bytes"] * bus_factor(op, n) for r in rows],
                                                       [r["time_us"] for r in rows])
                             for op, rows in g["ops"].items()}
    return res


def link_numbers(fits: dict[str, Fit]) -> tuple[float, float]:
    """(GB/s, latency µs) of a link from its per-collective busbw fits: the medians."""
    return (statistics.median(f.gbps for f in fits.values()), statistics.median(f.latency_us for f in fits.values()))


# -- the per-rank worker (``python -m runtime.probe worker``, started by torchrun) --------------------

def _worker_measure(group, ranks: list[int], rank: int, sizes: Sequence[int], reps: int, min_s: float,
                    device: torch.device) -> dict[str, list[dict]]:
    import torch.distributed as dist

    from moe.comm import all_to_all_rows

    n, me = len(ranks), ranks.index(rank)
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    sync = _sync_of(device)
    out: dict[str, list[dict]] = {}
    for op in OPS:
        rows = []
        for size in sizes:
            numel = max(n, size // 4 // n * n)
            x = torch.zeros(numel, dtype=torch.float32, device=device)
            y = torch.empty_like(x)
            if op == "all_to_all":  # as the runtime's EP lane runs it (full duplex on gloo)
                def call(x=x, y=y):
                    all_to_all_rows(y, x, [numel // n] * n, [numel // n] * n, group)
            elif op == "all_reduce":
                def call(x=x):
                    dist.all_reduce(x, group=group)
            else:
                def call(x=x, y=y):
                    # receive posted first: full duplex on gloo ([Note: full-duplex all-to-all on gloo])
                    for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, y, prv, group),
                                                       dist.P2POp(dist.isend, x, nxt, group)]):
                        req.wait()
            call()
            call()
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)  # NCCL: on the GPU
            dist.all_reduce(one, op=dist.ReduceOp.MAX, group=group)  # every rank loops the same count
            iters = int(min(1000, max(1, math.ceil(min_s / max(one.item(), 1e-9)))))
            samples, cpu = [], []
            for _ in range(reps):
                dist.barrier(group=group)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(iters):
                    call()
                sync()
                cpu.append((time.process_time() - c0) / iters)
                dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # the slowest rank
                samples.append(dt.item())
            t = statistics.median(samples)
            nbytes = numel * 4
            rows.append({"bytes": nbytes, "time_us": t * 1e6, "algbw_gbps": nbytes / t / 1e9,
                         "busbw_gbps": nbytes / t / 1e9 * bus_factor(op, n), "iters": iters,
                         "samples_us": [s * 1e6 for s in samples], "cpu_us": statistics.median(cpu) * 1e6})
        out[op] = rows
    return out


def worker_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.probe worker")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", required=True, help="comma-separated message sizes, bytes")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.005)
    ap.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    ap.add_argument("--groups", default=None, help='JSON {"name": [ranks]} (default: every rank)')
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = ap.parse_args(list(argv))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        sizes = [int(s) for s in a.sizes.split(",") if s]
        spec = json.loads(a.groups) if a.groups else {"loopback": list(range(world))}
        timeout = timedelta(seconds=a.timeout)
        if a.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
            dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        # every rank creates every group, in the same order
        handles = {name: dist.new_group(ranks, timeout=timeout) for name, ranks in spec.items()}
        result: dict[str, Any] = {"world": world, "backend": dist.get_backend(), "device": device.type,
                                  "host": socket.gethostname(), "groups": {}}
        for name, ranks in spec.items():
            if rank in ranks:
                ops = _worker_measure(handles[name], ranks, rank, sizes, a.reps, a.min_s, device)
                result["groups"][name] = {"ranks": ranks, "ops": ops}
            dist.barrier()
        if rank == 0:
            tmp = a.out / (RESULT_FILE + ".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(a.out / RESULT_FILE)
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line for the parent
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        line = f"probe rank {rank}: {type(e).__name__}: {msg}"
        with contextlib.suppress(OSError):
            (a.out / f"error_rank{rank}.txt").write_text(f"{time.time():.6f} {line}\n")
        print(line, file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo threads may still sit in a collective after a failure: no interpreter teardown


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


def _sig(x: float, digits: int = 4) -> float:
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")


def _mem_gib(key: str) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / 2 ** 30
    return None


def probe(cfg=None, *, nproc: int = 2, quick: bool = False, testbed: Any = None, timeout_s: float = 300.0,
          work_dir: str | Path | None = None, progress: Callable[[str], None] | None = None) -> ProbeResult:
    """Measure this machine (see [Note: what the probe measures]). ``cfg``: a
    :class:`k3sched.config.Config` whose model gives the GEMM shapes and dtype and whose hardware
    section supplies what is not measured (memory sizes, ``gpus_per_node``, name); None: a default
    GEMM and sizes from this machine. ``testbed``: run the collectives in the shaped-link testbed
    (``runtime/testbed.py``). Raises ProbeError (one line) when a measurement fails."""
    say = progress or (lambda s: None)
    knobs = Knobs.of(quick)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    rows: list[Row] = []
    notes: list[str] = []
    dtype_name = cfg.model.dtype if cfg is not None else ("bf16" if cuda else "fp32")
    dtype = TORCH_DTYPES[dtype_name]

    say("compute: timing the model's GEMMs in one thread")
    shapes = gemm_shapes(cfg)
    tflops, gemms = measure_compute(shapes, dtype, device, knobs)
    src = "the config's model" if cfg is not None else "a default square GEMM"
    rows.append(Row("peak_tflops (mfu 1.0)", f"{tflops:.4g} TFLOP/s",
                    f"torch.matmul fwd/dX/dW at {len(gemms)} shape(s) of {src}, {dtype_name}, 1 thread; "
                    f"FLOP-weighted"))
    for t in gemms:
        m, k, n = t.timed
        cut = "" if (m, n) == (t.shape.m, t.shape.n) else f" (model {t.shape.m}x{t.shape.k}x{t.shape.n})"
        rows.append(Row(f"  {t.shape.name}", f"{t.tflops * 1e3:.4g} GFLOP/s", f"{m}x{k}x{n}{cut}, x{t.shape.weight:g}"
                        " per step"))

    say("launch: tiny op and executor overhead per task")
    tiny_us, exec_us, exec_note = measure_launch(device, knobs)
    launch = tiny_us + (exec_us or 0.0)
    ex_txt = f"{exec_us:.3g} µs/task ({exec_note})" if exec_us is not None else f"not measured: {exec_note}"
    rows.append(Row("launch_us", f"{launch:.3g} µs", f"8x8 matmul {tiny_us:.3g} µs + executor {ex_txt}"))
    if exec_us is None:
        notes.append(f"launch_us is the tiny op alone: {exec_note}")

    say("hbm: large copy_")
    hbm, add_gbps, hbm_bytes = measure_hbm(device, knobs)
    rows.append(Row("hbm_gbps", f"{hbm:.4g} GB/s", f"copy_ of {hbm_bytes // MiB} MiB, 2 x size (read + write)"))
    rows.append(Row("  add_ cross-check", f"{add_gbps:.4g} GB/s", "in-place add, 3 x size (gshard.add's count)"))

    adam_ns = measure_adamw(device, knobs)
    rows.append(Row("optim_ns_per_param", f"{adam_ns:.3g} ns", "torch.optim.AdamW step of 1M fp32 parameters, "
                    "1 thread"))
    host_cores = 0 if device.type == "cuda" else (os.cpu_count() or 1)
    rows.append(Row("host_cores", str(host_cores), "0 on CUDA (a device per rank); on CPU the cores the ranks share"))

    ops: dict[str, float] = {}
    if cfg is not None:
        say("operators: one serial in-process step of the model at its shapes")
        copies = max(1, min(nproc, os.cpu_count() or 1)) if device.type == "cpu" else 1
        ops = measure_ops_concurrent(cfg, copies, timeout_s, work_dir)
        rows.append(Row("operator profile", f"{len(ops)} kinds", f"one rank, pp=ep=dp=1, serial, {copies} copies at "
                        "once, median µs per task: " + ", ".join(f"{k} {v:.3g}" for k, v in ops.items())))

    say("pcie: offload copies at several sizes")
    pc = measure_pcie(device, knobs)
    pfit: Fit = pc["fit"]
    sizes_txt = f"{len(knobs.copy_sizes)} sizes {_size(knobs.copy_sizes[0])}..{_size(knobs.copy_sizes[-1])}"
    rows.append(Row("pcie_gbps", f"{pfit.gbps:.4g} GB/s", f"{pc['how']}, {sizes_txt}, fit", pfit.residual))
    rows.append(Row("pcie_latency_us", f"{pfit.latency_us:.3g} µs", "intercept of the same fit", pfit.residual))

    hw_base = cfg.hardware if cfg is not None else None
    gpn = hw_base.gpus_per_node if hw_base is not None else (torch.cuda.device_count() if cuda else nproc)
    tb_links = getattr(testbed, "links", None)  # runtime.testbed.Links: the shaped rates
    if tb_links is not None:
        gpn = tb_links.gpus_per_node
    groups = collective_groups(nproc, gpn if testbed is not None else None)
    where = "in the shaped-link testbed" if testbed is not None else "on this machine (loopback)"
    say(f"collectives: {nproc} ranks {where}, {len(knobs.coll_sizes)} sizes")
    coll = measure_collectives(nproc, sizes=knobs.coll_sizes, reps=knobs.coll_reps, min_s=knobs.coll_min_s,
                               timeout_s=timeout_s, testbed=testbed, groups=groups, work_dir=work_dir)
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
        how = "loopback (one machine): median of the 3 fits above; same for both links"
        ihow = how
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
    cpu_ns = comm_cpu_ns_per_byte(coll) if device.type == "cpu" else 0.0
    rows.append(Row("comm_cpu_ns_per_byte", f"{cpu_ns:.3g} ns", "process CPU time of rank 0 during its largest "
                    "all_to_alls / bytes it sent and received (gloo threads, kernel TCP); 0 on CUDA"))
    rows.append(Row("nvlink_gbps", f"{intra[0]:.4g} GB/s", how))
    rows.append(Row("nvlink_latency_us", f"{intra[1]:.3g} µs", how))
    rows.append(Row("internode_gbps", f"{inter[0]:.4g} GB/s", ihow))
    rows.append(Row("internode_latency_us", f"{inter[1]:.3g} µs", ihow))

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
    hardware = {
        "name": f"probe {name}" if not str(name).startswith("probe ") else name,
        "peak_tflops": _sig(tflops), "mfu": 1.0, "hbm_gbps": _sig(hbm),
        "device_memory_gb": _sig(dev_gb), "host_memory_gb": _sig(host_gb), "gpus_per_node": int(gpn),
        "nvlink_gbps": _sig(intra[0]), "nvlink_latency_us": _sig(intra[1]),
        "internode_gbps": _sig(inter[0]), "internode_latency_us": _sig(inter[1]),
        "pcie_gbps": _sig(pfit.gbps), "pcie_latency_us": _sig(pfit.latency_us), "launch_us": _sig(launch),
        "optim_ns_per_param": _sig(adam_ns), "host_cores": host_cores, "comm_cpu_ns_per_byte": _sig(cpu_ns),
    }
    if device.type == "cpu":
        wire = ("the shaped veths cap the rate, but the bytes still move by CPU memcpy through the kernel's TCP "
                "stack" if testbed is not None else "loopback bandwidth is memcpy through the kernel's TCP stack, "
                "not a wire")
        notes.append(f"CPU: the {nproc} ranks share {os.cpu_count()} core(s); {wire}")
    return ProbeResult(hardware, rows, coll, gemms, device.type, nproc, testbed is not None, notes, ops)


def comm_cpu_ns_per_byte(coll: dict) -> float:
    """CPU ns per byte a rank sends or receives, from rank 0's CPU time in the two largest
    all_to_all sizes of the first measured group ((n-1)/n of the bytes leave, as many arrive)."""
    for group in coll.get("groups", {}).values():
        n = len(group["ranks"])
        rows = sorted(group["ops"].get("all_to_all", []), key=lambda r: r["bytes"])[-2:]
        vals = [r["cpu_us"] * 1e3 / (2 * r["bytes"] * (n - 1) / n) for r in rows if r.get("cpu_us") and n > 1]
        if vals:
            return statistics.median(vals)
    return 0.0


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


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
    "comm_cpu_ns_per_byte": "measured: CPU time per byte sent + received in the largest all_to_alls",
    "device_memory_gb": "not measured",
    "host_memory_gb": "not measured",
    "gpus_per_node": "not measured",
}


def hardware_block(result: ProbeResult, config_given: bool) -> str:
    """The ``hardware:`` mapping as YAML text, one commented line per field."""
    lines = ["hardware:"]
    for key, value in result.hardware.items():
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
        ops = write_ops_profile(result.ops_us, p.with_name(p.stem + ".ops.yaml"))
        overrides = list(overrides or []) + [f"schedule.profile={ops.resolve()}"]
    text = hardware_yaml(result, config_path, overrides)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def result_json(result: ProbeResult) -> dict[str, Any]:
    """A JSON-able form of ``result`` (for benchmarks that keep the raw numbers)."""
    coll = {k: v for k, v in result.collectives.items() if k != "fits"}
    coll["fits"] = {g: {op: asdict(f) for op, f in fits.items()} for g, fits in result.collectives["fits"].items()}
    return {"hardware": result.hardware, "rows": [asdict(r) for r in result.rows], "collectives": coll,
            "gemms": [{"name": t.shape.name, "model": [t.shape.m, t.shape.k, t.shape.n], "timed": list(t.timed),
                       "weight": t.shape.weight, "us": t.us, "tflops": t.tflops} for t in result.gemms],
            "device": result.device, "nproc": result.nproc, "emulated": result.emulated, "notes": result.notes}


def _ops_main(config_json: str, out: str) -> None:
    from k3sched.config import config_from_dict

    torch.set_num_threads(1)
    Path(out).write_text(json.dumps(measure_ops(config_from_dict(json.loads(Path(config_json).read_text())))))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "ops":
        _ops_main(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        print("usage: python -m runtime.probe worker --out DIR --sizes N,N,... (started by torchrun; "
              "use `k3sched probe` instead)", file=sys.stderr)
        sys.exit(2)
