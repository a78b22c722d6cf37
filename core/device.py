"""The one handle through which zspeed touches an accelerator.

Every stream, event, synchronisation, pinned allocation and memory statistic
goes through :class:`DeviceHandle`, so the CPU path is a real code path (its
streams are no-ops and its events are always complete) rather than a mock, and
no other module of zspeed calls ``torch.cuda`` directly.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

import torch


class _CpuStream:
    """Stands in for a device stream on the CPU: work is already ordered."""

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuEvent:
    """Stands in for a device event on the CPU: always complete.

    ``record`` notes the host time, so :meth:`elapsed_time` measures the
    (synchronous) CPU work between two events, like a timing CUDA event.
    """

    def record(self, stream: object | None = None) -> None:
        self.recorded_at = time.perf_counter()

    def elapsed_time(self, end: "_CpuEvent") -> float:
        """Milliseconds from this event's record to ``end``'s."""
        return (end.recorded_at - self.recorded_at) * 1000.0

    def wait(self, stream: object | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class DeviceHandle:
    """One compute device: ``cuda:N`` or ``cpu``.

    Construct with :meth:`for_device` or :meth:`auto`. The handle is immutable
    and cheap to pass around; it holds no streams itself (see
    :class:`zspeed.core.comm.CommContext` and the streamer, which own theirs).
    """

    device: torch.device

    @classmethod
    def for_device(cls, device: str | torch.device) -> "DeviceHandle":
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"device {dev} was requested but CUDA is not available; "
                    "use device='cpu' or run on a machine with a GPU"
                )
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.type != "cpu":
            raise ValueError(f"unsupported device type {dev.type!r}; zspeed supports 'cuda' and 'cpu'")
        return cls(dev)

    @classmethod
    def auto(cls, local_rank: int = 0) -> "DeviceHandle":
        """CUDA device ``local_rank`` when CUDA is available, else the CPU."""
        if torch.cuda.is_available():
            return cls.for_device(torch.device("cuda", local_rank % torch.cuda.device_count()))
        return cls(torch.device("cpu"))

    # -- facts -----------------------------------------------------------------
    @property
    def type(self) -> str:
        return self.device.type

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        """The torch.distributed backend that suits this device."""
        return "nccl" if self.is_cuda else "gloo"

    @property
    def can_pin(self) -> bool:
        """Whether pinned (page-locked) host memory helps transfers to this device."""
        return self.is_cuda

    # -- streams and events ----------------------------------------------------
    def new_stream(self, priority: int = 0):
        if self.is_cuda:
            return torch.cuda.Stream(device=self.device, priority=priority)
        return _CpuStream()

    def current_stream(self):
        if self.is_cuda:
            return torch.cuda.current_stream(self.device)
        return _CpuStream()

    @contextlib.contextmanager
    def use_stream(self, stream) -> Iterator[None]:
        if self.is_cuda:
            with torch.cuda.stream(stream):
                yield
        else:
            yield

    def new_event(self, *, timing: bool = False):
        if self.is_cuda:
            return torch.cuda.Event(enable_timing=timing)
        return _CpuEvent()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator that ``tensor`` is used on ``stream``."""
        if self.is_cuda and tensor.is_cuda:
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def elapsed_seconds(self, start, end) -> float:
        """Seconds between two events made with ``new_event(timing=True)``; waits for ``end``."""
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def set_current(self) -> None:
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    # -- random number generators ------------------------------------------------
    def get_rng_state(self) -> torch.Tensor | None:
        """This device's generator state (None on the CPU: ``torch.get_rng_state`` covers it)."""
        return torch.cuda.get_rng_state(self.device) if self.is_cuda else None

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self.is_cuda:
            torch.cuda.set_rng_state(state, self.device)

    # -- memory ----------------------------------------------------------------
    def empty(self, shape, *, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def pinned_empty(self, shape, *, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor, page-locked when that speeds transfers to this device."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.can_pin)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else 0

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else 0

    def reset_peak_memory(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def total_memory(self) -> int:
        """The device's memory in bytes (0 on the CPU)."""
        return torch.cuda.get_device_properties(self.device).total_memory if self.is_cuda else 0

    def limit_memory(self, nbytes: int) -> None:
        """Caps this process's caching allocator on the device at ``nbytes`` (no-op on the CPU).

        Past the cap allocations raise ``torch.OutOfMemoryError`` as if the device
        had only ``nbytes``: how benchmarks make a model "not fit" on a large GPU.
        """
        if self.is_cuda:
            torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / self.total_memory()), self.device)

    def __str__(self) -> str:
        return str(self.device)
