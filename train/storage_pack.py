"""One flat buffer per dtype for the groups' persistent device buffers (stages 0-2).

[Note: packed persistent storage]
Groups are built one unit at a time, each allocating its own 16-bit ``full``
buffer and fp32 ``master`` while the unit's fp32 staging copies come and go.
The CUDA caching allocator hands some of those buffers blocks a little larger
than asked (it does not split off a remainder under 1 MiB), and the allocated
bytes it reports count the whole block. On the ZeRO-2 benchmark of
benchmarks/RESULTS.md that slack was the whole difference between zspeed's
peak and DeepSpeed's, whose parameters and masters are one flat buffer each.
So once every unit is built, :func:`pack_persistent_storage` moves each
device-resident ``full``, ``master`` and ``full_grad`` into one buffer per
dtype (a view each, on the 16-byte boundaries the partition pads to) and
points the parameters at their new views; the per-group blocks are freed.
The move costs one extra copy of one dtype's buffers at build time, before any
activation exists; training then runs on the same values at the same offsets
within each group, so results do not change.

Stage 3 is left alone: there ``full`` is gathered and released around every
use, and only shards persist.
"""
from __future__ import annotations

import torch

from ..core.partition import DEFAULT_ALIGN_BYTES
from .param_group_state import FlatParamGroup, point_params_at

_ALIGN_BYTES = DEFAULT_ALIGN_BYTES  # what the partition pads each rank's chunk to: no padding is added
_FIELDS = ("full", "master", "full_grad")


def pack_persistent_storage(groups: list[FlatParamGroup], device: torch.device) -> int:
    """Moves the groups' persistent buffers on ``device`` into one flat buffer per dtype.

    A buffer that is a view of another (a master that is a slice of ``full``)
    follows its base to the same offset. Returns the number of buffers moved.
    """
    owners: list[tuple[FlatParamGroup, str, torch.Tensor]] = []
    for g in groups:
        if g.policy.shard_params:
            continue
        for name in _FIELDS:
            t = getattr(g, name)
            if t is None or t.device != device or t.untyped_storage().nbytes() == 0:
                continue
            if name == "master" and g.master_on_host:
                continue
            owners.append((g, name, t))
    bases = {_storage_key(t): t for _, _, t in owners if _is_whole(t)}
    moved = 0
    for dtype in sorted({t.dtype for t in bases.values()}, key=str):
        moved += _pack_dtype([t for t in bases.values() if t.dtype == dtype], owners, dtype, device)
    return moved


def _pack_dtype(tensors: list[torch.Tensor], owners, dtype: torch.dtype, device: torch.device) -> int:
    align = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    offsets, total = {}, 0
    for t in tensors:
        offsets[_storage_key(t)] = total
        total += -(-t.numel() // align) * align
    flat = torch.empty(total, dtype=dtype, device=device)
    new_views: dict[tuple[int, int], torch.Tensor] = {}
    for t in tensors:
        key = _storage_key(t)
        view = flat[offsets[key]:offsets[key] + t.numel()].view_as(t)
        view.copy_(t)
        new_views[key] = view
    count = 0
    for g, name, t in owners:
        base = new_views.get(_storage_key(t))
        if base is None:
            continue
        element = (t.data_ptr() - t.untyped_storage().data_ptr()) // t.element_size()
        setattr(g, name, base.view(-1)[element:element + t.numel()].view_as(t))
        if name == "full":
            point_params_at(g)
        count += 1
    return count


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def _is_whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage, whole and contiguous (a buffer, not a view into one)."""
    return (t.is_contiguous() and t.data_ptr() == t.untyped_storage().data_ptr()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())
