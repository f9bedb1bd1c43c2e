"""Launch a training run: ``run_command`` checks the config and the plan in-process, then starts
the ranks under torchrun and makes sure none outlives it.

- User errors (bad config, world size mismatch, infeasible budget, a plan using a task kind the
  runtime does not implement yet) print one line and return 2 before anything launches.
- The ranks run ``python -m torch.distributed.run --nproc-per-node N --master-addr 127.0.0.1
  --master-port FREE -m runtime.train CONFIG --out DIR ...`` in a new process group (session);
  gloo on CPU, NCCL with one GPU per rank when CUDA is present.
- When a rank fails, torchrun stops the others; ``run_command`` then prints the failing rank's
  one-line error (``error_rank{R}.txt``, the earliest) and returns 1. On timeout, Ctrl-C or any
  exit path, the whole process group of the launched torchrun is killed (SIGTERM, then SIGKILL).
- ``nsys=True`` wraps the launch in ``nsys profile --trace=nvtx`` (report in DIR/profile.*).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UNSUPPORTED_KINDS: dict[str, str] = {}  # task kind -> the option that emits it (none today)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)


def check_run(config_path: str | Path, overrides: list[str] | None, nproc: int | None, strategy: str | None):
    """Validate before launching; returns (cfg, plan doc) or raises ValueError (one line)."""
    from k3sched.config import ConfigError, load_config
    from k3sched.planner import InfeasibleBudget, plan
    from k3sched.render import plan_to_json
    from k3sched.simulator import DeadlockError

    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    world = cfg.parallel.world
    if nproc is not None and nproc != world:
        p = cfg.parallel
        raise ValueError(f"--nproc {nproc}: the config needs pp*ep*dp = {p.pp}*{p.ep}*{p.dp} = {world} ranks")
    try:
        doc = plan_to_json(plan(cfg, strategy))
    except (InfeasibleBudget, ConfigError, DeadlockError) as e:
        raise ValueError(str(e)) from None
    except ValueError as e:
        raise ValueError(f"schedule.pipeline: {e}") from None
    kinds = {t["kind"] for st in doc["stages"] for ts in st["lanes"].values() for t in ts}
    for k in sorted(kinds & UNSUPPORTED_KINDS.keys()):
        raise ValueError(f"{UNSUPPORTED_KINDS[k]}: the plan has {k} tasks, which the runtime does not execute yet; "
                         f"set {UNSUPPORTED_KINDS[k]}=false")
    return cfg, doc


def torchrun_command(config_path: str | Path, out_dir: Path, nproc: int, *, overrides: list[str] | None = None,
                     steps: int = 3, strategy: str | None = None, port: int | None = None,
                     extra: list[str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port or free_port()), "--max-restarts", "0",
           "-m", "runtime.train", str(config_path), "--out", str(out_dir), "--steps", str(steps)]
    for o in overrides or []:
        cmd += ["--set", o]
    if strategy:
        cmd += ["--strategy", strategy]
    return cmd + list(extra or [])


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group of ``proc`` (started with start_new_session), then SIGKILL."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(pgid):
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.05)
            else:
                time.sleep(0.05)
        if not _group_alive(pgid):
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def nsys_import(prefix: Path, timeout_s: float = 300.0) -> Path:
    """Turn ``PREFIX.qdstrm`` (nsys 2022.4 cannot import it itself) into ``PREFIX.nsys-rep`` and
    export ``PREFIX.sqlite``; returns the sqlite path. Raises RuntimeError (one line)."""
    import shutil

    from traces.nsys import QDSTRM_IMPORTER

    rep, qd, sql = (prefix.with_name(prefix.name + ext) for ext in (".nsys-rep", ".qdstrm", ".sqlite"))
    steps = []
    if not rep.exists():
        importer = QDSTRM_IMPORTER if Path(QDSTRM_IMPORTER).exists() else shutil.which("QdstrmImporter")
        if not qd.exists() or importer is None:
            raise RuntimeError(f"{prefix}: nsys left no {rep.name}, and {qd.name} or QdstrmImporter is missing")
        steps.append(("QdstrmImporter", [importer, "-i", str(qd)]))
    steps.append(("nsys export", ["nsys", "export", "--type", "sqlite", "--force-overwrite=true", "-o", str(sql),
                                  str(rep)]))
    for name, cmd in steps:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{prefix}: {name} failed (exit {p.returncode}): {last}")
    if not sql.exists():
        raise RuntimeError(f"{rep}: nsys export produced no {sql.name}")
    return sql


def first_error(out_dir: Path) -> str | None:
    """The earliest one-line rank error written under ``out_dir`` (the root cause, usually)."""
    lines = []
    for f in out_dir.glob("error_rank*.txt"):
        with contextlib.suppress(OSError, ValueError):
            ts, _, line = f.read_text().strip().partition(" ")
            lines.append((float(ts), line))
    return min(lines)[1] if lines else None


def run_command(config_path: str | Path, overrides: list[str] | None, steps: int, nproc: int | None,
                out_dir: str | Path, nsys: bool = False, strategy: str | None = None, *,
                timeout_s: float | None = None, extra_args: list[str] | None = None, env: dict | None = None,
                quiet: bool = False) -> int:
    """Run ``steps`` training steps of ``config_path`` on ``nproc`` local ranks (default: the
    config's pp*ep*dp). Returns 0 on success, 1 when a rank failed or the run timed out, 2 on a
    user error (nothing launched). Outputs land in ``out_dir`` (see :mod:`runtime.train`)."""
    out = Path(out_dir)
    try:
        cfg, _ = check_run(config_path, overrides, nproc, strategy)
    except ValueError as e:
        _err(str(e))
        return 2
    if steps < 1:
        _err(f"--steps: must be at least 1; got {steps}")
        return 2
    world = cfg.parallel.world
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("error_rank*.txt")) + list(out.glob("trace_rank*.json")):
        stale.unlink()
    cmd = torchrun_command(config_path, out, world, overrides=overrides, steps=steps, strategy=strategy,
                           extra=(["--quiet"] if quiet else []) + list(extra_args or []))
    if nsys:
        cmd = ["nsys", "profile", "--trace=nvtx", "--sample=none", "--cpuctxsw=none", "--force-overwrite=true",
               "-o", str(out / "profile")] + cmd
    run_env = {**os.environ, **(env or {})}
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), run_env.get("PYTHONPATH", "")] if p)
    run_env.setdefault("OMP_NUM_THREADS", "1")
    run_env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env, start_new_session=True)
    rc: int | None = None
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _err(f"run timed out after {timeout_s:.0f} s; stopped every rank")
        return 1
    except KeyboardInterrupt:
        _err("interrupted; stopped every rank")
        return 130
    finally:
        kill_group(proc)
    if rc == 0 and nsys:
        try:
            sql = nsys_import(out / "profile")
        except RuntimeError as e:
            _err(str(e))
            return 1
        if not quiet:
            print(f"wrote {sql} (NVTX ranges named by task id; `k3sched validate` reads it)", flush=True)
    if rc != 0:
        line = first_error(out)
        _err(line or f"torchrun exited with status {rc} (no rank reported an error; see the output above)")
        return 1
    if not quiet:
        print(f"wrote {out}/plan.json, {out}/summary.json, {world} trace file(s) trace_rank*.json", flush=True)
    return 0
