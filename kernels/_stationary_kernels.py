"""The x-stationary GEMV: INT8 / INT4 weights times a few rows of ``x``, weight rows streamed past a slice of ``x``.

Imported lazily, like ``_word_kernels`` (see [Note: lazy triton] in ``_runtime``).

[Note: x-stationary GEMV] The tile GEMV of ``_word_kernels`` walks ``K`` for a
block of weight rows: every tile needs the matching columns of ``x`` again, and a
slice of ``x`` broadcast over the tile's rows is redistributed between threads
(through shared memory, with barriers) once per field plane per tile. Here the
loop runs the other way. A program owns one slice of ``K`` (``G`` quantization
groups of ``WG`` words; INT8: ``WG`` words) and a run of weight rows: it loads its
slice of ``x`` once, as one register tensor per field plane in the weight tile's
own layout, and then only streams weight words, ``BLOCK_N`` rows at a time (the
next block, with its scales and zero points, in flight), each row's group sums
finished (scale and zero point applied) before the next block. The layouts are
Triton's: 3-D ``(BLOCK_N, G, WG)`` tiles keep each group's words in a few
neighbouring threads, so the group sums need two shuffle levels. (A 4-D version
with the fields as a last axis made Triton spread the fields over threads: three
shuffles per code.) The slice of ``x`` is read a word at a time: the 4 or 8
columns under a word in one 8- or 16-byte load, split into the planes in
registers (``_x_word_values``). Each plane used to be a 2-byte gather (20
``LDG.E.U16`` a thread in the INT8 config of 2048 words and 16 warps, where 4
``LDG.E.64`` do now; sm_90 SASS). On an H200 (kernels run 262, both ways in one call,
the tuner's picks, us) INT8 at one row: 8192x8192 25.0 / 25.3, 4096x6144
12.9-13.0 / 13.2, 14336x4096 24.6-24.7 / 25.0, the large shapes within 1 %; at
four rows 56.6-56.9 / 58.0, 24.1-24.2 / 25.5, 52.0 / 53.5. The first block's
loads are issued before ``x`` is read (run 263: 8192x8192 24.6-24.8 against 25.0
us, the other shapes within the runs' spread).

Several slices of ``K`` make several partial sums per output: each program
stores its partials (fp32) to a workspace, then counts itself done on a per-run
counter; the program that finds it was the last one sums the partials in slice
order (deterministic, unlike fp32 atomics), stores the output in ``x``'s dtype and
resets the counter to zero for the next call. So one launch does it all: no
zeroed buffer, no cast kernel. Ordering: a barrier makes the program's stores
precede its counter update, which has release semantics; the last program's
update has acquire semantics and it reads the partials through L2 (``.cg``).

[Note: subnormal codes] A field masked in place, ``word & (0xF << s)`` with
``s + 4 <= 23``, has a zero exponent: read as fp32 it is the subnormal
``q * 2^(s - 149)``, exactly. Multiplied (FFMA) by ``x * 2^(93 - s)`` it gives
``q * x * 2^-56``, so a code costs one LOP3 (the mask is its one immediate) and
one FFMA, against the magic-number path's LOP3, FADD and FFMA (and a register
rebuilt for the second constant). The zero point comes off per group through
the sum of ``x`` (``sum((q - z) x) = sum(q x) - z sum(x)``, z = 8 when
symmetric, 128 for INT8 after the xor), and sums are scaled back by ``2^56``.
Both factors are powers of two, so nothing is rounded that the plain product
would not round; the range is what the scaling costs: ``|x|`` must stay below
``2^35`` and a dot product below ``2^-70`` loses bits as a subnormal. The GPU
keeps subnormals in fp32 FMA (Triton emits no ``.ftz``) at full rate.

[Note: TMA weight stream] The register prefetch keeps one block per program in
flight, so the bytes in flight per SM are (programs per SM) x (block bytes), both
capped by registers; under full load the memory latency grows past what that
covers, and the kernel ran at ~70 % of what a kernel that only loads the same
blocks reaches. ``stationary_tma_kernel`` has the tensor memory accelerator copy
each block into shared memory instead: Triton's loop pipeliner
(``tl.range(..., num_stages=STAGES)``) keeps ``STAGES - 1`` blocks in flight per
program in shared memory, which costs no registers, and the threads read a block
from shared memory when it is due. The copy also zero-fills rows past ``N`` and
words past ``KW``, so it needs no masks. Scales and zero points (a few bytes a
row) keep the register prefetch. The launcher builds the descriptor on the host
(the words viewed as ``(N, KW / WG, WG)``), which needs rows whose byte stride is a
multiple of 16 (TMA's rule). The tuner offers it for INT4, beside the other two
kernels; INT8 runs it correctly but was never faster than its register kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _plane(acc, src, x, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """``acc + q * x * 2^-56`` for the field of ``src`` at bit ``SHIFT``: one LOP3 and one FFMA per code."""
    return tl.fma((src & (((1 << BITS) - 1) << SHIFT)).to(tl.float32, bitcast=True), x, acc)


@triton.jit
def _program_slice(x_ptr, stride_xm, KW, G: tl.constexpr, WG: tl.constexpr):
    """This program's (row of x, slice, run of rows), the slice's word indices ``(1, G, WG)``, which of them lie
    inside the row, and its row of ``x``."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    word = pid_k * (G * WG) + tl.arange(0, G)[None, :, None] * WG + tl.arange(0, WG)[None, None, :]
    return pid_m, pid_k, tl.program_id(2), word, word < KW, x_ptr + pid_m * stride_xm


@triton.jit
def _load_scales(s_ptr, z_ptr, rows, N, pid_k, KW, stride_sn, FMT: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 G: tl.constexpr, WG: tl.constexpr):
    """Scales and zero points ``(BN, G)`` of weight rows ``rows`` in this slice (INT8: scales ``(BN,)``, no zero
    points; without zero points the scales stand in); rows from ``N`` on read nothing."""
    rmask = rows < N
    if FMT == 1:
        gcol = pid_k * G + tl.arange(0, G)
        sptr = rows[:, None] * stride_sn + gcol[None, :]
        smask = rmask[:, None] & (gcol * WG < KW)[None, :]
        s = tl.load(s_ptr + sptr, mask=smask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + sptr, mask=smask, other=0).to(tl.float32)
        else:
            z = s
    else:
        s = tl.load(s_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        z = s
    return s, z


@triton.jit
def _load_block(w_ptr, s_ptr, z_ptr, rows, N, word, live, pid_k, KW, stride_wn, stride_sn, FMT: tl.constexpr,
                HAS_ZEROS: tl.constexpr, G: tl.constexpr, WG: tl.constexpr, EVEN: tl.constexpr):
    """Words ``(BN, G, WG)`` of weight rows ``rows`` in this slice, and their scales and zero points."""
    rmask = rows < N
    if EVEN:
        w = tl.load(w_ptr + rows[:, None, None] * stride_wn + word, mask=rmask[:, None, None], other=0)
    else:
        w = tl.load(w_ptr + rows[:, None, None] * stride_wn + word, mask=rmask[:, None, None] & live, other=0)
    s, z = _load_scales(s_ptr, z_ptr, rows, N, pid_k, KW, stride_sn, FMT, HAS_ZEROS, G, WG)
    return w, s, z


@triton.jit
def _x_word_values(x_row, word, live, CPW: tl.constexpr):
    """The ``CPW`` (4 or 8) columns of ``x`` under each word, as fp32 ``(1, G, WG, CPW)``, one 8- or 16-byte load a
    word ([Note: x a word at a time] in ``_dense_mma_kernels``; a 2-byte gather a column before). The callers split
    them into planes, column ``CPW * word + j`` times ``2^(93 - shift)`` (exact) for the field ``j`` at bit
    ``shift`` of each word, which reads as ``q * 2^(shift - 149)``: so products come out as ``q * x * 2^-56``
    ([Note: subnormal codes])."""
    col = word[:, :, :, None] * CPW + tl.arange(0, CPW)[None, None, None, :]
    return tl.load(x_row + col, mask=live[:, :, :, None], other=0.0).to(tl.float32)


@triton.jit
def _x_planes4(x_row, word, live):
    """INT4: the slice's 8 planes of ``x`` (field ``j`` of every word), scaled for codes masked in place, and the
    per-group sums of ``x`` ``(1, G)`` for the zero points."""
    v = _x_word_values(x_row, word, live, 8)
    even, odd = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], v.shape[2], 2, 2, 2)))  # (the last axis: bit 0)
    e0, e1 = tl.split(even)  # columns 0, 4 / 2, 6
    o0, o1 = tl.split(odd)  # 1, 5 / 3, 7
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    # field 4 is masked in the word itself (bits 16-19), fields 5-7 in its upper half
    x0 = x0 * 2.0 ** 93
    x1 = x1 * 2.0 ** 89
    x2 = x2 * 2.0 ** 85
    x3 = x3 * 2.0 ** 81
    x4 = x4 * 2.0 ** 77
    x5 = x5 * 2.0 ** 89
    x6 = x6 * 2.0 ** 85
    x7 = x7 * 2.0 ** 81
    # sum((q - z) x) = sum(q x) - z sum(x), per group (symmetric: z = 8)
    x_sum = tl.sum(x0 + 65536.0 * x4 + 16.0 * (x1 + x5) + 256.0 * (x2 + x6) + 4096.0 * (x3 + x7),
                   axis=2) * 2.0 ** -93
    return x0, x1, x2, x3, x4, x5, x6, x7, x_sum


@triton.jit
def _x_planes8(x_row, word, live):
    """INT8: the slice's 4 planes of ``x`` and its sum ``(1,)`` (codes are read as ``q + 128``)."""
    v = _x_word_values(x_row, word, live, 4)
    even, odd = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], v.shape[2], 2, 2)))  # (the last axis: bit 0)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    x0 = x0 * 2.0 ** 93  # fields at bits 0 and 8 of each half
    x1 = x1 * 2.0 ** 85
    x2 = x2 * 2.0 ** 93
    x3 = x3 * 2.0 ** 85
    x_sum = tl.sum(tl.sum(x0 + x2 + 256.0 * (x1 + x3), axis=2), axis=1) * 2.0 ** -93  # (1,): q = u - 128
    return x0, x1, x2, x3, x_sum


@triton.jit
def _rows_w4(w, x0, x1, x2, x3, x4, x5, x6, x7, x_sum, s, z, HAS_ZEROS: tl.constexpr):
    """INT4: a block's row sums ``(BN,)``, each group's sum scaled after its zero point comes off."""
    hi = w >> 16
    t = _plane(0.0, w, x0, 0, 4)  # one chain of multiply-adds per word
    t = _plane(t, w, x1, 4, 4)
    t = _plane(t, w, x2, 8, 4)
    t = _plane(t, w, x3, 12, 4)
    t = _plane(t, w, x4, 16, 4)  # bits 16-19 are still mantissa: one LOP3, where (w >> 16) & 0xF cost a shift
    t = _plane(t, hi, x5, 4, 4)  # and a bit-field extract
    t = _plane(t, hi, x6, 8, 4)
    t = _plane(t, hi, x7, 12, 4)
    tg = tl.sum(t, axis=2) * 2.0 ** 56  # (BN, G)
    if HAS_ZEROS:
        tg = tg - z * x_sum
    else:
        tg = tg - 8.0 * x_sum
    return tl.sum(tg * s, axis=1)


@triton.jit
def _rows_w8(w, x0, x1, x2, x3, x_sum, s):
    """INT8: a block's row sums ``(BN,)`` (signed bytes read as ``q + 128``, the 128 taken off through the sum)."""
    u = w ^ -2139062144  # 0x80808080: signed bytes to q + 128
    hi = u >> 16
    t = _plane(0.0, u, x0, 0, 8)
    t = _plane(t, u, x1, 8, 8)
    t = _plane(t, hi, x2, 0, 8)
    t = _plane(t, hi, x3, 8, 8)
    return (tl.sum(tl.sum(t, axis=2), axis=1) * 2.0 ** 56 - 128.0 * x_sum) * s


@triton.jit
def _x_slice(x_row, word, live, FMT: tl.constexpr):
    """The slice's planes of ``x`` and its sums: INT4's 8 planes, or INT8's 4 given twice (the last four unused)."""
    if FMT == 1:
        x0, x1, x2, x3, x4, x5, x6, x7, x_sum = _x_planes4(x_row, word, live)
    else:
        x0, x1, x2, x3, x_sum = _x_planes8(x_row, word, live)
        x4, x5, x6, x7 = x0, x1, x2, x3
    return x0, x1, x2, x3, x4, x5, x6, x7, x_sum  # (one return: Triton wants one type per function)


@triton.jit
def _block_sums(w, x0, x1, x2, x3, x4, x5, x6, x7, x_sum, s, z, FMT: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """A block's row sums ``(BN,)`` in either format."""
    if FMT == 1:
        part = _rows_w4(w, x0, x1, x2, x3, x4, x5, x6, x7, x_sum, s, z, HAS_ZEROS)
    else:
        part = _rows_w8(w, x0, x1, x2, x3, x_sum, s)
    return part


@triton.jit(do_not_specialize=["M", "SPLIT"])
def stationary_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, KW, SPLIT,
                           stride_xm, stride_wn, stride_sn, stride_om,
                           FMT: tl.constexpr, HAS_ZEROS: tl.constexpr, G: tl.constexpr, WG: tl.constexpr,
                           BLOCK_N: tl.constexpr, ROW_BLOCKS: tl.constexpr, PARTIAL: tl.constexpr,
                           EVEN: tl.constexpr, FIX_K: tl.constexpr, DEPTH: tl.constexpr):
    """Grid ``(M, SPLIT, cdiv(N, BLOCK_N * ROW_BLOCKS))``: row of ``x``, slice of ``K``, run of weight rows.

    INT4 (FMT 1): a slice is ``G`` groups of ``WG`` words (8 codes each); scales and zero points ``(N, groups)``.
    INT8 (FMT 0): a slice is ``WG`` words (4 codes each, ``G`` = 1); one scale per output row. ``EVEN``: every
    slice is whole (``KW`` a multiple of ``G * WG``), so word loads need no per-column mask."""
    pid_m, pid_k, pid_r, word, live, x_row = _program_slice(x_ptr, stride_xm, KW, G, WG)
    n1 = tl.arange(0, BLOCK_N)
    row0 = pid_r * (BLOCK_N * ROW_BLOCKS)
    # [Note: register prefetch] in _word_kernels: block b + 1's words, scales and zero points are in flight
    # while block b is computed (scales loaded on use cost one memory latency per block). The first block's go in
    # flight before x is read: the slice of x waits on its loads and a barrier (its sum), and loads issued after
    # that barrier would wait for it.
    w_next, s_next, z_next = _load_block(w_ptr, s_ptr, z_ptr, row0 + n1, N, word, live, pid_k, KW, stride_wn,
                                         stride_sn, FMT, HAS_ZEROS, G, WG, EVEN)
    if DEPTH == 2:  # two blocks in flight
        w_far, s_far, z_far = _load_block(w_ptr, s_ptr, z_ptr, tl.where(ROW_BLOCKS > 1, row0 + BLOCK_N + n1, N), N,
                                          word, live, pid_k, KW, stride_wn, stride_sn, FMT, HAS_ZEROS, G, WG, EVEN)
    x0, x1, x2, x3, x4, x5, x6, x7, x_sum = _x_slice(x_row, word, live, FMT)
    for b in range(ROW_BLOCKS):
        w = w_next
        s = s_next
        z = z_next
        rows = row0 + b * BLOCK_N + n1
        rmask = rows < N
        nxt = tl.where(b + DEPTH < ROW_BLOCKS, rows + DEPTH * BLOCK_N, N)  # past the last block: row N, no load
        if DEPTH == 2:
            w_next = w_far
            s_next = s_far
            z_next = z_far
            w_far, s_far, z_far = _load_block(w_ptr, s_ptr, z_ptr, nxt, N, word, live, pid_k, KW, stride_wn,
                                              stride_sn, FMT, HAS_ZEROS, G, WG, EVEN)
        else:
            w_next, s_next, z_next = _load_block(w_ptr, s_ptr, z_ptr, nxt, N, word, live, pid_k, KW, stride_wn,
                                                 stride_sn, FMT, HAS_ZEROS, G, WG, EVEN)
        part = _block_sums(w, x0, x1, x2, x3, x4, x5, x6, x7, x_sum, s, z, FMT, HAS_ZEROS)
        _store_rows(part, out_ptr, part_ptr, pid_m, pid_k, rows, rmask, N, SPLIT, stride_om, PARTIAL)
    if PARTIAL:
        _finish(part_ptr, count_ptr, out_ptr, pid_m, pid_r, row0, N, SPLIT, stride_om, BLOCK_N * ROW_BLOCKS, FIX_K)


@triton.jit(do_not_specialize=["M", "SPLIT"])
def stationary_tma_kernel(x_ptr, w_desc, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, KW, SPLIT,
                          stride_xm, stride_sn, stride_om,
                          FMT: tl.constexpr, HAS_ZEROS: tl.constexpr, G: tl.constexpr, WG: tl.constexpr,
                          BLOCK_N: tl.constexpr, ROW_BLOCKS: tl.constexpr, PARTIAL: tl.constexpr,
                          FIX_K: tl.constexpr, STAGES: tl.constexpr):
    """``stationary_gemv_kernel`` with the weight words brought in by the tensor memory accelerator
    ([Note: TMA weight stream]): ``w_desc`` describes the words as ``(N, KW / WG, WG)`` in blocks of
    ``(BLOCK_N, G, WG)``; grid, workspace and results as there."""
    pid_m, pid_k, pid_r, word, live, x_row = _program_slice(x_ptr, stride_xm, KW, G, WG)
    x0, x1, x2, x3, x4, x5, x6, x7, x_sum = _x_slice(x_row, word, live, FMT)
    n1 = tl.arange(0, BLOCK_N)
    row0 = pid_r * (BLOCK_N * ROW_BLOCKS)
    s_next, z_next = _load_scales(s_ptr, z_ptr, row0 + n1, N, pid_k, KW, stride_sn, FMT, HAS_ZEROS, G, WG)
    for b in tl.range(ROW_BLOCKS, num_stages=STAGES):
        s = s_next  # the scales in registers one block ahead, the words in STAGES - 1 shared-memory buffers
        z = z_next
        rows = row0 + b * BLOCK_N + n1
        rmask = rows < N
        s_next, z_next = _load_scales(s_ptr, z_ptr, tl.where(b + 1 < ROW_BLOCKS, rows + BLOCK_N, N), N, pid_k, KW,
                                      stride_sn, FMT, HAS_ZEROS, G, WG)
        w = w_desc.load([row0 + b * BLOCK_N, pid_k * G, 0])  # rows from N on and words from KW on read as 0
        part = _block_sums(w, x0, x1, x2, x3, x4, x5, x6, x7, x_sum, s, z, FMT, HAS_ZEROS)
        _store_rows(part, out_ptr, part_ptr, pid_m, pid_k, rows, rmask, N, SPLIT, stride_om, PARTIAL)
    if PARTIAL:
        _finish(part_ptr, count_ptr, out_ptr, pid_m, pid_r, row0, N, SPLIT, stride_om, BLOCK_N * ROW_BLOCKS, FIX_K)


@triton.jit
def _store_rows(part, out_ptr, part_ptr, pid_m, pid_k, rows, rmask, N, SPLIT, stride_om, PARTIAL: tl.constexpr):
    """A block's sums: with one slice the output itself (in its dtype), else this slice's fp32 partials."""
    if not PARTIAL:
        tl.store(out_ptr + pid_m * stride_om + rows, part.to(out_ptr.dtype.element_ty), mask=rmask)
    else:
        tl.store(part_ptr + (pid_m * SPLIT + pid_k) * N + rows, part, mask=rmask)


@triton.jit
def _finish(part_ptr, count_ptr, out_ptr, pid_m, pid_r, row0, N, SPLIT, stride_om, RUN: tl.constexpr,
            FIX_K: tl.constexpr):
    """After this program's partials are stored: count it done; the last slice of the run sums them in slice
    order into the output and resets the counter ([Note: x-stationary GEMV]). The sum is the tail of the launch
    (the last run's last program does it after everything else), so it loads two batches of ``FIX_K`` slices
    before adding either: one L2 latency per two batches."""
    tl.debug_barrier()
    counter = count_ptr + pid_m * tl.num_programs(2) + pid_r
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT - 1:
        run = row0 + tl.arange(0, RUN)
        total = tl.zeros((RUN,), tl.float32)
        kc = tl.arange(0, FIX_K)
        for k0 in range(0, SPLIT, 2 * FIX_K):
            first = _partials(part_ptr, pid_m, SPLIT, N, k0 + kc, run)
            second = _partials(part_ptr, pid_m, SPLIT, N, k0 + FIX_K + kc, run)
            total += tl.sum(first, axis=0)
            total += tl.sum(second, axis=0)
        tl.store(out_ptr + pid_m * stride_om + run, total.to(out_ptr.dtype.element_ty), mask=run < N)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _partials(part_ptr, pid_m, SPLIT, N, slices, run):
    """Partial sums ``(len(slices), RUN)`` of slices ``slices`` (zero past ``SPLIT``), read through L2."""
    ptrs = part_ptr + (pid_m * SPLIT + slices)[:, None] * N + run[None, :]
    return tl.load(ptrs, mask=(slices < SPLIT)[:, None] & (run < N)[None, :], other=0.0, cache_modifier=".cg")


@triton.jit
def _x_block(x_row, word, live, B: tl.constexpr):
    """2:4 + INT4: columns ``16 * word + 4 * B + j`` (j = 0..3) of ``x``, scaled for codes masked in place in
    the 16-bit half that holds block ``B`` (bit ``8 * (B % 2)``; see [Note: subnormal codes])."""
    base = x_row + word * 16 + 4 * B
    f = 2.0 ** (93 - 8 * (B % 2))
    x0 = tl.load(base, mask=live, other=0.0).to(tl.float32) * f
    x1 = tl.load(base + 1, mask=live, other=0.0).to(tl.float32) * f
    x2 = tl.load(base + 2, mask=live, other=0.0).to(tl.float32) * f
    x3 = tl.load(base + 3, mask=live, other=0.0).to(tl.float32) * f
    return x0, x1, x2, x3


@triton.jit
def _kept(t0, t1, xs, src, meta, x0, x1, x2, x3, B: tl.constexpr):
    """Block ``B``'s two kept values: ``t0 += q0 * x[p0]`` and ``t1 += 16 q1 * x[p1]`` (both times 2^-56), and
    ``xs += x[p0] + x[p1]`` (for the zero point). Positions are sorted: p0 <= 2, p1 >= 1."""
    SH: tl.constexpr = 8 * (B % 2)
    p0 = (meta >> (4 * B)) & 3
    p1 = (meta >> (4 * B + 2)) & 3
    xa = tl.where(p0 == 0, x0, tl.where(p0 == 1, x1, x2))
    xb = tl.where(p1 == 3, x3, tl.where(p1 == 2, x2, x1))
    t0 = tl.fma((src & (0xF << SH)).to(tl.float32, bitcast=True), xa, t0)
    t1 = tl.fma((src & (0xF0 << SH)).to(tl.float32, bitcast=True), xb, t1)
    return t0, t1, xs + (xa + xb)


@triton.jit
def _load_s24w4(w_ptr, meta_ptr, rows, N, word, live, stride_wn, stride_mn, EVEN: tl.constexpr):
    """Words and int16 position words ``(BN, G, WG)`` of weight rows ``rows``; rows from ``N`` on read nothing."""
    if EVEN:
        mask = (rows < N)[:, None, None]
    else:
        mask = (rows < N)[:, None, None] & live
    w = tl.load(w_ptr + rows[:, None, None] * stride_wn + word, mask=mask, other=0)
    meta = tl.load(meta_ptr + rows[:, None, None] * stride_mn + word, mask=mask, other=0).to(tl.int32)
    return w, meta


@triton.jit(do_not_specialize=["M", "SPLIT"])
def stationary_s24w4_kernel(x_ptr, w_ptr, meta_ptr, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, KW, SPLIT,
                            stride_xm, stride_wn, stride_mn, stride_sn, stride_om,
                            HAS_ZEROS: tl.constexpr, G: tl.constexpr, WG: tl.constexpr, BLOCK_N: tl.constexpr,
                            ROW_BLOCKS: tl.constexpr, PARTIAL: tl.constexpr, EVEN: tl.constexpr,
                            FIX_K: tl.constexpr):
    """2:4 + INT4 (FMT 3: a word is 4 blocks of 4 columns, nibble ``2b + i`` kept value ``i`` of block ``b``; the
    int16 metadata word holds the 4 blocks' positions), x-stationary ([Note: x-stationary GEMV]): the word's 16
    columns of ``x`` stay in registers, each kept value picks its column by its position. Grid and workspace as
    ``stationary_gemv_kernel``'s; a group is ``WG`` words. Zero points need the sum of the picked columns, so it
    is summed per row (one add per kept value) instead of once per slice."""
    pid_m, pid_k, pid_r, word, live, x_row = _program_slice(x_ptr, stride_xm, KW, G, WG)
    a0, a1, a2, a3 = _x_block(x_row, word, live, 0)
    b0, b1, b2, b3 = _x_block(x_row, word, live, 1)
    c0, c1, c2, c3 = _x_block(x_row, word, live, 2)
    d0, d1, d2, d3 = _x_block(x_row, word, live, 3)
    n1 = tl.arange(0, BLOCK_N)
    row0 = pid_r * (BLOCK_N * ROW_BLOCKS)
    gcol = pid_k * G + tl.arange(0, G)
    w_next, m_next = _load_s24w4(w_ptr, meta_ptr, row0 + n1, N, word, live, stride_wn, stride_mn, EVEN)
    for b in range(ROW_BLOCKS):
        w = w_next  # [Note: register prefetch] in _word_kernels: the next block's words and positions in flight
        meta = m_next
        rows = row0 + b * BLOCK_N + n1
        rmask = rows < N
        w_next, m_next = _load_s24w4(w_ptr, meta_ptr, tl.where(b + 1 < ROW_BLOCKS, rows + BLOCK_N, N), N, word,
                                     live, stride_wn, stride_mn, EVEN)
        hi = w >> 16
        zero = tl.zeros(w.shape, tl.float32)
        t0, t1, xs_e = _kept(zero, zero, zero, w, meta, a0, a1, a2, a3, 0)
        t0, t1, xs_o = _kept(t0, t1, zero, w, meta, b0, b1, b2, b3, 1)
        t0, t1, xs_e = _kept(t0, t1, xs_e, hi, meta, c0, c1, c2, c3, 2)
        t0, t1, xs_o = _kept(t0, t1, xs_o, hi, meta, d0, d1, d2, d3, 3)
        tg = tl.sum(t0 + t1 * 0.0625, axis=2) * 2.0 ** 56  # (BN, G)
        x_sum = tl.sum(xs_e + xs_o * 256.0, axis=2) * 2.0 ** -93  # the picked columns of x, per row and group
        sptr = rows[:, None] * stride_sn + gcol[None, :]
        smask = rmask[:, None] & (gcol * WG < KW)[None, :]
        s = tl.load(s_ptr + sptr, mask=smask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            tg = tg - tl.load(z_ptr + sptr, mask=smask, other=0).to(tl.float32) * x_sum
        else:
            tg = tg - 8.0 * x_sum
        part = tl.sum(tg * s, axis=1)
        _store_rows(part, out_ptr, part_ptr, pid_m, pid_k, rows, rmask, N, SPLIT, stride_om, PARTIAL)
    if PARTIAL:
        _finish(part_ptr, count_ptr, out_ptr, pid_m, pid_r, row0, N, SPLIT, stride_om, BLOCK_N * ROW_BLOCKS, FIX_K)


@triton.jit
def _x_cols(x_row, word, live, C: tl.constexpr):
    """Plain 2:4: column ``4 * word + C`` of ``x`` (fp32) for every value word of the slice."""
    return tl.load(x_row + word * 4 + C, mask=live, other=0.0).to(tl.float32)


@triton.jit
def _load_s24(w_ptr, meta_ptr, rows, N, word, live, stride_wn, stride_mn, EVEN: tl.constexpr):
    """Value words ``(BN, G, 8)`` of weight rows ``rows`` and, beside each, its unit's int32 metadata word (the 8
    words of a unit load the same address: a ``(BN, G, 1)`` load broadcast to the words' layout made Triton convert
    layouts through shared memory, 16 barriers per block); rows from ``N`` on read nothing."""
    rmask = (rows < N)[:, None, None]
    if not EVEN:
        rmask = rmask & live
    w = tl.load(w_ptr + rows[:, None, None] * stride_wn + word, mask=rmask, other=0)
    meta = tl.load(meta_ptr + rows[:, None, None] * stride_mn + word // 8, mask=rmask, other=0)
    return w, meta


@triton.jit(do_not_specialize=["M", "SPLIT"])
def stationary_s24_kernel(x_ptr, w_ptr, meta_ptr, part_ptr, count_ptr, out_ptr, M, N, KW, SPLIT,
                          stride_xm, stride_wn, stride_mn, stride_om,
                          G: tl.constexpr, BLOCK_N: tl.constexpr, ROW_BLOCKS: tl.constexpr, PARTIAL: tl.constexpr,
                          EVEN: tl.constexpr, FIX_K: tl.constexpr):
    """Plain 2:4 (FMT 2: a word is one block of 4 columns, its two kept bf16 values, low half first; the metadata
    read as int32 words, 8 blocks each, block ``j`` at bits ``4j``: 2-bit positions p0 < p1), x-stationary
    ([Note: x-stationary GEMV]): the slice's 4 columns of ``x`` per word stay in registers, each kept value picks
    its column by its position, one FFMA per value (bf16 values become fp32 by a shift or a mask). A slice is
    ``G`` units of 8 words (one metadata word each); grid and workspace as ``stationary_gemv_kernel``'s."""
    pid_m, pid_k, pid_r, word, live, x_row = _program_slice(x_ptr, stride_xm, KW, G, 8)
    x0 = _x_cols(x_row, word, live, 0)
    x1 = _x_cols(x_row, word, live, 1)
    x2 = _x_cols(x_row, word, live, 2)
    x3 = _x_cols(x_row, word, live, 3)
    shift = 4 * tl.arange(0, 8)[None, None, :]  # block j of a unit at bits 4j
    n1 = tl.arange(0, BLOCK_N)
    row0 = pid_r * (BLOCK_N * ROW_BLOCKS)
    w_next, m_next = _load_s24(w_ptr, meta_ptr, row0 + n1, N, word, live, stride_wn, stride_mn, EVEN)
    for b in range(ROW_BLOCKS):
        w = w_next  # [Note: register prefetch] in _word_kernels: the next block's words in flight
        meta = m_next
        rows = row0 + b * BLOCK_N + n1
        rmask = rows < N
        w_next, m_next = _load_s24(w_ptr, meta_ptr, tl.where(b + 1 < ROW_BLOCKS, rows + BLOCK_N, N), N, word, live,
                                   stride_wn, stride_mn, EVEN)
        nib = meta >> shift  # (BN, G, 8): bits 0-1 p0, bits 2-3 p1 (higher bits are later blocks': not read)
        # sorted positions, p0 <= 2 and p1 >= 1, so single bits choose: one bit test and one select each
        xa = tl.where((nib & 2) != 0, x2, tl.where((nib & 1) != 0, x1, x0))
        xb = tl.where((nib & 8) != 0, tl.where((nib & 4) != 0, x3, x2), x1)
        t = tl.fma((w << 16).to(tl.float32, bitcast=True), xa, 0.0)
        t = tl.fma((w & -65536).to(tl.float32, bitcast=True), xb, t)
        part = tl.sum(tl.sum(t, axis=2), axis=1)
        _store_rows(part, out_ptr, part_ptr, pid_m, pid_k, rows, rmask, N, SPLIT, stride_om, PARTIAL)
    if PARTIAL:
        _finish(part_ptr, count_ptr, out_ptr, pid_m, pid_r, row0, N, SPLIT, stride_om, BLOCK_N * ROW_BLOCKS, FIX_K)
