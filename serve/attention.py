"""Attention over the slot KV cache for a packed batch, plugged into Hugging Face's decoder layers.

[Note: packed batch] A step's tokens (prefill chunks and decode tokens of all
sequences) are packed into one row ``(1, N, hidden)``: the linear layers,
norms and MLPs of the Hugging Face decoder layer run once for the whole batch,
with no padding. Only attention needs to know which token belongs to which
sequence. Hugging Face lets a model pick its attention function by name
(``config._attn_implementation``); we register :func:`slot_attention` as
``"zspeed_slots"`` and hand it a :class:`LayerAttention` through the keyword
arguments that the decoder layer passes down untouched. It writes the step's
new keys and values into their sequences' cache slots (one indexed copy for
all of them), then for each sequence attends over its slot's first
``start + length`` entries, so the layer's own code (projections, rotary
embedding, output projection) is Hugging Face's.

The per-sequence call mirrors what Hugging Face's ``sdpa`` path does for one
unpadded sequence (``is_causal`` for a whole prompt, no mask for one token,
``enable_gqa`` for grouped heads), so a batch gives each sequence the same
numbers it would get alone. A prompt chunk that continues a cached prefix
needs the causal mask aligned to the bottom right, which SDPA's ``is_causal``
is not, so it gets an explicit mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .kv_cache import KVCache

ATTN_IMPLEMENTATION = "zspeed_slots"


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence's tokens in a packed step: rows ``offset .. offset+length-1``,
    at positions ``start .. start+length-1``, cached in ``slot``."""

    slot: int
    start: int
    length: int
    offset: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)

    @property
    def kv_length(self) -> int:
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What :func:`slot_attention` needs for one layer of one step: the segments, and per packed token
    its cache slot and position (``(N,)`` device tensors, made once per step by the runner)."""

    cache: KVCache
    layer: int
    segments: tuple[Segment, ...]
    token_slots: torch.Tensor
    token_positions: torch.Tensor


def chunk_mask(segment: Segment, device: torch.device) -> torch.Tensor | None:
    """The boolean mask ``(length, start+length)`` of a prompt chunk after a cached prefix, else None."""
    if segment.length == 1 or segment.start == 0:
        return None
    query_pos = torch.arange(segment.start, segment.kv_length, device=device)[:, None]
    key_pos = torch.arange(segment.kv_length, device=device)[None, :]
    return key_pos <= query_pos  # (length, start+length)


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    zspeed: LayerAttention | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention-function signature; see [Note: packed batch].

    ``query`` is ``(1, heads, N, head_dim)``, ``key``/``value`` ``(1, kv_heads,
    N, head_dim)`` after the rotary embedding. Returns ``(1, N, heads, head_dim)``.
    """
    if zspeed is None:
        raise RuntimeError(f"attention {ATTN_IMPLEMENTATION!r} runs only inside zspeed's model runner")
    if sliding_window is not None and any(seg.kv_length > sliding_window for seg in zspeed.segments):
        raise NotImplementedError(f"sequences longer than the sliding window ({sliding_window}) are not supported")
    gqa = query.shape[1] != key.shape[1]
    # every sequence's new keys and values at once; each segment below reads only its own slot
    zspeed.cache.write_tokens(zspeed.layer, zspeed.token_slots, zspeed.token_positions, key[0], value[0])
    outs = []
    for seg in zspeed.segments:
        k, v = zspeed.cache.read(zspeed.layer, seg.slot, seg.kv_length)  # (kvH, L, D) each
        mask = chunk_mask(seg, query.device)
        o = F.scaled_dot_product_attention(
            query[:, :, seg.rows], k[None], v[None], attn_mask=mask, scale=scaling,
            is_causal=seg.length > 1 and mask is None, enable_gqa=gqa,
        )  # (1, H, length, D)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1), None  # (1, N, H, D): the segments tile the packed row in order


AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention)
