"""In-register dequantization: one ``(BLOCK_N, BLOCK_K)`` fp32 tile of ``W``.

Every format's kernel is the same matmul skeleton (``_gemm.py``) around one of
these loaders; the compile-time ``FMT`` picks it. Each loader reads only the
stored bytes of its format and rebuilds the dense tile of original columns
``k0 .. k0 + BLOCK_K`` for rows ``offs_n``.

[Note: packed layouts] (the same as ``zspeed.compress.packing``)
- INT4: byte ``b`` of a row holds columns ``2b`` (low nibble) and ``2b+1``.
- 2:4 metadata: byte ``b`` holds the in-block positions of kept values
  ``4b .. 4b+3`` in bit pairs, lowest first; kept values ``2j, 2j+1`` belong to
  block ``j`` (original columns ``4j .. 4j+3``).
- INT8 tiles are returned *unscaled*: the per-channel scale is applied once to
  the accumulator (it factors out of the sum over ``k``).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nibbles(b):
    """uint8 bytes ``(R, C)`` → 4-bit fields ``(R, 2C)`` as int32, low nibble first."""
    b = b.to(tl.int32)
    return tl.interleave(b & 0xF, (b >> 4) & 0xF)

@triton.jit
def _crumbs(b):
    """uint8 bytes ``(R, C)`` → 2-bit fields ``(R, 4C)`` as int32, lowest bits first."""
    b = b.to(tl.int32)
    even = tl.interleave(b & 3, (b >> 4) & 3)  # fields 0, 2
    odd = tl.interleave((b >> 2) & 3, (b >> 6) & 3)  # fields 1, 3
    return tl.interleave(even, odd)  # fields 0, 1, 2, 3

@triton.jit
def _group_dequant(codes, s_ptr, z_ptr, offs_n, c0, N, C, stride_sn, GROUP_C: tl.constexpr,
                   HAS_ZEROS: tl.constexpr, BLOCK_C: tl.constexpr):
    """``(codes - zero) * scale`` for a tile of columns ``c0 .. c0+BLOCK_C`` (of ``C``) with groups of
    ``GROUP_C``. Columns past ``C`` read no scale (a scale read past the row could be anything, NaN
    included, and NaN times a zero code is still NaN)."""
    nmask = offs_n < N
    if GROUP_C % BLOCK_C == 0:  # the whole tile lies in one group (tiles start at multiples of BLOCK_C)
        g = c0 // GROUP_C
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)[:, None]
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=nmask, other=0).to(tl.int32)[:, None]
        else:
            z = 8
    else:  # several groups per tile: gather per column
        cols = c0 + tl.arange(0, BLOCK_C)
        g = cols // GROUP_C
        ptrs = offs_n[:, None] * stride_sn + g[None, :]
        gmask = nmask[:, None] & (cols < C)[None, :]
        s = tl.load(s_ptr + ptrs, mask=gmask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + ptrs, mask=gmask, other=0).to(tl.int32)
        else:
            z = 8
    return (codes - z).to(tl.float32) * s

@triton.jit
def _densify_24(vals, pos, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Kept values ``(BN, BK/2)`` and their positions → dense ``(BN, BK)`` tile."""
    v0, v1 = tl.split(tl.reshape(vals, (BLOCK_N, BLOCK_K // 4, 2)))  # each (BN, BK/4)
    p0, p1 = tl.split(tl.reshape(pos, (BLOCK_N, BLOCK_K // 4, 2)))
    d0 = tl.where(p0 == 0, v0, 0.0) + tl.where(p1 == 0, v1, 0.0)
    d1 = tl.where(p0 == 1, v0, 0.0) + tl.where(p1 == 1, v1, 0.0)
    d2 = tl.where(p0 == 2, v0, 0.0) + tl.where(p1 == 2, v1, 0.0)
    d3 = tl.where(p0 == 3, v0, 0.0) + tl.where(p1 == 3, v1, 0.0)
    return tl.interleave(tl.interleave(d0, d2), tl.interleave(d1, d3))  # (BN, BK)

@triton.jit
def _load_meta_24(meta_ptr, offs_n, k0, N, K, stride_mn, BLOCK_K: tl.constexpr):
    """Positions of the ``BK/2`` kept values of columns ``k0 .. k0+BK``: int32 ``(BN, BK/2)``."""
    offs_b = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = (offs_n[:, None] < N) & (offs_b[None, :] < K // 8)
    return _crumbs(tl.load(meta_ptr + offs_n[:, None] * stride_mn + offs_b[None, :], mask=mask, other=0))

@triton.jit
def _load_w_tile(w_ptr, s_ptr, z_ptr, meta_ptr, offs_n, k0, N, K, stride_wn, stride_sn, stride_mn,
                 FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 tile ``W[offs_n, k0:k0+BLOCK_K]`` (INT8: unscaled codes), zero outside ``N x K``."""
    nmask = offs_n[:, None] < N
    if FMT == 0:  # INT8 codes (N, K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = nmask & (offs_k[None, :] < K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
        tile = w.to(tl.float32)
    elif FMT == 1:  # INT4 packed (N, K/2)
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = nmask & (offs_b[None, :] < K // 2)
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=mask, other=0)
        tile = _group_dequant(_nibbles(b), s_ptr, z_ptr, offs_n, k0, N, K, stride_sn, GROUP, HAS_ZEROS, BLOCK_K)
    elif FMT == 2:  # 2:4, kept values (N, K/2)
        offs_c = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = nmask & (offs_c[None, :] < K // 2)
        vals = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_c[None, :], mask=mask, other=0.0)
        pos = _load_meta_24(meta_ptr, offs_n, k0, N, K, stride_mn, BLOCK_K)
        tile = _densify_24(vals.to(tl.float32), pos, BLOCK_N, BLOCK_K)
    else:  # 2:4 + INT4: kept values packed (N, K/4), groups of GROUP/2 kept values
        offs_b = k0 // 4 + tl.arange(0, BLOCK_K // 4)
        mask = nmask & (offs_b[None, :] < K // 4)
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=mask, other=0)
        vals = _group_dequant(_nibbles(b), s_ptr, z_ptr, offs_n, k0 // 2, N, K // 2, stride_sn, GROUP // 2,
                              HAS_ZEROS, BLOCK_K // 2)
        pos = _load_meta_24(meta_ptr, offs_n, k0, N, K, stride_mn, BLOCK_K)
        tile = _densify_24(vals, pos, BLOCK_N, BLOCK_K)
    return tile
