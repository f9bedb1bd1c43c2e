"""Split backward: explicit saved tensors, dX without dW, and deferred WGrad.

[Note: split backward]
Every sub-op (``attn.fwd``, ``expert.fwd`` ...) builds its own small autograd graph:

* Its boundary inputs enter through :meth:`SubOpCtx.tap`, a custom Function that returns the
  input unchanged and whose backward stores the incoming gradient in the context
  (``ctx.input_grads``). The graph therefore references no boundary tensor, only a 0-byte anchor.
* Its parameters enter through :func:`split_linear`, :func:`split_grouped_linear`,
  :func:`split_scale` (and the embedding task). Their backward computes only the input gradient
  and stores ``grad_output`` in a :class:`WGradSlot`; the forward stored the input there.
  The WGrad task (``*.dw``) later computes ``grad_output^T @ input`` and ACCUMULATES it into
  ``param.grad``. Autograd itself never writes a parameter gradient.
* Every tensor autograd saves for backward goes through ``saved_tensors_hooks`` into the
  context's :class:`SavedStore`; the graph keeps only names. The store is what an offload manager
  sees: ``saved_tensors()`` lists live tensors by name, ``replace(name, t)`` swaps one for a copy
  (host copy on offload, device copy on onload). A tensor must be back on its device before the
  task that reads it (``*.dx`` for graph-saved tensors, ``*.dw`` for WGrad inputs) runs.
* Outputs are kept as ``GradientEdge`` s, not tensors, so holding a context pins no output data.

The dX task is ``torch.autograd.backward`` over the sub-op's output edges; afterwards the store
drops what only the graph needed. The dW task applies the slots and drops the rest. A tensor the
store hands out or drops is handed to the current stream first ([Note: cross-lane handoff] in
moe/handoff.py): a saved tensor may come from another lane (an onload, an FP8 read-back, another
lane's forward), and the kernels ``backward()`` just queued may still read what the store drops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks

from moe import handoff as _ho

GRAPH_USER = "graph"
"""Store user tag of tensors saved by a sub-op's autograd graph (released after its dX task)."""


def _alias_key(t: Tensor) -> tuple:
    """Identity of a tensor view: two entries with the same key are the same memory."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()))


@dataclass(eq=False)
class _Entry:
    tensor: Tensor | None
    users: set[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    alias_key: tuple | None


@dataclass(eq=False)
class SavedStore:
    """Named tensors a sub-op keeps between its forward and its backward tasks.

    Entries are reference-counted by user tag (``"graph"`` or a WGrad slot name); an entry is
    dropped when its last user releases it. The same view saved twice gets one name (aliases are
    matched on live entries only: an evicted, replaced or dropped entry's old address is forgotten,
    so a new tensor reusing that memory is never mistaken for it).
    """

    prefix: str
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _alias: dict[tuple, str] = field(default_factory=dict)
    _count: int = 0
    where: str = ""
    """Owner label for reports (``mb<m>/L<l>``; set by the layer context)."""

    def _what(self, name: str) -> str:
        return f"{self.where}/{name}" if self.where else name

    def put(self, t: Tensor, user: str, name: str | None = None) -> str:
        """Keep ``t`` (detached) for ``user``; return its name (an existing one if aliased)."""
        t = t.detach()
        key = _alias_key(t)
        existing = self._alias.get(key)
        if existing is not None:
            self._entries[existing].users.add(user)
            if _ho.HOOK is not None:
                _ho.cell(self, existing, False, self._what(existing))
                _ho.read(t, self._what(existing), True)
            return existing
        if name is None:
            name = f"{self.prefix}.saved{self._count}"
            self._count += 1
        elif name in self._entries:
            raise KeyError(f"saved tensor {name!r} already exists")
        self._entries[name] = _Entry(t, {user}, tuple(t.shape), t.dtype, key)
        self._alias[key] = name
        if _ho.HOOK is not None:
            _ho.cell(self, name, True, self._what(name))
            _ho.publish(t, self._what(name))
        return name

    def _forget_alias(self, entry: _Entry) -> None:
        if entry.alias_key is not None:
            self._alias.pop(entry.alias_key, None)
            entry.alias_key = None

    def get(self, name: str) -> Tensor:
        """The tensor saved as ``name``; raises if it was evicted for recompute and not restored."""
        entry = self._entries.get(name)
        if _ho.HOOK is not None:
            _ho.cell(self, name, False, self._what(name), entry is not None and entry.tensor is not None)
        if entry is None:
            raise KeyError(name)
        if entry.tensor is None:
            raise RuntimeError(f"saved tensor {name!r} was evicted for recompute and not restored")
        _ho.handoff(entry.tensor)
        _ho.read(entry.tensor, self._what(name), True)
        return entry.tensor

    def release(self, name: str, user: str) -> None:
        """``user`` no longer needs ``name``; drop it when no user is left."""
        entry = self._entries.get(name)
        if entry is None:
            return
        entry.users.discard(user)
        if not entry.users:
            self._forget_alias(entry)
            _ho.handoff(entry.tensor)  # the kernels that read it may still be queued on this stream
            del self._entries[name]
            _ho.cell(self, name, True, self._what(name))

    def release_user(self, user: str) -> None:
        """Release every entry held for ``user``."""
        for name in [n for n, e in self._entries.items() if user in e.users]:
            self.release(name, user)

    def evict(self, name: str) -> None:
        """Drop the data of ``name`` but keep the entry; :meth:`restore` must refill it."""
        entry = self._entries[name]
        self._forget_alias(entry)
        _ho.handoff(entry.tensor)
        entry.tensor = None
        _ho.cell(self, name, True, self._what(name))

    def restore(self, name: str, t: Tensor) -> None:
        """Refill an entry emptied by :meth:`evict` (or replace it) with recomputed data."""
        self.replace(name, t)
        _ho.publish(t, self._what(name))

    def replace(self, name: str, t: Tensor) -> None:
        """Swap the tensor of ``name`` (offload: a host copy; onload: a device copy)."""
        entry = self._entries[name]
        if tuple(t.shape) != entry.shape or t.dtype != entry.dtype:
            raise ValueError(f"replacement for {name!r} has shape {tuple(t.shape)} {t.dtype}, "
                             f"expected {entry.shape} {entry.dtype}")
        self._forget_alias(entry)
        entry.tensor = t.detach()
        _ho.cell(self, name, True, self._what(name))  # the caller records the bytes it wrote

    def saved_tensors(self) -> dict[str, Tensor]:
        """Live saved tensors by name (entries evicted for recompute are left out)."""
        return {n: e.tensor for n, e in self._entries.items() if e.tensor is not None}

    def names(self) -> list[str]:
        """All entry names, evicted ones included."""
        return list(self._entries)

    def names_of(self, user: str) -> set[str]:
        """Names of the entries held for ``user`` (e.g. ``"graph"``: what the dX task reads)."""
        return {n for n, e in self._entries.items() if user in e.users}

    def nbytes(self) -> int:
        """Bytes held by live entries (aliases counted once)."""
        seen: set[tuple] = set()
        total = 0
        for t in self.saved_tensors().values():
            k = (t.device, t.untyped_storage().data_ptr())
            if k not in seen:
                seen.add(k)
                total += t.untyped_storage().nbytes()
        return total


SlotKind = Literal["linear", "grouped", "scale", "embedding"]


@dataclass(eq=False)
class WGradSlot:
    """One deferred weight gradient: ``param`` gets ``f(grad_output, input)`` added to its grad.

    ``kind``: ``linear`` (g^T x), ``grouped`` (per-expert g_l^T x_l over ``group_sizes`` rows),
    ``scale`` (sum of g * x over rows: RMSNorm weight), ``embedding`` (index_add of g at ids x).
    """

    name: str
    param: nn.Parameter
    kind: SlotKind
    store: SavedStore
    x_name: str | None = None
    g_name: str | None = None
    group_sizes: list[int] | None = None
    deferred: bool = False
    """The input is recomputed at the end of the dX task (:meth:`SubOpCtx.backward_dx`), not
    saved by the forward ([Note: element-wise recompute])."""

    def save_input(self, x: Tensor) -> None:
        self.x_name = self.store.put(x, self.name)

    def save_grad(self, g: Tensor) -> None:
        if self.g_name is not None:
            raise RuntimeError(f"WGrad slot {self.name!r} got a second grad_output")
        self.g_name = self.store.put(g, self.name, name=f"{self.name}.grad_out")

    @property
    def ready(self) -> bool:
        return self.x_name is not None and self.g_name is not None

    def apply(self) -> None:
        """Compute the weight gradient, accumulate it into ``param.grad``, free the inputs."""
        if not self.ready:
            raise RuntimeError(f"WGrad slot {self.name!r} has no grad_output yet (dX task not run)")
        x = self.store.get(self.x_name)
        g = self.store.get(self.g_name)
        p = self.param
        if self.kind == "linear":
            dw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        elif self.kind == "scale":
            dw = (g * x).reshape(-1, x.shape[-1]).sum(0)
        elif self.kind == "embedding":
            dw = torch.zeros_like(p).index_add_(0, x.reshape(-1), g.reshape(-1, g.shape[-1]).to(p.dtype))
        else:
            assert self.group_sizes is not None
            dw = torch.stack([gl.t() @ xl for gl, xl in zip(g.split(self.group_sizes), x.split(self.group_sizes))]) \
                if self.group_sizes else torch.zeros_like(p)
        dw = dw.to(p.dtype)
        if p.grad is None:
            p.grad = dw
        else:
            p.grad.add_(dw)
        _ho.write(p.grad, f"{self.store.where}/{self.name}.grad")
        self.store.release(self.x_name, self.name)
        self.store.release(self.g_name, self.name)
        self.x_name = self.g_name = None


class _GradTap(torch.autograd.Function):
    """Identity at a sub-op boundary; its backward stores the input gradient by name."""

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor, sink: dict[str, Tensor], name: str) -> Tensor:  # noqa: ARG004
        ctx.sink, ctx.name = sink, name
        return x.detach()

    @staticmethod
    def backward(ctx, g: Tensor):
        prev = ctx.sink.get(ctx.name)
        ctx.sink[ctx.name] = g if prev is None else prev + g
        return None, None, None, None


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, slot: WGradSlot) -> Tensor:
        if not slot.deferred:
            slot.save_input(x)
        ctx.slot = slot
        return F.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx, g: Tensor):
        slot: WGradSlot = ctx.slot
        slot.save_grad(g)
        return g @ slot.param.to(g.dtype), None, None


class _SplitGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI: Tensor, weight_LOI: Tensor, slot: WGradSlot) -> Tensor:
        if not slot.deferred:
            slot.save_input(x_NI)
        ctx.slot = slot
        assert slot.group_sizes is not None
        outs = [F.linear(xl, weight_LOI[i]) for i, xl in enumerate(x_NI.split(slot.group_sizes))]
        return torch.cat(outs) if outs else x_NI.new_zeros(0, weight_LOI.shape[1])

    @staticmethod
    def backward(ctx, g_NO: Tensor):
        slot: WGradSlot = ctx.slot
        slot.save_grad(g_NO)
        w = slot.param
        outs = [gl @ w[i] for i, gl in enumerate(g_NO.split(slot.group_sizes))]
        return (torch.cat(outs) if outs else g_NO.new_zeros(0, w.shape[2])), None, None


class _SplitScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, slot: WGradSlot) -> Tensor:
        if not slot.deferred:
            slot.save_input(x)
        ctx.slot = slot
        return x * weight

    @staticmethod
    def backward(ctx, g: Tensor):
        slot: WGradSlot = ctx.slot
        slot.save_grad(g)
        return g * slot.param.to(g.dtype), None, None


class _SwiGLU(torch.autograd.Function):
    """``silu(h1) * h3`` that saves only ``h1`` and ``h3`` (not ``silu(h1)``) and recomputes
    ``silu(h1)`` in backward; the gradients are bitwise those of autograd's silu + mul."""

    @staticmethod
    def forward(ctx, h1: Tensor, h3: Tensor) -> Tensor:
        ctx.save_for_backward(h1, h3)
        return F.silu(h1) * h3

    @staticmethod
    def backward(ctx, g: Tensor):
        h1, h3 = ctx.saved_tensors
        # autograd: MulBackward0 gives (g * h3, g * silu(h1)); SiluBackward0 is aten.silu_backward
        return torch.ops.aten.silu_backward(g * h3, h1), g * F.silu(h1)


def swiglu(h1: Tensor, h3: Tensor) -> Tensor:
    """The SwiGLU product ``silu(h1) * h3`` (what :meth:`SubOpCtx.swiglu` computes)."""
    return F.silu(h1) * h3


Recipe = tuple  # (fn, (source tensors...)): a WGrad input recomputed as fn(*sources)


@dataclass(eq=False)
class SubOpCtx:
    """Saved state of one sub-op (e.g. ``attn``) of one micro-batch and layer.

    See [Note: split backward]. ``input_grads`` receives the gradients of the tapped inputs
    during the dX task; ``slots`` are the WGrad work left for the dW task.
    """

    op: str
    store: SavedStore = field(init=False)
    slots: list[WGradSlot] = field(default_factory=list)
    edges: dict[str, GradientEdge] = field(default_factory=dict)
    input_grads: dict[str, Tensor] = field(default_factory=dict)
    anchor: Tensor | None = None
    dx_done: bool = False
    dw_done: bool = False
    recipes: list[tuple[WGradSlot, object, list[str]]] = field(default_factory=list)
    """Deferred WGrad inputs: (slot, fn, names of the source tensors in the store)."""

    def __post_init__(self) -> None:
        self.store = SavedStore(self.op)

    # -- forward helpers ------------------------------------------------------------------------
    def tap(self, name: str, x: Tensor) -> Tensor:
        """Bring boundary input ``x`` into this sub-op's graph; its grad lands in ``input_grads``."""
        if self.anchor is None:
            self.anchor = torch.empty(0, device=x.device, requires_grad=True)
        return _GradTap.apply(x.detach(), self.anchor, self.input_grads, name)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Run the sub-op's forward: grad mode on, saved tensors routed into :attr:`store`."""
        store = self.store

        def pack(t: Tensor) -> str | Tensor:
            if isinstance(t, nn.Parameter):
                return t
            return store.put(t, GRAPH_USER)

        def unpack(obj: str | Tensor) -> Tensor:
            return obj if isinstance(obj, Tensor) else store.get(obj)

        with torch.enable_grad(), saved_tensors_hooks(pack, unpack):
            yield

    def _slot(self, suffix: str, param: nn.Parameter, kind: SlotKind, group_sizes: list[int] | None = None
              ) -> WGradSlot:
        slot = WGradSlot(f"{self.op}.{suffix}", param, kind, self.store, group_sizes=group_sizes)
        self.slots.append(slot)
        return slot

    def _defer(self, slot: WGradSlot, recompute: Recipe | None) -> WGradSlot:
        """Recompute ``slot``'s input from ``recompute = (fn, sources)`` at the end of the dX task
        instead of saving it ([Note: element-wise recompute]); the sources stay in the store
        until then (they are graph-saved tensors already, so this keeps nothing extra)."""
        if recompute is not None:
            fn, sources = recompute
            user = f"recompute:{slot.name}"
            self.recipes.append((slot, fn, [self.store.put(t, user) for t in sources]))
            slot.deferred = True
        return slot

    def linear(self, suffix: str, x: Tensor, weight: nn.Parameter, recompute: Recipe | None = None) -> Tensor:
        """``x @ weight^T`` whose weight gradient is deferred to this context's dW task
        (``recompute``: its input is recomputed in the dX task, not saved)."""
        return _SplitLinear.apply(x, weight, self._defer(self._slot(suffix, weight, "linear"), recompute))

    def grouped_linear(self, suffix: str, x_NI: Tensor, weight_LOI: nn.Parameter, group_sizes: list[int],
                       recompute: Recipe | None = None) -> Tensor:
        """Per-group ``x_l @ weight[l]^T`` over consecutive row groups (a grouped GEMM)."""
        slot = self._defer(self._slot(suffix, weight_LOI, "grouped", list(group_sizes)), recompute)
        return _SplitGroupedLinear.apply(x_NI, weight_LOI, slot)

    def scale(self, suffix: str, x: Tensor, weight: nn.Parameter, recompute: Recipe | None = None) -> Tensor:
        """``x * weight`` (broadcast over the last dim) with a deferred weight gradient."""
        return _SplitScale.apply(x, weight, self._defer(self._slot(suffix, weight, "scale"), recompute))

    def swiglu(self, h1: Tensor, h3: Tensor, recompute: bool = False) -> Tensor:
        """``silu(h1) * h3``; with ``recompute`` only ``h1`` and ``h3`` are saved (not ``silu(h1)``)."""
        return _SwiGLU.apply(h1, h3) if recompute else swiglu(h1, h3)

    def embedding_slot(self, param: nn.Parameter, ids: Tensor) -> WGradSlot:
        """A WGrad slot for an embedding lookup of ``ids`` (filled by the caller)."""
        slot = self._slot("weight", param, "embedding")
        slot.save_input(ids)
        return slot

    def output(self, name: str, t: Tensor) -> Tensor:
        """Record output ``t`` of the graph by edge; return it detached for the consumers."""
        self.edges[name] = get_gradient_edge(t)
        return t.detach()

    # -- backward -------------------------------------------------------------------------------
    def backward_dx(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """The dX task: backward from the named outputs, return the tapped inputs' gradients.

        Outputs missing from ``grads`` get no gradient. Frees the graph and what only it needed.
        """
        if self.dx_done:
            raise RuntimeError(f"dX of {self.op!r} already ran")
        names = [n for n in self.edges if grads.get(n) is not None]
        if names:
            torch.autograd.backward([self.edges[n] for n in names], grad_tensors=[grads[n] for n in names])
        for slot, fn, srcs in self.recipes:  # deferred WGrad inputs, before the graph's tensors go
            with torch.no_grad():
                slot.save_input(fn(*[self.store.get(n) for n in srcs]))
            self.store.release_user(f"recompute:{slot.name}")
        self.recipes.clear()
        self.edges.clear()
        self.anchor = None
        self.store.release_user(GRAPH_USER)
        self.dx_done = True
        out, self.input_grads = self.input_grads, {}
        return out

    def apply_wgrad(self) -> None:
        """The dW task: accumulate every deferred weight gradient of this sub-op."""
        if not self.dx_done:
            raise RuntimeError(f"dW of {self.op!r} before its dX")
        if self.dw_done:
            raise RuntimeError(f"dW of {self.op!r} already ran")
        for slot in self.slots:
            if slot.x_name is not None and slot.g_name is None:
                # the output of this linear got no gradient (e.g. an unused branch): nothing to add
                self.store.release(slot.x_name, slot.name)
                continue
            slot.apply()
        self.slots.clear()
        self.dw_done = True

    def saved_tensors(self) -> dict[str, Tensor]:
        """Live saved tensors by name (see :class:`SavedStore`)."""
        return self.store.saved_tensors()

    def replace(self, name: str, t: Tensor) -> None:
        """Swap a saved tensor (offload / onload)."""
        self.store.replace(name, t)
