"""Runtime options: every environment variable the runtime reads, read once.

[Note: runtime options]
A rank's process reads its environment in one place, :meth:`RuntimeOptions.from_env`, called by
``runtime.train`` (and by the launcher, to refuse a malformed value before it starts a rank); the
objects it builds (:class:`runtime.stage.StageRunner`, :class:`runtime.executor.Executor`,
:class:`runtime.checkpoint.Checkpointer`, :class:`offload.ActivationManager`,
:class:`offload.GradShards`) take these values as arguments and never look at ``os.environ``.
Tests and in-process runs build a :class:`RuntimeOptions` directly. The launcher's own variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR) are read in one place too, :meth:`LaunchEnv.from_env`.

The variables (test and debugging hooks; none is needed to train):

- ``K3SCHED_OFFLOAD_DEBUG=1``: checksums and residency checks on every offloaded set;
- ``K3SCHED_OFFLOAD_DELAY_S=S``: every offload / gradient-shard copy task sleeps S s after its
  copy was issued (slows the copy lanes; results must not change);
- ``K3SCHED_PERTURB=LANE[:I][@RANK]``: swap two adjacent tasks of a lane (``parse_perturb`` in
  runtime/executor.py);
- ``K3SCHED_UNSAFE_SHARED_DX=1``: the race detector's regression hook ([Note: partial input
  gradients] in moe/context.py);
- ``K3SCHED_DETERMINISTIC=1``: deterministic kernels (bitwise comparisons on CUDA);
- ``K3SCHED_FAIL_RANK=R``, ``K3SCHED_FAIL_TASK=GLOB``, ``K3SCHED_FAIL_STEP=N``,
  ``K3SCHED_FAIL_SIGNAL=KILL|HANG``: fault injection (raise, SIGKILL or hang in a task of rank R);
- ``K3SCHED_STACKS_AFTER_S=S``: dump every thread's stack once after S s (debugging a hang);
- ``K3SCHED_TIMEOUT_S=S``: the default of ``runtime.train --timeout`` (120 s when unset; the
  launcher sets it from its whole-run limit);
- ``K3SCHED_CKPT_KILL=RANK:STEP``, ``K3SCHED_CKPT_VERIFIED=1``: checkpoint hooks (``KILL_ENV``,
  ``VERIFIED_ENV`` in runtime/checkpoint.py);
- ``K3SCHED_FAILURES_FILE=PATH``: set by the launcher for its torchrun wrapper
  (``runtime.launch.torchrun_main``), which writes there which ranks failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .checkpoint import KILL_ENV as CKPT_KILL_ENV
from .checkpoint import VERIFIED_ENV as CKPT_VERIFIED_ENV
from .executor import PERTURB_ENV, parse_perturb

OFFLOAD_DEBUG_ENV = "K3SCHED_OFFLOAD_DEBUG"
OFFLOAD_DELAY_ENV = "K3SCHED_OFFLOAD_DELAY_S"
UNSAFE_SHARED_DX_ENV = "K3SCHED_UNSAFE_SHARED_DX"
"""Test-only: ``1`` makes shared.dx add into the layer's one ``xn`` gradient buffer, beside
dispatch.bwd on the ep lane, the race [Note: partial input gradients] prevents (the race
detector's regression test)."""
DETERMINISTIC_ENV = "K3SCHED_DETERMINISTIC"
FAIL_RANK_ENV = "K3SCHED_FAIL_RANK"
FAIL_TASK_ENV = "K3SCHED_FAIL_TASK"
FAIL_STEP_ENV = "K3SCHED_FAIL_STEP"
FAIL_SIGNAL_ENV = "K3SCHED_FAIL_SIGNAL"
STACKS_ENV = "K3SCHED_STACKS_AFTER_S"
TIMEOUT_ENV = "K3SCHED_TIMEOUT_S"
FAILURES_ENV = "K3SCHED_FAILURES_FILE"
FAIL_SIGNALS = ("", "RAISE", "KILL", "HANG")


@dataclass(frozen=True)
class RuntimeOptions:
    """One rank's runtime options (see [Note: runtime options])."""

    offload_debug: bool = False
    copy_delay_s: float = 0.0
    perturb: tuple[str, int | None] | None = None
    """(lane, index or None) of the swap on this rank, or None."""
    unsafe_shared_dx: bool = False
    deterministic: bool = False
    fail_task: str | None = None
    """Glob of the task ids that fail on this rank ("*": the first task), or None."""
    fail_step: int | None = None
    fail_signal: str = ""
    """"" or "RAISE": the task raises; "KILL": SIGKILL; "HANG": the task never returns."""
    stacks_after_s: float | None = None
    timeout_s: float | None = None
    """``K3SCHED_TIMEOUT_S``, or None when unset."""
    ckpt_kill_step: int | None = None
    """The checkpoint step after whose DCP files this rank SIGKILLs itself, or None."""
    ckpt_verified: bool = False
    """The launcher has checked the resumed checkpoint's files (the ranks skip the CRC32 pass)."""
    failures_file: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int) -> RuntimeOptions:
        """The options of rank ``rank`` from ``env``; ValueError (one line naming the variable,
        its value and what is allowed) on a malformed value."""

        def num(name: str, kind=float, default=None):
            raw = env.get(name, "")
            if raw == "":
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r}: expected a{'n integer' if kind is int else ' number'}") from None
            if value < 0 or value != value:
                raise ValueError(f"{name}={raw!r}: expected a value >= 0")
            return value

        def flag(name: str) -> bool:
            raw = env.get(name, "")
            if raw not in ("", "0", "1"):
                raise ValueError(f"{name}={raw!r}: expected 0 or 1")
            return raw == "1"

        signal = env.get(FAIL_SIGNAL_ENV, "").upper()
        if signal in ("SIGKILL", "9"):
            signal = "KILL"
        if signal not in FAIL_SIGNALS:
            raise ValueError(f"{FAIL_SIGNAL_ENV}={env[FAIL_SIGNAL_ENV]!r}: one of KILL, HANG (or unset: raise)")
        fails = env.get(FAIL_RANK_ENV, "") == str(rank)
        kill_rank, colon, kill_step = env.get(CKPT_KILL_ENV, "").partition(":")
        if env.get(CKPT_KILL_ENV) and not (colon and kill_rank.isdigit() and kill_step.isdigit()):
            raise ValueError(f"{CKPT_KILL_ENV}={env[CKPT_KILL_ENV]!r}: expected RANK:STEP")
        return cls(
            offload_debug=flag(OFFLOAD_DEBUG_ENV),
            copy_delay_s=num(OFFLOAD_DELAY_ENV, float, 0.0),
            perturb=parse_perturb(env.get(PERTURB_ENV), rank),
            unsafe_shared_dx=flag(UNSAFE_SHARED_DX_ENV),
            deterministic=flag(DETERMINISTIC_ENV),
            fail_task=(env.get(FAIL_TASK_ENV) or "*") if fails else None,
            fail_step=num(FAIL_STEP_ENV, int) if fails else None,
            fail_signal=signal if fails else "",
            stacks_after_s=num(STACKS_ENV, float),
            timeout_s=num(TIMEOUT_ENV, float),
            ckpt_kill_step=int(kill_step) if colon and int(kill_rank) == rank else None,
            ckpt_verified=flag(CKPT_VERIFIED_ENV),
            failures_file=env.get(FAILURES_ENV) or None,
        )


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun, DeepSpeed's) tells a process about its place in the run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    master_addr: str = ""
    """"": no rendezvous address (a one-rank run started without a launcher)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LaunchEnv:
        def num(name: str, default: int) -> int:
            raw = env.get(name, "")
            return default if raw == "" else int(raw)

        return cls(num("RANK", 0), num("WORLD_SIZE", 1), num("LOCAL_RANK", 0), env.get("MASTER_ADDR", ""))
