"""The functions the MoE model is built from: RMSNorm, routing (top-k, the sequence-wise aux loss
and its sliced form, the router skew bias), the offset causal mask of a sequence slice, the
parameter initialisation shared by every rank and the reference path, and the plain SwiGLU of the
reference path. :mod:`moe.model` composes them into the sub-ops of the plan's task kinds."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.config import MoEModelArgs
from moe.split import SubOpCtx


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """``x / rms(x)`` over the last dim (the RMSNorm weight is applied by the caller)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def norm_scale(c: SubOpCtx, suffix: str, x: Tensor, weight: nn.Parameter, eps: float, recompute: bool
               ) -> tuple[Tensor, tuple | None]:
    """``RMSNorm(x) * weight`` in context ``c`` (weight gradient deferred). Returns the output and,
    with ``recompute``, the recipe that recomputes it for the WGrad slot of the GEMM it feeds
    (None without): see [Note: element-wise recompute]."""
    if not recompute:
        return c.scale(suffix, rms_normalize(x, eps), weight), None
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # the ops of rms_normalize, r kept by name
    out = c.scale(suffix, x * r, weight, recompute=(_mul, (x, r)))
    return out, (lambda x_, r_: (x_ * r_) * weight, (x, r))


def _mul(a: Tensor, b: Tensor) -> Tensor:
    return a * b


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """Routers run in fp32 at least."""
    return torch.promote_types(dtype, torch.float32)


def sequence_aux_loss(scores_TE: Tensor, topk_idx_TK: Tensor, batch: int) -> Tensor:
    """Sequence-wise load-balancing loss averaged over the ``batch`` sequences of the tokens."""
    T, E = scores_TE.shape
    K = topk_idx_TK.shape[1]
    S = T // batch
    counts_BE = F.one_hot(topk_idx_TK, E).sum(1).view(batch, S, E).sum(1).to(scores_TE.dtype)
    f_BE = counts_BE * (E / (S * K))
    p_BE = scores_TE.view(batch, S, E).mean(1)
    return (f_BE * p_BE).sum(-1).mean()


def sliced_aux_value(counts_BE: Tensor, psum_BE: Tensor, seq_len: int, top_k: int) -> Tensor:
    """:func:`sequence_aux_loss` from the whole sequences' routed slot counts and score sums
    (summed over the slices of a micro-batch)."""
    E = counts_BE.shape[1]
    return ((counts_BE * (E / (seq_len * top_k))) * (psum_BE / seq_len)).sum(-1).mean()


def sliced_aux_grad(counts_BE: Tensor, seq_len: int, top_k: int, aux_grad: float) -> Tensor:
    """Gradient of ``aux_grad * aux`` with respect to one slice's score sums ``psum_BE``: the aux
    loss is ``mean_b sum_e f_be P_be`` with ``P_be = psum_be (summed over slices) / S``, linear in
    every slice's sums, so this is ``aux_grad * f_BE / (B S)`` with the whole sequence's ``f``."""
    B, E = counts_BE.shape
    return counts_BE * (E / (seq_len * top_k)) * (aux_grad / (B * seq_len))


def offset_causal_mask(start: int, end: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[end - start, end]`` additive mask: query ``start + i`` attends to keys ``0 .. start + i``
    (0), the later keys get half the dtype's lowest value, which softmax turns into exactly 0
    weight like -inf. Finite on purpose: SDPA saves the mask for its backward, and a -inf in a
    saved tensor becomes NaN under FP8 storage (``schedule.act_quant: fp8``)."""
    later = torch.arange(end, device=device)[None, :] > torch.arange(start, end, device=device)[:, None]
    return torch.zeros(later.shape, dtype=dtype, device=device).masked_fill_(later, torch.finfo(dtype).min / 2)


def skew_bias(experts: int, skew: float, dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """The fixed router-logit bias ``-skew * ln(e + 1)`` of expert e (``MoEModelArgs.router_skew``):
    it multiplies expert e's softmax score by ``(e + 1) ** -skew`` ([Note: router skew] in
    k3sched/balance.py)."""
    return -skew * torch.log1p(torch.arange(experts, dtype=torch.float64, device=device)).to(dtype)


def contiguous_slots(experts: int, ep_size: int) -> tuple[tuple[int, ...], ...]:
    """The placement without replicas: expert e on EP rank ``e // (experts / ep_size)``."""
    L = experts // ep_size
    return tuple(tuple(range(r * L, (r + 1) * L)) for r in range(ep_size))


def route(scores_TE: Tensor, expert_bias_E: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """Top-k selection on ``scores + bias`` (bias affects selection only); gather the weights."""
    topk_idx_TK = torch.topk(scores_TE.detach() + expert_bias_E, top_k, dim=-1).indices
    w_TK = scores_TE.gather(1, topk_idx_TK)
    if normalize:
        denom = w_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(w_TK.dtype).eps)
        w_TK = w_TK / denom
    return topk_idx_TK, w_TK


def init_full_state(args: MoEModelArgs, seed: int) -> dict[str, Tensor]:
    """Deterministic full (all experts) weights on CPU: the same on every rank for a seed."""
    g = torch.Generator().manual_seed(seed)
    dt = args.torch_dtype
    D, V, E, F_, Fd = args.hidden, args.vocab, args.experts, args.expert_hidden, args.dense_hidden
    Fs = args.shared_experts * F_

    def mat(*shape: int) -> Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1])).to(dt)

    def norm() -> Tensor:
        return (1.0 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)).to(dt)

    state: dict[str, Tensor] = {"embed": mat(V, D)}
    for i in range(args.layers):
        p = f"layers.{i}."
        state.update({p + "attn_norm": norm(), p + "wqkv": mat(3 * D, D), p + "wo": mat(D, D),
                      p + "ffn_norm": norm()})
        if args.is_moe_layer(i):
            state.update({p + "gate": mat(E, D), p + "expert_bias": torch.zeros(E, dtype=router_dtype(dt)),
                          p + "w1": mat(E, F_, D), p + "w3": mat(E, F_, D), p + "w2": mat(E, D, F_)})
            if Fs:
                state.update({p + "shared_w1": mat(Fs, D), p + "shared_w3": mat(Fs, D),
                              p + "shared_w2": mat(D, Fs)})
        else:
            state.update({p + "mlp_w1": mat(Fd, D), p + "mlp_w3": mat(Fd, D), p + "mlp_w2": mat(D, Fd)})
    state.update({"final_norm": norm(), "head": mat(V, D)})
    return state


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


def swiglu_reference(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
