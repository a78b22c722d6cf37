"""Parameter offload (stage 3): units' 16-bit chunks live in the core TensorStore, streamed in to be gathered.

Each non-persistent unit of the engine is one streamer unit whose tensors are
its groups' chunks (this rank's ``[lo, hi)`` in the compute dtype), kept in a
CPU (pinned) or DISK store. A group's gather source is the streamed chunk
(:class:`~zspeed.train.param_group_state.ShardSource`): the first group of a
unit to start gathering acquires the unit from the :class:`~zspeed.core.streamer.Streamer`
(which prefetches the next units in the access order: forward order, then the
reverse for backward), and the unit is released once every group's gather
has completed, so its slot can take the next unit. After an optimizer step the
updated chunks are written to the store and resident copies are invalidated.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.store import StoreConfig, TensorStore, Tier
from ..core.streamer import Streamer, StreamerConfig, UnitSpec
from ..core.topology import Topology
from .config_schema import AioConfig, OffloadDevice, OffloadParamConfig
from .param_group_state import FlatParamGroup
from .units import Unit

__all__ = ["ParamOffload"]


class ParamOffload:
    """The stage-3 shard source for offloaded units (see the module docstring)."""

    def __init__(self, *, config: OffloadParamConfig, topo: Topology, aio: AioConfig | None = None):
        self.config, self.topo, self.aio = config, topo, aio or AioConfig()
        self.store = TensorStore(config=self._store_config(), device=topo.device)
        self.units: list[Unit] = []
        self._unit_of: dict[int, int] = {}  # id(group) -> streamer unit index
        self._keys: dict[int, str] = {}
        self._held: dict[int, tuple[dict[str, torch.Tensor], int]] = {}  # unit -> (views, gathers pending)
        self.streamer: Streamer | None = None
        self.window = 2

    def _store_config(self) -> StoreConfig:
        if self.config.device is OffloadDevice.NVME:
            path = Path(self.config.nvme_path) / f"zspeed_params_rank{self.topo.rank}"
            return nvme_store_config(path, self.aio)
        return StoreConfig(tier=Tier.CPU)

    # -- construction ------------------------------------------------------------------------
    def adopt(self, unit: Unit) -> None:
        """Move a freshly initialised non-persistent unit's chunks into the store."""
        if unit.persistent or unit.module is None:
            return
        index = len(self.units)
        self.units.append(unit)
        for k, g in enumerate(unit.groups):
            key = f"u{unit.index}.{k}"
            self.store.put(key, g._shard_source())
            self._unit_of[id(g)], self._keys[id(g)] = index, key
            g.shard, g.source = None, self

    def owns(self, g: FlatParamGroup) -> bool:
        return id(g) in self._unit_of

    def set_window(self, units_in_flight: int) -> None:
        """Slots: the units gathering at once (the current one and its prefetches) plus one loading ahead."""
        self.window = max(2, min(len(self.units), units_in_flight + 1))

    def _streamer(self) -> Streamer:
        if self.streamer is None:
            specs = [UnitSpec(name=f"unit{u.index}", tensor_keys=tuple(self._keys[id(g)] for g in u.groups))
                     for u in self.units]
            n = len(specs)
            self.streamer = Streamer(units=specs, store=self.store, device=self.topo.device,
                                     config=StreamerConfig(window=self.window), order=[*range(n), *reversed(range(n))])
        return self.streamer

    def follow(self, order: list[Unit]) -> None:
        """Prefetch along the recorded forward order (then its reverse, for backward)."""
        index = {id(u): i for i, u in enumerate(self.units)}
        seq = [index[id(u)] for u in order if id(u) in index]
        if seq:
            self._streamer().set_order([*seq, *reversed(seq)])

    # -- ShardSource -------------------------------------------------------------------------
    def fetch(self, g: FlatParamGroup) -> torch.Tensor:
        ui = self._unit_of[id(g)]
        if ui not in self._held:
            self._held[ui] = (self._streamer().acquire(ui), 0)
        views, pending = self._held[ui]
        self._held[ui] = (views, pending + 1)
        return views[self._keys[id(g)]]

    def done(self, g: FlatParamGroup) -> None:
        ui = self._unit_of[id(g)]
        views, pending = self._held[ui]
        if pending > 1:
            self._held[ui] = (views, pending - 1)
            return
        del self._held[ui]
        self.streamer.release(ui)

    # -- updates and checkpoints -----------------------------------------------------------------
    def write(self, g: FlatParamGroup, chunk: torch.Tensor) -> None:
        """Store a group's updated chunk (compute dtype, host)."""
        self.store.put(self._keys[id(g)], chunk.to(g.dtype))

    def values(self, g: FlatParamGroup) -> torch.Tensor:
        return self.store.get(self._keys[id(g)])

    def after_update(self) -> None:
        """Drop resident copies made before the update."""
        if self.streamer is not None:
            self.streamer.invalidate()

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        self.store.close()


def nvme_store_config(path: Path, aio: AioConfig) -> StoreConfig:
    """The NVMe (DISK tier) store for offload files, tuned by the config's ``aio`` section."""
    return StoreConfig(tier=Tier.DISK, path=path, io_threads=aio.requests_in_flight, chunk_bytes=aio.block_size)
