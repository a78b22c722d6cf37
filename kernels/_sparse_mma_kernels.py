"""The 2:4 GEMV on sparse tensor cores (``mma.sp``), written in Gluon: plain 2:4 weights times up to 8 rows of ``x``.

Imported lazily, like ``_word_kernels`` (see [Note: lazy triton] in ``_runtime``); only on an sm_80+ GPU with a
Triton that has Gluon (``_sparse_mma.sparse_mma_possible``).

[Note: 2:4 GEMV on sparse tensor cores] The x-stationary kernel (``stationary_s24_kernel``) spends ~22 instructions
per value word: each kept value picks its column of ``x`` by its 2-bit position (bit tests and selects), then one
FMA. It ran at 1.5 TB/s where INT8's kernel reaches ~2 TB/s, limited by instructions and loads per byte, not by
bytes in flight (benchmarks/RESULTS.md, kernels runs 11 and 18). The sparse tensor cores do that selection in
hardware: ``mma.sp.m16n8k32`` multiplies a 16 x 32 weight tile stored as its 16 x 16 kept values plus 2-bit
positions by a 32 x 8 block of ``x``. So here one warp issues one ``mma.sp`` per 16 weight rows x 32 columns, and
the weight rows need no shuffling: the format of ``compress.nm`` is already the instruction's.

- Weight rows are the MMA's ``M`` side (16 per warp), the rows of ``x`` its ``N`` side: 8 columns, of which
  ``M`` are used (the rest are zero), so 1 to 8 rows of ``x`` cost the same weight bytes.
- A thread's four ``A`` registers for one tile are four value words as stored: a value word is one block of 4
  columns (its two kept bf16 values), and the fragment of lane ``4g + t`` is rows ``g`` and ``g + 8``, blocks
  ``t`` and ``t + 4`` of the tile (PTX ISA, "Matrix Fragments for sparse mma.m16n8k32"). Any order of the blocks
  inside a tile gives the same product if ``x`` and the metadata follow it, so the kernel hands the instruction
  stored blocks ``2t`` and ``2t + 1`` in those places: one 8-byte load per row ([Note: block order]).
- The metadata of a tile is 16 rows x 8 blocks x 4 bits, held by two lanes of each quad: lane ``4g`` has blocks
  0-3 of rows ``g`` (low half) and ``g + 8`` (high half), lane ``4g + 1`` blocks 4-7; with sparsity selector 1
  lanes ``4g + 2`` and ``4g + 3`` hold them instead. So two tiles share one register a thread: even tiles use
  selector 0, odd tiles 1. A block's nibble (first position in bits 0-1, second in 2-3, sorted) is what
  ``compress.nm`` stores; each thread loads the stored metadata words of its two rows and picks out its four
  blocks' nibbles (one shift, one mask, one shift-or per row and a byte permute for both).
- ``B`` (this program's slice of ``x``) is loaded once, lane ``4g + t`` holding row ``g`` of ``x``, columns
  ``2t + 8i`` and ``2t + 8i + 1`` of the tile in register ``i`` (permuted as [Note: block order] says), and stays
  in registers while weight rows stream past ([Note: x-stationary GEMV] in ``_stationary_kernels``), the next
  block of rows loaded while the current one multiplies (register prefetch).
- The two ``mma.sp`` of a pair of tiles run in one inline-asm call (Gluon's layouts put exactly one thread's
  fragment registers in each call: ``pack=8``); pairs are summed in registers; the accumulator of lane ``4g + t``
  holds rows ``g`` / ``g + 8`` times rows ``2t`` / ``2t + 1`` of ``x``.
- Slices of ``K`` meet as in the x-stationary kernels: fp32 partials in the device workspace, summed in slice order
  by the run's last program ([Note: split-K fix-up] in ``_word``).

[Note: 2:4 + INT4 on sparse tensor cores] ``sparse_mma_w4_kernel`` runs the same schedule on INT4 kept values
(``compress`` stores a block's two codes in one byte, first kept value in the low nibble). Each block becomes its
``A`` register in three instructions: a byte permute takes the byte and, from the word shifted right by a nibble,
its high nibble into bits 16-19; a LOP3 masks both nibbles into ``0x4300`` (the bf16 pair ``(128 + code, 128 +
code')``) and one ``fma.bf16x2`` by 1 minus ``128 + zero`` makes it ``code - zero``, exact. The group's scale
multiplies the fp32 sums of a stripe (below), which lies in one group.

[Note: INT4 stripes] Read a tile at a time, a lane's INT4 share of a tile is 2 bytes a row (blocks ``2t`` and ``2t +
1``, as [Note: block order] places them), and the first version loaded just that, with the metadata, scales and zero
points per tile or pair: on an H100 it ran at 29 % of DRAM bandwidth with the L1 87 % busy (ncu, kernels run 151),
slower at one row than the x-stationary kernel. So the kernel walks ``K`` in *stripes* of 4 tiles (2 where the groups
are 64 columns). With ``S`` tiles a stripe, lane ``t`` takes the stripe's stored blocks ``2 S t`` to ``2 S t + 2 S -
1``, so its codes of a row are one 8-byte load (4 bytes for a stripe of 2), and tile ``s`` of the stripe gets stored
blocks ``2 S t + 2s`` and ``2 S t + 2s + 1`` as its logical blocks ``t`` and ``t + 4``. In general logical block
``L`` of tile ``s`` is stored block ``2 S (L % 4) + 2s + L // 4``: the products are the same as long as ``x`` (loaded
once, any order is free) and the metadata follow. The metadata register of a pair of tiles needs one nibble of four
bytes that lie ``S`` apart, so every lane of a quad loads the stripe's positions of both rows in one vector (16
bytes) and gathers its bytes with byte permutes (``meta_gather``). Scales and zero points are one load a stripe and
row, or one a slice and row where the slices are whole and a stripe is a group. A stripe's MMAs chain through the
accumulators in one inline-asm call (``w4_stripe_asm``). Loads a stripe and row: one of codes, one of positions, one
scale, one zero point, where the tile-wise version made 8, 4, 2 and 8. The stripes hold a block's weights in few
registers, so the next block's can be in flight while this one multiplies (``DEPTH`` 1). The weights are read
unmasked: rows past ``N`` read row ``N - 1`` (their sums are not stored) and stripes past ``K`` the last stripe (``x``
is zero there), which saves the predicates and the default values of masked loads. The 2:4 GEMM reads 2:4 + INT4 the
same way ([Note: 2:4 GEMM on sparse tensor cores] in ``_sparse_gemm_kernels``).

On an H100 (benchmarks/RESULTS.md, kernels runs 152-156, bf16 in the same process) one row runs 2.79x of bf16 on
8192x8192, 2.81x on 8192x28672 and 2.66x on 28672x8192, where the x-stationary kernel (the tuner's pick before) ran
2.00 / 2.11 / 2.07x; four rows 2.39-2.59x, eight rows 2.04-2.33x. The first version (no block ahead, masked loads)
gave 2.44 / 2.81 / 2.67x at one row.

A lane's ``x`` in that order is every other int32 (a pair of values) of two runs of ``4 S`` int32 a stripe
(``_stripe_b``): gathered 4 bytes a register, or with ``XVEC`` both runs loaded whole, 16 bytes a tile, the lane
keeping its parity's int32 ([Note: x a word at a time] in ``_dense_mma_kernels``). Half the L2 sectors, but a
``SEL`` a register more. Kernels run 265 (H200, tuned both ways in one call, us, 16-byte twice / 4-byte): 2:4 + INT4
at 8 rows 22.9 / 23.7 on 8192x8192, 37.8 / 39.0 on 4096x28672, 25.2-25.3 / 26.6 on 14336x4096, at one row within 3 %
(18.3 / 18.8, 31.7-31.8 / 31.7, 18.1-18.5 / 18.4); plain 2:4 in stripes (``sparse_mma_stripe_kernel``) lost at one
row (31.5-31.9 / 30.8, 46.6-47.3 / 44.7, 29.8 / 27.6) and tied at 8. So 2:4 + INT4 reads ``x`` this way where its rows
start at multiples of 16 bytes, and plain 2:4 keeps the 4-byte loads.

[Note: 2:4 stripes] Tile by tile, plain 2:4 reads a lane's values of a tile and row in one 8-byte load, and each
pair of tiles' positions in masked 4-byte loads that it shifts and folds per lane: 424 instructions a block of 16
tiles in its loop (sm_90 SASS, 48 loads, 240 registers), most of them address and mask arithmetic (IMAD, ISETP),
which is why moving ``x`` to shared memory did not help it (kernels run 168). ``sparse_mma_stripe_kernel`` reads
plain values as the 2:4 + INT4 kernel reads codes ([Note: INT4 stripes]): lane ``t`` takes the stripe's stored blocks ``2 S t`` to
``2 S t + 2 S - 1`` (``S`` = 2 or 4 tiles a stripe), so its values of a row are ``2 S`` consecutive words, one or two
16-byte loads, and tile ``s`` gets the 64-bit pair of words ``2s``, ``2s + 1`` as its logical blocks ``t`` and ``t +
4`` (``s24_stripe_asm`` splits the pair into the ``A`` registers). ``x`` and the metadata follow that order exactly as
for 2:4 + INT4 (the same ``B`` loads and ``meta_gather``), and the weights are read unmasked (rows past ``N`` read row
``N - 1``, stripes past ``K`` the last one, where ``x`` is zero). The same block then takes 296 instructions, 24 loads
and 148 registers. The tuner times both kernels: in kernels runs 172-174 the stripes won at one row on every shape
(H100: 1.39 / 1.51 / 1.48x of bf16 to 1.46 / 1.62 / 1.60x; H200: 1.30-1.44x to 1.37-1.60x) and mostly at four rows;
on 8192x8192 at 4-8 rows the tile-wise kernel stays ahead. ``benchmarks/sparse_mma_check.py --stripes`` checks it
bit for bit.

[Note: 2:4 folded rows] In both kernels above a lane's ``A`` quad of a tile holds two weight rows, ``g`` and ``g +
8``, so it is assembled from two rows' loads: in the striped loop 64 of 296 instructions a block of 16 tiles are
register moves (sm_90 SASS). ``sparse_mma_fold_kernel`` gives both halves of the MMA's ``M`` side to one weight row
``r``: fragment row ``g`` holds ``r`` over one 32-column segment of ``K``, row ``g + 8`` the same ``r`` over the next,
and column ``2i`` of ``B`` holds row ``i`` of ``x`` over the first segment, column ``2i + 1`` over the second. Then
``D[g][2i] + D[g + 8][2i + 1]`` is row ``r`` times row ``i`` of ``x`` over 64 columns (lane ``4g + i``: ``d0 + d3``);
the other products are thrown away, as the unused columns of ``B`` were already. An MMA now covers 8 weight rows by 64
columns, the same weight bytes as before, and takes at most 4 rows of ``x`` (``_sparse_mma.FOLD_M``).

- A lane's quad is 4 consecutive value words of row ``r``, ``4t .. 4t + 3`` of the MMA's 16, as (segment 1, block
  ``t``), (segment 2, block ``t``), (segment 1, block ``t + 4``), (segment 2, block ``t + 4``): one 16-byte load whose
  registers are the ``A`` operand as they land (no moves). So stored block ``4 (L % 4) + 2 (L // 4) + c`` of the MMA
  is logical block ``L`` of segment ``c``, and ``B`` is loaded in that order.
- Metadata: lanes ``4g``, ``4g + 1`` (selector 0) serve the even MMA of a pair, ``4g + 2``, ``4g + 3`` the odd one, so
  each lane loads the 8 position bytes of its MMA (one 8-byte load). Its blocks are the stored nibbles ``4L + 2 (t % 2)
  + c``: bytes ``2L + t % 2``, gathered by one byte permute, then the low nibbles (segment 1, row ``g``) packed into
  the low half and the high nibbles (segment 2, row ``g + 8``) into the high half: two shifts, two LOP3, one permute,
  shared by the pair's two MMAs (``s24_fold_asm``).
- The pair's sum goes out in slot 0 of the asm's four; the others are ``-0.0`` and split off, not added (summed,
  ptxas issued the additions of ``-0.0``).
- ``x`` takes half the registers of the other layouts (4 a lane per 64 columns), so slices of 32 tiles with one block
  ahead fit in 245 registers.

A block of 8 MMAs (the weights of 8 tiles; no block ahead) takes 83 instructions in the loop, 17 of them scheduling
no-ops around the MMAs, where the striped loop takes 148 for as many weights. Blocks loaded ahead are carried into the
next iteration with register copies (4 an MMA): with a loop of two blocks an iteration in alternating registers, ptxas
moved each load down to its MMAs and nothing stayed in flight ahead, so that was not kept. Measured
(benchmarks/RESULTS.md, kernels runs 176-181; ``sparse24_matmul`` as users call it, bf16 in the same process): one row
1.50 / 1.68 / 1.69x of bf16 on the H100 (8192x8192: 1.48-1.51x across three runs; stripes: 1.46 / 1.62 / 1.60x), 1.50 /
1.61 / 1.60x on the H200 (1.37 / 1.60 / 1.52x); four rows 1.44 / 1.61 / 1.62x on the H100 (1.32 / 1.51 / 1.43x), 1.39 /
1.53 / 1.52x on the H200 (1.14 / 1.37 / 1.24x). The tuner took 32 tiles a slice, 4 warps, one block ahead on every
shape. ``benchmarks/sparse_mma_check.py --fold`` checks it bit for bit.

2:4 + INT4 folds the same way (``sparse_mma_w4_fold_kernel``, ``w4_fold_asm``), a pair of MMAs being 128 columns,
so it takes groups of a multiple of 128 columns. Lane ``t`` reads stored blocks ``8t .. 8t + 7`` of a pair: one 8-byte
load of codes, byte ``4m + j`` becoming ``A`` register ``j`` of MMA ``m`` (a byte permute, a LOP3 into ``0x4300``, one
bf16 subtraction of ``128 + zero``, as in [Note: 2:4 + INT4 on sparse tensor cores]). So stored block ``8 (L % 4) + 4m
+ 2 (L // 4) + c`` is logical block ``L`` of segment ``c`` of MMA ``m``, and lane ``t``'s metadata nibbles lie in byte
``t`` of each of the pair's 4 position words (one 16-byte load): three byte permutes gather them before the same
unzip. One row a lane also means one zero point and one scale a pair. The loop takes 231 instructions where the
striped one takes 275 for as many weights (sm_90 SASS, 8 MMAs, no block ahead). On an H100 (kernels run 182, each kind
tuned alone) one row runs 2.96 / 3.11 / 2.98x of bf16 where the stripes ran 2.79 / 2.81 / 2.66x, four rows 2.73 /
2.90 / 2.83x (2.52 / 2.55 / 2.37x). ``benchmarks/sparse_mma_check.py --w4-fold`` checks it bit for bit.

Tiles past ``K`` and rows past ``N`` read zero values with a valid position pair (0, 1), since an invalid one is
undefined behaviour for the instruction. Positions must be sorted and distinct within a block, as ``compress.nm``
writes them (the x-stationary kernel assumes the same).

Measured on an H100 (benchmarks/RESULTS.md, kernels runs 66-73, speed-up over cuBLAS bf16 in the same process): one
row 1.39-1.55x where the x-stationary kernel ran 1.08-1.16x (8192x28672: 112.7 us, 2.3 TB/s), four rows 1.31-1.48x,
eight 1.22-1.39x; best with 512-column slices and nothing loaded ahead (a warp's whole block in flight at once).
Tried and not kept: a ``cp.async`` ring in shared memory (run 68, never among the four fastest configs), weights
read through L2 only (run 71, never chosen), unmasked loads where rows and slices are whole (run 72: fewer
registers, 4-11 % slower at 4-8 rows).
"""
from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # renamed in Triton 3.9

_MMA = "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32"
# $0-$3: the pair's sum (the accumulator fragment), $4-$7: zero (unused slots of the pack); $8-$15: A of the even and
# the odd tile, each as (row g, block 2t), (row g, 2t + 1), (row g + 8, 2t), (row g + 8, 2t + 1), the order in which
# they load as two 8-byte vectors; $16-$23: B of both; $24: their metadata (selector 0 for the even tile, 1 for the
# odd)
_ASM_PAIR = gl.constexpr("{\n.reg .f32 d<4>, z;\nmov.f32 z, 0f00000000;\n"
                         f"{_MMA} {{d0, d1, d2, d3}}, {{$8, $10, $9, $11}}, {{$16, $17, $18, $19}}, "
                         "{z, z, z, z}, $24, 0x0;\n"
                         f"{_MMA} {{$0, $1, $2, $3}}, {{$12, $14, $13, $15}}, {{$20, $21, $22, $23}}, "
                         "{d0, d1, d2, d3}, $24, 0x1;\n"
                         "mov.f32 $4, z;\nmov.f32 $5, z;\nmov.f32 $6, z;\nmov.f32 $7, z;\n}")
_ASM_IO = gl.constexpr(",".join(["=f"] * 8 + ["r"] * 24))
# the metadata register from the two rows' stored words (after the nibble fold below): bytes 0 and 2 of each
_ASM_META = gl.constexpr("prmt.b32 $0, $1, $2, 0x6420;")


def meta_gather(stripe: int, mg: list[str], mh: list[str], out: str) -> list[str]:
    """PTX lines: the metadata register ``out`` of tile ``s`` of a stripe ([Note: INT4 stripes]), from the stripe's
    position words of rows ``g`` (``mg``) and ``g + 8`` (``mh``). The caller declares ``ts`` (the tile ``s``), ``n4``
    (``4 (t % 2)``), ``sel``, ``u``, ``v``, ``xg`` and ``xh``. The lane's logical blocks ``4n .. 4n + 3`` (``n = t %
    2``) are stored blocks ``2 S u + 2s + n``: nibble ``n`` of byte ``S u + s`` of the stripe's positions, ``u = 0 ..
    3``; gathered by byte permutes, then two blocks a byte in bytes 0 and 2 of both rows, joined."""
    if stripe == 4:  # byte s of each of four words
        lines = ["mad.lo.u32 sel, ts, 17, 64;"]
        for words, dst in ((mg, "xg"), (mh, "xh")):
            lines += [f"prmt.b32 u, {words[0]}, {words[1]}, sel;", f"prmt.b32 v, {words[2]}, {words[3]}, sel;",
                      f"prmt.b32 {dst}, u, v, 0x5410;"]
    else:  # bytes s and s + 2 of each of two words
        lines = ["mad.lo.u32 sel, ts, 0x1111, 0x6420;", f"prmt.b32 xg, {mg[0]}, {mg[1]}, sel;",
                 f"prmt.b32 xh, {mh[0]}, {mh[1]}, sel;"]
    for dst in ("xg", "xh"):  # nibble n of each byte, then two blocks a byte in bytes 0 and 2
        lines += [f"shr.b32 {dst}, {dst}, n4;", f"shr.b32 u, {dst}, 4;",
                  f"lop3.b32 {dst}, {dst}, u, 0x0F0F0F0F, 0xE4;"]  # (dst & mask) | (u & ~mask)
    return lines + [f"prmt.b32 {out}, xg, xh, 0x6420;"]


@functools.cache
def w4_stripe_asm(stripe: int) -> tuple[str, str]:
    """2:4 + INT4, one stripe of ``stripe`` (2 or 4) tiles ([Note: INT4 stripes]): the inline asm and its constraints,
    for ``pack=stripe``. Operands in order, ``stripe`` registers each (a broadcast value: only its first is read):
    the lane's code words of rows ``g`` and ``g + 8`` (one 64-bit load each for 4 tiles, a 32-bit one for 2), the four
    ``B`` registers of every tile, the stripe's metadata words of both rows, ``-(128 + zero)`` in both bf16 halves of
    both rows, and the lane value ``t // 2 + 4 (t % 2)``. Out: the stripe's sums, row ``g`` times rows ``2t``,
    ``2t + 1`` of ``x``, then row ``g + 8``. A kept pair's byte becomes the bf16 pair ``(128 + code, 128 + code')``
    (one byte permute of the word and of the word shifted by a nibble, masked into 0x4300) and then ``code - zero``
    exactly."""
    if stripe not in (2, 4):
        raise ValueError(f"w4_stripe_asm: a stripe has 2 or 4 tiles, got {stripe}")
    nxt = iter(range(4, 4 + 11 * stripe))
    cg, ch = ([next(nxt) for _ in range(stripe)] for _ in range(2))
    b = [[next(nxt) for _ in range(stripe)] for _ in range(4)]
    mg, mh, nzg, nzh, lane = ([next(nxt) for _ in range(stripe)] for _ in range(5))
    lines = ["{", ".reg .b32 zr, one, y, a<4>, cg<2>, ch<2>, cg0s, cg1s, ch0s, ch1s, t2, n4, ts, sel, u, v, xg, xh;",
             ".reg .b32 m<2>;", ".reg .f32 e<4>, z;", "mov.b32 zr, 0;", "mov.b32 one, 0x3F803F80;",
             "mov.f32 z, 0f00000000;", f"and.b32 t2, ${lane[0]}, 1;", f"and.b32 n4, ${lane[0]}, 4;"]
    if stripe == 4:
        lines += [f"mov.b64 {{cg0, cg1}}, ${cg[0]};", f"mov.b64 {{ch0, ch1}}, ${ch[0]};"]
    else:
        lines += [f"mov.b32 cg0, ${cg[0]};", f"mov.b32 ch0, ${ch[0]};"]
    words = [f"{row}{w}" for w in range(stripe // 2) for row in ("cg", "ch")]
    lines += [f"shr.b32 {w}s, {w}, 4;" for w in words]  # each byte's high nibble in its low nibble
    for pair in range(stripe // 2):
        lines.append(f"add.u32 ts, t2, {2 * pair};")  # the pair's tile of this lane
        lines += meta_gather(stripe, [f"${w}" for w in mg], [f"${w}" for w in mh], f"m{pair}")
    for s in range(stripe):
        word, byte = s // 2, 2 * (s % 2)  # tile s: bytes 2 (s % 2) (logical block t) and + 1 (t + 4) of a word
        # A register: (row g, block t), (row g + 8, block t), (row g, block t + 4), (row g + 8, block t + 4)
        for reg, (src, bt, nz) in enumerate(((f"cg{word}", byte, nzg), (f"ch{word}", byte, nzh),
                                            (f"cg{word}", byte + 1, nzg), (f"ch{word}", byte + 1, nzh))):
            # the byte's low nibble in bits 0-3, its high nibble in bits 16-19
            lines += [f"prmt.b32 y, {src}, {src}s, 0x{4 + bt}{4 + bt}{bt}{bt};",
                      "lop3.b32 y, y, 0x000F000F, 0x43004300, 0xEA;", f"fma.rn.bf16x2 a{reg}, y, one, ${nz[0]};"]
        acc = "z, z, z, z" if s == 0 else "e0, e1, e2, e3"
        lines.append(f"{_MMA} {{e0, e1, e2, e3}}, {{a0, a1, a2, a3}}, {{${b[0][s]}, ${b[1][s]}, ${b[2][s]}, "
                     f"${b[3][s]}}}, {{{acc}}}, m{s // 2}, 0x{s % 2};")
    lines += ["mov.f32 $0, e0;", "mov.f32 $1, e1;", "mov.f32 $2, e2;", "mov.f32 $3, e3;", "}"]
    code = "l" if stripe == 4 else "r"
    io = ["=f"] * 4 + [code] * (2 * stripe) + ["r"] * (9 * stripe)
    return "\n".join(lines), ",".join(io)


@functools.cache
def s24_stripe_asm(stripe: int) -> tuple[str, str]:
    """Plain 2:4, one stripe of ``stripe`` (2 or 4) tiles ([Note: 2:4 stripes]): the inline asm and its constraints,
    for ``pack=stripe``. Operands in order, ``stripe`` registers each (a broadcast value: only its first is read):
    tile ``s``'s value words of rows ``g`` and ``g + 8`` (64 bits each: its logical blocks ``t`` and ``t + 4``), the
    four ``B`` registers of every tile, the stripe's metadata words of both rows, and the lane value ``t // 2 + 4 (t %
    2)``. Out: the stripe's sums, row ``g`` times rows ``2t``, ``2t + 1`` of ``x``, then row ``g + 8``."""
    if stripe not in (2, 4):
        raise ValueError(f"s24_stripe_asm: a stripe has 2 or 4 tiles, got {stripe}")
    nxt = iter(range(4, 4 + 9 * stripe))
    vg, vh = ([next(nxt) for _ in range(stripe)] for _ in range(2))
    b = [[next(nxt) for _ in range(stripe)] for _ in range(4)]
    mg, mh, lane = ([next(nxt) for _ in range(stripe)] for _ in range(3))
    lines = ["{", ".reg .b32 ag<2>, ah<2>, t2, n4, ts, sel, u, v, xg, xh, m<2>;", ".reg .f32 e<4>, z;",
             "mov.f32 z, 0f00000000;", f"and.b32 t2, ${lane[0]}, 1;", f"and.b32 n4, ${lane[0]}, 4;"]
    for pair in range(stripe // 2):
        lines.append(f"add.u32 ts, t2, {2 * pair};")  # the pair's tile of this lane
        lines += meta_gather(stripe, [f"${w}" for w in mg], [f"${w}" for w in mh], f"m{pair}")
    for s in range(stripe):
        # A: (row g, block t), (row g + 8, block t), (row g, block t + 4), (row g + 8, block t + 4)
        lines += [f"mov.b64 {{ag0, ag1}}, ${vg[s]};", f"mov.b64 {{ah0, ah1}}, ${vh[s]};"]
        acc = "z, z, z, z" if s == 0 else "e0, e1, e2, e3"
        lines.append(f"{_MMA} {{e0, e1, e2, e3}}, {{ag0, ah0, ag1, ah1}}, {{${b[0][s]}, ${b[1][s]}, ${b[2][s]}, "
                     f"${b[3][s]}}}, {{{acc}}}, m{s // 2}, 0x{s % 2};")
    lines += ["mov.f32 $0, e0;", "mov.f32 $1, e1;", "mov.f32 $2, e2;", "mov.f32 $3, e3;", "}"]
    io = ["=f"] * 4 + ["l"] * (2 * stripe) + ["r"] * (7 * stripe)
    return "\n".join(lines), ",".join(io)


_VALID = gl.constexpr(0x44444444)  # eight blocks whose kept positions are (0, 1): what masked metadata reads


@gluon.jit
def _along4(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along ``dim`` of a 4-D tensor in ``layout`` (size 1 on the other axes)."""
    if dim == 0:
        return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))[:, None, None,
                                                                                                         None]
    elif dim == 1:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout))))[None, :, None,
                                                                                                         None]
    elif dim == 2:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))[None, None, :,
                                                                                                         None]
    else:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))[None, None,
                                                                                                         None, :]


@gluon.jit
def _along5_last(n: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along the last axis of a 5-D tensor in ``layout`` (size 1 on the others): a word's int32 where a
    GEMV reads ``x`` a word at a time ([Note: x a word at a time] in ``_dense_mma_kernels``)."""
    i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, layout)))))
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 0), 0), 0)


@gluon.jit
def _along3(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along ``dim`` of a 3-D tensor in ``layout``."""
    if dim == 0:
        return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))[:, None, None]
    elif dim == 1:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))[None, :, None]
    else:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]


@gluon.jit
def _meta_index(pid_k, TILES, KT: gl.constexpr, num_warps: gl.constexpr, M3: gl.constexpr):
    """Where lane ``4g + t`` reads its metadata registers: for the tile ``2p + t // 2`` of each pair ``p``, logical
    blocks 0-3 (t even: stored blocks 0, 2, 4, 6) or 4-7 (t odd: 1, 3, 5, 7) of rows ``g`` (low half) and ``g + 8``
    (high half). ``(row, tile, live, shift)`` in the layout ``M3`` (one value per pair of tiles)."""
    lane3 = _along3(32, 1, M3)
    t3 = lane3 % 4
    m_tile = pid_k * KT + 2 * _along3(KT // 2, 2, M3) + t3 // 2
    return 16 * _along3(num_warps, 0, M3) + lane3 // 4, m_tile, m_tile < TILES, 4 * (t3 % 2)


@gluon.jit
def _meta_regs(meta_ptr, rows, m_row, m_col, m_live, m_shift, N, stride_mn):
    """The metadata registers of a block's pairs of tiles from the stored words of rows ``g`` and ``g + 8`` (rows
    from ``N`` on read valid positions): the four blocks this lane holds are every other one (the even or the odd,
    ``m_shift`` 0 or 4), their nibbles folded into bytes 0 and 2, then those bytes of both rows joined."""
    r0 = rows + m_row
    lo = gl.load(meta_ptr + r0 * stride_mn + m_col, mask=(r0 < N) & m_live, other=_VALID)
    hi = gl.load(meta_ptr + (r0 + 8) * stride_mn + m_col, mask=(r0 + 8 < N) & m_live, other=_VALID)
    lo = (lo >> m_shift) & 0x0F0F0F0F
    hi = (hi >> m_shift) & 0x0F0F0F0F
    return gl.inline_asm_elementwise(_ASM_META, "=r,r,r", [lo | (lo >> 4), hi | (hi >> 4)], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _load_rows(w_ptr, meta_ptr, rows, a_row, a_col, a_live, m_row, m_col, m_live, m_shift, N, stride_wn,
               stride_mn):
    """A block's value words (the ``A`` fragments of every tile of the slice) and the metadata registers of every
    pair of tiles; rows from ``N`` on read zero values and valid positions."""
    ra = rows + a_row
    a = gl.load(w_ptr + ra * stride_wn + a_col, mask=(ra < N) & a_live, other=0)
    return a, _meta_regs(meta_ptr, rows, m_row, m_col, m_live, m_shift, N, stride_mn)


@gluon.jit
def sparse_mma_kernel(x_ptr, w_ptr, meta_ptr, part_ptr, count_ptr, out_ptr, M, N, TILES, SPLIT,
                      stride_xm, stride_wn, stride_mn, stride_om, KT: gl.constexpr, ROW_BLOCKS: gl.constexpr,
                      DEPTH: gl.constexpr, PARTIAL: gl.constexpr, FIX_K: gl.constexpr, num_warps: gl.constexpr):
    """``out[M, N] = x @ densify(values, meta)^T`` for ``M <= 8`` ([Note: 2:4 GEMV on sparse tensor cores]).

    ``x_ptr``: ``x`` (M, K) bf16 read as int32 pairs (M, K / 2); ``w_ptr``: the kept values (N, K / 2) bf16 read as
    int32 words, one per block of 4 columns; ``meta_ptr``: the positions (N, K / 8) uint8 read as int32 words, 8
    blocks each. ``TILES = K / 32``. Grid ``(runs, SPLIT)``: a program owns ``KT`` tiles of ``K`` (even) and a run
    of ``ROW_BLOCKS`` blocks of ``16 * num_warps`` weight rows, warp ``w`` taking rows ``16w .. 16w + 15`` of each;
    ``DEPTH`` (0, 1 or 2) blocks are loaded ahead (0: each where it is used, other warps hiding the wait)."""
    L4: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, KT // 2, 8], threads_per_warp=[1, 32, 1, 1],
                                        warps_per_cta=[num_warps, 1, 1, 1], order=[3, 2, 1, 0])
    M3: gl.constexpr = gl.SliceLayout(3, L4)  # one value per pair of tiles: the metadata registers
    O3: gl.constexpr = gl.SliceLayout(2, L4)  # one value per accumulator slot: the sums
    ROWS: gl.constexpr = 16 * num_warps
    pid_r = gl.program_id(0)
    pid_k = gl.program_id(1)

    # A and B fragments: axis 2 is the pair of tiles p, axis 3 the slot j (tile 2p + j // 4, register j % 4)
    warp = _along4(num_warps, 0, L4)
    lane = _along4(32, 1, L4)
    j = _along4(8, 3, L4)
    g = lane // 4
    t = lane % 4
    tile = pid_k * KT + 2 * _along4(KT // 2, 2, L4) + j // 4
    r = j % 4
    live = tile < TILES
    # [Note: block order]: lane 4g + t's blocks t and t + 4 of a tile are stored blocks 2t and 2t + 1 (one 8-byte
    # load per row); so the tile's logical block L is stored block 2 (L % 4) + L // 4, and register i of B, logical
    # columns 2t + 8i and 2t + 8i + 1 (block t // 2 + 2i), reads the matching stored columns of x
    blk = t // 2 + 2 * r
    xb = gl.load(x_ptr + g * stride_xm + tile * 16 + 2 * (2 * (blk % 4) + blk // 4) + t % 2, mask=(g < M) & live,
                 other=0)
    a_row = 16 * warp + g + 8 * ((j // 2) % 2)  # not (r // 2): Triton then sees no 8-byte pairs
    a_col = tile * 8 + 2 * t + j % 2

    m_row, m_tile, m_live, m_shift = _meta_index(pid_k, TILES, KT, num_warps, M3)

    # where the sums go: slot j of lane 4g + t is weight row g + 8 (j // 2), row 2t + j % 2 of x (slots 4-7 unused)
    lane_o = _along3(32, 1, O3)
    j_o = _along3(8, 2, O3)
    o_row = 16 * _along3(num_warps, 0, O3) + lane_o // 4 + 8 * (j_o // 2)
    o_m = 2 * (lane_o % 4) + j_o % 2
    o_live = (j_o < 4) & (o_m < M)

    row0 = pid_r * (ROWS * ROW_BLOCKS)
    if DEPTH > 0:
        a_1, e_1 = _load_rows(w_ptr, meta_ptr, row0, a_row, a_col, live, m_row, m_tile, m_live, m_shift, N,
                              stride_wn, stride_mn)
        a_2, e_2 = a_1, e_1
        if DEPTH == 2:
            a_2, e_2 = _load_rows(w_ptr, meta_ptr, gl.where(ROW_BLOCKS > 1, row0 + ROWS, N), a_row, a_col, live,
                                  m_row, m_tile, m_live, m_shift, N, stride_wn, stride_mn)
    for b in range(ROW_BLOCKS):
        rows = row0 + b * ROWS
        if DEPTH == 0:  # no prefetch: the block is loaded where it is used (other warps hide the wait)
            a, e = _load_rows(w_ptr, meta_ptr, rows, a_row, a_col, live, m_row, m_tile, m_live, m_shift, N,
                              stride_wn, stride_mn)
        else:
            a = a_1
            e = e_1
            nxt = gl.where(b + DEPTH < ROW_BLOCKS, rows + DEPTH * ROWS, N)  # past the last block: nothing (masked)
            if DEPTH == 2:
                a_1, e_1 = a_2, e_2
                a_2, e_2 = _load_rows(w_ptr, meta_ptr, nxt, a_row, a_col, live, m_row, m_tile, m_live, m_shift, N,
                                      stride_wn, stride_mn)
            else:
                a_1, e_1 = _load_rows(w_ptr, meta_ptr, nxt, a_row, a_col, live, m_row, m_tile, m_live, m_shift, N,
                                      stride_wn, stride_mn)
        e4 = gl.broadcast(gl.expand_dims(e, 3), a)[0]
        d = gl.inline_asm_elementwise(_ASM_PAIR, _ASM_IO, [a, xb, e4], dtype=gl.float32, is_pure=True, pack=8)
        acc = gl.sum(d, axis=2)  # the pairs of tiles, in registers
        row = rows + o_row
        _store_sums(acc, out_ptr, part_ptr, row, o_m, o_live & (row < N), N, SPLIT, pid_k, stride_om, PARTIAL)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_r, row0, 0, M, N, SPLIT, stride_om, ROWS * ROW_BLOCKS, FIX_K,
                   num_warps)


@gluon.jit
def _store_sums(acc, out_ptr, part_ptr, row, o_m, mask, N, SPLIT, pid_k, stride_om, PARTIAL: gl.constexpr):
    """A block's sums: with one slice the output itself (in its dtype), else this slice's fp32 partials."""
    if PARTIAL:
        gl.store(part_ptr + (o_m * SPLIT + pid_k) * N + row, acc, mask=mask)
    else:
        gl.store(out_ptr + o_m * stride_om + row, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _fold_k_sums(sums, out_ptr, part_ptr, row0, M, N, SPLIT, pid_k, stride_om, ROW_BLOCKS: gl.constexpr,
                 WR: gl.constexpr, WK: gl.constexpr, PARTIAL: gl.constexpr, num_warps: gl.constexpr):
    """With folded rows and warps along ``K`` ([Note: fold warps along K]): the warps' sums of every block
    (``sums``, shared memory ``(ROW_BLOCKS, WR, 32, WK)``: lane ``4g + t`` of the row warp's block, weight row ``8 *
    (row warp) + g`` times row ``t`` of ``x``), added across the ``WK`` warps along ``K`` and stored."""
    FL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, WK], threads_per_warp=[1, 32, 1],
                                        warps_per_cta=[num_warps, 1, 1], order=[2, 1, 0])
    F2: gl.constexpr = gl.SliceLayout(2, FL)
    wr = gl.arange(0, WR, layout=gl.SliceLayout(1, F2))[:, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, F2))[None, :]
    o_m = lane % 4 + 0 * wr
    for blk in range(ROW_BLOCKS):
        row = row0 + blk * (8 * WR) + 8 * wr + lane // 4
        _store_sums(gl.sum(sums.index(blk).load(FL), axis=2), out_ptr, part_ptr, row, o_m, (o_m < M) & (row < N), N,
                    SPLIT, pid_k, stride_om, PARTIAL)


@gluon.jit
def _held_sums(held, out_ptr, part_ptr, row0, M, N, SPLIT, pid_k, stride_om, WR: gl.constexpr, PARTIAL: gl.constexpr):
    """With folded rows and warps along ``K`` ([Note: fold warps along K] in ``_dense_mma_kernels``): the warps' sums
    of every block held in registers (``held``, ``(ROW_BLOCKS, WR, 32, WK)``, lane ``4g + t`` of the row warp's
    block: weight row ``8 * (row warp) + g`` times row ``t`` of ``x``), added across the ``WK`` warps along ``K`` and
    stored."""
    tot = gl.sum(held, axis=3)
    L3: gl.constexpr = tot.type.layout
    lane = _along3(32, 2, L3)
    o_m = lane % 4
    row = row0 + _along3(held.shape[0], 0, L3) * (8 * WR) + 8 * _along3(WR, 1, L3) + lane // 4
    _store_sums(tot, out_ptr, part_ptr, row, o_m, (o_m < M) & (row < N), N, SPLIT, pid_k, stride_om, PARTIAL)


@gluon.jit
def _late_sums_keeper(ROW_BLOCKS: gl.constexpr, WR: gl.constexpr, WK: gl.constexpr, LATE: gl.constexpr):
    """Where a program with folded rows and warps along ``K`` keeps its warps' sums of every block until the last
    ([Note: fold warps along K] in ``_dense_mma_kernels``): ``LATE`` 1, shared memory ``(ROW_BLOCKS, WR, 32, WK)``;
    2, registers of that shape (a lane's sum of each block), zeroed; 0, nowhere (``0``). Returns it and, for 2, each
    register's block."""
    if LATE == 0:
        return 0, 0
    elif LATE == 1:
        PL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])  # (of a block's buffer)
        return gl.allocate_shared_memory(gl.float32, [ROW_BLOCKS, WR, 32, WK], PL), 0
    else:
        RL: gl.constexpr = gl.BlockedLayout(size_per_thread=[ROW_BLOCKS, 1, 1, 1], threads_per_warp=[1, 1, 32, 1],
                                            warps_per_cta=[1, WR, 1, WK], order=[3, 2, 1, 0])
        return gl.zeros([ROW_BLOCKS, WR, 32, WK], gl.float32, RL), _along4(ROW_BLOCKS, 0, RL)


@gluon.jit
def _block_sums(kept, which, d, blk, row, o_m, out_ptr, part_ptr, M, N, SPLIT, pid_k, stride_om, WR: gl.constexpr,
                WK: gl.constexpr, PARTIAL: gl.constexpr, LATE: gl.constexpr):
    """Block ``blk``'s sums with folded rows (``d``: ``(WR, 32, WK * per warp)``, slice ``kw * per + j`` being warp
    ``kw``'s ``j``; weight rows ``row``, rows ``o_m`` of ``x``): with ``LATE`` each warp's own kept in ``kept``
    (:func:`_late_sums_keeper`), else added across the warps along ``K`` (in shared memory) and stored now. Returns
    ``kept``."""
    if LATE == 0:
        _store_sums(gl.sum(d, axis=2), out_ptr, part_ptr, row, o_m, (o_m < M) & (row < N), N, SPLIT, pid_k, stride_om,
                    PARTIAL)
    else:
        own = gl.sum(gl.reshape(d, [WR, 32, WK, d.shape[2] // WK]), axis=3)
        if LATE == 1:
            kept.index(blk).store(own)
        else:
            own = gl.convert_layout(own, gl.SliceLayout(0, kept.type.layout))
            kept = gl.where(which == blk, gl.expand_dims(own, 0), kept)
    return kept


@gluon.jit
def _late_sums(kept, out_ptr, part_ptr, row0, M, N, SPLIT, pid_k, stride_om, ROW_BLOCKS: gl.constexpr,
               WR: gl.constexpr, WK: gl.constexpr, PARTIAL: gl.constexpr, LATE: gl.constexpr, num_warps: gl.constexpr):
    """After the last block: the kept sums (:func:`_late_sums_keeper`) added across the warps along ``K`` and
    stored."""
    if LATE == 1:
        _cta_barrier()
        _fold_k_sums(kept, out_ptr, part_ptr, row0, M, N, SPLIT, pid_k, stride_om, ROW_BLOCKS, WR, WK, PARTIAL,
                     num_warps)
    else:
        _held_sums(kept, out_ptr, part_ptr, row0, M, N, SPLIT, pid_k, stride_om, WR, PARTIAL)


@gluon.jit
def _fold_end(kept, out_ptr, part_ptr, count_ptr, pid_r, row0, M, N, SPLIT, pid_k, stride_om, RUN: gl.constexpr,
              ROW_BLOCKS: gl.constexpr, WR: gl.constexpr, WK: gl.constexpr, PARTIAL: gl.constexpr, FIX_K: gl.constexpr,
              LATE: gl.constexpr, num_warps: gl.constexpr):
    """The end of a program with folded rows: the kept sums of every block stored (``LATE`` > 0, :func:`_late_sums`),
    then with more than one slice of ``K`` the run's fix-up (:func:`finish_run`)."""
    if LATE > 0:
        _late_sums(kept, out_ptr, part_ptr, row0, M, N, SPLIT, pid_k, stride_om, ROW_BLOCKS, WR, WK, PARTIAL, LATE,
                   num_warps)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_r, row0, 0, M, N, SPLIT, stride_om, RUN, FIX_K, num_warps)


@gluon.jit
def finish_run(part_ptr, count_ptr, out_ptr, run_index, row0, M0, M, N, SPLIT, stride_om, RUN: gl.constexpr,
               FIX_K: gl.constexpr, num_warps: gl.constexpr):
    """After a program stored its partials (``(rows of x, SPLIT, N)`` fp32) for weight rows ``row0 .. row0 + RUN -
    1`` and rows ``M0 .. M - 1`` of ``x``: count it done on the run's counter (``run_index``); the run's last slice
    sums the partials in slice order into the output and resets the counter ([Note: split-K fix-up] in ``_word``).
    Two batches of ``FIX_K`` slices are in flight before either is added."""
    _cta_barrier()
    counter = count_ptr + run_index
    done = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT - 1:
        fix_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32],
                                               warps_per_cta=[1, num_warps], order=[1, 0])
        run = row0 + gl.arange(0, RUN, layout=gl.SliceLayout(0, fix_l))[None, :]
        kc = gl.arange(0, FIX_K, layout=gl.SliceLayout(1, fix_l))[:, None]
        for m in range(M0, M):
            total = gl.zeros([RUN], gl.float32, gl.SliceLayout(0, fix_l))
            for k0 in range(0, SPLIT, 2 * FIX_K):
                s0 = k0 + kc
                s1 = k0 + FIX_K + kc
                first = gl.load(part_ptr + (m * SPLIT + s0) * N + run, mask=(s0 < SPLIT) & (run < N), other=0.0,
                                cache_modifier=".cg")
                second = gl.load(part_ptr + (m * SPLIT + s1) * N + run, mask=(s1 < SPLIT) & (run < N), other=0.0,
                                 cache_modifier=".cg")
                total += gl.sum(first, axis=0)
                total += gl.sum(second, axis=0)
            orow = row0 + gl.arange(0, RUN, layout=gl.SliceLayout(0, fix_l))
            gl.store(out_ptr + m * stride_om + orow, total.to(out_ptr.dtype.element_ty), mask=orow < N)
        gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _stripe_b(x_ptr, stride_xm, M, pid_k, stripes, Q: gl.constexpr, STRIPE: gl.constexpr, L4: gl.constexpr,
              XVEC: gl.constexpr, num_warps: gl.constexpr):
    """The ``B`` registers of a slice read in stripes ([Note: INT4 stripes], [Note: 2:4 stripes]), loaded once: axis 2
    the stripe ``q``, axis 3 its tile ``s``; register ``i`` holds logical block ``L = t // 2 + 2i`` of the tile, stored
    block ``2 STRIPE (L % 4) + 2s + L // 4`` of the stripe (zero past ``K`` and past ``M``). Returns the four, the lane
    value ``t // 2 + 4 (t % 2)`` that the asm's metadata gather takes, and ``g``, ``t``, ``q``, ``s``.

    As int32 pairs of ``x`` that is ``4s + t % 2`` (registers 0 and 1) or ``4s + 2 + t % 2`` (2 and 3) past ``4 STRIPE
    (t // 2)`` (0 and 2) or ``4 STRIPE (t // 2 + 2)`` (1 and 3) in the stripe: every other int32 of two runs of ``4
    STRIPE``. With ``XVEC`` a lane loads both runs whole, 16 bytes a tile ([Note: x a word at a time] in
    ``_dense_mma_kernels``), and keeps the int32 of its parity ``t % 2``; otherwise one 4-byte load a register."""
    lane = _along4(32, 1, L4)
    g = lane // 4
    t = lane % 4
    q = pid_k * Q + _along4(Q, 2, L4)
    s = _along4(STRIPE, 3, L4)
    t2 = t // 2
    if XVEC:
        b0, b2 = _stripe_run(x_ptr, stride_xm, M, pid_k, stripes, 0, Q, STRIPE, L4, num_warps)
        b1, b3 = _stripe_run(x_ptr, stride_xm, M, pid_k, stripes, 8 * STRIPE, Q, STRIPE, L4, num_warps)
    else:
        xmask = (g < M) & (q < stripes)
        xrow = x_ptr + g * stride_xm + q * (16 * STRIPE) + 4 * s + t % 2
        b0 = gl.load(xrow + 2 * (2 * STRIPE * (t2 % 4) + t2 // 4), mask=xmask, other=0)
        b1 = gl.load(xrow + 2 * (2 * STRIPE * ((t2 + 2) % 4) + (t2 + 2) // 4), mask=xmask, other=0)
        b2 = gl.load(xrow + 2 * (2 * STRIPE * ((t2 + 4) % 4) + (t2 + 4) // 4), mask=xmask, other=0)
        b3 = gl.load(xrow + 2 * (2 * STRIPE * ((t2 + 6) % 4) + (t2 + 6) // 4), mask=xmask, other=0)
    return b0, b1, b2, b3, gl.zeros_like(b0) + (t2 + 4 * (t % 2)), g, t, q, s


@gluon.jit
def _stripe_run(x_ptr, stride_xm, M, pid_k, stripes, OFF: gl.constexpr, Q: gl.constexpr, STRIPE: gl.constexpr,
                L4: gl.constexpr, num_warps: gl.constexpr):
    """Two ``B`` registers of each tile from the lane's run of ``4 STRIPE`` int32 of ``x`` at ``4 STRIPE (t // 2) +
    OFF`` in each stripe (:func:`_stripe_b`), read 16 bytes a tile: int32 ``4s + t % 2`` and ``4s + 2 + t % 2``."""
    L5: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, Q, STRIPE, 4], threads_per_warp=[1, 32, 1, 1, 1],
                                        warps_per_cta=[num_warps, 1, 1, 1, 1], order=[4, 3, 2, 1, 0])
    S4: gl.constexpr = gl.SliceLayout(4, L5)
    lane = _along4(32, 1, S4)
    g = lane // 4
    t = lane % 4
    q = pid_k * Q + _along4(Q, 2, S4)
    s = _along4(STRIPE, 3, S4)
    e5 = _along5_last(4, L5)
    at = g * stride_xm + q * (16 * STRIPE) + 4 * STRIPE * (t // 2) + OFF + 4 * s
    v = gl.load(x_ptr + gl.expand_dims(at, 4) + e5, mask=gl.expand_dims((g < M) & (q < stripes), 4) & (e5 < 4),
                other=0)
    v0, v1, v2, v3 = _split4(v)
    odd = gl.convert_layout(t % 2, v0.type.layout) == 1
    return (gl.convert_layout(gl.where(odd, v1, v0), L4), gl.convert_layout(gl.where(odd, v3, v2), L4))


@gluon.jit
def _split4(v):
    """The four values of ``v``'s last axis (4 a thread), in order, each without it."""
    even, odd = gl.split(gl.reshape(v, v.shape[:-1] + [2, 2]))  # (the last axis of the reshape is the index's bit 0)
    v0, v2 = gl.split(even)
    v1, v3 = gl.split(odd)
    return v0, v1, v2, v3


@gluon.jit
def _stripe_slots(M, STRIPE: gl.constexpr, O3: gl.constexpr, num_warps: gl.constexpr):
    """Where a stripe's sums go: slot ``j`` is weight row ``g + 8 (j // 2)`` of the block, row ``2t + j % 2`` of ``x``
    (two slots a stripe of 2: row ``g``, then ``g + 8``). ``(weight row, row of x, live)``."""
    lane_o = _along3(32, 1, O3)
    slot = _along3(STRIPE, 2, O3)
    o_m = 2 * (lane_o % 4) + slot % 2
    return 16 * _along3(num_warps, 0, O3) + lane_o // 4 + 8 * (slot // 2), o_m, o_m < M


@gluon.jit
def w4_codes(w_ptr, z_ptr, ra, col, z_col, live, N, stride_wn, stride_zn, HAS_ZEROS: gl.constexpr):
    """2:4 + INT4 (the 2:4 GEMM): a tile's codes of rows ``ra`` (low 16 bits) and ``ra + 8`` (high) from the int16 at
    ``col`` (the lane's two stored blocks of the tile, [Note: INT4 stripes]), and both rows' zero points at ``z_col``
    (8 without zero points)."""
    lo = gl.load(w_ptr + ra * stride_wn + col, mask=(ra < N) & live, other=0).to(gl.int32) & 0xFFFF
    hi = gl.load(w_ptr + (ra + 8) * stride_wn + col, mask=(ra + 8 < N) & live, other=0).to(gl.int32)
    codes = lo | (hi << 16)
    if HAS_ZEROS:
        z0 = gl.load(z_ptr + ra * stride_zn + z_col, mask=(ra < N) & live, other=0).to(gl.int32)
        z1 = gl.load(z_ptr + (ra + 8) * stride_zn + z_col, mask=(ra + 8 < N) & live, other=0).to(gl.int32)
    else:
        z0 = gl.zeros_like(codes) + 8
        z1 = z0
    return codes, z0, z1


@gluon.jit
def _w4_block(w_ptr, meta_ptr, s_ptr, z_ptr, rows, a_row, a_col, g_col, m_row, m_col, N, stride_wn, stride_mn,
              stride_sn, stride_zn, HAS_ZEROS: gl.constexpr):
    """A block's operands of every stripe of the slice, rows ``g`` and ``g + 8`` each: the lane's codes, the stripe's
    positions, zero points (int32) and scales (fp32). Unmasked ([Note: INT4 stripes]): rows from ``N`` on read row
    ``N - 1`` (their sums are not stored); the callers clamp the stripes past ``K`` the same way."""
    rg = gl.minimum(rows + a_row, N - 1)
    rh = gl.minimum(rows + a_row + 8, N - 1)
    mg = gl.load(meta_ptr + gl.minimum(rows + m_row, N - 1) * stride_mn + m_col)
    mh = gl.load(meta_ptr + gl.minimum(rows + m_row + 8, N - 1) * stride_mn + m_col)
    zg, zh, sg, sh = group_params(s_ptr, z_ptr, rg, rh, g_col, stride_sn, stride_zn, HAS_ZEROS)
    return gl.load(w_ptr + rg * stride_wn + a_col), gl.load(w_ptr + rh * stride_wn + a_col), mg, mh, zg, zh, sg, sh


@gluon.jit
def group_params(s_ptr, z_ptr, rg, rh, col, stride_sn, stride_zn, HAS_ZEROS: gl.constexpr):
    """The zero points (int32; 8 without them) and scales (fp32) of rows ``rg`` and ``rh`` at group column ``col``."""
    if HAS_ZEROS:
        zg = gl.load(z_ptr + rg * stride_zn + col).to(gl.int32)
        zh = gl.load(z_ptr + rh * stride_zn + col).to(gl.int32)
    else:
        zg = gl.zeros_like(col) + 8
        zh = zg
    sg = gl.load(s_ptr + rg * stride_sn + col).to(gl.float32)
    sh = gl.load(s_ptr + rh * stride_sn + col).to(gl.float32)
    return zg, zh, sg, sh


@gluon.jit
def sparse_mma_w4_kernel(x_ptr, w_ptr, meta_ptr, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, TILES, SPLIT,
                         stride_xm, stride_wn, stride_mn, stride_sn, stride_zn, stride_om, GROUP: gl.constexpr,
                         HAS_ZEROS: gl.constexpr, KT: gl.constexpr, STRIPE: gl.constexpr, ROW_BLOCKS: gl.constexpr,
                         DEPTH: gl.constexpr, EVEN_K: gl.constexpr, PARTIAL: gl.constexpr, FIX_K: gl.constexpr,
                         ASM: gl.constexpr, ASM_IO: gl.constexpr, XVEC: gl.constexpr, num_warps: gl.constexpr):
    """2:4 + INT4: ``out[M, N] = x @ densify(dequant(codes), meta)^T`` for ``M <= 8`` ([Note: 2:4 GEMV on sparse
    tensor cores], [Note: 2:4 + INT4 on sparse tensor cores], [Note: INT4 stripes]).

    ``w_ptr``: the kept values' codes (N, K / 4) uint8 read as int64 (stripes of 4 tiles) or int32 (2), a lane's part
    of a stripe each; ``meta_ptr``: the positions (N, K / 8) uint8 read as int32 words; ``s_ptr`` / ``z_ptr``: scales
    and zero points (uint8; ``HAS_ZEROS`` false: 8) per (row, group of ``GROUP`` original columns, a multiple of
    ``32 * STRIPE``); ``ASM`` / ``ASM_IO``: ``w4_stripe_asm(STRIPE)``. ``KT`` (a multiple of ``STRIPE``) tiles a slice;
    ``DEPTH`` 1 loads the next block's operands while this one multiplies (0: each where it is used); ``EVEN_K``: the
    slices are whole (``KT`` divides ``TILES``); ``XVEC``: ``x`` read 16 bytes a tile (:func:`_stripe_b`); the rest
    as ``sparse_mma_kernel``."""
    Q: gl.constexpr = KT // STRIPE  # stripes a slice
    L4: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, Q, STRIPE], threads_per_warp=[1, 32, 1, 1],
                                        warps_per_cta=[num_warps, 1, 1, 1], order=[3, 2, 1, 0])
    Q3: gl.constexpr = gl.SliceLayout(3, L4)  # per stripe
    O3: gl.constexpr = gl.SliceLayout(2, L4)  # per accumulator slot
    ROWS: gl.constexpr = 16 * num_warps
    pid_r = gl.program_id(0)
    pid_k = gl.program_id(1)
    stripes = TILES // STRIPE

    b0, b1, b2, b3, lane_v, g, t, q, s = _stripe_b(x_ptr, stride_xm, M, pid_k, stripes, Q, STRIPE, L4, XVEC,
                                                   num_warps)
    # metadata: both rows' words of each stripe, every lane of a quad the same STRIPE words (one vector load); the
    # weights are read unmasked: stripes past K read the last one (x is zero there), rows past N row N - 1
    # (EVEN_K: every slice whole, nothing to clamp, and a slice's scales of a row contiguous: one vector load)
    m_row = 16 * _along4(num_warps, 0, L4) + g
    lane3 = _along3(32, 1, Q3)
    q3 = pid_k * Q + _along3(Q, 2, Q3)
    if EVEN_K:
        m_col = q * STRIPE + s
    else:
        m_col = gl.minimum(q, stripes - 1) * STRIPE + s
        q3 = gl.minimum(q3, stripes - 1)
    # codes, scales, zero points: one per stripe and row
    a_row = 16 * _along3(num_warps, 0, Q3) + lane3 // 4
    a_col = q3 * 4 + lane3 % 4
    g_col = q3 // (GROUP // (32 * STRIPE))

    o_row, o_m, o_live = _stripe_slots(M, STRIPE, O3, num_warps)

    row0 = pid_r * (ROWS * ROW_BLOCKS)
    if DEPTH == 1:
        nxt = _w4_block(w_ptr, meta_ptr, s_ptr, z_ptr, row0, a_row, a_col, g_col, m_row, m_col, N, stride_wn,
                        stride_mn, stride_sn, stride_zn, HAS_ZEROS)
    for blk in range(ROW_BLOCKS):
        rows = row0 + blk * ROWS
        if DEPTH == 1:  # this block's operands were loaded during the last one; the next block's go in flight now
            cg, ch, mg, mh, zg, zh, sg, sh = nxt
            if blk + 1 < ROW_BLOCKS:
                nxt = _w4_block(w_ptr, meta_ptr, s_ptr, z_ptr, rows + ROWS, a_row, a_col, g_col, m_row, m_col, N,
                                stride_wn, stride_mn, stride_sn, stride_zn, HAS_ZEROS)
        else:
            cg, ch, mg, mh, zg, zh, sg, sh = _w4_block(w_ptr, meta_ptr, s_ptr, z_ptr, rows, a_row, a_col, g_col, m_row,
                                                       m_col, N, stride_wn, stride_mn, stride_sn, stride_zn, HAS_ZEROS)
        nzg = gl.broadcast(gl.expand_dims((zg | 0xC300) * 0x10001, 3), b0)[0]  # -(128 + zero) in both halves
        nzh = gl.broadcast(gl.expand_dims((zh | 0xC300) * 0x10001, 3), b0)[0]
        cg4 = gl.broadcast(gl.expand_dims(cg, 3), b0)[0]
        ch4 = gl.broadcast(gl.expand_dims(ch, 3), b0)[0]
        sg4 = gl.expand_dims(sg, 3)
        sh4 = gl.expand_dims(sh, 3)
        row = rows + o_row
        ops = [cg4, ch4, b0, b1, b2, b3, mg, mh, nzg, nzh, lane_v]
        if STRIPE == 4:  # one output, slots 0-3
            d = gl.inline_asm_elementwise(ASM, ASM_IO, ops, dtype=gl.float32, is_pure=True, pack=4)
            acc = gl.sum(d * gl.where(s < 2, sg4, sh4), axis=2)
            _store_sums(acc, out_ptr, part_ptr, row, o_m, o_live & (row < N), N, SPLIT, pid_k, stride_om, PARTIAL)
        else:  # two outputs, rows g and g + 8
            d0, d1 = gl.inline_asm_elementwise(ASM, ASM_IO, ops, dtype=(gl.float32, gl.float32), is_pure=True, pack=2)
            acc0 = gl.sum(d0 * sg4, axis=2)
            acc1 = gl.sum(d1 * sh4, axis=2)
            _store_sums(acc0, out_ptr, part_ptr, row, o_m, o_live & (row < N), N, SPLIT, pid_k, stride_om, PARTIAL)
            _store_sums(acc1, out_ptr, part_ptr, row + 8, o_m, o_live & (row + 8 < N), N, SPLIT, pid_k, stride_om,
                        PARTIAL)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_r, row0, 0, M, N, SPLIT, stride_om, ROWS * ROW_BLOCKS, FIX_K,
                   num_warps)


@gluon.jit
def _s24_block(w_ptr, meta_ptr, rows, a_row, a_col, m_row, m_col, N, stride_wn, stride_mn):
    """A block's operands of every stripe of the slice, rows ``g`` and ``g + 8`` each: the lane's value words of every
    tile (64 bits a tile) and the stripe's positions. Unmasked ([Note: 2:4 stripes]): rows from ``N`` on read row
    ``N - 1``; the caller clamps the stripes past ``K``."""
    rg = gl.minimum(rows + a_row, N - 1)
    rh = gl.minimum(rows + a_row + 8, N - 1)
    mg = gl.load(meta_ptr + gl.minimum(rows + m_row, N - 1) * stride_mn + m_col)
    mh = gl.load(meta_ptr + gl.minimum(rows + m_row + 8, N - 1) * stride_mn + m_col)
    return gl.load(w_ptr + rg * stride_wn + a_col), gl.load(w_ptr + rh * stride_wn + a_col), mg, mh


@gluon.jit
def sparse_mma_stripe_kernel(x_ptr, w_ptr, meta_ptr, part_ptr, count_ptr, out_ptr, M, N, TILES, SPLIT,
                             stride_xm, stride_wn, stride_mn, stride_om, KT: gl.constexpr, STRIPE: gl.constexpr,
                             ROW_BLOCKS: gl.constexpr, DEPTH: gl.constexpr, EVEN_K: gl.constexpr,
                             PARTIAL: gl.constexpr, FIX_K: gl.constexpr, ASM: gl.constexpr, ASM_IO: gl.constexpr,
                             num_warps: gl.constexpr):
    """Plain 2:4 in stripes: ``out[M, N] = x @ densify(values, meta)^T`` for ``M <= 8`` ([Note: 2:4 stripes]).

    ``w_ptr``: the kept values (N, K / 2) bf16 read as int64 (N, K / 8), two value words a tile and lane; ``meta_ptr``:
    the positions (N, K / 8) uint8 read as int32 words; ``ASM`` / ``ASM_IO``: ``s24_stripe_asm(STRIPE)``; the rest as
    ``sparse_mma_w4_kernel``."""
    Q: gl.constexpr = KT // STRIPE  # stripes a slice
    L4: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, Q, STRIPE], threads_per_warp=[1, 32, 1, 1],
                                        warps_per_cta=[num_warps, 1, 1, 1], order=[3, 2, 1, 0])
    O3: gl.constexpr = gl.SliceLayout(2, L4)  # per accumulator slot
    ROWS: gl.constexpr = 16 * num_warps
    pid_r = gl.program_id(0)
    pid_k = gl.program_id(1)
    stripes = TILES // STRIPE

    b0, b1, b2, b3, lane_v, g, t, q, s = _stripe_b(x_ptr, stride_xm, M, pid_k, stripes, Q, STRIPE, L4, False,
                                                   num_warps)  # (4-byte loads: the 16-byte ones lost here)
    # values: lane t's stored blocks 2 STRIPE t .. 2 STRIPE t + 2 STRIPE - 1 of the stripe, tile s the 64-bit pair
    # 2s, 2s + 1 (its logical blocks t and t + 4); metadata: both rows' STRIPE words, every lane of a quad the same
    w_row = 16 * _along4(num_warps, 0, L4) + g
    if EVEN_K:
        qc = q
    else:
        qc = gl.minimum(q, stripes - 1)  # stripes past K read the last one (x is zero there)
    a_col = qc * (4 * STRIPE) + t * STRIPE + s
    m_col = qc * STRIPE + s

    o_row, o_m, o_live = _stripe_slots(M, STRIPE, O3, num_warps)

    row0 = pid_r * (ROWS * ROW_BLOCKS)
    if DEPTH == 1:
        nxt = _s24_block(w_ptr, meta_ptr, row0, w_row, a_col, w_row, m_col, N, stride_wn, stride_mn)
    for blk in range(ROW_BLOCKS):
        rows = row0 + blk * ROWS
        if DEPTH == 1:  # this block's operands were loaded during the last one; the next block's go in flight now
            vg, vh, mg, mh = nxt
            if blk + 1 < ROW_BLOCKS:
                nxt = _s24_block(w_ptr, meta_ptr, rows + ROWS, w_row, a_col, w_row, m_col, N, stride_wn, stride_mn)
        else:
            vg, vh, mg, mh = _s24_block(w_ptr, meta_ptr, rows, w_row, a_col, w_row, m_col, N, stride_wn, stride_mn)
        row = rows + o_row
        ops = [vg, vh, b0, b1, b2, b3, mg, mh, lane_v]
        if STRIPE == 4:  # one output, slots 0-3
            d = gl.inline_asm_elementwise(ASM, ASM_IO, ops, dtype=gl.float32, is_pure=True, pack=4)
            acc = gl.sum(d, axis=2)
            _store_sums(acc, out_ptr, part_ptr, row, o_m, o_live & (row < N), N, SPLIT, pid_k, stride_om, PARTIAL)
        else:  # two outputs, rows g and g + 8
            d0, d1 = gl.inline_asm_elementwise(ASM, ASM_IO, ops, dtype=(gl.float32, gl.float32), is_pure=True, pack=2)
            acc0 = gl.sum(d0, axis=2)
            acc1 = gl.sum(d1, axis=2)
            _store_sums(acc0, out_ptr, part_ptr, row, o_m, o_live & (row < N), N, SPLIT, pid_k, stride_om, PARTIAL)
            _store_sums(acc1, out_ptr, part_ptr, row + 8, o_m, o_live & (row + 8 < N), N, SPLIT, pid_k, stride_om,
                        PARTIAL)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_r, row0, 0, M, N, SPLIT, stride_om, ROWS * ROW_BLOCKS, FIX_K,
                   num_warps)


@functools.cache
def s24_fold_asm() -> tuple[str, str]:
    """Plain 2:4 with folded rows ([Note: 2:4 folded rows]): the inline asm of one pair of MMAs and its constraints,
    for ``pack=4``. Operands in order, four each (slot ``u`` of the pair: MMA ``u // 2``, words ``2 (u % 2)`` and
    ``2 (u % 2) + 1`` of the lane's quad): the lane's value words (64 bits), the four ``B`` registers (read at slots 0
    and 2), the lane's 8 position bytes of its MMA (``t // 2``; read at slot 0) and its byte selector ``0x6420 +
    0x1111 (t % 2)`` (slot 0). Out: slot 0 the pair's sum of weight row ``g`` times row ``t`` of ``x``, the other
    slots ``-0.0`` (the caller splits them off)."""
    lines = ["{", ".reg .b32 a<4>, c<4>, e, u, v, lo, hi, m, p0, p1;", ".reg .f32 d<4>, z;", "mov.f32 z, 0f00000000;",
             # the metadata register: bytes 2L + t % 2 of the MMA's positions, then their low nibbles (row g: the
             # first segment) in the low half and their high nibbles (row g + 8: the second) in the high half
             "mov.b64 {p0, p1}, $24;", "prmt.b32 e, p0, p1, $28;", "shr.b32 u, e, 4;", "shr.b32 v, e, 8;",
             "lop3.b32 lo, e, u, 0x0F0F0F0F, 0xE4;", "lop3.b32 hi, u, v, 0x0F0F0F0F, 0xE4;",
             "prmt.b32 m, lo, hi, 0x6420;",
             "mov.b64 {a0, a1}, $4;", "mov.b64 {a2, a3}, $5;", "mov.b64 {c0, c1}, $6;", "mov.b64 {c2, c3}, $7;",
             f"{_MMA} {{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {{$8, $12, $16, $20}}, {{z, z, z, z}}, m, 0x0;",
             f"{_MMA} {{d0, d1, d2, d3}}, {{c0, c1, c2, c3}}, {{$10, $14, $18, $22}}, {{d0, d1, d2, d3}}, m, 0x1;",
             "add.f32 $0, d0, d3;", "mov.f32 $1, 0f80000000;", "mov.f32 $2, 0f80000000;", "mov.f32 $3, 0f80000000;",
             "}"]
    return "\n".join(lines), ",".join(["=f"] * 4 + ["l"] * 4 + ["r"] * 16 + ["l"] * 4 + ["r"] * 4)


@gluon.jit
def _fold_slots(num_warps: gl.constexpr, O2: gl.constexpr):
    """Where a lane's sum with folded rows goes ([Note: 2:4 folded rows]): lane ``4g + t`` of warp ``w`` holds
    weight row ``8w + g`` of the block times row ``t`` of ``x``. ``(weight row, row of x)`` in the layout ``O2``."""
    o_row = 8 * gl.arange(0, num_warps, layout=gl.SliceLayout(1, O2))[:, None] \
        + gl.arange(0, 32, layout=gl.SliceLayout(0, O2))[None, :] // 4
    return o_row, gl.arange(0, 32, layout=gl.SliceLayout(0, O2))[None, :] % 4 + 0 * o_row


@gluon.jit
def _fold_b(xrow, xmask, t, STEP: gl.constexpr):
    """The four ``B`` registers with folded rows ([Note: 2:4 folded rows]): register ``i`` holds logical block ``L = t
    // 2 + 2i``, the int32 pair at ``xrow + STEP (L % 4) + 4 (L // 4)`` (``STEP`` 8 for plain 2:4, 16 for 2:4 + INT4's
    pairs of MMAs); zero where ``xmask`` is false."""
    t2 = t // 2
    return (gl.load(xrow + STEP * t2, mask=xmask, other=0), gl.load(xrow + STEP * (t2 + 2), mask=xmask, other=0),
            gl.load(xrow + STEP * t2 + 4, mask=xmask, other=0),
            gl.load(xrow + STEP * (t2 + 2) + 4, mask=xmask, other=0))


@gluon.jit
def _fold_block(w_ptr, meta_ptr, rows, w_row, a_col, m_row, m_col, N, stride_wn, stride_mn):
    """A block's operands with folded rows ([Note: 2:4 folded rows]): the lane's value quads (two 64-bit halves an
    MMA) and the 8 position bytes of its MMA of each pair. Unmasked: rows from ``N`` on read row ``N - 1``; the caller
    clamps the MMAs past ``K``."""
    v = gl.load((w_ptr + gl.minimum(rows + w_row, N - 1) * stride_wn + a_col[0]) + a_col[1])
    return v, gl.load((meta_ptr + gl.minimum(rows + m_row, N - 1) * stride_mn + m_col[0]) + m_col[1])


@gluon.jit
def sparse_mma_fold_kernel(x_ptr, w_ptr, meta_ptr, part_ptr, count_ptr, out_ptr, M, N, MMAS, SPLIT,
                           stride_xm, stride_wn, stride_mn, stride_om, KP: gl.constexpr, ROW_BLOCKS: gl.constexpr,
                           DEPTH: gl.constexpr, EVEN_K: gl.constexpr, PARTIAL: gl.constexpr, FIX_K: gl.constexpr,
                           ASM: gl.constexpr, ASM_IO: gl.constexpr, num_warps: gl.constexpr):
    """Plain 2:4 with folded rows: ``out[M, N] = x @ densify(values, meta)^T`` for ``M <= 4`` ([Note: 2:4 folded
    rows]).

    ``x_ptr``: ``x`` (M, K) bf16 read as int32 pairs; ``w_ptr``: the kept values (N, K / 2) bf16 read as int64 (N, K /
    8); ``meta_ptr``: the positions (N, K / 8) uint8 read as int64 (N, K / 64), one an MMA. ``MMAS = K / 64``. Grid
    ``(runs, SPLIT)``: a program owns ``KP`` pairs of MMAs (128 columns each) of ``K`` and a run of ``ROW_BLOCKS``
    blocks of ``8 * num_warps`` weight rows, warp ``w`` taking rows ``8w .. 8w + 7`` of each; ``DEPTH`` (0, 1 or 2)
    blocks loaded ahead; ``ASM`` / ``ASM_IO``: ``s24_fold_asm()``."""
    L4: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, KP, 4], threads_per_warp=[1, 32, 1, 1],
                                        warps_per_cta=[num_warps, 1, 1, 1], order=[3, 2, 1, 0])
    M3: gl.constexpr = gl.SliceLayout(3, L4)  # one value a pair: the position bytes
    O2: gl.constexpr = gl.SliceLayout(2, M3)  # one value a lane: its sum
    ROWS: gl.constexpr = 8 * num_warps

    pid_k = gl.program_id(1)
    u = _along4(4, 3, L4)  # slot u of a pair: MMA u // 2, half u % 2 of the lane's quad
    mma = pid_k * (2 * KP) + 2 * _along4(KP, 2, L4) + u // 2
    lane = _along4(32, 1, L4)
    g = lane // 4
    t = lane % 4
    # B: column g of the MMA is row g // 2 of x over segment g % 2; register i holds logical block L = t // 2 + 2i,
    # stored block 4 (L % 4) + 2 (L // 4) + g % 2 of the MMA; slots 1 and 3 are not read (zero, no load)
    b0, b1, b2, b3 = _fold_b(x_ptr + (g // 2) * stride_xm + mma * 32 + 2 * (g % 2) + t % 2,
                             (g // 2 < M) & (mma < MMAS) & (u % 2 == 0), t, 8)
    sel = gl.zeros_like(b0) + (0x6420 + 0x1111 * (t % 2))
    w_row = 8 * _along4(num_warps, 0, L4) + g
    lane3 = _along3(32, 1, M3)
    m_row = 8 * _along3(num_warps, 0, M3) + lane3 // 4
    # the lane's quad of its MMA: words 4t .. 4t + 3, as two 64-bit halves; the position bytes of MMA t // 2 of each
    # pair. Each as (a lane's base, a constant offset an element), added to the row's pointer in that order so
    # that the offsets become the loads' immediates
    if EVEN_K:
        a_col = (pid_k * (16 * KP) + 2 * t, 8 * (mma - pid_k * (2 * KP)) + u % 2)
        m_col = (pid_k * (2 * KP) + (lane3 % 4) // 2, 2 * _along3(KP, 2, M3))
    else:  # MMAs past K read the last one (x is zero there)
        a_col = (2 * t, 8 * gl.minimum(mma, MMAS - 1) + u % 2)
        m_col = (0 * lane3, gl.minimum(pid_k * (2 * KP) + 2 * _along3(KP, 2, M3) + (lane3 % 4) // 2, MMAS - 1))

    o_row, o_m = _fold_slots(num_warps, O2)
    pid_r = gl.program_id(0)
    row0 = pid_r * (ROWS * ROW_BLOCKS)
    if DEPTH > 0:
        nxt = _fold_block(w_ptr, meta_ptr, row0, w_row, a_col, m_row, m_col, N, stride_wn, stride_mn)
        nxt2 = nxt
        if DEPTH == 2:
            nxt2 = _fold_block(w_ptr, meta_ptr, row0 + ROWS * (ROW_BLOCKS > 1), w_row, a_col, m_row, m_col, N,
                               stride_wn, stride_mn)
    # (the blocks ahead are carried from one iteration to the next, which costs register copies: with a loop of two
    # blocks an iteration instead, alternating between two sets of registers, ptxas moved each load down to its
    # MMAs, which left nothing in flight ahead)
    for blk in range(ROW_BLOCKS):
        rows = row0 + blk * ROWS
        if DEPTH == 2:  # loaded two blocks ago; the block two ahead goes in flight now
            ops = nxt
            nxt = nxt2
            if blk + 2 < ROW_BLOCKS:
                nxt2 = _fold_block(w_ptr, meta_ptr, rows + 2 * ROWS, w_row, a_col, m_row, m_col, N, stride_wn,
                                   stride_mn)
        elif DEPTH == 1:  # loaded during the last block; the next block goes in flight now
            ops = nxt
            if blk + 1 < ROW_BLOCKS:
                nxt = _fold_block(w_ptr, meta_ptr, rows + ROWS, w_row, a_col, m_row, m_col, N, stride_wn, stride_mn)
        else:  # no prefetch: the block is loaded where it is used (other warps hide the wait)
            ops = _fold_block(w_ptr, meta_ptr, rows, w_row, a_col, m_row, m_col, N, stride_wn, stride_mn)
        _fold_sums(ops, b0, b1, b2, b3, sel, rows + o_row, o_m, out_ptr, part_ptr, M, N, SPLIT, pid_k, stride_om,
                   ASM, ASM_IO, KP, PARTIAL, num_warps, O2)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_r, row0, 0, M, N, SPLIT, stride_om, ROWS * ROW_BLOCKS, FIX_K,
                   num_warps)


@gluon.jit
def _fold_sums(ops, b0, b1, b2, b3, sel, row, o_m, out_ptr, part_ptr, M, N, SPLIT, pid_k, stride_om,
               ASM: gl.constexpr, ASM_IO: gl.constexpr, KP: gl.constexpr, PARTIAL: gl.constexpr,
               num_warps: gl.constexpr, O2: gl.constexpr):
    """A block's MMAs with folded rows (``ops``: its values and positions from ``_fold_block``) and the store of its
    sums, lane ``4g + t`` weight row ``row`` times row ``o_m = t`` of ``x``."""
    v, pos = ops
    pos4 = gl.broadcast(gl.expand_dims(pos, 3), v)[0]
    d = gl.inline_asm_elementwise(ASM, ASM_IO, [v, b0, b1, b2, b3, pos4, sel], dtype=gl.float32, is_pure=True, pack=4)
    # slot 0 of each pair holds its sum (the others -0.0, not added): split off, then the pairs added
    d = gl.split(gl.reshape(d, [num_warps, 32, KP, 2, 2]))[0]
    acc = gl.convert_layout(gl.sum(gl.split(d)[0], axis=2), O2)  # the same registers, renamed
    _store_sums(acc, out_ptr, part_ptr, row, o_m, (o_m < M) & (row < N), N, SPLIT, pid_k, stride_om, PARTIAL)


@functools.cache
def w4_fold_asm() -> tuple[str, str]:
    """2:4 + INT4 with folded rows ([Note: 2:4 folded rows]): the inline asm of one pair of MMAs (128 columns, one
    group) and its constraints, for ``pack=4``. Operands in order, four each: the lane's 8 code bytes of the pair
    (64 bits; byte ``4m + j`` is the ``A`` register ``j`` of MMA ``m``; slot 0), the four ``B`` registers (read at
    slots 0 and 2), the pair's 4 position words of the row (slot ``u``: word ``u``), ``-(128 + zero)`` in both bf16
    halves (slot 0) and the lane's byte selector ``t + 16 (t + 4)`` (slot 0). Out: slot 0 the pair's sum of weight
    row ``g`` times row ``t`` of ``x`` in units of the group's scale, the other slots ``-0.0``."""
    lines = ["{", ".reg .b32 w<2>, ws<2>, y, one, a<4>, c<4>, e, u, v, lo, hi, m;", ".reg .f32 d<4>, z;",
             "mov.b32 one, 0x3F803F80;", "mov.f32 z, 0f00000000;", "mov.b64 {w0, w1}, $4;",
             "shr.b32 ws0, w0, 4;", "shr.b32 ws1, w1, 4;",  # each byte's high nibble in its low nibble
             # the metadata register: byte t of each position word (MMA t // 2, blocks 4 (t % 2) .. of both
             # segments), then the low nibbles (the first segment, row g) in the low half and the high nibbles
             # (the second, row g + 8) in the high half
             "prmt.b32 u, $24, $25, $32;", "prmt.b32 v, $26, $27, $32;", "prmt.b32 e, u, v, 0x5410;",
             "shr.b32 u, e, 4;", "shr.b32 v, e, 8;", "lop3.b32 lo, e, u, 0x0F0F0F0F, 0xE4;",
             "lop3.b32 hi, u, v, 0x0F0F0F0F, 0xE4;", "prmt.b32 m, lo, hi, 0x6420;"]
    for mma, (regs, b, acc, sel) in enumerate((("a", (8, 12, 16, 20), "z, z, z, z", "0x0"),
                                              ("c", (10, 14, 18, 22), "d0, d1, d2, d3", "0x1"))):
        for j in range(4):  # byte j's codes at bits 0-3 and 16-19, into 0x4300, then code - zero (exact)
            lines += [f"prmt.b32 y, w{mma}, ws{mma}, 0x{4 + j}{4 + j}{j}{j};",
                      "lop3.b32 y, y, 0x000F000F, 0x43004300, 0xEA;", f"fma.rn.bf16x2 {regs}{j}, y, one, $28;"]
        lines.append(f"{_MMA} {{d0, d1, d2, d3}}, {{{regs}0, {regs}1, {regs}2, {regs}3}}, "
                     f"{{${b[0]}, ${b[1]}, ${b[2]}, ${b[3]}}}, {{{acc}}}, m, {sel};")
    lines += ["add.f32 $0, d0, d3;", "mov.f32 $1, 0f80000000;", "mov.f32 $2, 0f80000000;", "mov.f32 $3, 0f80000000;",
              "}"]
    return "\n".join(lines), ",".join(["=f"] * 4 + ["l"] * 4 + ["r"] * 28)


@gluon.jit
def _w4_fold_block(w_ptr, meta_ptr, s_ptr, z_ptr, rows, w_row, a_col, m_col, g_col, N, stride_wn, stride_mn,
                   stride_sn, stride_zn, HAS_ZEROS: gl.constexpr):
    """A block's operands of 2:4 + INT4 with folded rows: a lane's 8 code bytes of each pair, the pair's position
    words, the row's zero point (int32; 8 without) and scale (fp32) of the pair's group. Unmasked: rows from ``N`` on
    read row ``N - 1``; the caller clamps the pairs past ``K``."""
    r3 = gl.minimum(rows + w_row, N - 1)
    if HAS_ZEROS:
        z = gl.load(z_ptr + r3 * stride_zn + g_col).to(gl.int32)
    else:
        z = gl.zeros_like(g_col) + 8
    r4 = gl.expand_dims(r3, 3)
    return (gl.load(w_ptr + r3 * stride_wn + a_col), gl.load(meta_ptr + r4 * stride_mn + m_col), z,
            gl.load(s_ptr + r3 * stride_sn + g_col).to(gl.float32))


@gluon.jit
def sparse_mma_w4_fold_kernel(x_ptr, w_ptr, meta_ptr, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, PAIRS, SPLIT,
                              stride_xm, stride_wn, stride_mn, stride_sn, stride_zn, stride_om, GROUP: gl.constexpr,
                              HAS_ZEROS: gl.constexpr, KP: gl.constexpr, WK: gl.constexpr, ROW_BLOCKS: gl.constexpr,
                              DEPTH: gl.constexpr, EVEN_K: gl.constexpr, PARTIAL: gl.constexpr, FIX_K: gl.constexpr,
                              LATE: gl.constexpr, ASM: gl.constexpr, ASM_IO: gl.constexpr, num_warps: gl.constexpr):
    """2:4 + INT4 with folded rows: ``out[M, N] = x @ densify(dequant(codes), meta)^T`` for ``M <= 4`` ([Note: 2:4
    folded rows], [Note: 2:4 + INT4 on sparse tensor cores]).

    ``w_ptr``: the codes (N, K / 4) uint8 read as int64 (N, K / 32): lane ``t`` takes stored blocks ``8t .. 8t + 7``
    of each pair of MMAs (128 columns), block ``8t + 4m + j`` being ``A`` register ``j`` of MMA ``m``; ``meta_ptr``:
    the positions (N, K / 8) uint8 read as int32, 4 words a pair; ``s_ptr`` / ``z_ptr``: scales and zero points
    (uint8; ``HAS_ZEROS`` false: 8) per (row, group of ``GROUP`` original columns, a multiple of 128). ``PAIRS = K /
    128``; ``KP`` pairs a warp, ``WK`` warps along ``K`` by ``num_warps / WK`` along the rows, a program covering
    ``WK * KP`` pairs ([Note: fold warps along K] in ``_dense_mma_kernels``); ``LATE`` (with ``WK`` > 1): each warp's
    sums of every block kept in shared memory and added across the warps along ``K`` once, after the last block;
    ``ASM`` / ``ASM_IO``: ``w4_fold_asm()``; the rest as ``sparse_mma_fold_kernel``."""
    WR: gl.constexpr = num_warps // WK  # warps along the rows
    KPW: gl.constexpr = KP * WK  # pairs a program
    L4: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, KP, 4], threads_per_warp=[1, 32, 1, 1],
                                        warps_per_cta=[WR, 1, WK, 1], order=[3, 2, 1, 0])
    M3: gl.constexpr = gl.SliceLayout(3, L4)  # one value a pair: codes, zero point, scale
    O2: gl.constexpr = gl.SliceLayout(2, M3)  # one value a lane: its sum
    ROWS: gl.constexpr = 8 * WR

    pid_k = gl.program_id(1)
    u = _along4(4, 3, L4)  # slot u of a pair: MMA u // 2 (B), position word u
    pair = pid_k * KPW + _along4(KPW, 2, L4)
    lane = _along4(32, 1, L4)
    g = lane // 4
    t = lane % 4
    # B: column g of an MMA is row g // 2 of x over segment g % 2; register i holds logical block L = t // 2 + 2i,
    # stored block 8 (L % 4) + 4m + 2 (L // 4) + g % 2 of the pair
    b0, b1, b2, b3 = _fold_b(x_ptr + (g // 2) * stride_xm + pair * 64 + 8 * (u // 2) + 2 * (g % 2) + t % 2,
                             (g // 2 < M) & (pair < PAIRS) & (u % 2 == 0), t, 16)
    sel = gl.zeros_like(b0) + (t + 16 * (t + 4))

    lane3 = _along3(32, 1, M3)
    w_row = 8 * _along3(WR, 0, M3) + lane3 // 4
    pair3 = pid_k * KPW + _along3(KPW, 2, M3)
    if EVEN_K:
        pc = pair
    else:  # pairs past K read the last one (x is zero there)
        pc = gl.minimum(pair, PAIRS - 1)
        pair3 = gl.minimum(pair3, PAIRS - 1)
    a_col = pair3 * 4 + lane3 % 4
    m_col = pc * 4 + u
    g_col = pair3 // (GROUP // 128)

    o_row, o_m = _fold_slots(WR, O2)
    pid_r = gl.program_id(0)
    row0 = pid_r * (ROWS * ROW_BLOCKS)
    # with LATE, each warp's sums of every block, added across the warps along K once, after the last block
    kept, which = _late_sums_keeper(ROW_BLOCKS, WR, WK, LATE)
    if DEPTH == 1:
        nxt = _w4_fold_block(w_ptr, meta_ptr, s_ptr, z_ptr, row0, w_row, a_col, m_col, g_col, N, stride_wn, stride_mn,
                             stride_sn, stride_zn, HAS_ZEROS)
    for blk in range(ROW_BLOCKS):
        rows = row0 + blk * ROWS
        if DEPTH == 1:  # loaded during the last block; the next block goes in flight now
            codes, pos, z, scale = nxt
            if blk + 1 < ROW_BLOCKS:
                nxt = _w4_fold_block(w_ptr, meta_ptr, s_ptr, z_ptr, rows + ROWS, w_row, a_col, m_col, g_col, N,
                                     stride_wn, stride_mn, stride_sn, stride_zn, HAS_ZEROS)
        else:
            codes, pos, z, scale = _w4_fold_block(w_ptr, meta_ptr, s_ptr, z_ptr, rows, w_row, a_col, m_col, g_col, N,
                                                  stride_wn, stride_mn, stride_sn, stride_zn, HAS_ZEROS)
        codes4 = gl.broadcast(gl.expand_dims(codes, 3), pos)[0]
        nz4 = gl.broadcast(gl.expand_dims((z | 0xC300) * 0x10001, 3), pos)[0]  # -(128 + zero) in both halves
        d = gl.inline_asm_elementwise(ASM, ASM_IO, [codes4, b0, b1, b2, b3, pos, nz4, sel], dtype=gl.float32,
                                      is_pure=True, pack=4)
        # slot 0 of each pair holds its sum in units of the group's scale (the others -0.0, split off)
        d = gl.split(gl.reshape(d, [WR, 32, KPW, 2, 2]))[0]
        d = gl.convert_layout(gl.split(d)[0], M3) * scale  # (the same registers, renamed)
        kept = _block_sums(kept, which, d, blk, rows + o_row, o_m, out_ptr, part_ptr, M, N, SPLIT, pid_k, stride_om,
                           WR, WK, PARTIAL, LATE)  # pair kw * KP + j of the program is warp kw's j
    _fold_end(kept, out_ptr, part_ptr, count_ptr, pid_r, row0, M, N, SPLIT, pid_k, stride_om, ROWS * ROW_BLOCKS,
              ROW_BLOCKS, WR, WK, PARTIAL, FIX_K, LATE, num_warps)
