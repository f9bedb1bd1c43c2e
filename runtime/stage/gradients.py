"""Gradient reduction of a stage: grad.rs(.bN) -> all-reduce (sum) of bucket N of the layer's
gradients: non-expert weights over the dense group (ep*dp replicas), expert weights over the expert
group (dp replicas); the replicas of a replicated expert then sum theirs ([Note: expert placement]
in k3sched/balance.py). With ``schedule.grad_offload`` grad.rs is :class:`offload.GradShards`'
instead ([Note: sharded gradients]). grad.mirror -> all-reduce (sum) of every gradient of the stage
with the stage holding the other model copy (chimera, dualpipe).

[Note: replica gradient reduction]
The bidirectional schedules (chimera, dualpipe; [Note: dualpipe mapping] in
k3sched/schedule_generators.py) train two copies of the model: rank r holds model stage r of the
down copy and model stage pp-1-r of the up copy, so ranks r and pp-1-r (same dp and ep index: the
``mirror`` group of runtime/groups.py) hold the same two model stages, with the same parameter
names, the same expert slice and, from ``init_full_state`` of one seed, the same initial weights.
Micro-batches 0..M/2-1 go down and M/2..M-1 up, so each copy accumulates the gradient of its half.
One task per rank, ``s{r}/step/grad.mirror`` on the collective lane, sums every gradient of the
rank (both model stages, embedding, head; after grad.rs, which reduced each over the stage's DP/EP
replicas) with its partner's in one flat all-reduce: both copies then hold the gradient of all M
micro-batches, the reference's, and take identical AdamW steps (a + b == b + a in floating point,
so the two sums agree bit for bit). The planner (k3sched/graph.py ``mirror``) places it after the
rank's last gradient work and P2P send and before optim.run, and prices it as a two-rank ring
all-reduce of the rank's gradient bytes on the link between the two ranks (k3sched/cost.py
``wire``). One reduction per rank rather than one per layer: the two ranks' collective lanes are
mirror images of each other, so per-layer reductions would have to be issued in one agreed order
across them; one call has no order to agree on (runtime/groups.py checks it at start-up anyway).
Its start is planned from the rank's own work: the partner's is about as late, as Chimera's and
DualPipe's orders are symmetric between ranks r and pp-1-r. The price: the reduction starts after all
of the rank's gradient work, so nothing of the rank's step hides it. Per-layer reductions, each once
the layer's gradients are complete, in one order on both ranks, would hide little of it, because the
bottom layers' gradients complete at the end of the backward and the optimizer waits for their
reduction; so the one call is kept. Not combined with
``schedule.grad_offload`` (the layers' gradients then live in host shards; ``k3sched run`` refuses
it in one line).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from k3sched.tasks import Kind
from moe import MoEModel, handoff
from offload.gradshard import GradShards

from ..executor import PlanTask
from ..groups import Groups


class Gradients:
    """The stage's handlers of grad.rs and grad.mirror. Owns the bucket count of each layer's
    grad.rs (:meth:`bind`); ``replicated`` is the experts with replicas ([Note: expert placement]);
    ``gshards`` (``schedule.grad_offload``) only to refuse grad.mirror, whose gradients it holds."""

    def __init__(self, model: MoEModel, groups: Groups, *, replicated, gshards: GradShards | None = None) -> None:
        self.model, self.groups, self.replicated, self.gshards = model, groups, replicated, gshards
        self._rs_buckets: dict[tuple[int, int], int] = {}

    def bind(self, lanes: Mapping[str, list[PlanTask]]) -> None:
        """The bucket count of each layer's grad.rs in the plan."""
        for t in lanes["collective"]:
            if t.kind is Kind.GRAD_RS:
                key = (t.chunk, t.layer)
                self._rs_buckets[key] = max(self._rs_buckets.get(key, 0), (t.bucket or 0) + 1)

    def _layer_buckets(self, t: PlanTask) -> list[list[tuple[str, nn.Parameter]]]:
        block = self.model.layers[t.layer]
        named = sorted(block.named_parameters(), key=lambda kv: kv[0])
        nb = self._rs_buckets.get((t.chunk, t.layer), 1)
        size = -(-len(named) // nb)
        return [named[i * size:(i + 1) * size] for i in range(nb)]

    def grad_rs(self, t: PlanTask) -> None:
        bucket = self._layer_buckets(t)[t.bucket or 0]
        dense = [p for n, p in bucket if not MoEModel.is_expert_param(n)]
        expert = [p for n, p in bucket if MoEModel.is_expert_param(n)]
        allreduce_grads(dense, self.groups.dense)
        allreduce_grads(expert, self.groups.expert)
        if self.replicated and expert:
            self._sum_replicas(expert, self.model.layers[t.layer].local_experts)
        for n, p in bucket:
            handoff.write(p.grad, f"L{t.layer}.{n}.grad")

    def grad_mirror(self, t: PlanTask) -> None:
        """[Note: replica gradient reduction]: sum every gradient of the stage with the other copy's."""
        if self.gshards is not None:
            raise RuntimeError(f"{t.id}: schedule.grad_offload keeps the gradients in host shards, which grad.mirror "
                               "does not reduce (k3sched run refuses the combination)")
        if self.groups.mirror is None:
            raise RuntimeError(f"{t.id}: no mirror group (runtime.groups.build_mirror_groups)")
        named = sorted(self.model.named_parameters(), key=lambda kv: kv[0])
        allreduce_grads([p for _, p in named], self.groups.mirror)
        for n, p in named:
            handoff.write(p.grad, f"{n}.grad (grad.mirror)")

    def _sum_replicas(self, params: list[nn.Parameter], local_experts: tuple[int, ...]) -> None:
        """[Note: expert placement] (k3sched/balance.py) Sum the gradients of every replicated expert's replicas (after
        the DP reduction, so each replica holds its dp-summed slice) over the stage's EP x DP ranks
        and give each replica the sum: one gradient per expert, as without replicas. Only the dp-0
        replica contributes, so the DP sum is not counted twice; identical gradients and identical
        initial weights keep the replicas identical under AdamW."""
        rep = {e: i for i, e in enumerate(self.replicated)}
        mine = [(s, rep[e]) for s, e in enumerate(local_experts) if e in rep]
        contribute = self.groups.layout.dp_idx == 0
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buf = p.grad.new_zeros((len(rep),) + tuple(p.shape[1:]))
            if contribute:
                for s_, i in mine:
                    buf[i] += p.grad[s_]
            if self.groups.dense is not None:
                dist.all_reduce(buf, group=self.groups.dense)
            for s_, i in mine:
                p.grad[s_].copy_(buf[i])


def allreduce_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat buffer (no-op without a group)."""
    if group is None or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off:off + n].view_as(p.grad))
        off += n
