"""The Triton kernel of :mod:`zspeed.kernels.decode_attention` (imported on first launch: [Note: lazy triton])."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slot_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, lengths_ptr, rows_ptr, scale,
                        stride_qh, stride_qn, stride_ks, stride_kh, stride_kl, stride_vs, stride_vh, stride_vl,
                        stride_ob, stride_oh,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """One program per (sequence, key head): its GROUP query heads over the sequence's cached keys, online softmax."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    live = g < GROUP
    q = tl.load(q_ptr + heads[:, None] * stride_qh + row * stride_qn + d[None, :], mask=live[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < length
        k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=inside[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale  # (GROUP_PAD, BLOCK_N)
        s = tl.where(inside[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=live[:, None])
