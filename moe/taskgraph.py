"""The task graph of one layer and micro-batch, and a micro-batch's tasks run in one valid order
(the serial reference of :class:`moe.MoEModel`).

[Note: sub-op graph of one layer]
    attn.fwd     x -> RMSNorm -> qkv -> causal SDPA -> o-proj -> h = x + o; xn = RMSNorm(h)
    router.fwd   xn -> gate -> softmax scores -> top-k (selection may add ``expert_bias``)
                 -> weights w (renormalised if ``normalize_topk``), sequence-wise aux loss
    dispatch.fwd sort slots by expert, exchange counts, all-to-all xn rows to the expert ranks
    shared.fwd   xn -> shared SwiGLU (replicated on every EP rank)
    expert.fwd   received rows -> grouped SwiGLU over the local experts
    combine.fwd  all-to-all back, unpermute, y = h + shared + sum_k w_k * expert_k(xn)
    mlp.fwd      (dense layers, instead of router..combine) y = h + SwiGLU(xn)
Backward: combine.bwd (local combine backward, then all-to-all of the expert-output grads to the
expert ranks) -> expert.dx -> dispatch.bwd (all-to-all of input grads back, unpermute) and
combine.bwd -> shared.dx, both -> router.bwd (which adds its gradient of xn last) -> attn.dx;
[dispatch.re] re-runs the dispatch for expert.dw. WGrad: attn.dw, shared.dw, expert.dw (after
dispatch.re when dispatch recompute is on), mlp.dw. Router dW runs inside router.bwd.
Per micro-batch extras: embed.fwd / embed.dw (after attn.dx of layer 0), head.fwd (loss),
head.dx, head.dw. The tasks and their edges are the planner's step table ([Note: step table] in
k3sched/steptable.py); ``INTRA_LAYER_DEPS`` lists the edges as a mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from torch import Tensor

from k3sched.steptable import CHUNK_FIRST, CHUNK_LAST, STEPS, data_deps, layer_steps
from k3sched.tasks import Kind
from moe.comm import ProcessGroup
from moe.config import MoEModelArgs
from moe.context import MicroBatch

if TYPE_CHECKING:
    from moe.model import MoEModel

INTRA_LAYER_DEPS: Mapping[Kind, tuple[Kind, ...]] = MappingProxyType(data_deps())
"""Dependencies between the tasks of one layer and micro-batch, read off the step table ([Note: step
table] in k3sched/steptable.py): its planned, implied and moe-serial edges (kinds absent from a
layer, e.g. ``mlp.*`` in an MoE layer or ``dispatch.re`` without recompute, are to be ignored).
Across layers: attn.fwd(l) needs ``LAYER_OUT`` of layer l-1 (embed.fwd for l = 0); the entry rows of
layer l's backward (combine.bwd, shared.dx, dispatch.re / mlp.dx) need attn.dx (l+1) (head.dx for
the last layer); embed.dw needs attn.dx (0)."""

LAYER_KINDS: frozenset[Kind] = frozenset(r.kind for r in STEPS)
MICROBATCH_KINDS: frozenset[Kind] = frozenset(CHUNK_FIRST + CHUNK_LAST)


@dataclass(frozen=True)
class MicroBatchTasks:
    """The tasks of one micro-batch in a valid order, as ``(kind, layer or None)`` pairs."""

    forward: tuple[tuple[Kind, int | None], ...]
    backward_dx: tuple[tuple[Kind, int | None], ...]
    wgrad: tuple[tuple[Kind, int | None], ...]


def microbatch_tasks(args: MoEModelArgs) -> MicroBatchTasks:
    """Forward of every layer, then dX in reverse layer order, then every dW; a layer's tasks in
    step-table order ([Note: step table] in k3sched/steptable.py), which respects every edge."""
    fwd: list[tuple[Kind, int | None]] = [(Kind.EMBED_FWD, None)]
    dx: list[tuple[Kind, int | None]] = [(Kind.HEAD_DX, None)]
    dw: list[tuple[Kind, int | None]] = [(Kind.HEAD_DW, None)]
    rows = {moe: layer_steps(moe, args.dispatch_recompute) for moe in (True, False)}
    for i in range(args.layers):
        fwd += [(r.kind, i) for r in rows[args.is_moe_layer(i)] if r.unit == "F"]
    fwd.append((Kind.HEAD_FWD, None))
    for i in reversed(range(args.layers)):
        dx += [(r.kind, i) for r in rows[args.is_moe_layer(i)] if r.unit == "I"]
        dw += [(r.kind, i) for r in rows[args.is_moe_layer(i)] if r.unit == "W"]
    dw.append((Kind.EMBED_DW, None))
    return MicroBatchTasks(tuple(fwd), tuple(dx), tuple(dw))


def run_tasks(model: MoEModel, mb: MicroBatch, tasks: tuple[tuple[Kind, int | None], ...],
              ep_group: ProcessGroup | None = None) -> None:
    """Run ``tasks`` of ``mb`` in the given order."""
    for kind, layer in tasks:
        model.run(kind, mb, layer, ep_group)


def run_microbatch_in_order(model: MoEModel, mb: MicroBatch, ep_group: ProcessGroup | None = None) -> Tensor:
    """Run every task of ``mb`` (forward, dX in reverse, then all dW); return its loss."""
    tasks = microbatch_tasks(model.args)
    run_tasks(model, mb, tasks.forward, ep_group)
    run_tasks(model, mb, tasks.backward_dx, ep_group)
    run_tasks(model, mb, tasks.wgrad, ep_group)
    assert mb.loss is not None
    return mb.loss


def run_slices_in_order(model: MoEModel, slices: list[MicroBatch], ep_group: ProcessGroup | None = None) -> Tensor:
    """Run every task of a micro-batch cut into ``slices`` (:meth:`MoEModel.new_slices`): the
    slices' forwards in slice order, their dX in reverse slice order, then every dW; return the
    micro-batch's loss ([Note: sequence slices in the model] in moe/model.py)."""
    tasks = microbatch_tasks(model.args)
    for mb in slices:
        run_tasks(model, mb, tasks.forward, ep_group)
    for mb in reversed(slices):
        run_tasks(model, mb, tasks.backward_dx, ep_group)
    for mb in slices:
        run_tasks(model, mb, tasks.wgrad, ep_group)
    return model.sliced_loss(slices)
