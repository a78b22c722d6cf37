"""Bit packing: small unsigned integers, several per byte.

One layout serves every packed tensor in zspeed: along the last axis, value
``j`` of each byte sits at bits ``[j*bits, (j+1)*bits)`` (the first value in the
low bits). INT4 weights use ``bits=4`` (two per byte, even column low) and 2:4
sparsity metadata uses ``bits=2`` (four 2-bit positions per byte). The Triton
kernels unpack exactly this layout (see ``zspeed.kernels._tiles``).
"""
from __future__ import annotations

import torch

VALID_BITS = (1, 2, 4, 8)


def _check_bits(bits: int) -> int:
    if bits not in VALID_BITS:
        raise ValueError(f"bits={bits} cannot be packed into bytes evenly; use one of {VALID_BITS}")
    return 8 // bits


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integers in ``[0, 2**bits)`` along the last axis into ``uint8``.

    ``values`` has shape ``(..., L)`` with ``L`` a multiple of ``8 // bits``; the
    result has shape ``(..., L * bits // 8)``.
    """
    per_byte = _check_bits(bits)
    length = values.shape[-1]
    if length % per_byte:
        raise ValueError(f"last dimension {length} is not a multiple of {per_byte} (values per byte at {bits} bits)")
    v = values.to(torch.int32)
    if v.numel() and (v.min() < 0 or v.max() >= (1 << bits)):
        raise ValueError(f"values must lie in [0, {1 << bits}) to pack at {bits} bits")
    v = v.reshape(*values.shape[:-1], length // per_byte, per_byte)  # (..., L/per, per)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=v.device) * bits
    return (v << shifts).sum(dim=-1).to(torch.uint8)  # fields do not overlap, so sum == or


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``(..., B)`` uint8 → ``(..., B * 8 // bits)`` uint8."""
    per_byte = _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed tensor must be uint8, got {packed.dtype}")
    p = packed.to(torch.int32).unsqueeze(-1)  # (..., B, 1)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=p.device) * bits
    fields = (p >> shifts) & ((1 << bits) - 1)  # (..., B, per)
    return fields.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte).to(torch.uint8)


def index_bits(m: int) -> int:
    """Bits used to store one position inside a block of ``m`` (rounded up to 1, 2, 4 or 8)."""
    if not 2 <= m <= 256:
        raise ValueError(f"block size m={m} must lie in [2, 256]")
    need = max(1, (m - 1).bit_length())
    return next(b for b in VALID_BITS if b >= need)
