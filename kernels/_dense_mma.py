"""Launcher of the INT4 GEMV on tensor cores ([Note: INT4 GEMV on tensor cores] in ``_dense_mma_kernels``).

The ``gemv`` path tunes it where :func:`dense_mma_w4_fits` (1 to 16 rows of ``x``, groups of a multiple of 128
columns; the policy sends it 1 to 8): beside the x-stationary kernels at one row, alone at more. It runs only
compiled on an sm_80+ GPU (the interpreter cannot run Gluon or ``mma.sync``), so CPU tests compile it for sm_90 and
check the instructions and run its inline asm through a PTX emulator, and GPU runs check its outputs against the
reference (``benchmarks/gemv_check.py --kinds dense``).
"""
from __future__ import annotations

import functools

import torch

from ._runtime import cdiv, compiled_gpu, optional_kernels, x_words_aligned

STRIPE_K = 128  # columns of a stripe: 8 MMAs of 16 columns, one 16-byte load a lane and row
MAX_M = 16  # rows of x: two blocks of 8, each one MMA's N side


@functools.cache
def _kernels():
    """The kernel module, or ``None`` where this Triton has no Gluon to build it with."""
    return optional_kernels("_dense_mma_kernels")


def dense_mma_possible(device: torch.device) -> bool:
    """Compiled (not interpreted) on an sm_80+ GPU, with a Triton that has Gluon."""
    return compiled_gpu(device, capability=(8, 0)) and _kernels() is not None


def dense_mma_w4_fits(x: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, *,
                      group: int) -> bool:
    """:func:`dense_mma_possible`, with 1 to 16 bf16 rows of ``x``, ``K`` and the groups multiples of 128 columns,
    INT4 words ``(N, K / 8)`` int32 in rows a lane can read 16 bytes of at a time, 2-D scales and uint8 zero points
    or none."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not 1 <= x.shape[0] <= MAX_M or x.stride(1) != 1:
        return False
    k = x.shape[1]
    if k % STRIPE_K or group % STRIPE_K or words.dtype != torch.int32 or words.dim() != 2 \
            or words.shape[1] * 8 != k or words.stride(1) != 1 or words.stride(0) % 4 or words.data_ptr() % 16:
        return False
    if s.dim() != 2 or s.shape[1] * group < k or (z is not None and (z.dtype != torch.uint8 or z.dim() != 2)):
        return False
    return dense_mma_possible(x.device)


def _setup(name: str, x: torch.Tensor, words: torch.Tensor, *, n: int, q: int, run: int, workspace):
    """``(stripes, split, runs, out, partials, counters)`` of a launch of ``q`` stripes a slice and ``run`` weight rows
    a program; more than one slice needs ``workspace`` ``(partials, counters)`` big enough for them."""
    m, k = x.shape
    stripes = k // STRIPE_K
    split = cdiv(stripes, q)
    runs = cdiv(n, run)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if split == 1:
        return stripes, split, runs, out, out, words
    if workspace is None:
        raise ValueError(f"{name}: more than one slice of K needs the fix-up workspace (partials, counters)")
    parts, counters = workspace
    if m * split * n > parts.numel() or runs > counters.numel():
        raise ValueError(f"{name}: {m} rows x {split} slices x {n} partials (or {runs} counters) do not fit the "
                         f"workspace")
    return stripes, split, runs, out, parts, counters


def run_dense_mma_w4(x: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, *, n: int,
                     group: int, stripes_per_slice: int, row_blocks: int, warps: int, k_warps: int = 1,
                     depth: int = 0, x_shared: bool = False,
                     workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """INT4 ``x @ dequant(words)^T`` in bf16 (:func:`dense_mma_w4_fits`): ``stripes_per_slice`` stripes of 128
    columns of ``K`` per program (a power of two), ``k_warps`` of the ``warps`` splitting them ([Note: warps along K]
    in ``_dense_mma_kernels``), ``row_blocks`` blocks of ``16 * warps / k_warps`` weight rows per program (a power of
    two), ``depth`` (0 or 1) of them loaded ahead, ``x_shared``: ``x`` in shared memory, read for each block ([Note: x
    in shared memory]); 9 to 16 rows run two blocks of 8 through each weight
    fragment. More than one slice needs ``workspace`` ``(partials,
    counters)`` ([Note: split-K fix-up] in ``_word``)."""
    q, rb = stripes_per_slice, row_blocks
    if q < 1 or q & (q - 1) or rb < 1 or rb & (rb - 1) or warps not in (1, 2, 4, 8) or depth not in (0, 1) \
            or k_warps < 1 or warps % k_warps or q % k_warps:
        raise ValueError(f"run_dense_mma_w4: stripes_per_slice and row_blocks must be powers of two, warps 1, 2, 4 "
                         f"or 8, k_warps a divisor of both warps and stripes_per_slice, depth 0 or 1; got {q}, {rb}, "
                         f"{warps}, {k_warps}, {depth}")
    if group % STRIPE_K:
        raise ValueError(f"run_dense_mma_w4: the groups must be a multiple of {STRIPE_K} columns, got {group}")
    m = x.shape[0]
    run = 16 * warps // k_warps * rb
    stripes, split, runs, out, parts, counters = _setup("run_dense_mma_w4", x, words, n=n, q=q, run=run,
                                                        workspace=workspace)
    zz = z if z is not None else s
    nt = 1 if m <= 8 else 2
    asm, io = _kernels().w4_dense_asm(nt)
    _kernels().dense_mma_w4_kernel[(runs, split)](
        x.view(torch.int16), words, s, zz, parts, counters, out, m, n, stripes, split,
        x.stride(0), words.stride(0), s.stride(0), zz.stride(0), out.stride(0),
        GROUP=group, HAS_ZEROS=z is not None, Q=q // k_warps, WK=k_warps, NT=nt, ROW_BLOCKS=rb, DEPTH=depth,
        EVEN_K=stripes % q == 0,
        PARTIAL=split > 1, FIX_K=max(1, min(16, 4096 // run)), ASM=asm, ASM_IO=io, XS=x_shared,
        XVEC=x_words_aligned(x), num_warps=warps)
    return out


FOLD_M = 4  # rows of x with folded rows: two of the MMA's 8 columns a row ([Note: INT4 GEMV with folded rows])


def run_dense_mma_w4_fold(x: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, *, n: int,
                          group: int, stripes_per_slice: int, row_blocks: int, warps: int, k_warps: int = 1,
                          depth: int = 0, late_sums: int = 0,
                          workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """INT4 ``x @ dequant(words)^T`` with folded rows (:func:`dense_mma_w4_fits`, at most :data:`FOLD_M` rows of
    ``x``): ``stripes_per_slice`` stripes of 128 columns a program (a power of two), ``k_warps`` of the ``warps``
    splitting them ([Note: fold warps along K] in ``_dense_mma_kernels``), ``row_blocks`` blocks of ``8 * warps /
    k_warps`` weight rows (a power of two; any count with one slice of ``K`` and the sums a block at a time: [Note:
    balanced runs] in ``_dense_mma_kernels``), ``depth`` 0 or 1 of them loaded ahead; ``late_sums`` (with
    ``k_warps`` > 1): the warps' sums added once after the last block, not a block at a time, kept until then in
    shared memory (1) or in registers (2)."""
    q, rb = stripes_per_slice, row_blocks
    if q < 1 or q & (q - 1) or rb < 1 or warps not in (1, 2, 4, 8, 16) or depth not in (0, 1) \
            or k_warps < 1 or warps % k_warps or q % k_warps or late_sums not in (0, 1, 2):
        raise ValueError(f"run_dense_mma_w4_fold: stripes_per_slice must be a power of two, row_blocks >= 1, warps 1, "
                         f"2, 4, 8 or 16, k_warps a divisor of both warps and stripes_per_slice, depth 0 or 1, "
                         f"late_sums 0, 1 or 2; got {q}, {rb}, {warps}, {k_warps}, {depth}, {late_sums}")
    m = x.shape[0]
    if m > FOLD_M or group % STRIPE_K:
        raise ValueError(f"run_dense_mma_w4_fold: at most {FOLD_M} rows of x and groups of a multiple of "
                         f"{STRIPE_K} columns, got {m} rows, groups of {group}")
    run = 8 * warps // k_warps * rb
    stripes, split, runs, out, parts, counters = _setup("run_dense_mma_w4_fold", x, words, n=n, q=q, run=run,
                                                        workspace=workspace)
    late = late_sums if k_warps > 1 else 0
    if rb & (rb - 1) and (split > 1 or late):  # the fix-up and the kept sums lay a run out in powers of two
        raise ValueError(f"run_dense_mma_w4_fold: {rb} row blocks (not a power of two) need one slice of K and the "
                         f"sums added a block at a time ([Note: balanced runs] in _dense_mma_kernels); got {split} "
                         f"slices, late_sums={late_sums}")
    zz = z if z is not None else s
    asm, io = _kernels().w4_dense_fold_asm()
    _kernels().dense_mma_w4_fold_kernel[(runs, split)](
        x.view(torch.int16), words, s, zz, parts, counters, out, m, n, stripes, split,
        x.stride(0), words.stride(0), s.stride(0), zz.stride(0), out.stride(0),
        GROUP=group, HAS_ZEROS=z is not None, Q=q // k_warps, WK=k_warps, ROW_BLOCKS=rb, DEPTH=depth,
        EVEN_K=stripes % q == 0, PARTIAL=split > 1, FIX_K=max(1, min(16, 4096 // run)),
        LATE=late, ASM=asm, ASM_IO=io, XVEC=x_words_aligned(x), num_warps=warps)
    return out
