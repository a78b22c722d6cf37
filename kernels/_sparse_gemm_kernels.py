"""2:4 weights times more than 8 rows of ``x`` on sparse tensor cores (``mma.sp``), written in Gluon.

Imported lazily, like ``_sparse_mma_kernels`` (see [Note: lazy triton] in ``_runtime``); only on an sm_80+ GPU with a
Triton that has Gluon (``_sparse_mma.sparse_mma_possible``).

[Note: 2:4 GEMM on sparse tensor cores] The 2:4 GEMV ([Note: 2:4 GEMV on sparse tensor cores] in
``_sparse_mma_kernels``) puts up to 8 rows of ``x`` on the ``N`` side of ``mma.sp.m16n8k32`` and keeps its slice of
``x`` in registers. Past 8 rows the 2:4 formats fell back to the generic split-K Triton path (0.7-0.9x of bf16 at 16
to 64 rows, H100, kernels runs 124-126), though their weight bytes still dominate there. This kernel keeps the
GEMV's weight side (16 weight rows per warp on the MMA's ``M`` side, the stored values and positions handed to the
instruction as they are, [Note: block order]) and changes the ``x`` side:

- a program owns one block of ``16 * num_warps`` weight rows, ``NT`` groups of 8 rows of ``x`` (one ``mma.sp`` per
  group and 32-column tile) and a slice of ``K`` that it walks in chunks of ``KT`` tiles, summing in registers; so
  at 64 rows a program reads its weights once and needs few slices (split-K partials of 64 rows cost 4 bytes per
  row each, against 1.25 bytes per weight per weight row);
- each chunk of ``x`` (``8 * NT`` rows x ``32 * KT`` columns) is staged in shared memory in fragment order: for
  every group, pair of tiles and tile, the 32 lanes' four ``B`` registers lie side by side, so a warp reads 512
  contiguous bytes per ``(group, pair, tile)`` (16-byte loads, no bank conflicts) and every warp reads the same
  chunk; two buffers, one barrier per chunk;
- the next chunk's weights (``DEPTH`` 1) and ``x`` are loaded into registers while this chunk multiplies.

Groups past ``M`` read zero rows of ``x`` (their sums are not stored); tiles past ``K`` and rows past ``N`` as in
the GEMV. Slices meet as there ([Note: split-K fix-up] in ``_word``): each (group of ``x`` rows, block of weight rows)
has its own counter, and its last slice sums the partials of its rows of ``x``. More than ``8 * NT`` rows run as
several groups of programs on the grid's first axis, so the programs that share a block of weights run together and
all but the first read it from L2.

Measured on an H100 (benchmarks/RESULTS.md, kernels runs 141 and 143): at 16 rows 1.05-1.24x of bf16 for plain 2:4
and 1.13-1.31x for 2:4 + INT4, at 32 rows 0.77-1.12x and 0.78-0.93x, where split-K ran 0.73-0.86x and 0.50-0.57x. From
64 rows it loses to split-K (0.49-0.70x): its time grows with the rows, since each warp reads every group's ``B``
from shared memory for its own 16 weight rows, sums the pairs' MMAs with FADDs and gathers its share of ``x`` in
4-byte loads (422 instructions a warp for a chunk of 32 ``mma.sp``, 212 registers, 8 warps an SM). So the policy
(``KernelPolicy.sparse_gemm_max_m``) sends it 9 to 32 rows.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._sparse_mma_kernels import (_ASM_IO, _ASM_PAIR, _ASM_W4_IO, _ASM_W4_PAIR, _along3, _along4, _cta_barrier,
                                  _meta_index,
                                  _meta_regs, _store_sums, finish_run)


@gluon.jit
def _along5(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along ``dim`` of a 5-D tensor in ``layout`` (size 1 on the other axes)."""
    if dim == 0:
        return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
            4, layout)))))[:, None, None, None, None]
    elif dim == 1:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
            4, layout)))))[None, :, None, None, None]
    elif dim == 2:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(
            4, layout)))))[None, None, :, None, None]
    elif dim == 3:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            4, layout)))))[None, None, None, :, None]
    else:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            3, layout)))))[None, None, None, None, :]


@gluon.jit
def _program(NT: gl.constexpr, ROWS: gl.constexpr):
    """This program's (group of x rows, block of weight rows, slice) and its first row of ``x`` and of weights."""
    pid_m = gl.program_id(0)
    pid_r = gl.program_id(1)
    return pid_m, pid_r, gl.program_id(2), pid_m * (8 * NT), pid_r * ROWS


@gluon.jit
def _x_chunk(x_ptr, M, TILES, stride_xm, m0, tile0, q, lane, pair, half, r):
    """``x`` in fragment order, for broadcastable index tensors: group ``q``, lane ``4g + t``, pair of tiles ``pair``,
    tile ``2 pair + half`` from ``tile0``, ``B`` register ``r``: row ``m0 + 8q + g`` of ``x``, the stored columns of
    logical block ``t // 2 + 2r`` ([Note: block order] in ``_sparse_mma_kernels``), as int32 pairs."""
    g = lane // 4
    t = lane % 4
    tile = tile0 + 2 * pair + half
    blk = t // 2 + 2 * r
    row = m0 + 8 * q + g
    col = tile * 16 + 2 * (2 * (blk % 4) + blk // 4) + t % 2
    return gl.load(x_ptr + row * stride_xm + col, mask=(row < M) & (tile < TILES), other=0)


@gluon.jit
def _stage_x(x_ptr, M, TILES, stride_xm, m0, tile0, KT: gl.constexpr, NT: gl.constexpr, LS: gl.constexpr):
    """One chunk of ``x`` as ``(NT, 32, KT / 2, 2, 4)``: group, lane, pair, tile of the pair, register."""
    return _x_chunk(x_ptr, M, TILES, stride_xm, m0, tile0, _along5(NT, 0, LS), _along5(32, 1, LS),
                    _along5(KT // 2, 2, LS), _along5(2, 3, LS), _along5(4, 4, LS))


@gluon.jit
def _stage_x_w4(x_ptr, M, TILES, stride_xm, m0, tile0, KT: gl.constexpr, NT: gl.constexpr, LS: gl.constexpr):
    """One chunk of ``x`` as four planes, one per ``B`` register (as the 2:4 + INT4 kernel takes them), each
    ``(NT, 32, KT / 2, 2)``: group, lane, pair, tile of the pair."""
    q = _along4(NT, 0, LS)
    lane = _along4(32, 1, LS)
    pair = _along4(KT // 2, 2, LS)
    half = _along4(2, 3, LS)
    return (_x_chunk(x_ptr, M, TILES, stride_xm, m0, tile0, q, lane, pair, half, 0),
            _x_chunk(x_ptr, M, TILES, stride_xm, m0, tile0, q, lane, pair, half, 1),
            _x_chunk(x_ptr, M, TILES, stride_xm, m0, tile0, q, lane, pair, half, 2),
            _x_chunk(x_ptr, M, TILES, stride_xm, m0, tile0, q, lane, pair, half, 3))


@gluon.jit
def sparse_gemm_kernel(x_ptr, w_ptr, meta_ptr, part_ptr, count_ptr, out_ptr, M, N, TILES, SPLIT, CHUNKS, RUNS,
                       stride_xm, stride_wn, stride_mn, stride_om, KT: gl.constexpr, NT: gl.constexpr,
                       DEPTH: gl.constexpr, PARTIAL: gl.constexpr, FIX_K: gl.constexpr, num_warps: gl.constexpr):
    """``out[M, N] = x @ densify(values, meta)^T`` for up to ``8 * NT`` rows of ``x`` per program ([Note: 2:4 GEMM
    on sparse tensor cores]); operands as ``sparse_mma_kernel``. Grid ``(groups of 8 * NT rows of x, RUNS blocks of
    16 * num_warps weight rows, SPLIT slices)``; a slice is ``CHUNKS`` chunks of ``KT`` tiles (even)."""
    # axes: warp, lane, group of x rows, pair of tiles, tile of the pair, register
    L6: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, NT, KT // 2, 2, 4], threads_per_warp=[1, 32, 1, 1, 1, 1],
                                        warps_per_cta=[num_warps, 1, 1, 1, 1, 1], order=[5, 4, 3, 2, 1, 0])
    A5: gl.constexpr = gl.SliceLayout(2, L6)  # one group's operands: A, B, the pair sums
    M3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, A5))  # one value per pair of tiles: the metadata
    O4: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(3, L6))  # the sums: (warp, lane, group, register)
    # staging: (group, lane, pair, tile of the pair, register), the warps over the groups, then the pairs
    WQ: gl.constexpr = NT if NT < num_warps else num_warps
    LS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 2, 4], threads_per_warp=[1, 32, 1, 1, 1],
                                        warps_per_cta=[WQ, 1, num_warps // WQ, 1, 1], order=[4, 3, 2, 1, 0])
    # fragment order in shared memory: register, lane, tile of the pair, pair, group (the buffer outermost)
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [4, 1, 3, 2, 0])
    ROWS: gl.constexpr = 16 * num_warps
    pid_m, pid_r, pid_k, m0, row0 = _program(NT, ROWS)

    warp = _along5(num_warps, 0, A5)
    lane = _along5(32, 1, A5)
    g = lane // 4
    t = lane % 4
    pair = _along5(KT // 2, 2, A5)
    half = _along5(2, 3, A5)
    r = _along5(4, 4, A5)
    a_row = row0 + 16 * warp + g + 8 * (r // 2)
    a_rmask = a_row < N
    a_ptrs = w_ptr + a_row * stride_wn + 2 * t + r % 2

    xs = gl.allocate_shared_memory(gl.int32, [2, NT, 32, KT // 2, 2, 4], SL)
    chunk0 = pid_k * CHUNKS
    tile0 = chunk0 * KT
    xr = _stage_x(x_ptr, M, TILES, stride_xm, m0, tile0, KT, NT, LS)
    tile = tile0 + 2 * pair + half
    a = gl.load(a_ptrs + tile * 8, mask=a_rmask & (tile < TILES), other=0)
    m_row, m_tile, m_live, m_shift = _meta_index(chunk0, TILES, KT, num_warps, M3)
    e = _meta_regs(meta_ptr, row0, m_row, m_tile, m_live, m_shift, N, stride_mn)

    acc = gl.zeros([num_warps, 32, NT, 4], gl.float32, O4)
    group = _along4(NT, 2, O4)
    for c in range(CHUNKS):
        buf = c % 2
        xs.index(buf).store(xr)
        _cta_barrier()  # the chunk staged; and every warp done with the buffer staged two chunks ago
        nxt = tile0 + (c + 1) * KT
        if c + 1 < CHUNKS:  # the next chunk's x in flight while this one multiplies
            xr = _stage_x(x_ptr, M, TILES, stride_xm, m0, nxt, KT, NT, LS)
        if DEPTH == 1:
            tile_n = nxt + 2 * pair + half
            a_n = gl.load(a_ptrs + tile_n * 8, mask=a_rmask & (tile_n < TILES) & (c + 1 < CHUNKS), other=0)
            mr, mt, ml, ms = _meta_index(chunk0 + c + 1, TILES, KT, num_warps, M3)
            e_n = _meta_regs(meta_ptr, row0, mr, mt, ml & (c + 1 < CHUNKS), ms, N, stride_mn)
        e5 = gl.broadcast(gl.expand_dims(gl.expand_dims(e, 3), 4), a)[0]
        xb = xs.index(buf)
        for q in gl.static_range(NT):
            b = xb.slice(q, 1).load(A5)  # (1, lane, pair, tile, register): the same in every warp
            d = gl.inline_asm_elementwise(_ASM_PAIR, _ASM_IO, [a, gl.broadcast(b, a)[0], e5], dtype=gl.float32,
                                          is_pure=True, pack=8)
            sums, _ = gl.split(gl.permute(d, (0, 1, 2, 4, 3)))  # a pack's slots 0-3 (4-7 are zero)
            # this group's sums over the pairs of tiles: (warp, lane, 1, register)
            s = gl.expand_dims(gl.convert_layout(gl.sum(sums, axis=2), gl.SliceLayout(2, O4)), 2)
            acc += gl.where(group == q, s, 0.0)
        if DEPTH == 1:
            a = a_n
            e = e_n
        else:
            tile_n = nxt + 2 * pair + half
            a = gl.load(a_ptrs + tile_n * 8, mask=a_rmask & (tile_n < TILES) & (c + 1 < CHUNKS), other=0)
            mr, mt, ml, ms = _meta_index(chunk0 + c + 1, TILES, KT, num_warps, M3)
            e = _meta_regs(meta_ptr, row0, mr, mt, ml & (c + 1 < CHUNKS), ms, N, stride_mn)

    # slot j of lane 4g + t, group q: weight row g + 8 (j // 2), row 8q + 2t + j % 2 of x
    lane_o = _along4(32, 1, O4)
    j_o = _along4(4, 3, O4)
    o_row = row0 + 16 * _along4(num_warps, 0, O4) + lane_o // 4 + 8 * (j_o // 2)
    o_m = m0 + 8 * group + 2 * (lane_o % 4) + j_o % 2
    o_live = (o_m < M) & (o_row < N)
    _store_sums(acc, out_ptr, part_ptr, o_row, o_m, o_live, N, SPLIT, pid_k, stride_om, PARTIAL)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_m * RUNS + pid_r, row0, m0, gl.minimum(M, m0 + 8 * NT), N,
                   SPLIT, stride_om, ROWS, FIX_K, num_warps)


@gluon.jit
def _w4_operands(w_ptr, meta_ptr, s_ptr, z_ptr, N, TILES, stride_wn, stride_mn, stride_sn, stride_zn, row0, base, more,
                 ra, t, pair, half, m_row, m_tile, m_shift, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr):
    """The weight side of the chunk from tile ``base`` (nothing read where ``more`` is false): codes of rows ``g``
    (low half) and ``g + 8`` (high), metadata registers, ``-(128 + zero)`` of both rows and the pairs' scales."""
    tile = base + 2 * pair + half
    live = (tile < TILES) & more
    lo_mask = (ra < N) & live
    hi_mask = (ra + 8 < N) & live
    lo = gl.load(w_ptr + ra * stride_wn + tile * 4 + t, mask=lo_mask, other=0).to(gl.int32) & 0xFFFF
    hi = gl.load(w_ptr + (ra + 8) * stride_wn + tile * 4 + t, mask=hi_mask, other=0).to(gl.int32)
    codes = lo | (hi << 16)
    mt = m_tile + base
    e = _meta_regs(meta_ptr, row0, m_row, mt, (mt < TILES) & more, m_shift, N, stride_mn)
    e4 = gl.broadcast(gl.expand_dims(e, 3), codes)[0]
    z_col = tile * 32 // GROUP
    if HAS_ZEROS:
        z0 = gl.load(z_ptr + ra * stride_zn + z_col, mask=lo_mask, other=0).to(gl.int32)
        z1 = gl.load(z_ptr + (ra + 8) * stride_zn + z_col, mask=hi_mask, other=0).to(gl.int32)
    else:
        z0 = gl.zeros_like(codes) + 8
        z1 = z0
    sr = row0 + m_row
    sp = mt - mt % 2  # the pair's first tile; both lie in one group (GROUP a multiple of 64)
    s_col = sp * 32 // GROUP
    s_live = (sp < TILES) & more
    s0 = gl.load(s_ptr + sr * stride_sn + s_col, mask=(sr < N) & s_live, other=0.0).to(gl.float32)
    s1 = gl.load(s_ptr + (sr + 8) * stride_sn + s_col, mask=(sr + 8 < N) & s_live, other=0.0).to(gl.float32)
    return codes, e4, (z0 | 0xC300) * 0x10001, (z1 | 0xC300) * 0x10001, gl.expand_dims(s0, 3), gl.expand_dims(s1, 3)


@gluon.jit
def sparse_gemm_w4_kernel(x_ptr, w_ptr, meta_ptr, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, TILES, SPLIT,
                          CHUNKS, RUNS, stride_xm, stride_wn, stride_mn, stride_sn, stride_zn, stride_om,
                          GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, KT: gl.constexpr, NT: gl.constexpr,
                          PARTIAL: gl.constexpr, FIX_K: gl.constexpr, num_warps: gl.constexpr):
    """2:4 + INT4 ``out[M, N] = x @ densify(dequant(codes), meta)^T`` for up to ``8 * NT`` rows of ``x`` per program
    ([Note: 2:4 GEMM on sparse tensor cores]; the weight side as ``sparse_mma_w4_kernel``, [Note: 2:4 + INT4 on
    sparse tensor cores]); grid and slices as :func:`sparse_gemm_kernel`; the next chunk's weight side is loaded
    after this one's MMAs."""
    # axes: warp, lane, group of x rows, pair of tiles, tile of the pair
    L5: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, NT, KT // 2, 2], threads_per_warp=[1, 32, 1, 1, 1],
                                        warps_per_cta=[num_warps, 1, 1, 1, 1], order=[4, 3, 2, 1, 0])
    A4: gl.constexpr = gl.SliceLayout(2, L5)  # one group's operands: codes, B registers, zero points
    M3: gl.constexpr = gl.SliceLayout(3, A4)  # one value per pair of tiles: metadata, scales
    O4: gl.constexpr = gl.SliceLayout(3, L5)  # the sums: (warp, lane, group, row 2t + k of x)
    WQ: gl.constexpr = NT if NT < num_warps else num_warps
    LS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 2], threads_per_warp=[1, 32, 1, 1],
                                        warps_per_cta=[WQ, 1, num_warps // WQ, 1], order=[3, 2, 1, 0])
    # shared memory, one allocation per B register: tile of the pair, lane, pair, group (the buffer outermost)
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 1, 2, 0])
    ROWS: gl.constexpr = 16 * num_warps
    pid_m, pid_r, pid_k, m0, row0 = _program(NT, ROWS)

    warp = _along4(num_warps, 0, A4)
    lane = _along4(32, 1, A4)
    t = lane % 4
    pair = _along4(KT // 2, 2, A4)
    half = _along4(2, 3, A4)
    ra = row0 + 16 * warp + lane // 4
    m_row, m_tile, m_live, m_shift = _meta_index(0, TILES, KT, num_warps, M3)  # m_tile: tiles from the chunk's first

    xs0 = gl.allocate_shared_memory(gl.int32, [2, NT, 32, KT // 2, 2], SL)
    xs1 = gl.allocate_shared_memory(gl.int32, [2, NT, 32, KT // 2, 2], SL)
    xs2 = gl.allocate_shared_memory(gl.int32, [2, NT, 32, KT // 2, 2], SL)
    xs3 = gl.allocate_shared_memory(gl.int32, [2, NT, 32, KT // 2, 2], SL)
    chunk0 = pid_k * CHUNKS
    tile0 = chunk0 * KT
    x0, x1, x2, x3 = _stage_x_w4(x_ptr, M, TILES, stride_xm, m0, tile0, KT, NT, LS)
    codes, e4, nz0, nz1, s0, s1 = _w4_operands(w_ptr, meta_ptr, s_ptr, z_ptr, N, TILES, stride_wn, stride_mn,
                                               stride_sn, stride_zn, row0, tile0, CHUNKS > 0, ra, t, pair, half,
                                               m_row, m_tile, m_shift, GROUP, HAS_ZEROS)
    acc0 = gl.zeros([num_warps, 32, NT, 2], gl.float32, O4)  # weight row g
    acc1 = gl.zeros([num_warps, 32, NT, 2], gl.float32, O4)  # weight row g + 8
    group = _along4(NT, 2, O4)
    for c in range(CHUNKS):
        buf = c % 2
        xb0 = xs0.index(buf)
        xb1 = xs1.index(buf)
        xb2 = xs2.index(buf)
        xb3 = xs3.index(buf)
        xb0.store(x0)
        xb1.store(x1)
        xb2.store(x2)
        xb3.store(x3)
        _cta_barrier()  # the chunk staged; and every warp done with the buffer staged two chunks ago
        nxt = tile0 + (c + 1) * KT
        if c + 1 < CHUNKS:  # the next chunk's x in flight while this one multiplies
            x0, x1, x2, x3 = _stage_x_w4(x_ptr, M, TILES, stride_xm, m0, nxt, KT, NT, LS)
        for q in gl.static_range(NT):  # each B register: (1, lane, pair, tile), the same in every warp
            b0 = gl.broadcast(xb0.slice(q, 1).load(A4), codes)[0]
            b1 = gl.broadcast(xb1.slice(q, 1).load(A4), codes)[0]
            b2 = gl.broadcast(xb2.slice(q, 1).load(A4), codes)[0]
            b3 = gl.broadcast(xb3.slice(q, 1).load(A4), codes)[0]
            d0, d1 = gl.inline_asm_elementwise(_ASM_W4_PAIR, _ASM_W4_IO, [codes, b0, b1, b2, b3, e4, nz0, nz1],
                                               dtype=(gl.float32, gl.float32), is_pure=True, pack=2)
            # this group's scaled sums over the pairs: (warp, lane, 1, row 2t + k of x)
            p0 = gl.expand_dims(gl.convert_layout(gl.sum(d0 * s0, axis=2), gl.SliceLayout(2, O4)), 2)
            p1 = gl.expand_dims(gl.convert_layout(gl.sum(d1 * s1, axis=2), gl.SliceLayout(2, O4)), 2)
            acc0 += gl.where(group == q, p0, 0.0)
            acc1 += gl.where(group == q, p1, 0.0)
        codes, e4, nz0, nz1, s0, s1 = _w4_operands(w_ptr, meta_ptr, s_ptr, z_ptr, N, TILES, stride_wn, stride_mn,
                                                   stride_sn, stride_zn, row0, nxt, c + 1 < CHUNKS, ra, t, pair, half,
                                                   m_row, m_tile, m_shift, GROUP, HAS_ZEROS)

    # slot k of lane 4g + t, group q: row 8q + 2t + k of x; acc0 weight row g, acc1 g + 8
    lane_o = _along4(32, 1, O4)
    o_row = row0 + 16 * _along4(num_warps, 0, O4) + lane_o // 4
    o_m = m0 + 8 * group + 2 * (lane_o % 4) + _along4(2, 3, O4)
    o_live = o_m < M
    _store_sums(acc0, out_ptr, part_ptr, o_row, o_m, o_live & (o_row < N), N, SPLIT, pid_k, stride_om, PARTIAL)
    _store_sums(acc1, out_ptr, part_ptr, o_row + 8, o_m, o_live & (o_row + 8 < N), N, SPLIT, pid_k, stride_om,
                PARTIAL)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_m * RUNS + pid_r, row0, m0, gl.minimum(M, m0 + 8 * NT), N,
                   SPLIT, stride_om, ROWS, FIX_K, num_warps)
