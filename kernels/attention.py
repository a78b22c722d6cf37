"""Serving attention straight from the slot KV cache: one kernel per layer and step.

[Note: slot attention kernel] The serving runner keeps every sequence's keys
and values in a slot of a preallocated cache ``(slots, kv_heads, max_len,
head_dim)`` (serve/kv_cache.py), and a step packs all sequences' new tokens
(prompt chunks and decode tokens) into one row. Its attention in plain PyTorch
gathers each decoding sequence's entries into a padded batch and calls SDPA
once more per prompt chunk: about 45 tensor operations per layer for the
decodes and more per chunk, which on a GPU cost more host time than the
attention costs device time (H100, Llama-8B shape, CUDA graphs around the
attention: an 8-layer decode step at batch 16 took 4.8 ms for ~1.5 ms of device
work), and made a step with a prompt chunk 1.2x one without.
:func:`slot_attention` does all of it in one Triton launch: the step's rows are
cut into *work items* of up to ``block_m`` consecutive rows of one sequence
(:func:`attention_work`; a decode token is an item of one row), and a program
per (item, key head) attends the item's rows causally over the sequence's
cache entries with an online softmax, its group of query heads sharing the key
loads (GQA). Rows times heads fill the rows of ``tl.dot`` (at least 16).
:func:`slot_attention_ref` is the plain-PyTorch definition it is tested
against.
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.nn.functional as F

from ._runtime import interpreting

BLOCK_M = 16  # rows of a prompt chunk per work item


@functools.cache
def _kernels():
    from . import _attention_kernels

    return _attention_kernels


def attention_work(segments: Iterable[tuple[int, int, int, int]], block_m: int) -> list[int]:
    """Work items, flattened: ``(slot, start, row, count)`` per item, for segments ``(slot, start, row,
    length)``: ``length`` rows from packed row ``row`` on, at cache positions ``start`` on."""
    work: list[int] = []
    for slot, start, row, length in segments:
        for j in range(0, length, block_m):
            work += (slot, start + j, row + j, min(block_m, length - j))
    return work


def slot_attention_ref(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, work: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Reference: ``query`` ``(heads, N, D)``; ``keys``/``values`` ``(slots, kv_heads, max_len, D)``; ``work``
    ``(items, 4)`` of ``(slot, start, row, count)``: rows ``row .. row+count-1`` sit at cache positions
    ``start ..`` and each attends over its slot's entries up to its own position; query head ``h`` reads key
    head ``h // (heads / kv_heads)``. Returns ``(N, heads, D)`` in ``query.dtype``; rows no item covers are 0."""
    heads, n, dim = query.shape
    group = heads // keys.shape[1]
    out = torch.zeros(n, heads, dim, dtype=torch.float32)
    for slot, start, row, count in work.tolist():
        for i in range(count):
            length = start + i + 1
            k = keys[slot, :, :length].float().repeat_interleave(group, dim=0)  # (heads, L, D)
            v = values[slot, :, :length].float().repeat_interleave(group, dim=0)
            q = query[:, row + i][:, None].float()  # (heads, 1, D)
            out[row + i] = F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0]
    return out.to(query.dtype)


def slot_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, work: torch.Tensor,
                   scale: float, *, block_m: int, block_n: int = 64) -> torch.Tensor:
    """Triton version of :func:`slot_attention_ref` (rows no item covers are left uninitialized). ``work`` is
    on the device, made by :func:`attention_work` with this ``block_m``; ``head_dim`` a power of two."""
    heads, n, dim = query.shape
    kv_heads = keys.shape[1]
    if heads % kv_heads or dim & (dim - 1) or min(keys.stride(-1), values.stride(-1)) != 1:
        raise ValueError(f"slot_attention needs heads ({heads}) a multiple of kv_heads ({kv_heads}), a "
                         f"power-of-two head_dim ({dim}) and caches with contiguous rows of head_dim")
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(n, heads, dim, device=query.device, dtype=query.dtype)
    items = work.numel() // 4
    if items == 0:
        return out
    group = heads // kv_heads
    group_pad = 1 << (group - 1).bit_length()
    while block_m * group_pad < 16:  # tl.dot needs 16 rows
        group_pad *= 2
    dot_f32 = interpreting() or query.dtype == torch.float32  # see [Note: interpreter dot] in _gemm.py
    _kernels()._slot_attention_kernel[(items, kv_heads)](
        query, keys, values, out, work, float(scale),
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=dim, BLOCK_N=block_n, DOT_F32=dot_f32)
    return out
