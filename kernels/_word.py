"""Launchers of the word-wise kernels (``_word_kernels``) and their shape-keyed tuning.

Two paths, both for weights whose packed rows can be read as int32 words
(:func:`word_view`; other shapes use the generic skeleton of ``_gemm``):

- ``gemv`` (a few rows), multiply-and-add on the CUDA cores, no tensor cores, two
  kernels tuned against each other. The tile kernel: one program per (row of ``x``,
  ``BLOCK_N`` weight rows, slice of ``K``); with one slice the result is stored in
  ``x.dtype`` directly; with several, fp32 atomics go into a zeroed buffer that is
  cast at the end (two more small kernels, which is why splitting is only picked
  where it pays). For INT8, INT4, plain 2:4 and 2:4 + INT4, the x-stationary kernels
  (``_stationary_kernels``, [Note: x-stationary GEMV]): one program per (row of
  ``x``, slice of ``K``, run of weight rows), its slice of ``x`` held in registers
  while weight rows stream past; slices meet in one launch. For INT4 also with the
  weight words copied by TMA ([Note: TMA weight stream]). For 2:4 (plain, and + INT4)
  with bf16 ``x`` also on sparse tensor cores, 1 to 8 rows at once ([Note: 2:4 GEMV on
  sparse tensor cores] in ``_sparse_mma_kernels``); plain 2:4 is tuned over those alone.
- ``wdot`` (INT8 / INT4, more rows), on tensor cores, two kernels tuned against each
  other: ``tl.dot`` per field plane (``_word_kernels``), and one ``tl.dot`` of full depth
  per tile, either orientation (``_wmma_kernels``, [Note: full-depth wdot]).

[Note: kernel tuning]
``triton.autotune`` would have to allocate the output before it knows whether
the chosen config splits ``K`` (atomics into fp32) or not (a plain store in the
output dtype), so the launchers tune themselves: the first call for a key
(format, group, zero points, rows bucket, N, K, dtype) times every candidate
in a CUDA graph (``_runtime.graph_time_ms``, [Note: timing small kernels]), times
the closest few again ([Note: finalists]) and keeps the fastest; :func:`tuned` lists what
was chosen (the benchmark prints it). Choices are kept on disk per GPU model and
Triton version (``tuning_cache``), so a machine tunes a shape once, not once per
process. Candidates are pruned by shape first (a
tile's bytes per iteration, enough programs to fill the GPU), so a key costs a
few dozen short timings. Under the interpreter the first candidate runs untimed.

[Note: split-K fix-up]
Where the full-depth ``wdot`` splits ``K`` it used to add each split's tile into
a zeroed fp32 buffer with atomics and cast that buffer afterwards: three launches
(zero, kernel, cast) and a sum whose order, and so its rounding, changed from run
to run. With ``fixup`` each split stores its fp32 tile in the device workspace
that the x-stationary kernels use, counts itself done on a counter per output
tile, and the tile's last split sums the partials in split order and stores the
output in ``x``'s dtype, as the x-stationary kernels do ([Note: x-stationary
GEMV] in ``_stationary_kernels``). That is one launch and the same bits every
run, and faster: on an H100 (session 11, run 21) it took 8192x8192 at 64 rows
from 64.8 to 52.4 us and was never slower beyond noise. So where the partials
fit the workspace the tuner offers it instead of atomics. The workspace is per
device (two launches must not overlap on two streams); a call captured into a
CUDA graph before the workspace exists uses atomics.

[Note: tile depth]
A full-depth tile is 128 columns deep where the groups allow. Tiles 64 columns deep
take half the shared memory per stage, so two or three programs fit an SM where one
did; on an H100 (kernels run 44, ``benchmarks/wdot_tiles.py``) that did not help at
256 rows, where every tile of this kernel stayed at 0.41-0.67x of cuBLAS bf16: each
program runs its tiles as a chain (load, dequantize, store, ``wgmma``, wait), and
more programs per SM shortened none of the chain. At 64 rows two tiles gained on
two shapes of three (``FULL_TILES``' last two, up to +19 %). From 128 rows the
tuner also offers the pipelined Gluon kernel, which breaks the chain ([Note:
pipelined wdot] in ``_pipelined_kernels``).
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, replace

import torch

from ._runtime import cdiv, graph_time_ms, interpreting, m_bucket

FMT_W8, FMT_W4, FMT_S24, FMT_S24W4 = 0, 1, 2, 3
CPW = {FMT_W8: 4, FMT_W4: 8, FMT_S24: 4, FMT_S24W4: 16}  # original columns per int32 word
GEMV_TILES = ((8, 128, 4, 1), (16, 128, 4, 1), (32, 64, 4, 1), (32, 128, 8, 1), (8, 64, 4, 2), (16, 128, 8, 2),
              (4, 128, 2, 2), (32, 64, 8, 2))  # (BLOCK_N, BLOCK_W, warps, register prefetch depth)
# (x2d, xnat) variants tuned by default. The X2D / XNAT loads ([Note: x layouts] in _word_kernels) are
# correct (tests) but unmeasured: the one GPU run that tuned them timed out, and they triple tuning time.
X_VARIANTS = ((False, False),)
WDOT_TILES = ((16, 64, 4, 4), (16, 128, 4, 4), (32, 64, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 8, 3),
              (128, 128, 8, 3), (128, 64, 4, 3), (128, 256, 8, 3), (256, 128, 8, 3))  # (BM, BN, warps, stages)


@dataclass(frozen=True, slots=True)
class WordConfig:
    block_m: int  # 1 for gemv
    block_n: int
    block_w: int
    split_k: int
    warps: int
    stages: int = 1
    prefetch: int = 1  # gemv: tiles loaded ahead ([Note: register prefetch] in _word_kernels)
    x2d: bool = False  # gemv: x planes loaded in the weight tile's shape ([Note: x layouts] in _word_kernels)
    xnat: bool = False  # gemv: x read in natural order, no plane-major copy (same note)
    row_blocks: int = 0  # gemv: > 0 picks the x-stationary kernel, BLOCK_N-row blocks per program; block_w is
    # then its slice of K in words and split_k the number of slices
    full_depth: bool = False  # wdot: one dot per tile ([Note: full-depth wdot] in _wmma_kernels), not per plane
    order: int = 0  # full_depth: the tile's column order ([Note: full-depth wdot]), 0 or 3 natural, 1 or 2 planes
    swap: bool = False  # full_depth: acc^T = w @ x^T, weight rows on the MMA's M side ([Note: swap-AB])
    tma: bool = False  # x-stationary (INT4 tuned, INT8 runs): words through TMA, ``stages - 1`` blocks in flight
    # in shared memory ([Note: TMA weight stream] in _stationary_kernels)
    scales_ahead: bool = False  # full_depth, packed INT4: each tile's scales and zero points loaded a tile ahead
    # ([Note: packed INT4 dequantization] in _wmma_kernels)
    fixup: bool = False  # full_depth with split_k > 1: partials summed by each tile's last program, not fp32
    # atomics into a zeroed buffer ([Note: split-K fix-up])
    pipelined: bool = False  # wdot, INT4 / INT8 in bf16 / fp16 on sm_90: the Gluon kernel that overlaps
    # dequantization and MMA ([Note: pipelined wdot] in _pipelined_kernels); block_m x rows, block_n weight rows,
    # stages buffers of x tiles, prefetch buffers of word tiles
    specialized: int = 0  # pipelined INT4: > 0 picks the warp-specialized kernel with that many dequantizing warps
    # ([Note: warp-specialized wdot] in _specialized_kernels); block_w is then its number of dequantized buffers
    fragment: bool = False  # pipelined INT4: the kernel that dequantizes into the wgmma's register operand ([Note:
    # fragment wdot] in _fragment_kernels)
    tail: bool = False  # fragment: split_k slices only the tiles of the grid's last, partial wave ([Note: tail
    # split] in _fragment_kernels)
    pair: bool = False  # fragment: two tiles' wgmma a round, one retire ([Note: paired tiles] in _fragment_kernels)
    overlap: bool = False  # fragment: each wgmma in flight while the next tile is dequantized ([Note: overlapped
    # fragments] in _fragment_kernels)
    sub: int = 1  # fragment, overlapped: word tiles a ring slot; stages and prefetch then count slots ([Note: slots
    # of two tiles] in _fragment_kernels)
    sparse_mma: bool = False  # gemv, 2:4 (plain or + INT4) with bf16 x on sm_80+: the Gluon kernels on sparse tensor
    # cores ([Note: 2:4 GEMV on sparse tensor cores] in _sparse_mma_kernels); block_w / 8 32-column tiles per slice of
    # K, split_k slices, row_blocks blocks of 16 x warps weight rows per program, prefetch blocks loaded ahead (0:
    # none; 2:4 + INT4 has no prefetch)
    dense_mma: bool = False  # gemv, INT4 with bf16 x on sm_80+, groups of 128 columns or a multiple: the Gluon kernel
    # on tensor cores ([Note: INT4 GEMV on tensor cores] in _dense_mma_kernels); block_w / 16 stripes of 128 columns
    # per slice of K (of a program), the rest as sparse_mma
    k_warps: int = 1  # dense_mma: warps along K, the others along the rows ([Note: warps along K] in
    # _dense_mma_kernels)
    x_shared: bool = False  # dense_mma: x in shared memory, read again for each block of rows ([Note: x in shared
    # memory] in _dense_mma_kernels)
    stripe: int = 0  # sparse_mma, plain 2:4: > 0 picks the kernel that reads the values in stripes of that many
    # tiles (2 or 4), unmasked ([Note: 2:4 stripes] in _sparse_mma_kernels); prefetch 0 or 1
    fold: bool = False  # sparse_mma (plain 2:4, 2:4 + INT4) or dense_mma, 1-4 rows of x: the kernels with folded
    # rows ([Note: 2:4 folded rows] in _sparse_mma_kernels, [Note: INT4 GEMV with folded rows] in _dense_mma_kernels);
    # block_n = 8 x warps weight rows a block
    late_sums: int = 0  # fold (INT4, 2:4 + INT4), k_warps > 1: the warps' sums of every block added across them
    # once, after the last block, kept until then in shared memory (1) or in registers (2) ([Note: fold warps along K]
    # in _dense_mma_kernels); 0: a block at a time
    wgmma_chunk: int = 0  # wdot, INT4 with bf16 x and scales, 9-16 rows on sm_90: > 0 picks the GEMV on wgmma
    # ([Note: INT4 GEMV on wgmma] in _stripe_wgmma_kernels) with chunks of that many stripes of 128 columns; block_w /
    # 16 stripes a slice of K, split_k slices, row_blocks blocks of 16 x warps weight rows a program


@functools.cache
def _kernels():
    from . import _word_kernels

    return _word_kernels


@functools.cache
def _wmma_kernels():
    from . import _wmma_kernels

    return _wmma_kernels


@functools.cache
def _stationary_kernels():
    from . import _stationary_kernels

    return _stationary_kernels


@functools.cache
def tma_available() -> bool:
    """Whether this Triton builds kernels from host tensor descriptors (``triton.tools.tensor_descriptor``)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def _tma_words(words: torch.Tensor, wg: int) -> bool:
    """TMA's rules for the word view ``(N, KW / WG, WG)``: 16-byte aligned base and row stride, whole groups."""
    kw = words.shape[1]
    return (tma_available() and words.is_contiguous() and kw % wg == 0 and (kw * 4) % 16 == 0
            and (wg * 4) % 16 == 0 and words.data_ptr() % 16 == 0)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def word_view(fmt: int, w: torch.Tensor, meta: torch.Tensor | None, k: int):
    """``(words, meta)`` as the word kernels read them, or ``None`` where this shape cannot be."""
    cpw = CPW[fmt]
    if k % cpw or w.stride(-1) != 1 or (w.shape[1] * w.element_size()) % 4:
        return None
    if fmt == FMT_S24 and w.dtype != torch.bfloat16:
        return None
    if fmt == FMT_S24W4:
        if meta is None or meta.stride(-1) != 1 or meta.shape[1] % 2:
            return None
        meta = meta.view(torch.int16)
    if not w.is_contiguous() or (w.storage_offset() * w.element_size()) % 4:
        return None
    return w.view(torch.int32), meta


def meta_words(meta: torch.Tensor) -> torch.Tensor | None:
    """Plain 2:4 metadata ``(N, K/8)`` uint8 as int32 words (8 blocks each, block ``j`` at bits ``4j``, the byte
    order being little-endian), or ``None`` where the rows cannot be viewed so (``K`` not a multiple of 32, rows
    not contiguous or not 4-byte aligned)."""
    if meta.dim() != 2 or meta.dtype != torch.uint8 or meta.shape[1] % 4 or not meta.is_contiguous() \
            or meta.storage_offset() % 4:
        return None
    return meta.view(torch.int32)


def plane_major(x: torch.Tensor, cpw: int) -> torch.Tensor:
    """``(M, K)`` → ``(M, cpw, K / cpw)`` with ``xp[m, j, w] = x[m, cpw * w + j]`` (see ``_word_kernels``)."""
    m, k = x.shape
    return x.view(m, k // cpw, cpw).transpose(1, 2).contiguous()


def _acc_width(fmt: int, block_w: int, group: int) -> int:
    if fmt in (FMT_W4, FMT_S24W4) and block_w * CPW[fmt] > group:
        return block_w * CPW[fmt] // group
    return block_w


def _group_ok(fmt: int, block_w: int, group: int, kw: int) -> bool:
    """A tile lies in one group, or spans whole groups (the kernels sum per group inside the tile)."""
    if fmt not in (FMT_W4, FMT_S24W4):
        return True
    cols = block_w * CPW[fmt]
    return group % cols == 0 if cols <= group else cols % group == 0


def words_fit_groups(fmt: int, group: int) -> bool:
    """Whether the word kernels can read this group size: an INT4 word (2:4 + INT4: its 16 original columns)
    must not straddle two groups, i.e. the group is a whole number of words. Others have no groups."""
    return fmt not in (FMT_W4, FMT_S24W4) or (group > 0 and group % CPW[fmt] == 0)


def wdot_fits(fmt: int, group: int) -> bool:
    """Whether ``wdot`` has a tile for this format and group size (what :func:`wdot_candidates` offers)."""
    if fmt == FMT_W8:
        return True
    return fmt == FMT_W4 and words_fit_groups(fmt, group) and (
        _full_block_w(fmt, group) is not None or _group_ok(fmt, 16, group, 0))


def _check_groups(path: str, fmt: int, group: int) -> None:
    if not words_fit_groups(fmt, group):
        raise ValueError(f"the {path} path reads whole int32 words of {CPW[fmt]} columns, and groups of {group} "
                         f"columns split a word; quantize with a group size that is a multiple of {CPW[fmt]}, or "
                         "use path='splitk', 'tiled' or 'dense'")


def _small_block_w(fmt: int, group: int, kw: int) -> int:
    """The widest of 4, 2, 1 words whose tiles fit the groups (1 always does for groups of >= 16 columns)."""
    return next((bw for bw in (4, 2) if _group_ok(fmt, bw, group, kw)), 1)


def gemv_candidates(fmt: int, m: int, n: int, kw: int, group: int, device: torch.device) -> list[WordConfig]:
    if interpreting() or device.type != "cuda":
        bw = _small_block_w(fmt, group, kw)
        return [WordConfig(1, 16, bw, 2 if kw > bw else 1, 1)]
    sms = _sm_count(device.index or 0)
    out = []
    for bn, bw, warps, prefetch in GEMV_TILES:
        if not _group_ok(fmt, bw, group, kw) or bw > kw:
            continue
        tiles = cdiv(kw, bw)
        progs = m * cdiv(n, bn)
        splits = {1} if progs >= sms else set()
        s = 1
        while progs * s < 2 * sms and s < tiles:
            s *= 2
        splits |= {s, min(2 * s, tiles)}
        out += [WordConfig(1, bn, bw, sp, warps, prefetch=prefetch, x2d=x2d, xnat=xnat) for sp in sorted(splits)
                for x2d, xnat in X_VARIANTS if tiles // sp >= 1]
    return out or [WordConfig(1, 16, _small_block_w(fmt, group, kw), 1, 4)]


STATIONARY_TILES = ((4, 32, 4), (8, 16, 4), (2, 64, 4), (4, 64, 8), (8, 32, 8), (4, 16, 4), (2, 32, 4),
                    (8, 8, 4))  # (groups (INT4) or 16-word units (INT8) per slice, BLOCK_N, warps): the first five
# give a thread 128 INT4 codes per block (~3.2 instructions per code in the SASS, against ~3.9 at 64 codes), the
# last three 64; none leaves a thread repeating another's work
TMA_TILES = ((4, 64, 4), (4, 32, 4), (2, 64, 4), (8, 32, 4))  # (groups per slice, BLOCK_N, warps) of the INT4
# TMA kernel: an H100 chose the first at 8192x8192, 8192x28672 and 28672x8192 (session 10); INT8 gets none (its
# register kernel was faster at every shape timed)
# (words per slice, BLOCK_N, warps): INT8's deep slices, a whole K of up to 8192 columns (2048 words) or slices of
# 1024 words (kernels runs 133-134, H100, one row: 8192x8192 34.8 -> 32.5 us, 8192x28672 92.4 -> 88.5, 28672x8192
# 93.8 -> 90.3 against the 16-word units above). One or two weight rows a block keep a thread at 8 or 16 words; a
# program then loads its x once, and at most a few slices meet in the fix-up
W8_DEEP_TILES = ((2048, 2, 8), (2048, 4, 16), (2048, 1, 8), (1024, 2, 4))
W8_DEEP_RUNS = (8, 16, 32)  # row blocks per program, each run kept where it still gives a wave of programs
TMA_RUNS = (4, 8, 16)  # row blocks per program
TMA_STAGES = (3, 4)  # num_stages: 2 or 3 blocks in flight per program ([Note: TMA weight stream])
STATIONARY_WORKSPACE = 1 << 23  # fp32 partial sums (32 MiB) per device; slices x rows x N must fit
WORKSPACE_COUNTERS = 1 << 16  # one per run of rows (x-stationary) or output tile (wdot's fix-up)


def _stationary_split(bw: int, kw: int, m: int, n: int) -> int | None:
    """Slices of ``K`` for an x-stationary slice of ``bw`` words: ``None`` where the slice is twice ``K`` or more, or
    its partials would not fit the workspace."""
    split = cdiv(kw, bw)
    if bw >= 2 * kw or (split > 1 and m * split * n > STATIONARY_WORKSPACE):
        return None
    return split


def stationary_candidates(fmt: int, m: int, n: int, kw: int, group: int, device: torch.device) -> list[WordConfig]:
    """x-stationary configs ([Note: x-stationary GEMV]): INT8, plain 2:4 (``K`` a multiple of 32), or INT4 and
    2:4 + INT4 with groups of a power-of-two number of words."""
    if fmt not in (FMT_W8, FMT_W4, FMT_S24W4, FMT_S24) or m > 8:
        return []
    if fmt == FMT_S24 and kw % 8:
        return []  # the metadata is read as int32 words of 8 blocks (32 columns)
    if fmt in (FMT_W4, FMT_S24W4):
        wg = group // CPW[fmt]
        if group % CPW[fmt] or wg < 1 or wg & (wg - 1) or kw % wg:
            return []
    else:
        wg = 16
    if interpreting() or device.type != "cuda":
        units = 2 if kw > 2 * wg else 1
        return [WordConfig(1, 4, units * wg, cdiv(kw, units * wg), 1, row_blocks=2)]
    sms = _sm_count(device.index or 0)
    out = []
    for units, bn, warps in STATIONARY_TILES:
        bw = units * wg
        split = _stationary_split(bw, kw, m, n)
        if split is None or (fmt == FMT_S24W4 and bn * bw > 128 * warps):
            continue  # 2:4 + INT4 keeps 16 columns of x per word: at most 4 words per thread fit the registers
        rb = 1  # the most row blocks per program that still leave ~4 programs per SM, and twice that (how many
        while rb < 32 and m * split * cdiv(n, bn * rb * 2) >= 4 * sms:  # fit at once depends on registers:
            rb *= 2  # the tuner sees which wave shape is faster)
        out += [WordConfig(1, bn, bw, split, warps, row_blocks=r) for r in sorted({rb, min(32, 2 * rb)})]
        if rb > 2 and fmt in (FMT_W8, FMT_W4):  # blocks two ahead ([Note: register prefetch] in _word_kernels)
            out.append(WordConfig(1, bn, bw, split, warps, prefetch=2, row_blocks=rb))
    if fmt == FMT_W8:
        for bw, bn, warps in W8_DEEP_TILES:
            split = _stationary_split(bw, kw, m, n)
            if split is None:
                continue
            out += [WordConfig(1, bn, bw, split, warps, row_blocks=rb) for rb in W8_DEEP_RUNS
                    if m * split * cdiv(n, bn * rb) >= sms]
    if fmt == FMT_W4 and tma_available() and kw % wg == 0 and (kw * 4) % 16 == 0 and (wg * 4) % 16 == 0:
        for units, bn, warps in TMA_TILES:
            bw = units * wg
            split = _stationary_split(bw, kw, m, n)
            if split is None:
                continue
            out += [WordConfig(1, bn, bw, split, warps, stages=st, row_blocks=rb, tma=True)
                    for rb in TMA_RUNS if m * split * cdiv(n, bn * rb) >= sms for st in TMA_STAGES]
    return out


# (BM, BN, warps, stages, swap) of the full-depth wdot; order 3 (interleaved natural order) throughout: on an H100
# it beat the reshaped and the plane orders at every M timed (8192x8192, M = 16, 64, 256), the per-plane kernel too.
# The 16 x 32 tile (more programs per SM) was chosen for 8192x28672 at 4 and 16 rows with packed INT4 (kernels run 39)
# (BM, BN, warps, stages, swap, columns per tile): the tiles the full-depth wdot tunes over ([Note: tile depth])
FULL_TILES = ((16, 64, 4, 4, False, 128), (16, 128, 4, 3, False, 128), (16, 64, 4, 4, True, 128),
              (16, 128, 4, 4, True, 128), (16, 32, 4, 4, False, 128),
              (32, 64, 4, 4, False, 128), (32, 128, 4, 3, False, 128), (32, 64, 4, 4, True, 128),
              (32, 128, 4, 4, True, 128),
              (64, 64, 4, 4, True, 128), (64, 128, 8, 3, True, 128), (64, 128, 4, 3, False, 128),
              (64, 256, 8, 3, False, 128),
              (128, 64, 4, 3, False, 128), (128, 128, 8, 3, False, 128), (128, 256, 8, 3, False, 128),
              (256, 128, 8, 3, False, 128), (256, 64, 8, 3, False, 128),
              (64, 64, 4, 3, False, 128), (64, 128, 8, 3, True, 64))  # the last two: kernels run 44
# (BM, BN, x buffers) of the pipelined Gluon kernel ([Note: pipelined wdot] in _pipelined_kernels), from 128 rows,
# 4 warps per 64 weight rows; each with split-K where the tiles do not fill the GPU. 256 weight rows (16 warps)
# never won (0.31-0.55x at 256 rows, kernels runs 49 and 54); 192 (12 warps) is not a power of two, which Gluon's
# tensors must be (run 58)
PIPELINED_TILES = ((128, 64, 4), (128, 128, 4), (256, 64, 4), (256, 128, 4))
PIPELINED_MIN_M = 128
# (BM, BN, x buffers, dequantized buffers, dequantizing warps) of the warp-specialized INT4 kernel ([Note:
# warp-specialized wdot] in _specialized_kernels), from 256 rows. Kernels run 80 timed eight tiles: these two won
# every cell at 256 and 512 rows; 128-row blocks of x ran 0.44-0.68x, a third dequantized buffer 1-5 % slower
SPECIALIZED_TILES = ((256, 128, 4, 2, 4), (256, 64, 4, 2, 4))
SPECIALIZED_MIN_M = 256
# (BM, x buffers) of the INT4 kernel that dequantizes into the wgmma's register operand ([Note: fragment wdot] in
# _fragment_kernels), 128 weight rows a program, from 128 rows. Kernels run 86: it beat every other kernel in all nine
# cells at 128-512 rows; six x buffers won one cell of nine (by 1 %), five none
FRAGMENT_TILES = ((128, 4), (256, 4))
FRAGMENT_MIN_M = 128
# below 128 rows one block of x as small as the rows allow (8 to 64: the wgmma's N), eight x and eight word buffers
# ([Note: fragment wdot at small M] in _fragment_kernels). Kernels run 111: +5 to +18 % over the Triton wdot at 32
# and 64 rows, -17 to +3 % at 4 and 16, so the tuner times it beside the others from 2 rows
FRAGMENT_SMALL_STAGES = (8, 8)
# for blocks of 8 and 16 rows also three x and three word slots of two tiles each ([Note: slots of two tiles]; run
# 115: +5 and +14 % at 16 rows on 8192x28672 and 28672x8192, -10 % on 8192x8192)
FRAGMENT_SMALL_SLOTS = (3, 3)
# each of those with two and with four MMA warp groups ([Note: four warp groups at small M]; run 118: +16 and +21 %
# at 16 and 64 rows on 8192x28672, within 2 % either way on 8192x8192)
FRAGMENT_SMALL_WARP_GROUPS = (2, 4)
FRAGMENT_SMALL_MIN_M = 2
# from here each of its configs also with two tiles a wgmma round ([Note: paired tiles]); kernels run 96: +2 to +5 %
# in most cells from 512 to 2048 rows, -3 to -12 % in some, so the tuner chooses. Unpaired configs overlap each
# wgmma with the next tile's dequantization ([Note: overlapped fragments]; run 104: +4 to +12 % with 256-row blocks)
FRAGMENT_PAIR_MIN_M = 256


def _full_block_w(fmt: int, group: int, cols: int = 128) -> int | None:
    """Words per full-depth tile: ``cols`` columns (128 or 64) where the groups allow, else the widest narrower
    tile that does, at least the 16 columns of one MMA step."""
    if fmt == FMT_W4 and group % CPW[fmt]:
        return None  # a word would straddle two groups
    return next((bw for bw in (128 // CPW[fmt], 64 // CPW[fmt], 32 // CPW[fmt], 16 // CPW[fmt])
                 if bw * CPW[fmt] <= cols and _group_ok(fmt, bw, group, 0)), None)


def _splits(progs: int, tiles: int, sms: int, waves: tuple[int, ...] = (1,)) -> list[int]:
    """No split, and for each of ``waves`` the smallest power of two that gives that many programs per SM
    (at least 4 tiles each)."""
    out = {1}
    for wave in waves:
        s = 1
        while progs * s < wave * sms and s < tiles // 4:
            s *= 2
        out.add(s)
    return sorted(out)


def full_depth_candidates(fmt: int, m: int, n: int, kw: int, group: int, device: torch.device,
                          packed: int = 0, half_x: bool = False) -> list[WordConfig]:
    """Full-depth wdot configs ([Note: full-depth wdot]): one row block for up to 64 rows, else blocks of 128 or
    256 rows; split-K to fill the GPU once or four times over. With ``packed`` (``packed_dequant``), from 64 rows
    each config also with its scales loaded a tile ahead (``scales_ahead``)."""
    bw = _full_block_w(fmt, group)
    if bw is None:
        return []
    if interpreting() or device.type != "cuda":
        return [WordConfig(16, 32, bw, 1, 1, full_depth=True, order=3)]
    sms = _sm_count(device.index or 0)
    mb = m_bucket(m)
    out = []
    for bm, bn, warps, stages, swap, cols in FULL_TILES:
        if bm > max(16, mb) or bm < (max(16, mb) if mb <= 64 else 128):
            continue
        bw = _full_block_w(fmt, group, cols)
        for sp in _splits(cdiv(m, bm) * cdiv(n, bn), cdiv(kw, bw), sms, (1, 4)):
            fixup = sp > 1 and _fixup_fits(m, n, sp, bm, bn)  # [Note: split-K fix-up]: never slower than atomics
            out.append(WordConfig(bm, bn, bw, sp, warps, stages, full_depth=True, order=3, swap=swap, fixup=fixup))
    if packed and mb >= 64:
        out += [replace(c, scales_ahead=True) for c in out]
    # the pipelined kernel: INT4 with scales in x's bf16 or fp16, INT8 with bf16 or fp16 x
    if ((packed in (1, 2) and fmt == FMT_W4) or (half_x and fmt == FMT_W8)) and mb >= PIPELINED_MIN_M:
        from ._pipelined import TILE_K, pipelined_possible

        if pipelined_possible(device, group=group if fmt == FMT_W4 else TILE_K, k=kw * CPW[fmt]):
            qs = 8 if fmt == FMT_W4 else 4  # word buffers (INT8 words take twice the shared memory)
            for bm, bn, xs in PIPELINED_TILES:
                if bm > mb:
                    continue
                progs = cdiv(m, bm) * cdiv(n, bn)
                for sp in sorted(set(_splits(progs, kw // 8, sms)) | {_under_wave(progs, sms)}):
                    if sp == 1 or _fixup_fits(m, n, sp, bm, bn):
                        out.append(WordConfig(bm, bn, 64 // CPW[fmt], sp, bn // 16, xs, qs, full_depth=True, order=3,
                                              pipelined=True, fixup=sp > 1))
    if ((packed in (1, 2) and fmt == FMT_W4) or (half_x and fmt == FMT_W8)) and m >= FRAGMENT_SMALL_MIN_M:
        from ._pipelined import TILE_K, specialized_possible

        if specialized_possible(device, group=group if fmt == FMT_W4 else TILE_K, k=kw * CPW[fmt]):
            # the register-operand kernel, INT8 too ([Note: INT8 fragments]); its tiles count K in INT4 words
            out += fragment_candidates(m, n, kw * CPW[fmt] // 8, sms)
            if mb >= SPECIALIZED_MIN_M and fmt == FMT_W4:
                out += specialized_candidates(m, n, kw, sms)
    return out


def _under_wave(progs: int, sms: int) -> int:
    """The largest power-of-two split of ``K`` that keeps ``progs`` programs within one wave (1 if none does)."""
    return 1 << max(0, (sms // progs).bit_length() - 1) if progs < sms else 1


def fragment_candidates(m: int, n: int, kw: int, sms: int) -> list[WordConfig]:
    """The register-operand INT4 kernel's configs ([Note: fragment wdot] in ``_fragment_kernels``): each tile whole;
    split just under one wave where the tiles leave SMs idle (a counter for each warp group's rows); and where more
    tiles than SMs leave a short last wave, that wave's tiles split to fill it ([Note: tail split]; 8192x28672 at 512
    rows: 448 tiles, 52 in the last wave, each in two slices)."""
    out = []
    # (rows of x, weight rows a program (64 an MMA warp group), x buffers, word buffers, tiles a slot)
    blocks = tuple((bm, 128, xs, 8, 1) for bm, xs in FRAGMENT_TILES)
    if m_bucket(m) < FRAGMENT_MIN_M:  # one block of x, the wgmma's N as small as the rows allow
        bm = max(8, m_bucket(m))
        blocks = ()
        for wg in FRAGMENT_SMALL_WARP_GROUPS:  # four: bit for bit two's on the GPU, odd N included (run 119)
            blocks += ((bm, 64 * wg, *FRAGMENT_SMALL_STAGES, 1), )
            if bm <= 16 and kw % 16 == 0:  # K a multiple of two 64-column tiles
                blocks += ((bm, 64 * wg, *FRAGMENT_SMALL_SLOTS, 2), )
    for bm, bn, xs, qs, sub in blocks:
        if bm > max(FRAGMENT_MIN_M, m_bucket(m)):
            continue
        tiles = cdiv(m, bm) * cdiv(n, bn)
        for sp in sorted({1, _under_wave(tiles, sms)}):
            if sp == 1 or _fragment_fits(m, n, bm, sp, 0, bn):
                out.append(WordConfig(bm, bn, 8, sp, bn // 16, xs, qs, full_depth=True, order=3, pipelined=True,
                                      fixup=sp > 1, fragment=True, overlap=True, sub=sub))
        if sub > 1 or bn != 128:
            continue  # (the tail split is offered with one-tile slots and two warp groups: not measured otherwise)
        sp = _tail_split(tiles, kw // 8, sms)
        c = WordConfig(bm, 128, 8, sp, 8, xs, qs, full_depth=True, order=3, pipelined=True, fixup=True, fragment=True,
                       tail=True, overlap=True)
        if sp > 1 and _fragment_fits(m, n, bm, sp, fragment_whole(c, m, n, sms)):
            out.append(c)
    if m_bucket(m) >= FRAGMENT_PAIR_MIN_M:
        out += [replace(c, pair=True, overlap=False) for c in out]
    return out


def fragment_whole(c: WordConfig, m: int, n: int, sms: int) -> int:
    """The tiles a register-operand config runs whole at ``m`` rows: those of the grid's whole waves where ``c.tail``
    (all where they make whole waves), none otherwise (``split_k`` then slices every tile)."""
    if not c.tail:
        return 0
    tiles = cdiv(m, c.block_m) * cdiv(n, c.block_n)
    return tiles - tiles % sms


def _tail_split(tiles: int, k_tiles: int, sms: int) -> int:
    """Slices of ``K`` for the tiles of a grid's last, partial wave: as many as fill the wave's SMs (at most 8, each
    at least 8 of ``K``'s 64-column tiles); 1 where the grid is one wave or less, whole waves, or a last wave more
    than half full."""
    if tiles <= sms or tiles % sms == 0:
        return 1
    return max(1, min(sms // (tiles % sms), 8, k_tiles // 8))


def _fragment_fits(m: int, n: int, bm: int, split: int, whole: int, bn: int = 128) -> bool:
    """Whether the register-operand kernel's split tiles (those after the first ``whole``) fit the workspace: a
    compact block of ``split x bn x bm`` partials and a counter for each of a tile's ``bn / 64`` warp groups."""
    tiles = cdiv(m, bm) * cdiv(n, bn)
    return _workspace_fits((tiles - whole) * split * bn * bm, bn // 64 * tiles)


def specialized_candidates(m: int, n: int, kw: int, sms: int) -> list[WordConfig]:
    """The warp-specialized INT4 kernel's configs ([Note: warp-specialized wdot] in ``_specialized_kernels``): each
    tile whole, and split just under one wave where the tiles leave SMs idle."""
    out = []
    for bm, bn, xs, wst, dq in SPECIALIZED_TILES:
        for sp in sorted({1, _under_wave(cdiv(m, bm) * cdiv(n, bn), sms)}):
            if sp == 1 or _fixup_fits(m, n, sp, bm, bn):
                out.append(WordConfig(bm, bn, wst, sp, bn // 16, xs, 8, full_depth=True, order=3, pipelined=True,
                                      fixup=sp > 1, specialized=dq))
    return out


def _fixup_fits(m: int, n: int, split: int, bm: int, bn: int) -> bool:
    """Whether a split-K fix-up's partials and tile counters fit the device workspace ([Note: split-K fix-up])."""
    return _workspace_fits(m * split * n, cdiv(m, bm) * cdiv(n, bn))


def _workspace_fits(partials: int, counters: int) -> bool:
    """Whether ``partials`` fp32 sums and ``counters`` counters fit the device workspace. Checked at every launch,
    not only when a key is tuned: a key covers a bucket of row counts (``m_bucket``), and a config tuned at 3 rows
    must not write past the workspace at 4."""
    return partials <= STATIONARY_WORKSPACE and counters <= WORKSPACE_COUNTERS


def _slices_workspace(x: torch.Tensor, c: WordConfig, n: int, counters: int) -> tuple[bool, tuple | None]:
    """The fix-up workspace of config ``c``'s slices of ``K`` for ``x``'s rows and ``counters`` counters ([Note:
    split-K fix-up]): ``(True, None)`` with one slice, ``(True, (partials, counters))`` where the device's fits, and
    ``(False, None)`` where it cannot be made now (a capture before the first eager call) or is too small: the GEMV
    kernels' callers then run another kernel."""
    if c.split_k == 1:
        return True, None
    ws = _stationary_workspace(x.device)
    if ws is None or not _workspace_fits(x.shape[0] * c.split_k * n, counters):
        return False, None
    return True, ws


def wdot_candidates(fmt: int, m: int, n: int, kw: int, group: int, device: torch.device,
                    packed: int = 0, half_x: bool = False) -> list[WordConfig]:
    """The full-depth kernel's configs first (the interpreter runs the first), then the per-plane kernel's;
    ``half_x``: ``x`` is bf16 or fp16 (INT8 can then take the pipelined kernel)."""
    full = full_depth_candidates(fmt, m, n, kw, group, device, packed, half_x)
    bw = 16 if fmt == FMT_W4 else 32  # INT4: 16 words = 128 columns (one g128 group); INT8: 32 words = 128 columns
    if not _group_ok(fmt, bw, group, kw):
        return full  # the per-plane kernel's 128-column tiles would straddle groups (e.g. g192)
    if interpreting() or device.type != "cuda":
        return full + [WordConfig(16, 32, bw, 1, 1)]
    sms = _sm_count(device.index or 0)
    out = []
    mb = m_bucket(m)
    for bm, bn, warps, stages in WDOT_TILES:
        if bm > max(16, mb) or (bm < mb // 4 and bm < 64):
            continue
        progs = cdiv(m, bm) * cdiv(n, bn)
        out += [WordConfig(bm, bn, bw, sp, warps, stages) for sp in _splits(progs, cdiv(kw, bw), sms)]
    return full + (out or [WordConfig(16, 64, bw, 1, 4, 3)])


_BEST: dict[tuple, WordConfig] = {}


def tuned() -> dict[tuple, WordConfig]:
    """Every key tuned so far and the config it chose (see [Note: kernel tuning])."""
    return dict(_BEST)


def _pick(key: tuple, candidates: list[WordConfig], launch) -> WordConfig:
    best = _BEST.get(key)
    if best is not None:
        return best
    if len(candidates) == 1 or interpreting():
        best = candidates[0]
    elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return candidates[0]  # cannot time inside a capture: run the first candidate, tune at the next eager call
    else:
        stored = cache_key(key, candidates)
        best = _tuning_cache().get(stored)
        if best not in candidates:  # not cached (for this candidate list)
            best = _fastest(candidates, launch)
            _tuning_cache().put(stored, best)
    _BEST[key] = best
    return best


def cache_key(key: tuple, candidates: list[WordConfig]) -> tuple:
    """The tuning cache's key of a choice among ``candidates``: ``key`` and a digest of the list, so that a choice
    made among other candidates (an older version's, before a kernel joined them) is tuned again, not kept."""
    return key + (hashlib.sha1(repr(candidates).encode()).hexdigest()[:12],)


def _rejected(e: Exception) -> bool:
    """Whether ``e`` is the compiler refusing a config (out of resources, e.g. shared memory): the tuner skips it."""
    return "out of resource" in str(e).lower() or "OutOfResources" in type(e).__name__


FINALISTS = 5  # [Note: finalists]: at most this many candidates are timed again
FINALIST_MARGIN = 0.15  # those within this fraction of the first pass's fastest
FINALISTS_LEAST = 3  # and the first pass's fastest this many, whatever their margin
FINALIST_ROUNDS = 3  # in this many interleaved rounds, each finalist's time the median of its rounds


def time_candidates(candidates: list[WordConfig], launch, *, finalists: int | None = None) -> list[tuple[float, int]]:
    """``(ms, index)`` of every candidate the compiler accepts, as the tuner ranks them: the finalists first, fastest
    first by their times again ([Note: finalists]), then the rest by their first pass. ``finalists`` (default
    ``FINALISTS``, read at the call) bounds how many are timed again; 0 or 1 keeps the first pass alone."""
    timed = []
    for i, c in enumerate(candidates):
        try:
            timed.append((graph_time_ms(lambda c=c: launch(c), reps=10, trials=3), i))
        except Exception as e:  # noqa: BLE001
            if not _rejected(e):
                raise
    timed.sort()
    finalists = FINALISTS if finalists is None else finalists
    return _time_finalists(timed, candidates, launch, finalists) if finalists > 1 and timed else timed


def _time_finalists(timed: list[tuple[float, int]], candidates: list[WordConfig], launch,
                    finalists: int) -> list[tuple[float, int]]:
    """[Note: finalists] The first pass times each candidate once: 10 calls a graph, less a graph of the L2 flushes
    alone (``graph_time_ms``). At 5-10 us a call the flushes (128 MiB written before every call, ~45 us) are most of
    each graph's time, so the difference carries their variation, and configs within a few per cent of each other can
    swap places from one process to the next. (On an H100, kernels run 209, the decode benchmark's tuner picked for
    4096x4096 a config without folded rows, a layout that took 8.3 us in run 199, where gemv_check in the same call
    picked a folded one at 7.1 us.) So the first pass only nominates: the candidates within ``FINALIST_MARGIN`` of its
    fastest, at most ``finalists`` of them, are timed again with 20 calls a graph and 5 trials, in
    ``FINALIST_ROUNDS`` rounds that alternate their order (a drift of the clocks falls on all of them), and each keeps
    the median of its rounds. The first pass's ``FINALISTS_LEAST`` fastest are timed again whatever their margin: a
    lucky draw can leave one config alone within it (kernels run 218, H100, 4096x6144: split-K 8 at 4.35 us in the
    first pass, under the ~8 us that streaming its 12.6 MB of weights takes, next best 9.04 us; it was picked unchecked
    and took 9.8 us timed again). Measured
    (``benchmarks/tuner_check.py``, kernels runs 212-217, H100 and H200, 22 keys tuned 2-3 times each way in one
    process): both ways pick consistently in isolation, the first pass's worst pick 5.0 % over its best (4096x6144,
    H100), the finalists' worst 3.9 % (the same key, H200), most keys the same config every time; run 209's slip was
    not seen again either way. The round costs 0.1-0.6 s a key."""
    best = timed[0][0]
    chosen = [(t, i) for n, (t, i) in enumerate(timed[:finalists])
              if n < FINALISTS_LEAST or t <= best * (1.0 + FINALIST_MARGIN)]
    if len(chosen) < 2:
        return timed
    rounds: dict[int, list[float]] = {i: [] for _, i in chosen}
    for r in range(FINALIST_ROUNDS):
        for _, i in (chosen if r % 2 == 0 else chosen[::-1]):
            rounds[i].append(graph_time_ms(lambda c=candidates[i]: launch(c), reps=20, trials=5))
    again = sorted((sorted(ts)[len(ts) // 2], i) for i, ts in rounds.items())
    return again + [(t, i) for t, i in timed if i not in rounds]


def compile_candidates(candidates: list[WordConfig], launch) -> int:
    """Launch each of ``candidates`` once, which compiles it into Triton's disk cache, so that a tuner in another
    process finds it compiled (the benchmarks' ``--jobs``); configs the compiler rejects are skipped, as the tuner
    skips them. Returns how many ran."""
    ran = 0
    for c in candidates:
        try:
            launch(c)
            ran += 1
        except Exception as e:  # noqa: BLE001
            if not _rejected(e):
                raise
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return ran


def _fastest(candidates: list[WordConfig], launch) -> WordConfig:
    timed = time_candidates(candidates, launch)
    if not timed:
        raise RuntimeError(f"no kernel config of {len(candidates)} fits this GPU's resources; use path='dense'")
    return candidates[timed[0][1]]


@functools.cache
def _tuning_cache():
    from .tuning_cache import TuningCache

    return TuningCache.default()


def _out(m: int, n: int, x: torch.Tensor, split: int) -> torch.Tensor:
    if split == 1:
        return torch.empty(m, n, device=x.device, dtype=x.dtype)
    return torch.zeros(m, n, device=x.device, dtype=torch.float32)


_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _stationary_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(partials, counters)`` of the x-stationary kernel on ``device``, made on first use outside a CUDA graph
    capture (counters start at zero and every launch leaves them at zero); ``None`` while capturing before that.
    One per device, not per stream (a graph captured on a side stream must find the one its warm-up made): two
    launches must not run at once on two streams of one device (the serving runner and decoding use one)."""
    ws = _WORKSPACE.get(device)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ws = _WORKSPACE[device] = (torch.empty(STATIONARY_WORKSPACE, device=device, dtype=torch.float32),
                                   torch.zeros(WORKSPACE_COUNTERS, device=device, dtype=torch.int32))
    return ws


SPARSE_MMA_TILES = ((16, 4, 0), (8, 4, 0), (8, 4, 1), (16, 8, 0), (8, 8, 0))  # (32-column tiles per slice, warps,
# blocks loaded ahead) of the 2:4 mma.sp GEMV; on an H100 (kernels runs 71 and 73) 16 tiles, 4 warps and nothing
# loaded ahead won at every shape and 1-8 rows: blocks loaded ahead cost registers that deeper slices use better.
# With x in shared memory ([Note: x in shared memory] in _dense_mma_kernels) it lost 3-6 % in every cell (run 168)
SPARSE_MMA_RUNS = (1, 2, 4, 8, 16)  # row blocks per program
# the 2:4 + INT4 GEMV's (tiles per slice, warps, blocks loaded ahead: 0 or 1): its stripes load a block's weights in
# few registers, so one block ahead fits beside deep slices ([Note: INT4 stripes] in _sparse_mma_kernels)
SPARSE_MMA_W4_TILES = ((16, 4, 0), (8, 4, 0), (16, 8, 0), (8, 8, 0), (16, 4, 1), (8, 4, 1), (8, 8, 1), (4, 8, 1))


def sparse_mma_candidates(m: int, n: int, k: int, device: torch.device, tiles_table: tuple = SPARSE_MMA_TILES, *,
                          warp_rows: int = 16, min_tiles: int = 2, fold: bool = False) -> list[WordConfig]:
    """Configs of the 2:4 GEMV on sparse tensor cores (the caller checks ``_sparse_mma.sparse_mma_fits``): each
    slice depth, warp count and prefetch depth of ``tiles_table`` with every run of row blocks (of ``warp_rows x
    warps`` rows) that still gives a wave of programs; slices whose partials do not fit the workspace are left out."""
    tiles = k // 32
    sms = _sm_count(device.index or 0)
    out = []
    for kt, warps, depth in tiles_table:
        kt = min(kt, max(min_tiles, 1 << (tiles - 1).bit_length()))  # a short K: one slice of all its tiles (a
        # power of two of them: the kernels' layouts hold a power of two of pairs, or of stripes; the rest are masked)
        split = cdiv(tiles, kt)
        if split > 1 and m * split * n > STATIONARY_WORKSPACE:
            continue
        rows = warp_rows * warps
        runs = [rb for rb in SPARSE_MMA_RUNS if split * cdiv(n, rows * rb) >= sms
                and cdiv(n, rows * rb) <= WORKSPACE_COUNTERS] or [1]
        out += [c for c in (WordConfig(1, rows, 8 * kt, split, warps, prefetch=depth, row_blocks=rb, sparse_mma=True,
                                       fold=fold) for rb in runs) if c not in out]
    return out


# plain 2:4 in stripes (tiles per slice, warps, blocks loaded ahead: 0 or 1, tiles a stripe): a block's values and
# positions in half the loads and registers of the tile-wise kernel ([Note: 2:4 stripes] in _sparse_mma_kernels)
# (sm_90 SASS: 146-169 registers, none spilled; 16 tiles with one block ahead, or 32 tiles, spill)
SPARSE_MMA_STRIPE_TILES = ((16, 4, 0, 4), (8, 4, 1, 4), (16, 8, 0, 4), (8, 8, 1, 4), (8, 4, 0, 4), (4, 4, 1, 4),
                           (16, 4, 0, 2), (8, 4, 1, 2), (4, 4, 1, 2))


def sparse_mma_stripe_candidates(m: int, n: int, k: int, device: torch.device) -> list[WordConfig]:
    """Configs of plain 2:4 in stripes (the caller checks ``_sparse_mma.sparse_mma_stripe_fits`` for each stripe):
    as :func:`sparse_mma_candidates` over ``SPARSE_MMA_STRIPE_TILES``, whole stripes a slice."""
    out = []
    for kt, warps, depth, stripe in SPARSE_MMA_STRIPE_TILES:
        for c in sparse_mma_candidates(m, n, k, device, ((kt, warps, depth),)):
            c = replace(c, stripe=stripe)
            if (c.block_w // 8) % stripe == 0 and c not in out:
                out.append(c)
    return out


# plain 2:4 with folded rows (tiles per slice, warps, blocks loaded ahead: 0-2): an MMA's values are one 16-byte
# load, its A operand as loaded ([Note: 2:4 folded rows] in _sparse_mma_kernels); the fastest of a sweep of 0-2 blocks
# ahead, 8-64 tiles, 2-8 warps (kernels run 177, H200) (sm_90 SASS: 84-244 registers, none spilled; 32 tiles with
# two blocks ahead, or 64 with one, spill)
SPARSE_MMA_FOLD_TILES = ((32, 4, 1), (32, 2, 1), (16, 8, 0), (16, 8, 1), (16, 4, 2), (16, 2, 2), (16, 4, 1),
                         (8, 4, 1))


def sparse_mma_fold_candidates(m: int, n: int, k: int, device: torch.device) -> list[WordConfig]:
    """Configs of plain 2:4 with folded rows (the caller checks ``_sparse_mma.sparse_mma_fold_fits``): as
    :func:`sparse_mma_candidates` over ``SPARSE_MMA_FOLD_TILES``, with blocks of 8 weight rows a warp and slices of
    whole pairs of MMAs (4 tiles)."""
    return sparse_mma_candidates(m, n, k, device, SPARSE_MMA_FOLD_TILES, warp_rows=8, min_tiles=4, fold=True)


# 2:4 + INT4 with folded rows (tiles per slice, warps, blocks loaded ahead: 0 or 1): plain 2:4's fastest families,
# one block ahead at most ([Note: 2:4 folded rows] in _sparse_mma_kernels; kernels run 182 chose 16-32 tiles, 2-8
# warps, one block ahead) (sm_90 SASS: 90-240 registers, none spilled)
SPARSE_MMA_W4_FOLD_TILES = ((32, 4, 1), (32, 2, 1), (16, 8, 0), (16, 8, 1), (16, 4, 1), (16, 4, 0), (8, 4, 1),
                            (64, 4, 0))
# the same with warps along K (tiles a program, warps, of them along K, blocks loaded ahead; [Note: fold warps along K]
# in _dense_mma_kernels): 16-32 tiles a warp as above, a program covering 4096-8192 columns of K
SPARSE_MMA_W4_FOLD_K_TILES = ((256, 16, 16, 1), (128, 8, 8, 1), (256, 8, 8, 1), (128, 16, 16, 1), (128, 4, 4, 1))

# the ways of adding the warps' sums after the last block (WordConfig.late_sums) that the tuner times beside the sums a
# block at a time: kept in shared memory (1). Kept in registers (2) is exact (kernels runs 205-206, H100) and has no
# barrier in the loop, but with it among the INT4 candidates the decode benchmark ran 2.35x where the same machine ran
# 2.50x without it (runs 207-208; which picks changed was not recorded), so it is timed only where asked for
# (benchmarks/gemv_check.py --late-sums 1 2)
FOLD_LATE_SUMS = (1,)


def sparse_mma_w4_fold_candidates(m: int, n: int, k: int, device: torch.device, *,
                                  late: tuple[int, ...] = FOLD_LATE_SUMS) -> list[WordConfig]:
    """Configs of 2:4 + INT4 with folded rows (the caller checks ``_sparse_mma.sparse_mma_w4_fold_fits``): as
    :func:`sparse_mma_fold_candidates` over ``SPARSE_MMA_W4_FOLD_TILES``, then with warps along ``K`` over
    ``SPARSE_MMA_W4_FOLD_K_TILES``, their sums added a block at a time and in each way of ``late``."""
    out = sparse_mma_candidates(m, n, k, device, SPARSE_MMA_W4_FOLD_TILES, warp_rows=8, min_tiles=4, fold=True)
    along_k = [c for c in _fold_along_k(m, n, k // 32, device, SPARSE_MMA_W4_FOLD_K_TILES, words=8, least=4,
                                        sparse_mma=True) if c not in out]
    return out + along_k + [replace(c, late_sums=way) for way in late for c in along_k]


def sparse_mma_w4_candidates(m: int, n: int, k: int, group: int, device: torch.device) -> list[WordConfig]:
    """Configs of the 2:4 + INT4 GEMV on sparse tensor cores (the caller checks ``_sparse_mma.sparse_mma_w4_fits``):
    as :func:`sparse_mma_candidates` over ``SPARSE_MMA_W4_TILES``, whole stripes a slice ([Note: INT4 stripes] in
    ``_sparse_mma_kernels``)."""
    from ._sparse_mma import w4_stripe

    return [c for c in sparse_mma_candidates(m, n, k, device, SPARSE_MMA_W4_TILES)
            if (c.block_w // 8) % w4_stripe(group) == 0]


# the INT4 GEMV on tensor cores' (stripes of 128 columns a warp, warps, warps along K, blocks loaded ahead: 0 or 1,
# x in shared memory), for 1-8 rows of x and for 9-16 (twice the B registers); with x in registers 8 stripes a warp
# and one block ahead spill, with x in shared memory they fit (255 registers; sm_90 SASS)
DENSE_MMA_W4_TILES = {1: ((4, 4, 1, 0, 0), (4, 4, 1, 1, 0), (2, 4, 1, 1, 0), (2, 8, 1, 1, 0), (4, 8, 1, 0, 0),
                          (8, 4, 1, 0, 0), (2, 4, 1, 0, 0), (4, 8, 1, 1, 0), (4, 4, 2, 1, 0), (4, 4, 4, 1, 0),
                          (2, 4, 4, 1, 0), (4, 8, 2, 1, 0), (4, 8, 4, 1, 0), (2, 8, 4, 1, 0), (4, 4, 4, 0, 0),
                          (8, 4, 4, 0, 0),
                          (4, 4, 1, 1, 1), (4, 4, 1, 0, 1), (8, 4, 1, 0, 1), (8, 4, 1, 1, 1), (2, 4, 1, 1, 1),
                          (4, 8, 1, 1, 1), (8, 8, 1, 0, 1), (4, 4, 2, 1, 1), (8, 4, 2, 0, 1), (4, 4, 4, 1, 1)),
                      2: ((2, 4, 1, 1, 0), (2, 4, 1, 0, 0), (4, 4, 1, 0, 0), (1, 4, 1, 1, 0), (2, 8, 1, 1, 0),
                          (1, 8, 1, 1, 0), (4, 8, 1, 0, 0), (2, 4, 2, 1, 0), (2, 4, 4, 1, 0), (2, 8, 4, 1, 0),
                          (2, 8, 8, 1, 0), (4, 4, 4, 0, 0), (1, 8, 8, 1, 0),
                          (2, 4, 1, 1, 1), (4, 4, 1, 1, 1), (4, 4, 1, 0, 1), (2, 4, 1, 0, 1), (4, 8, 1, 0, 1),
                          (2, 8, 1, 1, 1), (4, 4, 2, 1, 1), (4, 4, 4, 1, 1), (4, 8, 2, 1, 1))}


def dense_mma_w4_candidates(m: int, n: int, k: int, device: torch.device) -> list[WordConfig]:
    """Configs of the INT4 GEMV on tensor cores (the caller checks ``_dense_mma.dense_mma_w4_fits``): each slice
    depth, warp count, warps along ``K`` and prefetch depth of ``DENSE_MMA_W4_TILES`` with every run of row blocks
    that still gives a wave of programs; a short ``K`` takes one slice of a power of two of stripes (the rest
    masked); slices whose partials do not fit the workspace are left out."""
    stripes = k // 128
    sms = _sm_count(device.index or 0)
    out = []
    for q, warps, wk, depth, xs in DENSE_MMA_W4_TILES[1 if m <= 8 else 2]:
        q = min(q * wk, 1 << (stripes - 1).bit_length())  # stripes a program
        wk = min(wk, q)
        split = cdiv(stripes, q)
        rows = 16 * warps // wk
        if split > 1 and m * split * n > STATIONARY_WORKSPACE:
            continue
        runs = [rb for rb in SPARSE_MMA_RUNS if split * cdiv(n, rows * rb) >= sms
                and cdiv(n, rows * rb) <= WORKSPACE_COUNTERS] or [1]
        out += [c for c in (WordConfig(1, rows, 16 * q, split, warps, prefetch=depth, row_blocks=rb,
                                       dense_mma=True, k_warps=wk, x_shared=bool(xs)) for rb in runs) if c not in out]
    return out


# the INT4 GEMV on tensor cores with folded rows (stripes of 128 columns a warp, warps, blocks loaded ahead: 0 or 1),
# 1-4 rows of x ([Note: INT4 GEMV with folded rows] in _dense_mma_kernels); kernels runs 185-186 chose 4 stripes, 4
# warps, one block ahead on every shape (sm_90 SASS: 52-255 registers, none spilled; 16 stripes with one block ahead
# spill, and 8 stripes of 8 warps with none ahead did without zero points on a partial slice)
DENSE_MMA_FOLD_TILES = ((4, 4, 1), (4, 8, 1), (4, 4, 0), (8, 4, 1), (8, 4, 0), (2, 4, 1), (2, 8, 1), (16, 4, 0))
# the same with warps along K (stripes a program, warps, of them along K, blocks loaded ahead): a program covers all of
# K or a large slice of it, so the split-K fix-up's latency leaves the tail ([Note: fold warps along K] in
# _dense_mma_kernels; kernels run 199: 4096x4096 2.35x -> 2.76x, 4096x6144 2.60x -> 2.80x at one row, H100). Programs
# of 16 warps take all 64K registers of an SM at 128 a thread (sm_90 SASS of 4 stripes a warp: 127-128, none spilled;
# 8 stripes a warp spill)
DENSE_MMA_FOLD_K_TILES = ((32, 8, 8, 1), (64, 16, 16, 1), (16, 8, 8, 1), (32, 16, 16, 1), (16, 4, 4, 1), (32, 8, 4, 1))


# whether the INT4 GEMV with folded rows also offers balanced runs ([Note: balanced runs] in _dense_mma_kernels);
# checked and timed in kernels run 218 (H100), picked on gate/up and the head
FOLD_BALANCED = True


def dense_mma_w4_fold_candidates(m: int, n: int, k: int, device: torch.device, *,
                                 late: tuple[int, ...] = FOLD_LATE_SUMS,
                                 balanced: bool | None = None) -> list[WordConfig]:
    """Configs of the INT4 GEMV with folded rows (the caller checks ``_dense_mma.dense_mma_w4_fits`` and at most 4
    rows): as :func:`sparse_mma_candidates` over ``DENSE_MMA_FOLD_TILES`` (a stripe: 4 tiles of 32 columns), blocks of
    8 weight rows a warp; ``block_w // 16`` stripes a slice as in :func:`dense_mma_w4_candidates`; then with warps
    along ``K`` over ``DENSE_MMA_FOLD_K_TILES``, their sums added a block at a time and in each way of ``late``; with
    ``balanced`` (default ``FOLD_BALANCED``) also :func:`balanced_runs` of those that cover all of ``K``."""
    table = tuple((4 * q, warps, depth) for q, warps, depth in DENSE_MMA_FOLD_TILES)
    out = [replace(c, block_w=c.block_w // 2, sparse_mma=False, dense_mma=True)
           for c in sparse_mma_candidates(m, n, k, device, table, warp_rows=8, min_tiles=4, fold=True)]
    along_k = [c for c in _fold_along_k(m, n, k // 128, device, DENSE_MMA_FOLD_K_TILES, words=16, least=1,
                                        dense_mma=True) if c not in out]
    out = out + along_k + [replace(c, late_sums=way) for way in late for c in along_k]
    if FOLD_BALANCED if balanced is None else balanced:
        out += [c for c in balanced_runs(along_k, n, device) if c not in out]
    return out


def balanced_runs(configs: list[WordConfig], n: int, device: torch.device) -> list[WordConfig]:
    """[Note: balanced runs] in ``_dense_mma_kernels``: for each of ``configs`` with folded rows that covers all of
    ``K`` (one slice) and adds its sums a block at a time, the runs of row blocks that spread the ``N`` rows' blocks
    evenly over ``p`` programs an SM: ``cdiv(blocks, p * SMs)`` blocks a program, any count (the configs' runs are
    powers of two), for ``p`` = ``16 // warps`` and twice that (how many of a program an SM holds at once depends on
    its registers: the 16-warp program at 54 a thread runs two, and its run for twice ``p`` won in kernels run 218)."""
    sms = _sm_count(device.index or 0)
    out = []
    for c in configs:
        if not c.fold or c.split_k != 1 or c.late_sums:
            continue
        blocks = cdiv(n, c.block_n)
        for p in (max(1, 16 // c.warps), 2 * max(1, 16 // c.warps)):
            rb = cdiv(blocks, p * sms)
            b = replace(c, row_blocks=rb)
            if rb & (rb - 1) and b not in out:  # a power of two is among the configs already, or could be
                out.append(b)
    return out


def _fold_along_k(m: int, n: int, units: int, device: torch.device, table: tuple, *, words: int, least: int,
                  **kind: bool) -> list[WordConfig]:
    """Configs with folded rows and warps along ``K`` ([Note: fold warps along K] in ``_dense_mma_kernels``): each
    ``(units a program, warps, of them along K, blocks loaded ahead)`` of ``table`` over ``units`` slices of ``K``
    (stripes or tiles, ``words`` words of a row each in ``block_w``, at least ``least`` a warp), with every run of
    row blocks (8 weight rows for each warp along the rows) that gives half a wave of programs or more: programs of
    8-16 warps run one or two an SM, and a full wave is often just short."""
    sms = _sm_count(device.index or 0)
    out = []
    for per, warps, wk, depth in table:
        per = min(per, max(least * wk, 1 << (units - 1).bit_length()))  # a short K: one slice of all of it
        split = cdiv(units, per)
        if split > 1 and m * split * n > STATIONARY_WORKSPACE:
            continue
        rows = 8 * warps // wk
        runs = [rb for rb in SPARSE_MMA_RUNS + (32,) if 2 * split * cdiv(n, rows * rb) >= sms
                and cdiv(n, rows * rb) <= WORKSPACE_COUNTERS] or [1]
        out += [c for c in (WordConfig(1, rows, words * per, split, warps, prefetch=depth, row_blocks=rb, k_warps=wk,
                                       fold=True, **kind) for rb in runs) if c not in out]
    return out


def run_dense_mma(x, words, s, z, c: WordConfig, *, n: int, group: int) -> torch.Tensor | None:
    """The INT4 GEMV on tensor cores with config ``c``; ``None`` where its workspace cannot be made now or is too
    small for these rows (as :func:`run_stationary`)."""
    from ._dense_mma import run_dense_mma_w4

    ok, ws = _slices_workspace(x, c, n, cdiv(n, c.block_n * c.row_blocks))
    if not ok:
        return None
    if c.fold:
        from ._dense_mma import run_dense_mma_w4_fold

        return run_dense_mma_w4_fold(x, words, s, z, n=n, group=group, stripes_per_slice=c.block_w // 16,
                                     row_blocks=c.row_blocks, warps=c.warps, k_warps=c.k_warps, depth=c.prefetch,
                                     late_sums=c.late_sums, workspace=ws)
    return run_dense_mma_w4(x, words, s, z, n=n, group=group, stripes_per_slice=c.block_w // 16,
                            row_blocks=c.row_blocks, warps=c.warps, k_warps=c.k_warps, depth=c.prefetch,
                            x_shared=c.x_shared, workspace=ws)


# the INT4 GEMV on wgmma at 9-16 rows ([Note: INT4 GEMV on wgmma] in _stripe_wgmma_kernels): (stripes a chunk,
# warps); kernels session 33 (H100 and H200) chose chunks of 2 stripes on every shape, 4 and 8 warps alike (chunks of
# one stripe were 25-41 % slower); slices of 2 to 32 stripes, runs of 1 to 16 blocks
STRIPE_WGMMA_TILES = ((2, 4), (2, 8))
STRIPE_WGMMA_SLICES = (2, 4, 8, 16, 32)
STRIPE_WGMMA_MAX_SPLIT = 16  # more slices of K than this lost in every cell (their partials)


def stripe_wgmma_candidates(m: int, n: int, k: int, device: torch.device) -> list[WordConfig]:
    """Configs of the INT4 GEMV on ``wgmma`` (the caller checks ``_stripe_wgmma.stripe_wgmma_fits``): each of
    ``STRIPE_WGMMA_TILES`` with every slice of ``STRIPE_WGMMA_SLICES`` stripes (whole chunks, at most a power of two
    past ``K``, its ``x`` within the shared memory) and every run of row blocks whose grid fills the GPU at least once
    and at most 16 times (one block where none does); slices whose partials do not fit the workspace are left
    out."""
    from ._stripe_wgmma import MAX_M, MAX_X_BYTES, STRIPE_K

    stripes = k // STRIPE_K
    sms = _sm_count(device.index or 0)
    out = []
    for qi, warps in STRIPE_WGMMA_TILES:
        for q in STRIPE_WGMMA_SLICES:
            split = cdiv(stripes, q)
            if q % qi or q >= 2 * max(stripes, qi) or MAX_M * STRIPE_K * q * 2 > MAX_X_BYTES \
                    or split > STRIPE_WGMMA_MAX_SPLIT or (split > 1 and m * split * n > STATIONARY_WORKSPACE):
                continue
            rows = 16 * warps
            runs = [rb for rb in SPARSE_MMA_RUNS if sms <= split * cdiv(n, rows * rb) <= 16 * sms
                    and cdiv(n, rows * rb) <= WORKSPACE_COUNTERS] or [1]
            out += [WordConfig(1, rows, 16 * q, split, warps, row_blocks=rb, wgmma_chunk=qi) for rb in runs]
    return out


def run_stripe_wgmma(x, words, s, z, c: WordConfig, *, n: int, group: int) -> torch.Tensor | None:
    """The INT4 GEMV on ``wgmma`` with config ``c``; ``None`` where its workspace cannot be made now or is too small
    for these rows (as :func:`run_dense_mma`)."""
    from ._stripe_wgmma import run_stripe_wgmma_w4

    ok, ws = _slices_workspace(x, c, n, cdiv(n, c.block_n * c.row_blocks))
    if not ok:
        return None
    q = c.block_w // 16
    return run_stripe_wgmma_w4(x, words, s, z, n=n, group=group, chunk_stripes=c.wgmma_chunk,
                               chunks=q // c.wgmma_chunk, row_blocks=c.row_blocks, warps=c.warps, workspace=ws)


SPARSE_GEMM_TILES = {2: ((8, 4, 1, 1), (8, 4, 0, 1), (16, 4, 0, 1), (8, 8, 1, 1), (16, 8, 0, 1), (4, 8, 1, 2),
                         (4, 4, 1, 2)),
                     4: ((4, 4, 1, 1), (8, 4, 1, 1), (8, 4, 0, 1), (4, 8, 1, 1), (8, 8, 0, 1), (4, 4, 1, 2),
                         (2, 8, 1, 2)),
                     8: ((4, 4, 1, 1), (4, 4, 0, 1), (4, 8, 1, 1), (2, 8, 1, 1), (8, 8, 1, 1), (8, 4, 1, 1),
                         (2, 8, 1, 2), (2, 4, 1, 2), (4, 4, 1, 2))}
# groups of 8 rows of x per program -> (32-column tiles per chunk, warps, next chunk's weights loaded before the
# MMAs, blocks of 16 weight rows a warp) of the 2:4 GEMM on sparse tensor cores; none spills (sm_90 SASS, plain and
# + INT4); 16-tile chunks at 4 groups, and 8-tile chunks with two blocks a warp, spill or take 255 registers


def sparse_gemm_candidates(m: int, n: int, k: int, device: torch.device, stripe: int = 1) -> list[WordConfig]:
    """Configs of the 2:4 GEMM ([Note: 2:4 GEMM on sparse tensor cores]) for ``m`` rows of ``x`` (more than 8): the
    fewest groups of 8 rows per program that cover ``m`` (at most 8; the same for every ``m`` of a tuning bucket),
    each chunk depth (whole stripes of ``stripe`` tiles: 2:4 + INT4, ``_sparse_mma.w4_stripe``), warp count and number
    of 16-row blocks a warp (``block_n = 16 * warps * blocks``) with the one or two slice counts that first give a wave
    of programs; slices whose partials do not fit the workspace are left out."""
    from ._sparse_mma import MAX_GEMM_GROUPS

    groups = min(MAX_GEMM_GROUPS, 1 << max(0, (cdiv(m, 8) - 1).bit_length()))
    m_groups = cdiv(m, 8 * groups)
    tiles = k // 32
    sms = _sm_count(device.index or 0)
    out = []
    for kt, warps, depth, blocks in SPARSE_GEMM_TILES[max(2, groups)]:
        progs = m_groups * cdiv(n, 16 * warps * blocks)
        if progs > WORKSPACE_COUNTERS or kt % stripe:
            continue
        splits = [sp for sp in (1, 2, 4, 8, 16, 32) if sp * kt <= max(kt, tiles)
                  and (sp == 1 or m * sp * n <= STATIONARY_WORKSPACE)]
        first = next((i for i, sp in enumerate(splits) if progs * sp >= sms), len(splits) - 1)
        for sp in splits[first:first + 2]:
            c = WordConfig(8 * groups, 16 * warps * blocks, 8 * kt, sp, warps, prefetch=depth, sparse_mma=True)
            if c not in out:
                out.append(c)
    return out


def run_sparse_mma(x, words, meta, c: WordConfig, *, n: int, s=None, z=None, group: int = 0) -> torch.Tensor | None:
    """The 2:4 GEMV on sparse tensor cores with config ``c`` (2:4 + INT4 where ``s``, the scales, are given), or the
    2:4 GEMM where ``c.block_m`` > 1 (:func:`sparse_gemm_candidates`); ``None`` where its workspace cannot be made now
    or is too small for these rows (as :func:`run_stationary`)."""
    from ._sparse_mma import run_sparse_gemm, run_sparse_gemm_w4, run_sparse_mma as run, run_sparse_mma_w4

    m = x.shape[0]
    if c.block_m > 1:
        ok, ws = _slices_workspace(x, c, n, cdiv(m, c.block_m) * cdiv(n, c.block_n))
        if not ok:
            return None
        blocks = c.block_n // (16 * c.warps)
        if s is not None:
            return run_sparse_gemm_w4(x, words, meta, s, z, n=n, group=group, tiles_per_chunk=c.block_w // 8,
                                      groups=c.block_m // 8, split=c.split_k, warps=c.warps, depth=c.prefetch,
                                      blocks=blocks, workspace=ws)
        return run_sparse_gemm(x, words, meta, n=n, tiles_per_chunk=c.block_w // 8, groups=c.block_m // 8,
                               split=c.split_k, warps=c.warps, depth=c.prefetch, blocks=blocks, workspace=ws)
    ok, ws = _slices_workspace(x, c, n, cdiv(n, c.block_n * c.row_blocks))
    if not ok:
        return None
    if s is not None and c.fold:
        from ._sparse_mma import run_sparse_mma_w4_fold

        return run_sparse_mma_w4_fold(x, words, meta, s, z, n=n, group=group, tiles_per_slice=c.block_w // 8,
                                      row_blocks=c.row_blocks, warps=c.warps, k_warps=c.k_warps, depth=c.prefetch,
                                      late_sums=c.late_sums, workspace=ws)
    if s is not None:
        return run_sparse_mma_w4(x, words, meta, s, z, n=n, group=group, tiles_per_slice=c.block_w // 8,
                                 row_blocks=c.row_blocks, warps=c.warps, depth=c.prefetch, workspace=ws)
    if c.fold:
        from ._sparse_mma import run_sparse_mma_fold

        return run_sparse_mma_fold(x, words, meta, n=n, tiles_per_slice=c.block_w // 8, row_blocks=c.row_blocks,
                                   warps=c.warps, depth=c.prefetch, workspace=ws)
    if c.stripe:
        from ._sparse_mma import run_sparse_mma_stripe

        return run_sparse_mma_stripe(x, words, meta, n=n, stripe=c.stripe, tiles_per_slice=c.block_w // 8,
                                     row_blocks=c.row_blocks, warps=c.warps, depth=c.prefetch, workspace=ws)
    return run(x, words, meta, n=n, tiles_per_slice=c.block_w // 8, row_blocks=c.row_blocks, warps=c.warps,
               depth=c.prefetch, workspace=ws)


def run_stationary(x, words, s, z, c: WordConfig, *, fmt: int, group: int, n: int,
                   meta: torch.Tensor | None = None) -> torch.Tensor | None:
    """The x-stationary kernel with config ``c``; ``None`` where its workspace cannot be made now (see above) or
    is too small for these rows (:func:`_workspace_fits`)."""
    m, kw = x.shape[0], words.shape[1]
    runs = cdiv(n, c.block_n * c.row_blocks)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    ok, ws = _slices_workspace(x, c, n, m * runs)
    if not ok:
        return None
    partials, counters = ws or (out, words)  # one slice: the kernel stores the output directly and touches neither
    wg = c.block_w if fmt == FMT_W8 else group // CPW[fmt]  # words per group (INT8: per slice, one "group")
    fix_k = max(1, min(16, 4096 // (c.block_n * c.row_blocks)))  # the fix-up has 2 * fix_k slices in flight
    zz = z if z is not None else s
    if fmt == FMT_S24:
        mw = meta_words(meta)
        _stationary_kernels().stationary_s24_kernel[(m, c.split_k, runs)](
            x, words, mw, partials, counters, out, m, n, kw, c.split_k,
            x.stride(0), words.stride(0), mw.stride(0), out.stride(0),
            G=c.block_w // 8, BLOCK_N=c.block_n, ROW_BLOCKS=c.row_blocks, PARTIAL=c.split_k > 1,
            EVEN=kw % c.block_w == 0, FIX_K=fix_k, num_warps=c.warps)
        return out
    if fmt == FMT_S24W4:
        _stationary_kernels().stationary_s24w4_kernel[(m, c.split_k, runs)](
            x, words, meta, s, zz, partials, counters, out, m, n, kw, c.split_k,
            x.stride(0), words.stride(0), meta.stride(0), s.stride(0), out.stride(0),
            HAS_ZEROS=z is not None, G=c.block_w // wg, WG=wg, BLOCK_N=c.block_n, ROW_BLOCKS=c.row_blocks,
            PARTIAL=c.split_k > 1, EVEN=kw % c.block_w == 0, FIX_K=fix_k, num_warps=c.warps)
        return out
    if c.tma and _tma_words(words, wg):
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor.from_tensor(words.view(n, kw // wg, wg), [c.block_n, c.block_w // wg, wg])
        _stationary_kernels().stationary_tma_kernel[(m, c.split_k, runs)](
            x, desc, s, zz, partials, counters, out, m, n, kw, c.split_k,
            x.stride(0), s.stride(0) if s.dim() > 1 else 1, out.stride(0),
            FMT=fmt, HAS_ZEROS=z is not None, G=c.block_w // wg, WG=wg, BLOCK_N=c.block_n, ROW_BLOCKS=c.row_blocks,
            PARTIAL=c.split_k > 1, FIX_K=fix_k, STAGES=c.stages, num_warps=c.warps, num_stages=c.stages)
        return out
    # (a TMA config on words that TMA cannot read runs here, with the same tile)
    _stationary_kernels().stationary_gemv_kernel[(m, c.split_k, runs)](
        x, words, s, zz, partials, counters, out, m, n, kw, c.split_k,
        x.stride(0), words.stride(0), s.stride(0) if s.dim() > 1 else 1, out.stride(0),
        FMT=fmt, HAS_ZEROS=z is not None, G=c.block_w // wg, WG=wg, BLOCK_N=c.block_n, ROW_BLOCKS=c.row_blocks,
        PARTIAL=c.split_k > 1, EVEN=kw % c.block_w == 0, FIX_K=fix_k, DEPTH=1 if c.tma else c.prefetch,
        num_warps=c.warps)
    return out


def run_gemv(x, words, s, z, meta, *, fmt: int, group: int, n: int, k: int) -> torch.Tensor:
    _check_groups("gemv", fmt, group)
    m, kw = x.shape[0], words.shape[1]
    zz = z if z is not None else s
    mm = meta if meta is not None else words

    def launch(c: WordConfig) -> torch.Tensor:
        if c.dense_mma:
            out = run_dense_mma(x, words, s, z, c, n=n, group=group)
            if out is not None:
                return out
            c = tiles[0]  # no workspace now or too small: the tile kernel
        elif c.sparse_mma:
            w4 = fmt == FMT_S24W4
            out = run_sparse_mma(x, words, meta, c, n=n, s=s if w4 else None, z=z, group=group)
            if out is not None:
                return out
            c = tiles[0]  # no workspace now or too small: the tile kernel
        elif c.row_blocks:
            out = run_stationary(x, words, s, z, c, fmt=fmt, group=group, n=n, meta=meta)
            if out is not None:
                return out
            c = tiles[0]  # no workspace now (a capture before the first eager call) or too small: the tile kernel
        xp = x if c.xnat else plane_major(x, CPW[fmt])
        out = _out(m, n, x, c.split_k)
        _kernels().gemv_kernel[(m, cdiv(n, c.block_n), c.split_k)](
            xp, words, s, zz, mm, out, m, n, k, kw, c.split_k,
            xp.stride(0), words.stride(0), s.stride(0) if s.dim() > 1 else 1, mm.stride(0), out.stride(0),
            FMT=fmt, GROUP=group, HAS_ZEROS=z is not None, ATOMIC=c.split_k > 1, CPW=CPW[fmt],
            BLOCK_N=c.block_n, BLOCK_W=c.block_w, EVEN_W=kw % c.block_w == 0,
            ACC_W=_acc_width(fmt, c.block_w, group), PREFETCH=c.prefetch, X2D=c.x2d, XNAT=c.xnat,
            num_warps=c.warps,
            num_stages=c.stages)
        return out if c.split_k == 1 else out.to(x.dtype)

    key = ("gemv", fmt, group, z is not None, m_bucket(m), n, k, x.dtype)
    tiles = gemv_candidates(fmt, m, n, kw, group, x.device)  # also the fallback of the other kernels
    from ._sparse_mma import MAX_M

    if fmt in (FMT_S24, FMT_S24W4) and m > MAX_M:  # more rows than the GEMV's MMA takes
        from ._sparse_mma import sparse_gemm_fits

        if sparse_gemm_fits(x, words, meta, w4=fmt == FMT_S24W4, s=s, z=z, group=group):  # the 2:4 GEMM alone
            from ._sparse_mma import w4_stripe

            stripe = w4_stripe(group) if fmt == FMT_S24W4 else 1
            return launch(_pick(key, sparse_gemm_candidates(m, n, k, x.device, stripe), launch))
    stationary = stationary_candidates(fmt, m, n, kw, group, x.device)
    if fmt == FMT_S24 and meta_words(meta) is None:
        stationary = []  # metadata the x-stationary kernel cannot read as int32 words
    if fmt == FMT_S24:
        from ._sparse_mma import sparse_mma_fits, sparse_mma_fold_fits, sparse_mma_stripe_fits

        mma = sparse_mma_fits(x, words, meta) and sparse_mma_candidates(m, n, k, x.device)
        if mma:  # it beat the CUDA-core kernels at every shape and 1-8 rows (kernels runs 66-73): tune it alone,
            # with its striped variant (faster at one row, not always at 4-8: kernels run 172)
            mma += [c for c in sparse_mma_stripe_candidates(m, n, k, x.device)
                    if sparse_mma_stripe_fits(x, words, meta, c.stripe)]
            if sparse_mma_fold_fits(x, words, meta):  # 1-4 rows: folded rows ([Note: 2:4 folded rows])
                mma += sparse_mma_fold_candidates(m, n, k, x.device)
            return launch(_pick(key, mma, launch))
    if fmt == FMT_W4:
        from ._dense_mma import FOLD_M, dense_mma_w4_fits

        if dense_mma_w4_fits(x, words, s, z, group=group):
            dense = dense_mma_w4_candidates(m, n, k, x.device)
            if m <= FOLD_M:  # folded rows ([Note: INT4 GEMV with folded rows]): ahead on 8192x8192 and the decode
                # shapes
                dense = dense + dense_mma_w4_fold_candidates(m, n, k, x.device)
            if m > 1:  # the others' instructions grow with the rows, its do not (kernels run 160): tune it alone
                return launch(_pick(key, dense, launch))
            stationary = stationary + dense
    if fmt == FMT_S24W4:
        from ._sparse_mma import sparse_mma_w4_fits, sparse_mma_w4_fold_fits

        if sparse_mma_w4_fits(x, words, meta, s, z, group=group):
            stationary = stationary + sparse_mma_w4_candidates(m, n, k, group, x.device)
            if sparse_mma_w4_fold_fits(x, words, meta, s, z, group=group):  # [Note: 2:4 folded rows]
                stationary = stationary + sparse_mma_w4_fold_candidates(m, n, k, x.device)
    return launch(_pick(key, tiles + stationary, launch))


def packed_dequant(fmt: int, x_dtype: torch.dtype, s_dtype: torch.dtype, device_type: str, group: int) -> int:
    """The full-depth wdot's ``PACKED`` ([Note: packed INT4 dequantization] in _wmma_kernels): 1 (bf16) or 2
    (fp16) for INT4 with scales in ``x``'s 16-bit dtype on the GPU, else 0 (the fp32 path; the interpreter runs no
    PTX). Every group size the full-depth tiles take, those spanning groups of 16 to 64 columns included: their
    scales are loaded per group and spread to the words ([Note: group scales] in _word_kernels). Loaded per word, as
    before, such a packed tile crashed Triton 3.6's compiler in 64-row tiles (kernels run 41), so g32 and g64 took
    the fp32 path. Groups of one word (8 columns) still do: there a group's scale is a word's, and the packed 64 x 128
    and 64 x 256 tiles with zero points crash Triton 3.6 the same way (``TritonGPUOptimizeDotOperands``, "Illegal
    shared layout"). ``ZSPEED_PACKED_DEQUANT=0`` in the environment turns it off (for A/B timings)."""
    if fmt != FMT_W4 or interpreting() or device_type != "cuda" or s_dtype != x_dtype:
        return 0
    if _full_block_w(fmt, group) is None or group < 2 * CPW[fmt]:
        return 0  # no full-depth tile for these groups, or groups of one word (see above)
    if os.environ.get("ZSPEED_PACKED_DEQUANT", "1") == "0":
        return 0
    return {torch.bfloat16: 1, torch.float16: 2}.get(x_dtype, 0)


def run_wdot(x, words, s, z, meta, *, fmt: int, group: int, n: int, k: int) -> torch.Tensor:
    key, candidates, launch = wdot_launcher(x, words, s, z, fmt=fmt, group=group, n=n, k=k)
    return launch(_pick(key, candidates, launch))


def wdot_launcher(x, words, s, z, *, fmt: int, group: int, n: int, k: int):
    """``(key, candidates, launch)`` of the ``wdot`` path for these operands: the tuning key, the configs it tunes
    over and ``launch(config)``, which runs one config (``benchmarks/wdot_tiles.py`` times any config with it)."""
    if fmt not in (FMT_W8, FMT_W4):
        raise ValueError(f"the wdot path has no kernel for format {fmt}; use gemv, tiled or dense")
    _check_groups("wdot", fmt, group)
    m, kw = x.shape[0], words.shape[1]
    zz = z if z is not None else s
    packed = packed_dequant(fmt, x.dtype, s.dtype, x.device.type, group)  # tuned apart: its best tiles differ
    candidates = wdot_candidates(fmt, m, n, kw, group, x.device, packed,
                                 x.dtype in (torch.bfloat16, torch.float16))
    if any(c.pipelined for c in candidates):
        from ._pipelined import words_readable

        if not words_readable(words):  # e.g. a view at an odd row offset: TMA cannot take it
            candidates = [c for c in candidates if not c.pipelined]
    if not candidates:
        raise ValueError(f"the wdot path has no tile for groups of {group} columns (its tiles of 16 to 128 columns "
                         "must lie in one group or span whole groups); use path='splitk', 'tiled' or 'dense'")
    if fmt == FMT_W4:
        from ._stripe_wgmma import stripe_wgmma_fits

        if stripe_wgmma_fits(x, words, s, z, group=group):  # 9-16 rows: [Note: INT4 GEMV on wgmma]
            candidates = candidates + stripe_wgmma_candidates(m, n, k, x.device)

    def launch(c: WordConfig) -> torch.Tensor:  # the plane-major copy, where read, is timed with the kernel
        if c.wgmma_chunk:
            out = run_stripe_wgmma(x, words, s, z, c, n=n, group=group)
            if out is not None:
                return out
            c = next(t for t in candidates if not t.wgmma_chunk)  # no workspace now or too small: a tiled kernel
        if c.pipelined:
            from ._pipelined import run_fragment, run_pipelined, run_specialized

            ws = _stationary_workspace(x.device) if c.split_k > 1 else None
            fits = ws is not None and _fixup_fits(m, n, c.split_k, c.block_m, c.block_n)
            if c.fragment:
                whole = fragment_whole(c, m, n, _sm_count(x.device.index or 0)) if c.tail else 0
                fits = ws is not None and _fragment_fits(m, n, c.block_m, c.split_k, whole, c.block_n)
                return run_fragment(x, words, s, z, group=group, n=n, k=k, block_m=c.block_m, stages=c.stages,
                                    q_stages=c.prefetch, split_k=c.split_k if fits else 1, whole=whole,
                                    pair=c.pair, overlap=c.overlap, sub=c.sub, warp_groups=c.block_n // 64,
                                    workspace=ws if fits else None, int8=fmt == FMT_W8)
            if c.specialized:
                return run_specialized(x, words, s, z, group=group, n=n, k=k, block_m=c.block_m, block_n=c.block_n,
                                       stages=c.stages, q_stages=c.prefetch, w_stages=c.block_w,
                                       dq_warps=c.specialized,
                                       split_k=c.split_k if fits else 1, workspace=ws if fits else None)
            return run_pipelined(x, words, s, z, group=group, n=n, k=k, block_m=c.block_m, block_n=c.block_n,
                                 stages=c.stages, q_stages=c.prefetch, split_k=c.split_k if fits else 1,
                                 workspace=ws if fits else None,  # no workspace yet (a capture): one slice
                                 int8=fmt == FMT_W8)
        xs = x if c.full_depth and c.order != 2 else plane_major(x, CPW[fmt])
        ws = _stationary_workspace(x.device) if c.fixup and _fixup_fits(m, n, c.split_k, c.block_m, c.block_n) else None
        fixup = ws is not None  # else atomics: in a capture before the first eager call, or past the workspace
        out = _out(m, n, x, 1 if fixup else c.split_k)
        if c.full_depth:
            kernel = _wmma_kernels().wmma_kernel
            parts, counters = ws if fixup else (out, out)
            head = (xs, words, s, zz, out, parts, counters)
            extra = dict(ORDER=c.order, SWAP=c.swap, FIXUP=fixup, PACKED=packed if c.order == 3 else 0,
                         SCALES_AHEAD=bool(c.scales_ahead and packed and c.order == 3))
        else:
            kernel, head, extra = _kernels().wdot_kernel, (xs, words, s, zz, out), {}
        kernel[(cdiv(m, c.block_m), cdiv(n, c.block_n), c.split_k)](
            *head, m, n, k, kw, c.split_k,
            xs.stride(0), words.stride(0), s.stride(0) if s.dim() > 1 else 1, out.stride(0),
            FMT=fmt, GROUP=group, HAS_ZEROS=z is not None, ATOMIC=c.split_k > 1 and not fixup,
            DOT_F32=interpreting() or x.dtype == torch.float32, CPW=CPW[fmt], BLOCK_M=c.block_m,
            BLOCK_N=c.block_n, BLOCK_W=c.block_w, EVEN_W=kw % c.block_w == 0, num_warps=c.warps,
            num_stages=c.stages, **extra)
        return out if c.split_k == 1 or fixup else out.to(x.dtype)

    key = ("wdot", fmt, group, z is not None, m_bucket(m), n, k, x.dtype) + ((f"packed{packed}",) if packed else ())
    return key, candidates, launch
