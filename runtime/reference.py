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
                  weight_decay: float = 0.01, delayed: bool = False) -> ReferenceRun:
    """Train ``steps`` steps on the global batch the distributed runner would see.

    ``delayed``: PipeDream-2BW's one-step-delayed update ([Note: pipedream-2bw] in
    k3sched/schedule_generators.py): step t's loss and gradient are computed on W_{t-1} (W_{-1} =
    W_0, a second copy of the model, the stashed version) and AdamW applies them to W_t, so
    W_{t+1} = AdamW(W_t, grad L_t(W_{t-1})). ``losses[t]`` is then L_t(W_{t-1})."""
    seed = cfg.schedule.seed if seed is None else seed
    args = model_args(cfg)
    model = MoEModel.build(args, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    run = MoEModel.build(args, seed) if delayed else model  # the version the steps compute on
    p, m = cfg.parallel, cfg.model
    M, R = p.microbatches, p.ep * p.dp
    losses, grads0 = [], {}
    for step in range(steps):
        total = 0.0
        for r in range(R):
            for mb in range(M):
                tokens, targets = synthetic_batch(seed, step, r, mb, m.micro_batch_size, m.seq_len, m.vocab)
                total += float(run.forward_backward_reference(tokens, targets, loss_scale=1.0 / (M * R)))
        losses.append(total / (M * R))
        if step == 0:
            grads0 = {n: q.grad.detach().clone() for n, q in run.named_parameters() if q.grad is not None}
        if delayed:  # W_t becomes the next step's version; W_t's update takes grad L_t(W_{t-1})
            with torch.no_grad():
                for w, q in zip(model.parameters(), run.parameters()):
                    w.grad, q.grad = q.grad, None
                    q.copy_(w)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ReferenceRun(losses, grads0)
