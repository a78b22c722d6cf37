"""Word-wise Triton kernels: weights read as int32 words, codes turned into floats by bit tricks.

Imported lazily, like ``_kernels`` (see [Note: lazy triton] in ``_runtime``).
The generic skeleton (``_kernels``) rebuilds a dense tile in column order with
``tl.interleave``, which costs shuffles, and reduces across threads every
iteration. These kernels instead keep a word's fields apart as *planes*: field
``j`` of every word in a tile is one ``(BLOCK_N, BLOCK_W)`` tensor, multiplied by
the matching strided slice of ``x`` (columns ``CPW * w + j``), so nothing is
permuted and the tile is reduced once, after the ``k`` loop.

``x`` arrives *plane-major* (``xp[m, j, w] = x[m, CPW * w + j]``, one small copy
per call made by the launcher): plane ``j`` of a tile is then one contiguous run
of ``x``, read with vector loads, instead of ``BLOCK_W`` scalar loads at stride
``CPW`` for every plane of every tile.

[Note: x layouts] A plane of ``x`` is a ``(BW,)`` vector broadcast over the
tile's rows; Triton may load it in a layout of its own and then redistribute it
through shared memory (with barriers) to match the weight tile, once per plane per
tile. The ``X2D`` variant loads it as a ``(BN, BW)`` tensor with a zero row stride
instead: more (cached) load instructions, no redistribution. Which wins depends
on the tile; the tuner times both. A third variant (``XNAT``) reads ``x`` in its
natural order at stride ``CPW``, which costs more load instructions but saves the
plane-major copy, a separate small kernel that matters when a decode step runs
hundreds of these matmuls; the tuner's timing includes that copy.

[Note: magic-number conversion]
``(bits & mask) | 0x4B000000`` read as fp32 is ``2^23 + field`` exactly when the
field is below ``2^23`` (0x4B000000 is 2^23; a 23-bit mantissa holds the rest).
Subtracting ``2^23`` (plus the zero point) gives the code as a float: one LOP3
and one FADD instead of a shift, a mask and a slow int-to-float conversion. A
field that is not at bit 0 comes out multiplied by ``2^shift``; that power of two
is divided out of the matching ``x`` slice (exact in fp32), so the shift is never
executed. INT8 codes are signed: xor-ing every byte with 0x80 makes them
``q + 128`` in ``0..255``. Fields above bit 15 are taken from ``word >> 16``
so that ``field * 2^shift`` stays below ``2^23``.

[Note: group scales] A tile of ``BW`` INT4 words that spans several quantization groups (the tensor-core
kernels' 128-column tiles at groups of 32 or 64 columns; 8 or 16 alike) needs a scale and a zero point per word.
They used to be gathered per word, a ``(BN, BW)`` load at ``(col0 + CPW * w) // GROUP``: every group's values
loaded ``GROUP / CPW`` times over, and, their addresses having no contiguity, in a layout of their own that the
dequantization then followed, so the dequantized tile went to shared memory in 16-bit stores instead of 128-bit
ones. ``_group_scale`` loads ``(BN, G)``, once per group, and spreads it to the words by a broadcast and a reshape
(``_per_word``); the compiler moves that small tensor into the words' layout through shared memory (a few stores
and loads, two barriers per tensor) and the dequantization keeps the words' layout. Compiled for sm_90 by Triton
3.6, the main loop of the g32 16 x 64 swap-AB tile with zero points, packed, went from 508 SASS instructions (16
scale and zero-point loads per thread, 64 16-bit shared stores) to 388 (4 loads, as at g128; 8 128-bit stores),
against 373 at g128; on the fp32 path from 739 to 547. The values are the same, so the results are bit for bit
those of before. It also let the packed dequantization take these tiles at groups of 16 to 64 columns: with
per-word scales its 64-row tiles crashed Triton 3.6's compiler ([Note: packed INT4 dequantization] in
``_wmma_kernels``), as they still do at groups of one word (8 columns; ``_word.packed_dequant``). Tiles inside one
group (32 or 64 columns at g32 / g64) were the alternative; per 128 columns they cost more (the same tile at 32
columns: 4 x 141 = 564 instructions), so the tuner offers none.

Word layouts (little-endian views of the packed tensors of ``_tiles``):
- FMT 0, INT8: a word is 4 columns, byte ``j`` = column ``4w + j``.
- FMT 1, INT4: a word is 8 columns, nibble ``j`` = column ``8w + j``.
- FMT 2, 2:4 bf16: a word is one 4-column block, its two kept values (low half
  first); positions from the uint8 metadata (a byte holds two blocks).
- FMT 3, 2:4 + INT4: a word is 4 blocks (16 columns), nibble ``2b + i`` = kept
  value ``i`` of block ``b``; the metadata as int16 holds the same 4 blocks.
"""
from __future__ import annotations

import triton
import triton.language as tl

MAGIC = 0x4B000000
TWO23 = 8388608.0


@triton.jit
def _as_float(bits):
    return (bits | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _x_plane(x_row, col0, offs_w, offs_n, CPW: tl.constexpr, j: tl.constexpr, K, X2D: tl.constexpr,
             XNAT: tl.constexpr = False):
    """Columns ``col0 + CPW * offs_w + j`` of one row of ``x``, read from its plane-major copy
    (``xp[j, w] = x[CPW * w + j]``, see ``_word.plane_major``): one contiguous run per plane.

    ``(1, BW)``, or with ``X2D`` ``(BN, BW)``: the same values loaded once per weight row, so the
    load gets the weight tile's own layout and nothing is redistributed between threads (the
    tuner picks whichever is faster, see [Note: x layouts])."""
    KW = K // CPW
    w = col0 // CPW + offs_w
    if XNAT:  # x in its natural order (no plane-major copy): stride-CPW loads
        ptrs = x_row + w[None, :] * CPW + j + 0 * offs_n[:, None]
        return tl.load(ptrs, mask=(w < KW)[None, :], other=0.0).to(tl.float32)
    elif X2D:
        ptrs = x_row + j * KW + w[None, :] + 0 * offs_n[:, None]
        return tl.load(ptrs, mask=(w < KW)[None, :], other=0.0).to(tl.float32)
    else:
        return tl.load(x_row + j * KW + w, mask=w < KW, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _group_scale(s_ptr, z_ptr, offs_n, nmask, col0, stride_sn, K, CPW: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_W: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Scale and zero point (fp32) of the words of the tile at column ``col0``: ``(BN, 1)`` if the tile lies in one
    group, else ``(BN, BW)``, loaded once per group and spread to the group's words ([Note: group scales]); without
    zero points ``z`` is 8, ``(1, 1)``."""
    if BLOCK_W * CPW <= GROUP:
        g = col0 // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)[:, None]
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=nmask, other=0).to(tl.float32)[:, None]
        else:
            z = tl.full((1, 1), 8.0, tl.float32)
    else:
        g = col0 // GROUP + tl.arange(0, BLOCK_W * CPW // GROUP)  # the tile's groups, (G,)
        ptrs = offs_n[:, None] * stride_sn + g[None, :]
        gmask = nmask[:, None] & (g * GROUP < K)[None, :]  # a partial last tile reads no scale past the row
        s = _per_word(tl.load(s_ptr + ptrs, mask=gmask, other=0.0).to(tl.float32), CPW, GROUP, BLOCK_W)
        if HAS_ZEROS:
            z = _per_word(tl.load(z_ptr + ptrs, mask=gmask, other=0).to(tl.float32), CPW, GROUP, BLOCK_W)
        else:
            z = tl.full((1, 1), 8.0, tl.float32)
    return s, z


@triton.jit
def _per_word(v, CPW: tl.constexpr, GROUP: tl.constexpr, BLOCK_W: tl.constexpr):
    """Per-group values ``(BN, G)`` of a tile spanning ``G`` whole groups, spread to its words: ``(BN, BW)``, word
    ``w`` taking group ``w // (GROUP // CPW)``'s value ([Note: group scales])."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (v.shape[0], BLOCK_W * CPW // GROUP, GROUP // CPW)),
                      (v.shape[0], BLOCK_W))


@triton.jit
def _gemv_tile(w, x_row, col0, offs_w, offs_n, nmask, s_ptr, z_ptr, meta_ptr, stride_sn, stride_mn, K,
               FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_W: tl.constexpr, X2D: tl.constexpr, XNAT: tl.constexpr):
    """This tile's contribution ``(BN, BW)`` to the output rows (INT8: unscaled)."""
    if FMT == 0:  # INT8: (q + 128) * 256^(j%2) after the xor, see [Note: magic-number conversion]
        u = w ^ -2139062144  # 0x80808080
        hi = u >> 16
        t = tl.zeros(w.shape, tl.float32)
        for j in tl.static_range(4):
            if j < 2:
                src = u
            else:
                src = hi
            f = _as_float(src & (0xFF << (8 * (j % 2)))) - (8388608.0 + 128.0 * (1 << (8 * (j % 2))))
            t += f * (_x_plane(x_row, col0, offs_w, offs_n, 4, j, K, X2D, XNAT) * (1.0 / (1 << (8 * (j % 2)))))
        return t
    elif FMT == 1:  # INT4: q * 16^(j%4); zero point through the sum of x
        hi = w >> 16
        t = tl.zeros(w.shape, tl.float32)
        if X2D:
            xs = tl.zeros((BLOCK_N, BLOCK_W), tl.float32)
        else:
            xs = tl.zeros((1, BLOCK_W), tl.float32)
        for j in tl.static_range(8):
            if j < 4:
                src = w
            else:
                src = hi
            xj = _x_plane(x_row, col0, offs_w, offs_n, 8, j, K, X2D, XNAT)
            if HAS_ZEROS:
                f = _as_float(src & (0xF << (4 * (j % 4)))) - 8388608.0
                xs += xj
            else:
                f = _as_float(src & (0xF << (4 * (j % 4)))) - (8388608.0 + 8.0 * (1 << (4 * (j % 4))))
            t += f * (xj * (1.0 / (1 << (4 * (j % 4)))))
        return _by_group(t, xs, s_ptr, z_ptr, offs_n, nmask, col0, stride_sn, K, 8, GROUP, HAS_ZEROS,
                         BLOCK_N, BLOCK_W)
    elif FMT == 2:  # 2:4 bf16: kept values v0, v1 of block w at positions p0 < p1
        v0 = (w << 16).to(tl.float32, bitcast=True)
        v1 = (w & -65536).to(tl.float32, bitcast=True)
        mb = tl.load(meta_ptr + offs_n[:, None] * stride_mn + (col0 // 8 + offs_w // 2)[None, :],
                     mask=nmask[:, None] & (col0 + offs_w * 4 < K)[None, :], other=0).to(tl.int32)
        m4 = (mb >> (4 * (offs_w % 2))[None, :]) & 0xF
        p0 = m4 & 3
        p1 = m4 >> 2
        x0 = _x_plane(x_row, col0, offs_w, offs_n, 4, 0, K, X2D, XNAT)
        x1 = _x_plane(x_row, col0, offs_w, offs_n, 4, 1, K, X2D, XNAT)
        x2 = _x_plane(x_row, col0, offs_w, offs_n, 4, 2, K, X2D, XNAT)
        x3 = _x_plane(x_row, col0, offs_w, offs_n, 4, 3, K, X2D, XNAT)
        xa = tl.where(p0 == 0, x0, tl.where(p0 == 1, x1, x2))  # sorted positions: p0 <= 2, p1 >= 1
        xb = tl.where(p1 == 3, x3, tl.where(p1 == 2, x2, x1))
        return v0 * xa + v1 * xb
    else:  # 2:4 + INT4: kept value i of block b is nibble 2b + i; positions in the int16 metadata word
        mw = tl.load(meta_ptr + offs_n[:, None] * stride_mn + (col0 // 16 + offs_w)[None, :],
                     mask=nmask[:, None] & (col0 + offs_w * 16 < K)[None, :], other=0).to(tl.int32)
        t = tl.zeros(w.shape, tl.float32)
        xs = tl.zeros(w.shape, tl.float32)
        for b in tl.static_range(4):
            x0 = _x_plane(x_row, col0, offs_w, offs_n, 16, 4 * b + 0, K, X2D, XNAT)
            x1 = _x_plane(x_row, col0, offs_w, offs_n, 16, 4 * b + 1, K, X2D, XNAT)
            x2 = _x_plane(x_row, col0, offs_w, offs_n, 16, 4 * b + 2, K, X2D, XNAT)
            x3 = _x_plane(x_row, col0, offs_w, offs_n, 16, 4 * b + 3, K, X2D, XNAT)
            p0 = (mw >> (4 * b)) & 3
            p1 = (mw >> (4 * b + 2)) & 3
            xa = tl.where(p0 == 0, x0, tl.where(p0 == 1, x1, x2))
            xb = tl.where(p1 == 3, x3, tl.where(p1 == 2, x2, x1))
            if HAS_ZEROS:
                f0 = _as_float((w >> (8 * b)) & 0xF) - 8388608.0
                f1 = _as_float((w >> (8 * b + 4)) & 0xF) - 8388608.0
                xs += xa + xb
            else:
                f0 = _as_float((w >> (8 * b)) & 0xF) - 8388616.0  # 2^23 + 8
                f1 = _as_float((w >> (8 * b + 4)) & 0xF) - 8388616.0
            t += f0 * xa + f1 * xb
        return _by_group(t, xs, s_ptr, z_ptr, offs_n, nmask, col0, stride_sn, K, 16, GROUP, HAS_ZEROS, BLOCK_N,
                         BLOCK_W)


@triton.jit
def _by_group(t, xs, s_ptr, z_ptr, offs_n, nmask, col0, stride_sn, K, CPW: tl.constexpr, GROUP: tl.constexpr,
              HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Scale (and zero-correct) a tile's products ``t`` ``(BN, BW)`` per group.

    ``xs``: the sums of ``x`` that met each code (broadcastable to ``t``), for the
    zero point: ``sum((q - z) x) = sum(q x) - z sum(x)``. A tile inside one group
    keeps its shape ``(BN, BW)``; a tile spanning several groups is summed per
    group first and returns ``(BN, groups in the tile)`` (see ``acc_width``)."""
    if BLOCK_W * CPW <= GROUP:
        g = col0 // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)[:, None]
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=nmask, other=0).to(tl.float32)[:, None]
            t = t - z * xs
        return t * s
    else:
        tg = tl.sum(tl.reshape(t, (BLOCK_N, BLOCK_W * CPW // GROUP, GROUP // CPW)), axis=2)
        g = col0 // GROUP + tl.arange(0, BLOCK_W * CPW // GROUP)
        ptrs = offs_n[:, None] * stride_sn + g[None, :]
        gmask = nmask[:, None] & (g * GROUP < K)[None, :]  # a partial last tile reads no scale past the row
        s = tl.load(s_ptr + ptrs, mask=gmask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + ptrs, mask=gmask, other=0).to(tl.float32)
            xs2 = tl.broadcast_to(xs, (BLOCK_N, BLOCK_W))
            tg = tg - z * tl.sum(tl.reshape(xs2, (BLOCK_N, BLOCK_W * CPW // GROUP, GROUP // CPW)), axis=2)
        return tg * s


@triton.jit
def _load_words(w_ptr, offs_n, N, t, t_hi, KW, stride_wn, BLOCK_W: tl.constexpr, EVEN_W: tl.constexpr):
    """Tile ``t`` of the words of rows ``offs_n`` (zeros once ``t`` reaches ``t_hi``). The mask is
    per row only (a row limit of 0 past the end), so the loads stay vectorized."""
    offs_w = t * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (offs_n < tl.where(t < t_hi, N, 0))[:, None]
    if not EVEN_W:
        mask = mask & (offs_w < KW)[None, :]
    return tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :], mask=mask, other=0)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, meta_ptr, out_ptr, M, N, K, KW, SPLIT_K,
                stride_xm, stride_wn, stride_sn, stride_mn, stride_om,
                FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, ATOMIC: tl.constexpr,
                CPW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_W: tl.constexpr,
                ACC_W: tl.constexpr, PREFETCH: tl.constexpr, X2D: tl.constexpr, XNAT: tl.constexpr):
    """One row of ``x`` against ``BLOCK_N`` weight rows over one of ``SPLIT_K`` slices of the words.

    Grid ``(M, cdiv(N, BLOCK_N), SPLIT_K)``, the row fastest: the programs reading
    one weight tile run together and share it in L2."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    n_tiles = tl.cdiv(KW, BLOCK_W)
    per_split = tl.cdiv(n_tiles, SPLIT_K)
    t_lo = pid_k * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)
    x_row = x_ptr + pid_m * stride_xm
    acc = tl.zeros((BLOCK_N, ACC_W), tl.float32)
    # [Note: register prefetch] Triton does not pipeline loads that feed no tl.dot, and
    # one tile per program in flight leaves HBM idle while the tile is computed: the
    # next PREFETCH tiles are loaded before this one is used.
    if PREFETCH > 0:
        w_a = _load_words(w_ptr, offs_n, N, t_lo, t_hi, KW, stride_wn, BLOCK_W, EVEN_W)
    if PREFETCH == 2:
        w_b = _load_words(w_ptr, offs_n, N, t_lo + 1, t_hi, KW, stride_wn, BLOCK_W, EVEN_W)
    for t in range(t_lo, t_hi):
        if PREFETCH == 0:
            w = _load_words(w_ptr, offs_n, N, t, t_hi, KW, stride_wn, BLOCK_W, EVEN_W)
        elif PREFETCH == 1:
            w = w_a
            w_a = _load_words(w_ptr, offs_n, N, t + 1, t_hi, KW, stride_wn, BLOCK_W, EVEN_W)
        else:
            w = w_a
            w_a = w_b
            w_b = _load_words(w_ptr, offs_n, N, t + 2, t_hi, KW, stride_wn, BLOCK_W, EVEN_W)
        acc += _gemv_tile(w, x_row, t * BLOCK_W * CPW, tl.arange(0, BLOCK_W), offs_n, nmask, s_ptr, z_ptr,
                          meta_ptr, stride_sn, stride_mn, K, FMT, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_W, X2D, XNAT)
    out = tl.sum(acc, axis=1)
    if FMT == 0:
        out *= tl.load(s_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    optrs = out_ptr + pid_m * stride_om + offs_n
    if ATOMIC:
        tl.atomic_add(optrs, out, mask=nmask)
    else:
        tl.store(optrs, out.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _mma_program(M, N, KW, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """A tensor-core program's rows of ``x``, weight rows, their masks and its tiles of words ``[t_lo, t_hi)``:
    grid ``(cdiv(M, BM), cdiv(N, BN), SPLIT_K)``, the ``K`` tiles split evenly over axis 2."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_tiles = tl.cdiv(KW, BLOCK_W)
    per_split = tl.cdiv(n_tiles, SPLIT_K)
    t_lo = tl.program_id(2) * per_split
    return offs_m, offs_n, offs_m < M, offs_n < N, t_lo, tl.minimum(t_lo + per_split, n_tiles)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def wdot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, KW, SPLIT_K,
                stride_xm, stride_wn, stride_sn, stride_om,
                FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, ATOMIC: tl.constexpr,
                DOT_F32: tl.constexpr, CPW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_W: tl.constexpr, EVEN_W: tl.constexpr):
    """INT8 / INT4 GEMM on tensor cores: each field plane, dequantized in registers (rounded to the
    input dtype exactly as the reference rounds the dense weight), is one ``tl.dot`` of depth
    ``BLOCK_W`` with the matching strided columns of ``x``. Grid ``(cdiv(M, BM), cdiv(N, BN), SPLIT_K)``."""
    offs_m, offs_n, mmask, nmask, t_lo, t_hi = _mma_program(M, N, KW, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_W)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for t in range(t_lo, t_hi):
        offs_w = t * BLOCK_W + tl.arange(0, BLOCK_W)
        wmask = offs_w < KW
        if EVEN_W:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :], mask=nmask[:, None], other=0)
        else:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :], mask=nmask[:, None] & wmask[None, :],
                        other=0)
        col0 = t * BLOCK_W * CPW
        if FMT == 0:
            src_lo = w ^ -2139062144
        else:
            src_lo = w
            s, z = _group_scale(s_ptr, z_ptr, offs_n, nmask, col0, stride_sn, K, 8, GROUP, BLOCK_W, HAS_ZEROS)
        src_hi = src_lo >> 16
        for j in tl.static_range(CPW):
            if j < CPW // 2:
                src = src_lo
            else:
                src = src_hi
            if FMT == 0:
                p = 1 << (8 * (j % 2))
                plane = (_as_float(src & (0xFF << (8 * (j % 2)))) - (8388608.0 + 128.0 * p)) * (1.0 / p)
            else:
                p = 1 << (4 * (j % 4))
                plane = (_as_float(src & (0xF << (4 * (j % 4)))) - (8388608.0 + z * p)) * (s * (1.0 / p))
            xmask = mmask[:, None] & wmask[None, :]  # x: plane-major, xp[m, j, w] = x[m, CPW * w + j]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + j * KW + offs_w[None, :], mask=xmask, other=0.0)
            if DOT_F32:
                acc = tl.dot(x.to(tl.float32), tl.trans(plane.to(x.dtype).to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(plane.to(x.dtype)), acc)
    _mma_store(acc, out_ptr, s_ptr, offs_m, offs_n, mmask, nmask, stride_om, FMT, ATOMIC)


@triton.jit
def _channel_scaled(acc, s_ptr, offs_n, nmask, FMT: tl.constexpr):
    """INT8: a ``(BM, BN)`` accumulator times its per-channel scales (INT4 tiles are scaled in the dequantization)."""
    if FMT == 0:
        acc *= tl.load(s_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _mma_store(acc, out_ptr, s_ptr, offs_m, offs_n, mmask, nmask, stride_om, FMT: tl.constexpr,
               ATOMIC: tl.constexpr):
    """Store a ``(BM, BN)`` fp32 accumulator (INT8: times the per-channel scale): fp32 atomics into a zeroed
    buffer where ``K`` is split, else in the output's dtype."""
    acc = _channel_scaled(acc, s_ptr, offs_n, nmask, FMT)
    optrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if ATOMIC:
        tl.atomic_add(optrs, acc, mask=omask)
    else:
        tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _mma_fixup(acc, part_ptr, count_ptr, out_ptr, s_ptr, offs_m, offs_n, mmask, nmask, M, N, SPLIT_K, stride_om,
               FMT: tl.constexpr):
    """Where ``K`` is split, without atomics into a zeroed buffer ([Note: split-K fix-up]): store this split's
    ``(BM, BN)`` partial (INT8: scaled), count the split done, and the last split of the tile sums the partials
    in split order into the output, in its dtype, and resets the tile's counter."""
    acc = _channel_scaled(acc, s_ptr, offs_n, nmask, FMT)
    omask = mmask[:, None] & nmask[None, :]
    tile = offs_m[:, None] * N + offs_n[None, :]
    tl.store(part_ptr + tl.program_id(2) * M * N + tile, acc, mask=omask)
    tl.debug_barrier()
    counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT_K - 1:
        total = tl.zeros(acc.shape, tl.float32)
        for k0 in range(0, SPLIT_K, 2):  # two partials in flight per L2 round trip
            first = tl.load(part_ptr + k0 * M * N + tile, mask=omask, other=0.0, cache_modifier=".cg")
            more = (tl.zeros_like(tile) + k0 + 1) < SPLIT_K
            second = tl.load(part_ptr + (k0 + 1) * M * N + tile, mask=omask & more, other=0.0, cache_modifier=".cg")
            total += first
            total += second
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=omask)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
