"""Fault injection of a stage (``K3SCHED_FAIL_*``, [Note: runtime options] in runtime/options.py):
the chosen task raises, kills its process or hangs, so the tests see how a run fails."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..executor import Handler, PlanTask
from ..options import RuntimeOptions


class Faults:
    """Wraps the stage's handlers when ``options.fail_task`` is set (:meth:`wrap`); ``step`` returns
    the global index of the step in progress (the runner's), ``rank`` names the failing rank."""

    def __init__(self, options: RuntimeOptions, *, step: Callable[[], int], rank: int, device: torch.device) -> None:
        self.fail_task: str | None = options.fail_task
        """The task id, task kind or ``*`` that fails (None: none)."""
        self.fail_step: int | None = options.fail_step
        """With ``fail_task``: fail only in this global step (None: the first)."""
        self.fail_signal = options.fail_signal
        """With ``fail_task``: "" raises; "KILL" SIGKILLs this process instead (a rank that dies without
        a word); "HANG" hangs in the task: a receive on the world group that no rank sends (a rank stuck
        in a collective whose peer never comes; the executor names it after ``--timeout``)."""
        self.step, self.rank, self.device = step, rank, device

    def wrap(self, h: Handler) -> Handler:
        """``h``, failing as :attr:`fail_task` says."""
        def run(task: PlanTask) -> None:
            if self.fail_task in ("*", task.id, task.kind.value) and self.fail_step in (None, self.step()):
                self.fail_task = None
                if self.fail_signal == "KILL":
                    import os
                    import signal

                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fail_signal == "HANG":
                    self._hang()
                raise RuntimeError(f"injected failure (K3SCHED_FAIL_RANK={self.rank})")
            h(task)
        return run

    def _hang(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            peer = (self.rank + 1) % dist.get_world_size()
            dist.recv(torch.zeros(1, device=self.device), src=peer, tag=0x4B3)  # never sent
        while True:  # one rank: nothing to wait on; block like one
            time.sleep(1.0)
