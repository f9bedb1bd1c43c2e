"""Gradient reduction of a stage: grad.rs(.bN) -> all-reduce (sum) of bucket N of the layer's
gradients: non-expert weights over the dense group (ep*dp replicas), expert weights over the expert
group (dp replicas); the replicas of a replicated expert then sum theirs ([Note: expert placement]
in k3sched/balance.py). With ``schedule.grad_offload`` grad.rs is :class:`offload.GradShards`'
instead ([Note: sharded gradients])."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe import handoff
from moe import MoEModel

from ..executor import PlanTask


class GradientOps:
    """:class:`~runtime.stage.StageRunner` handler of grad.rs and the routing statistics."""

    def _layer_buckets(self, t: PlanTask) -> list[list[tuple[str, nn.Parameter]]]:
        block = self.model.layers[t.layer]
        named = sorted(block.named_parameters(), key=lambda kv: kv[0])
        nb = self._rs_buckets.get((t.chunk, t.layer), 1)
        size = -(-len(named) // nb)
        return [named[i * size:(i + 1) * size] for i in range(nb)]

    def _grad_rs(self, t: PlanTask) -> None:
        bucket = self._layer_buckets(t)[t.bucket or 0]
        dense = [p for n, p in bucket if not MoEModel.is_expert_param(n)]
        expert = [p for n, p in bucket if MoEModel.is_expert_param(n)]
        _allreduce_grads(dense, self.groups.dense)
        _allreduce_grads(expert, self.groups.expert)
        if self._replicated and expert:
            self._sum_replicas(expert, self.model.layers[t.layer].local_experts)
        for n, p in bucket:
            handoff.write(p.grad, f"L{t.layer}.{n}.grad")

    def _sum_replicas(self, params: list[nn.Parameter], local_experts: tuple[int, ...]) -> None:
        """[Note: expert placement] (k3sched/balance.py) Sum the gradients of every replicated expert's replicas (after
        the DP reduction, so each replica holds its dp-summed slice) over the stage's EP x DP ranks
        and give each replica the sum: one gradient per expert, as without replicas. Only the dp-0
        replica contributes, so the DP sum is not counted twice; identical gradients and identical
        initial weights keep the replicas identical under AdamW."""
        rep = {e: i for i, e in enumerate(self._replicated)}
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

    def routing_counts(self) -> dict[int, tuple[list[int], list[int]]]:
        """This rank's routed slots since the last call, per MoE layer of the stage: (per expert,
        per global slot); the counters restart."""
        out = {}
        for L in self.spec.layers:
            block = self.model.layers[L]
            if getattr(block, "is_moe", False):
                out[L] = (block.routed_E.tolist(), block.routed_G.tolist())
                block.reset_routing_counts()
        return out


def _allreduce_grads(params: list[nn.Parameter], group) -> None:
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
