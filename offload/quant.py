"""Block-wise FP8 storage of activations: 1 x 128 tiles, one fp32 scale per tile (lossy).

``quantize(x)`` flattens ``x`` (any float dtype), pads it to a multiple of 128 and stores each
tile as ``float8_e4m3fn`` scaled so the tile's absolute maximum maps to 448 (the format's largest
finite value), with the fp32 scale beside it; ``dequantize`` inverts it into ``x``'s dtype.
Relative error per element is at most about 2^-4 of its tile's maximum (3 mantissa bits);
``tests/unit/offload/test_offload_manager.py`` measures it. Never used in the bitwise tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TILE = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class Quantized:
    """FP8 payload ``q`` (tiles x 128), fp32 ``scale`` per tile, and the original numel/dtype."""

    q: Tensor
    scale: Tensor
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4


def quantized_nbytes(numel: int) -> int:
    """Bytes of the FP8 form of ``numel`` elements (payload + scales)."""
    tiles = -(-numel // TILE)
    return tiles * TILE + tiles * 4


def quantize(x: Tensor, out_q: Tensor | None = None, out_scale: Tensor | None = None) -> Quantized:
    """Block-wise FP8 of ``x`` (flattened); ``out_q`` / ``out_scale`` receive the result when given
    (flat buffers of at least tiles*128 fp8 and tiles fp32 elements)."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    tiles = -(-n // TILE)
    if tiles * TILE != n:
        flat = torch.nn.functional.pad(flat, (0, tiles * TILE - n))
    t = flat.view(tiles, TILE)
    amax = t.abs().amax(dim=1).clamp_min(1e-30)
    scale = amax / FP8_MAX
    q = (t / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if out_q is not None:
        out_q[: tiles * TILE].view(tiles, TILE).copy_(q)
        q = out_q[: tiles * TILE].view(tiles, TILE)
    if out_scale is not None:
        out_scale[:tiles].copy_(scale)
        scale = out_scale[:tiles]
    return Quantized(q, scale, n, x.dtype)


def dequantize(qz: Quantized, out: Tensor | None = None) -> Tensor:
    """The values of ``qz`` as a flat tensor of its original dtype (into ``out`` when given)."""
    tiles = qz.scale.numel()
    vals = (qz.q.reshape(tiles, TILE).float() * qz.scale[:, None]).reshape(-1)[: qz.numel].to(qz.dtype)
    if out is None:
        return vals
    out[: qz.numel].copy_(vals)
    return out[: qz.numel]
