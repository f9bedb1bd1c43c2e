"""The slow, obviously-correct path beside the executor (docs/design.md, rule 5): one process, every
expert local, plain autograd over the same global batch, the same AdamW. Tests compare the
distributed runs' losses and gradients against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3sched.config import Config
from moe import MoEModel

from .stage import model_args, synthetic_batch


@dataclass
class ReferenceRun:
    losses: list[float]
    grads: dict[str, Tensor]  # step 0, before AdamW, full (unsharded) parameters


def reference_run(cfg: Config, steps: int, *, seed: int | None = None, lr: float = 1e-3,
                  weight_decay: float = 0.01) -> ReferenceRun:
    """Train ``steps`` steps on the global batch the distributed runner would see."""
    seed = cfg.schedule.seed if seed is None else seed
    args = model_args(cfg)
    model = MoEModel.build(args, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    p, m = cfg.parallel, cfg.model
    M, R = p.microbatches, p.ep * p.dp
    losses, grads0 = [], {}
    for step in range(steps):
        total = 0.0
        for r in range(R):
            for mb in range(M):
                tokens, targets = synthetic_batch(seed, step, r, mb, m.micro_batch_size, m.seq_len, m.vocab)
                total += float(model.forward_backward_reference(tokens, targets, loss_scale=1.0 / (M * R)))
        losses.append(total / (M * R))
        if step == 0:
            grads0 = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ReferenceRun(losses, grads0)
