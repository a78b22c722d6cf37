"""The vocabulary of the tensor store: tiers, its config, metadata and errors.

Kept apart from :mod:`zspeed.core.store` so the tier back ends
(:mod:`zspeed.core.disk_io`) can share it without importing the front end.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch


class Tier(enum.Enum):
    """Where a :class:`~zspeed.core.store.TensorStore` keeps its tensors."""

    DEVICE = "device"  # on the DeviceHandle's device
    CPU = "cpu"  # host memory, page-locked when the device is CUDA
    DISK = "disk"  # one file per key under StoreConfig.path ("NVMe")


class StoreError(RuntimeError):
    """A store could not be opened, or a read or write failed."""


class StoreCorruptionError(StoreError):
    """A stored file does not match its header (bad magic, truncated, checksum)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreConfig:
    """How a :class:`~zspeed.core.store.TensorStore` keeps its tensors.

    tier: a :class:`Tier` (or its string value).
    path: the directory of a DISK store; created if missing; ignored by the other tiers.
    io_threads: worker threads for asynchronous reads and writes.
    direct_io: ``"auto"`` probes O_DIRECT at construction and falls back to
        buffered I/O where the file system refuses it; ``True`` requires it;
        ``False`` never uses it.
    alignment: byte alignment of file offsets, lengths and host buffers for
        O_DIRECT (a power of two, at least 512).
    verify_checksums: write a CRC-32 of every DISK payload and check it on read.
    chunk_bytes: size of the bounce buffers used where a transfer cannot go
        straight between the file and the tensor (device tensors, unaligned
        host tensors); a multiple of ``alignment``.
    """

    tier: Tier = Tier.CPU
    path: str | os.PathLike | None = None
    io_threads: int = 4
    direct_io: bool | str = "auto"
    alignment: int = 4096
    verify_checksums: bool = True
    chunk_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", _as_tier(self.tier))
        if self.tier is Tier.DISK and not self.path:
            raise ValueError("StoreConfig.path is required for tier=DISK: give the directory to keep tensor files in")
        if self.io_threads < 1:
            raise ValueError(f"StoreConfig.io_threads={self.io_threads}: use at least 1")
        if self.direct_io not in ("auto", True, False):
            raise ValueError(f"StoreConfig.direct_io={self.direct_io!r}: use 'auto', True or False")
        if self.alignment < 512 or self.alignment & (self.alignment - 1):
            raise ValueError(f"StoreConfig.alignment={self.alignment}: use a power of two >= 512 (4096 suits NVMe)")
        if self.chunk_bytes < self.alignment or self.chunk_bytes % self.alignment:
            raise ValueError(f"StoreConfig.chunk_bytes={self.chunk_bytes}: use a positive multiple of "
                             f"alignment={self.alignment}")


def _as_tier(tier: Tier | str) -> Tier:
    if isinstance(tier, Tier):
        return tier
    try:
        return Tier(str(tier).lower())
    except ValueError:
        names = ", ".join(t.value for t in Tier)
        raise ValueError(f"StoreConfig.tier={tier!r}: use a Tier or one of {names}") from None


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the store knows about one key without reading its bytes.

    checksum: CRC-32 of the payload bytes for DISK entries written with
    ``verify_checksums``; ``None`` otherwise (memory tiers keep none).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    checksum: int | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, checksum: int | None = None) -> "TensorMeta":
        return cls(tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size(), checksum)

    def matches(self, tensor: torch.Tensor) -> bool:
        return tuple(tensor.shape) == self.shape and tensor.dtype == self.dtype


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor of any dtype (0-d and empty included)."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def missing_key_message(key: str, known: list[str]) -> str:
    """A KeyError message naming ``key`` and a few keys that do exist."""
    some = ", ".join(repr(k) for k in known[:5]) or "none"
    more = f" and {len(known) - 5} more" if len(known) > 5 else ""
    return f"key {key!r} is not in the store (stored keys: {some}{more})"
