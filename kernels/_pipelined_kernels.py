"""The pipelined INT4 / INT8 GEMM for Hopper, written in Gluon: dequantization of one tile overlapped with the MMA of
the one before.

Imported lazily, like ``_word_kernels`` (see [Note: lazy triton] in ``_runtime``); only on an sm_90 GPU with a
Triton that has Gluon (``_pipelined.pipelined_possible``).

[Note: pipelined wdot] The full-depth ``wmma_kernel`` (``_wmma_kernels``) runs each tile of ``K`` as a chain:
wait for the tile's loads, dequantize it in registers, store it to shared memory, barrier, issue the ``wgmma`` and
wait for it to finish before the next tile, because the next tile's dequantized weights go to the same shared
buffer. Triton cannot double-buffer a tile it computed, and in the swapped orientation, where the weights are the
``wgmma``'s register operand, ptxas waits for every ``wgmma`` before it reuses their registers (SASS for sm_90
from Triton 3.6: ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each ``HGMMA``). That chain, not bandwidth or issue, is
what limited it at 128 to 256 rows (kernels run 44: tiles that fit two or three programs per SM did not help,
[Note: tile depth] in ``_word``).

This kernel computes ``acc^T[BN, BM] = W[BN, K] @ x^T`` (weight rows on the ``wgmma``'s M side, 64 per warp group,
the rows of ``x`` on its N side, [Note: swap-AB]) with both operands in shared memory:

- TMA copies each tile's INT4 words ``(BN, 8)`` into a ring of ``QSTAGES`` buffers and its ``x`` block ``(BM, 64)``
  into a ring of ``XSTAGES``, one mbarrier per buffer; zero rows past ``M`` come from the TMA's bounds. The words'
  ring is the deeper one and is refilled as soon as a tile's words are read: they come from HBM, while every
  program reads the same ``x``, mostly from L2;
- the words are dequantized in registers as the full-depth kernel does ([Note: packed INT4 dequantization] in
  ``_wmma_kernels``, natural column order), into one of two shared buffers, alternately. (Stored in *plane order*,
  the order the PTX leaves the fields in, with ``x`` permuted to match by one copy per call, it ran 5-10 % slower
  at 128 and 256 rows: the copy cost more than the register shuffles it saved, kernels run 46);
- the ``wgmma`` of tile ``i`` is issued asynchronously and waited for only down to one outstanding, so it runs
  while the warps dequantize tile ``i + 1``;
- one CTA barrier per tile: after it every warp group has retired the ``wgmma`` of tile ``i - 2``, so that tile's
  ``x`` buffer can take the copy of tile ``i + XSTAGES - 2`` and its dequantized buffer the next tile. With one
  warp group (4 warps) the copy of tile ``i + XSTAGES - 1`` goes out as soon as the wait retires tile ``i - 1``'s
  ``wgmma``, one tile further ahead. Each warp group writes only its own 64 rows of a dequantized buffer (the
  words' layout puts warp ``w`` on rows ``16w .. 16w + 15``);
- scales and zero points are loaded 16 groups at a time, one such chunk ahead, in registers, and spread to the
  words' layout once per group.

INT8 (``INT8``) runs the same schedule on tiles of 16 words, its codes made exact 16-bit values by
[Note: INT8 in 16-bit pairs] (``_int8_asm``) and its per-channel scale applied to the fp32 accumulator.

Tiles are 64 columns deep (a 128-byte row of bf16, the TMA's swizzle width), so a group of 128 columns spans two.
Where the output has too few tiles to fill the GPU, ``K`` is split and each tile's last split sums the partials
in split order ([Note: split-K fix-up] in ``_word``), 32 rows of ``x`` at a time so that the accumulator and a
partial are never both in registers.

Measured on an H100 (benchmarks/RESULTS.md, kernels runs 45-48, speed-up over cuBLAS bf16): at 256 rows 0.77-0.83x
where the full-depth kernel ran 0.55-0.67x, at 128 rows 1.02-1.19x (0.80-0.97x). Below 128 rows it is slower than
the full-depth kernel (16 rows: 0.6-1.6x against 1.9-2.1x): a 64-column tile carries too few weight bytes for its
fixed cost (barriers, TMA issue, mbarrier waits). What is left at 256 rows, from Nsight Compute on an H100
(kernels run 61, 8192x28672, 256 x 128 tiles): the tensor pipe is busy 63 % of the cycles its SMs are active (50 %
with 64-row tiles on 8192x8192), L2 serves 3.7 TB/s (37 % of its peak) and issue slots are 26 % busy. The warps
mostly wait: on fixed-latency dependencies inside the dequantization (1.4 cycles per issued instruction), on the
mbarriers and loads (1.3), on dispatch (0.7), shared memory (0.7) and the CTA barrier (0.6). With 218 registers a
thread only 8 warps fit an SM, too few to hide that. The warp-specialized kernel splits the roles
([Note: warp-specialized wdot] in ``_specialized_kernels``) and replaces this one from 256 rows where it wins.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ._wmma_kernels import _ASM_BF16, _ASM_F16, _ASM_IO

# the TMA load is ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before (the device has 3.6)
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # renamed in Triton 3.9


def _int8_asm(half16: bool) -> str:
    """[Note: INT8 in 16-bit pairs]: ``$0``-``$3`` are bytes 0-3 of words a (``$4``) and b (``$5``) as exact 16-bit
    pairs of the signed codes, a's in the low half. fp16 holds ``1024 + u`` for a whole byte ``u = q + 128``. bf16
    (8 significant bits) takes the byte's two nibbles apart, ``128 + h`` and ``128 + l``, and joins them as
    ``(h - 8) * 16 + l`` in one FMA, exact because the result has at most 8 significant bits."""
    lines = ["{", ".reg .b32 a, b, d, t, lo, hi, c0, c1, c2;", "xor.b32 a, $4, 0x80808080;",
             "xor.b32 b, $5, 0x80808080;"]
    if half16:
        lines += ["mov.b32 c0, 0x64806480;"]  # 1152 = 1024 + 128 in fp16
    else:
        lines += ["mov.b32 c0, 0x43084308;", "mov.b32 c1, 0x43004300;", "mov.b32 c2, 0x41804180;"]  # 136, 128, 16
    for j in range(4):
        sel = j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12)  # byte j of a into byte 0, of b into byte 2
        lines.append(f"prmt.b32 d, a, b, {sel:#06x};")
        if half16:
            lines += ["lop3.b32 t, d, 0x00ff00ff, 0x64006400, 0xea;", f"sub.rn.f16x2 ${j}, t, c0;"]
        else:
            lines += ["lop3.b32 lo, d, 0x000f000f, 0x43004300, 0xea;", "shr.u32 t, d, 4;",
                      "lop3.b32 hi, t, 0x000f000f, 0x43004300, 0xea;", "sub.rn.bf16x2 hi, hi, c0;",
                      "sub.rn.bf16x2 lo, lo, c1;", f"fma.rn.bf16x2 ${j}, hi, c2, lo;"]
    return "\n".join(lines + ["}"])


_ASM_W8_BF16 = gl.constexpr(_int8_asm(False))
_ASM_W8_F16 = gl.constexpr(_int8_asm(True))
_ASM_W8_IO = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 2))

BK = gl.constexpr(64)  # columns per tile
BW = gl.constexpr(8)  # INT4 words per tile row


@gluon.jit
def _scale_chunk(s_ptr, z_ptr, rows, rmask, cols, c, groups, stride_sn, HAS_ZEROS: gl.constexpr):
    """Scales and zero points of groups ``16c .. 16c + 15`` of the rows, ``(BN, 16)`` (zeros past the row)."""
    g = c * 16 + cols
    offs = rows[:, None] * stride_sn + g[None, :]
    mask = rmask[:, None] & (g < groups)[None, :]
    s = gl.load(s_ptr + offs, mask=mask, other=0.0)
    if HAS_ZEROS:
        z = gl.load(z_ptr + offs, mask=mask, other=0)
    else:
        z = gl.full(s.shape, 8, gl.uint8, s.type.layout)
    return s, z


@gluon.jit
def _tile_scales(s_chunk, z_chunk, cols, j, WORDS_LAYOUT: gl.constexpr, BW: gl.constexpr):
    """Column ``j`` of a chunk (``_scale_chunk``), spread over the words' ``(BN, BW)`` layout: the scale, and
    ``128 + zero point`` (fp16: ``1024 + zero point``), in the scales' dtype ([Note: packed INT4 dequantization] in
    ``_wmma_kernels``)."""
    pick = (cols == j)[None, :]
    s = gl.sum(gl.where(pick, s_chunk.to(gl.float32), 0.0), axis=1)
    z = gl.sum(gl.where(pick, z_chunk.to(gl.float32), 0.0), axis=1)
    row_l: gl.constexpr = gl.SliceLayout(1, WORDS_LAYOUT)
    zero = gl.zeros([s_chunk.shape[0], BW], gl.float32, WORDS_LAYOUT)
    dtype: gl.constexpr = s_chunk.dtype  # bf16 or fp16, x's: the exponent base is 128 (bf16) or 1024 (fp16)
    base: gl.constexpr = 1024.0 if dtype == gl.float16 else 128.0
    s2 = (gl.convert_layout(s, row_l)[:, None] + zero).to(dtype)
    z2 = (gl.convert_layout(z + base, row_l)[:, None] + zero).to(dtype)
    return s2, z2


@gluon.jit
def _scales_first(s_ptr, z_ptr, off_n, N, t_lo, groups, stride_sn, HAS_ZEROS: gl.constexpr, GROUP: gl.constexpr,
                  BLOCK_N: gl.constexpr, CHUNK_L: gl.constexpr, WORDS_L: gl.constexpr):
    """The scale state at a split's first tile ``t_lo``: the rows, the chunk of 16 groups holding it and the next one
    (``_scale_chunk``), and its group's scales spread over the words' layout (``_tile_scales``)."""
    TILES_PER_CHUNK: gl.constexpr = 16 * (GROUP // BK)
    rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CHUNK_L))
    rmask = rows < N
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, CHUNK_L))
    chunk = t_lo // TILES_PER_CHUNK
    s_cur, z_cur = _scale_chunk(s_ptr, z_ptr, rows, rmask, cols, chunk, groups, stride_sn, HAS_ZEROS)
    s_nxt, z_nxt = _scale_chunk(s_ptr, z_ptr, rows, rmask, cols, chunk + 1, groups, stride_sn, HAS_ZEROS)
    s_t, z_t = _tile_scales(s_cur, z_cur, cols, (t_lo // (GROUP // BK)) % 16, WORDS_L, BW)
    return rows, rmask, cols, s_cur, z_cur, s_nxt, z_nxt, s_t, z_t


@gluon.jit
def _scales_next(j, t, rows, rmask, cols, s_cur, z_cur, s_nxt, z_nxt, s_t, z_t, s_ptr, z_ptr, groups, stride_sn,
                 HAS_ZEROS: gl.constexpr, GROUP: gl.constexpr, WORDS_L: gl.constexpr):
    """The scale state at tile ``t`` (the split's ``j``-th): a new chunk loaded a chunk ahead where one starts, the
    group's scales spread where a group starts."""
    TILES_PER_GROUP: gl.constexpr = GROUP // BK
    TILES_PER_CHUNK: gl.constexpr = 16 * TILES_PER_GROUP
    if (t % TILES_PER_CHUNK == 0) & (j > 0):
        s_cur, z_cur = s_nxt, z_nxt
        s_nxt, z_nxt = _scale_chunk(s_ptr, z_ptr, rows, rmask, cols, t // TILES_PER_CHUNK + 1, groups, stride_sn,
                                    HAS_ZEROS)
    if (t % TILES_PER_GROUP == 0) & (j > 0):
        s_t, z_t = _tile_scales(s_cur, z_cur, cols, (t // TILES_PER_GROUP) % 16, WORDS_L, BW)
    return s_cur, z_cur, s_nxt, z_nxt, s_t, z_t


@gluon.jit
def _dequant_to(buf, w, s, zz):
    """INT4 words ``(BN, BW)`` -> ``buf`` ``(BN, 8 * BW)`` in the scales' dtype (bf16 or fp16), ``(q - z) * s`` in
    the natural column order."""
    if s.dtype == gl.float16:
        f0, f1, f2, f3, f4, f5, f6, f7 = gl.inline_asm_elementwise(_ASM_F16, _ASM_IO, [w, s, zz],
                                                                   dtype=(gl.float16, ) * 8, is_pure=True, pack=2)
    else:
        f0, f1, f2, f3, f4, f5, f6, f7 = gl.inline_asm_elementwise(_ASM_BF16, _ASM_IO, [w, s, zz],
                                                                   dtype=(gl.bfloat16, ) * 8, is_pure=True, pack=2)
    t = gl.join(gl.join(gl.join(f0, f4), gl.join(f2, f6)), gl.join(gl.join(f1, f5), gl.join(f3, f7)))
    bn: gl.constexpr = w.shape[0]
    buf.store(gl.reshape(t, [bn, 8 * BW]))


@gluon.jit
def _dequant8_to(buf, w, DTYPE: gl.constexpr):
    """INT8 words ``(BN, BW)`` -> ``buf`` ``(BN, 4 * BW)``: the codes themselves, exact in ``DTYPE`` (bf16 or fp16),
    natural column order; the per-channel scale goes on the accumulator, as in the full-depth kernel."""
    if DTYPE == gl.float16:
        f0, f1, f2, f3 = gl.inline_asm_elementwise(_ASM_W8_F16, _ASM_W8_IO, [w], dtype=(gl.float16, ) * 4,
                                                   is_pure=True, pack=2)
    else:
        f0, f1, f2, f3 = gl.inline_asm_elementwise(_ASM_W8_BF16, _ASM_W8_IO, [w], dtype=(gl.bfloat16, ) * 4,
                                                   is_pure=True, pack=2)
    t = gl.join(gl.join(f0, f2), gl.join(f1, f3))
    bn: gl.constexpr = w.shape[0]
    buf.store(gl.reshape(t, [bn, 4 * w.shape[1]]))


@gluon.jit
def _split_tiles(K, SPLIT_K, k_slice):
    """``(t_lo, n_tiles)``: slice ``k_slice`` of ``SPLIT_K`` of ``K``'s 64-column tiles, ``t_lo .. t_lo + n_tiles -
    1``."""
    n_all = K // BK
    per_split = gl.cdiv(n_all, SPLIT_K)
    t_lo = k_slice * per_split
    return t_lo, gl.maximum(gl.minimum(per_split, n_all - t_lo), 0)


@gluon.jit
def _store_acc(acc, out_ptr, part_ptr, count_ptr, off_n, off_m, M, N, SPLIT_K, stride_om, tile_id, k_slice, p_base,
               p_slice, p_row, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    """The tile's ``acc^T`` (weight rows x rows of ``x``) into ``out``, or with split-K its partial into ``part_ptr``,
    the tile's last split summing the partials in split order ([Note: split-K fix-up] in ``_word``), 32 rows of
    ``x`` at a time so that the accumulator and a partial are never both in registers. ``tile_id`` picks the
    tile's counter; ``num_warps`` are the warps that hold ``acc``. Slice ``k_slice``'s partial of output element
    ``(off_m + i, off_n + j)`` is at ``p_base + k_slice p_slice + i p_row + j``: ``(off_m N + off_n, M N, N)`` keeps
    partials in the output's shape, a compact block per tile takes only the tiles that are split."""
    acc_l: gl.constexpr = acc.type.layout
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_l))
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if SPLIT_K == 1:
        gl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tile = p_base + (offs_m - off_m)[None, :] * p_row + (offs_n - off_n)[:, None]
        gl.store(part_ptr + k_slice * p_slice + tile, acc, mask=mask)
        _cta_barrier()
        counter = count_ptr + tile_id
        done = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            fix_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[16, 2],
                                                   warps_per_cta=[1, num_warps], order=[0, 1])
            FIX_M: gl.constexpr = 32 if BLOCK_M >= 32 else BLOCK_M  # every row of the tile, also below 32
            fn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, fix_l))
            for mb in gl.static_range(BLOCK_M // FIX_M):
                fm = off_m + mb * FIX_M + gl.arange(0, FIX_M, layout=gl.SliceLayout(0, fix_l))
                fmask = (fn < N)[:, None] & (fm < M)[None, :]
                ftile = p_base + (fm - off_m)[None, :] * p_row + (fn - off_n)[:, None]
                total = gl.zeros([BLOCK_N, FIX_M], gl.float32, fix_l)
                for k0 in range(0, SPLIT_K):
                    total += gl.load(part_ptr + k0 * p_slice + ftile, mask=fmask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + fm[None, :] * stride_om + fn[:, None], total.to(out_ptr.dtype.element_ty),
                         mask=fmask)
            gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@gluon.jit
def w4_pipelined_kernel(x_desc, w_desc, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, SPLIT_K, stride_sn,
                        stride_om, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_M: gl.constexpr, XSTAGES: gl.constexpr, QSTAGES: gl.constexpr, W_LAYOUT: gl.constexpr,
                        num_warps: gl.constexpr, INT8: gl.constexpr = False):
    """``out[M, N] = x @ dequant(W)^T`` for INT4 words, ``x`` and scales in bf16 or fp16 ([Note: pipelined wdot]). Grid
    ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K)``; ``K`` a multiple of 64, ``GROUP`` of 64. Where ``K`` is
    split, each split stores its fp32 partial in ``part_ptr`` and the tile's last split sums them in split order
    ([Note: split-K fix-up] in ``_word``)."""
    off_n = gl.program_id(0) * BLOCK_N
    off_m = gl.program_id(1) * BLOCK_M
    t_lo, n_tiles = _split_tiles(K, SPLIT_K, gl.program_id(2))
    groups = K // GROUP

    WPT: gl.constexpr = 2 * BW if INT8 else BW  # words per tile row: 64 columns, 4 (INT8) or 8 (INT4) a word
    RPW: gl.constexpr = BLOCK_N // num_warps  # warp w dequantizes rows 16w .. 16w + 15, its warp group's own
    words_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, WPT * RPW // 32], threads_per_warp=[RPW, 32 // RPW],
                                             warps_per_cta=[num_warps, 1], order=[1, 0])
    chunk_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16 * RPW // 32],
                                             threads_per_warp=[RPW, 32 // RPW], warps_per_cta=[num_warps, 1],
                                             order=[1, 0])
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BLOCK_M, 16])
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [XSTAGES, BLOCK_M, BK], x_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [QSTAGES, BLOCK_N, WPT], w_desc.layout)
    w_smem = gl.allocate_shared_memory(x_desc.dtype, [2, BLOCK_N, BK], W_LAYOUT)
    x_ready = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [QSTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(XSTAGES):
        mbarrier.init(x_ready.index(i), count=1)
    for i in gl.static_range(QSTAGES):
        mbarrier.init(q_ready.index(i), count=1)

    for i in gl.static_range(QSTAGES):  # words of the first QSTAGES tiles in flight
        if i < n_tiles:
            mbarrier.expect(q_ready.index(i), w_desc.block_type.nbytes)
            _tma_load(w_desc, [off_n, (t_lo + i) * WPT], q_ready.index(i), q_smem.index(i))
    for i in gl.static_range(XSTAGES - 1):  # x of the first XSTAGES - 1
        if i < n_tiles:
            mbarrier.expect(x_ready.index(i), x_desc.block_type.nbytes)
            _tma_load(x_desc, [off_m, (t_lo + i) * BK], x_ready.index(i), x_smem.index(i))

    if not INT8:  # INT4's group scales (INT8's per-channel scale goes on the accumulator)
        rows, rmask, cols, s_cur, z_cur, s_nxt, z_nxt, s_t, z_t = _scales_first(
            s_ptr, z_ptr, off_n, N, t_lo, groups, stride_sn, HAS_ZEROS, GROUP, BLOCK_N, chunk_l, words_l)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
    for j in range(n_tiles):  # j counts this split's tiles (ring slots, phases); t is the tile of K
        t = t_lo + j
        if not INT8:
            s_cur, z_cur, s_nxt, z_nxt, s_t, z_t = _scales_next(j, t, rows, rmask, cols, s_cur, z_cur, s_nxt, z_nxt,
                                                                s_t, z_t, s_ptr, z_ptr, groups, stride_sn, HAS_ZEROS,
                                                                GROUP, words_l)
        qs = j % QSTAGES
        mbarrier.wait(q_ready.index(qs), (j // QSTAGES) & 1)
        buf = w_smem.index(j % 2)
        if INT8:
            _dequant8_to(buf, q_smem.index(qs).load(words_l), x_desc.dtype)
        else:
            _dequant_to(buf, q_smem.index(qs).load(words_l), s_t, z_t)
        fence_async_shared()
        _cta_barrier()  # every warp: this tile's stores visible, its words read, wgmma of tile j - 2 retired
        if j + QSTAGES < n_tiles:  # into the words buffer this tile used
            mbarrier.expect(q_ready.index(qs), w_desc.block_type.nbytes)
            _tma_load(w_desc, [off_n, (t + QSTAGES) * WPT], q_ready.index(qs), q_smem.index(qs))
        if num_warps > 4:
            nxt = j + XSTAGES - 2
            if (j > 0) & (nxt < n_tiles):  # into the x buffer that tile j - 2 used
                xn = nxt % XSTAGES
                mbarrier.expect(x_ready.index(xn), x_desc.block_type.nbytes)
                _tma_load(x_desc, [off_m, (t_lo + nxt) * BK], x_ready.index(xn), x_smem.index(xn))
        xs = j % XSTAGES
        mbarrier.wait(x_ready.index(xs), (j // XSTAGES) & 1)
        acc = warpgroup_mma(buf, x_smem.index(xs).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if num_warps == 4:  # one warp group: its wait retired tile j - 1's wgmma, the only reader of that buffer
            nxt = j + XSTAGES - 1
            if nxt < n_tiles:
                xn = nxt % XSTAGES
                mbarrier.expect(x_ready.index(xn), x_desc.block_type.nbytes)
                _tma_load(x_desc, [off_m, (t_lo + nxt) * BK], x_ready.index(xn), x_smem.index(xn))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for i in gl.static_range(XSTAGES):
        mbarrier.invalidate(x_ready.index(i))
    for i in gl.static_range(QSTAGES):
        mbarrier.invalidate(q_ready.index(i))

    if INT8:  # the per-channel scale, in fp32 on the accumulator
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
        acc = acc * gl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[:, None]
    _store_acc(acc, out_ptr, part_ptr, count_ptr, off_n, off_m, M, N, SPLIT_K, stride_om,
               gl.program_id(1) * gl.num_programs(0) + gl.program_id(0), gl.program_id(2), off_m * N + off_n, M * N, N,
               BLOCK_N, BLOCK_M, num_warps)
