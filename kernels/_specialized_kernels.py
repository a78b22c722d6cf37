"""The warp-specialized INT4 GEMM for Hopper, written in Gluon: warps that only load, warps that only dequantize,
and warp groups that only issue MMAs, meeting at mbarriers.

Imported lazily, like ``_pipelined_kernels``; only on an sm_90 GPU with a Triton that has Gluon's
``warp_specialize`` (``_pipelined.specialized_possible``).

[Note: warp-specialized wdot] The pipelined kernel ([Note: pipelined wdot] in ``_pipelined_kernels``) has every warp
do everything in turn: wait for a tile's words, dequantize them into shared memory, meet the other warps at a CTA
barrier, issue the tile's ``wgmma``. Nsight Compute found it latency-bound at 256 rows (kernels run 61): the tensor
pipe busy 50-63 % of the time, issue slots 26 %, the warps waiting on the dequantization's dependency chains, the
mbarriers, shared memory and the barrier, with only 8 warps an SM. Here the roles are split
(``gl.warp_specialize``), so that a stall in one role no longer stops the other:

- ``DQ_WARPS`` *dequantizing* warps (a worker partition) wait for a tile's INT4 words ``(BN, 8)``, read them from
  shared memory, dequantize them (the same packed PTX, [Note: packed INT4 dequantization] in ``_wmma_kernels``) into
  one of ``WSTAGES`` shared buffers once the MMAs have freed it, mark it ready, and refill the words' slot by TMA,
  ``QSTAGES`` tiles ahead. They load the scales and zero points a chunk of 16 groups ahead, as before;
- the default partition, ``BN / 16`` warps (one or two warp groups, 64 weight rows each), waits for a tile's
  dequantized weights and its ``x`` block ``(BM, 64)``, issues the tile's ``wgmma`` asynchronously, retires the one
  before, frees that tile's dequantized buffer and refills its ``x`` slot by TMA, ``XSTAGES`` tiles ahead. Then it
  stores the output, or its split's partial for the fix-up (``_store_acc``).

An mbarrier arrive is one thread's (Triton lowers it for the partition's first thread), so a partition's warps meet
at their own named barrier (``bar.sync id, threads``) before it: after the dequantized stores and their
``fence.proxy.async``, and after both warp groups' ``wgmma`` waits. The dequantizing warps get ``DQ_REGS`` registers
a thread (``setmaxnreg``), the MMA warps the rest; 16 warps in all would leave 128 registers at launch, too few for a
64 x 256 accumulator, so 8 dequantizing warps need 128-row blocks of ``x``.

Measured on an H100 (benchmarks/RESULTS.md, kernels runs 80-82, over cuBLAS bf16): at 256 rows 0.84-0.91x where the
pipelined kernel ran 0.81-0.85x, at 512 rows 0.72-0.82x (0.66-0.76x), at 1024 rows 0.79x (0.72-0.76x). More ``x``
buffers (5, 6), a third dequantized buffer or 8 dequantizing warps were each slower, so neither latency nor the
dequantization's throughput is what is left. Shared memory bandwidth is the likely limit: per 256 x 128 x 64 tile
the two warp groups' ``wgmma`` read ``x`` twice and the weights once (80 KB), TMA writes 36 KB and the dequantization
16 KB, about 130 bytes a cycle at the tensor pipe's full rate, against 128 an SM. The register-operand kernel
([Note: fragment wdot] in ``_fragment_kernels``) saves the 32 KB of dequantized stores and reads a tile, and is
faster in every cell measured (kernels run 86); this one stays among the tuner's candidates from 256 rows.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ._pipelined_kernels import (BK, BW, _cta_barrier, _dequant_to, _scales_first, _scales_next, _split_tiles,
                                 _store_acc, _tma_load)


@gluon.jit
def _dequant_part(w_desc, q_smem, w_smem, q_ready, w_ready, w_empty, s_ptr, z_ptr, off_n, N, K, t_lo, n_tiles,
                  stride_sn, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr,
                  QSTAGES: gl.constexpr, WSTAGES: gl.constexpr, DQ_WARPS: gl.constexpr):
    """The dequantizing warps: words -> ``(q - z) * s`` in shared memory, tile by tile. They also keep the words'
    ring full: a slot is refilled as soon as its words are in registers."""
    for i in gl.static_range(QSTAGES):
        if i < n_tiles:
            mbarrier.expect(q_ready.index(i), w_desc.block_type.nbytes)
            _tma_load(w_desc, [off_n, (t_lo + i) * BW], q_ready.index(i), q_smem.index(i))
    RPW: gl.constexpr = BLOCK_N // DQ_WARPS  # rows per warp
    TPR: gl.constexpr = 32 // RPW if RPW < 32 else 1  # threads per row
    words_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[RPW * TPR // 32, BW // TPR],
                                             threads_per_warp=[32 // TPR, TPR], warps_per_cta=[DQ_WARPS, 1],
                                             order=[1, 0])
    chunk_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[RPW * TPR // 32, 16 // TPR],
                                             threads_per_warp=[32 // TPR, TPR], warps_per_cta=[DQ_WARPS, 1],
                                             order=[1, 0])
    groups = K // GROUP
    rows, rmask, cols, s_cur, z_cur, s_nxt, z_nxt, s_t, z_t = _scales_first(
        s_ptr, z_ptr, off_n, N, t_lo, groups, stride_sn, HAS_ZEROS, GROUP, BLOCK_N, chunk_l, words_l)
    for j in range(n_tiles):
        t = t_lo + j
        s_cur, z_cur, s_nxt, z_nxt, s_t, z_t = _scales_next(j, t, rows, rmask, cols, s_cur, z_cur, s_nxt, z_nxt, s_t,
                                                            z_t, s_ptr, z_ptr, groups, stride_sn, HAS_ZEROS, GROUP,
                                                            words_l)
        qs = j % QSTAGES
        mbarrier.wait(q_ready.index(qs), (j // QSTAGES) & 1)
        w = q_smem.index(qs).load(words_l)
        ws = j % WSTAGES
        mbarrier.wait(w_empty.index(ws), ((j // WSTAGES) & 1) ^ 1)
        _dequant_to(w_smem.index(ws), w, s_t, z_t)
        fence_async_shared()
        _cta_barrier()  # the partition's warps: words read, dequantized tile stored and fenced
        mbarrier.arrive(w_ready.index(ws))
        if j + QSTAGES < n_tiles:
            mbarrier.expect(q_ready.index(qs), w_desc.block_type.nbytes)
            _tma_load(w_desc, [off_n, (t + QSTAGES) * BW], q_ready.index(qs), q_smem.index(qs))


@gluon.jit
def _mma_part(x_desc, x_smem, w_smem, x_ready, w_ready, w_empty, off_m, t_lo, n_tiles, BLOCK_N: gl.constexpr,
              BLOCK_M: gl.constexpr, XSTAGES: gl.constexpr, WSTAGES: gl.constexpr):
    """The MMA warp groups: ``acc^T[BN, BM] += W_tile @ x_tile^T``, one ``wgmma`` in flight under the next. They
    also keep the ``x`` ring full: a slot is refilled as soon as the ``wgmma`` that read it is retired."""
    for i in gl.static_range(XSTAGES):
        if i < n_tiles:
            mbarrier.expect(x_ready.index(i), x_desc.block_type.nbytes)
            _tma_load(x_desc, [off_m, (t_lo + i) * BK], x_ready.index(i), x_smem.index(i))
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BLOCK_N // 16, 1],
                                                    instr_shape=[16, BLOCK_M, 16])
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
    for j in range(n_tiles):
        ws = j % WSTAGES
        xs = j % XSTAGES
        mbarrier.wait(w_ready.index(ws), (j // WSTAGES) & 1)
        mbarrier.wait(x_ready.index(xs), (j // XSTAGES) & 1)
        acc = warpgroup_mma(w_smem.index(ws), x_smem.index(xs).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if j > 0:  # tile j - 1's wgmma is retired in every warp group: its buffers are free
            _cta_barrier()
            mbarrier.arrive(w_empty.index((j - 1) % WSTAGES))
            nxt = j - 1 + XSTAGES
            if nxt < n_tiles:
                xn = (j - 1) % XSTAGES
                mbarrier.expect(x_ready.index(xn), x_desc.block_type.nbytes)
                _tma_load(x_desc, [off_m, (t_lo + nxt) * BK], x_ready.index(xn), x_smem.index(xn))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return (acc, )  # a tuple: warp_specialize flattens the default partition's results


@gluon.jit
def w4_specialized_kernel(x_desc, w_desc, s_ptr, z_ptr, out_ptr, part_ptr, count_ptr, M, N, K, SPLIT_K, stride_sn,
                          stride_om, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr,
                          BLOCK_M: gl.constexpr, XSTAGES: gl.constexpr, QSTAGES: gl.constexpr,
                          WSTAGES: gl.constexpr, DQ_WARPS: gl.constexpr, DQ_REGS: gl.constexpr,
                          W_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    """``out[M, N] = x @ dequant(W)^T`` for INT4 words, ``x`` and scales in bf16 or fp16 ([Note: warp-specialized
    wdot]). Grid and arguments as ``_pipelined_kernels.w4_pipelined_kernel``; ``num_warps`` is ``BLOCK_N // 16`` (the
    MMA warp groups), the loader warp and ``DQ_WARPS`` dequantizing warps come on top."""
    off_n = gl.program_id(0) * BLOCK_N
    off_m = gl.program_id(1) * BLOCK_M
    t_lo, n_tiles = _split_tiles(K, SPLIT_K, gl.program_id(2))

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [XSTAGES, BLOCK_M, BK], x_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [QSTAGES, BLOCK_N, BW], w_desc.layout)
    w_smem = gl.allocate_shared_memory(x_desc.dtype, [WSTAGES, BLOCK_N, BK], W_LAYOUT)
    x_ready = gl.allocate_shared_memory(gl.int64, [XSTAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [QSTAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [WSTAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [WSTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(XSTAGES):
        mbarrier.init(x_ready.index(i), count=1)
    for i in gl.static_range(QSTAGES):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(WSTAGES):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)

    (acc, ) = gl.warp_specialize([
        (_mma_part, (x_desc, x_smem, w_smem, x_ready, w_ready, w_empty, off_m, t_lo, n_tiles, BLOCK_N, BLOCK_M,
                     XSTAGES, WSTAGES)),
        (_dequant_part, (w_desc, q_smem, w_smem, q_ready, w_ready, w_empty, s_ptr, z_ptr, off_n, N, K, t_lo,
                         n_tiles, stride_sn, GROUP, HAS_ZEROS, BLOCK_N, QSTAGES, WSTAGES, DQ_WARPS)),
    ], [DQ_WARPS], [DQ_REGS])
    for i in gl.static_range(XSTAGES):
        mbarrier.invalidate(x_ready.index(i))
    for i in gl.static_range(QSTAGES):
        mbarrier.invalidate(q_ready.index(i))
    for i in gl.static_range(WSTAGES):
        mbarrier.invalidate(w_ready.index(i))
        mbarrier.invalidate(w_empty.index(i))

    _store_acc(acc, out_ptr, part_ptr, count_ptr, off_n, off_m, M, N, SPLIT_K, stride_om,
               gl.program_id(1) * gl.num_programs(0) + gl.program_id(0), gl.program_id(2), off_m * N + off_n, M * N, N,
               BLOCK_N, BLOCK_M, num_warps)
