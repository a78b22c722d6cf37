"""Streamer: keep at most K units of a model resident on the device, prefetching ahead.

Both ZeRO-3 parameter offload (units = modules in execution order, forward
then backward) and ZeRO-Inference (units = layers) drive this one class; see
DESIGN.md, "One mechanism, two policies".

[Note: prefetch and eviction]
The streamer knows the access order (default ``0..n-1``, cyclic: after the
last position it continues at the first, as the next step or token does).
After ``acquire(i)`` at position p, and after each ``release``, it makes sure
the next K distinct units from the cursor are resident or loading, taking for
each either a free slot or the slot of a RELEASED unit whose next use is
later than the one being loaded (Belady's rule), and stopping at the first
unit it cannot place so loads stay in order. A RELEASED unit keeps its bytes
until its slot is taken, so acquiring it again costs nothing. An acquire of a
unit that is not resident loads it on demand, evicting a RELEASED or else a
not-yet-used RESIDENT unit; with all K slots IN_USE it raises.
Transfers: see [Note: streamer pipeline] in :mod:`zspeed.core.stream_loader`.
"""
from __future__ import annotations

import bisect
import enum
import math
import operator
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from .buffer_pool import DeviceSlot, SlotPool, UnitLayout, plan_layout
from .device import DeviceHandle
from .stream_loader import Loader, LoadJob
from .store import TensorStore, Tier


class UnitState(enum.Enum):
    """Where a unit stands; every state but EMPTY holds one of the K slots."""

    EMPTY = "empty"  # no slot
    LOADING = "loading"  # slot taken, bytes on their way
    RESIDENT = "resident"  # loaded (copy enqueued), not yet acquired
    IN_USE = "in_use"  # acquired and not yet released
    RELEASED = "released"  # used and released; bytes still valid until the slot is taken


class StreamerError(RuntimeError):
    """A unit could not be made resident (its load failed, or no slot can hold it)."""


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """One unit: a name (for messages) and the store keys of its tensors."""

    name: str
    tensor_keys: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensor_keys", tuple(self.tensor_keys))
        if len(set(self.tensor_keys)) != len(self.tensor_keys):
            raise ValueError(f"unit {self.name!r} lists a tensor key twice")


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamerConfig:
    """How a :class:`Streamer` moves units.

    window: K, the number of device slots (the most units resident at once).
    prefetch: load the next units of the access order ahead of ``acquire``.
    cyclic: the access order repeats (prefetch wraps from its end to its start).
    staging_buffers: pinned staging buffers for DISK -> device (2 = double buffering).
    stage_disk_reads: read DISK units into the staging buffers, then copy to the
        slot (``None``: when the device is CUDA; on the CPU reads can land in
        the slot directly, ``True`` forces the CUDA path there, e.g. in tests).
    alignment: byte alignment of each tensor inside a slot (raised to the
        store's alignment for DISK stores so O_DIRECT reads land in place, and
        for units the store packed so they move in one copy).
    timeout_s: ``acquire`` raises rather than waiting longer than this.
    """

    window: int = 2
    prefetch: bool = True
    cyclic: bool = True
    staging_buffers: int = 2
    stage_disk_reads: bool | None = None
    alignment: int = 256
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"StreamerConfig.window={self.window}: use at least 1 (2 or more to overlap)")
        if self.staging_buffers < 1:
            raise ValueError(f"StreamerConfig.staging_buffers={self.staging_buffers}: use at least 1 (2 overlaps)")
        if self.alignment < 16 or self.alignment & (self.alignment - 1):
            raise ValueError(f"StreamerConfig.alignment={self.alignment}: use a power of two >= 16")
        if self.timeout_s <= 0:
            raise ValueError(f"StreamerConfig.timeout_s={self.timeout_s}: use a positive number of seconds")


@dataclass(frozen=True, slots=True)
class StreamerStats:
    """Counters since construction.

    bytes_moved: tensor bytes loaded into slots (alignment padding excluded).
    stall_seconds: time the consumer waited inside ``acquire``.
    acquires_ready: acquires that found their unit already loaded (RESIDENT or
        RELEASED: on CUDA, its copy already enqueued), so ``acquire`` did not
        wait for the loader; in steady state every acquire should be one.
    read_seconds / copy_seconds: time spent reading from the store and copying
        to the device (device-timed on CUDA); ``transfer_seconds`` is their sum,
        so with overlapping stages ``achieved_gbps`` is a lower bound.
    """

    acquires: int
    units_loaded: int
    bytes_moved: int
    stall_seconds: float
    read_seconds: float
    copy_seconds: float
    acquires_ready: int = 0

    @property
    def transfer_seconds(self) -> float:
        return self.read_seconds + self.copy_seconds

    @property
    def achieved_gbps(self) -> float:
        return self.bytes_moved / self.transfer_seconds / 1e9 if self.transfer_seconds > 0 else 0.0


@dataclass(eq=False)
class _Unit:
    index: int
    spec: UnitSpec
    layout: UnitLayout
    state: UnitState = UnitState.EMPTY
    slot: DeviceSlot | None = None
    users: int = 0
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def label(self) -> str:
        return f"unit {self.spec.name!r} (index {self.index})"


class Streamer:
    """Streams units of tensors from a :class:`TensorStore` into K device slots.

    ``acquire(i)`` blocks until unit i is resident, makes the current stream
    wait for its copy, starts prefetching the units that follow in the access
    order, and returns ``{store key: tensor}`` views into the unit's slot
    (valid until ``release(i)``). ``run(order)`` iterates and releases for you.
    At most ``config.window`` units are ever resident (``max_resident_seen``).
    A failed load raises :class:`StreamerError` naming the unit in ``acquire``;
    a load that takes longer than ``config.timeout_s`` raises ``TimeoutError``.

    Changing stored tensors: ``writeback(i)`` writes an acquired unit's
    (modified) tensors back to the store; after changing keys with
    ``store.put`` call ``invalidate()`` so stale resident copies are dropped.
    Shapes and dtypes are fixed when the streamer is built.
    One consumer thread is expected. Design: [Note: prefetch and eviction],
    [Note: streamer pipeline], [Note: one layout, two buffers].
    """

    def __init__(self, *, units: Sequence[UnitSpec], store: TensorStore, device: DeviceHandle,
                 config: StreamerConfig = StreamerConfig(), order: Sequence[int] | None = None):
        if not units:
            raise ValueError("Streamer needs at least one unit")
        self.config, self.store, self.device = config, store, device
        alignment = max(config.alignment, store.alignment) if store.tier is Tier.DISK else config.alignment
        self._units = [_Unit(i, s, self._plan(s, alignment)) for i, s in enumerate(units)]
        span = max(u.layout.span for u in self._units) or alignment
        self._slots = SlotPool(device=device, window=config.window, slot_bytes=span, alignment=alignment)
        self._cond = threading.Condition()
        self._closed = False
        self._counters = {"acquires": 0, "acquires_ready": 0, "units_loaded": 0, "bytes_moved": 0, "stall": 0.0}
        self.max_resident_seen = 0
        self.set_order(range(len(units)) if order is None else order)
        staged = store.tier is Tier.DISK and (device.is_cuda if config.stage_disk_reads is None
                                              else config.stage_disk_reads)
        self._loader = Loader(store=store, device=device, staged=staged, staging_bytes=span,
                              staging_count=config.staging_buffers, on_done=self._on_loaded)

    def _plan(self, spec: UnitSpec, alignment: int) -> UnitLayout:
        missing = [k for k in spec.tensor_keys if k not in self.store]
        if missing:
            raise KeyError(f"unit {spec.name!r}: keys {missing[:5]} are not in the store; put them first")
        if spec.tensor_keys and self.store.packed_buffer(spec.tensor_keys[0]) is not None:
            alignment = max(alignment, self.store.alignment)  # the pack's layout: one copy per unit
        return plan_layout([(k, self.store.meta(k)) for k in spec.tensor_keys], alignment=alignment)

    # -- facts -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._units)

    def state(self, i: int) -> UnitState:
        return self._unit(i).state

    @property
    def resident_count(self) -> int:
        """Units holding a slot now (LOADING, RESIDENT, IN_USE or RELEASED)."""
        return self._slots.occupied

    @property
    def slot_bytes(self) -> int:
        """Device bytes held by the K slots."""
        return self._slots.nbytes

    @property
    def stats(self) -> StreamerStats:
        c = self._counters
        return StreamerStats(acquires=c["acquires"], units_loaded=c["units_loaded"], bytes_moved=c["bytes_moved"],
                             stall_seconds=c["stall"], read_seconds=self._loader.read_seconds,
                             copy_seconds=self._loader.copy_seconds(), acquires_ready=c["acquires_ready"])

    # -- lifecycle: order ------------------------------------------------------
    def set_order(self, order: Iterable[int]) -> None:
        """Set the access order prefetch follows (e.g. ``[*range(n), *reversed(range(n))]``)."""
        order = [self._unit(i).index for i in order]
        if not order:
            raise ValueError("the access order is empty; give at least one unit index")
        with self._cond:
            self._order = order
            self._positions: dict[int, list[int]] = {}
            for pos, i in enumerate(order):
                self._positions.setdefault(i, []).append(pos)
            self._cursor = 0

    # -- lifecycle: acquire / release -------------------------------------------
    def acquire(self, i: int) -> dict[str, torch.Tensor]:
        """Block until unit ``i`` is resident; return its tensors (views into its slot)."""
        unit = self._unit(i)
        start = time.perf_counter()
        with self._cond:
            self._check_open()
            pos = self._advance_cursor(unit.index)
            self._counters["acquires_ready"] += unit.state in (UnitState.RESIDENT, UnitState.RELEASED)
            if unit.state is UnitState.EMPTY:
                self._load_on_demand(unit, deadline=start + self.config.timeout_s)
            unit.users += 1
            self._counters["acquires"] += 1
            self._prefetch(self._cursor if pos is None else pos)
        try:
            self._wait_ready(unit, deadline=start + self.config.timeout_s)
        finally:
            self._counters["stall"] += time.perf_counter() - start
        return unit.layout.views(unit.slot.buffer)

    def release(self, i: int) -> None:
        """Give unit ``i`` back; its slot may be reused once the current stream is past its use."""
        unit = self._unit(i)
        with self._cond:
            if unit.state is not UnitState.IN_USE:
                raise StreamerError(f"release of {unit.label()} which is {unit.state.value}, not in use")
            unit.slot.free_event.record(self.device.current_stream())
            self._unpin(unit)
            self._prefetch(self._cursor)

    def run(self, order: Iterable[int] | None = None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield ``(i, tensors)`` for each unit of ``order`` (default: the current order), releasing after each."""
        if order is not None:
            self.set_order(order)
        for i in list(self._order):
            tensors = self.acquire(i)
            try:
                yield i, tensors
            finally:
                self.release(i)

    # -- lifecycle: changing stored tensors -------------------------------------
    def writeback(self, i: int) -> "Future[None]":
        """Write acquired unit ``i``'s tensors back to the store.

        Synchronises the current stream once (so the consumer's writes are
        complete), then puts each tensor asynchronously; the unit keeps its slot
        until the returned future completes, even if released earlier. Meant for
        checkpoints and write-back after an update, not the per-layer hot path.
        """
        unit = self._unit(i)
        with self._cond:
            if unit.state is not UnitState.IN_USE:
                raise StreamerError(f"writeback of {unit.label()} which is {unit.state.value}; acquire it first")
            unit.users += 1
        self.device.current_stream().synchronize()
        views = unit.layout.views(unit.slot.buffer)
        puts = [self.store.put_async(key, t) for key, t in views.items()]
        return _gather(puts, on_done=lambda: self._finish_writeback(unit))

    def invalidate(self, indices: Iterable[int] | None = None) -> None:
        """Drop resident copies of these units (default: all) so the next acquire reloads them."""
        units = self._units if indices is None else [self._unit(i) for i in indices]
        with self._cond:
            busy = [u.label() for u in units if u.users]
            if busy:
                raise StreamerError(f"cannot invalidate {', '.join(busy)} while in use; release first")
            for unit in units:
                self._wait_loaded(unit, deadline=time.perf_counter() + self.config.timeout_s)
                if unit.slot is not None:
                    self._evict(unit)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._loader.close(timeout=self.config.timeout_s)

    def __enter__(self) -> "Streamer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals: order --------------------------------------------------------
    def _unit(self, i: int) -> _Unit:
        index = operator.index(i)
        if not 0 <= index < len(self._units):
            raise IndexError(f"unit index {i!r} out of range: the streamer has {len(self._units)} units")
        return self._units[index]

    def _advance_cursor(self, i: int) -> int | None:
        """The position of this access of unit ``i`` (next occurrence from the cursor); moves the cursor."""
        positions = self._positions.get(i)
        if not positions:
            return None
        k = bisect.bisect_left(positions, self._cursor)
        pos = positions[k] if k < len(positions) else positions[0]
        self._cursor = pos + 1
        if self._cursor == len(self._order) and self.config.cyclic:
            self._cursor = 0
        return pos

    def _distance(self, unit: _Unit, start: int) -> float:
        """Positions from ``start`` to the next use of ``unit`` (inf if never)."""
        positions = self._positions.get(unit.index)
        if not positions:
            return math.inf
        k = bisect.bisect_left(positions, start)
        if k < len(positions):
            return positions[k] - start
        return positions[0] + len(self._order) - start if self.config.cyclic else math.inf

    def _upcoming(self, start: int) -> list[_Unit]:
        """The next K distinct units of the order from position ``start``."""
        n = len(self._order)
        stop = start + n if self.config.cyclic else n
        seen: dict[int, _Unit] = {}
        for pos in range(start, stop):
            seen.setdefault(self._order[pos % n], self._units[self._order[pos % n]])
            if len(seen) == self.config.window:
                break
        return list(seen.values())

    # -- internals: slots (called with the lock held) ---------------------------
    def _prefetch(self, start: int) -> None:
        if not self.config.prefetch or self._closed:
            return
        for unit in self._upcoming(start):
            if unit.state is not UnitState.EMPTY:
                continue
            slot = self._slots.free_slot() or self._take_released(start, closer_than=self._distance(unit, start))
            if slot is None:
                return
            self._start_load(unit, slot)

    def _take_released(self, start: int, *, closer_than: float) -> DeviceSlot | None:
        """Evict the RELEASED unit used furthest in the future, if later than ``closer_than``."""
        released = [u for u in self._holders() if u.state is UnitState.RELEASED and not u.users]
        if not released:
            return None
        victim = max(released, key=lambda u: self._distance(u, start))
        if self._distance(victim, start) <= closer_than:
            return None
        return self._evict(victim)

    def _load_on_demand(self, unit: _Unit, *, deadline: float) -> None:
        """Find a slot for ``unit`` now (waiting for loads in flight if need be) and start its load."""
        while True:
            slot = self._slots.free_slot() or self._take_any(UnitState.RELEASED) or self._take_any(UnitState.RESIDENT)
            if slot is not None:
                return self._start_load(unit, slot)
            if not any(u.state is UnitState.LOADING for u in self._holders()):
                raise StreamerError(f"no slot for {unit.label()}: all {self.config.window} slots hold units in "
                                    "use; release one first or raise StreamerConfig.window")
            if not self._cond.wait(timeout=max(deadline - time.perf_counter(), 0)):
                raise TimeoutError(f"{unit.label()}: no slot came free within {self.config.timeout_s}s")

    def _take_any(self, state: UnitState) -> DeviceSlot | None:
        candidates = [u for u in self._holders() if u.state is state and not u.users]
        if not candidates:
            return None
        return self._evict(max(candidates, key=lambda u: self._distance(u, self._cursor)))

    def _holders(self) -> list[_Unit]:
        return [self._units[s.unit] for s in self._slots.slots if s.unit is not None]

    def _start_load(self, unit: _Unit, slot: DeviceSlot) -> None:
        unit.state, unit.slot, unit.error = UnitState.LOADING, slot, None
        slot.unit = unit.index
        unit.ready.clear()
        self.max_resident_seen = max(self.max_resident_seen, self._slots.occupied)
        assert self._slots.occupied <= self.config.window
        self._loader.submit(LoadJob(unit.index, unit.layout, slot))

    def _evict(self, unit: _Unit) -> DeviceSlot:
        slot, unit.slot = unit.slot, None
        slot.unit = None
        unit.state = UnitState.EMPTY
        return slot

    def _unpin(self, unit: _Unit) -> None:
        unit.users -= 1
        if unit.users == 0:
            unit.state = UnitState.RELEASED
            self._cond.notify_all()

    # -- internals: completion -----------------------------------------------------
    def _on_loaded(self, job: LoadJob, error: BaseException | None) -> None:
        """Called by the loader thread when a job ends."""
        unit = self._units[job.unit]
        with self._cond:
            if error is None:
                unit.state = UnitState.RESIDENT
                self._counters["units_loaded"] += 1
                self._counters["bytes_moved"] += unit.layout.payload_bytes
            else:
                unit.error = error
                self._evict(unit)
            unit.ready.set()
            self._cond.notify_all()

    def _wait_ready(self, unit: _Unit, *, deadline: float) -> None:
        if not unit.ready.wait(timeout=max(deadline - time.perf_counter(), 0)):
            with self._cond:
                unit.users -= 1
            raise TimeoutError(f"{unit.label()} did not arrive within {self.config.timeout_s}s")
        with self._cond:
            if unit.error is not None:
                unit.users -= 1
                error, unit.error = unit.error, None
                raise StreamerError(f"{unit.label()} failed to load: {error}") from error
            unit.state = UnitState.IN_USE
            self.device.current_stream().wait_event(unit.slot.ready_event)

    def _wait_loaded(self, unit: _Unit, *, deadline: float) -> None:
        while unit.state is UnitState.LOADING:
            if not self._cond.wait(timeout=max(deadline - time.perf_counter(), 0)):
                raise TimeoutError(f"{unit.label()} still loading after {self.config.timeout_s}s")

    def _finish_writeback(self, unit: _Unit) -> None:
        with self._cond:
            self._unpin(unit)

    def _check_open(self) -> None:
        if self._closed:
            raise StreamerError("the streamer is closed")


def _gather(futures: list[Future], *, on_done) -> "Future[None]":
    """A future that completes when all ``futures`` have; it carries the first error."""
    result: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            on_done()
            error = next((f.exception() for f in futures if f.exception() is not None), None)
            result.set_exception(error) if error is not None else result.set_result(None)

    if not futures:
        on_done()
        result.set_result(None)
    for f in futures:
        f.add_done_callback(one_done)
    return result
