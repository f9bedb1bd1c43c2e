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

from runtime.launch import REPO, first_error, free_port, kill_group

KiB, MiB = 1 << 10, 1 << 20
from .inprocess import COLL_SIZES, OPS, RESULT_FILE, Fit, KiB, MiB, ProbeError, _sync_of, bus_factor, fit_latency_bandwidth

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
