"""The INT4 GEMV for Hopper whose weights go into ``wgmma`` straight from the registers they were loaded into, written
in Gluon: 9 to 16 rows of ``x``.

Imported lazily, like ``_dense_mma_kernels``; only on an sm_90 GPU with a Triton that has Gluon
(``_stripe_wgmma.stripe_wgmma_possible``).

[Note: INT4 GEMV on wgmma] At 9 to 16 rows the GEMV on ``mma.sync`` ([Note: INT4 GEMV on tensor cores] in
``_dense_mma_kernels``) holds two blocks of 8 rows of ``x`` in ``B`` registers, 32 a stripe, or reads them from
shared memory beside its MMAs, and loses to the tiled ``wdot`` kernels (1.52-1.76x of bf16 against 1.90-2.22x on an
H100). Here the 16 rows of ``x`` are the ``wgmma``'s ``B`` operand (``N`` = 16), read by the tensor cores from
shared memory, and the weights its ``A`` operand from registers: ``m64n16k16``, 16 weight rows a warp, a warp
group a block of 64 rows (two with 8 warps).

- A lane loads its words as the GEMV on ``mma.sync`` does: lane ``4g + t`` of warp ``w`` takes words ``4t .. 4t + 3``
  of each stripe (128 columns) of rows ``16w + g`` and ``16w + g + 8``, one 16-byte load a stripe and row. The A
  fragment wants columns ``2t, 2t + 1, 2t + 8, 2t + 9`` of each 16-column step, and the product does not change if
  ``x``'s columns follow the same order, so the codes stay where they were loaded: code pair ``p = 2 i2 + i1`` of
  word ``u`` (the nibbles ``p`` and ``p + 4``, half ``i0``) is column ``32u + 16 i2 + 8 i1 + 2t + i0`` of its stripe,
  and ``x``'s column ``128 q + 8 (4t + u) + p + 4 i0`` is stored there in shared memory, once a program.
- The codes of a block are a 7-D tensor ``(rows, stripe, t, u, i2, i1, i0)`` in a linear layout whose registers run
  over ``i0, i1, i2`` first (one inline asm a word, ``pack=8``); permuted by :data:`CODE_ORDER` and reshaped to
  ``(rows, 128 stripes)`` it is the ``wgmma``'s operand layout, which ``convert_layout(assert_trivial=True)`` checks
  when it compiles: no data moves.
- A pair is ``lop3`` (into ``0x4300``: ``128 + q`` in both bf16 halves), ``fma`` by 1 plus ``-(128 + zero)`` (exact)
  and a bf16 ``mul`` by the scale: one rounding, as the reference's fp32 product cast to bf16, so the group's scale
  needs no accumulator of its own. 15 instructions a word with the shifts; bf16 scales only.
- A program owns ``QC`` chunks of ``QI`` stripes of ``K`` and a run of blocks of rows, walked block by block and
  chunk by chunk with the next chunk's words, scales and zero points in flight (registers); each chunk's ``8 QI``
  ``wgmma`` chain on the block's accumulator and are retired before the next chunk's fragments take their registers
  (ptxas reuses them: [Note: fragment wdot] in ``_fragment_kernels``). Slices of ``K`` meet as in the other GEMVs
  (fp32 partials summed by the run's last program, ``finish_run``).

Measured (benchmarks/RESULTS.md, kernels session 33, runs 236-246; every config checked against the reference on
NaN-filled output), 16 rows over bf16, against the ``wdot`` path's tiled kernels tuned in the same process: on an H100
8192x28672 2.33-2.36x (tiled: 2.24-2.25x), 8192x8192 1.71-1.74x (1.92-1.95x), 28672x8192 1.77x (2.10-2.12x) and the
decode step's 4096-deep shapes 1.08-2.00x (1.81-2.23x); on an H200 1.82x (1.67x), 1.43x (1.52x) and 1.34x (1.67x).
It wins where ``N`` is large and ``K`` short: every program reads its slice of ``x`` from L2 and the fp32 partials
grow with the slices of ``K``. The ``wdot`` path's tuner times it beside the tiled kernels at 9 to 16 rows.

Not kept (session 33, the same runs): chunks of one stripe (8 ``wgmma`` a retire: 25-41 % slower); the next chunk's
fragments built while this chunk's ``wgmma`` runs (ptxas holds their writes until the retire: 13-30 % slower); the
words through a ``cp.async`` ring of 3 or 5 chunks (14-24 % slower); the codes into the ``wgmma`` as ``128 + code``
with the zero point's share taken off through ``sum(x)`` (half the dequantization, but an accumulator a stripe: 155
registers, three programs an SM instead of four; 8-28 % slower); ``x`` loaded 16 bytes a lane (a quarter of the
prologue's instructions, but 8192x28672 took 76.0 us against 73.7).
"""
from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ._sparse_mma_kernels import _cta_barrier, _store_sums, finish_run

# (rows, stripe, t, u, i2, i1, i0) -> (rows, stripe, u, i2, i1, t, i0): a block's codes in the fragment's column order
CODE_ORDER = gl.constexpr((0, 1, 3, 4, 5, 2, 6))
# x loaded as (rows of x, stripe, t, u, i0, i2, i1), its natural column order, into the same order as the codes
X_ORDER = gl.constexpr((0, 1, 3, 5, 6, 2, 4))


@functools.cache
def stripe_wgmma_asm() -> tuple[str, str]:
    """A word's 8 codes as the 4 bf16 pairs ``(code - zero) * scale``, pair ``p`` the nibbles ``(p, p + 4)``, for
    ``pack=8``: ``$0``-``$3`` out, ``$4`` the word, ``$12`` ``-(128 + zero)`` and ``$20`` the scale, each in both
    halves ([Note: INT4 GEMV on wgmma])."""
    lines = ["{", ".reg .b32 w, y, one;", "mov.b32 one, 0x3F803F80;"]
    for p in range(4):
        src = "$4"
        if p:
            lines.append(f"shr.u32 w, $4, {4 * p};")
            src = "w"
        lines += [f"lop3.b32 y, {src}, 0x000F000F, 0x43004300, 0xEA;", "fma.rn.bf16x2 y, y, one, $12;",
                  f"mul.rn.bf16x2 ${p}, y, $20;"]
    lines.append("}")
    return "\n".join(lines), ",".join(["=r"] * 4 + ["r"] * 24)


@functools.cache
def stripe_layout(warps: int, qi: int) -> gl.DistributedLinearLayout:
    """The linear layout of a chunk's codes ``(rows, stripe, t, u, i2, i1, i0)`` ([Note: INT4 GEMV on wgmma]): lane
    ``4g + t`` of warp ``w`` holds word ``4t + u`` of each stripe of rows ``16w + g`` and ``16w + g + 8``. Registers
    run over the pair halves and pairs first (one asm call a word), then the 4 words of a row (one 16-byte load),
    the row ``+ 8``, the stripes."""
    def unit(axis: int, value: int) -> list[int]:
        v = [0] * 7
        v[axis] = value
        return v

    regs = [unit(6, 1), unit(5, 1), unit(4, 1), unit(3, 1), unit(3, 2), unit(0, 8)]
    regs += [unit(1, 1 << i) for i in range(qi.bit_length() - 1)]
    lanes = [unit(2, 1), unit(2, 2), unit(0, 1), unit(0, 2), unit(0, 4)]
    warp_bases = [unit(0, 16 << i) for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warp_bases, block_bases=[],
                                      shape=[16 * warps, qi, 4, 4, 2, 2, 2])


@gluon.constexpr_function
def _only(dim, layout, rank):
    """The 7-D ``layout`` sliced down to its axis ``dim`` of its first ``rank`` axes."""
    for d in reversed(range(7)):
        if d != dim or d >= rank:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.jit
def _along(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr, RANK: gl.constexpr):
    """``arange(n)`` along ``dim`` of a ``RANK``-D tensor (size 1 on the other axes) in the 7-D ``layout`` without
    its last ``7 - RANK`` axes: 7 for ``x`` and the codes, 4 for the words ``(rows, stripe, t, u)``."""
    v = gl.arange(0, n, layout=_only(dim, layout, RANK))
    for d in gl.static_range(RANK):
        if d != dim:
            v = gl.expand_dims(v, d)
    return v


@gluon.jit
def _spread(v, like):
    """The words' ``(rows, stripe, t, u)`` tensor ``v`` over the codes' 7-D ``like`` (registers only)."""
    return gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 4), 5), 6), like)[0]


@gluon.jit
def _chunk_loads(w_ptr, s_ptr, z_ptr, rows, q0, w_row, w_q, w_word, STRIPES, N, stride_wn, stride_sn, stride_zn,
                 GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, EVEN_K: gl.constexpr):
    """A chunk's words ``(rows, stripe, t, u)`` from stripe ``q0`` on, and its scales and zero points ``(rows,
    stripe, 1, 1)``, as stored. Unmasked: rows from ``N`` read row ``N - 1`` (their sums are not stored), stripes from
    ``STRIPES`` the last one (``x`` is zero there)."""
    q = q0 + w_q
    if not EVEN_K:
        q = gl.minimum(q, STRIPES - 1)
    r = gl.minimum(rows + w_row, N - 1)
    w = gl.load(w_ptr + r * stride_wn + q * 16 + w_word)
    g = q // (GROUP // 128)
    s = gl.load(s_ptr + r * stride_sn + g)
    if HAS_ZEROS:
        z = gl.load(z_ptr + r * stride_zn + g)
    else:
        z = s
    return w, s, z


@gluon.jit
def _fragments(w, s, z, like, HAS_ZEROS: gl.constexpr, ASM: gl.constexpr, ASM_IO: gl.constexpr, ROWS: gl.constexpr,
               KC: gl.constexpr, DOT: gl.constexpr):
    """A chunk's words, scales and zero points as the ``wgmma``'s A operand ``(ROWS, KC)`` in bf16."""
    sp = (s.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF) * 0x10001
    if HAS_ZEROS:
        nz = (z.to(gl.int32) | 0xC300) * 0x10001  # -(128 + zero) in both halves
    else:
        nz = gl.zeros_like(sp) - 0x3CF73CF8  # -(128 + 8) in both halves: 0xC308C308
    f = gl.inline_asm_elementwise(ASM, ASM_IO, [_spread(w, like), _spread(nz, like), _spread(sp, like)],
                                  dtype=gl.bfloat16, is_pure=True, pack=8)
    return gl.convert_layout(gl.reshape(gl.permute(f, CODE_ORDER.value), [ROWS, KC]), DOT, assert_trivial=True)


@gluon.jit
def stripe_wgmma_w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, STRIPES, SPLIT,
                           stride_xm, stride_wn, stride_sn, stride_zn, stride_om, GROUP: gl.constexpr,
                           HAS_ZEROS: gl.constexpr, QI: gl.constexpr, QC: gl.constexpr, MN: gl.constexpr,
                           ROW_BLOCKS: gl.constexpr, EVEN_K: gl.constexpr, PARTIAL: gl.constexpr,
                           FIX_K: gl.constexpr, CL: gl.constexpr, ASM: gl.constexpr, ASM_IO: gl.constexpr,
                           num_warps: gl.constexpr):
    """INT4 ``out[M, N] = x @ dequant(words)^T`` for ``M <= MN`` ([Note: INT4 GEMV on wgmma]).

    ``x_ptr``: ``x`` (M, K) bf16; ``w_ptr``: the words (N, K / 8) int32, column ``8c + i`` in nibble ``i`` of word
    ``c``; ``s_ptr`` / ``z_ptr``: bf16 scales and uint8 zero points (``HAS_ZEROS`` false: 8) per (row, group of
    ``GROUP`` columns, a multiple of 128). ``STRIPES = K / 128``. Grid ``(runs, SPLIT)``: a program owns ``QC``
    chunks of ``QI`` stripes of ``K`` and a run of ``ROW_BLOCKS`` blocks of ``16 * num_warps`` weight rows;
    ``EVEN_K``: ``QI * QC`` divides ``STRIPES``; ``CL``: ``stripe_layout(num_warps, QI)``; ``ASM`` / ``ASM_IO``:
    ``stripe_wgmma_asm()``."""
    ROWS: gl.constexpr = 16 * num_warps
    KC: gl.constexpr = 128 * QI  # columns of a chunk
    Q: gl.constexpr = QI * QC
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, MN, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    pid_r = gl.program_id(0)
    pid_k = gl.program_id(1)
    q_base = pid_k * Q

    # x in the codes' column order, chunk c in buffer c: loaded in its own order (rows, stripe, t, u, i0, i2, i1),
    # column 128 q + 32 t + 8 u + 4 i0 + 2 i2 + i1, and permuted on the way into shared memory. (Loaded 16 bytes a
    # lane instead, as (rows, words, 8 columns), the prologue has a quarter of the instructions, but 8192x28672 at 16
    # rows took 78.8 us where this took 73.7-74.1: kernels session 33, H100.)
    XL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 1, 2, 2, 2], threads_per_warp=[1, 1, 4, 4, 1, 1, 2],
                                        warps_per_cta=[num_warps, 1, 1, 1, 1, 1, 1], order=[6, 5, 4, 3, 2, 1, 0])
    XS_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    xs = gl.allocate_shared_memory(gl.bfloat16, [QC, MN, KC], XS_L)
    xm = _along(MN, 0, XL, 7)
    x_q = _along(QI, 1, XL, 7)
    x_off = 128 * x_q + 32 * _along(4, 2, XL, 7) + 8 * _along(4, 3, XL, 7) + 4 * _along(2, 4, XL, 7) \
        + 2 * _along(2, 5, XL, 7) + _along(2, 6, XL, 7)
    for xc in gl.static_range(QC):
        q0 = q_base + xc * QI
        xv = gl.load(x_ptr + xm * stride_xm + q0 * 128 + x_off, mask=(xm < M) & (q0 + x_q < STRIPES), other=0.0)
        xs.index(xc).store(gl.reshape(gl.permute(xv, X_ORDER.value), [MN, KC]))
    fence_async_shared()
    _cta_barrier()

    like = gl.zeros([ROWS, QI, 4, 4, 2, 2, 2], gl.int32, CL)
    w_row = _along(ROWS, 0, CL, 4)
    w_q = _along(QI, 1, CL, 4)
    w_word = 4 * _along(4, 2, CL, 4) + _along(4, 3, CL, 4)
    row0 = pid_r * (ROWS * ROW_BLOCKS)
    o_row = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ACC))[:, None]
    o_m = gl.arange(0, MN, layout=gl.SliceLayout(0, ACC))[None, :]
    acc = gl.zeros([ROWS, MN], gl.float32, ACC)
    T = ROW_BLOCKS * QC
    nxt = _chunk_loads(w_ptr, s_ptr, z_ptr, row0, q_base, w_row, w_q, w_word, STRIPES, N, stride_wn, stride_sn,
                       stride_zn, GROUP, HAS_ZEROS, EVEN_K)
    for it in range(T):
        c = it % QC
        rows = row0 + (it // QC) * ROWS
        w, s, z = nxt  # loaded during the last chunk; the next chunk's go in flight now
        if it + 1 < T:
            n_it = it + 1
            nxt = _chunk_loads(w_ptr, s_ptr, z_ptr, row0 + (n_it // QC) * ROWS, q_base + (n_it % QC) * QI, w_row, w_q,
                               w_word, STRIPES, N, stride_wn, stride_sn, stride_zn, GROUP, HAS_ZEROS, EVEN_K)
        a = _fragments(w, s, z, like, HAS_ZEROS, ASM, ASM_IO, ROWS, KC, DOT)
        acc = warpgroup_mma(a, xs.index(c).permute((1, 0)), acc, use_acc=c > 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if c == QC - 1:  # the block's sums: with one slice the output itself, else this slice's fp32 partials
            row = rows + o_row
            _store_sums(acc, out_ptr, part_ptr, row, o_m, (o_m < M) & (row < N), N, SPLIT, pid_k, stride_om, PARTIAL)
    if PARTIAL:
        finish_run(part_ptr, count_ptr, out_ptr, pid_r, row0, 0, M, N, SPLIT, stride_om, ROWS * ROW_BLOCKS, FIX_K,
                   num_warps)
