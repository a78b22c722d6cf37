"""The streamed device update: fused Adam(W) steps on the device for masters and moments that live on the host.

:class:`~zspeed.train.offload.OptimizerOffload` hands a share of its groups
(``offload_optimizer.device_share``) to a :class:`StreamedAdam` instead of the
CPU worker; see [Note: the streamed device update].

[Note: the streamed device update]
The host update is bound by the host: 28 bytes of memory traffic per element
through as many cores as the machine has (1.1 B parameters: ~0.45 s on 16
cores, while the GPU's whole forward and backward take ~0.18 s). The GPU is idle
meanwhile and the PCIe link nearly so (2 bytes per element each way). This
object runs the update of some groups on the device instead, with their fp32
master, exp_avg and exp_avg_sq still living on the host (pinned): chunk by
chunk, the three arrays go up on their own H2D stream into one of a few device
slots, the device casts and scales the chunk's gradient (which never left the
device) and runs torch's fused kernel on the slot, writes the 16-bit result
straight into the group's parameters, and the three arrays go back down on
their own D2H stream. So an element streamed this way costs 12 bytes each way
on the link, no core time, and the device's own memory is only the slots
(``slots × chunk × 16`` bytes), never a resident copy of the state: that is
the difference from keeping part of the state on the GPU (DeepSpeed's
"twin-flow" ``ratio``), which costs 12 bytes of device memory per element.
The host's CPU update of the other groups runs at the same time, so the step
takes max(host share / host rate, device share / link rate) instead of the
whole model at the host rate.

Slots are used round robin; a slot's next upload waits for its last download
(an event), the kernel waits for the upload, the download for the kernel. The
first upload of a step waits for the last download of the step before (stream
order on the D2H stream, then an event), so the host arrays are never read
half-written; anything on the host that reads them (checkpoints, exports) calls
:meth:`StreamedAdam.wait` first.

[Note: prefetching the state during backward]
With clipping nothing can be updated before the global norm, i.e. before
backward ends; but uploading a streamed group's state does not depend on the
norm, and during backward the link's host-to-device direction is idle while
backward frees the forward's activations. So each time a gradient is sent
(during backward on CUDA), :class:`~zspeed.train.offload.OptimizerOffload`
asks this object to upload whole chunks of the streamed groups' state, in the
order the update will take them, into fresh device buffers, within a budget:
the process's peak so far (reached by the forward, at the loss) less what is
allocated now, less a margin for what backward still allocates
(``PREFETCH_MARGIN``). So prefetching should not raise the peak the forward
set (the benchmark's peak memory checks it). :meth:`StreamedAdam.update` then
computes on a prefetched chunk without uploading it, and its buffers go back
to the allocator once the chunk's download has run. The uploads wait for the
last step's downloads (the host arrays are whole again); a skipped step (fp16
overflow) drops them, and so does loading a checkpoint over them.

Only ``prefetch_depth`` chunks are on their way at once (the next ones are
queued by later gradients' hooks, as earlier uploads complete), so prefetching
ends about when backward does. Queued all at once (measured on an H100, ~5 GB
for 0.8 B elements), the uploads outlasted backward by ~70 ms, and the host
groups' new parameters, uploaded after their CPU update, waited behind them:
the step got slower although the device part's state was ready earlier. With
16 in flight the same step went from 394 ms (no prefetch) to 360 ms, ~600 M of
its 835 M streamed elements uploaded during backward (benchmarks/RESULTS.md,
session 8).

[Note: resident state (Twin-Flow)]
DeepSpeed's ``offload_optimizer.ratio`` (its "Twin-Flow") keeps ``1 - ratio`` of
the optimizer state on the GPU and offloads the rest. Here those groups are
streamed groups whose chunks, once uploaded, stay in device memory: each
step's :meth:`StreamedAdam.update` computes on them in place and downloads
nothing, so they cost 12 bytes of device memory per element and none of the
link. Where the link is the bound (stage 3 with every rank streaming its
shard over its own link) that is the lever: memory a run has spare under the
peak it may not raise buys link time. The host arrays stay allocated but
fall behind: :meth:`StreamedAdam.sync_host` downloads the resident chunks
that changed since the last sync, and everything that reads the host state
calls it first: checkpoints, master values and exports (through
``OptimizerOffload.arrays`` / ``master_values``), and ``optimizer.state_dict()``
(a pre-hook). Reading ``optimizer.state`` directly sees the last synced values. Loading state over the host
arrays drops the resident copies (:meth:`StreamedAdam.drop_resident`); the
next update uploads them again. Numerics: the same kernel on the same values
as the streamed path, so bit for bit the same results.

[Note: device memory across streams]
The caching allocator hands a freed block to the next allocation *on the same
stream* at once, trusting stream order: the block's last reader was queued on
that stream, so anything the new owner queues there runs after it. A tensor
allocated on one stream and used on another breaks that: freed, its memory can
be handed out while the other stream's kernels still read it (here: a step
count allocated on the current stream, read by the fused kernel on the compute
stream, reused by the next forward's activations while that forward overlaps
the update: garbage step counts, NaN losses, on the GPU only). So everything
this object allocates is allocated on the stream that first uses it (the slots
on the H2D stream, the step count and lr on the compute stream), and
``record_stream`` marks every other stream that touches it.

Numerics: the same fused Adam(W) on the same fp32 values, gradient cast and
scaled the same way; on the CPU (where the "device" is the host and the tests
run) it is bit for bit the CPU path (chunk boundaries are multiples of
:data:`~zspeed.train.host_adam.ALIGN`); on CUDA it is the CUDA kernel, whose
rounding may differ from the CPU kernel's in the last bit.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from ..core.device import DeviceHandle
from .host_adam import ALIGN, AdamPlan

__all__ = ["StreamedAdam", "DEFAULT_CHUNK_NUMEL", "pin_state"]

# 8 Mi elements: a slot is 3 × 32 MiB of state plus 32 MiB of fp32 gradient, so three slots take 384 MiB of device
# memory; large enough that each copy runs at the link's full rate, small enough that the first chunk's upload
# (the pipeline's fill) costs ~2 ms.
DEFAULT_CHUNK_NUMEL = 1 << 23


@dataclass(eq=False)
class _Slot:
    """One chunk's worth of device memory: master, exp_avg, exp_avg_sq and the fp32 gradient."""

    arrays: tuple[torch.Tensor, ...]
    free: Any = None  # event after this slot's last download
    loaded: Any = None  # a prefetched chunk: event after its upload


class StreamedAdam:
    """Fused Adam(W) updates of host-resident groups, run on the device (see [Note: the streamed device update])."""

    def __init__(self, *, device: DeviceHandle, chunk_numel: int = DEFAULT_CHUNK_NUMEL, slots: int = 3,
                 prefetch_depth: int = 16):
        if chunk_numel < ALIGN or chunk_numel % ALIGN:
            raise ValueError(f"StreamedAdam: chunk_numel must be a positive multiple of {ALIGN}, got {chunk_numel}")
        if slots < 2:
            raise ValueError(f"StreamedAdam: needs at least 2 slots (one uploading while one computes), got {slots}")
        if prefetch_depth < 0:
            raise ValueError(f"StreamedAdam: prefetch_depth counts chunks in flight, >= 0; got {prefetch_depth}")
        self.device, self.chunk, self.num_slots = device, chunk_numel, slots
        self.h2d, self.compute, self.d2h = device.new_stream(), device.new_stream(), device.new_stream()
        self._slots: list[_Slot] = []
        self._prefetched: dict[tuple[Any, int], _Slot] = {}  # (key, first element) -> an uploaded chunk
        self.prefetched_elements = 0  # elements whose state was uploaded ahead of update() (a count)
        self.prefetch_depth = prefetch_depth
        self._in_flight: deque = deque()  # upload events of prefetched chunks not yet seen complete, oldest first
        self._whole: set = set()  # keys every chunk of which is prefetched for the coming update
        # [Note: resident state (Twin-Flow)]: (key, first element) -> the chunk's device arrays, kept between
        # steps; the keys whose resident chunks changed since the host arrays were last written (with those
        # host arrays, for sync_host).
        self._resident: dict[tuple[Any, int], tuple[torch.Tensor, ...]] = {}
        self._stale: dict[Any, tuple[torch.Tensor, ...]] = {}
        self._next = 0
        self._fresh = True  # no update enqueued since the last release(): the next one waits for old downloads
        self.done = None  # event after the last download enqueued
        self.elements = 0  # elements updated since construction (a count, for logs and tests)

    def _slot(self) -> _Slot:
        if len(self._slots) < self.num_slots:
            n = self.chunk
            # Allocated on the stream that first writes them: memory the caching allocator hands out on the
            # current stream may still be read by that stream's queued kernels (see [Note: device memory
            # across streams]).
            with self.device.use_stream(self.h2d):
                arrays = tuple(self.device.empty((n,), dtype=torch.float32) for _ in range(4))
            self._slots.append(_Slot(arrays=arrays))  # type: ignore[arg-type]
        s = self._slots[self._next % self.num_slots]
        self._next += 1
        return s

    def prefetch_room(self) -> int:
        """How many more chunks :meth:`prefetch` may start now: ``prefetch_depth`` less the uploads still
        running (they complete in the order they were queued, on one stream)."""
        while self._in_flight and self._in_flight[0].query():
            self._in_flight.popleft()
        return self.prefetch_depth - len(self._in_flight)

    def prefetch(self, key: Any, arrays: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, budget: int) -> int:
        """Upload whole chunks of one group's host state (master, exp_avg, exp_avg_sq) ahead of its
        :meth:`update` with the same ``key``, while their bytes fit in ``budget``; returns the bytes taken
        (see [Note: prefetching the state during backward]). Chunks already uploaded are skipped."""
        dev, taken = self.device, 0
        n = arrays[0].numel()
        host = [t.view(-1) for t in arrays]
        for lo in range(0, n, self.chunk):
            if (key, lo) in self._prefetched:
                continue
            k = min(n, lo + self.chunk) - lo
            if taken + 12 * k > budget or self.prefetch_room() <= 0:
                break
            if self._fresh:  # the last step's downloads land before these uploads read the host arrays
                self.h2d.wait_stream(self.d2h)
                self._fresh = False
            with dev.use_stream(self.h2d):  # allocated where first written ([Note: device memory across streams])
                dest = tuple(dev.empty((k,), dtype=torch.float32) for _ in range(3))
                loaded = self._upload(dest, host, lo, lo + k)
            self._prefetched[key, lo] = _Slot(arrays=dest, loaded=loaded)
            self._in_flight.append(loaded)
            taken += 12 * k
            self.prefetched_elements += k
        else:
            self._whole.add(key)
        return taken

    def prefetched_whole(self, key: Any) -> bool:
        """Whether :meth:`prefetch` has uploaded every chunk under ``key`` for the coming update."""
        return key in self._whole

    def drop_prefetched(self) -> None:
        """Forget every prefetched chunk (a skipped step, or a checkpoint loaded over the state they hold)."""
        for slot in self._prefetched.values():
            for t in slot.arrays:
                self.device.record_stream(t, self.h2d)
        self._prefetched.clear()
        self._whole.clear()

    def update(self, plan: AdamPlan, *, master: torch.Tensor, grad: torch.Tensor, scale: float,
               out: torch.Tensor, grad_ready: Any, key: Any = None, resident: bool = False) -> Any:
        """Enqueue ``master.grad = fp32(grad) × scale; optimizer.step(); out.copy_(master)`` on the device.

        ``master`` and ``plan``'s moments are host tensors (pinned on CUDA), ``grad`` and ``out`` device
        tensors of the master's number of elements; ``grad_ready`` is an event after which ``grad`` holds
        the gradient. Returns at once on CUDA; ``out`` is written on :attr:`compute` (make the stream that
        reads it wait for that stream, or for the returned event, after which ``out`` is written) and the
        host arrays on :attr:`d2h` (call :meth:`wait` before the host reads them). Steps ``plan.step``
        once, as the host path does. Chunks :meth:`prefetch` uploaded under ``key`` are not uploaded again.
        With ``resident`` (and a ``key``) the chunks stay on the device after the update and the host arrays are
        left behind until :meth:`sync_host` (see [Note: resident state (Twin-Flow)])."""
        n = master.numel()
        if grad.numel() != n or out.numel() != n:
            raise ValueError(f"StreamedAdam.update: master has {n} elements, its gradient {grad.numel()} and its "
                             f"output {out.numel()}; they must be the same chunk of the group")
        if plan.max_exp_avg_sq is not None:
            raise ValueError("StreamedAdam.update: amsgrad is not streamed (its fourth array); use the host update")
        if resident and key is None:
            raise ValueError("StreamedAdam.update: resident state needs a key to find it again next step")
        dev = self.device
        computed = None
        host = [t.view(-1) for t in (master, plan.exp_avg, plan.exp_avg_sq)]
        g, o = grad.view(-1), out.view(-1)
        with torch.no_grad():
            plan.step.add_(1)  # once per update, before the kernel reads it (as the host path)
            step, hyper = plan.step, plan.hyper
            if dev.is_cuda:  # made on the stream that reads them ([Note: device memory across streams])
                with dev.use_stream(self.compute):
                    step = torch.full((), float(plan.step), dtype=torch.float32, device=dev.device)
                    hyper = _device_hyper(plan.hyper, dev)
            if self._fresh:  # the last step's downloads land before this step's uploads read the host arrays
                self.h2d.wait_stream(self.d2h)
                self._fresh = False
            if grad_ready is not None:
                self.compute.wait_event(grad_ready)
            self._whole.discard(key)
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                k = hi - lo
                ahead = self._prefetched.pop((key, lo), None) if key is not None else None
                kept = self._resident.get((key, lo)) if resident else None
                gbuf = None
                if kept is not None:  # on the device since an earlier step ([Note: resident state (Twin-Flow)])
                    (p, m, v), loaded = kept, None
                elif ahead is not None:  # uploaded during backward
                    slot, loaded = ahead, ahead.loaded
                    p, m, v = ahead.arrays
                elif resident:  # uploaded once, into arrays of its own that stay
                    with dev.use_stream(self.h2d):  # allocated where first written
                        p, m, v = (dev.empty((k,), dtype=torch.float32) for _ in range(3))
                        loaded = self._upload((p, m, v), host, lo, hi)
                else:
                    slot = self._slot()
                    p, m, v, gbuf = (a[:k] for a in slot.arrays)
                    if slot.free is not None:
                        self.h2d.wait_event(slot.free)
                    with dev.use_stream(self.h2d):
                        loaded = self._upload((p, m, v), host, lo, hi)
                if resident:
                    self._resident[key, lo] = (p, m, v)
                if gbuf is None:
                    with dev.use_stream(self.compute):
                        gbuf = dev.empty((k,), dtype=torch.float32)
                if loaded is not None:
                    self.compute.wait_event(loaded)
                with dev.use_stream(self.compute):
                    gbuf.copy_(g[lo:hi])
                    if scale != 1.0:
                        gbuf.mul_(scale)
                    plan.kernel([p], [gbuf], [m], [v], [], [step], **hyper)
                    o[lo:hi].copy_(p)
                    computed = dev.new_event(timing=True)
                    computed.record(self.compute)
                if resident:  # nothing goes down: the host arrays wait for sync_host
                    self._stale[key] = tuple(host)
                    continue
                self.d2h.wait_event(computed)
                with dev.use_stream(self.d2h):
                    for d, src in zip(host, (p, m, v)):
                        d[lo:hi].copy_(src, non_blocking=True)
                    slot.free = dev.new_event()
                    slot.free.record(self.d2h)
                if ahead is not None:  # its memory goes back once the download has run
                    for t in ahead.arrays:
                        dev.record_stream(t, self.compute)
                        dev.record_stream(t, self.d2h)
            dev.record_stream(grad, self.compute)
            dev.record_stream(out, self.compute)
            self.done = dev.new_event(timing=True)
            self.done.record(self.d2h)
        self.elements += n
        return computed

    def _upload(self, dest: tuple[torch.Tensor, ...], host: list[torch.Tensor], lo: int, hi: int) -> Any:
        """Copy ``host[i][lo:hi]`` into ``dest[i]`` on the current (H2D) stream; returns the event after it."""
        for d, src in zip(dest, host):
            d.copy_(src[lo:hi], non_blocking=True)
        loaded = self.device.new_event()
        loaded.record(self.h2d)
        return loaded

    @property
    def resident_elements(self) -> int:
        """Elements whose state is kept on the device ([Note: resident state (Twin-Flow)])."""
        return sum(t[0].numel() for t in self._resident.values())

    def sync_host(self) -> None:
        """Write the resident chunks that changed since the last sync back to their host arrays and wait for
        every download (see [Note: resident state (Twin-Flow)]); afterwards the host arrays are current."""
        if self._stale:
            dev = self.device
            self.d2h.wait_stream(self.compute)
            with dev.use_stream(self.d2h):
                for (key, lo), arrays in self._resident.items():
                    host = self._stale.get(key)
                    if host is None:
                        continue
                    for d, src in zip(host, arrays):
                        d[lo:lo + src.numel()].copy_(src, non_blocking=True)
                self.done = dev.new_event(timing=True)
                self.done.record(self.d2h)
            self._stale.clear()
        self.wait()

    def drop_resident(self) -> None:
        """Forget the resident chunks (state was loaded over the host arrays): the next update uploads them
        again. Changes not yet written back are lost, as the load intends."""
        for arrays in self._resident.values():
            for t in arrays:
                for stream in (self.h2d, self.compute, self.d2h):
                    self.device.record_stream(t, stream)
        self._resident.clear()
        self._stale.clear()

    def release(self) -> None:
        """Give the slots back to the allocator once the work enqueued on them is done (call after the last
        update of a step): between steps the device's memory belongs to the forward and backward, whose
        activations set the peak. The next step's first update takes them again (from the allocator's cache)."""
        for slot in self._slots:
            for t in slot.arrays:
                for stream in (self.h2d, self.compute, self.d2h):
                    self.device.record_stream(t, stream)
        self._slots.clear()
        self.drop_prefetched()  # (none left after a step that updated every group it prefetched)
        self._next = 0
        self._fresh = True

    def wait(self) -> None:
        """Block until every enqueued update's host arrays are written back."""
        if self.done is not None:
            self.done.synchronize()

    def close(self) -> None:
        self.sync_host()
        self.release()
        self.drop_resident()


def _device_hyper(hyper: dict[str, Any], dev: DeviceHandle) -> dict[str, Any]:
    """The kernel's keyword arguments for the device: a tensor lr moves there with the parameters."""
    lr = hyper["lr"]
    if dev.is_cuda and isinstance(lr, torch.Tensor):
        return {**hyper, "lr": lr.to(dev.device)}
    return hyper


def pin_state(plan_state: dict[str, Any], names: tuple[str, ...]) -> None:
    """Replace the named host tensors of an optimizer state dict by pinned copies, where they are not pinned
    (a state made by torch or loaded from a checkpoint is pageable; copies from pageable memory are staged)."""
    for k in names:
        t = plan_state.get(k)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_pinned():
            plan_state[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
