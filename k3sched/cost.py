"""Analytic cost model: durations from FLOPs and bytes, memory of saved activations.

Legend: T tokens per micro-batch per rank (micro_batch_size x seq_len), S sequence length,
h hidden, f expert hidden, F dense hidden, k top-k, E experts, V vocab, b dtype bytes.

FLOPs count a multiply-add as 2. Attention projections (q, k, v, o) are 4 h x h GEMMs; the
causal attention core is QK^T plus AV over half the S x S score matrix per sequence:
2 * 2 * T * S * h / 2 = 2 T S h in forward, twice that in backward (it is all dX). Expert and
shared MLPs are SwiGLU (3 GEMMs of h x f); routed experts see T k tokens per rank on average
(balanced routing: every rank receives what it sends). dX and dW of a GEMM each cost the forward.

Communication ([Note: wire model], :class:`Wire`): all-to-all bytes = T k h b per rank, of which
(ep-1)/ep leave the rank, over NVLink when the EP group fits in a node, else over the NIC; the
dispatch first exchanges token counts (one more call). A layer's DP gradient reduction is costed
as the runtime runs it: a ring all-reduce (2(n-1)/n of the bytes, 2(n-1) steps; dense parameters
over ep*dp ranks, expert parameters over dp), a ring reduce-scatter under ``grad_offload``. A PP
send only posts the transfer; its T h b bytes move in the matching receive (gloo and NCCL move
them once both sides are posted). optim.run costs AdamW per parameter plus the all-reduce of
the embedding / head gradients. Offload / onload go over PCIe; remote offload over the P2P link.

On the CPU runner (``hardware.cpu_runner`` set) compute shares the host's cores and transfers cost
CPU: those terms are :class:`k3sched.cpurunner.CpuRunner`'s (``self.cpu``, None on GPUs; [Note: the
CPU-runner model] in k3sched/cpurunner.py).

A measured profile (YAML, see :func:`k3sched.profile.load_profile`, checked strictly: [Note:
profile document] in k3sched/profile.py)
replaces the analytic duration of any kind:
``durations_us: {attn.fwd: 812.0, ...}`` (per layer and micro-batch), optionally
``bandwidth_gbps: {ep: .., collective: .., offload_local: .., offload_remote: ..}`` and
``saved_bytes: {attn.fwd: [w, x], attn.dx: n, ...}``: measured activation bytes per layer and
micro-batch that replace :meth:`CostModel.saved_bytes` (forward kinds: bytes kept until dW, bytes
kept until dX) and :meth:`CostModel.grad_out_bytes` (dX kinds); a forward kind may also give one
number N (split like the analytic model); ``per_expert_us: {expert.dw: ..}`` the part of an expert
op's time paid per local expert ([Note: per-expert cost]). ``runtime.measure.write_profile``
measures them on the ``moe`` code ([Note: measured saved bytes] in ``runtime/measure.py``).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass

from .config import STORAGE_OPS, Config
from .cpurunner import CpuRunner
from .placement import GroupPlacement, RankOrder, group_placement, stage_pair_crosses
from .profile import Profile, load_profile
from .seqslice import keys
from .tasks import EXPERT_KINDS, LANE_OF, Kind

_FP8_A2A = frozenset({Kind.DISPATCH_FWD, Kind.DISPATCH_RE, Kind.COMBINE_BWD})
"""All-to-alls whose payload feeds an expert GEMM: FP8 under ``schedule.fp8_dispatch``."""

"""Routed-expert GEMMs: their duration follows the busiest EP rank's load ([Note: skewed cost] in
k3sched/balance.py)."""

_GEMM = {
    Kind.ATTN_FWD, Kind.ATTN_DX, Kind.ATTN_DW, Kind.ROUTER_FWD, Kind.ROUTER_BWD, Kind.SHARED_FWD,
    Kind.SHARED_DX, Kind.SHARED_DW, Kind.EXPERT_FWD, Kind.EXPERT_DX, Kind.EXPERT_DW, Kind.MLP_FWD,
    Kind.MLP_DX, Kind.MLP_DW, Kind.HEAD_FWD, Kind.HEAD_DX, Kind.HEAD_DW, Kind.EMBED_FWD, Kind.EMBED_DW,
}


@dataclass(frozen=True)
class Wire:
    """[Note: wire model] What one communication task does on the wire: ``steps`` sequential
    calls or ring steps, each paying the link latency once, and ``terms`` (bytes, link GB/s) that
    move at the same time on different links (the slowest sets the time). ``nbytes``: bytes that
    leave the rank."""

    steps: int = 0
    terms: tuple[tuple[float, float], ...] = ()
    latency_us: float = 0.0

    @property
    def nbytes(self) -> int:
        return int(sum(b for b, _ in self.terms))

    def __add__(self, other: "Wire") -> "Wire":
        """Two calls one after the other on one link kind (bytes add up)."""
        if not self.terms:
            return other
        if not other.terms:
            return self
        g = min(self.terms[0][1], other.terms[0][1])
        return Wire(self.steps + other.steps, ((self.nbytes + other.nbytes, g),), max(self.latency_us, other.latency_us))


@functools.lru_cache(maxsize=64)
def _placement(order: RankOrder, gpus_per_node: int) -> dict[str, GroupPlacement]:
    return group_placement(order, gpus_per_node)


class CostModel:
    """Durations (µs), FLOPs, bytes moved and activation bytes of every task kind of a config."""

    def __init__(self, cfg: Config, profile: Profile | None = None):
        self.cfg = cfg
        if profile is None and cfg.schedule.profile:
            profile = load_profile(cfg.schedule.profile)
        self.profile = profile or Profile()
        m, p, hw = cfg.model, cfg.parallel, cfg.hardware
        self.cpu = CpuRunner(self, hw.cpu_runner) if hw.cpu_runner is not None else None
        self.T = m.tokens
        self.b = m.dtype_bytes
        self._flops_per_us = hw.peak_tflops * hw.mfu * 1e6  # TFLOP/s -> FLOP/µs
        gpn = hw.gpus_per_node
        # Links from the rank order's placement ([Note: rank order] in k3sched/placement.py): a
        # group is on NVLink when all its ranks share a node; pp_link is the worst adjacent pair's.
        self.order = RankOrder(p.pp, p.dp, p.ep, p.order)
        self.place = _placement(self.order, gpn)
        self.ep_link = self._link(not self.place["ep"].crosses)
        self.dp_dense_link = self._link(not self.place["dense"].crosses)
        self.dp_expert_link = self._link(not self.place["expert"].crosses)
        self.pp_link = self._link(not self.place["p2p"].crosses)
        self._pair_link: dict[tuple[int, int], tuple[float, float]] = {}
        self.slice: tuple[int, int] | None = None
        """[start, end) of the sequence slice this model costs (:meth:`sliced`); None: the whole sequence."""
        self._whole = self

    def sliced(self, start: int, end: int) -> "CostModel":
        """The cost model of one sequence slice, tokens [start, end) of every sequence of a
        micro-batch ([Note: sequence slices] in k3sched/seqslice.py): everything per token scales
        with the slice's tokens; the attention core counts the causal keys of its positions; the
        attention forward also keeps the keys and values of the prefix [0, start) for its backward.
        A measured profile's durations and bytes (whole micro-batch) scale the same way."""
        c = copy.copy(self)
        c.T = self.cfg.model.micro_batch_size * (end - start)
        c.slice = (start, end)
        c.cpu = CpuRunner(c, c.cpu.rc) if c.cpu is not None else None
        return c

    # -- links -------------------------------------------------------------------------------
    def shared_links(self) -> list[tuple[str, ...]]:
        """[Note: shared links] Lanes whose traffic crosses the same NIC: the ``ep`` all-to-alls and
        the ``collective`` lane's gradient reductions / PP transfers when both leave the node. They
        share the NIC's time, so the planner gives them one resource (their transfers follow one
        another, in the plan's order) and the runtime runs them in that order (a token per link,
        as in [Note: serial execution]). Lanes over NVLink, or with nothing to send, share nothing."""
        p, hw = self.cfg.parallel, self.cfg.hardware
        nic = (hw.internode_gbps, hw.internode_latency_us)
        ep = p.ep > 1 and self.ep_link == nic and self.place["ep"].crosses
        coll = ((p.ep * p.dp > 1 and self.dp_dense_link == nic and self.place["dense"].crosses)
                or (p.pp > 1 and self.pp_link == nic))
        return [("ep", "collective")] if ep and coll else []

    def p2p_link(self, a: int, b: int) -> tuple[float, float]:
        """(GB/s, latency µs) of a PP transfer between stages ``a`` and ``b``: NVLink when every
        (dp, ep) column's two ranks share a node under ``parallel.order``, else the NIC."""
        key = (min(a, b), max(a, b))
        link = self._pair_link.get(key)
        if link is None:
            link = self._pair_link[key] = self._link(
                not stage_pair_crosses(self.order, self.cfg.hardware.gpus_per_node, *key))
        return link

    def _link(self, intra: bool) -> tuple[float, float]:
        hw = self.cfg.hardware
        return (hw.nvlink_gbps, hw.nvlink_latency_us) if intra else (hw.internode_gbps, hw.internode_latency_us)

    # -- parameters ----------------------------------------------------------------------------
    def attn_params(self) -> int:
        return 4 * self.cfg.model.hidden ** 2

    def expert_params_local(self) -> int:
        m, p = self.cfg.model, self.cfg.parallel
        return (m.experts // p.ep + p.redundant_experts) * 3 * m.hidden * m.expert_hidden

    def skew_factors(self) -> tuple[float, float]:
        """(expert GEMM, all-to-all bytes) factors of the busiest EP rank under the modelled
        per-expert loads and placement ([Note: skewed cost] in k3sched/balance.py); (1, 1) when
        routing is uniform over a contiguous placement."""
        f = self.__dict__.get("_skew")
        if f is None:
            from .balance import load_factors

            f = self.__dict__["_skew"] = load_factors(self.cfg)
        return f

    def per_expert_us(self, kind: Kind) -> float:
        """[Note: per-expert cost] An expert op's time has a part per local expert, whatever its
        tokens: expert.dw stacks one weight gradient per local expert and adds it to the weights'
        gradient (bytes of every local expert's weights, twice), and each local expert is a GEMM call
        of its own. Measured with every expert on one rank (the operator profile), that part is not
        what a rank of ``ep`` ranks, holding ``experts / ep``, pays: at the same tokens an expert op
        takes visibly less with half the experts, most of all expert.dw, so scaling the whole
        profiled time by the tokens makes an EP plan's expert compute too long, hence its overlap
        too high and its serial step too long. So a profile may give per expert kind
        ``per_expert_us``: the profiled time is that much per expert (of ``model.experts``) plus a
        part that scales with the tokens; a rank's time is the token part times the busiest rank's
        factor ([Note: skewed cost] in k3sched/balance.py) plus ``per_expert_us`` times its slots
        (:meth:`local_experts`). ``k3sched probe`` measures it from a second operator profile with
        the experts of one EP rank (``experts / ep``; half of them at ep 1): the line through the
        two. 0 (no entry): the profiled time scales with the tokens alone."""
        return self.profile.per_expert_us.get(kind.value, 0.0) if kind in EXPERT_KINDS else 0.0

    def at_local_experts(self, kind: Kind, profiled_us: float, token_scale: float = 1.0) -> float:
        """A profiled time of ``kind`` (every expert on one rank) as this config's rank pays it: the
        part per local expert for its own slots, the rest (the tokens' part) times ``token_scale``
        ([Note: per-expert cost]); ``profiled_us * token_scale`` for a kind without that part."""
        fixed = self.per_expert_us(kind)
        if not fixed:
            return profiled_us * token_scale
        return max(0.0, profiled_us - fixed * self.cfg.model.experts) * token_scale + fixed * self.local_experts()

    def local_experts(self) -> int:
        """Expert slots of one EP rank (``experts / ep``, with redundant replicas the placement's
        slots per rank): what :meth:`per_expert_us` is paid for."""
        n = self.__dict__.get("_local_experts")
        if n is None:
            m, p = self.cfg.model, self.cfg.parallel
            if p.ep == 1 or not m.experts:
                n = m.experts
            else:
                from .balance import placement_for

                n = placement_for(self.cfg).per_rank
            self.__dict__["_local_experts"] = n
        return n

    def replica_params(self) -> int:
        """Parameters of one MoE layer's replicated experts (summed over the stage's ranks in grad.rs)."""
        from .balance import placement_for

        m, p = self.cfg.model, self.cfg.parallel
        if not p.redundant_experts and not self.cfg.schedule.expert_placement:
            return 0
        return len(placement_for(self.cfg).replicated()) * 3 * m.hidden * m.expert_hidden

    def shared_params(self) -> int:
        m = self.cfg.model
        return m.shared_experts * 3 * m.hidden * m.expert_hidden + m.hidden * m.experts

    def dense_mlp_params(self) -> int:
        m = self.cfg.model
        return 3 * m.hidden * m.ffn_dense_hidden

    def layer_params(self, layer: int) -> tuple[int, int]:
        """(dense params reduced over ep*dp, expert params reduced over dp) of one layer."""
        if self.cfg.model.is_moe(layer):
            return self.attn_params() + self.shared_params(), self.expert_params_local()
        return self.attn_params() + self.dense_mlp_params(), 0

    def embed_params(self) -> int:
        return self.cfg.model.vocab * self.cfg.model.hidden

    # -- FLOPs -------------------------------------------------------------------------------
    def flops(self, kind: Kind) -> float:
        m = self.cfg.model
        T, h, S, k = self.T, m.hidden, m.seq_len, m.top_k
        f, F = m.expert_hidden, m.ffn_dense_hidden
        proj = 2 * T * h * 4 * h
        core = 2 * T * S * h
        if self.slice is not None:  # 2 * 2 h FLOPs per (query, key) over the slice's causal keys
            core = 4 * h * m.micro_batch_size * keys(*self.slice)
        table = {
            Kind.ATTN_FWD: proj + core,
            Kind.ATTN_DX: proj + 2 * core,
            Kind.ATTN_DW: proj,
            Kind.ROUTER_FWD: 2 * T * h * m.experts,
            Kind.ROUTER_BWD: 4 * T * h * m.experts,
            Kind.SHARED_FWD: 2 * T * 3 * h * f * m.shared_experts,
            Kind.SHARED_DX: 2 * T * 3 * h * f * m.shared_experts,
            Kind.SHARED_DW: 2 * T * 3 * h * f * m.shared_experts,
            Kind.EXPERT_FWD: 2 * T * k * 3 * h * f * self.skew_factors()[0],
            Kind.EXPERT_DX: 2 * T * k * 3 * h * f * self.skew_factors()[0],
            Kind.EXPERT_DW: 2 * T * k * 3 * h * f * self.skew_factors()[0],
            Kind.MLP_FWD: 2 * T * 3 * h * F,
            Kind.MLP_DX: 2 * T * 3 * h * F,
            Kind.MLP_DW: 2 * T * 3 * h * F,
            Kind.HEAD_FWD: 2 * T * h * m.vocab,
            Kind.HEAD_DX: 2 * T * h * m.vocab,
            Kind.HEAD_DW: 2 * T * h * m.vocab,
            Kind.EMBED_FWD: T * h,
            Kind.EMBED_DW: T * h,
        }
        return float(table.get(kind, 0.0))

    # -- bytes moved ---------------------------------------------------------------------------
    def a2a_bytes(self, kind: Kind | None = None) -> int:
        """Bytes of one EP all-to-all of ``kind`` that leave the rank (None: a combine, model dtype)."""
        if kind is None and not self._node_limited():
            m, ep = self.cfg.model, self.cfg.parallel.ep
            return int(self.T * m.top_k * m.hidden * self.b * (ep - 1) / ep) if ep > 1 else 0
        return self.a2a_wire(kind or Kind.COMBINE_FWD).nbytes

    def a2a_payload_bytes(self, kind: Kind) -> float:
        """Bytes per element of an all-to-all's payload: FP8 plus an fp32 scale per 128 elements for
        the kinds that feed expert GEMMs under ``schedule.fp8_dispatch`` (dispatch, its recompute,
        the combine's backward), else the model dtype."""
        if self.cfg.schedule.fp8_dispatch and kind in _FP8_A2A:
            return 1 + 4 / 128
        return float(self.b)

    def _node_limited(self) -> bool:
        m, p, hw = self.cfg.model, self.cfg.parallel, self.cfg.hardware
        return m.max_route_nodes is not None and p.ep > hw.gpus_per_node

    def a2a_us(self, kind: Kind = Kind.COMBINE_FWD) -> float:
        """Duration of one EP all-to-all without the launch (:meth:`a2a_wire`)."""
        return self.wire_us(self.a2a_wire(kind), "ep")

    def p2p_bytes(self) -> int:
        return self.T * self.cfg.model.hidden * self.b

    def grad_rs_us(self, layer: int, lane: str = "collective") -> tuple[float, int]:
        """One layer's gradient reduction as the runtime executes it (dense over ep*dp, experts
        over dp): (µs without launch, bytes leaving each rank). See :meth:`grad_wire`."""
        w = self.grad_wire(layer)
        return self.wire_us(w, lane), w.nbytes

    def grad_wire(self, layer: int) -> Wire:
        """A ring all-reduce (no grad_offload: every rank needs the whole gradient for its AdamW),
        2(n-1)/n of the bytes leave each rank in 2(n-1) steps, as gloo's and NCCL's ring do; with
        ``grad_offload`` a ring reduce-scatter into the chunk buffer, (n-1)/n in n-1 steps. The
        dense and the expert reduction are two calls, one after the other."""
        p = self.cfg.parallel
        dense, expert = self.layer_params(layer)
        f = 1 if self.cfg.schedule.grad_offload else 2
        w = Wire()
        replicas = self.replica_params() if self.cfg.model.is_moe(layer) else 0  # summed over ep*dp
        for n, params, link in ((p.ep * p.dp, dense, self.dp_dense_link), (p.dp, expert, self.dp_expert_link),
                                (p.ep * p.dp, replicas, self.dp_dense_link)):
            if n > 1 and params:
                nbytes = params * self.b * f * (n - 1) / n
                w = w + Wire(steps=f * (n - 1), terms=((nbytes, link[0]),), latency_us=link[1])
        return w

    def a2a_wire(self, kind: Kind) -> Wire:
        """Hierarchical all-to-all: the share of peers inside the node goes over NVLink while the
        rest crosses the NIC at the same time (the slower sets the time). The dispatch (and its
        recompute) first exchanges the per-expert token counts: one more call, no bytes to speak of.

        [Note: node-limited routing] Balanced top-k routing over an EP group of ``ep`` ranks on
        ``nodes = ep / gpus_per_node`` nodes sends each token's k copies to k ranks: k (ep - g)/ep
        copies cross the NIC (g = ranks per node). With ``model.max_route_nodes`` M (DeepSeek-V3:
        M = 4 of 8 nodes) a token reaches at most M nodes and crosses the NIC once per remote node
        (DeepEP: one copy per node, forwarded on NVLink inside it): M (nodes - 1) / nodes copies
        cross the NIC, the ``k (g - 1) / g`` copies bound for other ranks of the reached nodes go
        over NVLink. Bytes per copy are ``hidden x payload`` (:meth:`a2a_payload_bytes`). The combine
        and the backward all-to-alls mirror the dispatch, so the same counts hold for them."""
        m, ep, hw = self.cfg.model, self.cfg.parallel.ep, self.cfg.hardware
        if ep == 1:
            return Wire()
        pb = self.a2a_payload_bytes(kind)
        g = self.place["ep"].ranks_per_node  # EP peers sharing a node (min(ep, gpus/node) for ep-dp-pp)
        if self._node_limited():
            nodes = ep / g
            row = self.T * m.hidden * pb
            routed = min(m.max_route_nodes, m.top_k, math.ceil(nodes))
            inter_b = row * routed * (nodes - 1) / nodes
            intra_b = row * m.top_k * (g - 1) / g
            terms = tuple(t for t in ((intra_b, hw.nvlink_gbps), (inter_b, hw.internode_gbps)) if t[0])
        else:
            per_peer = self.T * m.top_k * m.hidden * pb / ep
            intra = g - 1
            inter = ep - 1 - intra
            terms = tuple(t for t in ((intra * per_peer, hw.nvlink_gbps), (inter * per_peer, hw.internode_gbps))
                          if t[0])
        inter_any = ep > g
        calls = self.comm_calls(kind)
        lat = hw.internode_latency_us if inter_any else hw.nvlink_latency_us
        a2a = self.skew_factors()[1]  # the busiest rank's bytes ([Note: skewed cost] in k3sched/balance.py)
        return Wire(steps=calls, terms=tuple((b * a2a, gbps) for b, gbps in terms), latency_us=lat)

    def wire(self, kind: Kind, *, layer: int | None = None, nbytes: int = 0,
             stages: tuple[int, int] | None = None) -> Wire | None:
        """What a communication task puts on the wire ([Note: wire model]); None for other kinds.
        ``stages``: a P2P receive's (sending, receiving) stage, priced on their link
        (:meth:`p2p_link`); without it, the worst adjacent pair's (``pp_link``)."""
        if kind in (Kind.DISPATCH_FWD, Kind.COMBINE_FWD, Kind.COMBINE_BWD, Kind.DISPATCH_BWD, Kind.DISPATCH_RE):
            return self.a2a_wire(kind)
        if kind in (Kind.FWD_RECV, Kind.BWD_RECV):
            link = self.pp_link if stages is None else self.p2p_link(*stages)
            return Wire(steps=1, terms=((self.p2p_bytes(), link[0]),), latency_us=link[1])
        if kind is Kind.GRAD_RS:
            assert layer is not None
            return self.grad_wire(layer)
        if kind in (Kind.ACT_ROFFLOAD, Kind.ACT_RONLOAD):
            return Wire(steps=2, terms=((nbytes, self.pp_link[0]),), latency_us=self.pp_link[1])
        if kind is Kind.GRAD_MIRROR:
            # a two-rank ring all-reduce of the ``nbytes`` of gradients the two model copies hold
            # (2(n-1)/n = 1x the bytes leave each rank in 2(n-1) = 2 steps), on the link between the
            # ``stages`` holding them ([Note: replica gradient reduction] in runtime/stage/gradients.py)
            link = self.pp_link if stages is None else self.p2p_link(*stages)
            return Wire(steps=2, terms=((nbytes, link[0]),), latency_us=link[1])
        return None

    def wire_us(self, w: Wire, lane: str) -> float:
        """Time of ``w`` on ``lane``: steps x latency + the slowest term's bytes / bandwidth. A
        measured profile's ``latency_us[lane]`` replaces the link latency, ``link_efficiency[lane]``
        scales every link rate of the lane, ``bandwidth_gbps[lane]`` replaces the rate outright."""
        prof = self.profile
        lat = prof.latency_us.get(lane, w.latency_us)
        eff = prof.link_efficiency.get(lane, 1.0)
        fixed_bw = prof.bandwidth_gbps.get(lane)
        t = max((b / ((fixed_bw or g * eff) * 1e3) for b, g in w.terms), default=0.0)
        return w.steps * lat + t

    # -- activation memory (bytes saved for backward, per layer per micro-batch) -----------------
    def saved_bytes(self, kind: Kind) -> tuple[int, int]:
        """(bytes kept until dW -- the op's inputs --, bytes kept until dX only) of a forward op."""
        if self.slice is not None:
            return self._slice_saved(kind)
        measured = self.profile.saved_bytes.get(kind.value)
        if isinstance(measured, tuple):
            if kind is Kind.HEAD_FWD:  # kept in the model dtype, see below
                return int(measured[0]), int(measured[1])
            return self._quant(measured[0], kind), self._quant(measured[1], kind)
        m = self.cfg.model
        T, h, k, b = self.T, m.hidden, m.top_k, self.b
        f, F = m.expert_hidden, m.ffn_dense_hidden
        rc = self.cfg.schedule.recompute
        hb = b  # the head's activations stay in the model dtype (log-softmax is not quantized)
        if self.stored_fp8(kind):
            b = 1 + 4 / 128  # one byte per element plus one fp32 scale per 1x128 tile
        dr = self.cfg.schedule.dispatch_recompute
        # SwiGLU keeps h1, silu(h1), h3 and their product (4 per row of width F); with element-wise
        # recompute only h1 and h3. RMSNorm outputs (3 T h per layer) are recomputed from their
        # inputs under recompute (what the moe sub-ops do, see moe/split.py).
        glu = 2 if rc else 4
        norms = 0 if rc else 3 * T * h * b
        table = {
            # norm input + normed input (dW of qkv), q,k,v + attention output (dX) + lse
            Kind.ATTN_FWD: (2 * T * h * b, int(4 * T * h * b + norms) + T * m.heads * 4),
            Kind.ROUTER_FWD: (T * h * b, T * m.experts * 4),
            Kind.DISPATCH_FWD: (0 if dr else T * k * h * b, 0),
            Kind.EXPERT_FWD: (0, int(glu * T * k * f * b)),
            Kind.COMBINE_FWD: (0, T * k * h * b),
            Kind.SHARED_FWD: (0, int(glu * T * f * b * m.shared_experts)),
            Kind.MLP_FWD: (T * h * b, int(glu * T * F * b)),
            Kind.HEAD_FWD: (T * h * hb, T * m.vocab * 4),
            Kind.EMBED_FWD: (0, 0),
        }
        w, x = table.get(kind, (0, 0))
        if isinstance(measured, int) and w + x:
            return int(measured * w / (w + x)), measured - int(measured * w / (w + x))
        return int(w), int(x)

    def _slice_fraction(self) -> float:
        start, end = self.slice or (0, self.cfg.model.seq_len)
        return (end - start) / self.cfg.model.seq_len

    def _slice_saved(self, kind: Kind) -> tuple[int, int]:
        """:meth:`saved_bytes` of a slice: the whole sequence's, scaled by the slice's tokens, and
        for attention the keys and values of the prefix [0, start) it concatenates in front of its
        own and keeps for its backward ([Note: sequence slices] in k3sched/seqslice.py)."""
        w, x = self._whole.saved_bytes(kind)
        frac = self._slice_fraction()
        w, x = int(w * frac), int(x * frac)
        if kind is Kind.ATTN_FWD and self.slice and self.slice[0]:
            b = 1 + 4 / 128 if self.stored_fp8(kind) else self.b
            x += int(2 * self.cfg.model.micro_batch_size * self.slice[0] * self.cfg.model.hidden * b)
        return w, x

    def stored_fp8(self, kind: Kind) -> bool:
        """Whether the forward kind's saved activations are stored block-wise FP8: its sub-op's
        storage policy ([Note: storage policies from the config] in k3sched/config.py); kinds
        outside ``STORAGE_OPS`` follow ``act_quant``."""
        op = kind.value.split(".", 1)[0]
        if op not in STORAGE_OPS:
            return self.cfg.schedule.act_quant == "fp8"
        return self.cfg.schedule.storage_policy(op) == "offload+fp8"

    def kept_on_device(self, kind: Kind) -> bool:
        """Whether the forward kind's saved activations stay on the device when their layer's set
        is offloaded (storage policy ``keep``)."""
        op = kind.value.split(".", 1)[0]
        return op in STORAGE_OPS and self.cfg.schedule.storage_policy(op) == "keep"

    def _quant(self, nbytes: int, kind: Kind) -> int:
        """Measured bytes (model dtype) as stored: FP8 (1 byte + fp32 scale per 128) when
        :meth:`stored_fp8`."""
        if self.stored_fp8(kind):
            return int(nbytes / self.b * (1 + 4 / 128))
        return int(nbytes)

    def grad_out_bytes(self, kind: Kind) -> int:
        """Bytes of the output gradient a dX task keeps for its deferred dW."""
        if self.slice is not None:
            return int(self._whole.grad_out_bytes(kind) * self._slice_fraction())
        measured = self.profile.saved_bytes.get(kind.value)
        if isinstance(measured, int):
            return measured
        m = self.cfg.model
        T, h, k, b = self.T, m.hidden, m.top_k, self.b
        return {
            Kind.ATTN_DX: 4 * T * h * b,
            Kind.EXPERT_DX: T * k * (h + 2 * m.expert_hidden) * b,
            Kind.SHARED_DX: T * (h + 2 * m.expert_hidden) * b * m.shared_experts,
            Kind.MLP_DX: T * (h + 2 * m.ffn_dense_hidden) * b,
            Kind.HEAD_DX: T * m.vocab * b,
        }.get(kind, 0)

    def static_bytes(self, layers: list[int], embed: bool, head: bool) -> tuple[int, int]:
        """(device, host) bytes of parameters, gradients and optimizer state of a stage."""
        p, s, b = self.cfg.parallel, self.cfg.schedule, self.b
        params = sum(sum(self.layer_params(L)) for L in layers)
        params += self.embed_params() * (int(embed) + int(head))
        weights = params * b
        # Adam moments (fp32) + an fp32 master copy unless the weights are fp32 already; ZeRO-1 over dp
        optim = params * (8 if b >= 4 else 12) // p.dp
        if s.grad_offload:
            # two chunk-sized device buffers (bf16), fp32 shards on the host
            chunk = max(1, p.vpp)
            grads_dev = 2 * (params // chunk) * b if chunk > 1 else params * b
            return weights + grads_dev, optim + params * 4 // p.dp
        return weights + params * 4 + optim, 0

    def weight_bytes(self, layers: list[int], embed: bool, head: bool) -> int:
        """Device bytes of one version of a stage's weights (the part of :meth:`static_bytes` a second
        weight version adds: pipedream-2bw, [Note: pipedream-2bw] in k3sched/schedule_generators.py)."""
        params = sum(sum(self.layer_params(L)) for L in layers) + self.embed_params() * (int(embed) + int(head))
        return params * self.b

    # -- durations -----------------------------------------------------------------------------
    def share(self, kind: Kind) -> float:
        """[Note: CPU sharing] factor of a task of ``kind`` (in k3sched/cpurunner.py); 1 on GPUs."""
        return self.cpu.share(kind) if self.cpu is not None else 1.0

    def overhead_us(self, kind: Kind) -> float:
        """Fixed cost of a communication task besides its wire time: the profile's measured
        ``overhead_us[kind]`` (``k3sched probe``'s operator profile), else ``hardware.launch_us``."""
        return self.profile.overhead_us.get(kind.value, self.cfg.hardware.launch_us)

    @staticmethod
    def comm_calls(kind: Kind) -> int:
        """Communication calls a task of ``kind`` makes: a dispatch (and its recompute) 2 (the
        token counts, then the rows), every other communication task 1."""
        return 2 if kind in (Kind.DISPATCH_FWD, Kind.DISPATCH_RE) else 1

    def optim_us(self, params: int, nonlayer_params: int) -> float:
        """optim.run of a stage holding ``params`` parameters: AdamW over them (this rank's
        expert slice included), plus the all-reduce of the ``nonlayer_params`` (embedding, head,
        final norm) over the optim group (ep*dp ranks); with ``grad_offload`` the layers' AdamW
        runs on the host fp32 shards (1/dp of them) and their parameters are all-gathered."""
        hw, p = self.cfg.hardware, self.cfg.parallel
        ns = hw.optim_ns_per_param or 28 / hw.hbm_gbps
        layer = params - nonlayer_params
        n = p.ep * p.dp
        if self.cfg.schedule.grad_offload:
            t = (nonlayer_params + layer / p.dp) * ns / 1e3
            if p.dp > 1:
                t += self.wire_us(Wire(steps=p.dp - 1, terms=((layer * self.b * (p.dp - 1) / p.dp,
                                                               self.dp_dense_link[0]),),
                                       latency_us=self.dp_dense_link[1]), "collective")
        else:
            t = params * ns / 1e3
        if n > 1 and nonlayer_params:
            t += self.wire_us(Wire(steps=2 * (n - 1), terms=((2 * nonlayer_params * self.b * (n - 1) / n,
                                                               self.dp_dense_link[0]),),
                                   latency_us=self.dp_dense_link[1]), "collective")
        return self.share(Kind.OPTIM) * t

    def stage_params(self, layers: list[int], embed: bool, head: bool) -> tuple[int, int]:
        """(all parameters, non-layer parameters) a stage holds: its layers (this rank's expert
        slice), the embedding and / or the head with the final norm."""
        nonlayer = self.embed_params() * int(embed) + (self.embed_params() + self.cfg.model.hidden) * int(head)
        return sum(sum(self.layer_params(L)) for L in layers) + nonlayer, nonlayer

    def duration_us(self, kind: Kind, *, layer: int | None = None, nbytes: int = 0,
                    stages: tuple[int, int] | None = None) -> float:
        """Duration of one task. ``nbytes`` is the payload for copy kinds; ``stages`` the
        (sending, receiving) stage of a P2P receive (:meth:`wire`)."""
        return self.share(kind) * self._one_core_us(kind, layer, nbytes, stages)

    def _one_core_us(self, kind: Kind, layer: int | None, nbytes: int,
                     stages: tuple[int, int] | None = None) -> float:
        hw = self.cfg.hardware
        measured = self.profile.durations_us.get(kind.value)
        if measured is not None:  # measured at the profiled run's routing: balanced ([Note: skewed cost])
            scale = 1.0
            if self.slice is not None:  # a whole micro-batch's time: the slice's share of its FLOPs or tokens
                whole = self._whole.flops(kind)
                scale = self.flops(kind) / whole if whole else self._slice_fraction()
            if kind in EXPERT_KINDS:
                scale *= self.skew_factors()[0]
            return self.at_local_experts(kind, measured, scale)
        if kind in _GEMM:
            return hw.launch_us + self.flops(kind) / self._flops_per_us
        w = self.wire(kind, layer=layer, nbytes=nbytes, stages=stages)
        if w is not None:
            return self.overhead_us(kind) + self.wire_us(w, LANE_OF[kind])
        if kind in (Kind.FWD_SEND, Kind.BWD_SEND):  # posts the send; the bytes move in the receive
            return hw.launch_us
        if kind in (Kind.ACT_OFFLOAD, Kind.ACT_ONLOAD, Kind.GSHARD_ONLOAD, Kind.GSHARD_OFFLOAD):
            gbps = self.profile.bandwidth_gbps.get("offload_local", hw.pcie_gbps)
            return hw.launch_us + hw.pcie_latency_us + nbytes / (gbps * 1e3)
        if kind in (Kind.ACT_RSTORE, Kind.ACT_RSERVE):
            return hw.launch_us
        if kind is Kind.GSHARD_ADD:
            return hw.launch_us + 3 * nbytes / (hw.hbm_gbps * 1e3)
        if kind is Kind.OPTIM:  # the stage's share is costed by the graph builder (optim_us)
            return hw.launch_us
        raise ValueError(f"no cost for task kind {kind.value}")
