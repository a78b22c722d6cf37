"""TensorStore: named tensors on the device, in (pinned) host memory, or on disk.

[Note: per-key ordering of asynchronous calls]
Reads and writes run on a thread pool. A write to a key, and any read, meta or
delete of that key submitted after it, waits for the write to finish, so
``put_async(k, t)`` followed by ``get_async(k)`` returns ``t``. The pool's
queue is first in, first out, so the earlier write has always been picked up
by a worker before the later task starts, and waiting on it cannot deadlock.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence

import torch

from .device import DeviceHandle
from .disk_io import DiskTier
from .pinned_pool import PinnedBufferPool, aligned_empty, size_class
from .store_config import (StoreConfig, StoreCorruptionError, StoreError, TensorMeta, Tier, align_up,
                           missing_key_message)

__all__ = ["MemoryTier", "StoreConfig", "StoreCorruptionError", "StoreError", "TensorMeta", "TensorStore", "Tier"]


class MemoryTier:
    """The DEVICE and CPU tiers: a private copy of every tensor, in a dict."""

    direct = False

    def __init__(self, *, tier: Tier, device: DeviceHandle):
        self.device = device
        self.on_device = tier is Tier.DEVICE
        self.tensors: dict[str, torch.Tensor] = {}
        self.index: dict[str, TensorMeta] = {}
        self.packs: dict[str, torch.Tensor] = {}  # key -> the flat buffer it was packed into
        self._lock = threading.Lock()

    def write(self, key: str, tensor: torch.Tensor) -> TensorMeta:
        src = tensor.detach()
        if self.on_device:
            copy = self.device.empty(src.shape, dtype=src.dtype)
        else:
            copy = self.device.pinned_empty(src.shape, dtype=src.dtype)
        copy.copy_(src)
        meta = TensorMeta.of(copy)
        with self._lock:
            self.tensors[key], self.index[key] = copy, meta
            self.packs.pop(key, None)
        return meta

    def write_group(self, tensors: Sequence[tuple[str, torch.Tensor]], *, alignment: int) -> list[TensorMeta]:
        """Copies ``tensors`` into one flat buffer, packed (see [Note: packed groups])."""
        offsets, end = [], 0
        for _, t in tensors:
            offsets.append(align_up(end, alignment))
            end = offsets[-1] + t.numel() * t.element_size()
        span = align_up(end, alignment)
        if self.on_device:
            flat = self.device.empty((span,), dtype=torch.uint8)
        else:
            flat = aligned_empty(span, alignment=alignment, device=self.device, pinned=True)
        views = []
        for (key, t), offset in zip(tensors, offsets):
            src = t.detach()
            raw = flat[offset:offset + src.numel() * src.element_size()]
            views.append((key, raw.view(src.dtype).view(src.shape).copy_(src)))
        with self._lock:
            for key, view in views:
                self.tensors[key], self.index[key], self.packs[key] = view, TensorMeta.of(view), flat
        return [self.index[key] for key, _ in views]

    def read(self, key: str, out: torch.Tensor | None) -> torch.Tensor:
        stored = self.peek(key)
        if out is None:
            return stored.clone()
        if not self.index[key].matches(out):
            raise ValueError(f"out for key {key!r} is {tuple(out.shape)} {out.dtype}, the stored tensor is "
                             f"{tuple(stored.shape)} {stored.dtype}")
        return out.copy_(stored)

    def peek(self, key: str) -> torch.Tensor:
        with self._lock:
            if key not in self.tensors:
                raise KeyError(missing_key_message(key, list(self.index)))
            return self.tensors[key]

    def delete(self, key: str) -> None:
        with self._lock:
            if key not in self.tensors:
                raise KeyError(missing_key_message(key, list(self.index)))
            del self.tensors[key], self.index[key]
            self.packs.pop(key, None)


class TensorStore:
    """Named tensors kept on one :class:`Tier`, read and written asynchronously.

    ``put``/``get`` block; ``put_async``/``get_async`` return futures resolved
    on the store's thread pool (``config.io_threads`` workers). ``get(key,
    out=t)`` fills ``t`` in place (a host tensor, pinned or not, or a device
    tensor; contiguous, with the stored shape and dtype) and returns it;
    without ``out`` the result lives on the tier's home (the device for DEVICE,
    host memory for CPU and DISK) and is the caller's own copy.

    A DISK store re-opened on an existing directory serves the keys already
    there. Bytes round-trip exactly for every dtype. A tensor passed to
    ``put_async`` must not change until the future completes; a device tensor's
    producing work must be complete (the store does not know your streams).
    Ordering: see [Note: per-key ordering of asynchronous calls].
    """

    def __init__(self, *, config: StoreConfig, device: DeviceHandle):
        self.config = config
        self.device = device
        pool_bytes = 2 * config.io_threads * size_class(config.chunk_bytes, minimum=64 << 10)
        self._pool = PinnedBufferPool(device=device, max_bytes=pool_bytes, alignment=config.alignment)
        if config.tier is Tier.DISK:
            self._tier: DiskTier | MemoryTier = DiskTier(config=config, pool=self._pool)
        else:
            self._tier = MemoryTier(tier=config.tier, device=device)
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="zspeed-store")
        self._writes: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- facts -----------------------------------------------------------------
    @property
    def tier(self) -> Tier:
        return self.config.tier

    @property
    def io_mode(self) -> str:
        """``"direct"`` (O_DIRECT), ``"buffered"`` or ``"memory"`` (DEVICE and CPU tiers)."""
        if isinstance(self._tier, MemoryTier):
            return "memory"
        return "direct" if self._tier.direct else "buffered"

    @property
    def alignment(self) -> int:
        return self.config.alignment

    def meta(self, key: str) -> TensorMeta:
        self._settle(key)
        try:
            return self._tier.index[key]
        except KeyError:
            raise KeyError(missing_key_message(key, self.keys())) from None

    def keys(self) -> list[str]:
        return list(self._tier.index)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self._settle(key) or key in self._tier.index)

    def __len__(self) -> int:
        return len(self._tier.index)

    def nbytes(self) -> int:
        """Payload bytes of every stored tensor (padding and headers excluded)."""
        return sum(m.nbytes for m in list(self._tier.index.values()))

    # -- lifecycle: put / get / delete ------------------------------------------
    def put(self, key: str, tensor: torch.Tensor) -> TensorMeta:
        return self.put_async(key, tensor).result()

    def put_async(self, key: str, tensor: torch.Tensor) -> "Future[TensorMeta]":
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({key!r}, ...) expects a torch.Tensor, got {type(tensor).__name__}")
        return self._submit(key, self._tier.write, tensor, write=True)

    def put_group(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
        """Put ``(key, tensor)`` pairs that are used together; blocks until all are stored.

        A memory tier packs them into one buffer (see [Note: packed groups]);
        the DISK tier writes one file per key, as ``put`` does.
        """
        keys = [key for key, _ in tensors]
        if len(set(keys)) != len(keys):
            raise ValueError("put_group lists a key twice")
        if not isinstance(self._tier, MemoryTier):
            return [f.result() for f in [self.put_async(key, t) for key, t in tensors]]
        for key, t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"put_group: {key!r} is a {type(t).__name__}, not a torch.Tensor")
            self._settle(key)  # an earlier write to ``key`` must not land after this one
        if self._closed:
            raise StoreError(f"the store is closed; cannot put {keys[:3]}")
        return self._tier.write_group(tensors, alignment=self.config.alignment)

    def packed_buffer(self, key: str) -> torch.Tensor | None:
        """The flat buffer ``key`` was packed into by ``put_group`` (None if it was put alone)."""
        if not isinstance(self._tier, MemoryTier):
            return None
        self._settle(key)
        return self._tier.packs.get(key)

    def get(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.get_async(key, out).result()

    def get_async(self, key: str, out: torch.Tensor | None = None) -> "Future[torch.Tensor]":
        return self._submit(key, self._tier.read, out, write=False)

    def delete(self, key: str) -> None:
        self._submit(key, self._tier.delete, write=True).result()

    def peek(self, key: str) -> torch.Tensor:
        """The stored tensor itself (DEVICE and CPU tiers only); read it, never write it.

        Lets the streamer copy host-resident tensors straight to the device
        without an extra host copy.
        """
        if not isinstance(self._tier, MemoryTier):
            raise StoreError(f"peek({key!r}) needs a DEVICE or CPU store; this one is {self.tier.value}")
        self._settle(key)
        return self._tier.peek(key)

    def flush(self) -> None:
        """Wait for every write submitted so far."""
        with self._lock:
            pending = list(self._writes.values())
        wait(pending)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        self._pool.close()

    def __enter__(self) -> "TensorStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f", path={str(self._tier.root)!r}" if isinstance(self._tier, DiskTier) else ""
        return f"TensorStore(tier={self.tier.value}{where}, io={self.io_mode}, keys={len(self)})"

    # -- internals ---------------------------------------------------------------
    def _submit(self, key: str, fn: Callable, *args, write: bool) -> Future:
        if not isinstance(key, str) or not key:
            raise TypeError(f"store keys are non-empty strings, got {key!r}")
        with self._lock:
            if self._closed:
                raise StoreError(f"the store is closed; cannot access key {key!r}")
            before = self._writes.get(key)
            future = self._executor.submit(_after, before, fn, key, *args)
            if write:
                self._writes[key] = future
        if write:  # outside the lock: a callback on a finished future runs at once
            future.add_done_callback(lambda f, k=key: self._forget(k, f))
        return future

    def _forget(self, key: str, future: Future) -> None:
        with self._lock:
            if self._writes.get(key) is future:
                del self._writes[key]

    def _settle(self, key: str) -> bool:
        """Wait for a pending write to ``key``; always False (usable inside ``or``)."""
        with self._lock:
            pending = self._writes.get(key)
        if pending is not None:
            wait([pending])
        return False


def _after(before: Future | None, fn: Callable, *args):
    """Run ``fn`` once the previous write to the same key is done (its errors are its own)."""
    if before is not None:
        wait([before])
    return fn(*args)
