"""The INT4 (and INT8) GEMM for Hopper whose weights go into the ``wgmma`` from registers, written in Gluon.

Imported lazily, like ``_specialized_kernels``; only on an sm_90 GPU with a Triton whose Gluon has
``warp_specialize`` (``_pipelined.specialized_possible``).

[Note: fragment wdot] The warp-specialized kernel ([Note: warp-specialized wdot] in ``_specialized_kernels``) writes
each dequantized tile to shared memory, and its ``wgmma`` reads it back from there: 32 KB of a 256 x 128 x 64 tile's
~130 KB of shared memory traffic, which is about what the SM can move at the tensor pipe's full rate. Here the
MMA warp groups dequantize their own 64 weight rows straight into the registers of the ``wgmma``'s A operand:

- the A fragment of ``m64nNk16`` gives lane ``4g + t`` of warp ``w`` rows ``16w + g`` and ``16w + g + 8``, columns
  ``2t, 2t + 1, 2t + 8, 2t + 9`` of each 16-column step. Over a 64-column tile that is byte ``t`` of each of the
  row's 8 INT4 words (word ``c`` holds columns ``8c .. 8c + 7``, two a byte). So every lane of a quad loads the
  row's 8 words (the same addresses: one shared memory broadcast, four 16-byte loads a thread) and dequantizes byte
  ``t`` of each into one bf16 pair, which is already a fragment register. The tensor is built as
  ``(64, 8 words, 4 lanes t, 2 columns)`` in a linear layout whose bases are the fragment's, so that reshaping it to
  ``(64, 64)`` and converting to the ``wgmma`` operand layout moves no data (sm_90 SASS: no shared-memory store or
  shuffle in the loop);
- a pair costs a ``prmt`` (byte ``t``, zero-extended), a multiply by ``0x1001`` (the byte's low nibble stays at bits
  0-3, its high nibble lands at bits 16-19), one ``lop3`` (both nibbles masked, ``128 + q`` in both halves), a
  ``sub`` of ``128 + z`` (exact) and a ``mul`` by the scale: one rounding, as in [Note: packed INT4 dequantization]
  in ``_wmma_kernels``, so the output is bit for bit the warp-specialized kernel's (``benchmarks/fragment_check.py``).
  Session 19 replaced two shifts and two ``lop3`` by the first three: 187 -> 172 instructions a tile in the loop
  with 8-row blocks (sm_90 SASS), +1 to +9 % (kernels run 112);
- each of the two MMA warp groups is its own partition (``gl.warp_specialize``), on its own 64 of the program's
  128 weight rows, and one loader warp keeps rings of word tiles and ``x`` blocks full by TMA. A slot is refilled
  once both warp groups have released it: its ``empty`` mbarrier counts two arrives, one a warp group (an arrive is
  its partition's first thread's, after the partition's own barrier);
- a warp group retires each tile's ``wgmma`` before it dequantizes the next tile. A first version kept one in
  flight, as the other kernels do, with both warp groups in one partition: ptxas wrote the next tile's fragments to
  the registers the in-flight ``HGMMA`` was reading (R152-R167, ``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the outputs
  were wrong in every config with two warp groups (kernels run 84). With the warp groups as separate partitions,
  one in flight makes ptxas serialize every ``HGMMA`` instead ("insufficient register resources", even with
  128-row blocks; sm_90 compile). Overlap comes from the two warp groups: while one dequantizes, the other's
  ``wgmma`` runs;
- with split-K each warp group stores its rows' partial and sums them on its own counter (``2 tile + WG``).

[Note: tail split] One program runs one tile; at 512 rows and more there are more tiles than SMs, and the last
wave can be short: 8192 x 28672 at 512 rows has 448 tiles of 128 x 256, 3.4 waves on 132 SMs, so for the last
quarter of the time 80 SMs idle (kernels run 90). Splitting every tile's ``K`` to fill that wave would need 29 M fp32
partials, past the fix-up workspace. So the grid is 1-D: the tiles of the whole waves come first and run whole; each
tile of the last wave runs in ``SPLIT_K`` slices of ``K``, as many as the SMs that wave leaves free allow (52 tiles
in two slices: 104 programs of half a tile, where 52 whole tiles took a full tile's time). Only those tiles keep
partials, each warp group's in a compact ``64 x BLOCK_M`` block per slice (3.4 M floats in the example), summed by
the tile's last slice in slice order as every split-K fix-up here ([Note: split-K fix-up] in ``_word``). Tiles are
numbered weight-row block first, as the 2-D grid was, and whole tiles launch before split ones. With no whole tiles
(``WHOLE = 0``) every tile is split: the uniform split-K that fills a grid of less than one wave.

[Note: paired tiles] With ``PAIR`` a warp group dequantizes two tiles into two sets of fragment registers (32
a thread instead of 16), issues both tiles' ``wgmma`` back to back (eight ``HGMMA``) and retires them once, then
releases both tiles' slots after one barrier. The per-round costs (the retire's drain, the barrier, the ring waits)
are paid once per two tiles, and each warp group's bursts on the tensor pipe are twice as long, while its dequantizing
phase is twice as long too. Whether that wins depends on the shape (kernels run 96: +2 to +5 % in most cells from 512
to 2048 rows, 3-12 % slower in some), so the tuner times both from 256 rows (``_word.FRAGMENT_PAIR_MIN_M``). An odd
tile count ends with one unpaired tile. The accumulation order is unchanged, so the output is bit for bit the
unpaired kernel's.

[Note: overlapped fragments] With ``OVERLAP`` a warp group issues tile ``j``'s ``wgmma`` and builds tile ``j + 1``'s
fragments before it retires ``j`` (``j``'s fragments among the wait's ``deps``, so they stay alive to it). In the
sm_90 SASS, ptxas gives the new fragments the registers of the in-flight ``HGMMA``'s A operand and holds every write
to them until the ``DEPBAR``: the ring wait, the four shared-memory loads of the words, the next group's scale loads
and packing, and part of the shifts and masks run under the ``wgmma``; the subtract and multiply that write the
fragments come after it (``tests/test_kernels_fragment.py`` checks that no write to an in-flight A register comes
before the retire: the hazard of kernels run 84 above). So the latency of each tile's loads now hides under the warp
group's own ``wgmma`` as well as the other warp group's (kernels run 104: +4 to +12 % with 256-row blocks, equal with
128; bit for bit the same output). The tuner's unpaired configs all overlap.

[Note: fragment wdot at small M] Below 128 rows the kernel runs with one block of ``x`` as small as the rows allow
(``BLOCK_M`` 8 to 64, the ``wgmma``'s N), so that a program streams its 128 weight rows once through the TMA rings
like a GEMV on tensor cores; eight ``x`` and word buffers (kernels run 111: more buffers were slower). The MMA is
nearly free there and the loop is bound by instruction issue: ~170 instructions a warp a tile, ~100 of them the
dequantization, for 4 KB of words (Nsight Compute, run 110: 0.56 instructions a cycle a scheduler, the rest waiting
on the rings). Over the Triton ``wdot`` it wins at 32 and 64 rows (+5 to +18 %) and
is within a few percent either way at 4 and 16, so the tuner times both from 2 rows (``_word.FRAGMENT_SMALL_MIN_M``).

[Note: four warp groups at small M] With ``NWG = 4`` a program has four MMA warp groups (256 weight rows) and the
loader warp: 17 warps, four consumer warps a scheduler where two left the issue slots idle half the time (kernels run
110). The register file then allows 104 registers a consumer thread (``setmaxnreg``), enough where the accumulator is
small (at most 64 rows of ``x``: 32 registers) and no spill (sm_90 SASS, ``tests/test_kernels_fragment.py``); with
large blocks it spilled (kernels run 99). Each warp group's rows, sums and partials are those of ``NWG = 2``; only the
program that computes them changes, and the counters are ``NWG`` a tile. Kernels run 118, over bf16, two / four warp
groups (best split each): at 16 rows 1.96 / **2.27** on 8192x28672, 1.87 / 1.90 on 8192x8192, 2.13 / 2.10 on
28672x8192; at 64 rows 1.65 / **1.99**, 1.71 / 1.69, 1.76 / **1.92**. The tuner offers both below 128 rows, at every
``N``: run 119 (``benchmarks/fragment_check.py --small``, an H200) found four warp groups bit for bit equal to two,
with 1000 weight rows (a partial last block) and split-K of 1-3 slices among the cases.

[Note: INT8 fragments] The same kernel runs INT8 words (``w_desc`` blocks of 16 words a row, which the kernel reads
as ``INT8``). A 64-column tile row is 16 words of four columns, and the A fragment's register ``j`` of lane ``4g + 2h
+ b`` holds columns ``8j + 4h + 2b`` and ``+ 1``: bytes ``2b`` and ``2b + 1`` of word ``2j + h``. So a lane loads 8 of
its rows' 16 words (every other one; lanes ``b = 0, 1`` the same), and the tensor is ``(64, 8, 2, 2, 2)`` (rows, j,
h, b, column of the pair) in a linear layout whose ``(64, 64)`` reshape is the fragment, as for INT4. A pair is
exact in six instructions (bf16): an xor makes each byte ``v + 128``; a ``prmt`` puts each byte under ``0x4B0000``,
the fp32 ``2^23 + v + 128``; one subtract each leaves ``v``, and one ``cvt`` rounds both (exactly) into a bf16 pair.
bf16's 8 bits of precision cannot hold ``256 + v`` as the INT4 path's magic number does. fp16 x takes ``1024 + v +
128`` straight from the ``prmt`` (three instructions). The per-channel scale multiplies the row's fp32 sums before
the store, so there are no group scales to load. That rounds once less than a dequantized bf16 weight: outputs are
within ~2e-3 of the bf16 reference, not bit for bit any other kernel's (its own schedules agree bit for bit:
``benchmarks/fragment_check.py``, kernels run 127). Kernels run 125 (H100, best config over cuBLAS bf16, against
the path the tuner chose before, the pipelined INT8 kernel from 128 rows): 0.99-1.12x at 256 rows (0.80-0.87x),
0.87-0.97x at 1024 (0.66-0.70x), 1.35-1.72x at 64 (1.36-1.57x). From 2 rows the tuner times it beside the others;
run 126, the peers' benchmark: W8A16 1.00 / 1.02 / 1.09x at 256 rows.

[Note: slots of two tiles] Every mbarrier wait and arrive of a warp group costs a warp-group ``bar.sync`` besides
the one before the arrives (Triton 3.6 puts one before each, sm_90 PTX): four a tile, plus the try-wait loops and
their address arithmetic. With ``SUB = 2`` a ring slot holds two 64-column tiles of words and of ``x`` (two TMA copies
on one mbarrier each), so a warp group waits for and releases a slot every two tiles: the loop of two tiles is 280
instructions where two one-tile rounds are 344 (16-row blocks), and the second tile's dequantization runs under the
first tile's ``wgmma`` in registers of its own (11 of its 16 multiplies before the retire). The tiles, their order
and so the output are those of ``SUB = 1`` (``benchmarks/fragment_check.py``), except that split-K slices ``K`` in
whole slots, which can move a slice's bounds (and so the rounding of the partials); ``stages`` and ``q_stages`` count
slots. Only overlapped; ``K`` a multiple of 128. Kernels run 115: at 16 rows +5 and +14 % on
8192x28672 and 28672x8192 (three slots each), -10 % on 8192x8192, and 2-6 % slower at 1024 rows, so the tuner
offers it for blocks of 8 and 16 rows only.

Measured on an H100 (benchmarks/RESULTS.md, kernels runs 86-88, over cuBLAS bf16): 1.11-1.23x at 128 rows,
0.92-0.93x at 256, 0.74-0.82x at 512 and 0.75-0.83x at 1024, the fastest of the INT4 kernels in every cell. Then
(session 18) the tail split, paired tiles and scales packed a group after their load (``_group_load``: Nsight's
stall sampling had the warp groups waiting on the scale loads at each group's start, kernels run 100): +3 to +16 %
in every cell (runs 101-102).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ._pipelined_kernels import BK, BW, _cta_barrier, _split_tiles, _store_acc, _tma_load


def _fragment_asm(magic: str, pair: str) -> str:
    """``$0`` the pair of columns ``2t, 2t + 1`` of a word's byte ``t``: ``$1`` the word, ``$3`` ``0x4440 + t`` (the
    ``prmt`` selector of byte ``t``), ``$5`` the scale and ``$7`` ``128 + z`` (fp16: ``1024 + z``) as 16-bit pairs
    ($2, $4, $6, $8 are their copies: pack 2). ``b * 0x1001 = b | b << 12`` puts the byte's low nibble at bits 0-3
    and its high nibble at bits 16-19, where one ``lop3`` masks both and ors the magic number in: three integer
    instructions a pair ([Note: fragment wdot])."""
    return "\n".join(["{", ".reg .b32 d;", "prmt.b32 d, $1, 0, $3;",  # byte t, zero-extended
                      "mul.lo.u32 d, d, 4097;",  # b | b << 12
                      f"lop3.b32 d, d, 0x000f000f, {magic}, 0xea;",  # (d & 0x000f000f) | magic: 128 + each nibble
                      f"sub.rn.{pair} d, d, $7;", f"mul.rn.{pair} $0, d, $5;", "}"])


_ASM_FRAG_BF16 = gl.constexpr(_fragment_asm("0x43004300", "bf16x2"))
_ASM_FRAG_F16 = gl.constexpr(_fragment_asm("0x64006400", "f16x2"))
_ASM_FRAG_IO = gl.constexpr("=r," + ",".join(["r"] * 8))


def _fragment8_asm(half: bool) -> str:
    """INT8 ([Note: INT8 fragments]): ``$0`` the pair of columns in bytes ``2b, 2b + 1`` of the word ``$1``; ``$3``
    the ``prmt`` selectors (bf16: the first value's in bits 0-15, the second's in bits 16-31). The xor makes each
    signed byte ``v + 128``; bf16 has too few mantissa bits for ``256 + (v + 128)``, so each byte goes into an fp32
    ``2^23 + v + 128``, loses ``2^23 + 128`` exactly and the two are rounded (exactly: |v| <= 128) into a bf16
    pair; fp16 takes ``1024 + v + 128`` directly."""
    lines = ["{", ".reg .b32 u, lo, hi, c;", "lop3.b32 u, $1, 0x80808080, 0, 0x3c;"]  # xor: v + 128 a byte
    if half:
        lines += ["prmt.b32 lo, u, 0x64646464, $3;", "mov.b32 c, 0x64806480;", "sub.rn.f16x2 $0, lo, c;"]
    else:
        lines += [".reg .f32 a, b;", "shr.b32 c, $3, 16;",
                  "prmt.b32 lo, u, 0x4B000000, $3;", "prmt.b32 hi, u, 0x4B000000, c;",
                  "mov.b32 a, lo;", "mov.b32 b, hi;", "sub.rn.f32 a, a, 0f4B000080;", "sub.rn.f32 b, b, 0f4B000080;",
                  "cvt.rn.bf16x2.f32 $0, b, a;"]
    return "\n".join(lines + ["}"])


_ASM_FRAG8_BF16 = gl.constexpr(_fragment8_asm(False))
_ASM_FRAG8_F16 = gl.constexpr(_fragment8_asm(True))
_ASM_FRAG8_IO = gl.constexpr("=r,r,r,r,r")


@gluon.jit
def _load_part(x_desc, w_desc, x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, off_m, off_n, t_lo, n_tiles,
               XSTAGES: gl.constexpr, QSTAGES: gl.constexpr, SUB: gl.constexpr):
    """The loader warp: words run ``QSTAGES - XSTAGES`` slots ahead of ``x`` (they come from HBM, ``x`` mostly from
    L2), each slot's copies (``SUB`` tiles, [Note: slots of two tiles]) issued once the slot is free."""
    LEAD: gl.constexpr = QSTAGES - XSTAGES
    WPT: gl.constexpr = q_smem.shape[2]  # words a tile row: 8 INT4, 16 INT8
    n_slots = n_tiles // SUB
    for i in range(n_slots + LEAD):
        if i < n_slots:
            qs = i % QSTAGES
            mbarrier.wait(q_empty.index(qs), ((i // QSTAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
            mbarrier.expect(q_ready.index(qs), SUB * w_desc.block_type.nbytes)
            for h in gl.static_range(SUB):
                _tma_load(w_desc, [off_n, (t_lo + i * SUB + h) * WPT], q_ready.index(qs), q_smem.index(qs * SUB + h))
        j = i - LEAD
        if j >= 0:
            xs = j % XSTAGES
            mbarrier.wait(x_empty.index(xs), ((j // XSTAGES) & 1) ^ 1)
            mbarrier.expect(x_ready.index(xs), SUB * x_desc.block_type.nbytes)
            for h in gl.static_range(SUB):
                _tma_load(x_desc, [off_m, (t_lo + j * SUB + h) * BK], x_ready.index(xs), x_smem.index(xs * SUB + h))


@gluon.jit
def _spread(v, like):
    """A per-row vector ``(BN,)`` broadcast over ``like``'s ``(BN, 8, 4, 2)`` (registers only)."""
    return gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 1), 2), 3), like)[0]


@gluon.jit
def _group_load(s_ptr, z_ptr, rows, rmask, g, stride_sn, HAS_ZEROS: gl.constexpr):
    """Group ``g``'s scales and zero points of the rows as stored (symmetric: the scales twice); packed by
    ``_group_pack`` only when the group starts, a group after the load, so that no instruction waits for it (kernels
    run 100: packing at the load stalled the warp groups on it)."""
    s = gl.load(s_ptr + rows * stride_sn + g, mask=rmask, other=0.0)
    z = s
    if HAS_ZEROS:
        z = gl.load(z_ptr + rows * stride_sn + g, mask=rmask, other=0)
    return s, z


@gluon.jit
def _group_pack(s, z, HAS_ZEROS: gl.constexpr, HALF: gl.constexpr):
    """The scales and ``128 + z`` (fp16: ``1024 + z``) of ``_group_load``, each as a 16-bit pair in an int32."""
    if HAS_ZEROS:
        zf = z.to(gl.float32)
    else:
        zf = gl.full(s.shape, 8.0, gl.float32, s.type.layout)
    base: gl.constexpr = 1024.0 if HALF else 128.0
    zz = (zf + base).to(s.dtype)
    sb = s.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    zb = zz.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return sb | (sb << 16), zb | (zb << 16)


@gluon.jit
def _fragments(q_smem, q_ready, j, t, s_cur, z_cur, s_nxt, z_nxt, s_ptr, z_ptr, rows, rmask, groups, sel, like,
               stride_sn, WG: gl.constexpr, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, HALF: gl.constexpr,
               QSTAGES: gl.constexpr, W_L: gl.constexpr, a_l: gl.constexpr):
    """Tile ``j`` (``t`` of ``K``) of the warp group's rows as the ``wgmma``'s A fragments, and the scales after it:
    ``s_cur, z_cur`` packed, ``s_nxt, z_nxt`` the next group's as loaded a group ahead (``_group_load``). One tile
    a slot of the word ring."""
    qs = j % QSTAGES
    a, s_cur, z_cur, s_nxt, z_nxt = _fragments_in(q_smem, q_ready, qs, (j // QSTAGES) & 1, qs, j, t, s_cur, z_cur,
                                                  s_nxt, z_nxt, s_ptr, z_ptr, rows, rmask, groups, sel, like,
                                                  stride_sn, True, WG, GROUP, HAS_ZEROS, HALF, W_L, a_l)
    return a, s_cur, z_cur, s_nxt, z_nxt


@gluon.jit
def _fragments_in(q_smem, q_ready, slot, phase, buf, j, t, s_cur, z_cur, s_nxt, z_nxt, s_ptr, z_ptr, rows, rmask,
                  groups, sel, like, stride_sn, WAIT: gl.constexpr, WG: gl.constexpr, GROUP: gl.constexpr,
                  HAS_ZEROS: gl.constexpr, HALF: gl.constexpr, W_L: gl.constexpr, a_l: gl.constexpr):
    """``_fragments`` of the word tile in buffer ``buf``; with ``WAIT``, after waiting for ring slot ``slot`` in
    ``phase`` (a slot of ``SUB`` tiles is waited for at its first: [Note: slots of two tiles])."""
    TILES_PER_GROUP: gl.constexpr = GROUP // BK
    INT8: gl.constexpr = q_smem.shape[2] == 16
    if not INT8:  # (INT8: one scale a row, applied to the sums)
        if (t % TILES_PER_GROUP == 0) & (j > 0):
            s_cur, z_cur = _group_pack(s_nxt, z_nxt, HAS_ZEROS, HALF)
            s_nxt, z_nxt = _group_load(s_ptr, z_ptr, rows, rmask, gl.minimum(t // TILES_PER_GROUP + 1, groups - 1),
                                       stride_sn, HAS_ZEROS)
    if WAIT:
        mbarrier.wait(q_ready.index(slot), phase)
    w = q_smem.index(buf).slice(WG * 64, 64, dim=0).load(W_L)
    if INT8:  # [Note: INT8 fragments]: word 2j + h of the row is (j, h) of the fragment's (64, 8, 2, 2, 2)
        W3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, like.type.layout))
        w3 = gl.convert_layout(gl.reshape(w, [64, 8, 2]), W3)
        w5 = gl.broadcast(gl.expand_dims(gl.expand_dims(w3, 3), 4), like)[0]
        if HALF:
            f = gl.inline_asm_elementwise(_ASM_FRAG8_F16, _ASM_FRAG8_IO, [w5, sel], dtype=gl.float16, is_pure=True,
                                          pack=2)
        else:
            f = gl.inline_asm_elementwise(_ASM_FRAG8_BF16, _ASM_FRAG8_IO, [w5, sel], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
    elif HALF:
        w4 = gl.broadcast(gl.expand_dims(gl.expand_dims(w, 2), 3), like)[0]
        f = gl.inline_asm_elementwise(_ASM_FRAG_F16, _ASM_FRAG_IO,
                                      [w4, sel, _spread(s_cur, like), _spread(z_cur, like)],
                                      dtype=gl.float16, is_pure=True, pack=2)
    else:
        w4 = gl.broadcast(gl.expand_dims(gl.expand_dims(w, 2), 3), like)[0]
        f = gl.inline_asm_elementwise(_ASM_FRAG_BF16, _ASM_FRAG_IO,
                                      [w4, sel, _spread(s_cur, like), _spread(z_cur, like)],
                                      dtype=gl.bfloat16, is_pure=True, pack=2)
    a = gl.convert_layout(gl.reshape(f, [64, BK]), a_l)
    return a, s_cur, z_cur, s_nxt, z_nxt


@gluon.jit
def _consumer(x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, off_n,
              off_m, M, N, K, t_lo, n_tiles, tile, k_slice, split, p_tile, stride_sn, stride_om, WG: gl.constexpr,
              GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_M: gl.constexpr, XSTAGES: gl.constexpr,
              QSTAGES: gl.constexpr, PAIR: gl.constexpr, OVERLAP: gl.constexpr, SUB: gl.constexpr,
              NWG: gl.constexpr):
    """One MMA warp group (its own partition): weight rows ``off_n + 64 WG ..``, each tile's words -> A fragments in
    registers -> ``wgmma``, retired before the next tile's fragments take the registers (with ``PAIR``, two tiles'
    fragments, then both ``wgmma``, then one retire); then its rows of the output."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    # (rows, words, lanes t, columns of a pair): the A fragment's bases ([Note: fragment wdot])
    L4: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0], [8, 0, 0, 0]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[64, BW, 4, 2])
    HALF: gl.constexpr = x_smem.dtype == gl.float16
    INT8: gl.constexpr = q_smem.shape[2] == 16
    row0 = off_n + WG * 64
    TILES_PER_GROUP: gl.constexpr = GROUP // BK
    groups = K // GROUP
    if INT8:  # [Note: INT8 fragments]: (rows, j, h, b, e), column 8j + 4h + 2b + e: byte 2b + e of word 2j + h
        L5: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 0, 1], [0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 4, 0, 0, 0], [8, 0, 0, 0, 0]],
            lane_bases=[[0, 0, 0, 1, 0], [0, 0, 1, 0, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]],
            warp_bases=[[16, 0, 0, 0, 0], [32, 0, 0, 0, 0]], block_bases=[], shape=[64, 8, 2, 2, 2])
        # (64, 16) words: a lane the 8 words 2j + h of its two rows (h: lane bit 1; lane bit 0 reads the same)
        W_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 2], [0, 4], [0, 8], [8, 0]], lane_bases=[[0, 0], [0, 1], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])
        R_L: gl.constexpr = gl.SliceLayout(1, W_L)
        like = gl.zeros([64, 8, 2, 2, 2], gl.int32, L5)
        b_idx = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            4, L5)))))[None, None, None, :, None]
        if HALF:  # bytes 2b, 2b + 1 into the low bytes of two fp16 whose high bytes are 0x64
            sel = gl.broadcast((0x4140 + 0x202 * b_idx).to(gl.int32), like)[0]
        else:  # byte 2b (then 2b + 1) under 0x4B0000 as an fp32
            sel = gl.broadcast((0x7650 + 2 * b_idx + ((0x7651 + 2 * b_idx) << 16)).to(gl.int32), like)[0]
        rows = row0 + gl.arange(0, 64, layout=R_L)
        rmask = rows < N
        s_cur = gl.zeros([64], gl.int32, R_L)  # (no group scales: threaded through unused)
        z_cur = s_cur
        s_nxt = s_cur
        z_nxt = s_cur
    else:
        L3: gl.constexpr = gl.SliceLayout(3, L4)
        W_L: gl.constexpr = gl.SliceLayout(2, L3)  # (64, 8) words, every lane of a quad the row's all
        R_L: gl.constexpr = gl.SliceLayout(1, W_L)  # (64,) per row
        T_L: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L3))  # (4,) per lane t
        rows = row0 + gl.arange(0, 64, layout=R_L)
        rmask = rows < N
        like = gl.zeros([64, BW, 4, 2], gl.int32, L4)
        t_idx = gl.arange(0, 4, layout=T_L) + 0x4440  # the prmt selector of byte t ([Note: fragment wdot])
        sel = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(t_idx, 0), 1), 3), like)[0]
        g0 = t_lo // TILES_PER_GROUP
        s0, z0 = _group_load(s_ptr, z_ptr, rows, rmask, g0, stride_sn, HAS_ZEROS)
        s_cur, z_cur = _group_pack(s0, z0, HAS_ZEROS, HALF)
        s_nxt, z_nxt = _group_load(s_ptr, z_ptr, rows, rmask, gl.minimum(g0 + 1, groups - 1), stride_sn,
                                   HAS_ZEROS)
    acc = gl.zeros([64, BLOCK_M], gl.float32, acc_l)
    n_single = n_tiles
    if PAIR:
        n_single = n_tiles % 2
        for jj in range(n_tiles // 2):
            j = 2 * jj
            a0, s_cur, z_cur, s_nxt, z_nxt = _fragments(q_smem, q_ready, j, t_lo + j, s_cur, z_cur, s_nxt, z_nxt,
                                                         s_ptr, z_ptr, rows, rmask, groups, sel, like, stride_sn,
                                                         WG, GROUP, HAS_ZEROS, HALF, QSTAGES, W_L, a_l)
            a1, s_cur, z_cur, s_nxt, z_nxt = _fragments(q_smem, q_ready, j + 1, t_lo + j + 1, s_cur, z_cur, s_nxt,
                                                         z_nxt, s_ptr, z_ptr, rows, rmask, groups, sel, like,
                                                         stride_sn, WG, GROUP, HAS_ZEROS, HALF, QSTAGES, W_L, a_l)
            x0 = j % XSTAGES
            x1 = (j + 1) % XSTAGES
            mbarrier.wait(x_ready.index(x0), (j // XSTAGES) & 1)
            acc = warpgroup_mma(a0, x_smem.index(x0).permute((1, 0)), acc, is_async=True)
            mbarrier.wait(x_ready.index(x1), ((j + 1) // XSTAGES) & 1)
            acc = warpgroup_mma(a1, x_smem.index(x1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _cta_barrier()  # this warp group: its words of both tiles read, its wgmma retired
            mbarrier.arrive(q_empty.index(j % QSTAGES))
            mbarrier.arrive(q_empty.index((j + 1) % QSTAGES))
            mbarrier.arrive(x_empty.index(x0))
            mbarrier.arrive(x_empty.index(x1))
    elif SUB > 1:  # [Note: slots of two tiles], overlapped as below
        n_single = 0
        n_slots = n_tiles // SUB
        if n_slots > 0:
            a, s_cur, z_cur, s_nxt, z_nxt = _fragments_in(q_smem, q_ready, 0, 0, 0, 0, t_lo, s_cur, z_cur, s_nxt,
                                                          z_nxt, s_ptr, z_ptr, rows, rmask, groups, sel, like,
                                                          stride_sn, True, WG, GROUP, HAS_ZEROS, HALF, W_L, a_l)
            for i in range(n_slots):
                xs = i % XSTAGES
                qs = i % QSTAGES
                mbarrier.wait(x_ready.index(xs), (i // XSTAGES) & 1)
                for h in gl.static_range(SUB):
                    j = i * SUB + h
                    acc = warpgroup_mma(a, x_smem.index(xs * SUB + h).permute((1, 0)), acc, is_async=True)
                    if h == SUB - 1:
                        # the next slot's first tile; after the last slot its own last tile again (its slot is not
                        # released yet, so the wait passes), built and dropped
                        nxt = gl.minimum(i + 1, n_slots - 1)
                        ns = nxt % QSTAGES
                        b, s_cur, z_cur, s_nxt, z_nxt = _fragments_in(
                            q_smem, q_ready, ns, (nxt // QSTAGES) & 1, ns * SUB, j + 1, t_lo + nxt * SUB, s_cur,
                            z_cur, s_nxt, z_nxt, s_ptr, z_ptr, rows, rmask, groups, sel, like, stride_sn, True, WG,
                            GROUP, HAS_ZEROS, HALF, W_L, a_l)
                    else:
                        b, s_cur, z_cur, s_nxt, z_nxt = _fragments_in(
                            q_smem, q_ready, qs, 0, qs * SUB + h + 1, j + 1, t_lo + j + 1, s_cur, z_cur, s_nxt, z_nxt,
                            s_ptr, z_ptr, rows, rmask, groups, sel, like, stride_sn, False, WG, GROUP, HAS_ZEROS,
                            HALF, W_L, a_l)
                    acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
                    a = b
                _cta_barrier()  # this warp group: its words of the slot read, its wgmma retired
                mbarrier.arrive(q_empty.index(qs))
                mbarrier.arrive(x_empty.index(xs))
    elif OVERLAP:  # [Note: overlapped fragments]
        n_single = 0
        if n_tiles > 0:
            a, s_cur, z_cur, s_nxt, z_nxt = _fragments(q_smem, q_ready, 0, t_lo, s_cur, z_cur, s_nxt, z_nxt, s_ptr,
                                                       z_ptr, rows, rmask, groups, sel, like, stride_sn, WG, GROUP,
                                                       HAS_ZEROS, HALF, QSTAGES, W_L, a_l)
            for j in range(n_tiles - 1):
                xs = j % XSTAGES
                mbarrier.wait(x_ready.index(xs), (j // XSTAGES) & 1)
                acc = warpgroup_mma(a, x_smem.index(xs).permute((1, 0)), acc, is_async=True)
                b, s_cur, z_cur, s_nxt, z_nxt = _fragments(q_smem, q_ready, j + 1, t_lo + j + 1, s_cur, z_cur, s_nxt,
                                                           z_nxt, s_ptr, z_ptr, rows, rmask, groups, sel, like,
                                                           stride_sn, WG, GROUP, HAS_ZEROS, HALF, QSTAGES, W_L, a_l)
                # ``a`` is a dependency of the retire: its registers stay the in-flight wgmma's until here
                acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
                _cta_barrier()  # this warp group: its words of tile j read, its wgmma retired
                mbarrier.arrive(q_empty.index(j % QSTAGES))
                mbarrier.arrive(x_empty.index(xs))
                a = b
            j = n_tiles - 1
            xs = j % XSTAGES
            mbarrier.wait(x_ready.index(xs), (j // XSTAGES) & 1)
            acc = warpgroup_mma(a, x_smem.index(xs).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _cta_barrier()
            mbarrier.arrive(q_empty.index(j % QSTAGES))
            mbarrier.arrive(x_empty.index(xs))
    for i in range(n_single):
        j = n_tiles - n_single + i
        a, s_cur, z_cur, s_nxt, z_nxt = _fragments(q_smem, q_ready, j, t_lo + j, s_cur, z_cur, s_nxt, z_nxt, s_ptr,
                                                   z_ptr, rows, rmask, groups, sel, like, stride_sn, WG, GROUP,
                                                   HAS_ZEROS, HALF, QSTAGES, W_L, a_l)
        xs = j % XSTAGES
        mbarrier.wait(x_ready.index(xs), (j // XSTAGES) & 1)
        acc = warpgroup_mma(a, x_smem.index(xs).permute((1, 0)), acc, is_async=True)
        # the next tile's fragments take this one's registers (ptxas reuses them even while a wgmma that reads
        # them is in flight: kernels run 84), so the wgmma is retired here; the other warp group's runs meanwhile
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _cta_barrier()  # this warp group: its words of the tile read, its wgmma retired
        mbarrier.arrive(q_empty.index(j % QSTAGES))
        mbarrier.arrive(x_empty.index(xs))
    if INT8:  # the row's scale on its sums ([Note: INT8 fragments])
        a_rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
        acc = acc * gl.expand_dims(gl.load(s_ptr + a_rows, mask=a_rows < N, other=0.0).to(gl.float32), 1)
    p_slice = 64 * BLOCK_M  # a compact partial block per warp group, slice and split tile ([Note: tail split])
    _store_acc(acc, out_ptr, part_ptr, count_ptr, row0, off_m, M, N, split, stride_om, tile * NWG + WG, k_slice,
               (p_tile * NWG + WG) * split * p_slice, p_slice, 64, 64, BLOCK_M, 4)


@gluon.jit
def w4_fragment_kernel(x_desc, w_desc, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, WHOLE, SPLIT_K,
                       stride_sn, stride_om, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_M: gl.constexpr,
                       XSTAGES: gl.constexpr, QSTAGES: gl.constexpr, MMA_REGS: gl.constexpr, num_warps: gl.constexpr,
                       PAIR: gl.constexpr = False, OVERLAP: gl.constexpr = False, SUB: gl.constexpr = 1,
                       NWG: gl.constexpr = 2):
    """``out[M, N] = x @ dequant(W)^T`` for INT4 words, ``x`` and scales in bf16 or fp16 ([Note: fragment wdot]);
    INT8 words where ``w_desc`` has blocks of 16 words a row, one scale a row ([Note: INT8 fragments]).
    Tiles of ``64 NWG`` (128 or 256) weight rows x ``BLOCK_M`` rows of ``x``, numbered weight-row block first; the
    first ``WHOLE`` run whole, each of the others in ``SPLIT_K`` slices of ``K`` ([Note: tail split]): a 1-D grid of
    ``WHOLE + (tiles - WHOLE) SPLIT_K`` programs. ``K`` a multiple of 64, ``GROUP`` of 64. ``num_warps`` is 4, the
    first MMA warp group (weight rows 0-63 of the program's); the others and the loader warp come on top. A split
    tile's warp groups each sum their own rows' partials, on their own counters (``NWG tile + WG``)."""
    pid = gl.program_id(0)
    tail = (pid >= WHOLE).to(gl.int32)
    r = gl.maximum(pid - WHOLE, 0)
    p_tile = r // SPLIT_K  # the tile's number among the split ones
    tile = pid + tail * (WHOLE + p_tile - pid)
    k_slice = r % SPLIT_K
    split = 1 + tail * (SPLIT_K - 1)
    BN: gl.constexpr = 64 * NWG  # weight rows a program: 64 an MMA warp group ([Note: four warp groups at small M])
    row_blocks = gl.cdiv(N, BN)
    off_n = (tile % row_blocks) * BN
    off_m = (tile // row_blocks) * BLOCK_M
    t_lo, n_tiles = _split_tiles(K // SUB, split, k_slice)  # in slots of SUB tiles ([Note: slots of two tiles])
    t_lo = t_lo * SUB
    n_tiles = n_tiles * SUB

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [XSTAGES * SUB, BLOCK_M, BK], x_desc.layout)
    WPT: gl.constexpr = w_desc.block_type.shape[1]  # words a tile row: 8 INT4, 16 INT8 ([Note: INT8 fragments])
    q_smem = gl.allocate_shared_memory(gl.int32, [QSTAGES * SUB, BN, WPT], w_desc.layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [QSTAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [QSTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(XSTAGES):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(x_empty.index(i), count=NWG)  # one arrive per MMA warp group
    for i in gl.static_range(QSTAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NWG)

    # The two calls spell out their partitions: a list built from one consumer entry (a comprehension or tuple
    # concatenation) loses the constexpr-ness of WG and fails to compile in Triton 3.6's Gluon.
    if NWG == 4:  # [Note: four warp groups at small M]
        gl.warp_specialize([
            (_consumer, (x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, s_ptr, z_ptr, out_ptr, part_ptr,
                         count_ptr, off_n, off_m, M, N, K, t_lo, n_tiles, tile, k_slice, split, p_tile, stride_sn,
                         stride_om, gl.constexpr(0), GROUP, HAS_ZEROS, BLOCK_M, XSTAGES, QSTAGES, PAIR, OVERLAP, SUB,
                         NWG)),
            (_consumer, (x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, s_ptr, z_ptr, out_ptr, part_ptr,
                         count_ptr, off_n, off_m, M, N, K, t_lo, n_tiles, tile, k_slice, split, p_tile, stride_sn,
                         stride_om, gl.constexpr(1), GROUP, HAS_ZEROS, BLOCK_M, XSTAGES, QSTAGES, PAIR, OVERLAP, SUB,
                         NWG)),
            (_consumer, (x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, s_ptr, z_ptr, out_ptr, part_ptr,
                         count_ptr, off_n, off_m, M, N, K, t_lo, n_tiles, tile, k_slice, split, p_tile, stride_sn,
                         stride_om, gl.constexpr(2), GROUP, HAS_ZEROS, BLOCK_M, XSTAGES, QSTAGES, PAIR, OVERLAP, SUB,
                         NWG)),
            (_consumer, (x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, s_ptr, z_ptr, out_ptr, part_ptr,
                         count_ptr, off_n, off_m, M, N, K, t_lo, n_tiles, tile, k_slice, split, p_tile, stride_sn,
                         stride_om, gl.constexpr(3), GROUP, HAS_ZEROS, BLOCK_M, XSTAGES, QSTAGES, PAIR, OVERLAP, SUB,
                         NWG)),
            (_load_part, (x_desc, w_desc, x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, off_m, off_n, t_lo,
                          n_tiles, XSTAGES, QSTAGES, SUB)),
        ], [4, 4, 4, 1], [MMA_REGS, MMA_REGS, MMA_REGS, 24])
    else:
        gl.warp_specialize([
            (_consumer, (x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, s_ptr, z_ptr, out_ptr, part_ptr,
                         count_ptr, off_n, off_m, M, N, K, t_lo, n_tiles, tile, k_slice, split, p_tile, stride_sn,
                         stride_om, gl.constexpr(0), GROUP, HAS_ZEROS, BLOCK_M, XSTAGES, QSTAGES, PAIR, OVERLAP, SUB,
                         NWG)),
            (_consumer, (x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, s_ptr, z_ptr, out_ptr, part_ptr,
                         count_ptr, off_n, off_m, M, N, K, t_lo, n_tiles, tile, k_slice, split, p_tile, stride_sn,
                         stride_om, gl.constexpr(1), GROUP, HAS_ZEROS, BLOCK_M, XSTAGES, QSTAGES, PAIR, OVERLAP, SUB,
                         NWG)),
            (_load_part, (x_desc, w_desc, x_smem, q_smem, x_ready, x_empty, q_ready, q_empty, off_m, off_n, t_lo,
                          n_tiles, XSTAGES, QSTAGES, SUB)),
        ], [4, 1], [MMA_REGS, 24])
    for i in gl.static_range(XSTAGES):
        mbarrier.invalidate(x_ready.index(i))
        mbarrier.invalidate(x_empty.index(i))
    for i in gl.static_range(QSTAGES):
        mbarrier.invalidate(q_ready.index(i))
        mbarrier.invalidate(q_empty.index(i))
