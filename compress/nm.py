"""N:M structured sparsity, stored compressed.

In every block of ``m`` consecutive input columns of a row, at most ``n`` weights
are nonzero. Compressed storage keeps, per row, the ``K * n / m`` kept values in
order and, for each, its position inside its block (packed into
``index_bits(m)`` bits; 2 bits for 2:4). Kept positions are sorted within a block.

``values`` may be floats or an :class:`Int4Weight` (2:4 + INT4): then the INT4
groups run over the compressed columns, ``group_size * n / m`` kept values per
group, i.e. ``group_size`` columns of the original matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Int4Weight
from .packing import index_bits, pack_bits, unpack_bits


@dataclass(frozen=True, slots=True)
class NMWeight:
    """An N:M sparse weight: kept values plus packed positions."""

    values: torch.Tensor | Int4Weight  # (N, K*n/m) floats, or INT4 over that shape
    meta: torch.Tensor  # uint8 (N, K*n/m * bits / 8)
    n: int
    m: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.meta.shape[0], self.in_features

    def positions(self) -> torch.Tensor:
        """Position of each kept value inside its block, int64 ``(N, K/m, n)``."""
        rows = self.meta.shape[0]
        pos = unpack_bits(self.meta, index_bits(self.m))
        return pos.reshape(rows, self.in_features // self.m, self.n).long()  # (N, K/m, n)

    def kept_values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        v = self.values.dequantize(dtype) if isinstance(self.values, Int4Weight) else self.values.to(dtype)
        return v

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``(N, K)`` matrix, zeros where pruned."""
        rows, k = self.shape
        vals = self.kept_values(dtype).reshape(rows, k // self.m, self.n)  # (N, K/m, n)
        dense = torch.zeros(rows, k // self.m, self.m, dtype=dtype, device=vals.device)
        return dense.scatter_(-1, self.positions(), vals).reshape(rows, k)


def check_nm_shape(in_features: int, n: int, m: int, *, name: str = "weight") -> None:
    """Raise a ``ValueError`` when ``in_features`` cannot hold whole, packable N:M blocks."""
    if in_features % m:
        raise ValueError(f"in_features={in_features} of {name} is not a multiple of m={m}: N:M blocks must tile rows")
    per_byte = 8 // index_bits(m)
    if (in_features // m * n) % per_byte:
        raise ValueError(
            f"{name}: {in_features // m * n} kept positions per row do not fill whole bytes "
            f"({per_byte} per byte for m={m}); in_features must be a multiple of {m * per_byte // _gcd(n, per_byte)}"
        )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def nm_mask(scores: torch.Tensor, *, n: int, m: int) -> torch.Tensor:
    """Boolean mask keeping the ``n`` largest ``scores`` in each block of ``m`` along the last axis."""
    rows, k = scores.shape
    blocks = scores.reshape(rows, k // m, m)  # (N, K/m, m)
    keep = blocks.topk(n, dim=-1).indices
    mask = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(rows, k)


def _check_is_nm(w: torch.Tensor, n: int, m: int, name: str) -> None:
    nonzero = (w.reshape(w.shape[0], -1, m) != 0).sum(-1)  # (N, K/m)
    bad = (nonzero > n).nonzero()
    if len(bad):
        r, b = bad[0].tolist()
        raise ValueError(
            f"{name} is not {n}:{m} sparse: row {r}, block {b} (columns {b * m}..{b * m + m - 1}) has "
            f"{int(nonzero[r, b])} nonzeros (> {n}); prune it first (zspeed.compress.prune_nm or sparsify_model)"
        )


def compress_nm(w: torch.Tensor, *, n: int = 2, m: int = 4, name: str = "weight") -> NMWeight:
    """Compress a weight that is already N:M sparse. Raises if any block has more than ``n`` nonzeros."""
    rows, k = w.shape
    check_nm_shape(k, n, m, name=name)
    _check_is_nm(w, n, m, name)
    blocks = w.reshape(rows, k // m, m)  # (N, K/m, m)
    pos = (blocks != 0).to(torch.float16).topk(n, dim=-1, sorted=True).indices  # nonzeros first
    pos = pos.sort(dim=-1).values  # (N, K/m, n), distinct since topk indices are
    values = blocks.gather(-1, pos).reshape(rows, k // m * n)  # (N, K*n/m)
    meta = pack_bits(pos.reshape(rows, -1), index_bits(m))
    return NMWeight(values=values, meta=meta, n=n, m=m, in_features=k)


def prune_nm(w: torch.Tensor, scores: torch.Tensor, *, n: int = 2, m: int = 4) -> torch.Tensor:
    """Zero all but the ``n`` highest-``scores`` weights in each block of ``m`` (a dense copy)."""
    check_nm_shape(w.shape[1], n, m)
    return w * nm_mask(scores, n=n, m=m)
