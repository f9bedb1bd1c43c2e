"""Fault injection of a stage (``K3SCHED_FAIL_*``, [Note: runtime options] in runtime/options.py):
the chosen task raises, kills its process or hangs, so the tests see how a run fails."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..executor import Handler, PlanTask


class FaultInjection:
    """Wraps :class:`~runtime.stage.StageRunner`'s handlers when ``fail_task`` is set (the runner
    sets these from its :class:`~runtime.options.RuntimeOptions`)."""

    fail_task: str | None = None
    """The task id, task kind or ``*`` that fails (None: none)."""
    fail_step: int | None = None
    """With ``fail_task``: fail only in this global step (None: the first)."""
    fail_signal = ""
    """With ``fail_task``: "" raises; "KILL" SIGKILLs this process instead (a rank that dies without
    a word); "HANG" hangs in the task: a receive on the world group that no rank sends (a rank stuck
    in a collective whose peer never comes; the executor names it after ``--timeout``)."""

    def _maybe_fail(self, h: Handler) -> Handler:
        def run(task: PlanTask) -> None:
            if self.fail_task in ("*", task.id, task.kind.value) and self.fail_step in (None, self.step):
                self.fail_task = None
                if self.fail_signal == "KILL":
                    import os
                    import signal

                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fail_signal == "HANG":
                    self._hang()
                raise RuntimeError(f"injected failure (K3SCHED_FAIL_RANK={self.groups.layout.rank})")
            h(task)
        return run

    def _hang(self) -> None:
        lo = self.groups.layout
        if dist.is_initialized() and dist.get_world_size() > 1:
            peer = (lo.rank + 1) % dist.get_world_size()
            dist.recv(torch.zeros(1, device=self.device), src=peer, tag=0x4B3)  # never sent
        while True:  # one rank: nothing to wait on; block like one
            time.sleep(1.0)
