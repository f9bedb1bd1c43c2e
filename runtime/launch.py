"""Launch a training run: ``run_command`` checks the config and the plan in-process, then starts
the ranks under torchrun and makes sure none outlives it.

- User errors (bad config, world size mismatch, infeasible budget, a plan using a task kind the
  runtime does not implement yet) print one line and return 2 before anything launches.
- The ranks run ``python -m runtime.launch --nproc-per-node N --master-addr 127.0.0.1
  --master-port FREE -m runtime.train CONFIG --out DIR ...`` (torchrun, :func:`torchrun_main`;
  every torchrun of the project goes through it) in a new process group (session);
  gloo on CPU, NCCL with one GPU per rank when CUDA is present. ``device`` (``k3sched run
  --device``): ``cuda`` needs a GPU per rank (else one line and 2), ``cpu`` forces gloo, None picks
  cuda when every rank has its own GPU, else cpu (:func:`resolve_device`). A GPU run's environment
  (:func:`gpu_env`) turns on NCCL's flight recorder and error handling and pins
  CUDA_DEVICE_MAX_CONNECTIONS ([Note: GPU run environment]).
- Every wait of a rank (start-up, dependencies, collectives, a task stuck in one, the end of a
  step, the abort) is bounded by the ranks' ``--timeout`` (env K3SCHED_TIMEOUT_S, default 120 s;
  with a whole-run ``timeout_s`` and no K3SCHED_TIMEOUT_S: half of it, at most 120 s), so a rank
  names its own stuck task before the launcher's limit runs out.
- When a rank fails, torchrun stops the others; ``run_command`` then prints the failing rank's
  one-line error (``error_rank{R}.txt``, the earliest) and returns 1 (2 when that error is a user
  error: bad checkpoint or token file found by a rank). A rank that died without a word (SIGKILL,
  the OOM killer, a crash) is named from torchrun's own record of its workers' exit codes
  (:func:`torchrun_main` runs torchrun and writes ``rank_failures.json``): that line comes first.
- Checkpoints and data (``save_every``, ``save_mode``, ``resume``, ``data.path``) are checked
  before launching (:func:`runtime.checkpoint.launch_args`): a missing, incomplete or corrupt
  checkpoint, one of another model shape, an unreadable token file or one with ids past the
  vocabulary is one line and 2. On timeout, Ctrl-C or any
  exit path, the whole process group of the launched torchrun is killed (SIGTERM, then SIGKILL).
- ``nsys=True`` runs the launch under Nsight Systems through :func:`traces.nsys.record` (``nsys
  profile --trace=nvtx``, plus ``cuda`` with CUDA; nsys 2022.4 workarounds: QdstrmImporter, agent
  kill, a hung capture killed and retried once), exports ``DIR/profile.sqlite``, validates it
  against ``DIR/plan.json`` (ranks share the host clock: cross-rank dependencies are compared),
  prints the verdict and writes ``DIR/validation.json``; a trace that does not conform returns 1.
- ``emulate_links=True`` runs torchrun and the ranks inside the shaped-link testbed
  (:mod:`runtime.testbed`: one network namespace per rank, NIC rates from the config's hardware),
  deleted again on every exit path; when it cannot be set up (not root, no ``ip`` / ``tc``,
  namespaces refused) one line and 2, nothing launched. Not combinable with ``nsys``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3sched.pipelines import TABLE as PIPELINE_TABLE

from .options import FAILURES_ENV, TIMEOUT_ENV, RuntimeOptions
from .testbed import free_port

REPO = Path(__file__).resolve().parents[1]
UNSUPPORTED_KINDS: dict[str, str] = {}  # task kind -> the option that emits it (none today)


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)


def resolve_device(device: str | None, world: int) -> str:
    """``cpu`` or ``cuda`` for a run of ``world`` local ranks; raises ValueError (one line) when
    ``cuda`` is asked for and there are fewer GPUs than ranks. None: cuda when every rank has its
    own GPU, else cpu."""
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device: must be cpu or cuda; got {device!r}")
    if device == "cpu":
        return "cpu"
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover
        gpus = 0
    if device is None:
        return "cuda" if gpus >= world else "cpu"
    if gpus < world:
        raise ValueError(f"--device cuda: the config needs {world} ranks, one GPU each, but this machine has "
                         f"{gpus} GPU(s) visible to torch; use --device cpu or a smaller pp*ep*dp")
    return "cuda"


# [Note: GPU run environment]
# A GPU run's ranks get (unless the caller's environment sets them already):
# - TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and TORCH_NCCL_DUMP_ON_TIMEOUT=1: NCCL's flight recorder keeps
#   the last collectives of each communicator and dumps them on a timeout, to
#   OUT/nccl_trace_rank_R (TORCH_NCCL_DEBUG_INFO_TEMP_FILE), to see which collective hung where.
# - TORCH_NCCL_ASYNC_ERROR_HANDLING=1: the watchdog aborts a communicator whose operation timed out
#   (the group's timeout is the ranks' --timeout) and tears the rank down, so a collective waiting
#   on a dead peer ends. TORCH_NCCL_BLOCKING_WAIT stays off: it would make every lane's host
#   thread wait for its collective's completion, serialising the issue of the lanes' GPU work;
#   the executor polls events with a deadline instead (runtime/executor.py).
# - CUDA_DEVICE_MAX_CONNECTIONS=16. Megatron pins 1 so kernels reach the GPU in issue order (its
#   compute and communication overlap relies on that order on few streams). The five lanes are
#   five streams, plus the current stream and NCCL's internal stream per communicator (EP, PP
#   send/recv per direction, DP, remote offload), that must run concurrently and are ordered by
#   CUDA events only: with one hardware queue, a lane's event wait or a collective waiting for
#   its peer would block every later kernel of every other lane behind it (false dependencies,
#   no overlap). 16 gives each of those streams its own queue (the CUDA default is 8, max 32).
NCCL_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "16"}


def gpu_env(out: Path) -> dict:
    """The environment a GPU run's ranks get on top of the caller's ([Note: GPU run environment])."""
    return {**NCCL_ENV, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(out).resolve() / "nccl_trace_rank_")}


# Schedules the planner plans but the runtime does not execute, and why (one line each; [Note: schedule
# registry] in k3sched/pipelines.py).
PLANNED_ONLY = {n: p.planned_only for n, p in PIPELINE_TABLE.items() if p.planned_only}


def check_run(config_path: str | Path, overrides: list[str] | None, nproc: int | None, strategy: str | None):
    """Validate before launching; returns (cfg, plan doc) or raises ValueError (one line)."""
    from k3sched.config import ConfigError, load_config
    from k3sched.limits import InfeasibleBudget
    from k3sched.p2pcheck import P2PDeadlock, check_p2p_transfers
    from k3sched.planfile import plan_to_json
    from k3sched.planner import plan
    from k3sched.simulator import DeadlockError

    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if cfg.schedule.pipeline in PLANNED_ONLY:
        raise ValueError(f"schedule.pipeline: {cfg.schedule.pipeline} {PLANNED_ONLY[cfg.schedule.pipeline]}")
    if PIPELINE_TABLE[cfg.schedule.pipeline].copies == 2 and cfg.schedule.grad_offload:
        raise ValueError(f"schedule.grad_offload: {cfg.schedule.pipeline} sums its two model copies' gradients on the "
                         "device (grad.mirror), the host shards do not; set schedule.grad_offload false")
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
    try:
        check_p2p_transfers(doc)  # [Note: NCCL P2P model]: a plan that would hang under NCCL is refused
    except P2PDeadlock as e:
        raise ValueError(str(e)) from None
    kinds = {t["kind"] for st in doc["stages"] for ts in st["lanes"].values() for t in ts}
    for k in sorted(kinds & UNSUPPORTED_KINDS.keys()):
        raise ValueError(f"{UNSUPPORTED_KINDS[k]}: the plan has {k} tasks, which the runtime does not execute yet; "
                         f"set {UNSUPPORTED_KINDS[k]}=false")
    return cfg, doc


def torchrun_command(config_path: str | Path, out_dir: Path, nproc: int, *, overrides: list[str] | None = None,
                     steps: int = 3, strategy: str | None = None, port: int | None = None,
                     extra: list[str] | None = None, testbed=None) -> list[str]:
    """The torchrun command of a local run; with ``testbed`` (a :class:`runtime.testbed.Testbed`)
    torchrun runs in its hub namespace and each rank in its own rank namespace."""
    train = [str(config_path), "--out", str(out_dir), "--steps", str(steps)]
    for o in overrides or []:
        train += ["--set", o]
    if strategy:
        train += ["--strategy", strategy]
    train += list(extra or [])
    if testbed is not None:
        return testbed.torchrun_command([sys.executable, "-m", "runtime.train", *train], port=port, nproc=nproc)
    return [sys.executable, "-m", "runtime.launch", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port or free_port()), "--max-restarts", "0",
            "-m", "runtime.train", *train]


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


NSYS_OPTIONS = ("--sample=none", "--cpuctxsw=none")
NSYS_TOLERANCE_US = 50.0


def nsys_trace_kinds() -> str:
    """``nvtx``, plus ``cuda`` when CUDA is present (kernels and copies under the NVTX ranges)."""
    try:
        import torch

        return "nvtx,cuda" if torch.cuda.is_available() else "nvtx"
    except ImportError:  # pragma: no cover
        return "nvtx"


def nsys_validate(out: Path, quiet: bool = False) -> int:
    """Validate ``out/profile.sqlite`` against ``out/plan.json`` (cross-rank clocks: one host);
    print the verdict, write ``out/validation.json``. Returns 0 conforms, 1 does not, 2 unreadable."""
    import io

    from traces.cli import validate_main

    buf = io.StringIO()
    code = validate_main(str(out / "plan.json"), [str(out / "profile.sqlite")], json_out=str(out / "validation.json"),
                         tolerance_us=NSYS_TOLERANCE_US, cross_rank_clocks=True, out=buf)
    text = buf.getvalue()
    if not quiet:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
    elif text:
        print(text.splitlines()[0], flush=True)  # the verdict line
    return code


def first_error(out_dir: Path) -> str | None:
    """The earliest one-line rank error written under ``out_dir`` (the root cause, usually)."""
    lines = []
    for f in out_dir.glob("error_rank*.txt"):
        with contextlib.suppress(OSError, ValueError):
            ts, _, line = f.read_text().strip().partition(" ")
            lines.append((float(ts), line))
    return min(lines)[1] if lines else None


FAILURES_FILE = "rank_failures.json"


def lost_rank(out_dir: Path) -> str | None:
    """One line naming a rank that torchrun saw die by a signal (it wrote no error of its own), or
    None. SIGTERM is what torchrun sends the other ranks when it stops them, so it names no
    cause; of several, the earliest, then the lowest rank."""
    import json

    try:
        doc = json.loads((Path(out_dir) / FAILURES_FILE).read_text())
        # torchrun stops the other ranks with SIGTERM (recorded as failures too): not a cause
        dead = sorted((f.get("timestamp", 0), int(f["rank"]), int(f["exitcode"]), f.get("pid")) for f in doc
                      if int(f["exitcode"]) < 0 and int(f["exitcode"]) != -signal.SIGTERM)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not dead:
        return None
    _, rank, code, pid = dead[0]
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"rank {rank}: killed by {name} (signal {-code}, pid {pid}) during the run; stopped every rank"


def torchrun_main(argv: list[str]) -> None:
    """``python -m runtime.launch TORCHRUN_ARGS``: torchrun (``torch.distributed.run``) whose
    workers' log folder is removed when it exits, and that also writes which ranks failed and how
    (global rank, pid, exit code; a negative code is the signal that killed the rank) to
    ``$K3SCHED_FAILURES_FILE`` before it exits with torchrun's error, so :func:`_launch` can name a
    rank that died without a word."""
    import json

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        # torchrun keeps an (empty unless redirected) folder per run for its workers' logs; without
        # --log-dir it is a torchelastic_* folder in /tmp that nothing removes: one per launch
        with tempfile.TemporaryDirectory(prefix="k3sched_torchrun_") as logs:
            torchrun(["--log-dir", logs, *argv])
    except ChildFailedError as e:
        try:
            path = RuntimeOptions.from_env(os.environ, 0).failures_file
        except ValueError:  # a malformed hook: the ranks said so already
            path = None
        if path:
            with contextlib.suppress(OSError):
                Path(path).write_text(json.dumps([{"rank": int(r), "local_rank": f.local_rank, "pid": f.pid,
                                                   "exitcode": f.exitcode, "timestamp": f.timestamp}
                                                  for r, f in e.failures.items()]))
        raise
    except SignalException as e:  # stopped by the launcher (Ctrl-C, timeout): torchrun said so already
        raise SystemExit(128 + int(e.sigval)) from None


def run_command(config_path: str | Path, overrides: list[str] | None, steps: int, nproc: int | None,
                out_dir: str | Path, nsys: bool = False, strategy: str | None = None, *,
                timeout_s: float | None = None, extra_args: list[str] | None = None, env: dict | None = None,
                quiet: bool = False, nsys_retries: int = 1, emulate_links: bool = False,
                link_rates: dict | None = None, save_every: int = 0, save_mode: str = "async",
                resume: str | None = None, p2p: str = "buffered", racecheck: bool = False,
                drop_deps: list[str] | None = None, device: str | None = None, warmup_steps: int = 1,
                trace_steps: bool = False) -> int:
    """Run ``steps`` training steps of ``config_path`` on ``nproc`` local ranks (default: the
    config's pp*ep*dp). Returns 0 on success, 1 when a rank failed or the run timed out, 2 on a
    user error (nothing launched). Outputs land in ``out_dir`` (see :mod:`runtime.train`).
    ``emulate_links``: run the ranks on the shaped-link testbed (:mod:`runtime.testbed`), links at
    the config's hardware rates unless ``link_rates`` (keyword arguments of
    :class:`runtime.testbed.Testbed`: ``internode_gbps``, ``nvlink_gbps``, ``gpus_per_node``,
    ``rate_scale``) says otherwise; summary.json then has a ``testbed`` entry. ``save_every`` /
    ``save_mode`` / ``resume``: checkpoints ([Note: checkpoint contents] in runtime/checkpoint.py).
    ``p2p``: ``buffered`` or ``strict`` (gloo P2P behaves like NCCL, [Note: strict P2P] in
    runtime/stage/p2p.py). ``racecheck``: run the race detector on every rank ([Note: race detector] in
    runtime/racecheck.py); ``drop_deps``: ``CONSUMER=PRODUCER`` plan dependencies removed before
    running (checked against the plan). ``device``: cpu, cuda or None (:func:`resolve_device`).
    ``warmup_steps``: the first steps left out of the summary's measured step (the median of the rest).
    ``trace_steps``: also write ``trace_steps_rank{R}.json``, the tasks of every step from the last
    warm-up step on ([Note: traces of the measured steps] in runtime/steplog.py)."""
    out = Path(out_dir)
    if p2p not in ("buffered", "strict"):
        _err(f"--p2p: must be buffered or strict; got {p2p!r}")
        return 2
    if p2p != "buffered":
        extra_args = [*(extra_args or []), "--p2p", p2p]
    if warmup_steps < 0:
        _err(f"--warmup-steps: must be a number of steps >= 0; got {warmup_steps}")
        return 2
    if warmup_steps != 1:
        extra_args = [*(extra_args or []), "--warmup-steps", str(warmup_steps)]
    if trace_steps:
        extra_args = [*(extra_args or []), "--trace-steps"]
    try:
        # the ranks' hooks: a malformed one is one line here, not one per rank
        opts = RuntimeOptions.from_env({**os.environ, **(env or {})}, 0)
        cfg, doc = check_run(config_path, overrides, nproc, strategy)
        if racecheck or drop_deps:
            from runtime.racecheck import launch_args as race_args

            extra_args = [*(extra_args or []), *race_args(doc, racecheck, drop_deps)]
    except ValueError as e:
        _err(str(e))
        return 2
    if steps < 1:
        _err(f"--steps: must be at least 1; got {steps}")
        return 2
    if PIPELINE_TABLE[cfg.schedule.pipeline].steps > 1 and (save_every or resume or cfg.data.path):
        _err(f"--save-every / --resume / data.path: {cfg.schedule.pipeline} runs on synthetic tokens without "
             f"checkpoints (its second weight version is not saved); allowed: none of them")
        return 2
    from runtime.checkpoint import launch_args

    try:
        more, sets, more_env = launch_args(cfg, out, steps, save_every=save_every, save_mode=save_mode, resume=resume)
    except ValueError as e:
        _err(str(e))
        return 2
    extra_args, overrides, env = [*(extra_args or []), *more], [*(overrides or []), *sets], {**(env or {}), **more_env}
    world = cfg.parallel.world
    try:
        dev = resolve_device(device, world)
    except ValueError as e:
        _err(str(e))
        return 2
    extra_args = [*extra_args, "--device", dev]
    env = _wait_env(env, timeout_s, opts)
    if dev == "cuda":
        env = {**{k: v for k, v in gpu_env(out).items() if k not in os.environ}, **env}
    if emulate_links:
        return _run_on_testbed(cfg, config_path, overrides, steps, out, nsys, strategy, timeout_s=timeout_s,
                               extra_args=extra_args, env=env, quiet=quiet, link_rates=link_rates)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("error_rank*.txt")) + list(out.glob("trace_rank*.json")):
        stale.unlink()
    cmd = torchrun_command(config_path, out, world, overrides=overrides, steps=steps, strategy=strategy,
                           extra=(["--quiet"] if quiet else []) + list(extra_args or []))
    run_env = _run_env(env)
    if nsys:
        return _run_under_nsys(cmd, out, run_env, world, timeout_s, quiet, nsys_retries)
    return _launch(cmd, out, run_env, world, timeout_s, quiet)


def _wait_env(env: dict, timeout_s: float | None, opts: RuntimeOptions) -> dict:
    """The ranks' wait limit (K3SCHED_TIMEOUT_S): the caller's (``opts``), else half the whole-run
    limit (at most 120 s, at least 5 s), so a stuck rank reports itself before the launcher gives up."""
    if timeout_s and opts.timeout_s is None:
        env = {**env, TIMEOUT_ENV: f"{max(5.0, min(120.0, timeout_s / 2)):g}"}
    return env


def _run_env(env: dict | None) -> dict:
    run_env = {**os.environ, **(env or {})}
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), run_env.get("PYTHONPATH", "")] if p)
    run_env.setdefault("OMP_NUM_THREADS", "1")
    run_env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return run_env


def _run_on_testbed(cfg, config_path, overrides, steps: int, out: Path, nsys: bool, strategy, *, timeout_s,
                    extra_args, env, quiet: bool, link_rates: dict | None) -> int:
    """The ``emulate_links=True`` path of :func:`run_command`: refuse (one line, 2) when the
    testbed cannot be set up, else launch inside it and delete it whatever happens."""
    from runtime.testbed import Testbed, TestbedError, testbed_available

    if nsys:
        _err("--emulate-links: cannot be combined with --nsys (the ranks run in their own network namespaces); "
             "drop one of the two")
        return 2
    reason = testbed_available()
    if reason is not None:
        _err(f"--emulate-links: {reason}")
        return 2
    world = cfg.parallel.world
    try:
        tb = Testbed(cfg.hardware, world, **(link_rates or {}))
    except (TypeError, ValueError) as e:
        _err(f"--emulate-links: {e}")
        return 2
    try:
        tb.start()
    except TestbedError as e:
        _err(f"--emulate-links: {e}")
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in list(out.glob("error_rank*.txt")) + list(out.glob("trace_rank*.json")):
            stale.unlink()
        cmd = torchrun_command(config_path, out, world, overrides=overrides, steps=steps, strategy=strategy,
                               extra=(["--quiet"] if quiet else []) + list(extra_args or []), testbed=tb)
        if not quiet:
            print(tb.describe(), flush=True)
        rc = _launch(cmd, out, {**_run_env(env), **tb.env()}, world, timeout_s, quiet)
    finally:
        tb.close()
    summary = out / "summary.json"
    if rc == 0 and summary.exists():
        import json

        doc = json.loads(summary.read_text())
        doc["testbed"] = tb.info()
        summary.write_text(json.dumps(doc, indent=1))
    return rc


def _launch(cmd: list[str], out: Path, run_env: dict, world: int, timeout_s: float | None, quiet: bool) -> int:
    """Start ``cmd`` (torchrun) in a new session, wait, kill its process group on any exit."""
    failures = (out / FAILURES_FILE).resolve()
    failures.unlink(missing_ok=True)
    run_env = {**run_env, FAILURES_ENV: str(failures)}
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
    except SystemExit:  # SIGTERM / SIGHUP while a testbed is open
        _err("terminated; stopped every rank")
        raise
    finally:
        kill_group(proc)
    if rc != 0:
        lost = lost_rank(out)
        line = first_error(out)
        if lost is None and line and line.startswith("error: "):  # a rank's user error (exit 2)
            _err(line[len("error: "):])
            return 2
        _err(lost or line or f"torchrun exited with status {rc} (no rank reported an error; see the output above)")
        return 1
    if not quiet:
        print(f"wrote {out}/plan.json, {out}/summary.json, {world} trace file(s) trace_rank*.json", flush=True)
    return 0


def _run_under_nsys(cmd: list[str], out: Path, run_env: dict, world: int, timeout_s: float | None, quiet: bool,
                    retries: int) -> int:
    """The ``nsys=True`` path of :func:`run_command`: record with :func:`traces.nsys.record`
    (``timeout_s`` per capture attempt), then :func:`nsys_validate`. Returns 0 / 1 / 130; a
    capture that hung on every attempt is reported as such (one line, exit 1)."""
    from traces.events import TraceError
    from traces.nsys import CaptureHung, record

    def clear(attempt: int) -> None:
        for stale in list(out.glob("error_rank*.txt")) + list(out.glob("trace_rank*.json")) + [out / "summary.json"]:
            stale.unlink(missing_ok=True)
        if attempt and not quiet:
            print(f"nsys: the capture hung; killed it and retrying (attempt {attempt + 1})", flush=True)

    try:
        sql = record(cmd, out / "profile", trace=nsys_trace_kinds(), options=NSYS_OPTIONS, env=run_env, cwd=REPO,
                     timeout_s=timeout_s or 600.0, retries=retries, echo=not quiet, before_attempt=clear)
    except KeyboardInterrupt:
        _err("interrupted; stopped every rank")
        return 130
    except CaptureHung as e:
        _err(str(e))
        return 1
    except TraceError as e:
        _err(first_error(out) or str(e))
        return 1
    if not (out / "summary.json").exists():
        _err(first_error(out) or "the ranks exited without writing summary.json (see the output above)")
        return 1
    if not quiet:
        print(f"wrote {sql} (NVTX ranges named by task id), {out}/plan.json, {out}/summary.json, {world} trace "
              f"file(s) trace_rank*.json", flush=True)
    code = nsys_validate(out, quiet)
    if code == 0:
        print(f"nsys trace conforms to the plan; wrote {out}/validation.json", flush=True)
    else:
        _err(f"the nsys trace {'does not conform to' if code == 1 else 'could not be checked against'} the plan; "
             f"see {out}/validation.json")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    torchrun_main(sys.argv[1:])
