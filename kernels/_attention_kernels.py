"""The Triton kernel of :mod:`zspeed.kernels.attention` (imported on first launch: [Note: lazy triton])."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, work_ptr, scale,
                           stride_qh, stride_qn, stride_ks, stride_kh, stride_kl, stride_vs, stride_vh, stride_vl,
                           stride_on, stride_oh,
                           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """One program per (work item, key head). A work item is up to BLOCK_M consecutive query rows of one
    sequence: (cache slot, cache position of its first row, its first row in the packed row, rows). Each row
    attends causally over the sequence's cache entries up to its own position; the key head's GROUP query
    heads share the key loads. Rows x heads are flattened into the BLOCK_M * GROUP_PAD rows of ``tl.dot``."""
    w = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(work_ptr + 4 * w).to(tl.int64)
    start = tl.load(work_ptr + 4 * w + 1)
    row0 = tl.load(work_ptr + 4 * w + 2).to(tl.int64)
    count = tl.load(work_ptr + 4 * w + 3)
    m = tl.arange(0, BLOCK_M * GROUP_PAD)
    i = m // GROUP_PAD  # query row within the item
    g = m % GROUP_PAD  # query head within the group
    heads = kv_head * GROUP + g
    live = (i < count) & (g < GROUP)
    position = start + i  # each row's own cache position: it sees keys 0 .. position
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + heads[:, None] * stride_qh + (row0 + i)[:, None] * stride_qn + d[None, :],
                mask=live[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
    m_i = tl.full((BLOCK_M * GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M * GROUP_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_M * GROUP_PAD, HEAD_DIM), tl.float32)
    end = start + count  # keys past the item's last row are never seen
    for lo in range(0, end, BLOCK_N):
        n = lo + tl.arange(0, BLOCK_N)
        inside = n < end
        k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=inside[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_M * GROUP_PAD, BLOCK_N)
        s = tl.where(inside[None, :] & (n[None, :] <= position[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows see no key: keep them finite
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + (row0 + i)[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=live[:, None])
