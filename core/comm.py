"""Bucketed, asynchronous collectives over a :class:`~zspeed.core.partition.FlatGroup`.

These free functions are the only communication the ZeRO stages and the
inference streamer need: gather parameter shards into the full buffer, and
reduce-scatter full gradients into shards. Thanks to the bucket-major layout
(see ``[Note: bucket-major layout]`` in partition.py) each bucket is a single
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on contiguous memory.

[Note: comm streams]
On CUDA every collective is issued from a dedicated stream owned by
:class:`CommContext`. The stream first waits on the caller's current stream
(so the inputs are ready), then issues the buckets, and records an event once
they are done. :meth:`CollectiveHandle.wait` makes the *caller's* stream wait
on that event; the host never blocks. Casting gradients to the reduce dtype
and averaging also run on the comm stream, off the compute stream. On gloo the
same code runs with the device handle's no-op streams and events, and where
gloo lacks a collective (older torch) a fallback with the same result is used.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from .partition import Bucket, FlatGroup
from .topology import Topology


# torch 2.13 renamed the single-tensor collectives; 2.11 (the GPU image) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"


# [Note: coalescing]
# Buckets keep every message bounded (and let ZeRO-3 gather one unit at a time),
# but back-to-back NCCL calls each pay a launch and run at their own message
# size's bandwidth. When one call covers several buckets we issue them inside
# torch's coalescing manager, so NCCL runs them as one grouped operation.


class CommContext:
    """The streams collectives are issued on, for one topology."""

    def __init__(self, topo: Topology, *, coalesce: bool = True):
        self.topo = topo
        # Issue the buckets of one call as one coalesced group (one NCCL launch): see [Note: coalescing].
        # (gloo cannot coalesce; on the CPU there is no launch cost to save anyway.)
        self.coalesce = coalesce and topo.device.is_cuda
        dev = topo.device
        # All-gathers get their own stream so the next unit's gather overlaps the current unit's compute.
        self.gather_stream = dev.new_stream()
        # Reduce-scatters get another so gradient reduction overlaps the rest of backward
        # without queueing behind (or in front of) parameter prefetches.
        self.reduce_stream = dev.new_stream()
        self._fallback: dict[str, bool] = {}
        if topo.is_distributed and not dev.is_cuda:
            self._probe_gloo()

    def _probe_gloo(self) -> None:
        """Find, once and on every rank alike, which single-tensor collectives this gloo build lacks."""
        world = self.topo.world_size
        probes = {
            "all_gather_into_tensor": lambda: _all_gather_single(torch.zeros(world), torch.zeros(1),
                                                                 group=self.topo.dp_group),
            "reduce_scatter_tensor": lambda: _reduce_scatter_single(torch.zeros(1), torch.zeros(world),
                                                                    group=self.topo.dp_group),
        }
        for name, probe in probes.items():
            try:
                probe()
            except (RuntimeError, NotImplementedError):
                self.mark_fallback(name)

    def use_fallback(self, name: str) -> bool:
        return self._fallback.get(name, False)

    def mark_fallback(self, name: str) -> None:
        self._fallback[name] = True


@dataclass(eq=False)
class CollectiveHandle:
    """A collective in flight. ``wait()`` orders the caller's stream after it (idempotent)."""

    topo: Topology
    works: list = field(default_factory=list)
    event: object | None = None
    finalizers: list[Callable[[], None]] = field(default_factory=list)
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        for w in self.works:
            if w is not None:
                w.wait()
        if self.event is not None:
            self.event.wait(self.topo.device.current_stream())
        for fn in self.finalizers:
            fn()
        self.done = True

    def is_completed(self) -> bool:
        return self.done or all(w is None or getattr(w, "is_completed", lambda: False)() for w in self.works)


def _buckets(group: FlatGroup, buckets: Sequence[int] | None) -> list[Bucket]:
    if buckets is None:
        return list(group.buckets)
    return [group.buckets[i] for i in buckets]


def _check_sizes(group: FlatGroup, *, full: torch.Tensor, shard: torch.Tensor) -> None:
    if full.numel() != group.full_numel or shard.numel() != group.shard_numel:
        raise ValueError(f"buffer sizes do not match the partition: full {full.numel()} vs {group.full_numel}, "
                         f"shard {shard.numel()} vs {group.shard_numel} ({group})")


def all_gather(group: FlatGroup, *, shard: torch.Tensor, full: torch.Tensor, topo: Topology,
               comm: CommContext | None = None, buckets: Sequence[int] | None = None,
               async_op: bool = True) -> CollectiveHandle:
    """Gather every rank's shard of ``group`` into ``full`` (bucket by bucket).

    ``shard`` and ``full`` must have the group's ``shard_numel`` / ``full_numel``
    elements and the same dtype. With ``buckets`` only those buckets are
    gathered. Returns a handle; with ``async_op=False`` it is already waited.
    """
    _check_sizes(group, full=full, shard=shard)
    handle = CollectiveHandle(topo=topo)
    chosen = _buckets(group, buckets)
    if not topo.is_distributed:
        for b in chosen:
            group.bucket_full(full, b).copy_(group.bucket_shard(shard, b))
        handle.done = True
        return handle
    comm = comm or CommContext(topo)
    _issue(handle, comm, comm.gather_stream,
           lambda: _gather_buckets(group, chosen, shard=shard, full=full, topo=topo, comm=comm, handle=handle))
    if not async_op:
        handle.wait()
    return handle


@contextlib.contextmanager
def _maybe_coalesced(handle: "CollectiveHandle", comm: CommContext, n_ops: int, *, fallback: str):
    """Group the collectives issued inside into one (see [Note: coalescing]); record its work."""
    if n_ops < 2 or not comm.coalesce or comm.use_fallback(fallback):
        yield
        return
    dev = comm.topo.device.device
    first = len(handle.works)
    with _coalescing_manager(group=comm.topo.dp_group, device=dev, async_ops=True) as cm:
        yield
    # Inside the manager each call returns a placeholder work that must not be waited; the group's is cm.
    del handle.works[first:]
    handle.works.append(cm)


def _gather_buckets(group, chosen, *, shard, full, topo, comm, handle) -> None:
    with _maybe_coalesced(handle, comm, len(chosen), fallback="all_gather_into_tensor"):
        _gather_each(group, chosen, shard=shard, full=full, topo=topo, comm=comm, handle=handle)


def _gather_each(group, chosen, *, shard, full, topo, comm, handle) -> None:
    pg = topo.dp_group
    for b in chosen:
        out, inp = group.bucket_full(full, b), group.bucket_shard(shard, b)
        if comm.use_fallback("all_gather_into_tensor"):
            handle.works.append(dist.all_gather(list(out.chunk(topo.world_size)), inp, group=pg, async_op=True))
        else:
            handle.works.append(_all_gather_single(out, inp, group=pg, async_op=True))


def reduce_scatter(group: FlatGroup, *, full: torch.Tensor, shard: torch.Tensor, topo: Topology,
                   op: ReduceOp = ReduceOp.AVG, reduce_dtype: torch.dtype | None = None,
                   accumulate: bool = False, comm: CommContext | None = None,
                   buckets: Sequence[int] | None = None, async_op: bool = True) -> CollectiveHandle:
    """Reduce ``full`` (this rank's full gradients) over ranks into this rank's ``shard``.

    ``op`` is SUM or AVG (average over the data-parallel world). With
    ``reduce_dtype`` the reduction runs in that dtype (e.g. fp32 for bf16
    gradients) and the result is cast to ``shard``'s dtype. With
    ``accumulate`` the result is added to ``shard`` instead of overwriting it
    (gradient accumulation across micro-batches on sharded gradients).
    ``full`` may be overwritten (it is the send buffer).
    """
    _check_sizes(group, full=full, shard=shard)
    handle = CollectiveHandle(topo=topo)
    chosen = _buckets(group, buckets)
    comm = comm or (CommContext(topo) if topo.is_distributed else None)
    stream = comm.reduce_stream if comm else topo.device.current_stream()
    _issue(handle, comm, stream, lambda: _reduce_buckets(
        group, chosen, full=full, shard=shard, topo=topo, comm=comm, handle=handle, op=op,
        reduce_dtype=reduce_dtype or full.dtype, accumulate=accumulate))
    if not async_op:
        handle.wait()
    return handle


def _reduce_buckets(group, chosen, *, full, shard, topo, comm, handle, op, reduce_dtype, accumulate) -> None:
    if comm is None:
        _reduce_each(group, chosen, full=full, shard=shard, topo=topo, comm=comm, handle=handle, op=op,
                     reduce_dtype=reduce_dtype, accumulate=accumulate)
        return
    pieces = any(full.dtype != reduce_dtype and b.chunk > CAST_PIECE_NUMEL for b in chosen)
    with _maybe_coalesced(handle, comm, 0 if pieces else len(chosen), fallback="reduce_scatter_tensor"):
        _reduce_each(group, chosen, full=full, shard=shard, topo=topo, comm=comm, handle=handle, op=op,
                     reduce_dtype=reduce_dtype, accumulate=accumulate)


# [Note: cast in pieces]
# Reducing 16-bit gradients in fp32 needs an fp32 send buffer. For a large
# bucket (a 65M-element lm_head, say) a whole-bucket copy costs ~4 bytes per
# element right where activation memory peaks, at the start of backward. Such
# buckets are reduced in pieces instead: piece j gathers element range j of
# every rank's chunk into one contiguous fp32 buffer (the cast copy needed
# anyway), so the transient is world x CAST_PIECE_NUMEL elements whatever the
# bucket's size. Pieces are not coalesced: each send buffer dies with its op.
# 4M elements: 1M measured the same ZeRO-2 peak on the 1.1B benchmark (so the peak is not here) and
# cost 12 % of step time in per-piece launches (benchmarks/RESULTS.md).
CAST_PIECE_NUMEL = 1 << 22


def _exact_in(reduce_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether values of ``dtype`` survive a round trip through ``reduce_dtype`` unchanged."""
    return reduce_dtype == dtype or (reduce_dtype in (torch.float32, torch.float64)
                                     and dtype in (torch.bfloat16, torch.float16, torch.float32))


# [Note: one rank] Over one rank a reduction is the identity (SUM, and AVG divides by 1), so when the reduce dtype
# holds the gradients' values exactly the result is ``full`` itself, added to or copied into the shard with no
# send buffer: bit for bit what the general path computes (cast up, divide by 1, copy, cast back), without its
# transients (at one rank the general path's whole-bucket fp32 copies of a 525M-element embedding bucket were
# 4.2 GB alive at an 8B model's peak: benchmarks/RESULTS.md, offload run 24).


def _reduce_each(group, chosen, *, full, shard, topo, comm, handle, op, reduce_dtype, accumulate) -> None:
    for b in chosen:
        send = group.bucket_full(full, b)
        out = group.bucket_shard(shard, b)
        if topo.world_size == 1 and _exact_in(reduce_dtype, send.dtype):  # [Note: one rank]
            if accumulate:
                out.add_(send.to(out.dtype))  # (rounded first, as the general path's store rounds)
            else:
                out.copy_(send)
            continue
        if send.dtype != reduce_dtype and b.chunk > CAST_PIECE_NUMEL and topo.is_distributed:
            for lo in range(0, b.chunk, CAST_PIECE_NUMEL):
                hi = min(b.chunk, lo + CAST_PIECE_NUMEL)
                piece = torch.cat([c[lo:hi] for c in send.chunk(topo.world_size)]).to(reduce_dtype)
                work, store = _reduce_one(piece, out[lo:hi], topo=topo, comm=comm, op=op, accumulate=accumulate)
                # Waiting here only orders the comm stream after the op (the host does not block on
                # CUDA); it lets this piece's buffers be reused by the next one.
                if work is not None:
                    work.wait()
                if store is not None:
                    store()
            continue
        work, store = _reduce_one(send if send.dtype == reduce_dtype else send.to(reduce_dtype), out, topo=topo,
                                  comm=comm, op=op, accumulate=accumulate)
        handle.works.append(work)
        if store is not None:
            handle.finalizers.append(store)


def _reduce_one(send, out, *, topo, comm, op, accumulate):
    """Reduce-scatter one contiguous send buffer (already in the reduce dtype) into ``out``.

    Returns ``(work, store)``: the collective's work (None when already done) and
    the function that moves the result into ``out`` once it is (None if it landed there).
    """
    world = topo.world_size
    if op is ReduceOp.AVG:
        # Pre-divide: keeps bf16/fp16 sums in range, and gloo has no native AVG on older torch.
        send.div_(world)
    recv = out if (out.dtype == send.dtype and not accumulate) else torch.empty_like(out, dtype=send.dtype)
    if world > 1:
        work = _reduce_scatter_one(recv, send, topo=topo, comm=comm)
    else:
        recv.copy_(send)
        work = None
    return work, (None if recv is out else _make_store(out, recv, accumulate))


def _make_store(out: torch.Tensor, recv: torch.Tensor, accumulate: bool) -> Callable[[], None]:
    def store() -> None:
        if accumulate:
            out.add_(recv.to(out.dtype))
        else:
            out.copy_(recv)
    return store


def _reduce_scatter_one(recv: torch.Tensor, send: torch.Tensor, *, topo: Topology, comm: CommContext):
    pg = topo.dp_group
    if not comm.use_fallback("reduce_scatter_tensor"):
        return _reduce_scatter_single(recv, send, op=dist.ReduceOp.SUM, group=pg, async_op=True)
    # Fallback for backends without reduce-scatter: all-reduce, then keep our chunk.
    work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=pg, async_op=True)
    work.wait()
    recv.copy_(send.chunk(topo.world_size)[topo.rank])
    return None


def _issue(handle: CollectiveHandle, comm: CommContext | None, stream, body: Callable[[], None]) -> None:
    """Run ``body`` on ``stream`` after the caller's stream; record the completion event."""
    dev = handle.topo.device
    if not dev.is_cuda:
        body()
        return
    caller = dev.current_stream()
    stream.wait_stream(caller)
    with dev.use_stream(stream):
        body()
        # Make the comm stream wait for NCCL's internal stream, then mark the end of the collective.
        for w in handle.works:
            if w is not None:
                w.wait()
        handle.works = []
        handle.event = dev.new_event()
        handle.event.record(stream)
    # Finalizers (casts/accumulation) also belong on the comm stream.
    if handle.finalizers:
        fns, handle.finalizers = handle.finalizers, []

        def run_on_stream() -> None:
            with dev.use_stream(stream):
                stream.wait_event(handle.event)
                for fn in fns:
                    fn()
                handle.event.record(stream)
        run_on_stream()


def all_reduce(tensor: torch.Tensor, *, topo: Topology, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Synchronous all-reduce of a small tensor in place (norms, overflow flags)."""
    if topo.is_distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=topo.dp_group)
        if op is ReduceOp.AVG:
            tensor.div_(topo.world_size)
    return tensor


def all_reduce_max(tensor: torch.Tensor, *, topo: Topology) -> torch.Tensor:
    if topo.is_distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=topo.dp_group)
    return tensor
