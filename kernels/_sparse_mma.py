"""Launchers of the 2:4 GEMV and GEMM on sparse tensor cores ([Note: 2:4 GEMV on sparse tensor cores] in
``_sparse_mma_kernels``, [Note: 2:4 GEMM on sparse tensor cores] in ``_sparse_gemm_kernels``).

The ``gemv`` path tunes the GEMV where :func:`sparse_mma_fits` (1-8 rows of ``x``) and the GEMM alone from 9 rows
where :func:`sparse_gemm_fits` (up to ``KernelPolicy.sparse_gemm_max_m``). Each
runs only compiled on an sm_80+ GPU (the interpreter cannot run Gluon or ``mma.sp``), so CPU tests compile it for
sm_90 and check the instructions, and GPU runs check its outputs against the reference
(``benchmarks/gemv_check.py``, ``benchmarks/bench_kernels.py``).
"""
from __future__ import annotations

import functools

import torch

from ._runtime import cdiv, compiled_gpu, optional_kernels, x_words_aligned

TILE_K = 32  # columns per mma.sp.m16n8k32
MAX_M = 8  # rows of x: the MMA's N side


@functools.cache
def _kernels():
    """The kernel module, or ``None`` where this Triton has no Gluon to build it with."""
    return optional_kernels("_sparse_mma_kernels")


def sparse_mma_possible(device: torch.device) -> bool:
    """Compiled (not interpreted) on an sm_80+ GPU, with a Triton that has Gluon."""
    return compiled_gpu(device, capability=(8, 0)) and _kernels() is not None


def sparse_mma_fits(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor | None) -> bool:
    """:func:`sparse_mma_possible`, with 1 to 8 bf16 rows of ``x`` (readable as int32 pairs), value words ``(N, K / 4)``
    int32 and positions ``(N, K / 8)`` uint8 readable as int32 words; ``K`` a multiple of 32."""
    if meta is None or x.dtype != torch.bfloat16 or not 1 <= x.shape[0] <= MAX_M or x.stride(1) != 1:
        return False
    k = x.shape[1]
    if k % TILE_K or x.stride(0) % 2 or x.data_ptr() % 4 or words.stride(1) != 1 or words.shape[1] * 4 != k:
        return False
    if meta.dtype != torch.uint8 or meta.dim() != 2 or meta.stride(1) != 1 or meta.shape[1] * 8 != k \
            or meta.stride(0) % 4 or meta.data_ptr() % 4:
        return False
    return sparse_mma_possible(x.device)


def _setup(name: str, x: torch.Tensor, like: torch.Tensor, *, n: int, tiles_per_slice: int, row_blocks: int,
           warps: int, workspace, warp_rows: int = 16, k_warps: int = 1):
    """``(tiles, split, run, out, partials, counters, fix_k)`` of a launch, its arguments checked first; a warp
    takes ``warp_rows`` weight rows of a block, ``k_warps`` of the warps splitting the slice instead."""
    m, k = x.shape
    tiles = k // TILE_K
    split = cdiv(tiles, tiles_per_slice)
    if tiles_per_slice < 2 or tiles_per_slice & (tiles_per_slice - 1) or row_blocks < 1 \
            or row_blocks & (row_blocks - 1) or warps not in (1, 2, 4, 8, 16) or k_warps < 1 or warps % k_warps:
        raise ValueError(f"{name}: tiles_per_slice must be a power of two from 2 (two tiles share a metadata "
                         f"register), row_blocks a power of two, warps 1, 2, 4, 8 or 16 and k_warps a divisor of "
                         f"them; got {tiles_per_slice}, {row_blocks}, {warps}, {k_warps}")
    if split > 1 and workspace is None:
        raise ValueError(f"{name}: more than one slice of K needs the fix-up workspace (partials, counters)")
    run = warp_rows * warps // k_warps * row_blocks
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts, counters = workspace if split > 1 else (out, like)
    return tiles, split, run, out, parts, counters, max(1, min(16, 4096 // run))


def run_sparse_mma(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor, *, n: int, tiles_per_slice: int,
                   row_blocks: int, warps: int, depth: int = 0,
                   workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``x @ densify(values, meta)^T`` in bf16 (:func:`sparse_mma_fits`): ``words`` the kept values as int32 words,
    ``tiles_per_slice`` 32-column tiles of ``K`` per program (even), ``row_blocks`` blocks of ``16 * warps`` weight
    rows per program (a power of two), ``depth`` (0, 1 or 2) of them loaded ahead into registers. More than one slice
    needs ``workspace`` ``(partials, counters)`` ([Note: split-K fix-up] in ``_word``)."""
    if depth not in (0, 1, 2):
        raise ValueError(f"run_sparse_mma: depth must be 0, 1 or 2, got {depth}")
    m = x.shape[0]
    tiles, split, run, out, parts, counters, fix_k = _setup("run_sparse_mma", x, words, n=n,
                                                            tiles_per_slice=tiles_per_slice, row_blocks=row_blocks,
                                                            warps=warps, workspace=workspace)
    _kernels().sparse_mma_kernel[(cdiv(n, run), split)](
        x.view(torch.int32), words, meta.view(torch.int32), parts, counters, out, m, n, tiles, split,
        x.stride(0) // 2, words.stride(0), meta.stride(0) // 4, out.stride(0),
        KT=tiles_per_slice, ROW_BLOCKS=row_blocks, DEPTH=depth, PARTIAL=split > 1, FIX_K=fix_k, num_warps=warps)
    return out


def sparse_mma_stripe_fits(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor | None, stripe: int) -> bool:
    """:func:`sparse_mma_fits`, and operands the striped kernel reads in vectors ([Note: 2:4 stripes] in
    ``_sparse_mma_kernels``): ``K`` a multiple of the stripe, a lane's 8 bytes a tile and the stripe's positions
    aligned as vectors."""
    if not sparse_mma_fits(x, words, meta) or x.shape[1] % (TILE_K * stripe):
        return False
    return words.stride(0) % (2 * stripe) == 0 and words.data_ptr() % 16 == 0 and meta.stride(0) % (4 * stripe) == 0 \
        and meta.data_ptr() % 16 == 0


def run_sparse_mma_stripe(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor, *, n: int, stripe: int,
                          tiles_per_slice: int, row_blocks: int, warps: int, depth: int = 0,
                          workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Plain 2:4 on sparse tensor cores in stripes of ``stripe`` (2 or 4) tiles (:func:`sparse_mma_stripe_fits`):
    operands as :func:`run_sparse_mma`, ``depth`` 0 or 1 blocks loaded ahead, whole stripes a slice."""
    if depth not in (0, 1) or stripe not in (2, 4):
        raise ValueError(f"run_sparse_mma_stripe: depth must be 0 or 1 and stripe 2 or 4, got {depth}, {stripe}")
    if tiles_per_slice % stripe or tiles_per_slice & (tiles_per_slice - 1):
        raise ValueError(f"run_sparse_mma_stripe: tiles_per_slice must be a power of two and a multiple of the "
                         f"stripe ({stripe}), got {tiles_per_slice}")
    m = x.shape[0]
    tiles, split, run, out, parts, counters, fix_k = _setup("run_sparse_mma_stripe", x, words, n=n,
                                                            tiles_per_slice=tiles_per_slice, row_blocks=row_blocks,
                                                            warps=warps, workspace=workspace)
    lanes = words.view(torch.int64)  # two value words a tile and lane
    meta32 = meta.view(torch.int32)
    asm, io = _kernels().s24_stripe_asm(stripe)
    _kernels().sparse_mma_stripe_kernel[(cdiv(n, run), split)](
        x.view(torch.int32), lanes, meta32, parts, counters, out, m, n, tiles, split,
        x.stride(0) // 2, lanes.stride(0), meta32.stride(0), out.stride(0),
        KT=tiles_per_slice, STRIPE=stripe, ROW_BLOCKS=row_blocks, DEPTH=depth, EVEN_K=tiles % tiles_per_slice == 0,
        PARTIAL=split > 1, FIX_K=fix_k, ASM=asm, ASM_IO=io, num_warps=warps)
    return out


FOLD_M = 4  # rows of x with folded rows: two of the MMA's 8 columns a row ([Note: 2:4 folded rows])


def sparse_mma_fold_fits(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor | None) -> bool:
    """:func:`sparse_mma_fits` with at most :data:`FOLD_M` rows of ``x``, ``K`` a multiple of 64 (one MMA), and the
    values and positions aligned as the folded kernel reads them: a lane's 16 bytes of values an MMA, 8 bytes of
    positions ([Note: 2:4 folded rows] in ``_sparse_mma_kernels``)."""
    if not sparse_mma_fits(x, words, meta) or x.shape[0] > FOLD_M or x.shape[1] % (2 * TILE_K):
        return False
    return words.stride(0) % 4 == 0 and words.data_ptr() % 16 == 0 and meta.stride(0) % 8 == 0 \
        and meta.data_ptr() % 8 == 0


def run_sparse_mma_fold(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor, *, n: int, tiles_per_slice: int,
                        row_blocks: int, warps: int, depth: int = 0,
                        workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Plain 2:4 on sparse tensor cores with folded rows (:func:`sparse_mma_fold_fits`): operands as
    :func:`run_sparse_mma`; ``tiles_per_slice`` counts 32-column tiles (a power of two from 4: whole pairs of MMAs of
    64 columns), ``row_blocks`` blocks of ``8 * warps`` weight rows, ``depth`` 0, 1 or 2 blocks loaded ahead."""
    if depth not in (0, 1, 2) or tiles_per_slice < 4:
        raise ValueError(f"run_sparse_mma_fold: depth must be 0, 1 or 2 and tiles_per_slice at least 4 (a pair of "
                         f"MMAs), got {depth}, {tiles_per_slice}")
    m = x.shape[0]
    if m > FOLD_M:
        raise ValueError(f"run_sparse_mma_fold: at most {FOLD_M} rows of x, got {m}; use run_sparse_mma")
    tiles, split, run, out, parts, counters, fix_k = _setup("run_sparse_mma_fold", x, words, n=n,
                                                            tiles_per_slice=tiles_per_slice, row_blocks=row_blocks,
                                                            warps=warps, workspace=workspace, warp_rows=8)
    quads = words.view(torch.int64)  # a lane's quad of an MMA: two 64-bit halves
    pos = meta.view(torch.int64)  # an MMA's 16 positions
    asm, io = _kernels().s24_fold_asm()
    _kernels().sparse_mma_fold_kernel[(cdiv(n, run), split)](
        x.view(torch.int32), quads, pos, parts, counters, out, m, n, tiles // 2, split,
        x.stride(0) // 2, quads.stride(0), pos.stride(0), out.stride(0),
        KP=tiles_per_slice // 4, ROW_BLOCKS=row_blocks, DEPTH=depth, EVEN_K=tiles % tiles_per_slice == 0,
        PARTIAL=split > 1, FIX_K=fix_k, ASM=asm, ASM_IO=io, num_warps=warps)
    return out


def sparse_mma_w4_fits(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor | None, s: torch.Tensor,
                       z: torch.Tensor | None, *, group: int) -> bool:
    """2:4 + INT4 on sparse tensor cores: as :func:`sparse_mma_fits` for ``x`` and ``meta`` (here int16 words, as the
    ``gemv`` path views them), kept values' codes ``(N, K / 4)`` readable as int16 (given as int32 words), groups
    of a multiple of 64 original columns, 2-D scales and uint8 zero points or none."""
    if meta is None or x.dtype != torch.bfloat16 or not 1 <= x.shape[0] <= MAX_M or x.stride(1) != 1:
        return False
    k = x.shape[1]
    stripe = w4_stripe(group)
    if group % 64 or k % (TILE_K * stripe) or x.stride(0) % 2 or x.data_ptr() % 4 or codes.stride(1) != 1 \
            or codes.shape[1] * 16 != k or s.dim() != 2 or (z is not None and (z.dtype != torch.uint8 or z.dim() != 2)):
        return False
    # a lane reads 2 bytes of codes a tile and every lane the stripe's 4 bytes of positions a tile, in one vector each
    if (codes.stride(0) * 4) % (2 * stripe) or codes.data_ptr() % 16:
        return False
    if meta.dtype != torch.int16 or meta.dim() != 2 or meta.stride(1) != 1 or meta.shape[1] * 16 != k \
            or (meta.stride(0) * 2) % (4 * stripe) or meta.data_ptr() % 16:
        return False
    return sparse_mma_possible(x.device)


def w4_stripe(group: int) -> int:
    """Tiles a stripe of 2:4 + INT4 weights in the GEMV and the GEMM ([Note: INT4 stripes] in
    ``_sparse_mma_kernels``): 4 where the groups hold 128 original columns or a multiple, else 2; a stripe lies in one
    group."""
    return 4 if group % 128 == 0 else 2


def run_sparse_mma_w4(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
                      *, n: int, group: int, tiles_per_slice: int, row_blocks: int, warps: int, depth: int = 0,
                      workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """2:4 + INT4 ``x @ densify(dequant(codes), meta)^T`` in bf16 (:func:`sparse_mma_w4_fits`; ``codes`` and ``meta``
    as the ``gemv`` path views them: int32 and int16 words); slices, runs and workspace as :func:`run_sparse_mma`,
    ``depth`` 0 or 1 blocks loaded ahead."""
    if depth not in (0, 1):
        raise ValueError(f"run_sparse_mma_w4: depth must be 0 or 1, got {depth}")
    m = x.shape[0]
    stripe = w4_stripe(group)
    if tiles_per_slice % stripe or tiles_per_slice & (tiles_per_slice - 1):
        raise ValueError(f"run_sparse_mma_w4: tiles_per_slice must be a power of two and a multiple of the stripe "
                         f"({stripe} tiles for groups of {group} columns), got {tiles_per_slice}")
    tiles, split, run, out, parts, counters, fix_k = _setup("run_sparse_mma_w4", x, codes, n=n,
                                                            tiles_per_slice=tiles_per_slice, row_blocks=row_blocks,
                                                            warps=warps, workspace=workspace)
    zz = z if z is not None else s
    meta32 = meta.view(torch.int32)
    lanes = codes.view(torch.int64) if stripe == 4 else codes  # a lane's codes of a stripe: 8 or 4 bytes
    asm, io = _kernels().w4_stripe_asm(stripe)
    _kernels().sparse_mma_w4_kernel[(cdiv(n, run), split)](
        x.view(torch.int32), lanes, meta32, s, zz, parts, counters, out, m, n, tiles, split,
        x.stride(0) // 2, lanes.stride(0), meta32.stride(0), s.stride(0), zz.stride(0), out.stride(0),
        GROUP=group, HAS_ZEROS=z is not None, KT=tiles_per_slice, STRIPE=stripe, ROW_BLOCKS=row_blocks,
        DEPTH=depth, EVEN_K=tiles % tiles_per_slice == 0, PARTIAL=split > 1, FIX_K=fix_k, ASM=asm, ASM_IO=io,
        XVEC=x_words_aligned(x), num_warps=warps)
    return out


def sparse_mma_w4_fold_fits(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor | None, s: torch.Tensor,
                            z: torch.Tensor | None, *, group: int) -> bool:
    """:func:`sparse_mma_w4_fits` with at most :data:`FOLD_M` rows of ``x``, groups of a multiple of 128 original
    columns (a pair of MMAs lies in one) and ``K`` a multiple of 128, the codes of a row readable in 8-byte steps
    ([Note: 2:4 folded rows] in ``_sparse_mma_kernels``)."""
    return (sparse_mma_w4_fits(x, codes, meta, s, z, group=group) and x.shape[0] <= FOLD_M and group % 128 == 0
            and x.shape[1] % 128 == 0 and (codes.stride(0) * 4) % 8 == 0)


def run_sparse_mma_w4_fold(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, s: torch.Tensor,
                           z: torch.Tensor | None, *, n: int, group: int, tiles_per_slice: int, row_blocks: int,
                           warps: int, k_warps: int = 1, depth: int = 0, late_sums: int = 0,
                           workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """2:4 + INT4 with folded rows (:func:`sparse_mma_w4_fold_fits`): operands as :func:`run_sparse_mma_w4`;
    ``tiles_per_slice`` counts 32-column tiles of a program (a power of two from 4: whole pairs of MMAs, 128 columns,
    for each of the ``k_warps`` warps splitting them, [Note: fold warps along K] in ``_dense_mma_kernels``),
    ``row_blocks`` blocks of ``8 * warps / k_warps`` weight rows, ``depth`` 0 or 1 blocks loaded ahead; ``late_sums``
    (with ``k_warps`` > 1): the warps' sums of every block added across them once, after the last block, kept until
    then in shared memory (1) or in registers (2)."""
    if depth not in (0, 1) or k_warps < 1 or tiles_per_slice < 4 * k_warps or late_sums not in (0, 1, 2):
        raise ValueError(f"run_sparse_mma_w4_fold: depth must be 0 or 1, tiles_per_slice at least 4 (a pair of "
                         f"MMAs) a warp along K and late_sums 0, 1 or 2, got {depth}, {tiles_per_slice}, {k_warps} "
                         f"warps along K, {late_sums}")
    m = x.shape[0]
    if m > FOLD_M or group % 128:
        raise ValueError(f"run_sparse_mma_w4_fold: at most {FOLD_M} rows of x and groups of a multiple of 128 "
                         f"columns, got {m} rows, groups of {group}; use run_sparse_mma_w4")
    tiles, split, run, out, parts, counters, fix_k = _setup("run_sparse_mma_w4_fold", x, codes, n=n,
                                                            tiles_per_slice=tiles_per_slice, row_blocks=row_blocks,
                                                            warps=warps, workspace=workspace, warp_rows=8,
                                                            k_warps=k_warps)
    zz = z if z is not None else s
    lanes = codes.view(torch.int64)  # a lane's 8 code bytes of a pair of MMAs
    meta32 = meta.view(torch.int32)
    asm, io = _kernels().w4_fold_asm()
    _kernels().sparse_mma_w4_fold_kernel[(cdiv(n, run), split)](
        x.view(torch.int32), lanes, meta32, s, zz, parts, counters, out, m, n, tiles // 4, split,
        x.stride(0) // 2, lanes.stride(0), meta32.stride(0), s.stride(0), zz.stride(0), out.stride(0),
        GROUP=group, HAS_ZEROS=z is not None, KP=tiles_per_slice // 4 // k_warps, WK=k_warps, ROW_BLOCKS=row_blocks,
        DEPTH=depth, EVEN_K=tiles % tiles_per_slice == 0, PARTIAL=split > 1, FIX_K=fix_k,
        LATE=late_sums if k_warps > 1 else 0, ASM=asm, ASM_IO=io, num_warps=warps)
    return out


MAX_GEMM_GROUPS = 8  # groups of 8 rows of x per program of the 2:4 GEMM ([Note: 2:4 GEMM on sparse tensor cores])


@functools.cache
def _gemm_kernels():
    """The 2:4 GEMM kernel module, or ``None`` where this Triton has no Gluon."""
    return optional_kernels("_sparse_gemm_kernels")


def sparse_gemm_fits(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor | None, *, w4: bool = False,
                     s: torch.Tensor | None = None, z: torch.Tensor | None = None, group: int = 0) -> bool:
    """The 2:4 GEMM (plain, or + INT4 with ``w4``) takes any number of rows of ``x``; otherwise what
    :func:`sparse_mma_fits` / :func:`sparse_mma_w4_fits` ask of the operands."""
    if x.dim() != 2 or x.shape[0] < 1 or _gemm_kernels() is None:
        return False
    one = x[:1]  # the operand checks of the GEMV, for one row (x's stride and pointer are the same)
    if w4:  # the weights are made in bf16: bf16 scales
        return s is not None and s.dtype == torch.bfloat16 and sparse_mma_w4_fits(one, words, meta, s, z, group=group)
    return sparse_mma_fits(one, words, meta)


def run_sparse_gemm(x: torch.Tensor, words: torch.Tensor, meta: torch.Tensor, *, n: int, tiles_per_chunk: int,
                    groups: int, split: int, warps: int, depth: int = 1, blocks: int = 1,
                    workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``x @ densify(values, meta)^T`` in bf16 on the 2:4 GEMM ([Note: 2:4 GEMM on sparse tensor cores]; operands
    as :func:`run_sparse_mma`): programs of ``groups`` groups of 8 rows of ``x`` and ``16 * warps * blocks`` weight
    rows (``blocks`` of 16 a warp), ``K`` in ``split`` slices walked ``tiles_per_chunk`` tiles at a time, ``depth`` 1
    loading the next chunk's weights before this one's MMAs (0: after)."""
    return _launch_gemm("run_sparse_gemm", x, words, meta.view(torch.int32), None, None, n=n, group=64,
                        tiles_per_chunk=tiles_per_chunk, groups=groups, split=split, warps=warps, depth=depth,
                        blocks=blocks, workspace=workspace)


def run_sparse_gemm_w4(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, s: torch.Tensor,
                       z: torch.Tensor | None, *, n: int, group: int, tiles_per_chunk: int, groups: int, split: int,
                       warps: int, depth: int = 1, blocks: int = 1,
                       workspace: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """2:4 + INT4 on the 2:4 GEMM (operands as :func:`run_sparse_mma_w4`, bf16 scales; the rest as
    :func:`run_sparse_gemm`): each chunk's kept values are dequantized once into bf16 weights, as the reference
    makes them, before its MMAs."""
    if s.dtype != torch.bfloat16:
        raise ValueError(f"run_sparse_gemm_w4: the scales must be bf16 (the weights are made in bf16), got {s.dtype}")
    return _launch_gemm("run_sparse_gemm_w4", x, codes.view(torch.int16), meta.view(torch.int32), s, z, n=n,
                        group=group, tiles_per_chunk=tiles_per_chunk, groups=groups, split=split, warps=warps,
                        depth=depth, blocks=blocks, workspace=workspace)


def _launch_gemm(name: str, x: torch.Tensor, words: torch.Tensor, meta32: torch.Tensor, s: torch.Tensor | None,
                 z: torch.Tensor | None, *, n: int, group: int, tiles_per_chunk: int, groups: int, split: int,
                 warps: int, depth: int, blocks: int, workspace) -> torch.Tensor:
    """The 2:4 GEMM, its arguments checked first: ``split`` slices of whole chunks of ``tiles_per_chunk`` tiles (fewer
    where that covers ``K``), 2:4 + INT4 where ``s`` is given."""
    m, k = x.shape
    tiles = k // TILE_K
    if tiles_per_chunk % 2 or tiles_per_chunk < 2 or groups not in (1, 2, 4, 8) or warps not in (1, 2, 4, 8) \
            or split < 1 or blocks not in (1, 2) or depth not in (0, 1):
        raise ValueError(f"{name}: tiles_per_chunk must be even, groups and warps 1, 2, 4 or 8, split >= 1, blocks 1 "
                         f"or 2, depth 0 or 1; got {tiles_per_chunk}, {groups}, {warps}, {split}, {blocks}, {depth}")
    stripe = w4_stripe(group) if s is not None else 1  # 2:4 + INT4 in stripes ([Note: INT4 stripes])
    if tiles_per_chunk % stripe:
        raise ValueError(f"{name}: tiles_per_chunk must be a multiple of the stripe ({stripe} tiles for groups of "
                         f"{group} columns), got {tiles_per_chunk}")
    chunks = cdiv(cdiv(tiles, split), tiles_per_chunk)
    split = cdiv(tiles, chunks * tiles_per_chunk)
    rows = 16 * warps * blocks
    runs = cdiv(n, rows)
    m_groups = cdiv(m, 8 * groups)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if split > 1:
        if workspace is None:
            raise ValueError(f"{name}: more than one slice of K needs the fix-up workspace (partials, counters)")
        parts, counters = workspace
        if m * split * n > parts.numel() or m_groups * runs > counters.numel():
            raise ValueError(f"{name}: {m} rows x {split} slices x {n} partials (or {m_groups * runs} counters) do "
                             f"not fit the workspace")
    else:
        parts, counters = out, words
    chain, chain_io = _gemm_kernels().chain_asm(tiles_per_chunk, blocks)
    meta, meta_io = _gemm_kernels().stripe_meta_asm(stripe) if s is not None else ("", "")
    ss = s if s is not None else out
    zz = z if z is not None else ss
    _gemm_kernels().sparse_gemm_kernel[(m_groups, runs, split)](
        x.view(torch.int32), words, meta32, ss, zz, parts, counters, out, m, n, tiles, split, chunks, runs,
        x.stride(0) // 2, words.stride(0), meta32.stride(0), ss.stride(0), zz.stride(0), out.stride(0),
        KT=tiles_per_chunk, NT=groups, MT=blocks, DEPTH=depth, W4=s is not None, GROUP=group, HAS_ZEROS=z is not None,
        PARTIAL=split > 1, FIX_K=max(1, min(16, 4096 // rows)), CHAIN=chain, CHAIN_IO=chain_io, STRIPE=stripe,
        META=meta, META_IO=meta_io, num_warps=warps)
    return out
