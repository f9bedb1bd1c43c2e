"""Per micro-batch, per layer task state: what the sub-op tasks of one layer hand each other.

Shape legend (torchtitan style) used across the package:
    B batch (sequences in the micro-batch)   S sequence length     T = B * S tokens
    D hidden    H heads    E routed experts (all EP ranks)   L = E / R local experts
    R EP ranks  K top-k    P = T * K routed slots on this rank (sorted by expert)
    N slots received by this rank's local experts   V vocabulary
    e.g. ``x_BSD``, ``topk_idx_TK``, ``recv_ND``, ``recv_counts_RL``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
class SequenceState:
    """What the slices of one micro-batch share ([Note: sequence slices in the model] in
    moe/model.py): per layer, the keys / values of the slices forwarded so far, the key / value
    gradients later slices added for earlier ones, and the routing counts and score sums of the
    sequence-wise aux loss. Every access is made by a compute-lane task (attn.*, router.*).

    ``bounds[j]`` is slice j's token range [start, end) of each sequence; ``batch`` the sequences
    B of the micro-batch. Tensors: ``kv[l][j]`` = (K, V) ``[B, H, n_j, hd]`` of slice j of layer
    l; ``grad_kv[(l, j)]`` = [dK, dV, contributions]; ``counts_BE[l]`` / ``psum_BE[l]`` the routed
    slot counts and softmax score sums over the slices routed so far (``routed[l]`` of them)."""

    bounds: tuple[tuple[int, int], ...]
    batch: int
    kv: dict[int, list[tuple[Tensor, Tensor]]] = field(default_factory=dict)
    grad_kv: dict[tuple[int, int], list] = field(default_factory=dict)
    counts_BE: dict[int, Tensor] = field(default_factory=dict)
    psum_BE: dict[int, Tensor] = field(default_factory=dict)
    routed: dict[int, int] = field(default_factory=dict)

    @property
    def slices(self) -> int:
        return len(self.bounds)

    @property
    def seq_len(self) -> int:
        return self.bounds[-1][1]

    def prefix(self, layer: int, j: int) -> list[tuple[Tensor, Tensor]]:
        """K / V of slices 0 .. j-1 of ``layer`` (for slice j's attention)."""
        have = self.kv.get(layer, [])
        if len(have) != j:
            raise RuntimeError(f"attn.fwd of slice {j} of layer {layer}: needs the keys / values of slices "
                               f"0..{j - 1}, has {len(have)} (slices run their attention forward in order)")
        return have

    def keep_kv(self, layer: int, j: int, kv: tuple[Tensor, Tensor] | None) -> None:
        """Keep slice j's K / V for later slices; the last slice (``kv`` None) drops the layer's
        prefix (its own graph saved the concatenation it attended to)."""
        if j == self.slices - 1:
            self.kv.pop(layer, None)
        else:
            assert kv is not None
            self.kv.setdefault(layer, []).append(kv)

    def add_grad_kv(self, layer: int, i: int, gk: Tensor, gv: Tensor) -> None:
        """A later slice's gradient of slice i's K / V."""
        acc = self.grad_kv.get((layer, i))
        if acc is None:
            self.grad_kv[(layer, i)] = [gk, gv, 1]
        else:
            acc[0], acc[1], acc[2] = acc[0] + gk, acc[1] + gv, acc[2] + 1

    def take_grad_kv(self, layer: int, j: int) -> tuple[Tensor | None, Tensor | None]:
        """The gradient of slice j's K / V summed over every later slice (None, None for the last
        slice); raises if a later slice's attn.dx has not run (backward runs in reverse slice order)."""
        want = self.slices - 1 - j
        acc = self.grad_kv.pop((layer, j), None)
        got = 0 if acc is None else acc[2]
        if got != want:
            raise RuntimeError(f"attn.dx of slice {j} of layer {layer}: needs the key / value gradients of the "
                               f"{want} later slice(s), has {got} (backward runs in reverse slice order)")
        return (None, None) if acc is None else (acc[0], acc[1])

    def add_routing(self, layer: int, counts_BE: Tensor, psum_BE: Tensor) -> bool:
        """Add a slice's routed slot counts and score sums; True when every slice has been routed."""
        if layer in self.counts_BE:
            self.counts_BE[layer] = self.counts_BE[layer] + counts_BE
            self.psum_BE[layer] = self.psum_BE[layer] + psum_BE
        else:
            self.counts_BE[layer], self.psum_BE[layer] = counts_BE, psum_BE
        self.routed[layer] = self.routed.get(layer, 0) + 1
        return self.routed[layer] == self.slices

    def full_counts(self, layer: int, j: int) -> Tensor:
        """The whole sequence's routed slot counts of ``layer`` (router.bwd of slice j)."""
        if self.routed.get(layer, 0) != self.slices:
            raise RuntimeError(f"router.bwd of slice {j} of layer {layer}: the aux loss needs every slice's "
                               f"routing, {self.routed.get(layer, 0)} of {self.slices} routed (every slice's "
                               "forward precedes any slice's backward of a micro-batch)")
        return self.counts_BE[layer]

    def tensors(self) -> list[Tensor]:
        """The tensors held here (kept K / V, pending K / V gradients, routing sums)."""
        out = [t for kvs in self.kv.values() for kv in kvs for t in kv]
        out += [t for acc in self.grad_kv.values() for t in acc[:2]]
        return out + list(self.counts_BE.values()) + list(self.psum_BE.values())


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
    """``ce + aux_loss_coef * sum of the layers' aux losses`` (detached, unscaled), set by head.fwd
    (None for a slice: the aux losses are whole-sequence values, see :func:`moe.model.sliced_loss`)."""
    slice: int | None = None
    """This state's sequence slice (None: the whole sequence); ``tokens_BS`` are its tokens."""
    seq: SequenceState | None = None
    """What the slices of the micro-batch share (None unless sliced)."""

    def __post_init__(self) -> None:
        self.acts = _HandedList(self.acts, f"{self.label}.acts")
        self.grads = _HandedList(self.grads, f"{self.label}.grads")

    @property
    def label(self) -> str:
        """``mb<m>``, or ``mb<m>q<j>`` for slice j (as task ids name it)."""
        return f"mb{self.index}" if self.slice is None else f"mb{self.index}q{self.slice}"

    @property
    def bounds(self) -> tuple[int, int]:
        """This state's token range [start, end) of each sequence."""
        if self.seq is None:
            return 0, self.tokens_BS.shape[1]
        return self.seq.bounds[self.slice]

    def __setattr__(self, name: str, value) -> None:
        if name in ("embed", "head") and value is not None:
            value.store.where = self.label
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
