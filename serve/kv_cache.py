"""The KV cache: one contiguous slot per running sequence, allocated once on the device.

[Note: slot cache] The cache is two tensors ``(layers, slots, kv_heads,
max_len, head_dim)`` (keys and values) allocated when the runner is built.
A sequence takes a free slot at its first prefill chunk and gives it back
when the runner frees it; nothing is allocated per step or per sequence, and
a sequence's keys for one layer are a view ``(kv_heads, length, head_dim)``
that attention reads in place. The scheduler's limits make a slot always
available: at most ``max_batch_size`` (= slots) sequences run at once, and
prompt + output never exceeds ``max_model_len`` (= ``max_len``). Memory is
``slots * max_len`` entries whatever the sequences' real lengths: the price
of simplicity over a paged cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zspeed.core.device import DeviceHandle


@dataclass(frozen=True, kw_only=True, slots=True)
class KVCacheConfig:
    """Shape of the cache: ``slots`` sequences of up to ``max_len`` tokens each."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    slots: int
    max_len: int
    dtype: torch.dtype = torch.float32
    # A slot no sequence ever gets, written by the padded rows of graphed steps ([Note: whole-step graphs]).
    scratch_slots: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "slots", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.scratch_slots not in (0, 1):
            raise ValueError(f"KVCacheConfig.scratch_slots={self.scratch_slots}: must be 0 or 1")

    @property
    def nbytes(self) -> int:
        entries = self.num_layers * (self.slots + self.scratch_slots) * self.num_kv_heads * self.max_len * self.head_dim
        return 2 * entries * torch.empty((), dtype=self.dtype).element_size()


class KVCacheFullError(RuntimeError):
    """No free slot, or a write past ``max_len``: the scheduler's limits were not kept."""


class KVCache:
    """Keys and values of every running sequence, per layer (see [Note: slot cache])."""

    def __init__(self, config: KVCacheConfig, *, device: DeviceHandle) -> None:
        self.config = config
        shape = (config.num_layers, config.slots + config.scratch_slots, config.num_kv_heads, config.max_len,
                 config.head_dim)
        self.keys = device.empty(shape, dtype=config.dtype)
        self.values = device.empty(shape, dtype=config.dtype)
        self._free = list(range(config.slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}

    # -- lifecycle: allocate / free --------------------------------------------
    def allocate(self, seq_id: int) -> int:
        """Gives ``seq_id`` a slot (its own, if it has one already)."""
        slot = self._slot_of.get(seq_id)
        if slot is not None:
            return slot
        if not self._free:
            raise KVCacheFullError(f"no free KV slot for sequence {seq_id}: all {self.config.slots} are in use")
        slot = self._slot_of[seq_id] = self._free.pop()
        return slot

    def free(self, seq_id: int) -> None:
        """Returns the sequence's slot; unknown ids are ignored."""
        slot = self._slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, seq_id: int) -> int:
        try:
            return self._slot_of[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} has no KV slot (was its first prefill chunk run?)") from None

    @property
    def scratch_slot(self) -> int | None:
        """The index of the slot no sequence gets (None without one)."""
        return self.config.slots if self.config.scratch_slots else None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """KV entries all slots hold together (the scheduler's ``kv_capacity``)."""
        return self.config.slots * self.config.max_len

    # -- per layer ---------------------------------------------------------------
    def check_span(self, start: int, end: int) -> None:
        """Raises :class:`KVCacheFullError` if positions ``start .. end-1`` do not fit a slot."""
        if end > self.config.max_len:
            raise KVCacheFullError(f"write of positions {start}..{end - 1} past max_len={self.config.max_len}")

    def write(self, layer: int, slot: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores ``key``/``value`` ``(kv_heads, t, head_dim)`` at positions ``start .. start+t-1``."""
        end = start + key.shape[1]
        self.check_span(start, end)
        self.keys[layer, slot, :, start:end] = key
        self.values[layer, slot, :, start:end] = value

    def write_tokens(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor) -> None:
        """Stores a packed step's ``key``/``value`` ``(kv_heads, N, head_dim)``: token n at position
        ``positions[n]`` of slot ``slots[n]`` (both ``(N,)`` on the device), one indexed copy per tensor.

        The same bytes as :meth:`write` per sequence, without a Python call per sequence and layer.
        Bounds are the caller's to check (:meth:`check_span`): checking device indices would synchronise.
        """
        self.keys[layer, slots, :, positions] = key.transpose(0, 1)  # (N, kv_heads, head_dim)
        self.values[layer, slots, :, positions] = value.transpose(0, 1)

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``length`` keys and values, each ``(kv_heads, length, head_dim)``."""
        return self.keys[layer, slot, :, :length], self.values[layer, slot, :, :length]
