"""The Triton kernels of the matmul skeleton and their autotuned launchers.

Imported lazily (on the first launch, see ``_gemm.kernels``): ``@triton.jit``
decides at decoration time whether it builds an interpreted (CPU) or a compiled
(GPU) kernel from ``TRITON_INTERPRET``, so decorating late lets a test module set
that variable after ``zspeed.kernels`` is already imported. The design of the
paths is in ``_gemm.py``; [Note: interpreter dot] is there too.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._runtime import bench_fn, interpreting, m_bucket
from ._tiles import _load_w_tile


@triton.jit(do_not_specialize=["M"])
def _qmm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, meta_ptr, out_ptr, M, N, K, M_BUCKET,
                stride_xm, stride_wn, stride_sn, stride_mn, stride_om,
                FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, DOT_F32: tl.constexpr,
                ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)  # row block varies fastest: its programs share a weight tile in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_lo = pid_k * per_split
    t_hi = tl.minimum(t_lo + per_split, k_tiles)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for t in range(t_lo, t_hi):
            offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            w = _load_w_tile(w_ptr, s_ptr, z_ptr, meta_ptr, offs_n, t * BLOCK_K, N, K, stride_wn, stride_sn,
                             stride_mn, FMT, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
            acc += tl.sum(w * x[None, :], axis=1)
        if FMT == 0:
            acc *= tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.atomic_add(out_ptr + pid_m * stride_om + offs_n, acc, mask=offs_n < N)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(t_lo, t_hi):
            offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
            xmask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=xmask, other=0.0)
            w = _load_w_tile(w_ptr, s_ptr, z_ptr, meta_ptr, offs_n, t * BLOCK_K, N, K, stride_wn, stride_sn,
                             stride_mn, FMT, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
            if DOT_F32:
                acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        if FMT == 0:
            acc *= tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if ATOMIC:
            tl.atomic_add(out_ptrs, acc, mask=omask)
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)

@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, meta_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_mn, stride_on,
                    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _load_w_tile(w_ptr, s_ptr, z_ptr, meta_ptr, offs_n, k0, N, K, stride_wn, stride_sn, stride_mn,
                     FMT, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
    if FMT == 0:
        w *= tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def _cfg(bm: int, bn: int, bk: int, split: int, warps: int = 4, stages: int = 3):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split},
                         num_warps=warps, num_stages=stages)


def _splitk_configs() -> list:
    if interpreting():
        return [_cfg(1, 32, 32, 2, 1, 1), _cfg(16, 32, 32, 2, 1, 1)]
    gemv = [_cfg(1, bn, bk, s, w) for bn, bk, s, w in
            ((64, 128, 4, 4), (128, 128, 4, 8), (64, 256, 2, 8), (32, 256, 8, 4), (128, 64, 8, 4))]
    dot = [_cfg(bm, bn, bk, s, w, st) for bm, bn, bk, s, w, st in
           ((16, 64, 128, 4, 4, 4), (16, 128, 64, 4, 4, 4), (16, 64, 64, 8, 4, 4),
            (32, 64, 128, 4, 4, 3), (64, 64, 64, 4, 4, 3), (64, 128, 64, 2, 4, 3))]
    return gemv + dot


def _tiled_configs() -> list:
    if interpreting():
        return [_cfg(16, 32, 32, 1, 1, 1)]
    return [_cfg(bm, bn, bk, 1, w, st) for bm, bn, bk, w, st in
            ((64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 64, 128, 4, 3),
             (128, 256, 64, 8, 3))]


def _prune_splitk(configs, named_args, **kwargs):
    """GEMV configs (``BLOCK_M == 1``) for up to 4 rows; ``tl.dot`` configs no taller than needed.

    Under the interpreter: GEMV for one row, ``tl.dot`` otherwise, so tests reach both."""
    m = named_args["M"]
    keep = [c for c in configs if _fits(c.kwargs["BLOCK_M"], m)]
    if interpreting():
        keep = keep[-1:] if m > 1 else keep[:1]
    return keep


def _fits(block_m: int, m: int) -> bool:
    if block_m == 1:
        return m <= 4
    return m > 1 and block_m <= max(16, m_bucket(m))


def _prune_tiled(configs, named_args, **kwargs):
    m = named_args["M"]
    return [c for c in configs if c.kwargs["BLOCK_M"] <= max(64, m_bucket(m))] or configs[:1]


_KEY = ["M_BUCKET", "N", "K", "FMT", "GROUP", "HAS_ZEROS"]

splitk = triton.autotune(_splitk_configs(), key=_KEY, reset_to_zero=["out_ptr"], do_bench=bench_fn,
                         prune_configs_by={"early_config_prune": _prune_splitk})(_qmm_kernel)
tiled = triton.autotune(_tiled_configs(), key=_KEY, do_bench=bench_fn,
                        prune_configs_by={"early_config_prune": _prune_tiled})(_qmm_kernel)
dequant = _dequant_kernel
