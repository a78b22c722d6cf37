"""The streamer's transfer pipeline: one thread that moves units into device slots.

[Note: streamer pipeline]
Jobs (unit -> slot) are handled in order by one loader thread:

    DISK store, CUDA device:  store thread pool reads every tensor of the unit
        (O_DIRECT) into a pinned staging buffer -> one non-blocking copy of the
        whole span staging -> slot on the copy stream -> ready_event.
    DISK store, CPU device:   the reads land straight in the slot (unless
        ``stage_disk_reads`` forces the staged path).
    CPU/DEVICE store:         one non-blocking copy of the whole span when the
        store packed the unit (``put_group``, [Note: packed groups]) at the
        slot's offsets, else per-tensor copies from the store's (pinned)
        tensors, on the copy stream -> ready_event.

Two threads form a pipeline: the *reader* takes a staging buffer and
submits the unit's reads to the store's pool, then hands the job to the
*copier*, which waits for those reads and enqueues the copy. So with two
staging buffers the reads of unit n+1 are already in flight while unit n's
last reads and checksums finish and its copy runs: the disk never idles
between units (measured: without this, disk streaming reached 75% of dd).
The reader blocks on the host only to reuse a staging buffer (its previous
copy's event); the consumer never waits for a copy on the host, only its
stream does (``wait_event(ready_event)`` in ``acquire``).
Before overwriting a slot the copy stream waits on the slot's ``free_event``,
recorded by the consumer's stream at ``release``.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Callable

from .buffer_pool import DeviceSlot, UnitLayout
from .device import DeviceHandle
from .pinned_pool import aligned_empty
from .store import TensorStore, Tier


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Move unit ``unit`` (laid out by ``layout``) into ``slot``."""

    unit: int
    layout: UnitLayout
    slot: DeviceSlot


@dataclass(eq=False)
class _Staging:
    buffer: object  # flat pinned uint8 tensor
    event: object  # recorded after the last copy out of ``buffer``


@dataclass(eq=False)
class _Pending:
    """A job whose reads were submitted by the reader, for the copier to finish."""

    job: LoadJob
    staging: _Staging | None = None
    reads: list[Future] = field(default_factory=list)
    started: float = 0.0
    error: BaseException | None = None


class Loader:
    """Runs :class:`LoadJob`s on a background thread; reports each to ``on_done(job, error)``."""

    def __init__(self, *, store: TensorStore, device: DeviceHandle, staged: bool, staging_bytes: int,
                 staging_count: int, on_done: Callable[[LoadJob, BaseException | None], None]):
        self.store, self.device, self.on_done = store, device, on_done
        # The copy stream: host->device copies run here so they overlap the
        # consumer's compute on its own stream (see [Note: streamer pipeline]).
        self.copy_stream = device.new_stream()
        self.staged = staged
        self._staging: queue.Queue[_Staging] = queue.Queue()
        for _ in range(staging_count if self.staged else 0):
            buf = aligned_empty(staging_bytes, alignment=store.alignment, device=device, pinned=True)
            self._staging.put(_Staging(buf, device.new_event()))
        self._jobs: queue.Queue[LoadJob | None] = queue.Queue()
        self._pending: queue.Queue[_Pending | None] = queue.Queue()
        self._lock = threading.Lock()
        self.read_seconds = 0.0
        self._timings: list[tuple[object, object]] = []
        self._copy_total = 0.0
        self._reader = threading.Thread(target=self._run_reader, name="zspeed-streamer-reader", daemon=True)
        self._copier = threading.Thread(target=self._run_copier, name="zspeed-streamer-copier", daemon=True)
        self._reader.start()
        self._copier.start()

    # -- lifecycle -------------------------------------------------------------
    def submit(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued jobs, stop both threads, and wait for the copies in flight."""
        self._jobs.put(None)
        self._reader.join(timeout)
        self._copier.join(timeout)
        self.copy_stream.synchronize()  # the slots may be freed next; no copy may still write them

    def copy_seconds(self) -> float:
        """Seconds the copies took (device-timed on CUDA); waits for pending copies."""
        return self._fold_timings(block=True)

    def _fold_timings(self, *, block: bool) -> float:
        """Add finished (all, if ``block``) copy timings to the total, keeping the list short."""
        with self._lock:
            pending, self._timings = self._timings, []
            for start, end in pending:
                if block or end.query():
                    self._copy_total += self.device.elapsed_seconds(start, end)
                else:
                    self._timings.append((start, end))
            return self._copy_total

    # -- the threads -----------------------------------------------------------
    def _run_reader(self) -> None:
        self.device.set_current()
        while (job := self._jobs.get()) is not None:
            pending = _Pending(job)
            try:
                self._start(pending)
            except BaseException as e:  # reported to the consumer's acquire, never swallowed
                pending.error = e
            self._pending.put(pending)
        self._pending.put(None)

    def _run_copier(self) -> None:
        self.device.set_current()
        while (pending := self._pending.get()) is not None:
            try:
                self._finish(pending)
            except BaseException as e:  # reported to the consumer's acquire, never swallowed
                pending.error = pending.error or e
            finally:
                if pending.staging is not None:
                    self._staging.put(pending.staging)
            self.on_done(pending.job, pending.error)

    def _start(self, pending: _Pending) -> None:
        """Reader side: submit the unit's reads (DISK); memory tiers have nothing to read."""
        job = pending.job
        if self.store.tier is not Tier.DISK:
            return
        target = job.slot.buffer
        if self.staged:
            pending.staging = self._staging.get()
            pending.staging.event.synchronize()  # its previous copy must finish before we overwrite it
            target = pending.staging.buffer
        pending.started = time.perf_counter()
        pending.reads = [self.store.get_async(p.key, out=p.view(target)) for p in job.layout.places]

    def _finish(self, pending: _Pending) -> None:
        """Copier side: wait for the reads, then copy the unit into its slot."""
        job = pending.job
        if pending.reads:
            wait(pending.reads)  # all of them, so none still writes into the buffer when we go on
            with self._lock:
                self.read_seconds += time.perf_counter() - pending.started
            for f in pending.reads:
                f.result()
        if pending.error is not None:
            return
        if self.store.tier is not Tier.DISK:
            self._copy_from_memory(job)
        elif pending.staging is not None:
            span, staging = job.layout.span, pending.staging
            self._copy(job.slot, lambda: job.slot.buffer[:span].copy_(staging.buffer[:span], non_blocking=True))
            staging.event.record(self.copy_stream)

    def _copy_from_memory(self, job: LoadJob) -> None:
        sources = [(p, self.store.peek(p.key)) for p in job.layout.places]
        for place, src in sources:
            if not place.meta.matches(src):
                raise ValueError(f"key {place.key!r} is now {tuple(src.shape)} {src.dtype}; the streamer "
                                 f"planned {place.meta.shape} {place.meta.dtype} (rebuild the streamer)")

        packed = _packed_source(self.store, job.layout, sources)
        if packed is not None:
            span = job.layout.span
            self._copy(job.slot, lambda: self._copy_one(job.slot.buffer[:span], packed[:span]))
            return

        def copies() -> None:
            for place, src in sources:
                place.view(job.slot.buffer).copy_(src, non_blocking=True)
                self.device.record_stream(src, self.copy_stream)  # a DEVICE-tier source may be replaced meanwhile

        self._copy(job.slot, copies)

    def _copy_one(self, dst, src) -> None:
        dst.copy_(src, non_blocking=True)
        self.device.record_stream(src, self.copy_stream)

    def _copy(self, slot: DeviceSlot, copies: Callable[[], None]) -> None:
        """Run ``copies`` on the copy stream after the slot is free; mark the slot ready."""
        start, end = self.device.new_event(timing=True), self.device.new_event(timing=True)
        with self.device.use_stream(self.copy_stream):
            self.copy_stream.wait_event(slot.free_event)
            start.record(self.copy_stream)
            copies()
            end.record(self.copy_stream)
            slot.ready_event.record(self.copy_stream)
        with self._lock:
            self._timings.append((start, end))
        if len(self._timings) > 64:
            self._fold_timings(block=False)


def _packed_source(store: TensorStore, layout: UnitLayout, sources) -> object | None:
    """The store's flat buffer holding the unit at exactly the slot layout's offsets, or None."""
    if not layout.places:
        return None
    flat = store.packed_buffer(layout.places[0].key)
    if flat is None or flat.numel() < layout.span:
        return None
    base = flat.data_ptr()
    if all(src.data_ptr() - base == place.offset for place, src in sources if place.meta.nbytes):
        return flat
    return None
