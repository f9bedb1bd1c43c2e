"""The optimizer step of a stage: optim.run -> reduce embed/head/final-norm gradients (optim
group), AdamW step, zero grads; with ``schedule.grad_offload`` :class:`offload.GradShards` steps
AdamW on the host shards and all-gathers the layers' parameters ([Note: sharded gradients])."""

from __future__ import annotations

import torch
from torch import Tensor

from moe import handoff

from ..executor import PlanTask
from .gradients import _allreduce_grads


class OptimizerOps:
    """:class:`~runtime.stage.StageRunner` handler of optim.run and the gradients it can capture."""

    def _optim(self, t: PlanTask) -> None:
        rest = [p for n, p in self.model.named_parameters() if not n.startswith("layers.")]
        _allreduce_grads(rest, self.groups.optim)
        stepped = rest if self.gshards is not None else self.params
        for p in stepped:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            handoff.write(p.grad, "param grad (optim.run)")
        if self.capture_grads:
            self.captured, self.capture_grads = self.grads(), False
            if self.gshards is not None:  # the layers' gradients live in the host shards
                self.captured.update({f"layers.{L}.{n}": g for (L, n), g in self.gshards.full_grads().items()})
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.gshards is not None:
            self.gshards.step()

    def grads(self) -> dict[str, Tensor]:
        """Current gradients by full parameter name (this rank's slices)."""
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
