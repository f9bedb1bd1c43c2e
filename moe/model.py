"""MoE transformer whose sub-ops are the plan's task kinds (see k3sched.tasks.Kind).

Shape legend: see :mod:`moe.context`.

The task graph of a layer and a micro-batch's tasks in order ([Note: sub-op graph of one layer],
``INTRA_LAYER_DEPS``, :func:`run_microbatch_in_order`) are in :mod:`moe.taskgraph`.

[Note: element-wise recompute]
With ``MoEModelArgs.recompute`` (``schedule.recompute``) the cheap element-wise ops keep their
inputs, not their outputs, and the dX task recomputes what is needed:
  SwiGLU (shared, expert, mlp): ``split._SwiGLU`` saves h1 and h3 (not silu(h1)) and recomputes
      silu(h1) in its backward; the w2 GEMM's WGrad input silu(h1) * h3 is not saved by the forward
      but recomputed at the end of the dX task (``SubOpCtx`` recipes) from the kept h1, h3.
  RMSNorm (attn_norm, ffn_norm, final_norm): autograd keeps x and rstd anyway; the normalised
      output (the norm weight's WGrad input) and the scaled output (the following GEMM's WGrad
      input: wqkv, head) are recomputed at the end of the dX task from x and rstd.
Same ops on the same operands: bitwise identical to storing (tests/unit/offload/test_quant_recompute.py). What
a dX task leaves for the dW task is unchanged; what the forward keeps shrinks (runtime/measure.py
measures it per op: [Note: measured saved bytes]).

[Note: sequence slices in the model]
A micro-batch cut into slices ([Note: sequence slices] in k3sched/seqslice.py) runs as one task
state per slice (:meth:`MoEModel.new_slices`: slice j holds the tokens [s_j, e_j) of every
sequence) sharing a :class:`moe.context.SequenceState`. Every result equals the unsliced model's:
  attention  slice j's queries attend to the keys / values of tokens [0, e_j): the earlier
             slices' (kept per layer in the state; they enter slice j's attn sub-op through
             ``tap``, so its attn.dx yields their gradients) concatenated with its own, under the
             causal mask offset by s_j (slice 0: plain ``is_causal``). Slice j's K / V are outputs
             of its attn sub-op; attn.dx of slice j adds the earlier slices' K / V gradients into the
             state, and attn.dx of slice i passes the sum over the later slices as the gradient of
             its K / V outputs, so backward runs in reverse slice order (checked: the state counts
             the contributions). The last slice's attn.fwd drops the layer's kept K / V.
  loss       the head's cross-entropy of a slice is the sum over its tokens / (B * S), so the
             slices' values add up to the unsliced mean.
  aux loss   ``mean_b sum_e f_be P_be`` needs every slice's routing for ``f`` (counts), while
             ``P`` (mean scores) is linear in the slices: each slice's router outputs its score
             sums ``psum_BE``; its router.bwd applies ``f_BE / (B S)`` (:func:`sliced_aux_grad`)
             with the whole sequence's counts, complete because every slice's forward precedes any
             slice's backward of the micro-batch (checked). The aux value is set (``LayerCtx.aux``)
             on the slice whose router.fwd completes the layer's counts.
  the rest   per token (norms, projections, router, experts, dispatch / combine per slice, head,
             embedding): unchanged; weight gradients accumulate over the slices' dW tasks.
Equality within rounding (fp32 1e-5): tests/unit/moe/test_seq_runtime.py. An unsliced micro-batch (slice
None) runs exactly the code it ran before.

Loss: ``ce + aux_loss_coef * sum_layers aux`` with a sequence-wise aux loss (DeepSeek-V3 style:
per sequence ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the sequence's K*S slots routed
to e and ``P_e`` its mean score, averaged over sequences). It is linear in the sequences, so
splitting a batch over data-parallel / EP ranks and averaging their losses gives the same value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3sched.tasks import Kind
from moe.comm import ProcessGroup, all_to_all_uneven, exchange_counts, group_size
from moe.config import MoEModelArgs
from moe.context import LayerCtx, MicroBatch, RoutingPlan, SequenceState, zero_scalar_like
from moe.split import SubOpCtx, swiglu
from moe.taskgraph import LAYER_KINDS, MICROBATCH_KINDS

from moe.functional import (offset_causal_mask, empty_param, swiglu_reference, contiguous_slots, init_full_state,
                            norm_scale, rms_normalize, route, router_dtype, sequence_aux_loss, skew_bias,
                            sliced_aux_grad, sliced_aux_value)

EXPERT_PARAMS: frozenset[str] = frozenset({"w1", "w3", "w2"})
"""Block parameter names sharded over EP ranks (dim 0 = expert)."""


class Block(nn.Module):
    """One transformer block; its methods are the per-layer sub-op tasks."""

    def __init__(self, args: MoEModelArgs, layer: int, ep_rank: int, ep_size: int,
                 device: torch.device | None, slots: tuple[tuple[int, ...], ...] | None = None) -> None:
        super().__init__()
        self.args, self.layer, self.ep_rank, self.ep_size = args, layer, ep_rank, ep_size
        self.is_moe = args.is_moe_layer(layer)
        dt, D = args.torch_dtype, args.hidden
        self.attn_norm = empty_param(D, dtype=dt, device=device)
        self.wqkv = empty_param(3 * D, D, dtype=dt, device=device)
        self.wo = empty_param(D, D, dtype=dt, device=device)
        self.ffn_norm = empty_param(D, dtype=dt, device=device)
        if self.is_moe:
            if args.experts % ep_size:
                raise ValueError(f"experts ({args.experts}) must be a multiple of the EP size ({ep_size})")
            self._set_slots(slots or contiguous_slots(args.experts, ep_size))
            L, F_, Fs = self.num_local_experts, args.expert_hidden, args.shared_experts * args.expert_hidden
            self.gate = empty_param(args.experts, D, dtype=dt, device=device)
            self.register_buffer("expert_bias", torch.zeros(args.experts, dtype=router_dtype(dt), device=device))
            self.w1 = empty_param(L, F_, D, dtype=dt, device=device)
            self.w3 = empty_param(L, F_, D, dtype=dt, device=device)
            self.w2 = empty_param(L, D, F_, dtype=dt, device=device)
            if Fs:
                self.shared_w1 = empty_param(Fs, D, dtype=dt, device=device)
                self.shared_w3 = empty_param(Fs, D, dtype=dt, device=device)
                self.shared_w2 = empty_param(D, Fs, dtype=dt, device=device)
        else:
            Fd = args.dense_hidden
            self.mlp_w1 = empty_param(Fd, D, dtype=dt, device=device)
            self.mlp_w3 = empty_param(Fd, D, dtype=dt, device=device)
            self.mlp_w2 = empty_param(D, Fd, dtype=dt, device=device)

    def _set_slots(self, slots: tuple[tuple[int, ...], ...]) -> None:
        """[Note: expert placement] (k3sched/balance.py): ``slots[r][s]`` is the expert in slot s of
        EP rank r; this rank's weights hold its slots' experts. Global slot id ``g = r * L + s``."""
        E, R = self.args.experts, self.ep_size
        if len(slots) != R or len({len(row) for row in slots}) != 1:
            raise ValueError(f"layer {self.layer}: a placement needs {R} rows of equal length; got {slots}")
        L = len(slots[0])
        table: list[list[int]] = [[] for _ in range(E)]
        for r, row in enumerate(slots):
            for s_, e in enumerate(row):
                table[e].append(r * L + s_)
        if any(not t for t in table):
            raise ValueError(f"layer {self.layer}: expert {next(e for e, t in enumerate(table) if not t)} has no slot")
        self.slots, self.num_local_experts = tuple(tuple(r) for r in slots), L
        self.local_experts = self.slots[self.ep_rank]
        self.identity_slots = self.slots == contiguous_slots(E, R)
        width = max(len(t) for t in table)
        cpu = torch.device("cpu")  # plain CPU tensors (not buffers), also when built under a meta device
        self._replica_n_E = torch.tensor([len(t) for t in table], dtype=torch.int64, device=cpu)
        self._replica_EM = torch.tensor([t + [t[0]] * (width - len(t)) for t in table], dtype=torch.int64,
                                        device=cpu)
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self.reset_routing_counts()

    def reset_routing_counts(self) -> None:
        """Zero the routing counters: ``routed_E`` (this rank's routed slots per expert) and
        ``routed_G`` (per global slot, i.e. per replica) since the last reset (dispatch.fwd adds)."""
        E, G = self.args.experts, self.ep_size * self.num_local_experts
        self.routed_E = torch.zeros(E, dtype=torch.int64, device="cpu")
        self.routed_G = torch.zeros(G, dtype=torch.int64, device="cpu")

    def physical_slots(self, flat_P: Tensor, counts_E: Tensor) -> Tensor:
        """Global slot of every routed (token, k) slot: the j-th of this rank's c slots for expert e
        (token order) goes to e's replica ``j * n // c`` of n ([Note: expert placement])."""
        if self.identity_slots:
            return flat_P
        dev = flat_P.device
        if dev not in self._tables:
            self._tables[dev] = (self._replica_n_E.to(dev), self._replica_EM.to(dev))
        n_E, table_EM = self._tables[dev]
        order0 = torch.argsort(flat_P, stable=True)
        e_sorted = flat_P[order0]
        start_E = torch.cumsum(counts_E, 0) - counts_E
        pos = torch.arange(flat_P.numel(), device=dev) - start_E[e_sorted]
        j = (pos * n_E[e_sorted]) // counts_E[e_sorted]
        slot_P = torch.empty_like(flat_P)
        slot_P[order0] = table_EM[e_sorted, j]
        return slot_P

    @property
    def has_shared(self) -> bool:
        return self.is_moe and self.args.shared_experts > 0

    def _check_group(self, group: ProcessGroup | None) -> None:
        if group_size(group) != self.ep_size:
            raise ValueError(f"layer {self.layer}: EP group of size {group_size(group)} but the model was "
                             f"sharded for EP size {self.ep_size}")

    # -- forward ---------------------------------------------------------------------------------
    def attn_fwd(self, lc: LayerCtx, x_BSD: Tensor, seq: SequenceState | None = None, j: int | None = None
                 ) -> None:
        """attn.fwd: attention sub-layer plus the FFN pre-norm; sets ``h_BSD`` and ``xn_TD``. For
        slice ``j`` of a sliced micro-batch (``seq``), ``S`` is the slice's length and the queries
        attend over the earlier slices' keys / values too ([Note: sequence slices in the model])."""
        a = self.args
        B, S, D = x_BSD.shape
        c = lc.attn = SubOpCtx("attn")
        with c.recording():
            x = c.tap("x", x_BSD)
            n, n_recipe = norm_scale(c, "attn_norm", x, self.attn_norm, a.rms_eps, a.recompute)
            qkv = c.linear("wqkv", n, self.wqkv, recompute=n_recipe)
            q, k, v = qkv.view(B, S, 3, a.heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            if seq is None or j == 0:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(q, *self._kv_prefix(c, seq, j, k, v),
                                                   attn_mask=offset_causal_mask(*seq.bounds[j], q.dtype, q.device))
            o_BSD = o.transpose(1, 2).reshape(B, S, D)
            if seq is not None:  # later slices attend to this slice's K / V
                seq.keep_kv(self.layer, j, (c.output("k", k), c.output("v", v)) if j < seq.slices - 1 else None)
            h = x + c.linear("wo", o_BSD, self.wo)
            xn, _ = norm_scale(c, "ffn_norm", h, self.ffn_norm, a.rms_eps, a.recompute)
            lc.h_BSD = c.output("h", h)
            lc.xn_TD = c.output("xn", xn.reshape(B * S, D))

    def _kv_prefix(self, c: SubOpCtx, seq: SequenceState, j: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of tokens [0, end of slice j): the earlier slices' (tapped, so slice j's
        attn.dx yields their gradients) and this slice's, concatenated along the sequence."""
        ks, vs = [], []
        for i, (ki, vi) in enumerate(seq.prefix(self.layer, j)):
            ks.append(c.tap(f"k{i}", ki))
            vs.append(c.tap(f"v{i}", vi))
        return torch.cat([*ks, k], dim=2), torch.cat([*vs, v], dim=2)

    def router_fwd(self, lc: LayerCtx, batch: int, seq: SequenceState | None = None, j: int | None = None
                   ) -> None:
        """router.fwd: top-k routing of ``xn_TD``; sets ``topk_idx_TK``, ``topk_w_TK``, ``aux``
        (for a slice: the slice's score sums are an output, the aux value is set on the slice that
        completes the sequence's routing; [Note: sequence slices in the model])."""
        c = lc.router = SubOpCtx("router")
        with c.recording():
            xn = c.tap("xn", lc.xn_TD)
            logits_TE = c.linear("gate", xn.to(router_dtype(xn.dtype)), self.gate)
            if self.args.router_skew:
                logits_TE = logits_TE + skew_bias(self.args.experts, self.args.router_skew, logits_TE.dtype,
                                                  logits_TE.device)
            scores_TE = logits_TE.softmax(-1)
            idx, w = route(scores_TE, self.expert_bias, self.args.top_k, self.args.normalize_topk)
            lc.topk_idx_TK = idx
            lc.topk_w_TK = c.output("w", w)
            if seq is None:
                lc.aux = c.output("aux", sequence_aux_loss(scores_TE, idx, batch))
            else:
                E = scores_TE.shape[1]
                psum_BE = c.output("psum", scores_TE.view(batch, -1, E).sum(1))
                counts_BE = F.one_hot(idx, E).sum(1).view(batch, -1, E).sum(1).to(psum_BE.dtype)
                if seq.add_routing(self.layer, counts_BE, psum_BE):
                    lc.aux = sliced_aux_value(seq.counts_BE[self.layer], seq.psum_BE[self.layer], seq.seq_len,
                                              idx.shape[1])

    def dispatch_fwd(self, lc: LayerCtx, group: ProcessGroup | None) -> None:
        """dispatch.fwd: sort slots by expert, exchange counts, all-to-all rows; sets ``recv_ND``."""
        self._check_group(group)
        a, R, L = self.args, self.ep_size, self.num_local_experts
        idx_TK = lc.topk_idx_TK
        K = idx_TK.shape[1]
        flat_P = idx_TK.reshape(-1)
        counts_E = torch.bincount(flat_P, minlength=a.experts)
        slot_P = self.physical_slots(flat_P, counts_E)  # = flat_P without replicas
        order_P = torch.argsort(slot_P, stable=True)
        counts_G = counts_E if self.identity_slots else torch.bincount(slot_P, minlength=R * L)
        self.routed_E += counts_E.cpu()
        self.routed_G += counts_G.cpu()
        recv_counts_RL = exchange_counts(counts_G, group)
        recv_RL_cpu = recv_counts_RL.cpu()
        local_expert_N = torch.repeat_interleave(torch.arange(L).repeat(R), recv_RL_cpu.reshape(-1))
        local_sort_N = torch.argsort(local_expert_N, stable=True).to(flat_P.device)
        lc.plan = RoutingPlan(
            order_P=order_P, token_of_slot_P=order_P // K, inv_order_P=torch.argsort(order_P),
            send_splits=counts_G.view(R, L).sum(1).tolist(), recv_splits=recv_RL_cpu.sum(1).tolist(),
            recv_counts_RL=recv_counts_RL, tokens_per_local_expert=recv_RL_cpu.sum(0).tolist(),
            local_sort_N=local_sort_N, local_unsort_N=torch.argsort(local_sort_N))
        c = lc.dispatch = SubOpCtx("dispatch")
        with c.recording():
            xn = c.tap("xn", lc.xn_TD)
            x_perm_PD = c.output("x_perm", xn.index_select(0, lc.plan.token_of_slot_P))
        if a.dispatch_recompute:
            c.store.put(lc.xn_TD, "recompute", name="dispatch.xn")
        lc.recv_ND = all_to_all_uneven(x_perm_PD, lc.plan.send_splits, lc.plan.recv_splits, group)

    def _swiglu_ffn(self, c: SubOpCtx, xn: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        """``w2(silu(w1 xn) * w3 xn)`` recorded on ``c`` (shared expert, dense MLP); under
        element-wise recompute only h1 and h3 are kept and the product is rebuilt in backward."""
        rc = self.args.recompute
        h1, h3 = c.linear("w1", xn, w1), c.linear("w3", xn, w3)
        a = c.swiglu(h1, h3, rc)
        return c.linear("w2", a, w2, recompute=(swiglu, (h1, h3)) if rc else None)

    def shared_fwd(self, lc: LayerCtx) -> None:
        """shared.fwd: shared-expert SwiGLU of ``xn_TD``; sets ``shared_TD`` (no-op without one)."""
        if not self.has_shared:
            return
        c = lc.shared = SubOpCtx("shared")
        with c.recording():
            out = self._swiglu_ffn(c, c.tap("xn", lc.xn_TD), self.shared_w1, self.shared_w3, self.shared_w2)
            lc.shared_TD = c.output("out", out)

    def expert_fwd(self, lc: LayerCtx) -> None:
        """expert.fwd: grouped SwiGLU over local experts; sets ``expert_out_ND`` (received order)."""
        p = lc.plan
        c = lc.expert = SubOpCtx("expert")
        sizes = p.tokens_per_local_expert
        with c.recording():
            x_ND = c.tap("recv", lc.recv_ND)
            xs_ND = x_ND.index_select(0, p.local_sort_N)
            h1 = c.grouped_linear("w1", xs_ND, self.w1, sizes)
            h3 = c.grouped_linear("w3", xs_ND, self.w3, sizes)
            rc = self.args.recompute
            o_ND = c.grouped_linear("w2", c.swiglu(h1, h3, rc), self.w2, sizes,
                                    recompute=(swiglu, (h1, h3)) if rc else None)
            lc.expert_out_ND = c.output("out", o_ND.index_select(0, p.local_unsort_N))
        if self.args.dispatch_recompute:
            lc.recompute_name = c.slots[0].x_name
            c.store.evict(lc.recompute_name)

    def combine_fwd(self, lc: LayerCtx, group: ProcessGroup | None) -> Tensor:
        """combine.fwd: all-to-all expert outputs back, unpermute, weighted sum, residuals.

        Returns the layer output ``y_BSD`` (detached)."""
        self._check_group(group)
        p = lc.plan
        B, S, D = lc.h_BSD.shape
        T, K = lc.topk_w_TK.shape
        y_perm_PD = all_to_all_uneven(lc.expert_out_ND, p.recv_splits, p.send_splits, group)
        c = lc.combine = SubOpCtx("combine")
        with c.recording():
            y_TKD = c.tap("y_perm", y_perm_PD).index_select(0, p.inv_order_P).view(T, K, D)
            w_TK = c.tap("w", lc.topk_w_TK).to(y_TKD.dtype)
            out_TD = (y_TKD * w_TK.unsqueeze(-1)).sum(1)
            if lc.shared_TD is not None:
                out_TD = out_TD + c.tap("shared", lc.shared_TD)
            y = c.output("y", c.tap("h", lc.h_BSD) + out_TD.view(B, S, D))
        lc.clear_forward_boundaries()
        return y

    def mlp_fwd(self, lc: LayerCtx) -> Tensor:
        """mlp.fwd (dense layer): ``y = h + SwiGLU(xn)``; returns ``y_BSD`` (detached)."""
        B, S, D = lc.h_BSD.shape
        c = lc.mlp = SubOpCtx("mlp")
        with c.recording():
            out = self._swiglu_ffn(c, c.tap("xn", lc.xn_TD), self.mlp_w1, self.mlp_w3, self.mlp_w2)
            y = c.output("y", c.tap("h", lc.h_BSD) + out.view(B, S, D))
        lc.clear_forward_boundaries()
        return y

    # -- backward: input gradients ---------------------------------------------------------------
    def combine_bwd(self, lc: LayerCtx, grad_y_BSD: Tensor, group: ProcessGroup | None) -> None:
        """combine.bwd: combine backward, then all-to-all of expert-output grads to expert ranks."""
        self._check_group(group)
        g = lc.combine.backward_dx({"y": grad_y_BSD})
        lc.grad_h_BSD, lc.grad_topk_w_TK, lc.grad_shared_TD = g["h"], g.get("w"), g.get("shared")
        p = lc.plan
        lc.grad_expert_out_ND = all_to_all_uneven(g["y_perm"], p.send_splits, p.recv_splits, group)

    def expert_dx(self, lc: LayerCtx) -> None:
        """expert.dx: grads of the received rows (expert dW deferred to expert.dw)."""
        g = lc.expert.backward_dx({"out": lc.grad_expert_out_ND})
        lc.grad_expert_out_ND = None
        lc.grad_recv_ND = g["recv"]

    def dispatch_re(self, lc: LayerCtx, group: ProcessGroup | None) -> None:
        """dispatch.re: re-run the dispatch all-to-all from the kept input to refill the expert
        input that expert.dw needs (dispatch recompute, EP-DR)."""
        self._check_group(group)
        if lc.recompute_name is None:
            raise RuntimeError(f"layer {self.layer}: dispatch.re without dispatch recompute")
        p = lc.plan
        xn_TD = lc.dispatch.store.get("dispatch.xn")
        recv_ND = all_to_all_uneven(xn_TD.index_select(0, p.token_of_slot_P), p.send_splits, p.recv_splits, group)
        lc.expert.store.restore(lc.recompute_name, recv_ND.index_select(0, p.local_sort_N))
        lc.dispatch.store.release("dispatch.xn", "recompute")
        lc.recompute_name = None

    def dispatch_bwd(self, lc: LayerCtx, group: ProcessGroup | None) -> None:
        """dispatch.bwd: all-to-all of the received rows' grads back to the token owners, then
        unpermute (index-add) into the grad of ``xn``."""
        self._check_group(group)
        p = lc.plan
        g_perm_PD = all_to_all_uneven(lc.grad_recv_ND, p.recv_splits, p.send_splits, group)
        lc.grad_recv_ND = None
        lc.add_grad_xn(lc.dispatch.backward_dx({"x_perm": g_perm_PD})["xn"])

    def shared_dx(self, lc: LayerCtx) -> None:
        """shared.dx: shared-expert input grad (no-op without shared experts)."""
        if lc.shared is None:
            return
        lc.add_grad_xn(lc.shared.backward_dx({"out": lc.grad_shared_TD})["xn"])
        lc.grad_shared_TD = None

    def router_bwd(self, lc: LayerCtx, aux_grad: float, seq: SequenceState | None = None, j: int | None = None
                   ) -> None:
        """router.bwd: router dX and dW together (from the weights' grads and the aux loss; for a
        slice, the aux gradient of its score sums uses the whole sequence's counts)."""
        grads = {"w": lc.grad_topk_w_TK}
        if aux_grad and seq is None:
            grads["aux"] = zero_scalar_like(lc.aux, aux_grad)
        elif aux_grad:
            grads["psum"] = sliced_aux_grad(seq.full_counts(self.layer, j), seq.seq_len, self.args.top_k, aux_grad)
        g = lc.router.backward_dx(grads)
        lc.router.apply_wgrad()
        lc.grad_topk_w_TK = None
        lc.add_grad_xn(g["xn"])

    def mlp_dx(self, lc: LayerCtx, grad_y_BSD: Tensor) -> None:
        """mlp.dx: dense MLP input grads (grads of ``xn`` and of the residual ``h``)."""
        g = lc.mlp.backward_dx({"y": grad_y_BSD})
        lc.grad_h_BSD = g["h"]
        lc.add_grad_xn(g["xn"])

    def attn_dx(self, lc: LayerCtx, seq: SequenceState | None = None, j: int | None = None) -> Tensor:
        """attn.dx: grad of the layer input from the grads of ``h`` and ``xn`` (for slice j, also of
        its K / V from the later slices; it adds the gradients of the earlier slices' K / V)."""
        grads = {"h": lc.grad_h_BSD, "xn": lc.grad_xn_TD}
        if seq is not None:
            grads["k"], grads["v"] = seq.take_grad_kv(self.layer, j)
        g = lc.attn.backward_dx(grads)
        lc.clear_backward_boundaries()
        for i in range(j or 0):
            seq.add_grad_kv(self.layer, i, g[f"k{i}"], g[f"v{i}"])
        return g["x"]

    # -- plain autograd reference ---------------------------------------------------------------
    def reference_forward(self, x_BSD: Tensor) -> tuple[Tensor, Tensor | None]:
        """Plain-autograd forward of the block with all experts local (a loop over experts)."""
        a = self.args
        B, S, D = x_BSD.shape
        n = rms_normalize(x_BSD, a.rms_eps) * self.attn_norm
        q, k, v = F.linear(n, self.wqkv).view(B, S, 3, a.heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, D)
        h = x_BSD + F.linear(o, self.wo)
        xn_TD = (rms_normalize(h, a.rms_eps) * self.ffn_norm).reshape(B * S, D)
        if not self.is_moe:
            return h + swiglu_reference(xn_TD, self.mlp_w1, self.mlp_w3, self.mlp_w2).view(B, S, D), None
        if self.ep_size != 1:
            raise ValueError("the reference path needs every expert local (EP size 1)")
        rdt = router_dtype(xn_TD.dtype)
        logits_TE = F.linear(xn_TD.to(rdt), self.gate.to(rdt))
        if a.router_skew:
            logits_TE = logits_TE + skew_bias(a.experts, a.router_skew, logits_TE.dtype, logits_TE.device)
        scores_TE = logits_TE.softmax(-1)
        idx_TK, w_TK = route(scores_TE, self.expert_bias, a.top_k, a.normalize_topk)
        aux = sequence_aux_loss(scores_TE, idx_TK, B)
        out_TD = torch.zeros_like(xn_TD)
        for e in range(a.experts):
            tok, slot = (idx_TK == e).nonzero(as_tuple=True)
            if tok.numel():
                y = swiglu_reference(xn_TD[tok], self.w1[e], self.w3[e], self.w2[e])
                out_TD = out_TD.index_add(0, tok, y * w_TK[tok, slot].unsqueeze(-1).to(y.dtype))
        if self.has_shared:
            out_TD = out_TD + swiglu_reference(xn_TD, self.shared_w1, self.shared_w3, self.shared_w2)
        return h + out_TD.view(B, S, D), aux


_HANDLERS: Mapping[Kind, str] = MappingProxyType({k: "_run_" + k.value.replace(".", "_")
                                                 for k in LAYER_KINDS | MICROBATCH_KINDS})


class MoEModel(nn.Module):
    """Embedding -> blocks -> final norm + head + cross-entropy, with EP-sharded experts.

    Build with :meth:`build` (from a seed) or :meth:`from_full_state` (from full weights); expert
    ``e`` lives on EP rank ``e // (experts / ep_size)``, or where ``slots`` puts it (replicas
    included, [Note: expert placement] in k3sched/balance.py). Execute with :meth:`new_microbatch` and
    :meth:`run` per task (see [Note: sub-op graph of one layer] in moe/taskgraph.py), or
    :func:`run_microbatch_in_order`.
    """

    def __init__(self, args: MoEModelArgs, *, ep_rank: int = 0, ep_size: int = 1,
                 device: torch.device | str | None = None, slots: tuple[tuple[int, ...], ...] | None = None) -> None:
        super().__init__()
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank {ep_rank} not in [0, {ep_size})")
        device = torch.device(device) if device is not None else None
        self.args, self.ep_rank, self.ep_size = args, ep_rank, ep_size
        self.slots = tuple(tuple(r) for r in slots) if slots is not None else contiguous_slots(args.experts, ep_size)
        dt = args.torch_dtype
        self.embed = empty_param(args.vocab, args.hidden, dtype=dt, device=device)
        self.layers = nn.ModuleList(Block(args, i, ep_rank, ep_size, device, self.slots)
                                    for i in range(args.layers))
        self.final_norm = empty_param(args.hidden, dtype=dt, device=device)
        self.head = empty_param(args.vocab, args.hidden, dtype=dt, device=device)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_full_state(cls, args: MoEModelArgs, state: Mapping[str, Tensor], *, ep_rank: int = 0,
                        ep_size: int = 1, device: torch.device | str | None = None,
                        slots: tuple[tuple[int, ...], ...] | None = None) -> MoEModel:
        """Model holding the local expert slots of full weights ``state`` (see init_full_state)."""
        model = cls(args, ep_rank=ep_rank, ep_size=ep_size, device=device, slots=slots)
        local = {name: model.shard_of(name, t) for name, t in state.items()}
        model.load_state_dict(local, strict=True)
        return model

    @classmethod
    def build(cls, args: MoEModelArgs, seed: int, *, ep_rank: int = 0, ep_size: int = 1,
              device: torch.device | str | None = None, slots: tuple[tuple[int, ...], ...] | None = None) -> MoEModel:
        """Model with weights ``init_full_state(args, seed)`` (identical across EP sizes and placements)."""
        return cls.from_full_state(args, init_full_state(args, seed), ep_rank=ep_rank, ep_size=ep_size,
                                   device=device, slots=slots)

    @staticmethod
    def is_expert_param(name: str) -> bool:
        """Whether parameter ``name`` is sharded over EP ranks (dim 0 = expert)."""
        return name.rsplit(".", 1)[-1] in EXPERT_PARAMS

    def shard_of(self, name: str, full: Tensor) -> Tensor:
        """This rank's slots of the full tensor ``name`` (the tensor itself if not sharded)."""
        if not self.is_expert_param(name):
            return full
        mine = self.slots[self.ep_rank]
        if mine == tuple(range(mine[0], mine[0] + len(mine))):
            return full[mine[0]:mine[0] + len(mine)]
        return full[list(mine)]

    # -- task execution --------------------------------------------------------------------------
    def new_microbatch(self, tokens_BS: Tensor, targets_BS: Tensor, *, index: int = 0,
                       loss_scale: float = 1.0) -> MicroBatch:
        """Fresh task state for one micro-batch of token ids ``[B, S]``."""
        n = self.args.layers
        return MicroBatch(index=index, tokens_BS=tokens_BS, targets_BS=targets_BS, loss_scale=loss_scale,
                          layers=[LayerCtx(i, self.args.is_moe_layer(i)) for i in range(n)],
                          acts=[None] * (n + 1), grads=[None] * (n + 1))

    def new_slices(self, tokens_BS: Tensor, targets_BS: Tensor, bounds: list[tuple[int, int]], *, index: int = 0,
                   loss_scale: float = 1.0) -> list[MicroBatch]:
        """Task states of the slices ``bounds`` ([start, end) along the sequence, contiguous from 0
        to the sequence's length) of one micro-batch, sharing one :class:`SequenceState`
        ([Note: sequence slices in the model])."""
        B, S = tokens_BS.shape
        edges = [b for se in bounds for b in se]
        if not bounds or edges[0] != 0 or edges[-1] != S or any(
                a >= b for a, b in bounds) or any(e != s for e, s in zip(edges[1:-1:2], edges[2::2])):
            raise ValueError(f"slice bounds {list(bounds)} do not cut [0, {S}) into contiguous non-empty slices")
        seq = SequenceState(tuple((int(a), int(b)) for a, b in bounds), B)
        out = []
        for j, (a, b) in enumerate(seq.bounds):
            mb = self.new_microbatch(tokens_BS[:, a:b], targets_BS[:, a:b], index=index, loss_scale=loss_scale)
            mb.slice, mb.seq = j, seq
            out.append(mb)
        return out

    def sliced_loss(self, slices: list[MicroBatch]) -> Tensor:
        """The loss of a micro-batch run as ``slices`` (detached): the slices' cross-entropy shares
        plus ``aux_loss_coef`` times the layers' aux values (each on the slice that completed its
        layer's routing); the unsliced ``MicroBatch.loss``. Needs the head and every slice's forward."""
        if any(mb.ce is None for mb in slices):
            raise RuntimeError("sliced_loss: a slice's head.fwd has not run")
        aux = [lc.aux for mb in slices for lc in mb.layers if lc.aux is not None]
        ce = sum(mb.ce for mb in slices)
        return ce + self.args.aux_loss_coef * sum(aux) if aux else ce

    def run(self, kind: Kind, mb: MicroBatch, layer: int | None = None,
            ep_group: ProcessGroup | None = None) -> None:
        """Run task ``kind`` of micro-batch ``mb`` (and ``layer`` for per-layer kinds).

        ``ep_group`` is the EP process group (None: EP size 1); only the ep-lane kinds use it.
        Tasks must run in an order that respects ``INTRA_LAYER_DEPS`` and the cross-layer rules.
        """
        name = _HANDLERS.get(Kind(kind))
        if name is None:
            raise ValueError(f"moe model has no handler for task kind {kind!r}")
        if (Kind(kind) in LAYER_KINDS) != (layer is not None):
            raise ValueError(f"task kind {kind!r}: layer must be {'given' if layer is None else 'None'}")
        handler: Callable[[MicroBatch, int | None, ProcessGroup | None], None] = getattr(self, name)
        handler(mb, layer, ep_group)

    def _block(self, layer: int, moe: bool) -> Block:
        block = self.layers[layer]
        if block.is_moe != moe:
            raise ValueError(f"layer {layer} is {'an MoE' if block.is_moe else 'a dense'} layer")
        return block

    def _run_embed_fwd(self, mb: MicroBatch, layer: None, group: ProcessGroup | None) -> None:
        c = mb.embed = SubOpCtx("embed")
        c.embedding_slot(self.embed, mb.tokens_BS)
        mb.acts[0] = self.embed.detach()[mb.tokens_BS]

    def _run_embed_dw(self, mb: MicroBatch, layer: None, group: ProcessGroup | None) -> None:
        c = mb.embed
        c.slots[0].save_grad(mb.grads[0])
        mb.grads[0] = None
        c.dx_done = True
        c.apply_wgrad()

    def _run_head_fwd(self, mb: MicroBatch, layer: None, group: ProcessGroup | None) -> None:
        a = self.args
        c = mb.head = SubOpCtx("head")
        with c.recording():
            x = c.tap("x", mb.acts[-1])
            n, n_recipe = norm_scale(c, "final_norm", x, self.final_norm, a.rms_eps, a.recompute)
            logits = c.linear("head", n, self.head, recompute=n_recipe)
            logits_ND = logits.to(router_dtype(logits.dtype)).reshape(-1, a.vocab)
            if mb.seq is None:
                ce = F.cross_entropy(logits_ND, mb.targets_BS.reshape(-1))
            else:  # this slice's share of the micro-batch's mean: sum over its tokens / all tokens
                ce = F.cross_entropy(logits_ND, mb.targets_BS.reshape(-1), reduction="sum") / (
                    mb.seq.batch * mb.seq.seq_len)
            mb.ce = c.output("loss", ce)
        mb.acts[-1] = None
        if mb.seq is None:
            aux = [lc.aux for lc in mb.layers if lc.aux is not None]
            mb.loss = mb.ce + a.aux_loss_coef * sum(aux) if aux else mb.ce

    def _run_head_dx(self, mb: MicroBatch, layer: None, group: ProcessGroup | None) -> None:
        mb.grads[-1] = mb.head.backward_dx({"loss": zero_scalar_like(mb.ce, mb.loss_scale)})["x"]

    def _run_head_dw(self, mb: MicroBatch, layer: None, group: ProcessGroup | None) -> None:
        mb.head.apply_wgrad()

    def _run_attn_fwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self.layers[layer].attn_fwd(mb.layers[layer], mb.acts[layer], mb.seq, mb.slice)
        mb.acts[layer] = None

    def _run_router_fwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).router_fwd(mb.layers[layer], mb.tokens_BS.shape[0], mb.seq, mb.slice)

    def _run_dispatch_fwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).dispatch_fwd(mb.layers[layer], group)

    def _run_shared_fwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).shared_fwd(mb.layers[layer])

    def _run_expert_fwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).expert_fwd(mb.layers[layer])

    def _run_combine_fwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        mb.acts[layer + 1] = self._block(layer, True).combine_fwd(mb.layers[layer], group)

    def _run_mlp_fwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        mb.acts[layer + 1] = self._block(layer, False).mlp_fwd(mb.layers[layer])

    def _run_combine_bwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).combine_bwd(mb.layers[layer], mb.grads[layer + 1], group)
        mb.grads[layer + 1] = None

    def _run_expert_dx(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).expert_dx(mb.layers[layer])

    def _run_dispatch_re(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).dispatch_re(mb.layers[layer], group)

    def _run_dispatch_bwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).dispatch_bwd(mb.layers[layer], group)

    def _run_shared_dx(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).shared_dx(mb.layers[layer])

    def _run_router_bwd(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, True).router_bwd(mb.layers[layer], self.args.aux_loss_coef * mb.loss_scale, mb.seq,
                                            mb.slice)

    def _run_mlp_dx(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        self._block(layer, False).mlp_dx(mb.layers[layer], mb.grads[layer + 1])
        mb.grads[layer + 1] = None

    def _run_attn_dx(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        mb.grads[layer] = self.layers[layer].attn_dx(mb.layers[layer], mb.seq, mb.slice)

    def _run_attn_dw(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        mb.layers[layer].attn.apply_wgrad()

    def _run_shared_dw(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        lc = mb.layers[layer]
        if lc.shared is not None:
            lc.shared.apply_wgrad()

    def _run_expert_dw(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        mb.layers[layer].expert.apply_wgrad()

    def _run_mlp_dw(self, mb: MicroBatch, layer: int, group: ProcessGroup | None) -> None:
        mb.layers[layer].mlp.apply_wgrad()

    # -- plain autograd reference ----------------------------------------------------------------
    def reference_loss(self, tokens_BS: Tensor, targets_BS: Tensor) -> Tensor:
        """Loss by plain autograd (no task split, every expert local: needs EP size 1)."""
        a = self.args
        x = F.embedding(tokens_BS, self.embed)
        aux: list[Tensor] = []
        for block in self.layers:
            x, layer_aux = block.reference_forward(x)
            if layer_aux is not None:
                aux.append(layer_aux)
        logits = F.linear(rms_normalize(x, a.rms_eps) * self.final_norm, self.head)
        ce = F.cross_entropy(logits.to(router_dtype(logits.dtype)).reshape(-1, a.vocab), targets_BS.reshape(-1))
        return ce + a.aux_loss_coef * sum(aux) if aux else ce

    def forward_backward_reference(self, tokens_BS: Tensor, targets_BS: Tensor, loss_scale: float = 1.0
                                   ) -> Tensor:
        """``reference_loss`` then ``(loss * loss_scale).backward()``; returns the loss (detached)."""
        loss = self.reference_loss(tokens_BS, targets_BS)
        (loss * loss_scale).backward()
        return loss.detach()
