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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Config


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
    if chunks > length:
        return (f"parallel.seq_chunks: every slice needs at least one token, so at most model.seq_len "
                f"({length}); got {chunks}")
    if p.seq_split == "even" and length % chunks:
        return (f"parallel.seq_chunks: must divide model.seq_len ({length}) under parallel.seq_split even; got "
                f"{chunks}; allowed: a divisor of {length}, or seq_split compute")
    return None
