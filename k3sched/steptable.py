"""The step table: the tasks of one layer and micro-batch, their edges and memory effects, as data.

[Note: step table]
:data:`STEPS` is the one description of a layer's tasks. The graph builder
(:mod:`k3sched.graph`) creates a layer's tasks from it, row by row in table order (a topological
order, and the creation order the planner's ``topo`` keeps); :func:`k3sched.limits.count_tasks`
counts its rows; ``moe.INTRA_LAYER_DEPS`` and ``moe.microbatch_tasks`` are read off it; the
runtime's executor waits for :func:`runtime_deps` (:func:`k3sched.lowering.implied_edges`). Changing a row
changes all of them together (tests/unit/k3sched/test_steptable.py).

A row names a task kind (its lane is ``LANE_OF[kind]``), its pipeline unit (``F`` forward, ``I``
input gradient, ``W`` weight gradient), the layer types that have it (``moe`` / ``dense``), the
schedule flag it needs (``when``: only ``dispatch_recompute``), and three kinds of edge to tasks
of the same layer and micro-batch:

* ``deps``: planned; the graph builder adds them to the task and every plan orders them;
* ``implied``: data dependencies the plan implies only transitively, often through another stage
  (combine.bwd needs combine.fwd's saved state: the plan reaches it through the next stage's
  backward). The executor sees only its own stage's dependencies, so the runtime waits for these
  explicitly; they never add an edge to a plan;
* ``serial``: needed only by ``moe``'s own execution of a task (:meth:`moe.MoEModel.run`), which
  the runtime replaces: moe's shared.dx takes its upstream gradient from combine.bwd, the
  runtime's reads it directly ([Note: shared.dx beside combine.bwd] in runtime/stage/model_ops.py).

router.bwd waits for both dispatch.bwd and shared.dx because it folds their partial gradients of
the FFN input ([Note: partial input gradients] in moe/context.py): its sum
``(dispatch + shared) + router`` is the same on every plan and in moe's serial order.

``entry``: the row waits for the layer's input: for attn.fwd the output of the layer below
(:data:`LAYER_OUT`, or the embedding / the activation received from the previous stage); for a
backward row the upstream gradient (the attn.dx of the layer above, head.dx or grad.recv) and the
onload of the layer's activation set. The first backward entry row is the one whose start
releases the prefetch of the layers below ([Note: layer task graph] in k3sched/graph.py).

Memory effects are sums of terms, ``(what, kind)``: ``w`` / ``x``: the bytes forward ``kind``
saves until its dW / until its dX (``CostModel.saved_bytes``); ``dx``: the output gradient of
``kind`` (``CostModel.grad_out_bytes``); ``expert_in``: the expert input that expert.dw reads
(dispatch.fwd's saved input, or what dispatch.re rebuilds under dispatch recompute). ``alloc`` is
taken at a task's start, ``free`` given back at its end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .tasks import LANE_OF, Kind

MOE, DENSE, BOTH = frozenset({"moe"}), frozenset({"dense"}), frozenset({"moe", "dense"})

Term = tuple[str, Kind]


@dataclass(frozen=True)
class Step:
    """One row of :data:`STEPS` (see [Note: step table])."""

    kind: Kind
    unit: str
    layers: frozenset[str]
    deps: tuple[Kind, ...] = ()
    implied: tuple[Kind, ...] = ()
    serial: tuple[Kind, ...] = ()
    entry: bool = False
    when: str | None = None
    alloc: tuple[Term, ...] = ()
    free: tuple[Term, ...] = ()

    @property
    def lane(self) -> str:
        return LANE_OF[self.kind]


def _fwd(kind: Kind, deps: tuple[Kind, ...] = (), layers: frozenset[str] = MOE, **kw) -> Step:
    """A forward row: it allocates what ``kind`` saves for its dX and dW."""
    return Step(kind, "F", layers, deps, alloc=(("w", kind), ("x", kind)), **kw)


K = Kind
STEPS: tuple[Step, ...] = (
    # forward
    _fwd(K.ATTN_FWD, layers=BOTH, entry=True),
    _fwd(K.ROUTER_FWD, (K.ATTN_FWD,)),
    _fwd(K.DISPATCH_FWD, (K.ROUTER_FWD,)),
    _fwd(K.EXPERT_FWD, (K.DISPATCH_FWD,)),
    _fwd(K.SHARED_FWD, (K.ATTN_FWD,)),
    # combine adds the shared expert's output into the layer output it returns
    _fwd(K.COMBINE_FWD, (K.EXPERT_FWD, K.SHARED_FWD), implied=(K.ROUTER_FWD,)),
    _fwd(K.MLP_FWD, (K.ATTN_FWD,), DENSE),
    # input gradients
    Step(K.COMBINE_BWD, "I", MOE, entry=True, implied=(K.COMBINE_FWD,)),
    Step(K.SHARED_DX, "I", MOE, entry=True, serial=(K.COMBINE_BWD,),
         free=(("x", K.SHARED_FWD),), alloc=(("dx", K.SHARED_DX),)),
    # EP-DR: re-run the dispatch to rebuild the expert input that expert.dw needs, on the ep lane
    # while the expert backward computes
    Step(K.DISPATCH_RE, "I", MOE, entry=True, implied=(K.EXPERT_FWD,), when="dispatch_recompute",
         alloc=(("expert_in", K.DISPATCH_FWD),)),
    Step(K.EXPERT_DX, "I", MOE, (K.COMBINE_BWD,),
         free=(("x", K.EXPERT_FWD), ("x", K.COMBINE_FWD)), alloc=(("dx", K.EXPERT_DX),)),
    Step(K.DISPATCH_BWD, "I", MOE, (K.EXPERT_DX,)),
    Step(K.ROUTER_BWD, "I", MOE, (K.DISPATCH_BWD, K.SHARED_DX), implied=(K.COMBINE_BWD,),
         free=(("w", K.ROUTER_FWD), ("x", K.ROUTER_FWD))),
    Step(K.MLP_DX, "I", DENSE, entry=True, implied=(K.MLP_FWD,),
         free=(("x", K.MLP_FWD),), alloc=(("dx", K.MLP_DX),)),
    Step(K.ATTN_DX, "I", BOTH, (K.ROUTER_BWD, K.MLP_DX), implied=(K.DISPATCH_BWD, K.SHARED_DX),
         free=(("x", K.ATTN_FWD),), alloc=(("dx", K.ATTN_DX),)),
    # weight gradients
    Step(K.EXPERT_DW, "W", MOE, (K.EXPERT_DX, K.DISPATCH_RE),
         free=(("expert_in", K.DISPATCH_FWD), ("dx", K.EXPERT_DX))),
    Step(K.SHARED_DW, "W", MOE, (K.SHARED_DX,), free=(("dx", K.SHARED_DX),)),
    Step(K.MLP_DW, "W", DENSE, (K.MLP_DX,), free=(("w", K.MLP_FWD), ("dx", K.MLP_DX))),
    Step(K.ATTN_DW, "W", BOTH, (K.ATTN_DX,), free=(("w", K.ATTN_FWD), ("dx", K.ATTN_DX))),
)
"""The tasks of one layer and micro-batch, in creation order (see [Note: step table])."""

LAYER_OUT: Mapping[str, tuple[Kind, ...]] = MappingProxyType({
    "moe": (K.COMBINE_FWD, K.SHARED_FWD),
    "dense": (K.MLP_FWD,),
})
"""Cross-layer edges of the forward: the next layer's attn.fwd (or head.fwd, or act.send) waits for
these tasks of the layer below."""
LAYER_IN_GRAD: Kind = K.ATTN_DX
"""Cross-layer edge of the backward: the layer below's entry rows (or embed.dw, or grad.send) wait
for this task, which makes the gradient of the layer's input."""
CHUNK_FIRST: tuple[Kind, ...] = (K.EMBED_FWD, K.EMBED_DW)
"""Per-micro-batch tasks of the first model chunk."""
CHUNK_LAST: tuple[Kind, ...] = (K.HEAD_FWD, K.HEAD_DX, K.HEAD_DW)
"""Per-micro-batch tasks of the last model chunk."""
BOUNDARY: tuple[Kind, ...] = (K.FWD_SEND, K.FWD_RECV, K.BWD_SEND, K.BWD_RECV)
"""Per-micro-batch tasks at a pipeline boundary between two stages (both sides)."""
del K


def layer_steps(moe: bool, dispatch_recompute: bool = False) -> tuple[Step, ...]:
    """The rows a layer has: an MoE or a dense layer, with or without dispatch recompute."""
    flags = {"dispatch_recompute": dispatch_recompute}
    kind = "moe" if moe else "dense"
    return tuple(r for r in STEPS if kind in r.layers and (r.when is None or flags[r.when]))


def runtime_deps() -> dict[Kind, tuple[Kind, ...]]:
    """Same-layer dependencies the runtime waits for: the planned edges and the implied ones (not
    those of moe's serial execution only)."""
    return {r.kind: r.deps + r.implied for r in STEPS if r.deps or r.implied}


def data_deps() -> dict[Kind, tuple[Kind, ...]]:
    """Every same-layer dependency of the table: planned, implied and moe-serial ones."""
    return {r.kind: r.deps + r.implied + r.serial for r in STEPS if r.deps or r.implied or r.serial}
