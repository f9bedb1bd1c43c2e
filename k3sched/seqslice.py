"""Sequence slices of a micro-batch (Seq1F1B): where the slices of a sequence begin and end.

[Note: sequence slices]
``parallel.seq_chunks`` S > 1 cuts every micro-batch along the sequence into S slices; slice j of
micro-batch m holds the tokens [s_j, e_j) of each of its sequences and is a pipeline unit of its
own (task ids ``s0/mb2q1/L4/attn.fwd``, ``Task.slice`` = j; [Note: task id grammar] in
k3sched/tasks.py). Causal attention makes the slices unequal and dependent:

- a token at position p attends to the p + 1 keys [0, p], so slice j's attention forward needs
  the keys and values of every earlier slice, and its attention FLOPs are proportional to
  ``keys(s, e) = sum over p in [s, e) of (p + 1)``: later slices are costlier;
- the backward of slice j adds key / value gradients into the earlier slices' keys and values, so
  backward runs in reverse slice order (S-1 first) and slice j-1's attention dX waits for slice
  j's.

Where the boundaries go (``parallel.seq_split``): ``even`` gives every slice L / S tokens (S must
divide ``model.seq_len`` L); ``compute`` places them so that every slice's forward cost of the
attention and MLP parts of all layers is equal, with a token at position p costing ``A + C (p+1)``
FLOPs (A: its linear parts -- projections, router, shared and routed experts or dense MLP,
summed over layers, as :meth:`k3sched.cost.CostModel.flops` counts them; C = 4 h per layer: QK^T
and AV over one key), rounded to whole tokens, every slice at least one token. The routed
experts are counted at balanced routing (the cost model's busiest-rank skew scales every slice
alike, so it moves no boundary).

The plan (k3sched/graph.py): every per-layer task of a micro-batch, its embedding and head, its
P2P sends and receives and its MoE dispatch / combine exist once per slice, costed by
:meth:`k3sched.cost.CostModel.sliced` (linear parts, all-to-all, P2P and head bytes by the
slice's tokens; attention FLOPs by ``keys(s, e)``; the head's loss is the slice's tokens'). Two
dependencies come on top of the layer graph: ``attn.fwd`` of slice j waits for ``attn.fwd`` of
slice j-1 (same micro-batch and layer), and ``attn.dx`` of slice j-1 waits for ``attn.dx`` of
slice j. Memory: each slice's activation sets are its own (offloaded per slice: keys (stage, mb,
layer, slice)); slice j's attention also keeps the keys and values of the prefix [0, s_j) it
concatenated in front of its own, so it holds K/V of [0, e_j); its backward hands the prefix's key
/ value gradients (model dtype) to slice j-1, which frees them. A slice's activation set leaves
for the host only after slice j+1's attention forward of that layer has read its keys / values.

The backbone (:func:`seq1f1b`, planner.backbone): the configured schedule generated over M * S
units, unit ``m * S + j`` being slice j of micro-batch m in the forward and slice S-1-j in the
backward (:func:`unit_of`), so forwards run in slice order and backwards in reverse slice order,
and each rank's backwards move S-1 forwards later (a warm-up of S-1 more slices), the way Seq1F1B
(Sun et al., 2024, "Seq1F1B: Efficient Sequence-Level Pipeline Parallelism for Large Language
Model Training") runs 1F1B at slice granularity. It applies to :data:`SEQ_BACKBONES`; schedules
with overlapped F&B pairs, two model copies or two weight versions are refused (one line).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from .schedule_ir import Action, Schedule

if TYPE_CHECKING:
    from .config import Config

SEQ_BACKBONES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min")
"""Backbones Seq1F1B runs on: one model copy, one weight version, and no overlapped F&B pair
(whose forward and backward would belong to different slices' halves of the order)."""


def keys(start: int, end: int) -> int:
    """Attention keys the tokens [start, end) of one causal sequence attend to: sum of (p + 1)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def token_flops(cfg: Config) -> tuple[float, float]:
    """(A, C): forward FLOPs of one token of one sequence over all layers are A + C (p + 1) at
    position p. A counts the linear parts (attention projections 8 h^2; router, shared and
    routed experts in MoE layers; the dense MLP in dense layers), C = 4 h per layer (QK^T and AV
    over one key). Same terms as :meth:`k3sched.cost.CostModel.flops`."""
    m = cfg.model
    h, f = m.hidden, m.expert_hidden
    moe = 2 * h * m.experts + 6 * h * f * m.shared_experts + 6 * h * f * m.top_k
    dense = 6 * h * m.ffn_dense_hidden
    n_moe = m.layers - m.dense_layers
    a = m.layers * 8 * h * h + n_moe * moe + m.dense_layers * dense
    return float(a), float(4 * h * m.layers)


def _cut(a: float, c: float, length: int, chunks: int) -> list[int]:
    """Boundaries e_1 .. e_{S-1} where the cumulative cost ``a e + c e (e+1) / 2`` reaches j / S
    of the whole, rounded to whole tokens, strictly increasing, every slice >= 1 token."""
    total = a * length + c * length * (length + 1) / 2
    lin = a + c / 2
    cuts: list[int] = []
    prev = 0
    for j in range(1, chunks):
        target = total * j / chunks
        e = 2 * target / (lin + math.sqrt(lin * lin + 2 * c * target))  # the root of c/2 e^2 + lin e = target
        cut = min(max(round(e), prev + 1), length - (chunks - j))
        cuts.append(cut)
        prev = cut
    return cuts


def unit_of(mb: int, j: int | None, op: str, chunks: int) -> int:
    """The backbone unit (its schedule's micro-batch index) of slice ``j`` of micro-batch ``mb``
    for op ``F`` (forward: slices in order) or ``I`` / ``W`` (backward: reverse slice order).
    ``j`` None: a task of the whole micro-batch (gradient-shard copies): its first forward unit
    or its last backward unit."""
    if j is None:
        return mb * chunks + (0 if op == "F" else chunks - 1)
    return mb * chunks + (j if op == "F" else chunks - 1 - j)


def slice_bounds(cfg: Config) -> list[tuple[int, int]]:
    """The token range [start, end) of every slice along the sequence ([Note: sequence slices]):
    ``even`` equal counts, ``compute`` equal forward cost; one slice: ``[(0, seq_len)]``."""
    length, chunks = cfg.model.seq_len, cfg.parallel.seq_chunks
    if chunks == 1:
        return [(0, length)]
    if cfg.parallel.seq_split == "even":
        step = length // chunks
        cuts = [step * j for j in range(1, chunks)]
    else:
        cuts = _cut(*token_flops(cfg), length, chunks)
    edges = [0, *cuts, length]
    return list(zip(edges[:-1], edges[1:]))


def seq_error(cfg: Config) -> str | None:
    """What is wrong with ``parallel.seq_chunks`` / ``seq_split`` for this config, as one line; None
    when nothing is."""
    p, length = cfg.parallel, cfg.model.seq_len
    chunks = p.seq_chunks
    if chunks == 1:
        return None
    if cfg.schedule.pipeline not in SEQ_BACKBONES:
        return (f"parallel.seq_chunks: Seq1F1B slices run on {', '.join(SEQ_BACKBONES)} (one model copy, one "
                f"weight version, no overlapped F&B pairs); schedule.pipeline is {cfg.schedule.pipeline}; allowed: "
                f"seq_chunks 1 or one of those backbones")
    if chunks > length:
        return (f"parallel.seq_chunks: every slice needs at least one token, so at most model.seq_len "
                f"({length}); got {chunks}")
    if p.seq_split == "even" and length % chunks:
        return (f"parallel.seq_chunks: must divide model.seq_len ({length}) under parallel.seq_split even; got "
                f"{chunks}; allowed: a divisor of {length}, or seq_split compute")
    return None


def seq1f1b(base: Schedule, chunks: int) -> Schedule:
    """Seq1F1B on ``base``, a backbone generated over M * S units ([Note: sequence slices]): unit
    ``u`` is slice ``u % S`` of micro-batch ``u // S`` in its forward and slice ``S-1 - u % S`` in its
    backward (:func:`unit_of`). Each rank keeps its forward order and its backward order and
    moves every backward action S-1 forwards later (the warm-up of S-1 more slices, as the
    Seq1F1B paper does for 1F1B), or further where the backbone needs it: a backward of
    micro-batch m waits until the rank has run the forward of m's last slice.

    [Note: one Seq1F1B shift for every rank] The shift a rank needs depends on where its
    backwards sit, and on the V schedules (zb-v, v-half) ranks need different shifts. A rank that
    moves its backwards further than its neighbour then runs forwards of the V's second leg before a
    backward its neighbour waits on, and the backbone deadlocks (zb-v, 4 slices, pp 4, 8 or 16; v-half
    at pp 8 and 16). When the per-rank shifts give an invalid backbone, every rank takes the largest
    shift: a longer warm-up, and valid in every case checked (tests/unit/k3sched/test_seq_slices.py). Backbones that
    are valid with their own shifts (every 1F1B, interleaved and ZB-H case, zb-v with 2 slices) are kept as
    they were. Returns a valid backbone (checked once) or raises ValueError as
    :func:`k3sched.schedules.check` does."""
    from .schedules import check, validate

    out = _shifted(base, chunks, uniform=False)
    if validate(out):
        out = check(_shifted(base, chunks, uniform=True))
    return out


def _shifted(base: Schedule, chunks: int, *, uniform: bool) -> Schedule:
    """:func:`seq1f1b` with each rank's own backward shift, or with the largest one on every rank."""
    ranks: dict[int, tuple[list, list, int]] = {}
    for r, slots in base.ranks.items():
        fwd = [a for a in slots if a.op == "F"]
        at = {(a.vstage, a.mb): i for i, a in enumerate(fwd)}
        bwd: list[tuple[int, Action]] = []  # (forwards before it in base, action)
        n = 0
        for a in slots:
            if not isinstance(a, Action):
                raise ValueError(f"{base.name}: Seq1F1B needs single actions per slot; got {a}")
            if a.op == "F":
                n += 1
            else:
                bwd.append((n, a))
        need = max((at[(a.vstage, a.mb // chunks * chunks + chunks - 1)] + 1 - k for k, a in bwd), default=0)
        ranks[r] = (fwd, bwd, max(chunks - 1, need))
    widest = max((v[2] for v in ranks.values()), default=0)
    out: dict[int, list] = {}
    for r, (fwd, bwd, shift) in ranks.items():
        shift = widest if uniform else shift
        order: list = []
        i = 0
        for k, a in bwd:
            while i < min(k + shift, len(fwd)):
                order.append(fwd[i])
                i += 1
            order.append(a)
        order.extend(fwd[i:])
        out[r] = order
    return replace(base, ranks=out)


def slice_times_us(plan) -> list[float]:
    """Compute time of each slice of micro-batch 0 through its slowest stage (its forward, dX and
    dW tasks on the compute lane), µs: the unit of work Seq1F1B pipelines. Empty for an unsliced
    plan."""
    chunks = plan.cfg.parallel.seq_chunks
    if chunks == 1:
        return []
    per: dict[tuple[int, int], float] = {}
    for t in plan.tasks.values():
        if t.mb == 0 and t.slice is not None and t.lane == "compute":
            per[(t.stage, t.slice)] = per.get((t.stage, t.slice), 0.0) + t.duration_us
    stages = {s for s, _ in per}
    slowest = max(stages, key=lambda s: sum(per.get((s, j), 0.0) for j in range(chunks)))
    return [per.get((slowest, j), 0.0) for j in range(chunks)]


def slices_line(plan) -> str:
    """One line for ``k3sched plan``: the slices' token ranges and times ([Note: sequence slices])."""
    cfg = plan.cfg
    bounds = slice_bounds(cfg)
    times = slice_times_us(plan)
    return (f"slices: S={cfg.parallel.seq_chunks} {cfg.parallel.seq_split}: tokens "
            + "/".join(str(e - s) for s, e in bounds)
            + "; time per slice (slowest stage, F+B+W) " + "/".join(f"{t / 1e3:.3f}" for t in times)
            + f" ms; largest {max(times) / 1e3:.3f} ms")
