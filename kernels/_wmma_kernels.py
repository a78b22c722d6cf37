"""The full-depth word GEMM: INT8 / INT4 weights read as int32 words, one ``tl.dot`` per ``K`` tile.

Imported lazily, like ``_word_kernels`` (see [Note: lazy triton] in ``_runtime``); it shares that
module's word layouts and [Note: magic-number conversion].

[Note: full-depth wdot] ``wdot_kernel`` (``_word_kernels``) keeps a word's ``CPW`` fields apart as
planes and runs one ``tl.dot`` of depth ``BLOCK_W`` per plane: 8 (INT4) or 4 (INT8) shallow dots
per tile, each a separate pass over the accumulator, against a plane-major copy of ``x`` made by
another launch. Here a tile's words ``(BN, BW)`` are expanded to all fields at once, ``(BN, BW,
CPW)``, dequantized in registers (rounded to ``x``'s dtype exactly as the reference rounds the
dense weight) and reshaped to one ``(BN, BK)`` operand, ``BK = CPW * BW``: one dot of full depth.
The tile's column order is a free choice, as long as ``x`` is read in the same order (``ORDER``):

- 0, natural: column ``c`` of the tile is field ``c % CPW`` of word ``c // CPW``, i.e. original
  column ``col0 + c``; the ``x`` tile is a plain contiguous ``(BM, BK)`` block (vector loads), and
  a thread that expands a word holds its fields side by side.
- 1, planes: column ``c`` is field ``c // BW`` of word ``c % BW`` (the ``(BN, CPW, BW)`` expansion);
  ``x`` column ``CPW * (t * BW + c % BW) + c // BW`` is gathered from the natural ``x`` (stride
  ``CPW``, no vector loads).
- 2, planes from the plane-major copy (``_word.plane_major``): contiguous runs of ``BW``, one extra
  launch per call.
- 3, natural, built by ``tl.interleave`` of the ``(BN, BW)`` fields instead of a 3-D broadcast and
  ``tl.reshape`` (Triton keeps each interleaved pair in one thread; the reshape's layout is the
  compiler's choice and took more layout conversions). On an H100 (Triton 3.6, 8192x8192, M = 16,
  64, 256) order 3 was the fastest, so the tuner's candidates use it; 0-2 stay for tests and trials.

[Note: fields masked in place] ``(w >> (BITS * j)) & mask`` costs a shift and a bit-field extract per
field before the exponent is ORed in ([Note: magic-number conversion]). A field whose bits lie in the
mantissa (bits 0-22) is masked where it is instead, and the mask and the exponent go in one LOP3:
``2^23 + q * 2^pos`` exactly (``q * 2^pos < 2^20``). Subtracting ``2^23 + z * 2^pos`` leaves ``(q - z) *
2^pos`` exactly, and multiplying by ``s * 2^-pos`` rounds once to the same value as ``(q - z) * s``: powers
of two change no rounding, and ``s`` (fp16 or bf16) stays a normal fp32 number. The fields above bit 23
(INT4 fields 5-7) are masked in ``w >> 16``, one shift per word. On an H100 (kernels run 25) INT4 at 4 and
16 rows ran 2-7 % faster, at 64 rows -3 % to +6 %; INT8 (fields 0-1 in place, 2-3 shifted) ran 5-10 % slower
at 64 and 256 rows, so INT8 keeps the shift-and-mask form.

[Note: packed INT4 dequantization] ``PACKED`` (INT4 into bf16 or fp16, scales in that dtype, on the GPU)
dequantizes two words at a time in 16-bit pairs, with inline PTX instead of fp32 arithmetic. One ``prmt`` puts
the low half-words of the two words side by side (fields 0-3 of each), another the high halves (fields 4-7); a
field then takes a shift and one ``lop3`` that masks both of its copies and ORs in the exponent of 128 (bf16
``0x4300``; fp16 1024, ``0x6400``), giving ``128 + q`` exactly in each half. ``sub.rn.bf16x2`` with ``128 + z``
leaves ``q - z`` exactly (integers of at most 8 significant bits), and ``mul.rn.bf16x2`` by the scale
rounds once: the exact product of two 8-bit significands fits in fp32, so this is the value the fp32 path
rounds to ``x``'s dtype, bit for bit. Per pair of fields the fp32 path spends a LOP3, two FADD/FMUL each and a
conversion; this one a LOP3 (and a shift), a SUB and a MUL, all on two values. ``SCALES_AHEAD`` (tuned, from
64 rows) loads each tile's scales and zero points one tile ahead, in registers: on an H100 it gained 6-9 % at
64 rows on two shapes of three, lost 4 % on the third and 6-14 % at 4-16 rows (benchmarks/RESULTS.md, kernels
run 37). The two words of a pair each take their own scale and zero point (the halves of ``$10`` and ``$11``), so
tiles that span groups (g32, g64) are packed too, their scales loaded once per group ([Note: group scales] in
``_word_kernels``; gathered per word, the 64-row tiles crashed Triton 3.6's compiler, kernels run 41). The
interpreter runs no PTX, so CPU tests cover the fp32 path only; the GPU checks (``benchmarks/packed_check.py``)
compare this one with the reference.

[Note: swap-AB] Hopper's ``wgmma`` takes 64 rows per warp group on its M side and 8..256 on its N
side. With a few rows of ``x`` on the M side (``acc[BM, BN] = x @ w^T``) a 16-row tile is padded
to 64. ``SWAP`` computes the transpose instead, ``acc^T[BN, BM] = w @ x^T``: the weight rows fill
the M side and the few rows of ``x`` sit on the N side; the accumulator is stored transposed. The
tuner times both orientations.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._word_kernels import _as_float, _group_scale, _load_words, _mma_fixup, _mma_program, _mma_store


def _packed_asm(magic: str, pair: str) -> str:
    """The PTX of [Note: packed INT4 dequantization]: ``$0``-``$7`` are fields 0-7 of words a (``$8``) and b
    (``$9``), a's in the low half; ``$10`` the scales and ``$11`` ``128 + z`` (1024 for fp16), as pairs."""
    lines = ["{", ".reg .b32 lo, hi, t;", "prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for j in range(8):
        src, shift = ("lo" if j < 4 else "hi"), 4 * (j % 4)
        if shift:
            lines.append(f"shr.u32 t, {src}, {shift};")
            src = "t"
        lines.append(f"lop3.b32 ${j}, {src}, 0x000f000f, {magic}, 0xea;")  # 0xea: (a & b) | c
    lines += [f"sub.rn.{pair} ${j}, ${j}, $11;" for j in range(8)]
    lines += [f"mul.rn.{pair} ${j}, ${j}, $10;" for j in range(8)]
    return "\n".join(lines + ["}"])


_ASM_BF16 = tl.constexpr(_packed_asm("0x43004300", "bf16x2"))
_ASM_F16 = tl.constexpr(_packed_asm("0x64006400", "f16x2"))
_ASM_IO = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 4))


@triton.jit
def _field(w, j: tl.constexpr, s, z, BITS: tl.constexpr):
    """Field ``j`` of every word, ``(code - z) * s`` in fp32, bit for bit the reference's value
    ([Note: fields masked in place] for INT4)."""
    if BITS == 8:  # INT8: shifted down, then masked (the in-place form ran 5-10 % slower for it)
        return (_as_float((w >> (BITS * j)) & ((1 << BITS) - 1)) - (8388608.0 + z)) * s
    if BITS * j + BITS <= 23:  # the field lies in the mantissa where it is: mask it there
        return _field_at(w, BITS * j, s, z, BITS)
    return _field_at(w >> 16, BITS * j - 16, s, z, BITS)  # from the upper half word, one shift for its fields


@triton.jit
def _field_at(src, pos: tl.constexpr, s, z, BITS: tl.constexpr):
    """The field at bits ``pos`` of ``src`` (``pos + BITS <= 23``), ``(code - z) * s`` in fp32."""
    return (_as_float(src & (((1 << BITS) - 1) << pos)) - (8388608.0 + z * (1 << pos))) * (s / (1 << pos))


@triton.jit
def _packed_fields(w, s, z, HALF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Fields 0-7 of every INT4 word ``(BN, BW)``, ``(q - z) * s`` in bf16 (or fp16 with ``HALF16``), two
    words per PTX block ([Note: packed INT4 dequantization]); ``s`` and ``z`` as ``_group_scale`` gives them."""
    if HALF16:
        s2 = tl.broadcast_to(s, (BLOCK_N, BLOCK_W)).to(tl.float16)
        zz = tl.broadcast_to(z + 1024.0, (BLOCK_N, BLOCK_W)).to(tl.float16)
        return tl.inline_asm_elementwise(_ASM_F16, _ASM_IO, [w, s2, zz], dtype=(tl.float16,) * 8, is_pure=True,
                                         pack=2)
    else:
        s2 = tl.broadcast_to(s, (BLOCK_N, BLOCK_W)).to(tl.bfloat16)
        zz = tl.broadcast_to(z + 128.0, (BLOCK_N, BLOCK_W)).to(tl.bfloat16)
        return tl.inline_asm_elementwise(_ASM_BF16, _ASM_IO, [w, s2, zz], dtype=(tl.bfloat16,) * 8, is_pure=True,
                                         pack=2)


@triton.jit
def _dequant_tile_packed(w, s, z, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HALF16: tl.constexpr):
    """INT4 words ``(BN, BW)`` → the dequantized tile ``(BN, 8 * BW)`` in natural order (``ORDER`` 3), in bf16 (or
    fp16 with ``HALF16``), bit for bit ``_dequant_tile``'s ([Note: packed INT4 dequantization]); ``s`` and ``z``
    from ``_group_scale``."""
    f0, f1, f2, f3, f4, f5, f6, f7 = _packed_fields(w, s, z, HALF16, BLOCK_N, BLOCK_W)
    return tl.interleave(tl.interleave(tl.interleave(f0, f4), tl.interleave(f2, f6)),
                         tl.interleave(tl.interleave(f1, f5), tl.interleave(f3, f7)))


@triton.jit
def _dequant_tile(w, s_ptr, z_ptr, offs_n, nmask, col0, stride_sn, K, FMT: tl.constexpr, GROUP: tl.constexpr,
                  HAS_ZEROS: tl.constexpr, CPW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                  ORDER: tl.constexpr):
    """Words ``(BN, BW)`` → the dequantized fp32 tile ``(BN, CPW * BW)`` in the column order ``ORDER``
    ([Note: full-depth wdot]); INT8 codes unscaled (the scale is applied to the accumulator)."""
    BITS = 32 // CPW  # bits per field
    j = tl.arange(0, CPW)
    if FMT == 0:
        w = w ^ -2139062144  # 0x80808080: every byte q + 128, see [Note: magic-number conversion]
        s, z = 1.0, 128.0
    else:
        s, z = _group_scale(s_ptr, z_ptr, offs_n, nmask, col0, stride_sn, K, CPW, GROUP, BLOCK_W,
                            HAS_ZEROS)  # each (BN, 1) if the tile lies in one group, else (BN, BW)
    if ORDER == 3:  # natural order by interleaving (BN, BW) fields: out[:, CPW * w + j] = field j of word w
        if CPW == 4:
            return tl.interleave(tl.interleave(_field(w, 0, s, z, BITS), _field(w, 2, s, z, BITS)),
                                 tl.interleave(_field(w, 1, s, z, BITS), _field(w, 3, s, z, BITS)))
        else:
            e = tl.interleave(tl.interleave(_field(w, 0, s, z, BITS), _field(w, 4, s, z, BITS)),
                              tl.interleave(_field(w, 2, s, z, BITS), _field(w, 6, s, z, BITS)))
            o = tl.interleave(tl.interleave(_field(w, 1, s, z, BITS), _field(w, 5, s, z, BITS)),
                              tl.interleave(_field(w, 3, s, z, BITS), _field(w, 7, s, z, BITS)))
            return tl.interleave(e, o)
    if ORDER == 0:
        f = (w[:, :, None] >> (BITS * j)[None, None, :]) & ((1 << BITS) - 1)  # (BN, BW, CPW)
    else:
        f = (w[:, None, :] >> (BITS * j)[None, :, None]) & ((1 << BITS) - 1)  # (BN, CPW, BW)
    if FMT == 0:
        q = _as_float(f) - (8388608.0 + 128.0)
    elif ORDER == 0:
        q = (_as_float(f) - (8388608.0 + z[:, :, None])) * s[:, :, None]
    else:
        q = (_as_float(f) - (8388608.0 + z[:, None, :])) * s[:, None, :]
    return tl.reshape(q, (BLOCK_N, CPW * BLOCK_W))  # (BN, BK)


@triton.jit
def _x_tile(x_ptr, offs_m, mmask, t, K, KW, stride_xm, CPW: tl.constexpr, BLOCK_W: tl.constexpr,
            EVEN_W: tl.constexpr, ORDER: tl.constexpr):
    """The ``(BM, BK)`` tile of ``x`` whose columns match ``_dequant_tile``'s (``ORDER``)."""
    c = tl.arange(0, CPW * BLOCK_W)
    if ORDER == 0 or ORDER == 3:
        col = t * BLOCK_W * CPW + c
        inside = col < K
    else:
        word = t * BLOCK_W + c % BLOCK_W
        inside = word < KW
        if ORDER == 1:
            col = CPW * word + c // BLOCK_W
        else:  # plane-major copy: xp[m, j, w] = x[m, CPW * w + j]
            col = (c // BLOCK_W) * KW + word
    mask = mmask[:, None]
    if not EVEN_W:
        mask = mask & inside[None, :]
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + col[None, :], mask=mask, other=0.0)


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:  # [Note: interpreter dot] in _gemm
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def wmma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, KW, SPLIT_K,
                stride_xm, stride_wn, stride_sn, stride_om,
                FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, ATOMIC: tl.constexpr,
                FIXUP: tl.constexpr, DOT_F32: tl.constexpr, CPW: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_W: tl.constexpr, ORDER: tl.constexpr,
                SWAP: tl.constexpr, PACKED: tl.constexpr = 0, SCALES_AHEAD: tl.constexpr = False):
    """INT8 / INT4 GEMM on tensor cores, one dot of depth ``CPW * BLOCK_W`` per tile of words
    ([Note: full-depth wdot]), optionally transposed ([Note: swap-AB]). Grid ``(cdiv(M, BM), cdiv(N, BN),
    SPLIT_K)``; where ``K`` is split, each of the ``SPLIT_K`` programs adds its tile's sum in fp32 (``ATOMIC``)
    or stores it as a partial that the tile's last program sums (``FIXUP``, [Note: split-K fix-up])."""
    offs_m, offs_n, mmask, nmask, t_lo, t_hi = _mma_program(M, N, KW, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_W)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if SCALES_AHEAD:  # [Note: packed INT4 dequantization]: the first tile's scales and zero points, loaded ahead
        s_next, z_next = _group_scale(s_ptr, z_ptr, offs_n, nmask, t_lo * BLOCK_W * CPW, stride_sn, K, CPW, GROUP,
                                      BLOCK_W, HAS_ZEROS)
    for t in range(t_lo, t_hi):
        w = _load_words(w_ptr, offs_n, N, t, t_hi, KW, stride_wn, BLOCK_W, EVEN_W)  # (BN, BW) int32
        x = _x_tile(x_ptr, offs_m, mmask, t, K, KW, stride_xm, CPW, BLOCK_W, EVEN_W, ORDER)  # (BM, BK)
        if PACKED:  # INT4 in x's 16-bit dtype (PACKED 1: bf16, 2: fp16), natural order
            if SCALES_AHEAD:
                s_t, z_t = s_next, z_next
                s_next, z_next = _group_scale(s_ptr, z_ptr, offs_n, nmask, tl.minimum(t + 1, t_hi - 1) * BLOCK_W * CPW,
                                              stride_sn, K, CPW, GROUP, BLOCK_W, HAS_ZEROS)
            else:
                s_t, z_t = _group_scale(s_ptr, z_ptr, offs_n, nmask, t * BLOCK_W * CPW, stride_sn, K, CPW, GROUP,
                                        BLOCK_W, HAS_ZEROS)
            wt = _dequant_tile_packed(w, s_t, z_t, BLOCK_N, BLOCK_W, PACKED == 2)  # (BN, BK)
        else:
            wt = _dequant_tile(w, s_ptr, z_ptr, offs_n, nmask, t * BLOCK_W * CPW, stride_sn, K, FMT, GROUP, HAS_ZEROS,
                               CPW, BLOCK_N, BLOCK_W, ORDER).to(x.dtype)  # (BN, BK)
        if SWAP:
            acc = _mma(wt, tl.trans(x), acc, DOT_F32)  # (BN, BM)
        else:
            acc = _mma(x, tl.trans(wt), acc, DOT_F32)  # (BM, BN)
    if SWAP:
        acc = tl.trans(acc)  # (once per program: a layout change in the epilogue)
    if FIXUP:
        _mma_fixup(acc, part_ptr, count_ptr, out_ptr, s_ptr, offs_m, offs_n, mmask, nmask, M, N, SPLIT_K, stride_om,
                   FMT)
    else:
        _mma_store(acc, out_ptr, s_ptr, offs_m, offs_n, mmask, nmask, stride_om, FMT, ATOMIC)
