"""2:4 weights times more than 8 rows of ``x`` on sparse tensor cores (``mma.sp``), written in Gluon.

Imported lazily, like ``_sparse_mma_kernels`` (see [Note: lazy triton] in ``_runtime``); only on an sm_80+ GPU with a
Triton that has Gluon (``_sparse_mma.sparse_mma_possible``).

[Note: 2:4 GEMM on sparse tensor cores] The 2:4 GEMV ([Note: 2:4 GEMV on sparse tensor cores] in
``_sparse_mma_kernels``) puts up to 8 rows of ``x`` on the ``N`` side of ``mma.sp.m16n8k32`` and keeps its slice of
``x`` in registers. Past 8 rows the 2:4 formats fell back to the generic split-K Triton path (0.5-0.9x of bf16 at 16
to 64 rows, H100, kernels run 124), though their weight bytes still dominate there. This kernel, for plain 2:4 and 2:4
+ INT4 alike, keeps the GEMV's weight side (16 weight rows per warp on the MMA's ``M`` side, the stored values and
positions handed to the instruction as they are, [Note: block order]) and changes the rest:

- a program owns ``16 * MT * num_warps`` weight rows (``MT`` blocks of 16 a warp), ``NT`` groups of 8 rows of ``x``
  (one ``mma.sp`` per block, group and 32-column tile) and a slice of ``K`` that it walks in chunks of ``KT`` tiles;
  so at 64 rows a program reads its weights once and needs few slices (split-K partials of 64 rows cost 4 bytes per
  row each, against 1.25 bytes per weight per weight row);
- with two blocks a warp, each ``B`` fragment read from shared memory feeds two ``mma.sp``, and ``x`` is staged once
  for twice the weight rows;
- a group's MMAs over a chunk run in one inline-asm call, chained through the accumulators (one per block, their
  MMAs alternating): the running sums go in as the first MMA's ``C`` and come out of the last (:func:`chain_asm`;
  the other slots of the pack are neither written nor read), so the loop has no FADD;
- each chunk of ``x`` (``8 * NT`` rows x ``32 * KT`` columns) is read in natural order, 16 bytes a load, renamed into
  fragment order in registers and staged in shared memory that way: for every group, pair of tiles and tile, the
  32 lanes' four ``B`` registers lie side by side, so a warp reads 512 contiguous bytes per ``(group, pair, tile)``
  (16-byte loads, no bank conflicts) and every warp reads the same chunk; two buffers, one barrier per chunk;
- 2:4 + INT4 turns each code byte into its bf16 weight once per chunk, before the groups' MMAs: ``code - zero``
  (exact) times the scale, rounded once, which is the weight the reference makes (so its scales must be bf16). Its
  weights are read in stripes of 4 tiles (2 for groups of 64 columns) as in the GEMV ([Note: INT4 stripes] in
  ``_sparse_mma_kernels``): a lane's codes of a pair of tiles and row are one 4-byte load, the stripe's positions of a
  row one 16-byte load gathered by byte permutes (:func:`stripe_meta_asm`), and ``x`` is staged in the stripe's block
  order;
- the next chunk's ``x`` and (``DEPTH`` 1) weights are loaded into registers while this chunk multiplies.

Groups past ``M`` read zero rows of ``x`` (their sums are not stored); tiles past ``K`` and rows past ``N`` as in
the GEMV. Slices meet as there ([Note: split-K fix-up] in ``_word``): each (group of ``x`` rows, block of weight rows)
has its own counter, and its last slice sums the partials of its rows of ``x``. More than ``8 * NT`` rows run as
several groups of programs on the grid's first axis, so the programs that share a block of weights run together and
all but the first read it from L2.

Measured on an H100 (benchmarks/RESULTS.md, kernels runs 141-149; bf16 in the same process): at 16 rows 1.09-1.44x
of bf16 for plain 2:4 and 1.12-1.30x for 2:4 + INT4, at 32 rows 0.89-1.34x and 0.94-1.13x, at 64 rows 0.66-1.06x and
0.63-0.85x, where split-K ran 0.73-0.86x, 0.50-0.57x and 0.67-0.79x. A chunk of 4 tiles x 8 groups is 7.1
instructions a ``mma.sp`` with two blocks a warp (plain 2:4; 2:4 + INT4 11.4); the first version (sums by FADD,
``x`` gathered 4 bytes at a time, INT4 dequantized once per group, one block a warp) took 13.2 (23.7). The cost per
weight byte still grows with the rows of ``x``: on 8192x8192 at 64 rows split-K stays 5-7 % ahead, and from 128 rows
it loses to cuSPARSELt (plain 2:4) and to dequantize + cuBLAS (2:4 + INT4). So the policy
(``KernelPolicy.sparse_gemm_max_m``) sends it 9 to 64 rows.
"""
from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._sparse_mma_kernels import (_MMA, _VALID, _along4, _cta_barrier, _meta_regs, _store_sums, finish_run,
                                  meta_gather, w4_codes)


@functools.cache
def chain_asm(kt: int, mt: int) -> tuple[str, str]:
    """One group's ``mma.sp`` over a whole chunk of ``kt`` tiles for ``mt`` blocks of 16 weight rows, chained through
    the accumulators: the pack is the chunk's ``4 kt mt`` fragment slots (block ``m``, pair ``p``, tile ``h`` of the
    pair, register ``r`` at ``4 kt m + 8p + 4h + r``); outputs: block ``m``'s new sums in its slots 0-3 (the other
    outputs are left unwritten and unread); inputs: ``A``, ``B`` (the same in every block: block 0's slots are read),
    the metadata (slot ``8p`` of each pair) and the sums so far (slots 0-3 of each block). The blocks' MMAs alternate,
    two independent chains. Outputs are early-clobber: they are written before the last inputs are read."""
    n = 4 * kt * mt
    a, b, e, c = n, 2 * n, 3 * n, 4 * n
    lines = ["{"]
    for tile in range(kt):
        p, h = divmod(tile, 2)
        for m in range(mt):
            o = 4 * kt * m
            i = o + 8 * p + 4 * h
            j = 8 * p + 4 * h
            acc = f"${o}, ${o + 1}, ${o + 2}, ${o + 3}" if tile else f"${c + o}, ${c + o + 1}, ${c + o + 2}, ${c + o + 3}"
            lines.append(f"{_MMA} {{${o}, ${o + 1}, ${o + 2}, ${o + 3}}}, {{${a + i}, ${a + i + 2}, ${a + i + 1}, "
                         f"${a + i + 3}}}, {{${b + j}, ${b + j + 1}, ${b + j + 2}, ${b + j + 3}}}, {{{acc}}}, "
                         f"${e + o + 8 * p}, 0x{h};")
    lines.append("}")
    return "\n".join(lines), ",".join(["=&f"] * n + ["r"] * (3 * n) + ["f"] * n)


@functools.cache
def stripe_meta_asm(stripe: int) -> tuple[str, str]:
    """2:4 + INT4 read in stripes ([Note: INT4 stripes] in ``_sparse_mma_kernels``): the metadata register of one
    pair of tiles, for ``pack=4``. ``$4``-``$7``: the stripe's position words of row ``g`` (the first ``stripe`` of them
    read), ``$8``-``$11`` of row ``g + 8``, ``$12`` the lane's tile of the stripe plus ``4 (t % 2)`` times 256. Out:
    the register, in all four slots."""
    lines = ["{", ".reg .b32 ts, n4, sel, u, v, xg, xh, m;", "and.b32 ts, $12, 0xFF;", "shr.b32 n4, $12, 8;"]
    lines += meta_gather(stripe, ["$4", "$5", "$6", "$7"], ["$8", "$9", "$10", "$11"], "m")
    lines += ["mov.b32 $0, m;", "mov.b32 $1, m;", "mov.b32 $2, m;", "mov.b32 $3, m;", "}"]
    return "\n".join(lines), ",".join(["=r"] * 4 + ["r"] * 12)


@gluon.jit
def _first(a, b):
    """A reduction's combine that keeps its first operand: reads one slot of a pack, in no instruction."""
    return a


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
def _along6(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along ``dim`` of a 6-D tensor in ``layout``, through :func:`_along5`."""
    if dim == 5:
        return gl.expand_dims(_along5(n, 4, gl.SliceLayout(0, layout)), 0)
    else:
        return gl.expand_dims(_along5(n, dim, gl.SliceLayout(5, layout)), 5)


@gluon.jit
def _along7(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along ``dim`` of a 7-D tensor in ``layout``, built up from :func:`_along5`."""
    L6: gl.constexpr = gl.SliceLayout(6, layout)
    if dim == 6:
        v = _along5(n, 4, gl.SliceLayout(0, gl.SliceLayout(0, layout)))
        return gl.expand_dims(gl.expand_dims(v, 0), 0)
    elif dim == 5:
        return gl.expand_dims(gl.expand_dims(_along5(n, 4, gl.SliceLayout(0, L6)), 0), 6)
    else:
        return gl.expand_dims(gl.expand_dims(_along5(n, dim, gl.SliceLayout(5, L6)), 5), 6)


@gluon.jit
def _stage_x(x_ptr, M, TILES, stride_xm, m0, tile0, KT: gl.constexpr, NT: gl.constexpr, LN: gl.constexpr,
             STRIPE: gl.constexpr):
    """One chunk of ``x`` as ``(NT, 32, KT / 2, 2, 4)``: group, lane, pair, tile of the pair, register. Read in natural
    order, 16 bytes a load, as ``(group, g, pair, tile of the pair, r % 2, t // 2, 4 int32)``: a tile's 16 int32
    columns are ``8 (r % 2) + 4 (t // 2) + 2 (r // 2) + t % 2`` for lane ``4g + t``'s ``B`` register ``r`` ([Note: block
    order] in ``_sparse_mma_kernels``); in stripes of ``STRIPE`` tiles ([Note: INT4 stripes]) the stripe's ``16 S``
    int32 columns are ``8 S (r % 2) + 4 S (t // 2) + 4s + 2 (r // 2) + t % 2`` for tile ``s`` of the stripe (``S`` 1:
    the tile-wise order). Then, in registers, the last axis is split as ``(r // 2, t % 2)`` and the axes are renamed
    into fragment order."""
    q = _along7(NT, 0, LN)
    g = _along7(8, 1, LN)
    tile = tile0 + 2 * _along7(KT // 2, 2, LN) + _along7(2, 3, LN)
    col = (tile // STRIPE) * (16 * STRIPE) + 4 * (tile % STRIPE) + 8 * STRIPE * _along7(2, 4, LN) \
        + 4 * STRIPE * _along7(2, 5, LN) + _along7(4, 6, LN)
    row = m0 + 8 * q + g
    v = gl.load(x_ptr + row * stride_xm + col, mask=(row < M) & (tile < TILES), other=0)
    v = gl.reshape(v, (NT, 8, KT // 2, 2, 2, 2, 2, 2))
    # (q, g, u = t // 2, t % 2, pair, tile, r // 2, r % 2): lane 4g + 2u + t % 2, register 2 (r // 2) + r % 2
    return gl.reshape(gl.permute(v, (0, 1, 5, 7, 2, 3, 6, 4)), (NT, 32, KT // 2, 2, 4))


def _dequant_asm() -> str:
    """2:4 + INT4 kept values into ``A`` registers, once per chunk: ``$4`` a tile's codes (rows ``g`` in the low 16
    bits, ``g + 8`` in the high; byte ``r`` is register ``r``'s block), ``$8``-``$11`` ``-(128 + zero)`` and
    ``$12``-``$15`` the scale, both in both bf16 halves, of register ``r``'s row. Byte ``r`` becomes the bf16 pair
    ``(128 + code, 128 + code')`` (a byte permute, a multiply by ``0x1001``, a LOP3 into ``0x4300``), then ``code -
    zero`` (exact) and that times the scale, rounded once: the bf16 weight that the reference makes."""
    lines = ["{", ".reg .b32 y, zr, one, mz;", "mov.b32 zr, 0;", "mov.b32 one, 0x3F803F80;", "mov.b32 mz, 0x80008000;"]
    for r in range(4):
        lines += [f"prmt.b32 y, $4, zr, 0x444{r};", "mul.lo.u32 y, y, 0x1001;",
                  "lop3.b32 y, y, 0x000F000F, 0x43004300, 0xEA;", f"fma.rn.bf16x2 y, y, one, ${8 + r};",
                  f"fma.rn.bf16x2 ${r}, y, ${12 + r}, mz;"]
    lines.append("}")
    return "\n".join(lines)


_DEQUANT = gl.constexpr(_dequant_asm())
_DEQUANT_IO = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 12))


@gluon.jit
def _weights(w_ptr, meta_ptr, s_ptr, z_ptr, N, TILES, stride_wn, stride_mn, stride_sn, stride_zn, row0, chunk, more,
             KT: gl.constexpr, MT: gl.constexpr, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, W4: gl.constexpr,
             STRIPE: gl.constexpr, META: gl.constexpr, META_IO: gl.constexpr, num_warps: gl.constexpr,
             A6: gl.constexpr):
    """The ``A`` registers (``(warp, lane, block, pair, tile, register)`` int32, bf16 pairs) and the metadata
    registers (``(warp, lane, block, pair)``) of chunk ``chunk`` (nothing read where ``more`` is false). Warp ``w``'s
    block ``m`` is weight rows ``16 (MT w + m)`` on. Register ``r`` of lane ``4g + t`` is the block's row ``g + 8 (r //
    2)``, stored block ``2t + r % 2`` of its tile: plain 2:4 reads it as stored (8-byte pairs); 2:4 + INT4 reads a
    tile's four code bytes of both rows as one int32 and dequantizes them here. 2:4 + INT4 is read in stripes of
    ``STRIPE`` tiles ([Note: INT4 stripes] in ``_sparse_mma_kernels``): a lane's codes of a pair of tiles and row are
    one 4-byte load, the stripe's positions of a row one vector, gathered by ``META`` (:func:`stripe_meta_asm`)."""
    M4: gl.constexpr = gl.SliceLayout(4, gl.SliceLayout(5, A6))  # (warp, lane, block, pair)
    lane4 = _along4(32, 1, M4)
    pair4 = _along4(KT // 2, 3, M4)
    rg4 = row0 + 16 * (MT * _along4(num_warps, 0, M4) + _along4(MT, 2, M4)) + lane4 // 4  # row g of the block
    if W4:
        # metadata of the pair: the stripe's words of rows g and g + 8 on the register axis (one vector load)
        W5: gl.constexpr = gl.SliceLayout(4, A6)  # (warp, lane, block, pair, word)
        lane_w = _along5(32, 1, W5)
        tile_w = chunk * KT + 2 * _along5(KT // 2, 3, W5)  # the pair's first tile
        row_w = row0 + 16 * (MT * _along5(num_warps, 0, W5) + _along5(MT, 2, W5)) + lane_w // 4
        col_w = (tile_w // STRIPE) * STRIPE + _along5(4, 4, W5) % STRIPE
        live_w = (tile_w < TILES) & more
        mg = gl.load(meta_ptr + row_w * stride_mn + col_w, mask=(row_w < N) & live_w, other=_VALID)
        mh = gl.load(meta_ptr + (row_w + 8) * stride_mn + col_w, mask=(row_w + 8 < N) & live_w, other=_VALID)
        info = tile_w % STRIPE + (lane_w % 4) // 2 + 1024 * (lane_w % 2)  # the lane's tile s, and 4 (t % 2) << 8
        e = gl.reduce(gl.inline_asm_elementwise(META, META_IO, [mg, mh, info], dtype=gl.int32, is_pure=True, pack=4),
                      4, _first)
        e = gl.convert_layout(e, M4)
        T5: gl.constexpr = gl.SliceLayout(5, A6)  # (warp, lane, block, pair, tile): one value per tile
        lane5 = gl.expand_dims(lane4, 4)
        pair5 = gl.expand_dims(pair4, 4)
        top = _along5(2, 4, T5)
        tq = chunk * KT + 2 * pair5 + top
        rg = gl.expand_dims(rg4, 4)
        lq = (chunk * KT + 2 * pair5 < TILES) & more  # by pairs (TILES is whole stripes): one mask for both loads
        # lane t's 2 bytes of tile s of a stripe: int16 S t + s of the stripe's 4 S, the pair's two side by side
        col = (chunk * KT // STRIPE + pair5 // (STRIPE // 2)) * (4 * STRIPE) + STRIPE * (lane5 % 4) \
            + 2 * (pair5 % (STRIPE // 2)) + top
        codes, z0, z1 = w4_codes(w_ptr, z_ptr, rg, col, (tq - top) * 32 // GROUP, lq, N, stride_wn, stride_zn,
                                 HAS_ZEROS)
        # the pair's scales (both tiles in one group: GROUP a multiple of 64), rows g and g + 8, as bf16 bits
        sp = chunk * KT + 2 * pair4
        s_live = (sp < TILES) & more
        s0 = gl.load(s_ptr + rg4 * stride_sn + sp * 32 // GROUP, mask=(rg4 < N) & s_live, other=0.0)
        s1 = gl.load(s_ptr + (rg4 + 8) * stride_sn + sp * 32 // GROUP, mask=(rg4 + 8 < N) & s_live, other=0.0)
        s0 = s0.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        s1 = s1.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        low = _along6(4, 5, A6) < 2  # registers 0-1: row g; 2-3: row g + 8 (the selects fold: in-thread axis)
        nz = gl.where(low, gl.expand_dims((z0 | 0xC300) * 0x10001, 5), gl.expand_dims((z1 | 0xC300) * 0x10001, 5))
        s2 = gl.where(low, gl.expand_dims(gl.expand_dims(s0 | (s0 << 16), 4), 5),
                      gl.expand_dims(gl.expand_dims(s1 | (s1 << 16), 4), 5))
        c6, nz = gl.broadcast(gl.expand_dims(codes, 5), nz)
        a = gl.inline_asm_elementwise(_DEQUANT, _DEQUANT_IO, [c6, nz, gl.broadcast(s2, nz)[0]], dtype=gl.int32,
                                      is_pure=True, pack=4)
    else:
        # metadata of the pair: lane 4g + t holds logical blocks 0-3 (t even) or 4-7 of tile 2p + t // 2, rows g, g + 8
        m_tile = chunk * KT + 2 * pair4 + (lane4 % 4) // 2
        e = _meta_regs(meta_ptr, rg4, 0, m_tile, (m_tile < TILES) & more, 4 * (lane4 % 2), N, stride_mn)
        r = _along6(4, 5, A6)
        tile = chunk * KT + 2 * _along6(KT // 2, 3, A6) + _along6(2, 4, A6)
        row = row0 + 16 * (MT * _along6(num_warps, 0, A6) + _along6(MT, 2, A6)) + _along6(32, 1, A6) // 4 + 8 * (r // 2)
        a = gl.load(w_ptr + row * stride_wn + tile * 8 + 2 * (_along6(32, 1, A6) % 4) + r % 2,
                    mask=(row < N) & (tile < TILES) & more, other=0)
    return a, e


@gluon.jit
def sparse_gemm_kernel(x_ptr, w_ptr, meta_ptr, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, TILES, SPLIT, CHUNKS,
                       RUNS, stride_xm, stride_wn, stride_mn, stride_sn, stride_zn, stride_om, KT: gl.constexpr,
                       NT: gl.constexpr, MT: gl.constexpr, DEPTH: gl.constexpr, W4: gl.constexpr, GROUP: gl.constexpr,
                       HAS_ZEROS: gl.constexpr, PARTIAL: gl.constexpr, FIX_K: gl.constexpr, CHAIN: gl.constexpr,
                       CHAIN_IO: gl.constexpr, STRIPE: gl.constexpr, META: gl.constexpr, META_IO: gl.constexpr,
                       num_warps: gl.constexpr):
    """``out[M, N] = x @ densify(values, meta)^T`` for up to ``8 * NT`` rows of ``x`` per program ([Note: 2:4 GEMM
    on sparse tensor cores]). Plain 2:4 (``W4`` false): operands as ``sparse_mma_kernel``. 2:4 + INT4: ``w_ptr`` the
    kept values' codes ``(N, K / 4)`` uint8 read as int16 (two blocks each), ``s_ptr`` bf16 scales and ``z_ptr``
    uint8 zero points (``HAS_ZEROS`` false: 8) per row and group of ``GROUP`` original columns (a multiple of 64).
    Grid ``(groups of 8 * NT rows of x, RUNS blocks of 16 * MT * num_warps weight rows, SPLIT slices)``: ``MT`` blocks
    of 16 weight rows a warp share each ``B`` read; a slice is ``CHUNKS`` chunks of ``KT`` tiles (even); ``DEPTH`` 1
    loads the next chunk's weights before this one's MMAs; ``CHAIN``, ``CHAIN_IO``: :func:`chain_asm` of ``KT``,
    ``MT``. 2:4 + INT4 is read in stripes of ``STRIPE`` tiles (2 or 4, dividing ``KT``; plain 2:4: 1), ``META`` /
    ``META_IO`` its :func:`stripe_meta_asm`."""
    # axes: warp, lane, group of x rows, block of 16 weight rows, pair of tiles, tile of the pair, register
    L7: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, NT, MT, KT // 2, 2, 4],
                                        threads_per_warp=[1, 32, 1, 1, 1, 1, 1],
                                        warps_per_cta=[num_warps, 1, 1, 1, 1, 1, 1], order=[6, 5, 4, 3, 2, 1, 0])
    A6: gl.constexpr = gl.SliceLayout(2, L7)  # one group's operands: A, B, the chained MMAs' slots
    B5: gl.constexpr = gl.SliceLayout(2, A6)  # B as read: (1, lane, pair, tile, register)
    O5: gl.constexpr = gl.SliceLayout(4, gl.SliceLayout(5, L7))  # the sums: (warp, lane, group, block, register)
    C4: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, A6))  # one group's sums: (warp, lane, block, register)
    # staging, x in natural order: (group, g, pair, tile of the pair, r % 2, t // 2, 4 int32), 16 bytes a thread,
    # a warp's lanes over 4 rows x 128 bytes, the warps over the groups, then the pairs
    WQ: gl.constexpr = NT if NT < num_warps else num_warps
    LS: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 1, 1, 1, 4], threads_per_warp=[1, 4, 1, 2, 2, 2, 1],
                                        warps_per_cta=[WQ, 1, num_warps // WQ, 1, 1, 1, 1], order=[6, 5, 4, 3, 2, 1, 0])
    # fragment order in shared memory: register, lane, tile of the pair, pair, group (the buffer outermost)
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [4, 1, 3, 2, 0])
    ROWS: gl.constexpr = 16 * MT * num_warps
    pid_m = gl.program_id(0)
    pid_r = gl.program_id(1)
    pid_k = gl.program_id(2)
    m0 = pid_m * (8 * NT)
    row0 = pid_r * ROWS

    xs = gl.allocate_shared_memory(gl.int32, [2, NT, 32, KT // 2, 2, 4], SL)
    chunk0 = pid_k * CHUNKS
    tile0 = chunk0 * KT
    xr = _stage_x(x_ptr, M, TILES, stride_xm, m0, tile0, KT, NT, LS, STRIPE)
    a, e = _weights(w_ptr, meta_ptr, s_ptr, z_ptr, N, TILES, stride_wn, stride_mn, stride_sn, stride_zn, row0,
                    chunk0, CHUNKS > 0, KT, MT, GROUP, HAS_ZEROS, W4, STRIPE, META, META_IO,
                    num_warps, A6)

    acc = gl.zeros([num_warps, 32, NT, MT, 4], gl.float32, O5)
    group = _along5(NT, 2, O5)
    for c in range(CHUNKS):
        buf = c % 2
        xs.index(buf).store(xr)
        _cta_barrier()  # the chunk staged; and every warp done with the buffer staged two chunks ago
        if c + 1 < CHUNKS:  # the next chunk's x in flight while this one multiplies
            xr = _stage_x(x_ptr, M, TILES, stride_xm, m0, tile0 + (c + 1) * KT, KT, NT, LS, STRIPE)
        if DEPTH == 1:
            a_n, e_n = _weights(w_ptr, meta_ptr, s_ptr, z_ptr, N, TILES, stride_wn, stride_mn, stride_sn, stride_zn,
                                row0, chunk0 + c + 1, c + 1 < CHUNKS, KT, MT, GROUP, HAS_ZEROS, W4, STRIPE, META,
                                META_IO, num_warps, A6)
        e6 = gl.broadcast(gl.expand_dims(gl.expand_dims(e, 4), 5), a)[0]
        xb = xs.index(buf)
        for q in gl.static_range(NT):
            b = gl.expand_dims(xb.slice(q, 1).load(B5), 2)  # the same in every warp and block
            # this group's sums so far, in slots 0-3 of each block (the selects fold: the group axis is in-thread, and
            # x + -0.0 is x)
            c4 = gl.convert_layout(gl.sum(gl.where(group == q, acc, -0.0), axis=2), C4)
            d = gl.inline_asm_elementwise(CHAIN, CHAIN_IO, [a, gl.broadcast(b, a)[0], e6, gl.broadcast(
                gl.expand_dims(gl.expand_dims(c4, 3), 4), a)[0]], dtype=gl.float32, is_pure=True, pack=4 * KT * MT)
            new = gl.reduce(gl.reduce(d, 4, _first), 3, _first)  # slots 0-3 of each block: (warp, lane, block, reg)
            acc = gl.where(group == q, gl.expand_dims(gl.convert_layout(new, gl.SliceLayout(2, O5)), 2), acc)
        if DEPTH == 1:
            a = a_n
            e = e_n
        else:
            a, e = _weights(w_ptr, meta_ptr, s_ptr, z_ptr, N, TILES, stride_wn, stride_mn, stride_sn, stride_zn,
                            row0, chunk0 + c + 1, c + 1 < CHUNKS, KT, MT, GROUP, HAS_ZEROS, W4, STRIPE, META,
                            META_IO, num_warps, A6)

    # slot j of lane 4g + t, group q, block m of warp w: weight row 16 (MT w + m) + g + 8 (j // 2), row 8q + 2t + j % 2
    # of x
    lane_o = _along5(32, 1, O5)
    j_o = _along5(4, 4, O5)
    o_row = row0 + 16 * (MT * _along5(num_warps, 0, O5) + _along5(MT, 3, O5)) + lane_o // 4 + 8 * (j_o // 2)
    o_m = m0 + 8 * group + 2 * (lane_o % 4) + j_o % 2
    o_live = (o_m < M) & (o_row < N)
    _store_sums(acc, out_ptr, part_ptr, o_row, o_m, o_live, N, SPLIT, pid_k, stride_om, PARTIAL)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_m * RUNS + pid_r, row0, m0, gl.minimum(M, m0 + 8 * NT), N,
                   SPLIT, stride_om, ROWS, FIX_K, num_warps)
