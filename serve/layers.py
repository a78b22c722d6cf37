"""Where the decoder layers' weights live while serving: on the device, or streamed in per step.

Both sources hand the runner a callable layer between ``acquire(i)`` and
``release(i)``; the runner does not know which one it has (DESIGN.md: "wait
for layer i resident, run it for the whole batch, release").

[Note: one shell, streamed weights] With offload, one decoder-layer module
built on the ``meta`` device (the *shell*: code and shapes, no storage) runs
every layer. ``acquire(i)`` asks the core :class:`Streamer` for layer i's
tensors, which are views into one of its K fixed device slots, and the layer
runs through ``torch.func.functional_call`` with those views in place of the
shell's parameters and buffers. Nothing is allocated per layer, and any module
state works the same way: dense ``nn.Linear`` weights or the quantized buffers
of ``QuantLinear``.
"""
from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

import torch
from torch import nn
from torch.func import functional_call

from zspeed.core.device import DeviceHandle
from zspeed.core.store import TensorStore
from zspeed.core.streamer import Streamer, StreamerConfig, UnitSpec, UnitState

Layer = Callable[..., torch.Tensor]


class LayerSource(Protocol):
    """The decoder layers, made resident one at a time."""

    def __len__(self) -> int: ...

    def acquire(self, i: int) -> Layer:
        """Layer ``i``, ready to run on the device until :meth:`release`."""
        ...

    def release(self, i: int) -> None: ...

    def take_stream_stats(self) -> tuple[int, float]:
        """``(bytes streamed, seconds compute waited for them)`` since the last call."""
        ...

    def close(self) -> None: ...


class ResidentLayers:
    """Every layer materialized on the device (``--offload none``)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._layers = list(layers)

    @property
    def modules(self) -> list[nn.Module]:
        return list(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def acquire(self, i: int) -> Layer:
        return self._layers[i]

    def release(self, i: int) -> None:
        pass

    def take_stream_stats(self) -> tuple[int, float]:
        return 0, 0.0

    def close(self) -> None:
        pass


class _BoundShell:
    """The shell module run with one layer's tensors (see [Note: one shell, streamed weights])."""

    __slots__ = ("shell", "tensors")

    def __init__(self, shell: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        self.shell, self.tensors = shell, tensors

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return functional_call(self.shell, self.tensors, args, kwargs, tie_weights=False, strict=True)


class StreamedLayers:
    """Layers kept in a :class:`TensorStore` (pinned CPU or disk), streamed into K device slots.

    ``names[i]`` lists layer i's ``(name in the shell, store key)`` pairs. The
    streamer prefetches the next layers while one runs and wraps around from
    the last layer to the first, so the next step's first layers load while
    the scheduler works.
    """

    def __init__(self, *, shell: nn.Module, store: TensorStore, names: Sequence[Sequence[tuple[str, str]]],
                 device: DeviceHandle, window: int) -> None:
        self.shell, self.store = shell, store
        self._names = [list(n) for n in names]
        units = [UnitSpec(f"layer{i}", tuple(key for _, key in n)) for i, n in enumerate(self._names)]
        self.streamer = Streamer(units=units, store=store, device=device, config=StreamerConfig(window=window))
        self._unit_bytes = [sum(store.meta(key).nbytes for _, key in n) for n in self._names]
        self._bytes = 0
        self._stall = 0.0

    def __len__(self) -> int:
        return len(self._names)

    @property
    def slot_bytes(self) -> int:
        return self.streamer.slot_bytes

    def acquire(self, i: int) -> Layer:
        # A RELEASED unit still holds its bytes from its last use: nothing moves. Any other
        # state means a load happened (or is happening) for this use. Only this thread
        # changes states away from RELEASED, so the check cannot go stale before acquire.
        if self.streamer.state(i) is not UnitState.RELEASED:
            self._bytes += self._unit_bytes[i]
        start = time.perf_counter()
        views = self.streamer.acquire(i)
        self._stall += time.perf_counter() - start
        return _BoundShell(self.shell, {name: views[key] for name, key in self._names[i]})

    def release(self, i: int) -> None:
        self.streamer.release(i)

    def take_stream_stats(self) -> tuple[int, float]:
        stats, (self._bytes, self._stall) = (self._bytes, self._stall), (0, 0.0)
        return stats

    def close(self) -> None:
        self.streamer.close()
        self.store.close()
