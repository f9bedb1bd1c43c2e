"""Model arguments of the MoE transformer (``moe`` package).

``MoEModelArgs`` is a plain dataclass so the package imports without ``k3sched.config``; build it
from the config file's model section with :meth:`MoEModelArgs.from_mapping` (unknown keys are
ignored, so the pydantic model section can carry scheduler-only fields).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "float64": torch.float64, "fp64": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@dataclass(frozen=True)
class MoEModelArgs:
    """Shape and routing options of the MoE transformer."""

    layers: int = 2
    """Number of transformer blocks."""
    dense_layers: int = 0
    """The first ``dense_layers`` blocks use a dense SwiGLU MLP instead of MoE (K2: layer 0)."""
    hidden: int = 32
    """Model width D."""
    heads: int = 4
    """Attention heads H; ``hidden`` must be a multiple of it."""
    experts: int = 8
    """Routed experts E per MoE layer (all EP ranks together)."""
    top_k: int = 2
    """Experts per token K."""
    shared_experts: int = 1
    """Shared experts per MoE layer (replicated on every EP rank); 0 disables them."""
    expert_hidden: int = 16
    """Hidden width F of one routed (and one shared) expert."""
    dense_hidden: int = 64
    """Hidden width of the dense SwiGLU MLP."""
    vocab: int = 64
    """Vocabulary size V."""
    seq_len: int = 16
    """Sequence length S (micro-batches may use any length up to it)."""
    aux_loss_coef: float = 0.01
    """Coefficient of the sequence-wise load-balancing loss (0 disables its gradient)."""
    dtype: str = "float32"
    """Parameter and activation dtype name (float32, float64, bfloat16, float16)."""
    normalize_topk: bool = True
    """Renormalise the K selected routing weights to sum to 1 (DeepSpeed does for k >= 2)."""
    dispatch_recompute: bool = False
    """EP dispatch recompute (task ``dispatch.re``): keep the dispatch input, not its output."""
    rms_eps: float = 1e-6
    """RMSNorm epsilon."""
    router_skew: float = 0.0
    """Zipf exponent of expert popularity (0: uniform): the fixed router-logit bias
    ``-router_skew * ln(e + 1)`` of expert e (see ``skew_bias`` in ``moe/functional.py``)."""
    recompute: bool = False
    """Element-wise recompute (``schedule.recompute``): keep the inputs of RMSNorm and SwiGLU, not
    their outputs, and recompute them in the dX task (bitwise identical; see [Note: element-wise
    recompute] in ``moe/model.py``)."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"dense_layers ({self.dense_layers}) must be in [0, layers={self.layers}]")
        if self.dense_layers < self.layers and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be in [1, experts={self.experts}]")
        if not (math.isfinite(self.router_skew) and self.router_skew >= 0):
            raise ValueError(f"router_skew ({self.router_skew}) must be a finite number >= 0")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not one of {sorted(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` named by :attr:`dtype`."""
        return _DTYPES[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has an MoE feed-forward (else a dense MLP)."""
        return layer >= self.dense_layers

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> MoEModelArgs:
        """Build from a mapping (e.g. the config's model section dumped to a dict); unknown keys
        are ignored, missing keys take the defaults. A ``torch.dtype`` value is accepted too."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in names}
        if isinstance(kwargs.get("dtype"), torch.dtype):
            kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
        return cls(**kwargs)
