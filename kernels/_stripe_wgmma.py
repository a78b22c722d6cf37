"""Launcher of the INT4 GEMV on ``wgmma`` ([Note: INT4 GEMV on wgmma] in ``_stripe_wgmma_kernels``).

The ``wdot`` path tunes it beside its tiled kernels at 9 to 16 rows of ``x`` where :func:`stripe_wgmma_fits`. It runs
only compiled on an sm_90 GPU (``wgmma`` is Hopper's; the interpreter cannot run Gluon), so CPU tests compile it for
sm_90 and check its instructions, and GPU runs check its outputs against the reference (``benchmarks/gemv_check.py
--ms 16 --kinds wdot wgmma``).
"""
from __future__ import annotations

import functools

import torch

from ._dense_mma import STRIPE_K, _setup
from ._runtime import compiled_gpu, optional_kernels

MIN_M, MAX_M = 9, 16  # rows of x it is offered at; the wgmma's N is 16
CHUNK_STRIPES = (1, 2)  # stripes of a chunk (the asm's registers: 2 fit 128 at 4 warps, 4 do not)
MAX_X_BYTES = 160 * 1024  # shared memory for a program's slice of x


@functools.cache
def _kernels():
    """The kernel module, or ``None`` where this Triton has no Gluon (or no Hopper ``wgmma``) to build it with."""
    return optional_kernels("_stripe_wgmma_kernels")


def stripe_wgmma_possible(device: torch.device) -> bool:
    """Compiled (not interpreted) on an sm_90 GPU, with a Triton that has Gluon."""
    return compiled_gpu(device, capability=(9, 0), exact=True) and _kernels() is not None


def stripe_wgmma_fits(x: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, *,
                      group: int) -> bool:
    """:func:`stripe_wgmma_possible`, with :data:`MIN_M` to :data:`MAX_M` bf16 rows of ``x``, ``K`` and the groups
    multiples of 128 columns, INT4 words ``(N, K / 8)`` int32 in rows a lane can read 16 bytes of at a time, 2-D bf16
    scales (the dequantized weight is rounded once, in bf16) and uint8 zero points or none."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not MIN_M <= x.shape[0] <= MAX_M or x.stride(1) != 1:
        return False
    k = x.shape[1]
    if k % STRIPE_K or group % STRIPE_K or words.dtype != torch.int32 or words.dim() != 2 \
            or words.shape[1] * 8 != k or words.stride(1) != 1 or words.stride(0) % 4 or words.data_ptr() % 16:
        return False
    if s.dim() != 2 or s.dtype != torch.bfloat16 or s.shape[1] * group < k \
            or (z is not None and (z.dtype != torch.uint8 or z.dim() != 2)):
        return False
    return stripe_wgmma_possible(x.device)


def run_stripe_wgmma_w4(x: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, *, n: int,
                        group: int, chunk_stripes: int, chunks: int, row_blocks: int, warps: int,
                        workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """INT4 ``x @ dequant(words)^T`` in bf16 (:func:`stripe_wgmma_fits`): a program's slice of ``K`` is ``chunks``
    chunks of ``chunk_stripes`` stripes of 128 columns, its run ``row_blocks`` blocks of ``16 * warps`` weight rows
    (``warps`` 4 or 8: one or two warp groups). More than one slice needs ``workspace`` ``(partials, counters)``
    ([Note: split-K fix-up] in ``_word``)."""
    q = chunk_stripes * chunks
    if chunk_stripes not in CHUNK_STRIPES or chunks < 1 or row_blocks < 1 or warps not in (4, 8):
        raise ValueError(f"run_stripe_wgmma_w4: chunk_stripes must be one of {CHUNK_STRIPES}, chunks and row_blocks "
                         f">= 1, warps 4 or 8; got {chunk_stripes}, {chunks}, {row_blocks}, {warps}")
    if MAX_M * STRIPE_K * q * 2 > MAX_X_BYTES:
        raise ValueError(f"run_stripe_wgmma_w4: a slice of {q} stripes of x takes {MAX_M * STRIPE_K * q * 2} bytes of "
                         f"shared memory, more than {MAX_X_BYTES}; use fewer chunks")
    m = x.shape[0]
    if m > MAX_M or group % STRIPE_K:
        raise ValueError(f"run_stripe_wgmma_w4: at most {MAX_M} rows of x and groups of a multiple of {STRIPE_K} "
                         f"columns, got {m} rows, groups of {group}")
    run = 16 * warps * row_blocks
    stripes, split, runs, out, parts, counters = _setup("run_stripe_wgmma_w4", x, words, n=n, q=q, run=run,
                                                        workspace=workspace)
    zz = z if z is not None else s
    kernels = _kernels()
    asm, io = kernels.stripe_wgmma_asm()
    kernels.stripe_wgmma_w4_kernel[(runs, split)](
        x, words, s, zz, parts, counters, out, m, n, stripes, split,
        x.stride(0), words.stride(0), s.stride(0), zz.stride(0), out.stride(0),
        GROUP=group, HAS_ZEROS=z is not None, QI=chunk_stripes, QC=chunks, MN=MAX_M, ROW_BLOCKS=row_blocks,
        EVEN_K=stripes % q == 0, PARTIAL=split > 1, FIX_K=max(1, min(16, 4096 // run)),
        CL=kernels.stripe_layout(warps, chunk_stripes), ASM=asm, ASM_IO=io, num_warps=warps)
    return out
