"""Aligned, page-locked host buffers, reused instead of allocated per transfer.

[Note: aligned host buffers]
O_DIRECT needs the host address, the file offset and the length all aligned
(4096 on NVMe). Torch gives no aligned allocator, so :func:`aligned_empty`
allocates ``alignment`` extra bytes and returns the view that starts at the
first aligned address; the view keeps the whole allocation alive.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .device import DeviceHandle


def aligned_empty(nbytes: int, *, alignment: int, device: DeviceHandle | None = None,
                  pinned: bool = False) -> torch.Tensor:
    """A flat uint8 host tensor of ``nbytes`` whose data pointer is aligned.

    ``pinned`` asks ``device`` for page-locked memory (plain memory on the CPU).
    See [Note: aligned host buffers].
    """
    if pinned and device is not None:
        raw = device.pinned_empty((nbytes + alignment,), dtype=torch.uint8)
    else:
        raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    start = -raw.data_ptr() % alignment
    return raw[start:start + nbytes]


def size_class(nbytes: int, *, minimum: int) -> int:
    """The smallest power of two >= max(nbytes, minimum)."""
    return 1 << (max(nbytes, minimum) - 1).bit_length()


@dataclass(eq=False)
class PinnedBuffer:
    """A buffer lent by a :class:`PinnedBufferPool`; give it back with ``release``.

    ``tensor`` is the aligned uint8 view of ``nbytes`` requested bytes;
    ``capacity`` holds the whole size class (also aligned).
    """

    capacity: torch.Tensor
    nbytes: int
    pool: "PinnedBufferPool | None" = field(default=None, repr=False)

    @property
    def tensor(self) -> torch.Tensor:
        return self.capacity[:self.nbytes]

    def release(self) -> None:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.release(self)

    def __enter__(self) -> "PinnedBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PinnedBufferPool:
    """Page-locked host buffers in power-of-two size classes, bounded in total.

    ``acquire(nbytes)`` hands out a free buffer of the matching class, else
    allocates one while the pool stays under ``max_bytes``, else drops free
    buffers of other classes, else blocks until a buffer comes back (or
    ``timeout`` seconds pass). Thread-safe.
    """

    def __init__(self, *, device: DeviceHandle, max_bytes: int, alignment: int = 4096,
                 min_class: int = 64 << 10):
        if max_bytes < min_class:
            raise ValueError(f"PinnedBufferPool max_bytes={max_bytes} is below one buffer of {min_class} bytes")
        self.device = device
        self.max_bytes = max_bytes
        self.alignment = alignment
        self.min_class = min_class
        self._free: dict[int, list[torch.Tensor]] = {}
        self._allocated = 0
        self._in_use = 0
        self._cond = threading.Condition()

    # -- lifecycle -------------------------------------------------------------
    def acquire(self, nbytes: int, *, timeout: float | None = None) -> PinnedBuffer:
        size = size_class(nbytes, minimum=self.min_class)
        if size > self.max_bytes:
            raise ValueError(f"a {nbytes}-byte buffer exceeds PinnedBufferPool max_bytes={self.max_bytes}; "
                             "raise max_bytes or transfer in smaller chunks")
        with self._cond:
            if not self._cond.wait_for(lambda: self._can_serve(size), timeout=timeout):
                raise TimeoutError(f"no {size}-byte pinned buffer came back within {timeout}s "
                                   f"({self._in_use} of {self.max_bytes} bytes in use)")
            capacity = self._take(size)
            self._in_use += size
        return PinnedBuffer(capacity=capacity, nbytes=nbytes, pool=self)

    def release(self, buffer: PinnedBuffer) -> None:
        size = buffer.capacity.numel()
        with self._cond:
            self._free.setdefault(size, []).append(buffer.capacity)
            self._in_use -= size
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._allocated -= sum(t.numel() for ts in self._free.values() for t in ts)
            self._free.clear()

    # -- facts -----------------------------------------------------------------
    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def in_use_bytes(self) -> int:
        return self._in_use

    # -- internals (called with the lock held) ---------------------------------
    def _can_serve(self, size: int) -> bool:
        if self._free.get(size):
            return True
        free_other = sum(t.numel() for ts in self._free.values() for t in ts)
        return self._allocated - free_other + size <= self.max_bytes

    def _take(self, size: int) -> torch.Tensor:
        if self._free.get(size):
            return self._free[size].pop()
        while self._allocated + size > self.max_bytes:
            self._drop_one_free()
        self._allocated += size
        return aligned_empty(size, alignment=self.alignment, device=self.device, pinned=True)

    def _drop_one_free(self) -> None:
        size = next(s for s, ts in self._free.items() if ts)
        self._free[size].pop()
        self._allocated -= size
