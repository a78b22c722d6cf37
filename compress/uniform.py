"""Uniform (affine) quantization grids: the math every integer format shares.

A value ``w`` in a group with scale ``s`` and zero point ``z`` becomes the code
``q = clamp(round(w / s) + z, qmin, qmax)`` and is read back as ``(q - z) * s``.

- INT8 is symmetric, stored signed: codes in [-128, 127], ``z = 0``.
- INT4 symmetric is stored unsigned with the implicit zero point 8: codes in
  [0, 15], ``z = 8``. INT4 asymmetric stores one integer ``z`` in [0, 15] per group.

[Note: scale rounding] Scales are stored in a narrow float (fp16 by default).
The scale is fitted in fp32, then rounded *up* to the storage dtype (never down),
and codes are computed from the stored value. So the covered range never
shrinks, and round-to-nearest keeps ``|w - dequant(w)| <= s / 2`` exactly, with
``s`` the stored scale.
"""
from __future__ import annotations

import torch

SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """The ``(qmin, qmax)`` a format stores."""
    if bits == 8:
        return -128, 127
    return 0, (1 << bits) - 1


def symmetric_zero(bits: int) -> int:
    """The implicit zero point of a symmetric grid (0 for signed INT8, 8 for unsigned INT4)."""
    return 0 if bits == 8 else 1 << (bits - 1)


def _round_scale_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast ``scale`` to ``dtype`` rounding up, see [Note: scale rounding]."""
    near = scale.to(dtype)
    up = (scale * (1 + torch.finfo(dtype).eps)).to(dtype)
    return torch.where(near.float() >= scale, near, up)


def fit_scale_zero(
    w: torch.Tensor, *, bits: int, symmetric: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fit one scale (and zero point) per row of ``w`` of shape ``(..., G)``.

    Returns ``scale`` of shape ``(...)`` in ``scale_dtype`` and ``zero`` of shape
    ``(...)`` as int32 (``None`` when ``symmetric``). The range always includes 0.
    """
    w = w.float()
    wmax = w.amax(dim=-1).clamp(min=0)
    wmin = w.amin(dim=-1).clamp(max=0)
    if symmetric:
        half = 1 << (bits - 1)
        scale = torch.maximum(wmax / (half - 1), -wmin / half)
    else:
        scale = (wmax - wmin) / ((1 << bits) - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero group
    scale = _round_scale_up(scale, scale_dtype)
    if symmetric:
        return scale, None
    qmin, qmax = code_range(bits, symmetric)
    zero = torch.round(-wmin / scale.float()).clamp(qmin, qmax).to(torch.int32)
    return scale, zero


def to_codes(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, *, bits: int, symmetric: bool
) -> torch.Tensor:
    """Round ``w`` of shape ``(..., G)`` onto the grid of per-row ``scale``/``zero``; int32 codes."""
    qmin, qmax = code_range(bits, symmetric)
    z = symmetric_zero(bits) if zero is None else zero.unsqueeze(-1)
    q = torch.round(w.float() / scale.float().unsqueeze(-1)) + z
    return q.clamp(qmin, qmax).to(torch.int32)


def from_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, *, bits: int) -> torch.Tensor:
    """Dequantize codes ``(..., G)`` with per-row ``scale``/``zero`` ``(...)`` to fp32."""
    z = symmetric_zero(bits) if zero is None else zero.unsqueeze(-1).float()
    return (codes.float() - z) * scale.float().unsqueeze(-1)
