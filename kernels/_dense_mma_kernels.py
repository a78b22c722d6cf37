"""The INT4 GEMV on tensor cores (``mma.sync.m16n8k16``), written in Gluon: W4A16 weights times up to 16 rows of ``x``.

Imported lazily, like ``_sparse_mma_kernels``; only on an sm_80+ GPU with a Triton that has Gluon
(``_dense_mma.dense_mma_possible``).

[Note: INT4 GEMV on tensor cores] The x-stationary kernels (``_stationary_kernels``) multiply each code on the CUDA
cores: two instructions a code and row of ``x`` ([Note: subnormal codes]), so four rows of ``x`` cost four times the
instructions of one, and the tensor-core ``wdot`` takes over from two rows with its own costs (a tile's
dequantized weights go through shared memory). Here the weights go into ``mma.sync.m16n8k16`` straight from the
registers they were loaded into, as the 2:4 GEMV does on sparse tensor cores ([Note: 2:4 GEMV on sparse tensor cores]
in ``_sparse_mma_kernels``, whose schedule this kernel keeps):

- weight rows are the MMA's ``M`` side (16 a warp), the rows of ``x`` its ``N`` side (8 columns, ``M`` of them
  used): 1 to 8 rows of ``x`` cost the same instructions;
- ``K`` is walked in *stripes* of 128 columns (8 MMAs), each inside one quantization group. Lane ``4g + t`` loads
  words ``4t .. 4t + 3`` of the stripe of rows ``g`` and ``g + 8``: one 16-byte load a row. The MMA's ``A`` fragment
  wants columns ``2t, 2t + 1, 2t + 8, 2t + 9`` of each 16-column step, but any assignment of columns to the steps
  gives the same product if ``x`` (the ``B`` operand, loaded once, in any order) follows it, and the ``k`` index of a
  fragment register depends only on ``t`` in ``A`` and ``B`` alike. So word ``w`` of the lane (original columns
  ``c .. c + 7``, ``c = 128 q + 8 (4t + w)``) feeds steps ``2w`` and ``2w + 1``: step ``2w + h`` takes the nibble
  pairs ``(2h, 2h + 4)`` as its columns ``2t, 2t + 1`` and ``(2h + 1, 2h + 5)`` as ``2t + 8, 2t + 9``, and ``B``
  register ``r`` of that step holds ``x[c + 2h + r]`` and ``x[c + 2h + r + 4]``;
- a nibble pair ``(p, p + 4)`` is where ``word >> 4p`` has it, in bits 0-3 and 16-19: one ``lop3`` masks both into
  ``0x4300`` (the bf16 pair ``(128 + code, 128 + code')``) and one ``fma.bf16x2`` by 1 plus ``-(128 + zero)`` makes
  it ``code - zero``, exact; 11 instructions a word (3 shifts) for its 8 codes;
- a stripe's 8 MMAs chain through one accumulator in one inline-asm call (``w4_dense_asm``); the group's scale then
  multiplies the stripe's fp32 sums (one rounding fewer than the reference, which rounds each weight to bf16);
- ``x`` stays in registers while the weight rows stream past in blocks of 16 rows a warp ([Note: x-stationary
  GEMV] in ``_stationary_kernels``), the next block's words, scales and zero points in flight while this one
  multiplies (``DEPTH`` 1). The words are read unmasked, as [Note: INT4 stripes] reads 2:4 + INT4: rows past ``N``
  read row ``N - 1`` (their sums are not stored) and stripes past ``K`` the last stripe (``x`` is zero there);
- slices of ``K`` meet as in the other x-stationary kernels: fp32 partials, summed in slice order by the run's last
  program (``finish_run``).

[Note: warps along K] Each slice of ``K`` adds a fp32 partial a row of ``x`` and output, written and read back once:
at 8 rows and 16 slices (8192x8192) that is 4 MB of 33.5, and the GEMV took 27 us against 21 at one row (kernels runs
160-161). A warp's slice is bounded by the ``B`` registers it holds (16 a stripe and block of 8 rows of ``x``), so
the program's warps may split ``K`` instead of the rows: with ``WK`` warps along ``K`` a program covers ``WK`` times
a warp's slice for ``16 * num_warps / WK`` rows, and the warps' sums meet in shared memory (Triton's reduction across
warps) before one partial a program is stored. (Nsight Compute later showed the partials staying in L2, kernels run
166: what grows with the rows is the wait between a warp's instructions, [Note: x in shared memory].)

[Note: x in shared memory] Held in registers, a warp's slice of ``x`` costs 16 ``B`` registers a stripe and block of
8 rows of ``x``: at 4 stripes and one block ahead, 64 of the 222 registers (two programs of 4 warps an SM), where the
words in flight take 64 too. Nsight Compute (kernels run 166, 8192x8192, one row) saw such a warp issue once every 5.5
cycles, half of it waiting on its loads, with two warps a scheduler: latency-bound, with too few bytes in flight. With
``XS`` the program stores its slice of ``x`` in shared memory once (a lane's 4 registers of a stripe in 16 contiguous
bytes, lanes side by side: one conflict-free 16-byte load) and every block reads it again, 4 ``LDS.128`` a stripe and
block of 8 rows beside its 8 MMAs and ~140 other instructions. The registers go to the words: the same config takes 162
registers (three programs an SM), and 8 stripes a warp with one block ahead fit without spilling. The loads must stay
in the loop: at a constant address ptxas hoists them out of it (held in registers again, as it did in a 2:4 try), so
the buffer index is ``rows >= N + run``, always 0 and not foldable. The first block's loads are issued before the store
and its barrier. The tuner times both ways: on an H100 (runs 167 and 169) shared memory won at one and four rows on
8192x28672 and 28672x8192 (one row 2.83 / 2.65x to 3.02 / 2.97x in run 167, 2.94 / 2.94x in the peers' benchmark)
and at 16 rows (1.32-1.61x to 1.52-1.76x, still behind ``wdot``), registers on 8192x8192 and on the smaller shapes of a
decode step (4096x4096: 2.57x against 1.93x), where the slice's store, barrier and extra loads weigh on a short run.

A warp's loop costs about 140 instructions a stripe for 1 KB of words (16 rows x 128 columns; sm_90 SASS, 4 stripes
with one block ahead: 556), a seventh of an instruction a byte whatever the rows of ``x`` up to 8, where the
x-stationary kernel's two instructions a code and row grow with the rows.

Measured on an H100 (benchmarks/RESULTS.md, kernels runs 160-169, bf16 in the same process): 2.65-2.94x of bf16 at
one row (the x-stationary TMA kernel: 2.49-2.80x; the tuner times both), 2.33-2.81x at four rows (``wdot``:
1.94-2.25x) and 2.13-2.55x at eight. On an H200 (run 165) 2.22-2.39x at one row, behind the TMA kernel's 2.45-2.60x,
and 1.86-2.10x at four. Two blocks of 8 rows of ``x`` a fragment (9 to 16 rows, ``NT`` 2) run but lose to ``wdot``
(1.52-1.76x at 16 rows with ``x`` in shared memory, run 167, against 1.90-2.22x), so the policy keeps them on ``wdot``.

[Note: INT4 GEMV with folded rows] ``dense_mma_w4_fold_kernel`` takes 1 to 4 rows of ``x`` the way the 2:4 kernels
with folded rows do ([Note: 2:4 folded rows] in ``_sparse_mma_kernels``): both halves of the MMA's ``M`` side are one
weight row, fragment row ``g`` over one half of a 32-column step and ``g + 8`` over the other, and column ``2i + h``
of ``B`` is row ``i`` of ``x`` over half ``h``; ``D[g][2i] + D[g + 8][2i + 1]`` is the row's product. A lane's word
(8 codes, columns ``c .. c + 7``) is one MMA's ``A``: nibble pair ``(p, p + 4)`` becomes register ``p``, so half 0
is columns ``c, c + 4, c + 2, c + 6`` and half 1 the others, and ``B`` register 0 of lane ``4g + t`` holds columns
``c + g % 2`` and ``c + g % 2 + 4`` of row ``g // 2`` of ``x``, register 1 the same plus 2. Lane ``t`` takes words
``4t .. 4t + 3`` of a stripe of its row (one 16-byte load), word ``4t + u`` being MMA ``u``; the stripe's 4 MMAs
chain, and slot 0 of the asm's four carries the stripe's sum (the others ``-0.0``, split off), times the row's scale.
The dequantization is the same 11 instructions a word, so the loop costs about as much a byte (sm_90 SASS: 265
instructions for 4 stripes of 8 rows, 2 KB of words, against about 140 a KB above); what changes is the registers:
``x`` takes half (8 a stripe) and a lane holds one row's scales and zero points, so 4 stripes with one block ahead
take 96 registers where the layout above takes 218-222. On an H100 (benchmarks/RESULTS.md, kernels runs 185-187, each
kind tuned alone) one row of 8192x8192 ran 2.83x of bf16 (registers above: 2.63x, shared memory: 2.50x), and the
decode shapes 2.59x on 4096x6144 (the TMA kernel: 2.18x), 2.85x on 4096x28672 (2.72x), 2.74x on 14336x4096 (2.54x);
on 8192x28672 and 28672x8192 ``x`` in shared memory stays ahead (3.00 / 2.96x against 2.89 / 2.89x), and on 4096x4096
the layout above (2.40x against 2.30x). The tuner times all of them.

[Note: fold warps along K] Where the time of the GEMV with folded rows goes was measured by switching parts of it off
(kernels runs 197-198, H100, wrong results, same grid; benchmarks/RESULTS.md, session 28): without the split-K fix-up
(``finish_run``) 8192x8192 went from 20.0 to 18.6-18.7 us, 4096x4096 from 8.4-8.9 to 6.8, 4096x6144 from 9.8-9.9 to
8.0-8.3; without the scales' and zero points' loads 0.3-0.9 us less; without the dequantization and MMAs, or reading
the same bytes as if stored tiled (512 contiguous bytes a warp load), no faster. Loading more ahead (two blocks, or
the rows two blocks on prefetched into L2) and fewer instructions a word (``128 + code`` into the MMA, the zero
points' share from a sum of ``x``) were no faster either (runs 188-196; again in session 32, runs 227-229, with warps
along ``K``: 1-3 % on long runs, 14-33 % slower on short ones, where ptxas puts the sum's MMAs, which wait for ``x``,
before the first block's loads; L1/L2 prefetches of the next blocks were slower too; so were passes over a slice with
``x`` in shared memory, runs 232-233, by up to 48 % on long ``K``; words as if stored in tiles of 8 rows, run 234 on
an H200, moved the picks by -3 to +2 %). The fix-up's cost is a latency at the end of the launch: the last program of
a run waits for its own stores, an atomic and the other slices' partials, about 1.5 us, whatever the number of slices.
So the warps may split ``K`` as in the layout above ([Note: warps along K]): ``WK`` warps along ``K`` by ``num_warps /
WK`` along the rows, a program covering ``WK`` times a warp's slice, the warps' sums meeting in shared memory
(Triton's reduction across warps) a block at a time. With 8-16 warps along ``K`` a program covers all of a 4096-column
``K``, and there is no fix-up. On an H100 (run 199, the tuner choosing among both) 4096x4096 ran 2.76x of bf16 (7.1
us; run 199's copy without warps along ``K``: 2.35x) and 4096x6144 2.80x (2.60x); on the larger shapes the choice is
within the runs' variation (2.75-3.03x against 2.90-2.99x). On an H200 (run 201) 4096x4096 went from 2.11x to 2.53x;
the other shapes kept their configs.
2:4 + INT4 with folded rows (``sparse_mma_w4_fold_kernel``) splits its pairs of MMAs the same way: on an H100 (run
202) 4096x4096 went from 2.45x to 3.14x and 4096x6144 from 2.81x to 3.20x, the larger shapes as before.
The reduction across the warps a block at a time puts four barriers in every iteration (sm_90 SASS), which keep a
program's warps in step. With ``LATE`` each warp stores its own sums of every block in shared memory instead (one
barrier an iteration, which Triton puts before the store), and they are added across the warps once, after the last
block: on an H100 (run 204, the tuner timing both) 8192x28672 ran 3.18x (54.3 us, the
same config a block at a time 57.4 us), 28672x8192 3.10x and 14336x4096 2.90x (18.2 against 19.3 us) with 4 warps
along ``K`` and late sums, while 4096x4096 and 4096x6144 keep the reduction a block at a time (run 203: 2.44x late
against 2.75x). 2:4 + INT4 with folded rows (``sparse_mma_w4_fold_kernel``) takes the same ``LATE`` (run 206,
H100: 4096x4096 at one row picked it: 6.1 us in the tuner's timing, the best config a block at a time 6.4).
``LATE = 2`` keeps a lane's sum of every block in registers instead (a ``where`` a block, ``ROW_BLOCKS`` registers),
so the loop has no barrier at all (sm_90 SASS), and adds them across the warps once at the end. It is exact on the GPU
(runs 205-206), but with it among the INT4 candidates the decode benchmark ran 2.35x where the same machine ran 2.50x
without it (runs 207-208), so the tuner offers it only where asked for (``_word.FOLD_LATE_SUMS``).

[Note: balanced runs] A program that covers all of ``K`` with 16 warps (the decode step's 4096-deep shapes, above)
takes an SM's registers alone, so its programs run in waves of one an SM, and a grid of runs of a power of two of
row blocks rarely fills the last wave: 4096x6144 in runs of 4 blocks is 192 programs, two on 60 SMs and one on the
other 72, so the launch takes the time of 8 blocks where 5.8 an SM would do; 4096x28672 in runs of 16, 224 programs,
32 blocks where 27.2 would do. Nothing in such a program needs its run to be a power of two (no fix-up, no kept sums: the run's
length is only the loop's trip count), so ``_word.balanced_runs`` offers runs of ``cdiv(blocks, p * SMs)`` blocks,
``p`` programs an SM for the warp count and twice that: 6 and 3 blocks for 4096x6144, 28 and 14 for 4096x28672, 122
and 61 for the 128,256-row head. The launcher refuses such a run with a fix-up or kept sums, whose layouts are powers
of two. Compiled for sm_90 on the CPU (``tests/test_kernels_dense_mma.py``). Measured (kernels run 218, H100,
``gemv_check.py --balanced``, every config checked on NaN-filled memory): the tuner picked a balanced run for
4096x28672 (14 blocks, 31.3 us; the same config in runs of 16, 33.3 us; the best power of two, 32.2 us) and for
the head (61 blocks, 108.2 us against 109.6 us), and none elsewhere. So they are offered by default
(``_word.FOLD_BALANCED``).

[Note: x a word at a time] With folded rows a lane's ``B`` registers of a word ``c .. c + 7`` hold four of its 8 values
of ``x`` (``c + p``, ``c + p + 2``, ``c + p + 4``, ``c + p + 6`` for the lane's parity ``p``). Gathered 2 bytes at a
time, that is 16 loads a stripe, and Nsight Compute (kernels run 249, H200, 8192x8192) counted 0.52 M L2 sector
requests for them against 1.05 M for the words, three quarters of them beyond the bytes used. With ``XVEC`` each
lane reads the word's 16 bytes in one load (4 int32, each a pair of values) and takes the halves of its parity with
one ``prmt`` a register (``X_HALVES_ASM``). Measured at one row, each config checked on NaN-filled memory, the tuner's
picks before / after in the same call (kernels runs 256-257, us): H200 8192x8192 16.8 / 16.1-16.2, 4096x6144 9.1 /
8.8-8.9, 4096x4096 6.6 / 6.0-6.2, 14336x4096 16.0 / 15.3-15.4, 4096x28672 26.4 / 25.8; H100 19.5 / 18.9-19.0, 9.1 /
8.8-8.9, 7.1 / 6.8, 18.3 / 17.7, 30.8 / 30.2-30.3. At 2-4 rows (kernels run 259, H200, tuned both ways in one call,
``XVEC`` / gathers twice / once, us): 4 rows 18.5 / 20.6 on 8192x8192, 9.0-9.2 / 10.5 on 4096x6144, 5.9-6.7 / 7.9 on
4096x4096, 17.9 / 19.9 on 14336x4096, 26.5-26.7 / 29.8 on 4096x28672; 2 rows 17.0 / 17.6, 8.7-8.9 / 9.3, 6.4-7.0 /
6.9, 16.3 / 16.7, 26.9-27.2 / 27.6.
``dense_mma_w4_kernel`` (5-16 rows) read a word's 8 values of a row as two 8-byte loads, one for each half of its
4 ``B`` registers (slot ``j``: ``x[c + j]``, ``x[c + j + 4]``); with ``XVEC`` it reads the 16 bytes once and builds
slot ``j`` with one ``prmt`` of int32 ``j // 2`` and ``j // 2 + 2`` (``_x_word_slots``). Kernels run 260 (H200,
the same way, us): 8 rows 21.8 / 23.7 on 8192x8192, 31.1 / 34.0 on 4096x28672, 21.6 / 24.3 on 14336x4096; 16 rows
30.2 / 32.5, 46.9 / 48.6, 33.3 / 36.7 (still behind the ``wdot`` path's kernels at 16 rows, so the policy keeps
9-16 rows there). So the launchers set ``XVEC`` at every row count where each row of ``x`` starts at a multiple of
16 bytes (``_runtime.x_words_aligned``: the loads' alignment); other rows keep the gathers.
"""
from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._sparse_mma_kernels import (_along3, _along4, _along5_last, _block_sums, _cta_barrier, _fold_end, _fold_slots,
                                  _late_sums_keeper, _split4, _store_sums, finish_run, group_params)

_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
# [Note: x a word at a time]: two int32 of x (a bf16 pair each) to the B register of a lane of parity p: the low halves
# (p = 0) or the high halves (p = 1) of the two, the first one's in the low half
X_HALVES_ASM = gl.constexpr("prmt.b32 $0, $1, $2, $3;")
X_LOW_HALVES = gl.constexpr(0x5410)  # (the selectors of parity 0 and 1)
X_HIGH_HALVES = gl.constexpr(0x7632)
# (the same with the selector a constant: slot j of a word in ``dense_mma_w4_kernel``, parity j % 2)
X_LOW_ASM = gl.constexpr(f"prmt.b32 $0, $1, $2, {X_LOW_HALVES.value:#x};")
X_HIGH_ASM = gl.constexpr(f"prmt.b32 $0, $1, $2, {X_HIGH_HALVES.value:#x};")


@functools.cache
def w4_dense_asm(nt: int) -> tuple[str, str]:
    """One stripe of INT4 weights ([Note: INT4 GEMV on tensor cores]) times ``nt`` (1 or 2) blocks of 8 rows of
    ``x``: the inline asm and its constraints, for ``pack=4``. Operands, 4 registers each: the lane's words of the
    stripe of rows ``g`` and ``g + 8``, the ``B`` registers of its words 0-3 for each block of ``x`` (register ``2h +
    r`` of word ``w``: register ``r`` of step ``2w + h``), and ``-(128 + zero)`` in both bf16 halves of rows ``g`` and
    ``g + 8`` (only the first register of each is read). Out, per block of ``x``: the stripe's sums of row ``g``
    times its rows ``2t``, ``2t + 1``, then row ``g + 8``."""
    if nt not in (1, 2):
        raise ValueError(f"w4_dense_asm: 1 or 2 blocks of 8 rows of x, got {nt}")
    first = 4 * nt  # the outputs' registers come first
    cg, ch = [first + w for w in range(4)], [first + 4 + w for w in range(4)]
    b = [[first + 8 + 4 * i + slot for slot in range(4)] for i in range(4 * nt)]  # b[4 tile + w][slot]
    nzg = first + 8 + 16 * nt
    nzh = nzg + 4
    lines = ["{", ".reg .b32 y, one, a<4>, g<4>, h<4>;", ".reg .f32 e<8>, z;", "mov.b32 one, 0x3F803F80;",
             "mov.f32 z, 0f00000000;"]

    def deq(dst: str, src: str, nz: int) -> list[str]:  # nibbles at bits 0-3 and 16-19 -> (code - zero) x 2
        return [f"lop3.b32 y, {src}, 0x000F000F, 0x43004300, 0xEA;", f"fma.rn.bf16x2 {dst}, y, one, ${nz};"]

    for w in range(4):
        for row, reg in (("g", cg[w]), ("h", ch[w])):
            lines += [f"mov.b32 {row}0, ${reg};"] + [f"shr.u32 {row}{p}, ${reg}, {4 * p};" for p in (1, 2, 3)]
        for h in range(2):
            # A: (row g, cols 2t, 2t + 1), (row g + 8, same), (row g, cols 2t + 8, 2t + 9), (row g + 8, same)
            lines += deq("a0", f"g{2 * h}", nzg) + deq("a1", f"h{2 * h}", nzh)
            lines += deq("a2", f"g{2 * h + 1}", nzg) + deq("a3", f"h{2 * h + 1}", nzh)
            for tile in range(nt):
                e = ", ".join(f"e{4 * tile + i}" for i in range(4))
                acc = "z, z, z, z" if w == h == 0 else e
                lines.append(f"{_MMA} {{{e}}}, {{a0, a1, a2, a3}}, {{${b[4 * tile + w][2 * h]}, "
                             f"${b[4 * tile + w][2 * h + 1]}}}, {{{acc}}};")
    lines += [f"mov.f32 ${i}, e{i};" for i in range(4 * nt)] + ["}"]
    return "\n".join(lines), ",".join(["=f"] * (4 * nt) + ["r"] * (4 * (4 + 4 * nt)))


@gluon.jit
def _w4_rows(w_ptr, s_ptr, z_ptr, rows, a_row, a_col, s_row, g_col, N, stride_wn, stride_sn, stride_zn,
             HAS_ZEROS: gl.constexpr):
    """A block's operands of every stripe of the slice: the lane's words of rows ``g`` and ``g + 8``, the zero
    points (int32; 8 without) and scales (fp32) of both rows. Unmasked: rows from ``N`` on read row ``N - 1``."""
    rg = gl.minimum(rows + a_row, N - 1)
    rh = gl.minimum(rows + a_row + 8, N - 1)
    zg, zh, sg, sh = group_params(s_ptr, z_ptr, gl.minimum(rows + s_row, N - 1), gl.minimum(rows + s_row + 8, N - 1),
                                  g_col, stride_sn, stride_zn, HAS_ZEROS)
    return gl.load(w_ptr + rg * stride_wn + a_col), gl.load(w_ptr + rh * stride_wn + a_col), zg, zh, sg, sh


@gluon.jit
def dense_mma_w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, STRIPES, SPLIT,
                        stride_xm, stride_wn, stride_sn, stride_zn, stride_om, GROUP: gl.constexpr,
                        HAS_ZEROS: gl.constexpr, Q: gl.constexpr, WK: gl.constexpr, NT: gl.constexpr,
                        ROW_BLOCKS: gl.constexpr, DEPTH: gl.constexpr, EVEN_K: gl.constexpr, PARTIAL: gl.constexpr,
                        FIX_K: gl.constexpr, XS: gl.constexpr, ASM: gl.constexpr, ASM_IO: gl.constexpr,
                        XVEC: gl.constexpr, num_warps: gl.constexpr):
    """INT4 ``out[M, N] = x @ dequant(words)^T`` for ``M <= 8 * NT`` ([Note: INT4 GEMV on tensor cores]).

    ``x_ptr``: ``x`` (M, K) bf16 read as int16; ``w_ptr``: the words (N, K / 8) int32, column ``8c + i`` in nibble
    ``i`` of word ``c``; ``s_ptr`` / ``z_ptr``: scales and uint8 zero points (``HAS_ZEROS`` false: 8) per (row, group
    of ``GROUP`` columns, a multiple of 128). ``STRIPES = K / 128``. Grid ``(runs, SPLIT)``: a program owns ``WK *
    Q`` stripes of ``K`` (powers of two), ``Q`` a warp, its warps ``WK`` along ``K`` by ``num_warps / WK`` along the
    rows ([Note: warps along K]), and a run of ``ROW_BLOCKS`` blocks of ``16 * num_warps / WK`` weight rows; ``DEPTH``
    1 loads the next block while this one multiplies (0: each where it is used); ``EVEN_K``: ``WK * Q`` divides
    ``STRIPES``; ``NT`` (1 or 2) blocks of 8 rows of ``x`` go through each weight fragment; ``XS``: ``x`` in shared
    memory, read for each block ([Note: x in shared memory]); ``ASM`` / ``ASM_IO``: ``w4_dense_asm(NT)``; ``XVEC``:
    each word of ``x`` in one 16-byte load ([Note: x a word at a time]; rows starting at multiples of 16 bytes)."""
    WR: gl.constexpr = num_warps // WK  # warps along the rows
    QW: gl.constexpr = Q * WK  # stripes a program
    L4: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, Q, 4], threads_per_warp=[1, 32, 1, 1],
                                        warps_per_cta=[WR, 1, WK, 1], order=[3, 2, 1, 0])
    Q3: gl.constexpr = gl.SliceLayout(3, L4)  # per stripe
    O3: gl.constexpr = gl.SliceLayout(2, L4)  # per accumulator slot
    ROWS: gl.constexpr = 16 * WR
    pid_r = gl.program_id(0)
    pid_k = gl.program_id(1)

    # B: axis 2 the stripe q, axis 3 the slot j; tensor w holds word w's registers, slot j = x[c + j], x[c + j + 4]
    lane = _along4(32, 1, L4)
    g = lane // 4
    t = lane % 4
    q = pid_k * QW + _along4(QW, 2, L4)
    j = _along4(4, 3, L4)
    xmask = (g < M) & (q < STRIPES)
    xmask8 = (g + 8 < M) & (q < STRIPES)  # (rows 8-15 of x, NT 2)
    if XVEC:  # each word's 8 values of x in one 16-byte load ([Note: x a word at a time])
        b0 = _x_word_slots(x_ptr, g, 4 * t, q, xmask, stride_xm, L4)
        b1 = _x_word_slots(x_ptr, g, 4 * t + 1, q, xmask, stride_xm, L4)
        b2 = _x_word_slots(x_ptr, g, 4 * t + 2, q, xmask, stride_xm, L4)
        b3 = _x_word_slots(x_ptr, g, 4 * t + 3, q, xmask, stride_xm, L4)
        if NT == 2:
            b4 = _x_word_slots(x_ptr, g + 8, 4 * t, q, xmask8, stride_xm, L4)
            b5 = _x_word_slots(x_ptr, g + 8, 4 * t + 1, q, xmask8, stride_xm, L4)
            b6 = _x_word_slots(x_ptr, g + 8, 4 * t + 2, q, xmask8, stride_xm, L4)
            b7 = _x_word_slots(x_ptr, g + 8, 4 * t + 3, q, xmask8, stride_xm, L4)
    else:
        xrow = x_ptr + g * stride_xm + q * 128 + 32 * t + j
        b0 = _x_pairs(xrow, xmask)
        b1 = _x_pairs(xrow + 8, xmask)
        b2 = _x_pairs(xrow + 16, xmask)
        b3 = _x_pairs(xrow + 24, xmask)
        if NT == 2:
            b4 = _x_pairs(xrow + 8 * stride_xm, xmask8)
            b5 = _x_pairs(xrow + 8 * stride_xm + 8, xmask8)
            b6 = _x_pairs(xrow + 8 * stride_xm + 16, xmask8)
            b7 = _x_pairs(xrow + 8 * stride_xm + 24, xmask8)

    # words: lane 4g + t, words 4t + j of each stripe of rows g and g + 8 (one 16-byte load a stripe and row);
    # stripes past K read the last one (x is zero there); scales and zero points one a stripe and row
    a_row = 16 * _along4(WR, 0, L4) + g
    if EVEN_K:
        a_col = q * 16 + 4 * t + j
        q3 = pid_k * QW + _along3(QW, 2, Q3)
    else:
        a_col = gl.minimum(q, STRIPES - 1) * 16 + 4 * t + j
        q3 = gl.minimum(pid_k * QW + _along3(QW, 2, Q3), STRIPES - 1)
    g_col = q3 // (GROUP // 128)
    s_row = 16 * _along3(WR, 0, Q3) + _along3(32, 1, Q3) // 4

    # slot j of a sum: weight row g + 8 (j // 2), row 2t + j % 2 of x
    lane_o = _along3(32, 1, O3)
    slot = _along3(4, 2, O3)
    o_row = 16 * _along3(WR, 0, O3) + lane_o // 4 + 8 * (slot // 2)
    o_m = 2 * (lane_o % 4) + slot % 2
    o_live = o_m < M

    row0 = pid_r * (ROWS * ROW_BLOCKS)
    if DEPTH == 1:
        nxt = _w4_rows(w_ptr, s_ptr, z_ptr, row0, a_row, a_col, s_row, g_col, N, stride_wn, stride_sn, stride_zn,
                       HAS_ZEROS)
    if XS:  # x in shared memory ([Note: x in shared memory]), stored after the first block's loads are issued
        xs0 = _to_shared(b0, QW)
        xs1 = _to_shared(b1, QW)
        xs2 = _to_shared(b2, QW)
        xs3 = _to_shared(b3, QW)
        if NT == 2:
            xs4 = _to_shared(b4, QW)
            xs5 = _to_shared(b5, QW)
            xs6 = _to_shared(b6, QW)
            xs7 = _to_shared(b7, QW)
        _cta_barrier()
    for blk in range(ROW_BLOCKS):
        rows = row0 + blk * ROWS
        if DEPTH == 1:  # this block's operands were loaded during the last one; the next block's go in flight now
            cg, ch, zg, zh, sg, sh = nxt
            if blk + 1 < ROW_BLOCKS:
                nxt = _w4_rows(w_ptr, s_ptr, z_ptr, rows + ROWS, a_row, a_col, s_row, g_col, N, stride_wn, stride_sn,
                               stride_zn, HAS_ZEROS)
        else:
            cg, ch, zg, zh, sg, sh = _w4_rows(w_ptr, s_ptr, z_ptr, rows, a_row, a_col, s_row, g_col, N, stride_wn,
                                              stride_sn, stride_zn, HAS_ZEROS)
        nzg = gl.broadcast(gl.expand_dims((zg | 0xC300) * 0x10001, 3), cg)[0]  # -(128 + zero) in both halves
        nzh = gl.broadcast(gl.expand_dims((zh | 0xC300) * 0x10001, 3), cg)[0]
        scale = gl.where(j < 2, gl.expand_dims(sg, 3), gl.expand_dims(sh, 3))
        row = rows + o_row
        if XS:  # buffer 0, by a test ptxas cannot fold (rows < N + the run): at a constant address it would hoist
            xi = (rows >= N + ROWS * ROW_BLOCKS).to(gl.int32)  # the loads out of the loop, into registers again
            b0 = xs0.index(xi).load(L4)
            b1 = xs1.index(xi).load(L4)
            b2 = xs2.index(xi).load(L4)
            b3 = xs3.index(xi).load(L4)
            if NT == 2:
                b4 = xs4.index(xi).load(L4)
                b5 = xs5.index(xi).load(L4)
                b6 = xs6.index(xi).load(L4)
                b7 = xs7.index(xi).load(L4)
        if NT == 1:
            d = gl.inline_asm_elementwise(ASM, ASM_IO, [cg, ch, b0, b1, b2, b3, nzg, nzh], dtype=gl.float32,
                                          is_pure=True, pack=4)
            _store_sums(gl.sum(d * scale, axis=2), out_ptr, part_ptr, row, o_m, o_live & (row < N), N, SPLIT, pid_k,
                        stride_om, PARTIAL)
        else:
            d0, d1 = gl.inline_asm_elementwise(ASM, ASM_IO, [cg, ch, b0, b1, b2, b3, b4, b5, b6, b7, nzg, nzh],
                                               dtype=(gl.float32, gl.float32), is_pure=True, pack=4)
            _store_sums(gl.sum(d0 * scale, axis=2), out_ptr, part_ptr, row, o_m, o_live & (row < N), N, SPLIT, pid_k,
                        stride_om, PARTIAL)
            _store_sums(gl.sum(d1 * scale, axis=2), out_ptr, part_ptr, row, o_m + 8, (o_m + 8 < M) & (row < N), N,
                        SPLIT, pid_k, stride_om, PARTIAL)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_r, row0, 0, M, N, SPLIT, stride_om, ROWS * ROW_BLOCKS, FIX_K,
                   num_warps)


@gluon.jit
def _to_shared(b, QW: gl.constexpr):
    """One ``B`` tensor of the slice (``(1, 32, QW, 4)``) in shared memory, a lane's 4 registers of a stripe in 16
    contiguous bytes and the lanes next to each other (16-byte loads without bank conflicts); one buffer."""
    XL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 1, 2, 0])
    xs = gl.allocate_shared_memory(gl.int32, [1, 1, 32, QW, 4], XL)
    xs.index(0).store(b)
    return xs


@gluon.jit
def _x_pairs(xrow, xmask):
    """``B`` registers of one word of each stripe: slot ``j`` holds ``x[c + j]`` (low half) and ``x[c + j + 4]``."""
    lo = gl.load(xrow, mask=xmask, other=0).to(gl.int32) & 0xFFFF
    hi = gl.load(xrow + 4, mask=xmask, other=0).to(gl.int32)
    return lo | (hi << 16)


@gluon.jit
def _x_word_pairs(x_ptr, g, t, u, q, M, STRIPES, stride_xm, Q: gl.constexpr, WR: gl.constexpr, WK: gl.constexpr,
                  L4: gl.constexpr):
    """The two ``B`` registers of each word with folded rows (as :func:`_x_pairs` at ``c + g % 2`` and ``c + g % 2 +
    2``), from one 16-byte load a word ([Note: x a word at a time]): the 4 int32 of ``x[c .. c + 7]`` (row ``g //
    2``), register 0 the halves ``g % 2`` of int32 0 and 2, register 1 of int32 1 and 3. ``x_ptr`` points at int16
    (bf16 bits)."""
    L5: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, Q, 4, 4], threads_per_warp=[1, 32, 1, 1, 1],
                                        warps_per_cta=[WR, 1, WK, 1, 1], order=[4, 3, 2, 1, 0])  # (L4's, then 4 int32)
    i5 = _along5_last(4, L5)
    g5 = gl.expand_dims(gl.convert_layout(g, gl.SliceLayout(4, L5)), 4)
    t5 = gl.expand_dims(gl.convert_layout(t, gl.SliceLayout(4, L5)), 4)
    u5 = gl.expand_dims(gl.convert_layout(u, gl.SliceLayout(4, L5)), 4)
    q5 = gl.expand_dims(gl.convert_layout(q, gl.SliceLayout(4, L5)), 4)
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    word = gl.load(x32 + (g5 // 2) * (stride_xm // 2) + q5 * 64 + 4 * (4 * t5 + u5) + i5,
                   mask=(g5 // 2 < M) & (q5 < STRIPES) & (i5 < 4), other=0)
    i0, i1, i2, i3 = _split4(word)  # int32 j holds x[c + 2j] and x[c + 2j + 1]
    sel = gl.convert_layout(gl.where(g % 2 == 1, X_HIGH_HALVES, X_LOW_HALVES), i0.type.layout)
    b0 = gl.inline_asm_elementwise(X_HALVES_ASM, "=r,r,r,r", [i0, i2, sel], dtype=gl.int32, is_pure=True, pack=1)
    b1 = gl.inline_asm_elementwise(X_HALVES_ASM, "=r,r,r,r", [i1, i3, sel], dtype=gl.int32, is_pure=True, pack=1)
    return gl.convert_layout(b0, L4), gl.convert_layout(b1, L4)


@gluon.jit
def _x_word_slots(x_ptr, row, word, q, xmask, stride_xm, L4: gl.constexpr):
    """The four ``B`` registers of word ``word`` of each stripe ``q`` of row ``row`` of ``x`` (columns ``c = 128 q + 8
    word`` on; slot ``j``: ``x[c + j]`` low, ``x[c + j + 4]`` high, as :func:`_x_pairs` at ``c + j``), from one
    16-byte load ([Note: x a word at a time]): int32 ``i`` of ``x[c .. c + 7]`` holds ``x[c + 2i]`` and ``x[c + 2i + 1]``, so slot ``j`` takes the halves
    ``j % 2`` of int32 ``j // 2`` and ``j // 2 + 2``. ``x_ptr`` points at int16 (bf16 bits)."""
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    i = _along4(4, 3, L4)  # (the load's int32 along the slots' axis: 4 contiguous a thread)
    v = gl.load(x32 + row * (stride_xm // 2) + q * 64 + 4 * word + i, mask=xmask, other=0)
    i0, i1, i2, i3 = _split4(v)
    s0 = gl.inline_asm_elementwise(X_LOW_ASM, "=r,r,r", [i0, i2], dtype=gl.int32, is_pure=True, pack=1)
    s1 = gl.inline_asm_elementwise(X_HIGH_ASM, "=r,r,r", [i0, i2], dtype=gl.int32, is_pure=True, pack=1)
    s2 = gl.inline_asm_elementwise(X_LOW_ASM, "=r,r,r", [i1, i3], dtype=gl.int32, is_pure=True, pack=1)
    s3 = gl.inline_asm_elementwise(X_HIGH_ASM, "=r,r,r", [i1, i3], dtype=gl.int32, is_pure=True, pack=1)
    return gl.convert_layout(gl.reshape(gl.join(gl.join(s0, s2), gl.join(s1, s3)), v.shape), L4)


@functools.cache
def w4_dense_fold_asm() -> tuple[str, str]:
    """One stripe of INT4 weights with folded rows ([Note: INT4 GEMV with folded rows]), for ``pack=4``: slot ``u``
    is MMA ``u`` of the stripe. Operands, 4 registers each: the lane's words (word ``4t + u`` of the stripe of its
    row), the two ``B`` registers of each MMA, and ``-(128 + zero)`` in both bf16 halves (slot 0). Out: slot 0 the
    stripe's sum of weight row ``g`` times row ``t`` of ``x`` in units of the group's scale, the others ``-0.0``."""
    lines = ["{", ".reg .b32 y, one, s, a<4>;", ".reg .f32 d<4>, z;", "mov.b32 one, 0x3F803F80;",
             "mov.f32 z, 0f00000000;"]
    for u in range(4):
        for p in range(4):  # nibble pair (p, p + 4) of the word: segment p % 2, k 2t (+ 8 from p = 2)
            src = f"${4 + u}"
            if p:
                lines.append(f"shr.u32 s, {src}, {4 * p};")
                src = "s"
            lines += [f"lop3.b32 y, {src}, 0x000F000F, 0x43004300, 0xEA;", f"fma.rn.bf16x2 a{p}, y, one, $16;"]
        acc = "z, z, z, z" if u == 0 else "d0, d1, d2, d3"
        lines.append(f"{_MMA} {{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {{${8 + u}, ${12 + u}}}, {{{acc}}};")
    lines += ["add.f32 $0, d0, d3;", "mov.f32 $1, 0f80000000;", "mov.f32 $2, 0f80000000;", "mov.f32 $3, 0f80000000;",
              "}"]
    return "\n".join(lines), ",".join(["=f"] * 4 + ["r"] * 16)


@gluon.jit
def _w4_fold_rows(w_ptr, s_ptr, z_ptr, rows, w_row, a_col, s_row, g_col, N, stride_wn, stride_sn, stride_zn,
                  HAS_ZEROS: gl.constexpr):
    """A block's operands with folded rows: the lane's 4 words of each stripe of its row, the row's zero point
    (int32; 8 without) and scale (fp32) of each stripe. Unmasked: rows from ``N`` on read row ``N - 1``."""
    r3 = gl.minimum(rows + s_row, N - 1)
    if HAS_ZEROS:
        z = gl.load(z_ptr + r3 * stride_zn + g_col).to(gl.int32)
    else:
        z = gl.zeros_like(g_col) + 8
    return (gl.load(w_ptr + gl.minimum(rows + w_row, N - 1) * stride_wn + a_col), z,
            gl.load(s_ptr + r3 * stride_sn + g_col).to(gl.float32))


@gluon.jit
def dense_mma_w4_fold_kernel(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, STRIPES, SPLIT,
                             stride_xm, stride_wn, stride_sn, stride_zn, stride_om, GROUP: gl.constexpr,
                             HAS_ZEROS: gl.constexpr, Q: gl.constexpr, WK: gl.constexpr, ROW_BLOCKS: gl.constexpr,
                             DEPTH: gl.constexpr, EVEN_K: gl.constexpr, PARTIAL: gl.constexpr, FIX_K: gl.constexpr,
                             LATE: gl.constexpr, ASM: gl.constexpr, ASM_IO: gl.constexpr, XVEC: gl.constexpr,
                             num_warps: gl.constexpr):
    """INT4 with folded rows: ``out[M, N] = x @ dequant(words)^T`` for ``M <= 4`` ([Note: INT4 GEMV with folded
    rows]). Operands as ``dense_mma_w4_kernel``; a program owns ``WK * Q`` stripes, ``Q`` a warp, its warps ``WK``
    along ``K`` by ``num_warps / WK`` along the rows ([Note: fold warps along K]), each of those taking 8 weight rows of
    each block; ``LATE`` (with ``WK`` > 1): each warp's sums of every block kept in shared memory and added across
    the warps along ``K`` once, after the last block, instead of a block at a time; ``ASM`` / ``ASM_IO``:
    ``w4_dense_fold_asm()``."""
    WR: gl.constexpr = num_warps // WK  # warps along the rows
    QW: gl.constexpr = Q * WK  # stripes a program
    L4: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, Q, 4], threads_per_warp=[1, 32, 1, 1],
                                        warps_per_cta=[WR, 1, WK, 1], order=[3, 2, 1, 0])
    Q3: gl.constexpr = gl.SliceLayout(3, L4)  # per stripe
    O2: gl.constexpr = gl.SliceLayout(2, Q3)  # per lane: its sum
    ROWS: gl.constexpr = 8 * WR

    pid_k = gl.program_id(1)
    q = pid_k * QW + _along4(QW, 2, L4)
    u = _along4(4, 3, L4)  # MMA u of a stripe: word 4t + u of the lane's row
    lane = _along4(32, 1, L4)
    g = lane // 4
    t = lane % 4
    # B: column g is row g // 2 of x over segment g % 2; for word c .. c + 7 (c = 128 q + 8 (4t + u)) register 0
    # holds columns c + g % 2 and c + g % 2 + 4, register 1 the same + 2
    if XVEC:  # the word's 8 values of x in one 16-byte load, the lane's halves picked out
        b0, b1 = _x_word_pairs(x_ptr, g, t, u, q, M, STRIPES, stride_xm, Q, WR, WK, L4)
    else:
        xrow = x_ptr + (g // 2) * stride_xm + q * 128 + 8 * (4 * t + u) + g % 2
        xmask = (g // 2 < M) & (q < STRIPES)
        b0 = _x_pairs(xrow, xmask)
        b1 = _x_pairs(xrow + 2, xmask)

    w_row = 8 * _along4(WR, 0, L4) + g
    lane3 = _along3(32, 1, Q3)
    s_row = 8 * _along3(WR, 0, Q3) + lane3 // 4
    q3 = pid_k * QW + _along3(QW, 2, Q3)
    if EVEN_K:
        a_col = q * 16 + 4 * t + u
    else:  # stripes past K read the last one (x is zero there)
        a_col = gl.minimum(q, STRIPES - 1) * 16 + 4 * t + u
        q3 = gl.minimum(q3, STRIPES - 1)
    g_col = q3 // (GROUP // 128)

    o_row, o_m = _fold_slots(WR, O2)
    pid_r = gl.program_id(0)
    row0 = pid_r * (ROWS * ROW_BLOCKS)
    # with LATE, each warp's sums of every block, added across the warps along K once, after the last block
    kept, which = _late_sums_keeper(ROW_BLOCKS, WR, WK, LATE)
    if DEPTH == 1:
        nxt = _w4_fold_rows(w_ptr, s_ptr, z_ptr, row0, w_row, a_col, s_row, g_col, N, stride_wn, stride_sn,
                            stride_zn, HAS_ZEROS)
    for blk in range(ROW_BLOCKS):
        rows = row0 + blk * ROWS
        if DEPTH == 1:  # loaded during the last block; the next block goes in flight now
            words, z, scale = nxt
            if blk + 1 < ROW_BLOCKS:
                nxt = _w4_fold_rows(w_ptr, s_ptr, z_ptr, rows + ROWS, w_row, a_col, s_row, g_col, N, stride_wn,
                                    stride_sn, stride_zn, HAS_ZEROS)
        else:
            words, z, scale = _w4_fold_rows(w_ptr, s_ptr, z_ptr, rows, w_row, a_col, s_row, g_col, N, stride_wn,
                                            stride_sn, stride_zn, HAS_ZEROS)
        nz = gl.broadcast(gl.expand_dims((z | 0xC300) * 0x10001, 3), words)[0]  # -(128 + zero) in both halves
        d = gl.inline_asm_elementwise(ASM, ASM_IO, [words, b0, b1, nz], dtype=gl.float32, is_pure=True, pack=4)
        # slot 0 of each stripe holds its sum in units of the group's scale (the others -0.0, split off)
        d = gl.split(gl.reshape(d, [WR, 32, QW, 2, 2]))[0]
        d = gl.convert_layout(gl.split(d)[0], Q3) * scale
        kept = _block_sums(kept, which, d, blk, rows + o_row, o_m, out_ptr, part_ptr, M, N, SPLIT, pid_k, stride_om,
                           WR, WK, PARTIAL, LATE)  # stripe kw * Q + j of the program is warp kw's j
    _fold_end(kept, out_ptr, part_ptr, count_ptr, pid_r, row0, M, N, SPLIT, pid_k, stride_om, ROWS * ROW_BLOCKS,
              ROW_BLOCKS, WR, WK, PARTIAL, FIX_K, LATE, num_warps)
