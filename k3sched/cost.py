"""Analytic cost model: durations from FLOPs and bytes, memory of saved activations.

Legend: T tokens per micro-batch per rank (micro_batch_size x seq_len), S sequence length,
h hidden, f expert hidden, F dense hidden, k top-k, E experts, V vocab, b dtype bytes.

FLOPs count a multiply-add as 2. Attention projections (q, k, v, o) are 4 h x h GEMMs; the
causal attention core is QK^T plus AV over half the S x S score matrix per sequence:
2 * 2 * T * S * h / 2 = 2 T S h in forward, twice that in backward (it is all dX). Expert and
shared MLPs are SwiGLU (3 GEMMs of h x f); routed experts see T k tokens per rank on average
(balanced routing: every rank receives what it sends). dX and dW of a GEMM each cost the forward.

Communication: all-to-all bytes = T k h b per rank, of which (ep-1)/ep leave the rank, over NVLink
when the EP group fits in a node, else over the NIC. DP reduce-scatter of a layer's gradient is a
ring over the DP group (dense parameters over ep*dp ranks, expert parameters over dp). PP
send/recv carries T h b. Offload / onload go over PCIe; remote offload over the P2P link.

A measured profile (YAML, see :func:`load_profile`) replaces the analytic duration of any kind:
``durations_us: {attn.fwd: 812.0, ...}`` (per layer and micro-batch), optionally
``bandwidth_gbps: {ep: .., collective: .., offload_local: .., offload_remote: ..}`` and
``saved_bytes: {attn.fwd: [w, x], attn.dx: n, ...}``: measured activation bytes per layer and
micro-batch that replace :meth:`CostModel.saved_bytes` (forward kinds: bytes kept until dW, bytes
kept until dX) and :meth:`CostModel.grad_out_bytes` (dX kinds); a forward kind may also give one
number N (split like the analytic model). ``offload.measure.write_profile`` measures them on the
``moe`` code ([Note: measured saved bytes] in ``offload/measure.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .config import Config, ConfigError
from .tasks import Kind

_GEMM = {
    Kind.ATTN_FWD, Kind.ATTN_DX, Kind.ATTN_DW, Kind.ROUTER_FWD, Kind.ROUTER_BWD, Kind.SHARED_FWD,
    Kind.SHARED_DX, Kind.SHARED_DW, Kind.EXPERT_FWD, Kind.EXPERT_DX, Kind.EXPERT_DW, Kind.MLP_FWD,
    Kind.MLP_DX, Kind.MLP_DW, Kind.HEAD_FWD, Kind.HEAD_DX, Kind.HEAD_DW, Kind.EMBED_FWD, Kind.EMBED_DW,
}


@dataclass
class Profile:
    """Measured per-kind durations (µs per task) and per-lane bandwidths (GB/s)."""

    durations_us: dict[str, float] = field(default_factory=dict)
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    source: str = ""
    saved_bytes: dict[str, int | tuple[int, int]] = field(default_factory=dict)


def load_profile(path: str | Path) -> Profile:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"schedule.profile: cannot read {p}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"schedule.profile: {p} must be a mapping with durations_us / bandwidth_gbps")
    unknown = set(data) - {"durations_us", "bandwidth_gbps", "saved_bytes", "format", "source"}
    if unknown:
        raise ConfigError(f"schedule.profile: unknown key {sorted(unknown)[0]!r} in {p}; allowed: durations_us, "
                          "bandwidth_gbps, saved_bytes, format, source")
    dur = {str(k): float(v) for k, v in (data.get("durations_us") or {}).items()}
    for k in dur:
        try:
            Kind(k)
        except ValueError:
            raise ConfigError(f"schedule.profile: unknown task kind {k!r} in {p}") from None
    bw = {str(k): float(v) for k, v in (data.get("bandwidth_gbps") or {}).items()}
    saved: dict[str, int | tuple[int, int]] = {}
    for k, v in (data.get("saved_bytes") or {}).items():
        try:
            Kind(str(k))
            saved[str(k)] = (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else int(v)
        except (ValueError, TypeError, IndexError):
            raise ConfigError(f"schedule.profile: saved_bytes: {k!r} must be a task kind with bytes N or [w, x] "
                              f"in {p}; got {v!r}") from None
    return Profile(dur, bw, str(p), saved)


class CostModel:
    """Durations (µs), FLOPs, bytes moved and activation bytes of every task kind of a config."""

    def __init__(self, cfg: Config, profile: Profile | None = None):
        self.cfg = cfg
        if profile is None and cfg.schedule.profile:
            profile = load_profile(cfg.schedule.profile)
        self.profile = profile or Profile()
        m, p, hw = cfg.model, cfg.parallel, cfg.hardware
        self.T = m.tokens
        self.b = m.dtype_bytes
        self._flops_per_us = hw.peak_tflops * hw.mfu * 1e6  # TFLOP/s -> FLOP/µs
        gpn = hw.gpus_per_node
        # Rank layout: ep innermost, then dp, then pp (EP groups on NVLink when ep <= gpus/node).
        self.ep_link = self._link(p.ep <= gpn)
        self.dp_dense_link = self._link(p.ep * p.dp <= gpn)
        self.dp_expert_link = self._link(p.ep * p.dp <= gpn)
        self.pp_link = self._link(p.ep * p.dp * 2 <= gpn)

    # -- links -------------------------------------------------------------------------------
    def _link(self, intra: bool) -> tuple[float, float]:
        hw = self.cfg.hardware
        return (hw.nvlink_gbps, hw.nvlink_latency_us) if intra else (hw.internode_gbps, hw.internode_latency_us)

    def _xfer_us(self, nbytes: float, link: tuple[float, float], lane: str) -> float:
        gbps = self.profile.bandwidth_gbps.get(lane, link[0])
        return link[1] + nbytes / (gbps * 1e3)  # GB/s -> bytes/µs

    # -- parameters ----------------------------------------------------------------------------
    def attn_params(self) -> int:
        return 4 * self.cfg.model.hidden ** 2

    def expert_params_local(self) -> int:
        m, p = self.cfg.model, self.cfg.parallel
        return (m.experts // p.ep) * 3 * m.hidden * m.expert_hidden

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
        table = {
            Kind.ATTN_FWD: proj + core,
            Kind.ATTN_DX: proj + 2 * core,
            Kind.ATTN_DW: proj,
            Kind.ROUTER_FWD: 2 * T * h * m.experts,
            Kind.ROUTER_BWD: 4 * T * h * m.experts,
            Kind.SHARED_FWD: 2 * T * 3 * h * f * m.shared_experts,
            Kind.SHARED_DX: 2 * T * 3 * h * f * m.shared_experts,
            Kind.SHARED_DW: 2 * T * 3 * h * f * m.shared_experts,
            Kind.EXPERT_FWD: 2 * T * k * 3 * h * f,
            Kind.EXPERT_DX: 2 * T * k * 3 * h * f,
            Kind.EXPERT_DW: 2 * T * k * 3 * h * f,
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
    def a2a_bytes(self) -> int:
        m, ep = self.cfg.model, self.cfg.parallel.ep
        return int(self.T * m.top_k * m.hidden * self.b * (ep - 1) / ep) if ep > 1 else 0

    def a2a_us(self) -> float:
        """Hierarchical all-to-all: the share of peers inside the node goes over NVLink while the
        rest crosses the NIC at the same time; the slower of the two sets the time."""
        m, ep, hw = self.cfg.model, self.cfg.parallel.ep, self.cfg.hardware
        if ep == 1:
            return 0.0
        per_peer = self.T * m.top_k * m.hidden * self.b / ep
        intra = min(ep, hw.gpus_per_node) - 1
        inter = ep - 1 - intra
        bw = self.profile.bandwidth_gbps
        t_intra = hw.nvlink_latency_us + intra * per_peer / (bw.get("ep", hw.nvlink_gbps) * 1e3)
        t_inter = (hw.internode_latency_us + inter * per_peer / (bw.get("ep", hw.internode_gbps) * 1e3)) if inter else 0.0
        return max(t_intra, t_inter)

    def p2p_bytes(self) -> int:
        return self.T * self.cfg.model.hidden * self.b

    def grad_rs_us(self, layer: int, lane: str = "collective") -> tuple[float, int]:
        """Ring reduce-scatter of one layer's gradient (dense over ep*dp, experts over dp)."""
        p = self.cfg.parallel
        dense, expert = self.layer_params(layer)
        gb = 4  # fp32 gradient reduction
        t = 0.0
        moved = 0
        for n, params, link in ((p.ep * p.dp, dense, self.dp_dense_link), (p.dp, expert, self.dp_expert_link)):
            if n > 1 and params:
                b = params * gb * (n - 1) / n
                moved += int(b)
                t += self._xfer_us(b, link, lane) + (n - 2) * link[1]
        return t, moved

    # -- activation memory (bytes saved for backward, per layer per micro-batch) -----------------
    def saved_bytes(self, kind: Kind) -> tuple[int, int]:
        """(bytes kept until dW -- the op's inputs --, bytes kept until dX only) of a forward op."""
        measured = self.profile.saved_bytes.get(kind.value)
        if isinstance(measured, tuple):
            if kind is Kind.HEAD_FWD:  # kept in the model dtype, see below
                return int(measured[0]), int(measured[1])
            return self._quant(measured[0]), self._quant(measured[1])
        m = self.cfg.model
        T, h, k, b = self.T, m.hidden, m.top_k, self.b
        f, F = m.expert_hidden, m.ffn_dense_hidden
        rc = self.cfg.schedule.recompute
        hb = b  # the head's activations stay in the model dtype (log-softmax is not quantized)
        if self.cfg.schedule.act_quant == "fp8":
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

    def _quant(self, nbytes: int) -> int:
        """Measured bytes (model dtype) as stored under ``act_quant: fp8`` (1 byte + fp32 scale per 128)."""
        if self.cfg.schedule.act_quant == "fp8":
            return int(nbytes / self.b * (1 + 4 / 128))
        return int(nbytes)

    def grad_out_bytes(self, kind: Kind) -> int:
        """Bytes of the output gradient a dX task keeps for its deferred dW."""
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

    # -- durations -----------------------------------------------------------------------------
    def duration_us(self, kind: Kind, *, layer: int | None = None, nbytes: int = 0) -> float:
        """Duration of one task. ``nbytes`` is the payload for copy kinds."""
        hw = self.cfg.hardware
        measured = self.profile.durations_us.get(kind.value)
        if measured is not None:
            return measured
        if kind in _GEMM:
            return hw.launch_us + self.flops(kind) / self._flops_per_us
        if kind in (Kind.DISPATCH_FWD, Kind.COMBINE_FWD, Kind.COMBINE_BWD, Kind.DISPATCH_BWD, Kind.DISPATCH_RE):
            return hw.launch_us + self.a2a_us()
        if kind in (Kind.FWD_SEND, Kind.BWD_SEND):
            return hw.launch_us + self._xfer_us(self.p2p_bytes(), self.pp_link, "collective")
        if kind in (Kind.FWD_RECV, Kind.BWD_RECV):
            return hw.launch_us + self.pp_link[1]
        if kind is Kind.GRAD_RS:
            assert layer is not None
            return hw.launch_us + self.grad_rs_us(layer)[0]
        if kind in (Kind.ACT_OFFLOAD, Kind.ACT_ONLOAD, Kind.GSHARD_ONLOAD, Kind.GSHARD_OFFLOAD):
            gbps = self.profile.bandwidth_gbps.get("offload_local", hw.pcie_gbps)
            return hw.launch_us + hw.pcie_latency_us + nbytes / (gbps * 1e3)
        if kind in (Kind.ACT_ROFFLOAD, Kind.ACT_RONLOAD):
            return hw.launch_us + self._xfer_us(nbytes, self.pp_link, "offload_remote")
        if kind is Kind.GSHARD_ADD:
            return hw.launch_us + 3 * nbytes / (hw.hbm_gbps * 1e3)
        if kind is Kind.OPTIM:
            return hw.launch_us
        raise ValueError(f"no cost for task kind {kind.value}")
