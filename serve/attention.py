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
all of them), then attends, so the layer's own code (projections, rotary
embedding, output projection) is Hugging Face's.

Prompt chunks attend one sequence at a time, over their slot's first
``start + length`` entries. The call mirrors what Hugging Face's ``sdpa``
path does for one unpadded sequence (``is_causal`` for a whole prompt,
``enable_gqa`` for grouped heads), so a batch gives each sequence the same
numbers it would get alone. A prompt chunk that continues a cached prefix
needs the causal mask aligned to the bottom right, which SDPA's ``is_causal``
is not, so it gets an explicit mask.

One-token segments (decode tokens, and one-token prompt chunks, which need no
mask either) attend all together, in one call per layer (a call per sequence
and layer is host-bound on a GPU): a :class:`DecodeBatch`, made once per step,
gathers each one's keys and values into a padded batch ``(B, kv_heads, Lmax,
head_dim)``, ``Lmax`` the longest of their ``start + 1``. The key mask
``(B, 1, 1, Lmax)`` keeps each sequence to its own ``start + 1`` entries: a
masked score is ``-inf`` and its softmax weight exactly zero, so a sequence's
numbers are those of its own unmasked call, up to rounding. The padding
repeats the sequence's last entry rather than reading past it, so it is
always finite data (the cache is allocated uninitialised, and a NaN there
would survive the mask: ``0 * NaN`` is NaN). Grouped query heads are folded
into the query length (``(B, heads, 1, D)`` as ``(B, kv_heads, heads /
kv_heads, D)``, as Hugging Face's ``pack_gqa`` does) instead of
``enable_gqa``: SDPA's memory-efficient CUDA kernel takes a mask but not
grouped heads, and would fall back to the math kernel. The outputs go back to
the segments' rows, so the result is laid out as if each segment had been
attended alone, in order.
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
class DecodeBatch:
    """The step's one-token segments, attended in one call per layer (see [Note: packed batch]).

    Device tensors, made once per step by :meth:`build` from segments in the
    packed row's order: ``rows`` ``(B,)`` their rows, ``slots`` ``(B,)`` their
    cache slots, ``key_positions`` ``(B, Lmax)`` the cache positions gathered
    for each (``0 .. start``, then ``start`` again as padding) and ``mask``
    ``(B, 1, 1, Lmax)``, True at the positions ``< start + 1``; None when every
    segment has ``Lmax`` entries (one segment, or all of one length).
    """

    rows: torch.Tensor
    slots: torch.Tensor
    key_positions: torch.Tensor
    mask: torch.Tensor | None
    max_kv_length: int
    in_order: bool = False  # the segments are rows 0 .. B-1 of the packed row, in order

    @staticmethod
    def host_values(segments: tuple[Segment, ...]) -> list[int]:
        """What :meth:`build` needs on the device, to go with the step's other inputs in one copy:
        the segments' rows, then their slots, then their kv lengths."""
        return [s.offset for s in segments] + [s.slot for s in segments] + [s.kv_length for s in segments]

    @classmethod
    def build(cls, segments: tuple[Segment, ...], values: torch.Tensor) -> DecodeBatch:
        """From one-token ``segments`` and ``values``, :meth:`host_values` on the device (no sync)."""
        if any(s.length != 1 for s in segments):
            raise ValueError("a DecodeBatch holds one-token segments only")
        rows, slots, kv_lengths = values.view(3, len(segments))
        max_kv_length = max(s.kv_length for s in segments)
        key_pos = torch.arange(max_kv_length, device=values.device)
        last = kv_lengths[:, None] - 1  # (B, 1)
        mask = None
        if any(s.kv_length != max_kv_length for s in segments):
            mask = (key_pos <= last)[:, None, None, :]  # (B, 1, 1, Lmax)
        in_order = all(s.offset == i for i, s in enumerate(segments))
        return cls(rows, slots, torch.minimum(key_pos, last), mask, max_kv_length, in_order)

    def gather(self, cache: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded keys and values of the batch, ``(B, kv_heads, Lmax, head_dim)`` each."""
        index = (self.slots[:, None], self.key_positions)
        keys = cache.keys[layer].transpose(1, 2)[index]  # (B, Lmax, kvH, D)
        values = cache.values[layer].transpose(1, 2)[index]
        return keys.transpose(1, 2), values.transpose(1, 2)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What :func:`slot_attention` needs for one layer of one step, all but ``layer`` made once per step by
    the runner: the segments attended one at a time (prompt chunks; a one-token segment here is attended
    alone, correctly but slower), the one-token segments attended together (``decode``), and per packed
    token its cache slot and position (``(N,)`` device tensors)."""

    cache: KVCache
    layer: int
    segments: tuple[Segment, ...]
    token_slots: torch.Tensor
    token_positions: torch.Tensor
    decode: DecodeBatch | None = None
    masks: tuple[torch.Tensor | None, ...] | None = None  # chunk_mask of each segment, made once per step
    # With the Triton slot attention kernel (zspeed.kernels.attention): every segment's work items on the
    # device, cut at ``work_block_m`` rows; then nothing above is used.
    work: torch.Tensor | None = None
    work_block_m: int = 1

    @property
    def max_kv_length(self) -> int:
        """The longest span that any of the step's sequences attends over."""
        longest = max((seg.kv_length for seg in self.segments), default=0)
        return max(longest, self.decode.max_kv_length if self.decode is not None else 0)


def chunk_mask(segment: Segment, device: torch.device) -> torch.Tensor | None:
    """The boolean mask ``(length, start+length)`` of a prompt chunk after a cached prefix, else None."""
    if segment.length == 1 or segment.start == 0:
        return None
    query_pos = torch.arange(segment.start, segment.kv_length, device=device)[:, None]
    key_pos = torch.arange(segment.kv_length, device=device)[None, :]
    return key_pos <= query_pos  # (length, start+length)


def attend_segment(query: torch.Tensor, zspeed: LayerAttention, seg: Segment,
                   scaling: float | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One segment over its slot: ``(1, length, heads, head_dim)`` for its rows of ``query`` ``(1, H, N, D)``;
    ``mask`` its :func:`chunk_mask`."""
    k, v = zspeed.cache.read(zspeed.layer, seg.slot, seg.kv_length)  # (kvH, L, D) each
    o = F.scaled_dot_product_attention(
        query[:, :, seg.rows], k[None], v[None], attn_mask=mask, scale=scaling,
        is_causal=seg.length > 1 and mask is None, enable_gqa=query.shape[1] != k.shape[0],
    )  # (1, H, length, D)
    return o.transpose(1, 2)


def attend_decodes(query: torch.Tensor, zspeed: LayerAttention, scaling: float | None) -> torch.Tensor:
    """All one-token segments in one call: ``(B, heads, head_dim)``, in the order of ``decode.rows``."""
    decode = zspeed.decode
    keys, values = decode.gather(zspeed.cache, zspeed.layer)  # (B, kvH, Lmax, D) each
    batch, kv_heads, _, dim = keys.shape
    heads = query.shape[1]
    # (B, H, D) -> (B, kvH, H/kvH, D): query head h reads key head h // (H/kvH), as enable_gqa maps them
    rows = query[0] if decode.in_order and query.shape[2] == batch else query[0].index_select(1, decode.rows)
    q = rows.transpose(0, 1).reshape(batch, kv_heads, heads // kv_heads, dim)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=decode.mask, scale=scaling)
    return o.reshape(batch, heads, dim)


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
    if sliding_window is not None and zspeed.max_kv_length > sliding_window:
        raise NotImplementedError(f"sequences longer than the sliding window ({sliding_window}) are not supported")
    # every sequence's new keys and values at once; attention below reads each sequence's own slot only
    zspeed.cache.write_tokens(zspeed.layer, zspeed.token_slots, zspeed.token_positions, key[0], value[0])
    if zspeed.work is not None:  # one launch for all segments ([Note: slot attention kernel])
        from zspeed.kernels.attention import slot_attention as kernel

        layer = zspeed.layer
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = kernel(query[0], zspeed.cache.keys[layer], zspeed.cache.values[layer], zspeed.work, scale,
                     block_m=zspeed.work_block_m)
        return out[None], None
    decode = zspeed.decode
    if not zspeed.segments and decode is not None:  # only one-token segments: they tile the row in order
        return attend_decodes(query, zspeed, scaling)[None], None
    _, heads, n, dim = query.shape
    out = query.new_empty(1, n, heads, dim)  # every row is written: the segments tile the packed row
    masks = zspeed.masks if zspeed.masks is not None else [chunk_mask(seg, query.device) for seg in zspeed.segments]
    for seg, mask in zip(zspeed.segments, masks):
        out[:, seg.rows] = attend_segment(query, zspeed, seg, scaling, mask)
    if decode is not None:
        out[0].index_copy_(0, decode.rows, attend_decodes(query, zspeed, scaling))
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention)
