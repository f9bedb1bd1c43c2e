"""Collectives over real process groups (``k3sched probe``): the torchrun launcher, the per-rank
worker (``python -m runtime.probe worker``) and the link numbers fitted from its timings; see
[Note: what the probe measures] in runtime/probe/__init__.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from runtime.launch import REPO, first_error, kill_group
from runtime.testbed import free_port
from runtime.options import LaunchEnv

KiB, MiB = 1 << 10, 1 << 20
from .inprocess import (COLL_SIZES, OPS, RESULT_FILE, Fit, KiB, MiB, ProbeError, bus_factor, fit_latency_bandwidth,
                        sync_of)

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
        cmd = [sys.executable, "-m", "runtime.launch", "--nnodes", "1", "--nproc-per-node", str(nproc),
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
                        work_dir: str | Path | None = None, device: str | None = None,
                        contended_s: float = 0.0, contended_reps: int = 3) -> dict[str, Any]:
    """Launch the collective probe on ``nproc`` ranks and return the ranks' result: ``{"world",
    "backend", "groups": {name: {"ranks": [...], "ops": {op: [{"bytes", "time_us", "algbw_gbps",
    "busbw_gbps", "iters", "samples_us"}]}}}}`` plus ``"fits": {group: {op: Fit}}`` (busbw fits).
    ``groups`` defaults to :func:`collective_groups` (one loopback group). ``testbed``: a
    :class:`runtime.testbed.Testbed` for ``nproc`` ranks, open (the caller closes it) or not yet
    started (opened around the launch; :class:`runtime.testbed.TestbedError` when refused).
    ``contended_s`` > 0 (CPU): also the contended measurement, ``contended_reps`` samples per size
    ([Note: what a call costs a computing thread]; a window in which fewer than two calls ended
    gives no sample and is run again, up to ``2 * contended_reps`` windows in all)."""
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
            str(min_s), "--timeout", str(max(10.0, timeout_s)), "--groups", json.dumps(groups), "--device", device,
            "--contended-s", str(contended_s), "--contended-reps", str(contended_reps)]
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

def _agreed(value: float, group, device: torch.device) -> float:
    """The largest ``value`` over the ranks of ``group``: every rank then loops the same
    count, or a time is the slowest rank's (on the device: NCCL reduces GPU tensors)."""
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def _worker_measure(group, ranks: list[int], rank: int, sizes: Sequence[int], reps: int, min_s: float,
                    device: torch.device) -> dict[str, list[dict]]:
    import torch.distributed as dist

    from moe.comm import all_to_all_rows

    n, me = len(ranks), ranks.index(rank)
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    sync = sync_of(device)
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
            one = _agreed(time.perf_counter() - t0, group, device)  # every rank loops the same count
            iters = int(min(1000, max(1, math.ceil(min_s / max(one, 1e-9)))))
            samples, cpu = [], []
            for _ in range(reps):
                dist.barrier(group=group)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(iters):
                    call()
                sync()
                cpu.append((time.process_time() - c0) / iters)
                samples.append(_agreed((time.perf_counter() - t0) / iters, group, device))  # the slowest rank
            t = statistics.median(samples)
            nbytes = numel * 4
            rows.append({"bytes": nbytes, "time_us": t * 1e6, "algbw_gbps": nbytes / t / 1e9,
                         "busbw_gbps": nbytes / t / 1e9 * bus_factor(op, n), "iters": iters,
                         "samples_us": [s * 1e6 for s in samples], "cpu_us": statistics.median(cpu) * 1e6})
        out[op] = rows
    return out


CONTENDED_SIZES = (16 * KiB, 256 * KiB, 1 * MiB)
"""All-to-all sizes of the contended measurement ([Note: what a call costs a computing thread])."""
IDLE_CALLS = 15
"""Calls timed alone per size in the contended measurement; their median is the call's time alone,
against which its time beside the GEMM loop gives ``comm_wait_us_per_call`` (:func:`comm_wait_fit`)."""
CHUNK_S = 0.005
"""Length of the GEMM-loop pieces whose spread the contended measurement also reports: about a
compute task of the testbed's models."""


def _worker_contended(group, ranks: list[int], rank: int, sizes: Sequence[int], window_s: float, reps: int,
                      device: torch.device) -> list[dict]:
    """[Note: what a call costs a computing thread] On the CPU runner a rank's lanes are threads on
    shared cores: while the EP or collective lane transfers, the compute lane loses CPU to gloo's
    threads, the kernel's TCP path and their wake-ups. The process CPU time of a transfer
    (``comm_cpu_ns_per_byte`` of the plain probe) misses part of that: softirq work charged to
    whichever process ran, context switches, the caches the compute thread then refills. This
    measures the loss where the planner uses it: every rank runs a fixed GEMM loop of about
    ``window_s`` once alone and once while a second thread runs back-to-back all-to-alls (as the EP
    lane does, ``moe.comm.all_to_all_rows``); the loop's extra time over the calls that completed in
    it is what one call of that size cost the computing thread. :func:`comm_cpu_fit` splits it into
    a per-call and a per-byte part over the sizes."""
    import threading

    import torch.distributed as dist

    from moe.comm import all_to_all_rows

    n = len(ranks)
    a, b = torch.randn(512, 256), torch.randn(256, 1024)

    def gemms(k: int, chunks: list[float] | None = None, every: int = 1) -> float:
        """``k`` GEMMs; with ``chunks``, the time of each run of ``every`` of them appended."""
        t0 = t = time.perf_counter()
        for i in range(k):
            torch.mm(a, b)
            if chunks is not None and (i + 1) % every == 0:
                now = time.perf_counter()
                chunks.append(now - t)
                t = now
        return time.perf_counter() - t0

    gemms(10)
    one = max(gemms(20) / 20, 1e-6)
    k = int(_agreed(max(1, window_s / one), group, device))
    per_chunk = max(1, round(CHUNK_S / one))  # task-sized pieces of the loop ([Note: task-time spread])
    rows = []
    for size in sizes:
        numel = max(n, size // 4 // n * n)
        x, y = torch.zeros(numel), torch.empty(numel)
        splits = [numel // n] * n

        def call(x=x, y=y, splits=splits):
            all_to_all_rows(y, x, splits, splits, group)

        call()
        dist.barrier(group=group)
        alone = []  # each call timed: one slow call among a few must not set the call's time alone
        for _ in range(IDLE_CALLS):
            t0 = time.perf_counter()
            call()
            alone.append(time.perf_counter() - t0)
        idle = _agreed(statistics.median(alone), group, device)
        stretch, per_call, chunks = [], [], []
        for _ in range(2 * reps):  # a window in which fewer than two calls ended is tried again
            if -_agreed(-len(stretch), group, device) >= reps:  # every rank has its samples
                break
            dist.barrier(group=group)
            alone = gemms(k)
            calls = int(_agreed(math.ceil(1.5 * alone / max(idle, 1e-6)) + 4, group, device))
            stamps: list[float] = []

            def loop(calls=calls, stamps=stamps, call=call):
                for _ in range(calls):
                    call()
                    stamps.append(time.perf_counter())

            dist.barrier(group=group)
            th = threading.Thread(target=loop, name="probe-comm", daemon=True)
            th.start()
            time.sleep(min(0.01, idle))  # the transfers are under way when the loop starts
            t0 = time.perf_counter()
            busy = gemms(k, chunks, per_chunk)
            t1 = t0 + busy
            th.join()
            done = [t for t in stamps if t0 <= t <= t1]
            if len(done) >= 2 and len(stretch) < reps:
                stretch.append((busy - alone) / len(done))
                per_call.append((done[-1] - done[0]) / (len(done) - 1))
        if stretch:
            rows.append({"bytes": numel * 4, "moved_bytes": 2 * numel * 4 * (n - 1) / n,
                         "stretch_us": statistics.median(stretch) * 1e6, "samples_us": [v * 1e6 for v in stretch],
                         "idle_call_us": idle * 1e6, "busy_call_us": statistics.median(per_call) * 1e6,
                         "chunk_cv": statistics.pstdev(chunks) / statistics.fmean(chunks) if len(chunks) > 1 else 0.0,
                         "chunks": len(chunks)})
    return rows


def task_time_cv_fit(coll: dict) -> float | None:
    """The spread (std / mean) of a task-sized piece of compute while all-to-alls run beside it: the
    median over the contended rows' ``chunk_cv`` of the first group that has them (``CHUNK_S`` pieces
    of the GEMM loop, [Note: what a call costs a computing thread]); the planner's
    ``hardware.task_time_cv`` ([Note: task-time spread] in k3sched/variability.py). None without
    contended rows."""
    for group in coll.get("groups", {}).values():
        rows = [r for r in group.get("contended") or [] if r.get("chunks", 0) > 1]
        if rows:
            return float(statistics.median(r["chunk_cv"] for r in rows))
    return None


def comm_wait_fit(coll: dict) -> float | None:
    """How much longer one all-to-all call takes while the rank computes beside it (µs): the median
    over the contended rows of the first group that has them of the call's time beside the GEMM
    loop less its time alone, at least 0; the planner's ``hardware.comm_wait_us_per_call`` ([Note: a
    transfer beside compute] in k3sched/cpurunner.py). None without contended rows."""
    for group in coll.get("groups", {}).values():
        rows = group.get("contended") or []
        if rows:
            return max(0.0, float(statistics.median(r["busy_call_us"] - r["idle_call_us"] for r in rows)))
    return None


def comm_cpu_fit(coll: dict) -> tuple[float, float] | None:
    """(ns per byte moved, µs per call) that concurrent all-to-alls cost a computing thread, from
    the contended rows of the first group that has them ([Note: what a call costs a computing
    thread]): a least-squares line through (bytes a rank sends plus receives, loop time lost per
    call), both parts at least 0. None without contended rows."""
    import numpy as np

    for group in coll.get("groups", {}).values():
        rows = group.get("contended") or []
        if len(rows) < 2:
            continue
        x = np.array([r["moved_bytes"] for r in rows], dtype=float)
        y = np.array([r["stretch_us"] for r in rows], dtype=float)
        slope, icpt = np.polyfit(x, y, 1)
        if slope < 0:
            return 0.0, max(0.0, float(np.median(y)))
        if icpt < 0:
            return max(0.0, float(np.sum(x * y) / np.sum(x * x)) * 1e3), 0.0
        return float(slope) * 1e3, float(icpt)
    return None


def worker_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.probe worker")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", required=True, help="comma-separated message sizes, bytes")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.005)
    ap.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    ap.add_argument("--groups", default=None, help='JSON {"name": [ranks]} (default: every rank)')
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--contended-s", type=float, default=0.0,
                    help="CPU: seconds of the GEMM loop of the contended measurement (0: none)")
    ap.add_argument("--contended-reps", type=int, default=3, help="samples per size of the contended measurement")
    a = ap.parse_args(list(argv))
    launch = LaunchEnv.from_env(os.environ)
    rank, world = launch.rank, launch.world
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        sizes = [int(s) for s in a.sizes.split(",") if s]
        spec = json.loads(a.groups) if a.groups else {"loopback": list(range(world))}
        timeout = timedelta(seconds=a.timeout)
        if a.device == "cuda":
            local = launch.local_rank
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
                if a.contended_s > 0 and device.type == "cpu":
                    result["groups"][name]["contended"] = _worker_contended(
                        handles[name], ranks, rank, CONTENDED_SIZES, a.contended_s, a.contended_reps, device)
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
