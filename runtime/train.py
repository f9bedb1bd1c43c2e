"""One training rank: ``python -m runtime.train CONFIG --out DIR [options]`` under a launcher.

Reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: set by
torchrun and by DeepSpeed's launcher alike), builds the PP x EP x DP groups ([Note: rank layout]
in :mod:`runtime.groups`), plans the step (every rank plans; the plans must be byte-identical;
rank 0 writes plan.json), builds its stage of the model, trains ``--steps`` steps with AdamW on
synthetic tokens and writes into DIR: ``plan.json``, ``trace_rank{R}.json`` (the last step),
with ``--trace-steps`` ``trace_steps_rank{R}.json`` (every step from the last warm-up step on),
``summary.json`` (rank 0). Rank 0 prints one progress line per step.

Failure: a rank that raises writes ``error_rank{R}.txt`` (one line, read by
:func:`runtime.launch.run_command`) and its traceback to ``rank{R}.log``, prints the line to stderr
and exits 1 at once; the launcher then stops the other ranks. Collectives time out after
``--timeout`` seconds (env K3SCHED_TIMEOUT_S, default 120). ``K3SCHED_FAIL_RANK=R`` makes rank R
fail in its first task (``K3SCHED_FAIL_TASK`` = a task id or kind picks another task;
``K3SCHED_FAIL_STEP`` = a global step index; ``K3SCHED_FAIL_SIGNAL=KILL``: SIGKILL itself; ``=HANG``: hang
in a receive nobody sends), for tests. ``K3SCHED_DETERMINISTIC=1``: ``torch.use_deterministic_algorithms``
(tests/conftest.py sets it on CUDA machines, for the bitwise comparisons). On GPU a failing rank aborts its NCCL communicators (bounded)
before it exits, never waiting on a collective whose peer may be dead.
Checkpoints and data: ``--save-every N`` / ``--save-mode`` / ``--resume DIR|latest``
(:mod:`runtime.checkpoint`), ``data.path`` (:mod:`runtime.data`).
Exit codes: 0 done, 1 a rank failed, 2 user error (bad config, world size mismatch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from runtime.steplog import StepLog, lane_busy, write_trace  # absolute: DeepSpeed runs this file as a script


class UserError(Exception):
    """A problem with the inputs: one line, exit 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m runtime.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="output directory (plan, traces, summary)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=1, metavar="N",
                    help="steps left out of measured_step_time_us (the median of the rest; all when none is left)")
    ap.add_argument("--trace-steps", action="store_true",
                    help="also write trace_steps_rank{R}.json: every step from the last warm-up step on "
                         "([Note: traces of the measured steps])")
    ap.add_argument("--strategy", choices=["k3", "serial"], default=None, help="default: schedule.strategy")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=None, help="model and data seed (default: schedule.seed)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="collective and dependency-wait timeout, seconds (default: env K3SCHED_TIMEOUT_S, else 120)")
    ap.add_argument("--save-every", type=int, default=0, metavar="N",
                    help="checkpoint every N steps into OUT/checkpoints/step_K, K = steps done (0: never)")
    ap.add_argument("--save-mode", choices=["async", "blocking"], default="async",
                    help="async: dcp.async_save, training goes on while it writes; blocking: dcp.save")
    ap.add_argument("--resume", default=None, metavar="DIR|latest",
                    help="continue from checkpoint DIR (latest: the newest complete one under OUT) up to --steps")
    ap.add_argument("--dump-grads", action="store_true", help="write grads_rank{R}.pt (step 0, before AdamW)")
    ap.add_argument("--dump-params", action="store_true", help="write params_rank{R}.pt (after the last step)")
    ap.add_argument("--offload-debug", action="store_true",
                    help="checksum every offloaded activation and verify it on onload (env K3SCHED_OFFLOAD_DEBUG=1)")
    ap.add_argument("--racecheck", action="store_true",
                    help="record which task touches each tensor; two tasks of a rank touching one, at least one "
                         "writing, with no happens-before path fail the run ([Note: race detector])")
    ap.add_argument("--drop-dep", dest="drop_deps", action="append", default=[], metavar="CONSUMER=PRODUCER",
                    help="debug: remove this dependency of the plan before running (repeatable)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--cpu", action="store_true", help="run on CPU with gloo even when CUDA is present")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="cuda: NCCL, one GPU per rank (LOCAL_RANK); cpu: gloo; auto: cuda when present")
    ap.add_argument("--p2p", choices=["buffered", "strict"], default="buffered",
                    help="strict: gloo P2P behaves like NCCL (a send completes once the receive is posted, one "
                         "stream per communicator; [Note: strict P2P] in runtime/stage/p2p.py); NCCL always is")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from runtime.options import LaunchEnv

    args = parse_args(argv)
    launch = LaunchEnv.from_env(os.environ)  # [Note: runtime options]
    rank = launch.rank
    _mark_rank(rank)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    stage = None
    from runtime.racecheck import MAX_LINES, RaceFound

    try:
        return _train(args, launch, out)
    except UserError as e:
        _report(out, rank, stage, f"error: {e}", None)
        _hard_exit(2)
    except RaceFound as e:  # [Note: race detector]: one line per race, exit 1
        more = e.lines[1:MAX_LINES] + ([f"... and {len(e.lines) - MAX_LINES} more"] if len(e.lines) > MAX_LINES else [])
        for line in more:
            print(f"k3sched rank {rank}: {line}", file=sys.stderr, flush=True)
        _report(out, rank, stage, f"rank {rank}: {e}", None)
        _hard_exit(1)
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line + exit 1
        cause = e
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        where = f"rank {rank}"
        _report(out, rank, stage, f"{where}: {msg if 'task ' in msg[:5] else type(e).__name__ + ': ' + msg}", cause)
        _abort_comms(args.timeout or 10.0)  # None: failed before _setup, no process group yet
        _hard_exit(1)
    return 1  # pragma: no cover


def _mark_rank(rank: int) -> None:
    """NVTX mark ``k3sched.rank=N``: names this process's rank in an nsys capture ([Note: nsys
    ranks] in traces/nsys.py). Through ``torch.cuda.nvtx`` without the nvtx package on CUDA
    ([Note: NVTX fallback] in runtime/executor.py); a no-op on CPU without it or without a profiler."""
    from runtime.executor import load_nvtx

    nvtx = load_nvtx()
    if nvtx is None:
        return
    nvtx.mark(message=f"k3sched.rank={rank}", domain="k3sched")


def _report(out: Path, rank: int, stage, line: str, exc: BaseException | None) -> None:
    try:
        (out / f"error_rank{rank}.txt").write_text(f"{time.time():.6f} {line}\n")
        if exc is not None:
            with open(out / f"rank{rank}.log", "a") as f:
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=f)
    except OSError:
        pass
    print(f"k3sched {line}", file=sys.stderr, flush=True)


def _abort_comms(timeout_s: float) -> None:
    """After a failure on GPU: abort the NCCL communicators instead of waiting for their work (a
    collective may wait on a dead peer forever; ``torch.cuda.synchronize`` would too). Runs in a
    daemon thread joined for at most ``min(timeout_s, 10)`` s; a no-op on gloo / without a group."""
    import threading

    def abort() -> None:
        try:
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_backend() != "nccl":
                return
            c10d = dist.distributed_c10d
            if hasattr(c10d, "_abort_process_group"):
                c10d._abort_process_group()  # every group's communicators, in one NCCL group call
            else:  # older torch
                import torch

                backend = c10d._get_default_group()._get_backend(torch.device("cuda"))
                if hasattr(backend, "abort"):
                    backend.abort()
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort: the process exits next anyway
            pass

    th = threading.Thread(target=abort, name="k3sched-abort", daemon=True)
    th.start()
    th.join(timeout=min(max(timeout_s, 1.0), 10.0))


def _hard_exit(code: int) -> None:
    """Exit now: lane threads may sit in a collective that will never finish."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and os.environ.get("NVTX_INJECTION64_PATH"):
        # Under Nsight Systems: its injection library flushes the last NVTX ranges from an atexit
        # handler, which os._exit skips (the run's tail went missing). libc exit() runs the C
        # atexit handlers without finalizing the interpreter; the lane threads are joined by now.
        import ctypes

        ctypes.CDLL(None).exit(code)
    os._exit(code)


def _checkpoint_setup(args: argparse.Namespace, cfg, runner, rank: int, world: int, out: Path, seed: int, opts):
    """Checkpoints and data of the run: the :class:`runtime.checkpoint.Checkpointer`, the global step
    to start from (the checkpoint's with ``--resume``, else 0) and the checkpoint resumed from; sets
    ``runner.data`` when ``data.path`` names a token file (at the checkpoint's data position)."""
    from runtime import checkpoint as ck
    from runtime.data import DataError, TokenData

    if args.save_every < 0:
        raise UserError(f"--save-every: must be 0 (never) or a number of steps >= 1; got {args.save_every}")
    if (args.save_every or args.resume) and not all(b.identity_slots for b in runner.model.layers
                                                    if getattr(b, "is_moe", False)):
        raise UserError("--save-every / --resume: checkpoints store experts by their contiguous EP slice; not "
                        "supported with redundant experts or an expert placement (parallel.redundant_experts, "
                        "schedule.expert_placement)")
    group = ck.make_group(timedelta(seconds=args.timeout)) if (args.save_every or args.resume) else None
    cp = ck.Checkpointer(runner, out=out, cfg=cfg, seed=seed, rank=rank, world=world, every=args.save_every,
                         mode=args.save_mode, group=group, kill_step=opts.ckpt_kill_step)
    start, doc, path = 0, None, None
    if args.resume:
        try:
            path, doc = ck.resolve_resume(args.resume, out, cfg, args.steps,
                                          files=rank == 0 and not opts.ckpt_verified)
            doc = cp.load(path)
        except ck.CheckpointError as e:
            raise UserError(str(e)) from None
        start = int(doc["step"])
    if runner.plan_steps > 1 and (args.save_every or args.resume or cfg.data.path):
        raise UserError(f"--save-every / --resume / data.path: {cfg.schedule.pipeline} runs on synthetic tokens "
                        f"without checkpoints (its second weight version is not saved); allowed: none of them")
    if cfg.data.path:
        lo, m = runner.groups.layout, cfg.model
        pos = int(doc["data"].get("position", 0)) if doc and doc["data"].get("kind") == "file" else 0
        try:
            runner.data = TokenData(cfg.data.path, cfg.data.dtype, vocab=m.vocab, seq_len=m.seq_len,
                                    batch=m.micro_batch_size, microbatches=cfg.parallel.microbatches,
                                    replicas=lo.ep * lo.dp, replica=lo.replica, position=pos)
        except DataError as e:
            raise UserError(str(e)) from None
    return cp, start, path


def _race_setup(args: argparse.Namespace, lanes, extra, stage: int):
    """``--drop-dep`` applied to this stage's lanes and runtime dependencies; returns (lanes,
    extra, the same-stage dependencies before the drops: the race detector's blame order)."""
    from runtime.racecheck import apply_drops, check_drops, parse_drop, same_stage_deps

    planned = same_stage_deps(lanes, extra, stage)
    try:
        mine = [d for d in args.drop_deps if parse_drop(d)[0].startswith(f"s{stage}/")]
        drops = check_drops(mine, planned)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not drops:
        return lanes, extra, planned
    lanes, extra = apply_drops(lanes, extra, drops)
    return lanes, extra, planned


def _run_step(ex, runner, rc, step: int, device):
    """One step (``ex.run_step`` then ``runner.end_step``); returns (record, loss contribution).
    With the race detector ``rc``: this rank's races raise :class:`runtime.racecheck.RaceFound`
    (also when the step failed and its accesses explain why); a rank without races of its own
    leaves with 1 when another rank found some."""
    if rc is None:
        record = ex.run_step(step)
        return record, runner.end_step()
    import torch
    import torch.distributed as dist

    from runtime.racecheck import RaceFound

    rc.begin_step(step)
    try:
        record = ex.run_step(step)
        contrib = runner.end_step()
    except BaseException as e:
        rep = rc.end_step(failed=True)
        if rep.races:
            raise RaceFound(rep.races) from e
        raise
    rep = rc.end_step()
    n = torch.tensor([len(rep.races)], dtype=torch.float64)
    if dist.is_initialized():
        n = n.to(device)
        dist.all_reduce(n)
    if rep.races:
        raise RaceFound(rep.races)
    if float(n):
        _hard_exit(1)  # another rank reports its races
    return record, contrib


@dataclass(frozen=True)
class _Setup:
    """What :func:`_setup` made of the arguments and the environment."""

    opts: object  # runtime.options.RuntimeOptions
    cfg: object  # k3sched.config.Config
    seed: int
    device: object  # torch.device
    use_cuda: bool
    timeout: timedelta


def _setup(args: argparse.Namespace, launch) -> _Setup:
    """Runtime options, config, seed, device and the default process group; ``args.timeout`` set
    when ``--timeout`` was not given."""
    import torch
    import torch.distributed as dist

    from runtime.options import RuntimeOptions

    try:
        opts = RuntimeOptions.from_env(os.environ, launch.rank)  # [Note: runtime options]: the only read
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.timeout is None:
        args.timeout = 120.0 if opts.timeout_s is None else opts.timeout_s
    if args.offload_debug:
        opts = replace(opts, offload_debug=True)
    if opts.stacks_after_s is not None:  # debugging aid: dump every thread's stack once
        import faulthandler

        faulthandler.dump_traceback_later(opts.stacks_after_s, exit=False)

    from k3sched.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        raise UserError(str(e)) from None
    p = cfg.parallel
    if p.world != launch.world:
        raise UserError(f"{args.config}: parallel pp*ep*dp = {p.pp}*{p.ep}*{p.dp} = {p.world} ranks, but the launcher "
                        f"started WORLD_SIZE={launch.world}")
    seed = cfg.schedule.seed if args.seed is None else args.seed
    torch.manual_seed(seed)
    if opts.deterministic:  # bitwise comparisons in tests (on CUDA)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU)")
    use_cuda = torch.cuda.is_available() and not args.cpu and args.device != "cpu"
    local_rank = launch.local_rank
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=args.timeout)
    if launch.world > 1 or launch.master_addr:
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=launch.rank, world_size=launch.world,
                                timeout=timeout, **({"device_id": device} if use_cuda else {}))
    return _Setup(opts, cfg, seed, device, use_cuda, timeout)


def _checked_plan(args: argparse.Namespace, cfg, rank: int, out: Path) -> dict:
    """Plan the step; every rank's plan must be byte-identical and NCCL-safe; rank 0 writes plan.json."""
    from k3sched.config import ConfigError
    from k3sched.p2pcheck import P2PDeadlock, check_p2p_transfers
    from k3sched.limits import InfeasibleBudget
    from k3sched.planfile import plan_to_json
    from k3sched.planner import plan

    from runtime.groups import verify_same_plan

    try:
        the_plan = plan(cfg, args.strategy)
    except (InfeasibleBudget, ConfigError) as e:
        raise UserError(str(e)) from None
    doc = plan_to_json(the_plan)
    plan_bytes = json.dumps(doc, indent=1).encode()
    verify_same_plan(plan_bytes)
    try:
        check_p2p_transfers(doc)  # [Note: NCCL P2P model]
    except P2PDeadlock as e:
        raise UserError(str(e)) from None
    if rank == 0:
        (out / "plan.json").write_bytes(plan_bytes)
    return doc


def _build_runner(args: argparse.Namespace, s: _Setup, doc: dict, groups):
    """(spec, lanes, runner) of this rank's stage: its P2P and remote groups built and warmed up,
    the runner bound to the plan, fault injection set (from ``s.opts``)."""
    from k3sched.lowering import stage_lanes
    from runtime.groups import build_mirror_groups, build_p2p_groups, p2p_edges, warm_up_p2p
    from runtime.stage import StageRunner, StageSpec, build_remote_group

    stage = groups.layout.pp_idx
    spec = StageSpec.of(s.cfg, stage)
    lanes = stage_lanes(doc, stage)
    remote_group = build_remote_group(groups, doc, timeout=s.timeout)
    strict = args.p2p == "strict" and not s.use_cuda  # NCCL is strict by itself
    build_p2p_groups(groups, p2p_edges(spec.vstage_rank), ready=strict, timeout=s.timeout)
    if spec.copies == 2:  # [Note: replica gradient reduction] in runtime/stage/gradients.py
        build_mirror_groups(groups, timeout=s.timeout)
    warm_up_p2p(groups, args.timeout, s.device)  # [Note: NCCL-safe P2P]
    runner = StageRunner(s.cfg, spec, groups, seed=s.seed, lr=args.lr, weight_decay=args.weight_decay,
                         device=s.device, options=s.opts, remote_group=remote_group,
                         p2p="strict" if strict else "buffered", p2p_timeout_s=args.timeout)
    runner.bind_plan(lanes)
    return spec, lanes, runner


def _build_executor(args: argparse.Namespace, s: _Setup, doc: dict, groups, spec, lanes, runner):
    """(executor, race checker or None): the lane orders checked against the peers', the plan's
    lanes perturbed and race-checked as asked."""
    from k3sched.lowering import implied_edges, lower_stage
    from runtime.executor import Executor, perturb_lanes
    from runtime.groups import verify_orders
    from runtime.stage import verify_remote_orders

    opts, rank, stage = s.opts, groups.layout.rank, groups.layout.pp_idx
    perturbed = perturb_lanes(lanes, *opts.perturb) if opts.perturb else None  # before the check: it must see it
    verify_orders(groups, lanes, spec.p2p_peer, stage)
    verify_remote_orders(groups, lanes, stage)
    lanes, extra, planned_deps = _race_setup(args, lanes, implied_edges(lanes), stage)
    ex = Executor(lower_stage(doc, stage, lanes, extra), runner.handlers(), rank=rank, device=s.device,
                  dep_timeout_s=args.timeout)  # [Note: lowering]: the lanes as changed, the plan's tokens
    ex.perturbed = perturbed
    rc = None
    if args.racecheck:  # [Note: race detector]
        from runtime.racecheck import RaceChecker

        rc = ex.racecheck = RaceChecker.for_executor(ex, planned_deps)
        rc.install()
    return ex, rc


def _run_steps(args: argparse.Namespace, ex, runner, rc, ckpt, first_step: int, out: Path, device, rank: int,
               progress) -> StepLog:
    """Steps ``first_step`` .. ``--steps``: run each, sum the loss over ranks, checkpoint when due;
    ``progress(step, loss, dt)`` prints the step's line (rank 0)."""
    import torch
    import torch.distributed as dist

    p = runner.cfg.parallel
    M, R = p.microbatches, p.ep * p.dp
    log = StepLog()
    for step in range(first_step, args.steps):
        t_wall = time.perf_counter()
        if dist.is_initialized():
            dist.barrier()
        runner.optim.capture_grads = args.dump_grads and step == first_step
        runner.begin_step(step)
        log.record, contrib = _run_step(ex, runner, rc, step, device)
        if getattr(args, "trace_steps", False) and step - first_step >= args.warmup_steps - 1:
            log.records.append(log.record)
        log.routed.append(runner.routing_counts())
        if runner.optim.captured is not None:
            torch.save(runner.optim.captured, out / f"grads_rank{rank}.pt")
            runner.optim.captured = None
        # pipedream-2bw: one plan run is two training steps, each with its loss
        loss_t = torch.tensor(runner.step_contribs if runner.plan_steps > 1 else [contrib], dtype=torch.float64)
        time_t = torch.tensor([log.record.wall_s], dtype=torch.float64)
        if dist.is_initialized():
            loss_t, time_t = loss_t.to(device), time_t.to(device)
            # every rank's contribution, summed exactly (fsum: the same whatever rank holds which
            # coordinate, so parallel.order changes no reported loss)
            parts = [torch.zeros_like(loss_t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, loss_t)
            loss_t = torch.tensor([math.fsum(float(x[i]) for x in parts) for i in range(len(loss_t))],
                                  dtype=torch.float64)
            dist.all_reduce(time_t, op=dist.ReduceOp.MAX)
        log.busy.append(lane_busy(log.record, device))
        losses, dt = [float(x) / (M * R) for x in loss_t], float(time_t)
        loss = losses[-1]
        log.losses.extend(losses)
        log.times.append(dt)
        log.peaks.append(runner.memory.peak_device)
        progress(step, loss, dt)
        if runner.data is not None:
            runner.data.advance()
        if ckpt.due(step + 1):
            from runtime.data import synthetic_state

            ckpt.save(step + 1, runner.data.state() if runner.data is not None else synthetic_state(step + 1))
        log.walls.append(time.perf_counter() - t_wall)
    return log


def _gather_totals(runner, rc, ckpt, log: StepLog, first_step: int, rank: int, world: int, device):
    """Every rank: (peak device / host / peer bytes of each rank, race counts, routing summary,
    longest blocking checkpoint time over ranks)."""
    import torch
    import torch.distributed as dist

    mem = torch.tensor(runner.memory.totals(), dtype=torch.float64)  # device, host, peer, allocated, ...
    mems = [mem]
    if dist.is_initialized():
        mems = [torch.zeros_like(mem).to(device) for _ in range(world)]
        dist.all_gather(mems, mem.to(device))
    mems = [[int(x) for x in m.cpu().tolist()] for m in mems]
    from runtime.summaries import race_totals, routing_summary

    race_doc = race_totals(rc, rank, device)
    routing_doc = routing_summary(runner.cfg, runner, log.routed,
                                  list(range(first_step, first_step + len(log.routed))), device)
    ckpt_s = torch.tensor([ckpt.summary()["blocking_s"]], dtype=torch.float64)
    if dist.is_initialized():
        ckpt_s = ckpt_s.to(device)
        dist.all_reduce(ckpt_s, op=dist.ReduceOp.MAX)
    return mems, race_doc, routing_doc, float(ckpt_s)


def steady_step_s(times: list[float], warmup_steps: int) -> float:
    """The measured step of a run: the median (the upper one of an even count) of the step times
    after the first ``warmup_steps`` (TCP windows, the allocator and caches still settle there), of
    all of them when no step is left; 0 without steps."""
    steady = sorted(times[warmup_steps:] or times)
    return steady[len(steady) // 2] if steady else 0.0


def _summary(args: argparse.Namespace, s: _Setup, doc: dict, world: int, ex, runner, ckpt, log: StepLog,
             totals, first_step: int, resumed_from) -> dict:
    """summary.json (rank 0)."""
    from runtime.groups import Layout

    p, cfg = s.cfg.parallel, s.cfg
    mems, race_doc, routing_doc, ckpt_s = totals
    M, R, times = p.microbatches, p.ep * p.dp, log.times
    tokens_per_step = M * R * cfg.model.micro_batch_size * cfg.model.seq_len
    predicted_us = float(doc["metrics"]["step_time_us"])
    measured = steady_step_s(times, args.warmup_steps)
    summary = {
        "format": "k3sched.run/1", "config": str(args.config), "overrides": args.overrides,
        "strategy": doc["strategy"], "pipeline": doc["pipeline"], "world": world, "device": s.device.type,
        "pp": p.pp, "dp": p.dp, "ep": p.ep, "microbatches": M, "steps": args.steps, "seed": s.seed, "lr": args.lr,
        "losses": log.losses, "step_time_s": times, "tokens_per_step": tokens_per_step,
        "tokens_per_s": [tokens_per_step / t for t in times],
        "predicted_step_time_us": predicted_us, "measured_step_time_us": measured * 1e6,
        "measured_over_predicted": (measured * 1e6 / predicted_us) if predicted_us else None,
        **_expected_fields(doc, measured * 1e6),
        "perturbed": list(ex.perturbed) if ex.perturbed else None, "p2p": args.p2p,
        "budget_bytes": doc["metrics"].get("budget_bytes"),
        "peak_device_bytes_planned": doc["metrics"]["peak_device_bytes"],
        "peak_device_bytes_measured": [m[0] for m in mems],
        "peak_host_bytes_measured": [m[1] for m in mems],
        "peak_peer_bytes_measured": [m[2] for m in mems],
        **runner.memory.summary_fields(mems),
        "stage_of_rank": [Layout(p.pp, p.dp, p.ep, r, p.order).pp_idx for r in range(world)],
        "offloaded_sets": doc["metrics"].get("offloaded_sets"),
        "racecheck": race_doc, "warmup_steps": args.warmup_steps, "first_step": first_step,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "step_wall_s": log.walls, **_busy_fields(doc, log.busy), "checkpoint_s": ckpt_s, "checkpoint": ckpt.summary(),
        "data": runner.data.state() if runner.data is not None else {"kind": "synthetic"},
    }
    if routing_doc is not None:
        summary["routing"] = routing_doc
    return summary


def _busy_fields(doc: dict, busy: list[list[list[float]]]) -> dict:
    """``lane_busy_s`` (per lane that has tasks: per rank, per step, the seconds its tasks ran),
    ``lane_busy_planned_s`` (per lane: per stage, the plan's sum of task durations) and
    ``comm_overlap_ratio`` (per rank, per step: the share of its communication lanes' time its
    compute overlapped; None in a step without communication)."""
    from k3sched.tasks import LANES

    planned = {lane: [sum(t["end_us"] - t["start_us"] for t in st["lanes"].get(lane, ())) / 1e6
                      for st in doc["stages"]] for lane in LANES}
    used = [i for i, lane in enumerate(LANES) if any(planned[lane]) or any(r[i] for b in busy for r in b)]
    ranks = len(busy[0]) if busy else 0
    n = len(LANES)
    return {"lane_busy_s": {LANES[i]: [[b[r][i] for b in busy] for r in range(ranks)] for i in used},
            "lane_busy_planned_s": {LANES[i]: planned[LANES[i]] for i in used},
            "comm_overlap_ratio": [[b[r][n + 1] / b[r][n] if b[r][n] > 0 else None for b in busy]
                                   for r in range(ranks)]}


def _expected_fields(doc: dict, measured_us: float) -> dict:
    """The plan's expected step under its task-time spread, when it has one ([Note: task-time
    spread] in k3sched/variability.py), and the measured step over it."""
    from k3sched.planfile import PlanMetrics

    exp = PlanMetrics.model_construct(**doc["metrics"]).expected_step_us  # the planner's own, as planned here
    if not exp:
        return {}
    return {"expected_step_time_us": float(exp), "measured_over_expected": measured_us / float(exp)}


def _print_totals(console, cfg, doc: dict, times: list[float], totals, memory, warmup_steps: int = 1) -> None:
    """Rank 0's closing lines: measured against predicted step time and peak memory, routing imbalance."""
    from runtime.groups import Layout

    p = cfg.parallel
    mems, _, routing_doc, _ = totals
    predicted_us = float(doc["metrics"]["step_time_us"])
    med_us = steady_step_s(times, warmup_steps) * 1e6
    first = warmup_steps + 1 if len(times) > warmup_steps else 1
    console.print(f"step time: measured {med_us / 1e3:.1f} ms (median of steps {first}.."
                  f"{len(times)}), predicted {predicted_us / 1e3:.1f} ms, measured/predicted "
                  f"{med_us / predicted_us if predicted_us else float('nan'):.3f}")
    exp = _expected_fields(doc, med_us)
    if exp:
        console.print(f"expected with the task-time spread (cv {doc['metrics']['expected']['task_time_cv']:g}, "
                      f"{doc['metrics']['expected']['samples']} replays): {exp['expected_step_time_us'] / 1e3:.1f} ms, "
                      f"measured/expected {exp['measured_over_expected']:.3f}")
    planned = doc["metrics"]["peak_device_bytes"]
    console.print("peak device memory per rank, measured / planned (MiB): " + ", ".join(
        f"r{r} {m[0] / 2**20:.2f}/{planned[Layout(p.pp, p.dp, p.ep, r, p.order).pp_idx] / 2**20:.2f}"
        for r, m in enumerate(mems)))
    console.print(memory.closing_line(mems))  # allocated / tracked / untracked bytes per rank
    if routing_doc is not None:
        console.print(f"routing imbalance (max / mean tokens per EP rank, mean over steps and MoE layers): "
                      f"{routing_doc['imbalance_mean']:.3f} (on the contiguous placement: "
                      f"{routing_doc['imbalance_contiguous_mean']:.3f})")


def _train(args: argparse.Namespace, launch, out: Path) -> int:
    """setup, plan and its checks, the stage runner, checkpoints, the step loop, the outputs."""
    import torch
    import torch.distributed as dist

    from runtime.groups import Layout, build_groups

    rank, world = launch.rank, launch.world
    s = _setup(args, launch)
    cfg, p, device = s.cfg, s.cfg.parallel, s.device
    lo = Layout(p.pp, p.dp, p.ep, rank, p.order)
    groups = build_groups(lo, timeout=s.timeout)
    doc = _checked_plan(args, cfg, rank, out)
    stage = lo.pp_idx
    spec, lanes, runner = _build_runner(args, s, doc, groups)
    ckpt, first_step, resumed_from = _checkpoint_setup(args, cfg, runner, rank, world, out, s.seed, s.opts)
    ex, rc = _build_executor(args, s, doc, groups, spec, lanes, runner)
    tokens_per_step = p.microbatches * p.ep * p.dp * cfg.model.micro_batch_size * cfg.model.seq_len
    predicted_us = float(doc["metrics"]["step_time_us"])
    show = rank == 0 and not args.quiet
    console = None
    if show:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True)
        console.print(f"k3sched run: {args.config} | {doc['strategy']} plan, {doc['pipeline']} | world {world} "
                      f"(pp {p.pp} x dp {p.dp} x ep {p.ep}) | {device.type} | predicted step "
                      f"{predicted_us / 1e3:.1f} ms")
    runner.bind_streams(ex.lane_streams())
    planned_peak = doc["metrics"]["peak_device_bytes"][stage]

    def progress(step: int, loss: float, dt: float) -> None:
        if console is not None:
            console.print(f"step {step + 1}/{args.steps}  loss {loss:.6f}  step {dt * 1e3:8.1f} ms  "
                          f"{tokens_per_step / dt:10,.0f} tok/s  peak device {runner.memory.peak_device / 2**20:.2f} "
                          f"MiB (plan {planned_peak / 2**20:.2f} MiB, stage {stage})")

    try:
        log = _run_steps(args, ex, runner, rc, ckpt, first_step, out, device, rank, progress)
        ckpt.wait()  # the last asynchronous save completes before the run ends
        write_trace(ex, runner, log, rank, out, device, predicted_us, planned_peak)
    finally:
        ex.close()
    if args.dump_params:
        torch.save({n: q.detach().cpu().clone() for n, q in runner.model.named_parameters()}, out / f"params_rank{rank}.pt")
    totals = _gather_totals(runner, rc, ckpt, log, first_step, rank, world, device)
    if rank == 0:
        summary = _summary(args, s, doc, world, ex, runner, ckpt, log, totals, first_step, resumed_from)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if show:
        _print_totals(console, cfg, doc, log.times, totals, runner.memory, args.warmup_steps)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if not __package__:  # run as a file (``deepspeed runtime/train.py ...``): make the packages importable
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    code = main()
    # Outputs are written and the process group is destroyed: leave without interpreter teardown,
    # where a gloo thread's destructor racing the lane threads (daemons) occasionally aborted a
    # rank ("terminate called without an active exception") after a successful run.
    _hard_exit(code)
