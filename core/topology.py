"""Process topology: who this process is and which groups it talks in.

One :class:`Topology` is built per process and passed explicitly to everything
that communicates; zspeed keeps no module-level process state. It owns
``torch.distributed`` initialisation when it started it (``env://`` under
torchrun), the data-parallel group, rank facts and the :class:`DeviceHandle`.
World size 1 needs no process group at all: every collective in
:mod:`zspeed.core.comm` short-circuits.
"""
from __future__ import annotations

import datetime
import enum
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .device import DeviceHandle


class MeshAxis(enum.Enum):
    """The parallel dimensions a topology can hold (only DATA is populated today)."""

    DATA = "data"
    NODE_LOCAL = "node_local"


@dataclass(frozen=True, kw_only=True, slots=True)
class TopologyConfig:
    """How to build a :class:`Topology`.

    backend: ``"auto"`` (NCCL on CUDA, gloo on CPU), ``"nccl"`` or ``"gloo"``.
    device: ``"auto"`` (``cuda:LOCAL_RANK`` when CUDA is available) or a device string.
    timeout_s: collective timeout handed to ``init_process_group``.
    """

    backend: str = "auto"
    device: str = "auto"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"TopologyConfig.backend={self.backend!r}: expected 'auto', 'nccl' or 'gloo'")
        if self.timeout_s <= 0:
            raise ValueError(f"TopologyConfig.timeout_s must be positive, got {self.timeout_s}")


def _fresh_store(restart: int, timeout: datetime.timedelta) -> dict:
    """``store``, ``rank`` and ``world_size`` for a worker restarted by torchrun's elastic agent.

    [Note: elastic restarts and stale store keys]
    The agent may hand restarted workers the store of the previous attempt, where the dead
    workers' gloo addresses are still recorded under the default group's keys; a new worker then
    connects to a dead address ("connectFullMesh failed ... Connection refused"). Prefixing the
    store with the attempt number gives every attempt its own keys.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    return {"store": dist.PrefixStore(f"zspeed/attempt{restart}/", store), "rank": rank, "world_size": world}


@dataclass(eq=False)
class Topology:
    """Ranks, groups and the device of this process.

    Attributes:
        rank / world_size: position in the data-parallel group (the default group).
        local_rank / local_world_size: position among the processes of this node.
        device: the handle for this rank's device.
        groups: process groups by :class:`MeshAxis`; ``None`` means the default group.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: DeviceHandle
    groups: dict[MeshAxis, object | None] = field(default_factory=dict)
    owns_process_group: bool = False

    # -- construction ----------------------------------------------------------
    @classmethod
    def single(cls, device: str | DeviceHandle = "cpu") -> "Topology":
        """A world of one process; no process group is created."""
        handle = device if isinstance(device, DeviceHandle) else DeviceHandle.for_device(device)
        return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, device=handle,
                   groups={MeshAxis.DATA: None})

    @classmethod
    def from_env(cls, config: TopologyConfig | None = None) -> "Topology":
        """Join (or create) the process group described by torchrun's environment.

        Without ``WORLD_SIZE`` in the environment, or with ``WORLD_SIZE=1`` and no
        group initialised yet, this returns :meth:`single` on the chosen device.
        If ``torch.distributed`` is already initialised, the existing default
        group is used and left for its owner to destroy.
        """
        config = config or TopologyConfig()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = DeviceHandle.auto(local_rank) if config.device == "auto" else DeviceHandle.for_device(config.device)
        if dist.is_available() and dist.is_initialized():
            return cls._from_group(device, owns=False)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls.single(device)
        for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeError(
                    f"WORLD_SIZE={world} but {var} is not set; launch with torchrun "
                    "(e.g. `torchrun --nproc-per-node 2 script.py`) or set the env:// variables"
                )
        backend = device.backend if config.backend == "auto" else config.backend
        if backend == "nccl" and not device.is_cuda:
            raise ValueError("backend 'nccl' needs CUDA devices; use backend='gloo' on the CPU")
        device.set_current()
        kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=config.timeout_s)}
        if device.is_cuda:
            kwargs["device_id"] = device.device
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart > 0:
            kwargs.update(_fresh_store(restart, kwargs["timeout"]))
        dist.init_process_group(**kwargs)
        return cls._from_group(device, owns=True)

    @classmethod
    def _from_group(cls, device: DeviceHandle, *, owns: bool) -> "Topology":
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                   device=device, groups={MeshAxis.DATA: None, MeshAxis.NODE_LOCAL: None},
                   owns_process_group=owns)

    # -- facts -----------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_group(self):
        """The data-parallel process group (``None`` = default group)."""
        return self.groups.get(MeshAxis.DATA)

    def barrier(self) -> None:
        if self.is_distributed:
            if self.device.is_cuda:
                dist.barrier(group=self.dp_group, device_ids=[self.device.device.index])
            else:
                dist.barrier(group=self.dp_group)

    def shutdown(self) -> None:
        """Destroy the process group if this topology created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False

    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"Topology(rank={self.rank}/{self.world_size}, local={self.local_rank}/"
                f"{self.local_world_size}, device={self.device})")
