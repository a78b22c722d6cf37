"""Decode attention straight from the serving KV cache: one kernel per layer and step.

[Note: slot decode attention] The serving runner keeps every sequence's keys
and values in a slot of a preallocated cache ``(slots, kv_heads, max_len,
head_dim)`` (serve/kv_cache.py). Its batched decode attention in plain PyTorch
gathers each sequence's entries into a padded batch, reshapes the queries and
calls SDPA with a key mask: about 40 tensor operations per layer, which on a
GPU cost more host time than the attention costs device time (H100, Llama-8B
shape: ~0.4 ms of host per layer against ~0.15 ms of device work per layer).
:func:`slot_decode_attention` does the same in one Triton launch: a program per
(sequence, key head) loads that head's group of query heads, walks the
sequence's first ``length`` cache entries in blocks with an online softmax,
and writes the group's outputs. Grouped heads share the key loads (GQA); the
group is padded to 16 rows for ``tl.dot``. :func:`slot_decode_attention_ref`
is the plain-PyTorch definition it is tested against.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._runtime import interpreting


@functools.cache
def _kernels():
    from . import _attention_kernels

    return _attention_kernels


def slot_decode_attention_ref(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                              lengths: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference: for each decode ``b``, query row ``rows[b]`` of ``query`` ``(heads, N, D)`` attends over
    ``keys[slots[b], :, :lengths[b]]`` (``keys``/``values`` ``(slots, kv_heads, max_len, D)``); query head ``h``
    reads key head ``h // (heads / kv_heads)``. Returns ``(B, heads, D)`` in ``query.dtype``."""
    heads, kv_heads = query.shape[0], keys.shape[1]
    out = []
    for b in range(slots.shape[0]):
        slot, length, row = int(slots[b]), int(lengths[b]), int(rows[b])
        q = query[:, row][:, None].float()  # (heads, 1, D)
        k = keys[slot, :, :length].float().repeat_interleave(heads // kv_heads, dim=0)  # (heads, L, D)
        v = values[slot, :, :length].float().repeat_interleave(heads // kv_heads, dim=0)
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])
    return torch.stack(out).to(query.dtype)


def slot_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                          lengths: torch.Tensor, rows: torch.Tensor, scale: float, *,
                          block_n: int = 64) -> torch.Tensor:
    """Triton version of :func:`slot_decode_attention_ref` (same arguments; ``head_dim`` a power of two, the
    caches' last dimension contiguous)."""
    heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    if heads % kv_heads or dim & (dim - 1) or min(keys.stride(-1), values.stride(-1)) != 1:
        raise ValueError(f"slot_decode_attention needs heads ({heads}) a multiple of kv_heads ({kv_heads}), a "
                         f"power-of-two head_dim ({dim}) and caches with contiguous rows of head_dim")
    if query.stride(-1) != 1:
        query = query.contiguous()
    batch = slots.shape[0]
    out = torch.empty(batch, heads, dim, device=query.device, dtype=query.dtype)
    if batch == 0:
        return out
    group = heads // kv_heads
    dot_f32 = interpreting() or query.dtype == torch.float32  # see [Note: interpreter dot] in _gemm.py
    _kernels()._slot_decode_kernel[(batch, kv_heads)](
        query, keys, values, out, slots, lengths, rows, float(scale),
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), HEAD_DIM=dim, BLOCK_N=block_n,
        DOT_F32=dot_f32)
    return out
