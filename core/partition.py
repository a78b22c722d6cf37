"""Flat-buffer partitioning of an ordered list of tensors across ranks.

[Note: bucket-major layout]
Tensors are packed, in order, into *buckets*: runs of consecutive tensors of
one dtype (and one unit, when unit ids are given) of at most ``bucket_bytes``.
A tensor larger than a bucket gets a bucket of its own. Each bucket is padded
so that it splits into ``world_size`` equal chunks whose size is a multiple of
``align`` elements, and chunk ``r`` of every bucket belongs to rank ``r``.

Two flat buffers per dtype follow from that:

* the *full* buffer is the buckets back to back; every tensor is a view into
  it, and every bucket is a contiguous range of it;
* the *shard* buffer of rank ``r`` is chunk ``r`` of each bucket back to back.

So gathering bucket ``b`` is one ``all_gather_into_tensor`` from a contiguous
range of the shard into a contiguous range of the full buffer, and
reduce-scattering it is one ``reduce_scatter_tensor`` the other way: no
copy-in or copy-out around either collective. With ``bucket_bytes`` infinite,
this is the classic layout (one bucket, rank ``r`` owns the ``r``-th slice).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

DEFAULT_ALIGN_BYTES = 16


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lives in its dtype's full flat buffer."""

    index: int  # position in the list given to FlatPartition.build
    name: str
    shape: torch.Size
    dtype: torch.dtype
    bucket: int  # index into FlatGroup.buckets
    offset: int  # element offset in the full buffer
    numel: int

    def view(self, full: torch.Tensor) -> torch.Tensor:
        """This tensor as a view into a full flat buffer of its group."""
        return full[self.offset:self.offset + self.numel].view(self.shape)


@dataclass(frozen=True, slots=True)
class Bucket:
    """A contiguous run of a group's full buffer, split evenly over the ranks."""

    index: int
    slots: tuple[int, ...]  # indices into FlatGroup.slots
    full_offset: int  # start in the full buffer (elements)
    numel: int  # padded size, = world_size * chunk
    chunk: int  # elements each rank owns
    shard_offset: int  # start of this bucket's chunk in every rank's shard buffer
    data_numel: int  # unpadded elements

    @property
    def padding(self) -> int:
        return self.numel - self.data_numel

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """Full-buffer range owned by ``rank`` in this bucket."""
        start = self.full_offset + rank * self.chunk
        return start, start + self.chunk


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """The part of one tensor that a rank owns."""

    slot: TensorSlot
    tensor_start: int  # first element of the tensor (flattened) in this piece
    shard_start: int  # where it sits in the rank's shard buffer
    numel: int


class FlatGroup:
    """All tensors of one dtype, laid out bucket-major (see the note above)."""

    def __init__(self, *, dtype: torch.dtype, slots: list[TensorSlot], buckets: list[Bucket], world_size: int):
        self.dtype = dtype
        self.slots = slots
        self.buckets = buckets
        self.world_size = world_size
        self.full_numel = sum(b.numel for b in buckets)
        self.shard_numel = sum(b.chunk for b in buckets)
        self.data_numel = sum(s.numel for s in slots)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    # -- buffers ---------------------------------------------------------------
    def new_full(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(self.full_numel, dtype=self.dtype, device=device)

    def new_shard(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(self.shard_numel, dtype=self.dtype, device=device)

    def flatten(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``tensors`` (this group's, in slot order) into a full buffer; padding is zero."""
        if len(tensors) != len(self.slots):
            raise ValueError(f"expected {len(self.slots)} tensors of dtype {self.dtype}, got {len(tensors)}")
        full = self.new_full(tensors[0].device if tensors else "cpu") if out is None else out
        if out is not None:
            self._zero_padding(full)
        for slot, t in zip(self.slots, tensors):
            if t.shape != slot.shape:
                raise ValueError(f"tensor {slot.name!r}: shape {tuple(t.shape)} does not match the "
                                 f"partition's {tuple(slot.shape)}")
            slot.view(full).copy_(t)
        return full

    def _zero_padding(self, full: torch.Tensor) -> None:
        for b in self.buckets:
            if b.padding:
                full[b.full_offset + b.data_numel:b.full_offset + b.numel].zero_()

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor of the group as a view into ``full``."""
        return [slot.view(full) for slot in self.slots]

    def shard_of(self, full: torch.Tensor, rank: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy rank ``rank``'s chunks of a full buffer into a shard buffer."""
        shard = torch.empty(self.shard_numel, dtype=full.dtype, device=full.device) if out is None else out
        for b in self.buckets:
            lo, hi = b.chunk_range(rank)
            shard[b.shard_offset:b.shard_offset + b.chunk].copy_(full[lo:hi])
        return shard

    def bucket_full(self, full: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return full[bucket.full_offset:bucket.full_offset + bucket.numel]

    def bucket_shard(self, shard: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return shard[bucket.shard_offset:bucket.shard_offset + bucket.chunk]

    # -- ownership -------------------------------------------------------------
    def pieces(self, rank: int) -> list[ShardPiece]:
        """The pieces of tensors that ``rank`` owns, in shard order."""
        out: list[ShardPiece] = []
        for b in self.buckets:
            lo, hi = b.chunk_range(rank)
            for si in b.slots:
                slot = self.slots[si]
                start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if start < end:
                    out.append(ShardPiece(slot=slot, tensor_start=start - slot.offset,
                                          shard_start=b.shard_offset + start - lo, numel=end - start))
        return out

    def ranks_of(self, slot: TensorSlot) -> list[int]:
        """The ranks whose shards hold part of ``slot``."""
        b = self.buckets[slot.bucket]
        first = (slot.offset - b.full_offset) // b.chunk
        last = (slot.offset + max(slot.numel, 1) - 1 - b.full_offset) // b.chunk
        return list(range(first, last + 1)) if slot.numel else []

    def __repr__(self) -> str:
        return (f"FlatGroup(dtype={self.dtype}, tensors={len(self.slots)}, buckets={len(self.buckets)}, "
                f"full={self.full_numel}, shard={self.shard_numel}, world={self.world_size})")


class FlatPartition:
    """An ordered list of tensors partitioned over ``world_size`` ranks, one :class:`FlatGroup` per dtype.

    Build with :meth:`build`. Groups appear in the order their dtype first
    occurs; within a group, tensors keep their given order.
    """

    def __init__(self, *, groups: dict[torch.dtype, FlatGroup], world_size: int, num_tensors: int):
        self.groups = groups
        self.world_size = world_size
        self.num_tensors = num_tensors
        self._where: dict[int, tuple[torch.dtype, int]] = {
            s.index: (dtype, i) for dtype, g in groups.items() for i, s in enumerate(g.slots)}

    @classmethod
    def build(cls, tensors: Sequence[torch.Tensor], *, world_size: int, names: Sequence[str] | None = None,
              bucket_bytes: int | float = math.inf, align_bytes: int = DEFAULT_ALIGN_BYTES,
              unit_ids: Sequence[int] | None = None) -> "FlatPartition":
        """Lay out ``tensors`` (only their shapes and dtypes are read; meta tensors work).

        Args:
            world_size: number of ranks sharing the buffers.
            names: optional names, used in error messages and :class:`TensorSlot`.
            bucket_bytes: largest bucket (collective) size in bytes; ``inf`` for one bucket per dtype.
            align_bytes: every rank's chunk is a multiple of this many bytes (rounded to whole elements).
            unit_ids: optional non-decreasing unit id per tensor; buckets never span two units
                (ZeRO-3 gathers a module's parameters as one unit).
        """
        _check_build_args(tensors, world_size=world_size, names=names, bucket_bytes=bucket_bytes,
                          align_bytes=align_bytes, unit_ids=unit_ids)
        names = list(names) if names is not None else [f"tensor{i}" for i in range(len(tensors))]
        units = list(unit_ids) if unit_ids is not None else [0] * len(tensors)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        groups = {dtype: _build_group(dtype, idx, tensors, names, units, world_size=world_size,
                                      bucket_bytes=bucket_bytes, align_bytes=align_bytes)
                  for dtype, idx in by_dtype.items()}
        return cls(groups=groups, world_size=world_size, num_tensors=len(tensors))

    def slot(self, index: int) -> TensorSlot:
        dtype, i = self._where[index]
        return self.groups[dtype].slots[i]

    def group_of(self, index: int) -> FlatGroup:
        return self.groups[self._where[index][0]]

    def __iter__(self) -> Iterator[FlatGroup]:
        return iter(self.groups.values())

    def shard_numel(self) -> dict[torch.dtype, int]:
        return {dtype: g.shard_numel for dtype, g in self.groups.items()}

    def shard_bytes(self) -> int:
        """Bytes one rank's shard buffers take, over all dtypes."""
        return sum(g.shard_numel * g.element_size for g in self.groups.values())

    def full_bytes(self) -> int:
        return sum(g.full_numel * g.element_size for g in self.groups.values())

    def data_bytes(self) -> int:
        return sum(g.data_numel * g.element_size for g in self.groups.values())

    def __repr__(self) -> str:
        return f"FlatPartition(world={self.world_size}, groups={list(self.groups.values())})"


def _check_build_args(tensors, *, world_size, names, bucket_bytes, align_bytes, unit_ids) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if align_bytes < 1:
        raise ValueError(f"align_bytes must be >= 1, got {align_bytes}")
    if names is not None and len(names) != len(tensors):
        raise ValueError(f"got {len(names)} names for {len(tensors)} tensors")
    if unit_ids is not None:
        if len(unit_ids) != len(tensors):
            raise ValueError(f"got {len(unit_ids)} unit ids for {len(tensors)} tensors")
        if any(b < a for a, b in zip(unit_ids, unit_ids[1:])):
            raise ValueError("unit_ids must be non-decreasing: a unit's tensors must be consecutive")


def _build_group(dtype, indices, tensors, names, units, *, world_size, bucket_bytes, align_bytes) -> FlatGroup:
    esize = torch.empty((), dtype=dtype).element_size()
    align = max(1, math.ceil(align_bytes / esize))
    cap = math.inf if math.isinf(bucket_bytes) else max(1, int(bucket_bytes // esize))
    runs = _bucket_runs(indices, tensors, units, cap)
    slots: list[TensorSlot] = []
    buckets: list[Bucket] = []
    full_off = shard_off = 0
    for run in runs:
        data = sum(tensors[i].numel() for i in run)
        chunk = max(align, _round_up(math.ceil(data / world_size), align))
        b_index = len(buckets)
        off = full_off
        members = []
        for i in run:
            members.append(len(slots))
            slots.append(TensorSlot(index=i, name=names[i], shape=tensors[i].shape, dtype=dtype,
                                    bucket=b_index, offset=off, numel=tensors[i].numel()))
            off += tensors[i].numel()
        buckets.append(Bucket(index=b_index, slots=tuple(members), full_offset=full_off,
                              numel=chunk * world_size, chunk=chunk, shard_offset=shard_off, data_numel=data))
        full_off += chunk * world_size
        shard_off += chunk
    return FlatGroup(dtype=dtype, slots=slots, buckets=buckets, world_size=world_size)


def _bucket_runs(indices, tensors, units, cap) -> list[list[int]]:
    """Split consecutive indices into runs of at most ``cap`` elements, never across units."""
    runs: list[list[int]] = []
    cur: list[int] = []
    cur_numel = 0
    for i in indices:
        n = tensors[i].numel()
        if cur and (cur_numel + n > cap or units[i] != units[cur[-1]]):
            runs.append(cur)
            cur, cur_numel = [], 0
        cur.append(i)
        cur_numel += n
    if cur:
        runs.append(cur)
    return runs


def _round_up(x: int, m: int) -> int:
    return ((x + m - 1) // m) * m
