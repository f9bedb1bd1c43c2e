"""Measurements of this process: GEMM rate, launch and executor overhead, memory copies, AdamW,
the operator profile, and the latency/bandwidth fit they share (``k3sched probe``; see
[Note: what the probe measures] in runtime/probe/__init__.py)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3sched.profile import EXPERT_OPS
from runtime.launch import REPO

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

def sync_of(device: torch.device) -> Callable[[], None]:
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
    contended_s: float = 0.5  # GEMM loop per sample of the contended measurement (CPU; quick too)
    contended_reps: int = 7  # samples per size of it: the per-byte part rests on the largest size's
    # few calls a loop (about 50 at 1 MiB on a 50 MB/s link), too few for a median of 3 to be stable

    @classmethod
    def of(cls, quick: bool) -> Knobs:
        if not quick:
            return cls()
        return cls(reps=3, min_s=0.002, gemm_target_s=0.005, hbm_bytes_cpu=32 * MiB, hbm_bytes_cuda=256 * MiB,
                   copy_sizes=QUICK_COPY_SIZES, coll_sizes=QUICK_COLL_SIZES, coll_reps=3, coll_min_s=0.002,
                   contended_reps=3)


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
    sync = sync_of(device)
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
        from k3sched.planfile import plan_to_json
        from k3sched.lowering import stage_lanes
        from runtime.executor import Executor, noop_handlers

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
        tiny = time_call(lambda: torch.matmul(a, a), sync=sync_of(device), reps=knobs.reps, min_s=knobs.min_s) * 1e6
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
    sync = sync_of(device)
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
        t = time_call(opt.step, sync=sync_of(device), reps=knobs.reps, min_s=knobs.min_s)
    return t * 1e9 / numel


def _one_rank(cfg, *, parallel: dict | None = None, schedule: dict | None = None):
    """``cfg`` at pp = ep = dp = 1, serial-friendly 1F1B without offload, profile or budget: the
    one-rank layout of the operator profile and the routing measurement (``parallel`` and
    ``schedule``: further fields to set)."""
    from k3sched.config import config_from_dict

    data = cfg.to_dict()
    data["parallel"] = {**data["parallel"], "pp": 1, "vpp": 1, "ep": 1, "dp": 1, "world_size": None,
                        "layer_split": "even", **(parallel or {})}
    data["schedule"] = {**data["schedule"], "pipeline": "1f1b", "offload": "none", "profile": None,
                        "device_memory_budget": 1 << 20, "grad_offload": False, "remote_offload": False,
                        **(schedule or {})}
    return config_from_dict(data)


def _profile_device() -> torch.device:
    """Where the in-process model steps of the probe run: where a one-rank run would
    (:func:`runtime.launch.resolve_device`), its GPU being ``cuda:0``."""
    from runtime.launch import resolve_device

    return torch.device("cuda", 0) if resolve_device(None, 1) == "cuda" else torch.device("cpu")


def measure_ops(cfg, steps: int = 2) -> dict[str, float]:
    """[Note: operator profile] Median duration (µs, one core, one rank) of each compute task kind
    of the config's model at its shapes: an in-process step of the same model with pp = ep = dp = 1
    (no communication, no other rank), run serially, steps after the first. The cost model's
    FLOP count covers GEMMs only; norms, softmax, routing (top-k, sorting, index ops) and autograd
    bookkeeping are what make a CPU task cost several times its GEMM time, and they are measured
    here, not guessed. The EP kinds at ep 1 move nothing: their time is the host-side work of a dispatch or
    combine (routing bookkeeping, permutes), the profile's ``overhead_us``. Not measured: anything of the target layout (ranks, links); that is what
    ``k3sched calibrate`` fits from a run. Where torch sees a GPU the step runs on ``cuda:0``, the
    lanes on their streams, each task timed by its CUDA events, as the ranks of a GPU run do (on
    the host CPU the profile would be the CPU's times, not the GPU's)."""
    from k3sched.tasks import LANE_OF, Kind, parse_task_id

    from runtime.local import local_run

    with _one_thread():
        run = local_run(_one_rank(cfg), steps, strategy="serial", device=_profile_device())
    spans: dict[str, list[float]] = {}
    for trace in run.traces[1:] or run.traces:
        for e in trace["traceEvents"]:
            if e.get("ph") == "X":
                kind = parse_task_id(e["name"]).kind
                if (LANE_OF[kind] == "compute" and kind is not Kind.OPTIM) or LANE_OF[kind] == "ep":
                    spans.setdefault(kind.value, []).append(float(e["dur"]))
    return {k: sig_digits(statistics.median(v)) for k, v in sorted(spans.items())}


def measure_routing(cfg, steps: int = 1) -> float:
    """The model's routing imbalance over the config's EP ranks ([Note: routing imbalance] in
    k3sched/balance.py): one in-process step of the same model at pp = ep = dp = 1 (the operator
    profile's layout, the config's seed and data), recording each dispatch's tokens per expert;
    the mean over the calls of max over mean per EP rank on the contiguous placement. 1.0 at
    ``parallel.ep`` 1 or without MoE layers."""
    from k3sched.balance import routing_imbalance

    from runtime.local import local_run

    ep = cfg.parallel.ep
    if ep <= 1 or not cfg.model.experts:
        return 1.0
    calls: list[list[int]] = []

    def record(runner) -> None:
        for block in runner.model.layers:
            if getattr(block, "is_moe", False):
                def dispatch_fwd(lc, group, _orig=block.dispatch_fwd, _block=block):
                    before = _block.routed_E.clone()
                    _orig(lc, group)
                    calls.append((_block.routed_E - before).tolist())
                block.dispatch_fwd = dispatch_fwd

    with _one_thread():
        local_run(_one_rank(cfg, parallel={"redundant_experts": 0}, schedule={"expert_placement": None}), steps,
                  strategy="serial", setup=record, device=_profile_device())
    return routing_imbalance(calls, ep)


def measure_ops_concurrent(cfg, copies: int, timeout_s: float = 300.0, work_dir: str | Path | None = None,
                           isolated: bool = False) -> dict[str, float]:
    """:func:`measure_ops` in ``copies`` processes at once (the ranks that share this node's
    cores in a run: measured alone, a task runs faster than beside another rank's compute, e.g. on
    SMT siblings or a shared memory bus); per kind, the median over the copies. ``isolated``: one
    copy also runs in its own process, as the copies do (one thread), not in this one."""
    if copies <= 1 and not isolated:
        return measure_ops(cfg)
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="k3sched_ops_") as tmp:
            return measure_ops_concurrent(cfg, copies, timeout_s, tmp, isolated)
    d = Path(work_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "ops_config.json").write_text(json.dumps(cfg.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}
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
    return {k: sig_digits(statistics.median(r[k] for r in runs)) for k in runs[0]}


def compute_alone_factor(cfg, copies: int, first: dict[str, float], timeout_s: float = 300.0,
                         work_dir: str | Path | None = None,
                         fewer: list[dict[str, float]] | None = None) -> tuple[float, dict[str, float]]:
    """``hardware.compute_alone_factor`` ([Note: compute alone] in k3sched/cpurunner.py): the
    operator profile measured by one process alone, against ``first`` (measured by ``copies`` at
    once) and the same measured again after it (the order both, one, both: a drift of the machine's
    speed that is linear over the three cancels); the sum over the kinds, at most 1. Returns it with
    the per-kind mean of the two measurements with every copy at once (the operator profile).
    ``fewer`` (a list, with a MoE model): also the profile with :func:`per_expert_point` experts,
    ``copies`` at once, just before and just after the one alone (centred like it), appended to it
    ([Note: per-expert cost] in k3sched/cost.py: :func:`per_expert_slopes`)."""
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="k3sched_ops_") as tmp:
            return compute_alone_factor(cfg, copies, first, timeout_s, tmp, fewer)
    sub = Path(work_dir)
    around = fewer is not None and per_expert_point(cfg) is not None
    if around:
        fewer.append(measure_fewer_experts(cfg, copies, timeout_s, sub / "fewer_a"))
    alone = measure_ops_concurrent(cfg, 1, timeout_s, sub / "alone", isolated=True)
    if around:
        fewer.append(measure_fewer_experts(cfg, copies, timeout_s, sub / "fewer_b"))
    again = measure_ops_concurrent(cfg, copies, timeout_s, sub / "again")
    both = {k: sig_digits((first[k] + again[k]) / 2) for k in first if k in again}
    kinds = [k for k in both if k in alone]
    factor = sum(alone[k] for k in kinds) / sum(both[k] for k in kinds) if kinds else 1.0
    return min(1.0, factor), both


def per_expert_point(cfg) -> int | None:
    """The expert count of the second operator profile ([Note: per-expert cost] in
    k3sched/cost.py): one EP rank's experts (``experts / ep``), half of them at ep 1; None when
    the model has no MoE layer or that many experts cannot hold ``top_k``."""
    m = cfg.model
    if not m.experts or m.layers <= m.dense_layers:
        return None
    fewer = m.experts // cfg.parallel.ep if cfg.parallel.ep > 1 else m.experts // 2
    return fewer if m.top_k <= fewer < m.experts else None


def measure_fewer_experts(cfg, copies: int, timeout_s: float = 300.0,
                          work_dir: str | Path | None = None) -> dict[str, float] | None:
    """The operator profile with :func:`per_expert_point` experts (the same tokens, top-k and every
    other shape; ``copies`` at once); None when there is no such point."""
    fewer = per_expert_point(cfg)
    if fewer is None:
        return None
    from k3sched.config import config_from_dict

    data = _one_rank(cfg, parallel={"redundant_experts": 0}, schedule={"expert_placement": None}).to_dict()
    data["model"] = {**data["model"], "experts": fewer}
    return measure_ops_concurrent(config_from_dict(data), copies, timeout_s, work_dir)


def per_expert_slopes(cfg, ops: dict[str, float], fewer: list[dict[str, float]]) -> dict[str, float]:
    """``per_expert_us`` of the profile ([Note: per-expert cost] in k3sched/cost.py): per expert
    kind, the slope of the line through ``ops`` (all ``model.experts``) and the mean of the
    ``fewer`` profiles (:func:`per_expert_point` experts), at least 0. {} without them."""
    point = per_expert_point(cfg)
    if point is None or not fewer:
        return {}
    n = cfg.model.experts - point
    return {k: sig_digits(max(0.0, (ops[k] - statistics.fmean(f[k] for f in fewer)) / n))
            for k in EXPERT_OPS if k in ops and all(k in f for f in fewer)}


def write_ops_profile(ops_us: dict[str, float], path: str | Path,
                      per_expert_us: dict[str, float] | None = None) -> Path:
    """The operator profile as a ``schedule.profile`` YAML (``durations_us``, ``overhead_us``, and
    ``per_expert_us`` when given: :func:`per_expert_slopes`)."""
    import yaml

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    from k3sched.tasks import LANE_OF, Kind

    compute = {k: v for k, v in ops_us.items() if LANE_OF[Kind(k)] == "compute"}
    overhead = {k: v for k, v in ops_us.items() if LANE_OF[Kind(k)] != "compute"}
    p.write_text("# k3sched probe: operator profile ([Note: operator profile] in runtime/probe/inprocess.py), µs per task "
                 f"on {'cuda:0' if _profile_device().type == 'cuda' else 'one core'};\n# overhead_us: the EP tasks' host-side work at ep 1 (the wire time comes on top)\n"
                 + yaml.safe_dump({"format": "k3sched.profile/1", "source": "k3sched probe", "durations_us": compute,
                                   "overhead_us": overhead,
                                   **({"per_expert_us": dict(per_expert_us)} if per_expert_us else {})},
                                  sort_keys=False))
    return p


def measure_pcie(device: torch.device, knobs: Knobs | None = None) -> dict[str, Any]:
    """Offload copies at ``knobs.copy_sizes``; returns ``{"fit": Fit, "direction": str, "points":
    {direction: [(bytes, µs)]}, "how": str}`` (on CUDA the slower direction's fit)."""
    knobs = knobs or Knobs()
    sync = sync_of(device)
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


def size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"



def ops_main(config_json: str, out: str) -> None:
    from k3sched.config import config_from_dict

    torch.set_num_threads(1)
    Path(out).write_text(json.dumps(measure_ops(config_from_dict(json.loads(Path(config_json).read_text())))))


def sig_digits(x: float, digits: int = 4) -> float:
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits}g}")
