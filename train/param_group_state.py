"""One flat parameter group: the buffers of a run of parameters of one dtype.

A :class:`FlatParamGroup` owns the parameters of one unit (see
:mod:`zspeed.train.units`) that share a compute dtype and an optimizer param
group. It is laid out by :class:`~zspeed.core.partition.FlatPartition` as a
single bucket, so rank ``r``'s shard is the contiguous range ``[lo, hi)`` of
the full buffer, and it holds, depending on the stage policy
(see :mod:`zspeed.train.stage_policy`):

* ``full``: the compute parameters, flat; every ``nn.Parameter`` of the group is
  a view into it. Stage 3 frees its storage when the group is resharded (see
  ``[Note: freeing by storage resize]``).
* ``shard`` (stage 3, only without an fp32 master: fp32 training or frozen
  parameters): this rank's chunk of the compute parameters. With a master, the
  chunk is cast from it when the group is gathered (see ``[Note: no 16-bit
  shard]``).
* ``master``: what the optimizer updates: the fp32 copy of this rank's chunk
  (the full buffer at stage 0); in fp32 training, the parameters themselves.
* ``full_grad`` (stages 0-1: persistent, autograd accumulates into it; stages
  2-3: one micro-batch, freed once reduce-scattered) and ``grad_shard``
  (stages 2-3: this rank's reduced gradient, summed over micro-batches).

[Note: no 16-bit shard]
In mixed precision at stage 3 the fp32 master chunk is the only copy of this
rank's parameters: ``unshard`` casts it to the compute dtype into a transient
buffer that lives until the all-gather completes (FSDP2 does the same). That
saves 2Ψ/N bytes per rank against keeping a 16-bit shard beside the master.
Gradient shards are likewise allocated at the first reduction of a step and
dropped by ``zero_grads``, so forward (where activations peak) holds none.

[Note: releasing gradient buffers]
A unit's ``full_grad`` is read only by the reduce-scatter, on the comm stream.
On CUDA it is handed back as soon as that collective is issued, marked with
``record_stream`` so the caching allocator does not reuse it until the comm
stream is past it; otherwise every unit's buffer would stay alive until the end
of backward (a whole model of 16-bit gradients). On the CPU the handle keeps it
until the collective is waited, since gloo runs it asynchronously.

[Note: freeing by storage resize]
Stage 3 never swaps ``param.data``. The parameters stay views of ``full`` for
the whole run; resharding resizes ``full``'s storage to zero bytes and
unsharding resizes it back before the all-gather writes into it. Tensors that
autograd saved in forward (``weight.t()`` views, for example) share that
storage, so they are valid again when backward regathers the unit, and they
never keep a gathered copy alive while the unit is resharded.
"""
from __future__ import annotations

import enum
import functools
from typing import Callable, Protocol, Sequence

import torch
import torch.nn as nn

from ..core.comm import CollectiveHandle, CommContext, ReduceOp, all_gather, all_reduce, reduce_scatter
from ..core.partition import FlatPartition
from ..core.topology import Topology
from .mixed_precision import MixedPrecision
from .stage_policy import StagePolicy

__all__ = ["ParamState", "ShardSource", "FlatParamGroup"]


class ShardSource(Protocol):
    """Where a stage-3 group's compute chunk comes from when it is not kept on the device."""

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        """The chunk on the device (compute dtype), valid until :meth:`done`."""

    def done(self, group: "FlatParamGroup") -> None:
        """The gather that read the chunk has completed."""


class ParamState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists (stage 3, released)
    GATHERING = "gathering"  # an all-gather into ``full`` is in flight
    GATHERED = "gathered"  # ``full`` holds every parameter of the group


class FlatParamGroup:
    """The buffers of one group; see the module docstring. Build, then call
    :meth:`init_from_full` or :meth:`init_from_shard`, then :meth:`init_grads`."""

    def __init__(self, *, params: Sequence[nn.Parameter], names: Sequence[str], opt_index: int | None,
                 policy: StagePolicy, mp: MixedPrecision, topo: Topology, comm: CommContext | None,
                 persistent: bool = False):
        if not params:
            raise ValueError("a FlatParamGroup needs at least one parameter")
        self.params, self.names = list(params), list(names)
        self.opt_index, self.policy, self.mp, self.topo, self.comm = opt_index, policy, mp, topo, comm
        self.persistent = persistent or not policy.shard_params
        self.dtype = mp.compute_dtype_for(params[0])
        meta = [torch.empty(p.shape, dtype=self.dtype, device="meta") for p in params]
        self.group = FlatPartition.build(meta, world_size=topo.world_size, names=names).groups[self.dtype]
        self.lo, self.hi = self.group.buckets[0].chunk_range(topo.rank)
        self.state = ParamState.GATHERED
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.full_grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.on_grads_reduced: Callable[["FlatParamGroup"], None] | None = None
        self.source: ShardSource | None = None  # stage 3 with parameter offload: where the chunk streams from
        # Called before this rank's chunk is read for a gather (optimizer offload's overlap_forward: the chunk
        # may still be waiting for its update; see [Note: overlapping the next forward] in train/offload.py).
        self.before_gather: Callable[["FlatParamGroup"], None] | None = None
        self._gather: CollectiveHandle | None = None
        self._gather_src: torch.Tensor | None = None  # keeps the cast chunk alive until the gather ends
        self.master_on_host = False  # set by optimizer offload, which then owns master.grad
        self._reductions: list[tuple[CollectiveHandle, torch.Tensor]] = []
        self._ready = 0
        self._hooks: list = []

    # -- facts -------------------------------------------------------------------------------
    @property
    def trainable(self) -> bool:
        return self.opt_index is not None

    @property
    def numel(self) -> int:
        return self.group.data_numel

    @property
    def _device(self) -> torch.device:
        return self.topo.device.device

    @property
    def _hi_dtype(self) -> torch.dtype:
        """The dtype initial values are kept in until they are split into master and compute copies."""
        return self.mp.master_dtype if self.dtype.is_floating_point else self.dtype

    def held_tensors(self) -> list[torch.Tensor]:
        """The persistent buffers of this group (for memory accounting)."""
        return [t for t in (self.full, self.shard, self.master, self.full_grad, self.grad_shard) if t is not None]

    # -- construction ------------------------------------------------------------------------
    def init_from_full(self, values: Sequence[torch.Tensor]) -> None:
        """Take initial values from whole tensors (one per parameter, any floating dtype)."""
        flat = torch.zeros(self.group.full_numel, dtype=self._hi_dtype, device=self._device)
        self.group.flatten([v.detach().to(self._device) for v in values], out=flat)
        self.init_from_shard(flat[self.lo:self.hi].clone())

    def init_from_shard(self, shard_hi: torch.Tensor) -> None:
        """Take initial values from this rank's chunk only (``hi - lo`` elements, master dtype)."""
        if shard_hi.numel() != self.hi - self.lo:
            raise ValueError(f"shard of {shard_hi.numel()} elements for a chunk of {self.hi - self.lo}")
        shard_hi = shard_hi.to(self._device, self._hi_dtype)
        self.full = torch.empty(self.group.full_numel, dtype=self.dtype, device=self._device)
        point_params_at(self)  # views first: a view cannot be made of a resharded (empty) storage
        if self.policy.shard_params:
            self._init_sharded_params(shard_hi)
        else:
            self._init_full_params(shard_hi)

    def _init_sharded_params(self, shard_hi: torch.Tensor) -> None:
        if self.trainable and self.mp.has_master:
            self.master = shard_hi  # the only copy: see [Note: no 16-bit shard]
        else:
            self.shard = shard_hi.to(self.dtype, copy=True)
            if self.trainable:
                self.master = self.shard
        self.state = ParamState.GATHERED
        if self.persistent:
            self._gather_sync()
        else:
            self.reshard()

    def _init_full_params(self, shard_hi: torch.Tensor) -> None:
        self.full[self.lo:self.hi].copy_(shard_hi)
        self._gather_sync()
        if not self.trainable:
            return
        if not self.mp.has_master:
            self.master = self.full if not self.policy.shard_optimizer else self.full[self.lo:self.hi]
        elif self.policy.shard_optimizer:
            self.master = shard_hi
        else:
            self.master = torch.empty(self.group.full_numel, dtype=self._hi_dtype, device=self._device)
            self.master[self.lo:self.hi].copy_(shard_hi)
            all_gather(self.group, shard=self.master[self.lo:self.hi], full=self.master, topo=self.topo,
                       comm=self.comm, async_op=False)

    def init_grads(self) -> None:
        """Allocate the persistent gradient buffer and, for stages 2-3, hook the parameters."""
        if not self.trainable:
            return
        if self.policy.keeps_full_grads:
            self.full_grad = torch.zeros(self.group.full_numel, dtype=self.dtype, device=self._device)
            return
        for i, p in enumerate(self.params):  # grad_shard itself is allocated at the first reduction
            self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- parameters: gather and release (stage 3) --------------------------------------------
    def unshard(self) -> None:
        """Start gathering the full parameters (no-op unless resharded)."""
        if self.state is not ParamState.SHARDED:
            return
        self.full.untyped_storage().resize_(self.group.full_numel * self.full.element_size())
        self._gather_src = self._shard_source()
        self._gather = all_gather(self.group, shard=self._gather_src, full=self.full, topo=self.topo, comm=self.comm)
        self.state = ParamState.GATHERING

    def wait_unshard(self) -> None:
        if self.state is ParamState.GATHERING:
            self._gather.wait()
            self._gather, self._gather_src = None, None
            self.state = ParamState.GATHERED
            if self.source is not None:
                self.source.done(self)

    def reshard(self) -> None:
        """Free the full parameters (stage 3, non-persistent groups only)."""
        if self.persistent or self.state is ParamState.SHARDED:
            return
        self.wait_unshard()
        self.full.untyped_storage().resize_(0)
        self.state = ParamState.SHARDED

    def _shard_source(self) -> torch.Tensor:
        """This rank's chunk in the compute dtype (cast from the master when there is no 16-bit shard;
        streamed in when parameters are offloaded)."""
        if self.before_gather is not None:
            self.before_gather(self)
        if self.source is not None:
            return self.source.fetch(self)
        return self.shard if self.shard is not None else self.master.to(self.dtype)

    def _gather_sync(self) -> None:
        src = self._shard_source() if self.policy.shard_params else self.full[self.lo:self.hi]
        all_gather(self.group, shard=src, full=self.full, topo=self.topo, comm=self.comm, async_op=False)
        if self.source is not None and self.policy.shard_params:
            self.source.done(self)

    # -- gradients ---------------------------------------------------------------------------
    def attach_grads(self) -> None:
        """Stages 0-1: make every ``param.grad`` a view of ``full_grad`` so autograd accumulates there."""
        for p, view in zip(self.params, self.group.views(self.full_grad)):
            p.grad = view

    def _on_grad(self, index: int, param: nn.Parameter) -> None:
        """Stages 2-3: a parameter's gradient is complete for this micro-batch."""
        if self.full_grad is None:
            self.full_grad = torch.zeros(self.group.full_numel, dtype=self.dtype, device=self._device)
        self.group.slots[index].view(self.full_grad).copy_(param.grad)
        param.grad = None
        self._ready += 1
        if self._ready == len(self.params):
            self.reduce_grads()

    def reduce_grads(self) -> None:
        """Stages 2-3: reduce-scatter this micro-batch's gradients and add them into ``grad_shard``."""
        if self.full_grad is None:
            return
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(self.hi - self.lo, dtype=self.dtype, device=self._device)
        handle = reduce_scatter(self.group, full=self.full_grad, shard=self.grad_shard, topo=self.topo,
                                op=ReduceOp.AVG, reduce_dtype=self.mp.reduce_dtype, accumulate=True, comm=self.comm)
        self._reductions.append((handle, self._release_after_reduce(self.full_grad)))
        self.full_grad, self._ready = None, 0
        if self.on_grads_reduced is not None:
            self.on_grads_reduced(self)

    def _release_after_reduce(self, full_grad: torch.Tensor) -> torch.Tensor | None:
        """What to keep alive until the reduction is waited (see [Note: releasing gradient buffers])."""
        if self.comm is not None and self.topo.device.is_cuda:
            self.topo.device.record_stream(full_grad, self.comm.reduce_stream)
            return None
        return full_grad

    def flush_grads(self) -> None:
        """Reduce what a partial micro-batch produced (parameters that got no gradient count as zero)."""
        if self._ready:
            self.reduce_grads()

    def wait_reductions(self) -> None:
        for handle, _ in self._reductions:
            handle.wait()
        self._reductions.clear()

    def reduce_at_boundary(self) -> None:
        """Stages 0-1, last micro-batch: reduce the locally accumulated gradients into ``master.grad``."""
        self.master.grad = self.reduced_full_grad()

    def reduced_full_grad(self) -> torch.Tensor:
        """Stages 0-1, last micro-batch: the accumulated gradients reduced over ranks (fp32, on the
        device; this rank's chunk from stage 1 on)."""
        if self.policy.shard_optimizer:
            grad = torch.empty(self.hi - self.lo, dtype=self.mp.master_dtype, device=self._device)
            reduce_scatter(self.group, full=self.full_grad, shard=grad, topo=self.topo, op=ReduceOp.AVG,
                           reduce_dtype=self.mp.reduce_dtype, comm=self.comm, async_op=False)
        else:
            grad = self.full_grad.to(self.mp.master_dtype)  # a copy in 16-bit training, an alias in fp32
            all_reduce(grad, topo=self.topo, op=ReduceOp.AVG)
        return grad

    def sharded_grad_to_master(self) -> None:
        """Stages 2-3, last micro-batch: expose the reduced gradient shard as ``master.grad`` (fp32)."""
        if self.grad_shard is None:  # no parameter of the group got a gradient this step
            self.master.grad = torch.zeros_like(self.master, dtype=self.mp.master_dtype)
        else:
            self.master.grad = self.grad_shard.to(self.mp.master_dtype)

    # -- after the optimizer step ------------------------------------------------------------
    def publish(self) -> None:
        """Make the compute parameters reflect the updated master."""
        if self.policy.shard_params:
            if self.mp.has_master and self.shard is not None:
                self.shard.copy_(self.master)
            if self.state is not ParamState.SHARDED:
                self.wait_unshard()
                self._gather_sync()
            return
        if not self.policy.shard_optimizer:
            if self.mp.has_master:
                self.full.copy_(self.master)
            return
        if self.mp.has_master:
            self.full[self.lo:self.hi].copy_(self.master)
        self._gather_sync()

    def regather(self) -> None:
        """After this rank's compute chunk (``shard``, or ``full[lo:hi]`` below stage 3) was written
        directly (optimizer offload): gather the full parameters again where they are gathered."""
        if self.policy.shard_params and self.state is ParamState.SHARDED:
            return
        self.wait_unshard()
        self._gather_sync()

    def zero_grads(self) -> None:
        if self.full_grad is not None and self.policy.keeps_full_grads:
            self.full_grad.zero_()
        self.grad_shard = None  # reallocated at the next step's first reduction
        if self.master is not None and not self.master_on_host:
            # An offloaded master's .grad belongs to the CPU optimizer's worker thread, which sets and
            # clears it itself; clearing it here could race a delayed update still running.
            self.master.grad = None

    def __repr__(self) -> str:
        return (f"FlatParamGroup({len(self.params)} params, {self.dtype}, numel={self.numel}, "
                f"opt_group={self.opt_index}, state={self.state.value}, persistent={self.persistent})")


def point_params_at(g: FlatParamGroup) -> None:
    """Make the group's parameters views of its ``full`` buffer (again, after the buffer moved)."""
    for p, view in zip(g.params, g.group.views(g.full)):
        _point_at(p, view)


def _point_at(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param`` (the same Python object: modules and tied owners keep it) a view of ``view``."""
    if param.is_meta:  # set_data cannot turn a meta tensor into a real one; swap the whole tensor instead
        real = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=param.requires_grad)
        real.data = view  # via set_data: the parameter keeps its own version counter, not ``full``'s
        torch.utils.swap_tensors(param, real)
    else:
        param.data = view
