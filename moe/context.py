"""Per micro-batch, per layer task state: what the sub-op tasks of one layer hand each other.

Shape legend (torchtitan style) used across the package:
    B batch (sequences in the micro-batch)   S sequence length     T = B * S tokens
    D hidden    H heads    E routed experts (all EP ranks)   L = E / R local experts
    R EP ranks  K top-k    P = T * K routed slots on this rank (sorted by expert)
    N slots received by this rank's local experts   V vocabulary
    e.g. ``x_BSD``, ``topk_idx_TK``, ``recv_ND``, ``recv_counts_RL``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moe.split import SubOpCtx

OPS: tuple[str, ...] = ("attn", "router", "dispatch", "shared", "expert", "combine", "mlp")


@dataclass(eq=False)
class RoutingPlan:
    """How this rank's routed slots travel to the expert ranks and back (made by dispatch.fwd).

    ``order_P``: slot permutation sorting the flat (token, k) slots by expert; ``token_of_slot_P``:
    token of each sorted slot; ``inv_order_P``: inverse of ``order_P``. ``send_splits[r]`` slots go
    to EP rank r, ``recv_splits[r]`` come from it. ``recv_counts_RL[r, l]``: slots from rank r for
    local expert l. ``local_sort_N`` reorders received rows from (source rank, expert) to
    (expert, source rank) order for the grouped GEMM; ``local_unsort_N`` is its inverse.
    """

    order_P: Tensor
    token_of_slot_P: Tensor
    inv_order_P: Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_counts_RL: Tensor
    tokens_per_local_expert: list[int]
    local_sort_N: Tensor
    local_unsort_N: Tensor


@dataclass(eq=False)
class LayerCtx:
    """State of one layer for one micro-batch: sub-op contexts plus boundary tensors.

    Boundary tensors are detached; each is cleared when its last consumer task has run, so a
    context holds, between tasks, only what a later task needs (and the sub-op stores).
    """

    layer: int
    is_moe: bool
    attn: SubOpCtx | None = None
    router: SubOpCtx | None = None
    dispatch: SubOpCtx | None = None
    shared: SubOpCtx | None = None
    expert: SubOpCtx | None = None
    combine: SubOpCtx | None = None
    mlp: SubOpCtx | None = None
    plan: RoutingPlan | None = None
    aux: Tensor | None = None
    """Load-balancing loss of this layer (detached value)."""
    recompute_name: str | None = None
    """Name of the expert input evicted for dispatch recompute (in ``expert.store``)."""
    # forward boundary tensors
    h_BSD: Tensor | None = None
    xn_TD: Tensor | None = None
    topk_idx_TK: Tensor | None = None
    topk_w_TK: Tensor | None = None
    recv_ND: Tensor | None = None
    expert_out_ND: Tensor | None = None
    shared_TD: Tensor | None = None
    # backward boundary gradients
    grad_h_BSD: Tensor | None = None
    grad_xn_TD: Tensor | None = None
    grad_topk_w_TK: Tensor | None = None
    grad_expert_out_ND: Tensor | None = None
    grad_recv_ND: Tensor | None = None
    grad_shared_TD: Tensor | None = None

    def add_grad_xn(self, g: Tensor) -> None:
        """Accumulate a gradient of the normed FFN input (router, dispatch, shared, mlp)."""
        self.grad_xn_TD = g if self.grad_xn_TD is None else self.grad_xn_TD + g

    def sub_ops(self) -> dict[str, SubOpCtx]:
        """The sub-op contexts created so far, by op name."""
        return {op: c for op in OPS if (c := getattr(self, op)) is not None}

    def saved_tensors(self) -> dict[str, Tensor]:
        """Every live saved tensor of this layer by name (``<op>.<entry>``); see
        :class:`moe.split.SavedStore`. Names may alias one tensor across ops only when a
        boundary tensor is kept by two sub-ops (e.g. ``shared`` and ``dispatch`` both keep xn)."""
        out: dict[str, Tensor] = {}
        for c in self.sub_ops().values():
            out.update(c.saved_tensors())
        return out

    def replace(self, name: str, t: Tensor) -> None:
        """Swap saved tensor ``name`` (as listed by :meth:`saved_tensors`) for ``t``."""
        op = name.split(".", 1)[0]
        c = getattr(self, op, None) if op in OPS else None
        if c is None:
            raise KeyError(f"no sub-op context for saved tensor {name!r} in layer {self.layer}")
        c.replace(name, t)

    def clear_forward_boundaries(self) -> None:
        self.h_BSD = self.xn_TD = self.topk_idx_TK = self.topk_w_TK = None
        self.recv_ND = self.expert_out_ND = self.shared_TD = None

    def clear_backward_boundaries(self) -> None:
        self.grad_h_BSD = self.grad_xn_TD = self.grad_topk_w_TK = None
        self.grad_expert_out_ND = self.grad_recv_ND = self.grad_shared_TD = None


@dataclass(eq=False)
class MicroBatch:
    """All task state of one micro-batch on this rank.

    ``acts[l]`` is the input of layer ``l`` (``acts[n_layers]`` the head input) until its consumer
    ran; ``grads[l]`` the gradient of that tensor until its consumer ran. ``loss_scale`` multiplies
    the loss gradient (e.g. 1 / (micro-batches * data-parallel ranks)).
    """

    index: int
    tokens_BS: Tensor
    targets_BS: Tensor
    loss_scale: float
    layers: list[LayerCtx]
    acts: list[Tensor | None]
    grads: list[Tensor | None]
    embed: SubOpCtx | None = None
    head: SubOpCtx | None = None
    ce: Tensor | None = None
    """Cross-entropy (detached), set by head.fwd."""
    loss: Tensor | None = None
    """``ce + aux_loss_coef * sum of the layers' aux losses`` (detached, unscaled), set by head.fwd."""

    def all_saved_tensors(self) -> dict[str, Tensor]:
        """Saved tensors of every context, names prefixed ``L<layer>/``, ``embed/``, ``head/``."""
        out: dict[str, Tensor] = {}
        for lc in self.layers:
            out.update({f"L{lc.layer}/{n}": t for n, t in lc.saved_tensors().items()})
        for tag, c in (("embed", self.embed), ("head", self.head)):
            if c is not None:
                out.update({f"{tag}/{n}": t for n, t in c.saved_tensors().items()})
        return out

    def saved_nbytes(self) -> int:
        """Bytes of live saved tensors (each storage counted once)."""
        seen: set[tuple] = set()
        total = 0
        for t in self.all_saved_tensors().values():
            k = (t.device, t.untyped_storage().data_ptr())
            if k not in seen:
                seen.add(k)
                total += t.untyped_storage().nbytes()
        return total


def zero_scalar_like(t: Tensor, value: float) -> Tensor:
    """A 0-d tensor holding ``value`` with ``t``'s dtype and device."""
    return torch.full((), value, dtype=t.dtype, device=t.device)
