"""Unit layouts and the fixed pool of device slots the streamer loads units into.

[Note: one layout, two buffers]
A unit's tensors are packed into one flat byte range, each at an aligned
offset (:func:`plan_layout`). The device slot and the pinned staging buffer use
the same layout, so moving a unit from staging to the device is a single
contiguous copy, and the tensors handed to the consumer are views into the
slot: nothing is allocated per unit. With a DISK store the alignment is the
store's (4096), so the store's O_DIRECT reads land straight in the staging
views (see [Note: aligned host buffers]).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .device import DeviceHandle
from .pinned_pool import aligned_empty
from .store_config import TensorMeta, align_up


@dataclass(frozen=True, slots=True)
class TensorPlace:
    """Where one tensor of a unit sits in the unit's flat byte range."""

    key: str
    offset: int
    meta: TensorMeta

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor as a view into ``flat`` (a uint8 buffer laid out by the unit's layout)."""
        raw = flat[self.offset:self.offset + self.meta.nbytes]
        return raw.view(self.meta.dtype).view(self.meta.shape)


@dataclass(frozen=True, slots=True)
class UnitLayout:
    """The packed layout of one unit: its tensors' places and the bytes it spans."""

    places: tuple[TensorPlace, ...]
    span: int

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data (the span minus alignment padding)."""
        return sum(p.meta.nbytes for p in self.places)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {p.key: p.view(flat) for p in self.places}


def plan_layout(metas: Sequence[tuple[str, TensorMeta]], *, alignment: int) -> UnitLayout:
    """Pack tensors in the given order, each starting at a multiple of ``alignment``."""
    places, offset = [], 0
    for key, meta in metas:
        offset = align_up(offset, alignment)
        places.append(TensorPlace(key, offset, meta))
        offset += meta.nbytes
    return UnitLayout(tuple(places), align_up(offset, alignment))


@dataclass(eq=False)
class DeviceSlot:
    """One of the K device buffers a unit can be resident in.

    ready_event: recorded on the copy stream after the unit's bytes land; the
        consumer's stream waits on it in ``acquire``.
    free_event: recorded on the consumer's stream at ``release``; the copy
        stream waits on it before overwriting the slot with another unit.
    """

    index: int
    buffer: torch.Tensor
    ready_event: object
    free_event: object
    unit: int | None = field(default=None)


class SlotPool:
    """K flat uint8 device buffers, each sized for the largest unit, allocated once.

    The buffers live as long as the pool, so no ``record_stream`` is needed
    although the copy stream writes them and the consumer's stream reads them.
    """

    def __init__(self, *, device: DeviceHandle, window: int, slot_bytes: int, alignment: int):
        self.slots = [self._new_slot(i, device, slot_bytes, alignment) for i in range(window)]

    @staticmethod
    def _new_slot(index: int, device: DeviceHandle, nbytes: int, alignment: int) -> DeviceSlot:
        if device.is_cuda:
            buffer = device.empty((nbytes,), dtype=torch.uint8)  # the allocator aligns to >= 512 bytes
        else:
            buffer = aligned_empty(nbytes, alignment=alignment)
        ready, free = device.new_event(), device.new_event()
        return DeviceSlot(index, buffer, ready, free)

    def free_slot(self) -> DeviceSlot | None:
        return next((s for s in self.slots if s.unit is None), None)

    @property
    def occupied(self) -> int:
        return sum(s.unit is not None for s in self.slots)

    @property
    def nbytes(self) -> int:
        return sum(s.buffer.numel() for s in self.slots)
