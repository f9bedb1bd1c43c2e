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

from moe import handoff as _ho
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


class _Handed:
    """A boundary tensor of :class:`LayerCtx` (or its ``RoutingPlan``): a hand-off cell between
    tasks. Reading it hands the tensor to the reader's stream ([Note: cross-lane handoff]); both
    directions are recording points of the race detector ([Note: race detector hooks])."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        v = obj.__dict__.get(self.slot)
        for t in _tensors(v):
            _ho.handoff(t)
        if _ho.HOOK is not None:
            what = f"{obj.label}.{self.name}"
            _ho.cell(obj, self.name, False, what, v is not None)
            for t in _tensors(v):
                _ho.read(t, what, True)
        return v

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value
        if _ho.HOOK is not None:
            what = f"{obj.label}.{self.name}"
            _ho.cell(obj, self.name, True, what)
            for t in _tensors(value):
                _ho.publish(t, what)


def _tensors(v) -> tuple:
    """The tensors of a boundary value: itself, or a RoutingPlan's index tensors."""
    if v is None:
        return ()
    if isinstance(v, Tensor):
        return (v,)
    if isinstance(v, RoutingPlan):
        return (v.order_P, v.token_of_slot_P, v.inv_order_P, v.recv_counts_RL, v.local_sort_N, v.local_unsort_N)
    return ()


class _HandedList(list):
    """``MicroBatch.acts`` / ``grads``: a list whose items are hand-off cells (layer inputs and
    their gradients, P2P receive buffers), like :class:`_Handed`."""

    __slots__ = ("label",)

    def __init__(self, items, label: str) -> None:
        super().__init__(items)
        self.label = label

    def __getitem__(self, i):
        v = super().__getitem__(i)
        if isinstance(i, int):
            if isinstance(v, Tensor):
                _ho.handoff(v)
            if _ho.HOOK is not None:
                k = i % len(self)
                what = f"{self.label}[{k}]"
                _ho.cell(self, k, False, what, v is not None)
                _ho.read(v, what, True)
        return v

    def __setitem__(self, i, v) -> None:
        super().__setitem__(i, v)
        if isinstance(i, int) and _ho.HOOK is not None:
            k = i % len(self)
            what = f"{self.label}[{k}]"
            _ho.cell(self, k, True, what)
            _ho.publish(v, what)


@dataclass(eq=False)
class LayerCtx:
    """State of one layer for one micro-batch: sub-op contexts plus boundary tensors.

    Boundary tensors are detached; each is cleared when its last consumer task has run, so a
    context holds, between tasks, only what a later task needs (and the sub-op stores).

    [Note: partial input gradients]
    Four tasks produce a gradient of the normed FFN input ``xn``: dispatch.bwd (ep lane),
    shared.dx (compute lane), router.bwd and, in a dense layer, mlp.dx. The plan orders
    dispatch.bwd and shared.dx before router.bwd but not with each other (they overlap), so they
    must not add into one buffer: a Python lock would order the host calls, not the kernels on two
    streams. The runtime's shared.dx writes its own partial ``grad_xn_shared_TD``; router.bwd, which
    follows both, folds it in (:meth:`fold_grad_xn_shared`) before adding its own:
    ``(dispatch + shared) + router``, the values the shared accumulator gave (``a + b == b + a`` in
    floating point). ``moe``'s own in-order execution keeps calling :meth:`add_grad_xn`.
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
    aux: Tensor | None = None
    """Load-balancing loss of this layer (detached value)."""
    recompute_name: str | None = None
    """Name of the expert input evicted for dispatch recompute (in ``expert.store``)."""
    label: str = ""
    """How reports name this context (``mb<m>/L<l>`` in the runtime; default ``L<layer>``)."""

    # Boundary tensors (class-level descriptors, not dataclass fields): each read and write is a
    # hand-off point ([Note: cross-lane handoff] in moe/handoff.py).
    plan = _Handed()  # RoutingPlan
    # forward boundary tensors
    h_BSD = _Handed()
    xn_TD = _Handed()
    topk_idx_TK = _Handed()
    topk_w_TK = _Handed()
    recv_ND = _Handed()
    expert_out_ND = _Handed()
    shared_TD = _Handed()
    # backward boundary gradients
    grad_h_BSD = _Handed()
    grad_xn_TD = _Handed()
    grad_topk_w_TK = _Handed()
    grad_expert_out_ND = _Handed()
    grad_recv_ND = _Handed()
    grad_shared_TD = _Handed()
    grad_xn_shared_TD = _Handed()
    """shared.dx's partial gradient of xn, kept apart from ``grad_xn_TD`` (see
    [Note: partial input gradients])."""

    def __post_init__(self) -> None:
        if not self.label:
            self.label = f"L{self.layer}"

    def __setattr__(self, name: str, value) -> None:
        if name in OPS and value is not None:
            value.store.where = self.label  # reports name saved tensors mb<m>/L<l>/<op>.<entry>
        object.__setattr__(self, name, value)

    def add_grad_xn(self, g: Tensor) -> None:
        """Accumulate a gradient of the normed FFN input (router, dispatch, shared, mlp)."""
        self.grad_xn_TD = g if self.grad_xn_TD is None else self.grad_xn_TD + g

    def fold_grad_xn_shared(self) -> None:
        """Add shared.dx's partial gradient into ``grad_xn_TD`` (run by router.bwd, which follows
        both shared.dx and dispatch.bwd; see [Note: partial input gradients])."""
        g = self.grad_xn_shared_TD
        if g is not None:
            self.grad_xn_shared_TD = None
            self.add_grad_xn(g)

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
        self.grad_xn_shared_TD = None


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

    def __post_init__(self) -> None:
        self.acts = _HandedList(self.acts, f"mb{self.index}.acts")
        self.grads = _HandedList(self.grads, f"mb{self.index}.grads")

    def __setattr__(self, name: str, value) -> None:
        if name in ("embed", "head") and value is not None:
            value.store.where = f"mb{self.index}"
        object.__setattr__(self, name, value)

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
