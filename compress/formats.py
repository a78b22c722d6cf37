"""Integer weight formats and their plain-PyTorch reference math.

- :class:`Int8Weight`: INT8, symmetric, one scale per output channel (W8A16).
- :class:`Int4Weight`: INT4, one scale (and zero point unless symmetric) per
  group of ``group_size`` consecutive input columns; two codes per byte.

Weights are ``(out_features, in_features)`` = ``(N, K)`` as in ``nn.Linear``.
These functions are the reference the Triton kernels are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import pack_bits, unpack_bits
from .uniform import fit_scale_zero, from_codes, to_codes


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """INT8 per-output-channel symmetric weight: ``W ≈ qweight * scales[:, None]``."""

    qweight: torch.Tensor  # int8 (N, K)
    scales: torch.Tensor  # (N,)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return from_codes(self.qweight, self.scales, None, bits=8).to(dtype)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """INT4 group-wise weight, packed two codes per byte (even column in the low nibble).

    ``zeros`` is ``None`` for the symmetric grid (implicit zero point 8).
    """

    qweight: torch.Tensor  # uint8 (N, K/2)
    scales: torch.Tensor  # (N, K/G)
    zeros: torch.Tensor | None  # uint8 (N, K/G) or None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def codes(self) -> torch.Tensor:
        """Unpacked codes, uint8 ``(N, K)`` in [0, 15]."""
        return unpack_bits(self.qweight, 4)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        codes = grouped(self.codes(), self.group_size)  # (N, ceil(K/G), G)
        zeros = None if self.zeros is None else self.zeros.to(torch.int32)
        return from_codes(codes, self.scales, zeros, bits=4).reshape(n, -1)[:, :k].to(dtype)


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(R, K)`` → ``(R, ceil(K/G), G)``, zero-padding a short last group."""
    pad = -w.shape[1] % group_size
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(w.shape[0], -1, group_size)  # (R, ceil(K/G), G)


def check_group_size(in_features: int, group_size: int, *, name: str = "weight", pad_groups: bool = False) -> None:
    """Raise a ``ValueError`` that says what to do when ``group_size`` does not fit.

    With ``pad_groups`` a group size that does not divide ``in_features`` is
    allowed: the last group is short (as if the weight were zero-padded to a
    multiple of the group size; the padding is not stored).
    """
    if in_features % group_size and not pad_groups:
        fits = [g for g in (32, 64, 128) if in_features % g == 0]
        hint = f"use group_size in {fits}" if fits else "no standard group size (32/64/128) divides it"
        raise ValueError(
            f"group_size={group_size} does not divide in_features={in_features} of {name}: {hint}, "
            "or set pad_groups=True (zcompress: --pad-groups; the last group is short), or leave this module "
            "uncompressed (add its name to `exclude`; zcompress: --exclude)"
        )
    if in_features % 2:
        raise ValueError(f"INT4 packs two values per byte, so in_features={in_features} of {name} must be even")


def int8_from_codes(codes: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
    return Int8Weight(qweight=codes.to(torch.int8), scales=scales)


def int4_from_codes(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *, group_size: int
) -> Int4Weight:
    """Pack int codes ``(N, K)`` in [0, 15] with their group ``scales``/``zeros`` ``(N, K/G)``."""
    z = None if zeros is None else zeros.to(torch.uint8)
    return Int4Weight(qweight=pack_bits(codes, 4), scales=scales, zeros=z, group_size=group_size)


def quantize_int8(w: torch.Tensor, *, scale_dtype: torch.dtype = torch.float16) -> Int8Weight:
    """Round-to-nearest INT8, symmetric, per output channel."""
    scale, _ = fit_scale_zero(w, bits=8, symmetric=True, scale_dtype=scale_dtype)  # (N,)
    return int8_from_codes(to_codes(w, scale, None, bits=8, symmetric=True), scale)


def quantize_int4(
    w: torch.Tensor, *, group_size: int = 128, symmetric: bool = False, scale_dtype: torch.dtype = torch.float16,
    pad_groups: bool = False,
) -> Int4Weight:
    """Round-to-nearest INT4 with one scale (and zero point) per group of input columns.

    ``pad_groups``: allow a short last group when ``group_size`` does not divide ``K``
    (zero padding never widens a group's range, which always includes 0).
    """
    n, k = w.shape
    check_group_size(k, group_size, pad_groups=pad_groups)
    groups = grouped(w, group_size)  # (N, ceil(K/G), G)
    scale, zero = fit_scale_zero(groups, bits=4, symmetric=symmetric, scale_dtype=scale_dtype)
    codes = to_codes(groups, scale, zero, bits=4, symmetric=symmetric).reshape(n, -1)[:, :k]
    return int4_from_codes(codes, scale, zero, group_size=group_size)
