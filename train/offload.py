"""Optimizer offload (ZeRO-Offload, stages 1-3): fp32 masters and optimizer state on the host or NVMe.

One mechanism for every stage; the stage only decides where a group's reduced
gradient comes from (stage 1: reduced at the boundary; stages 2-3: each
group's reduce-scatter during backward) and where its updated 16-bit chunk goes
(stages 1-2: ``full[lo:hi]`` then an all-gather; stage 3: the device ``shard``,
or the parameter store with parameter offload, :mod:`zspeed.train.param_offload`).

[Note: the offloaded step]
1. Backward, last micro-batch of a step: as soon as a group's gradient chunk
   is reduced, it leaves the device on the D2H stream (non-blocking, into a
   pinned buffer) and its squared norm is taken there (a device scalar).
2. ``step()``: one all-reduce of the summed squares gives the global norm,
   which gates the step (fp16 overflow) and sets the clip coefficient.
3. A worker thread updates group after group: wait for the group's gradient;
   with torch's fused Adam/AdamW, walk the group in cache-sized chunks, each
   cast to fp32, unscaled and clipped, stepped by the fused kernel and cast into
   a pinned 16-bit buffer while it is in cache (see [Note: the chunked host
   update] in :mod:`zspeed.train.host_adam`: bit for bit ``optimizer.step()``);
   with any other optimizer, unscale and clip the gradient in a persistent fp32
   buffer, run ``optimizer.step()`` on that master only (the other masters have
   no ``.grad``, so torch skips them) and cast the master. Neither allocates
   per step. With NVMe the master and its states are read from the store first
   (the next group's read is in flight while this one updates) and written
   back after.
4. Meanwhile the main thread takes the groups in the same order: it copies each
   updated 16-bit chunk to the device on the H2D stream and all-gathers it, so
   the upload and gather of group i overlap the update of group i+1.
The step ends when the last group is home.

[Note: the device gradient after its copy]
At stages 2-3 a group's reduced gradient shard (``grad_shard``) used to stay on
the device until ``zero_grads`` after the step, although only its host copy is
read from then on: at one rank the shards are the whole model's gradients, so an
8 B model held 16 GB of them through the step (the capacity run of session 5:
37.8 GiB peak against DeepSpeed's 6.7). At the accumulation boundary the shard
is now dropped as soon as its copy is queued; ``record_stream`` on the D2H stream
keeps the memory from reuse until the copy has run, and the copy waits for the
reduction (stream order), so nothing reads freed memory. Earlier micro-batches
keep accumulating into it as before.

[Note: overlapping the CPU update]
Without gradient clipping and without fp16 nothing in the step needs the global
norm, so step 3 does not wait for step 2: each group's update is submitted to the
worker as soon as its gradient is sent (on CUDA from the reduction hook, during
backward; on the CPU, and at stage 1, as ``collect`` takes the groups after
backward), and the worker copies the updated chunk to the device itself. The
copy may overwrite the group's parameters during backward because the group's
gradient is complete: every kernel that read those parameters ran before the
gradient's D2H copy, which the worker waited for. ``step()`` then only waits for
the tail and issues the gathers, in ``self.order`` so that every rank issues its
collectives in the same order. Each group's update is the same call on the same
tensors as in the unoverlapped path, so the results are bit for bit the same.

[Note: speculative update]
With clipping, step 3 waits for the global norm, so the whole host update
(1.1 B parameters: ~0.3 s on 32 cores) runs after backward while the device
idles. With ``offload_optimizer.speculative_update`` each group's update is
submitted during backward as in the overlapped path, as if the clip will not
fire (coefficient 1), but written into a second set of arrays (``_Host.shadow``:
master, exp_avg, exp_avg_sq; the chunked update copies each chunk over and steps
it there, :func:`~zspeed.train.host_adam.chunked_adam_update` with ``into``);
the master, moments and step count stay untouched, and the 16-bit result is
uploaded as usual. ``step()`` then knows the norm: if the coefficient is
exactly 1 the two sets are swapped (the step count advanced), which leaves
every array as the in-place update would have, bit for bit; otherwise the
speculative results are dropped and the exact update runs from the untouched
state, uploading over what speculation put on the device (nothing has read it:
the next forward starts after ``step()``). A step speculates only if the step
before it was not clipped: where the clip fires every step (the 1.1 B
benchmark on random tokens, H100: all 11 speculations dropped, and the step
took 1.40 s against 0.65 s exact, two updates competing for the host's memory
bandwidth) it is tried once per run of clipped steps. Only torch's fused Adam/AdamW
without amsgrad speculates (anything else waits for ``step()``); fp16 does not
(its overflow check may skip the step). The price is 12 bytes of host memory per
parameter, and a clipped step costs what it cost before, plus the wasted work.

[Note: overlapping the next forward]
With ``offload_optimizer.overlap_forward`` :meth:`OptimizerOffload.step`
returns once every group's update is started (submitted to the worker, or
enqueued on the device by the :class:`~zspeed.train.streamed_adam.StreamedAdam`)
and leaves the groups *unpublished*. A forward pre-hook on each module that owns
parameters publishes the groups holding them the first time the next forward
reaches it: waits for that group's update (the worker's job, or the device
event after its parameters were written), uploads and gathers it, exactly what
the eager path does for every group at the end of ``step()``. So the next
forward runs right behind the update, unit by unit, instead of after all of it;
the values every forward sees are the same, only the moment they are published
moves. At stages 1-2 on several ranks publishing gathers (a collective), so a
hook publishes every unpublished group up to its own in ``self.order``: the
ranks issue the gathers in one order even where their forwards visit different
modules (a mixture of experts), and for a dense model, whose forward follows
unit order, that is what the hook would have done anyway. What the forward
did not touch is published before the next backward (:meth:`OptimizerOffload.arm`) and by
``drain()`` (checkpoints, state dicts, exports, the next ``step()``,
``engine.publish_updates()``). At stage 3 a unit is gathered ahead of its
forward (prefetch), from this rank's 16-bit shard: each group's
``before_gather`` publishes it first (the shard is written, the gather's stream
waits for the current one), so a prefetch may wait for an update the module
hook would have waited for later. (The module hook alone would be correct too:
publishing a gathered group gathers it again, from the new shard; the early
publication saves that second gather.)
The updates are started in the order the last forward published the groups
(both the worker's jobs and the device's): unit order is not forward order at
stage 3, whose persistent unit (norms, ...) comes last but is needed by the
first layer; started last, it made the first layer wait for the whole host
update (measured: 2 GPUs, overlap_forward gained 2 % instead of the forward's
third of fwd+bwd). With parameter offload the shard lives in the
parameter store, written by ``after_update``: not combined (refused).

[Note: delayed parameter update]
With ``offload_optimizer.delayed_update = W`` (a zspeed extension; ZeRO-Offload's
DPU), steps 0..W-1 are exact; from step W on, ``step()`` computes the norm from
this step's gradients (clipping and the fp16 gate stay exact), submits the
update and returns at once: the update runs on the CPU during the next step's
forward and backward, and lands (upload and gather) at the start of the next
``step()``. So the forward of step t > W uses the parameters of step t-2's
update: one update stale. What the late update needs is captured when it is
submitted: its gradient buffer (two pinned buffers alternate per step, since
the next backward writes the other one), and the optimizer's hyperparameters
(:func:`_frozen`: the lr scheduler steps before the update runs). Checkpoints,
``full_state_dict`` and ``close`` land the pending update first (:meth:`OptimizerOffload.drain`),
so the step after them is exact again and warm-up restarts after a resume.
"""
from __future__ import annotations

import copy
import math
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.comm import ReduceOp, all_reduce
from ..core.store import TensorStore, Tier
from ..core.topology import Topology
from .config_schema import AioConfig, OffloadDevice, OffloadOptimizerConfig, ZSpeedConfig
from .host_adam import Scratch, chunked_adam_update, fused_adam_plan, fused_adam_usable, record_step
from .loss_scaler import LossScaler
from .optimizer_step import StepOutcome
from .param_group_state import FlatParamGroup
from .param_offload import ParamOffload, nvme_store_config
from .stage_policy import StagePolicy
from .streamed_adam import StreamedAdam, pin_state
from .units import Unit

__all__ = ["OptimizerOffload", "OffloadStepper", "build_offload", "adopt_unit", "units_in_flight"]


def build_offload(config: ZSpeedConfig, *, policy: StagePolicy,
                  topo: Topology) -> tuple["OptimizerOffload | None", ParamOffload | None]:
    """The offload objects ``config.zero_optimization`` asks for (None where it asks for none)."""
    z = config.zero_optimization
    opt = OptimizerOffload(config=z.offload_optimizer, policy=policy, topo=topo, aio=config.aio) \
        if z.offload_optimizer.enabled \
        else None
    par = ParamOffload(config=z.offload_param, topo=topo, aio=config.aio) if z.offload_param.enabled else None
    if opt is not None:
        opt.shard_sink = par
    return opt, par


def adopt_unit(unit: Unit, opt: "OptimizerOffload | None", par: ParamOffload | None) -> None:
    """Move a freshly initialised unit's state off the device (masters first, then 16-bit chunks)."""
    if opt is not None:
        for k, g in enumerate(unit.groups):
            opt.adopt(g, f"u{unit.index}.{k}")
    if par is not None:
        par.adopt(unit)


def units_in_flight(hooks) -> int:
    """The most units stage 3 gathers at once: one, plus as many as its prefetch window can hold."""
    total, n = 0, 0
    for numel in sorted(u.numel for u in hooks.units):
        if total >= hooks.prefetch_numel:
            break
        total, n = total + numel, n + 1
    return n + 1


@dataclass(eq=False)
class _Host:
    """One trainable group's host side."""

    group: FlatParamGroup
    key: str
    grad: torch.Tensor | None = None  # pinned: this step's reduced gradient chunk, as the device had it
    grads: list = field(default_factory=lambda: [None, None])  # the pinned buffers ``grad`` alternates between
    out: torch.Tensor | None = None  # pinned: the updated chunk in the compute dtype
    norm_sq: torch.Tensor | None = None  # device scalar: this chunk's squared gradient norm
    grad_ready: Any = None  # event after the D2H copy
    uploaded: Any = None  # event after the H2D copy of ``out``
    sent: bool = False
    job: Future | None = None  # this group's submitted, not yet landed, update
    landed: bool = False  # the worker copied ``out`` to the device itself (see [Note: overlapping the CPU update])
    shadow: tuple | None = None  # master, exp_avg, exp_avg_sq of a speculative update ([Note: speculative update])
    speculated: bool = False  # this step's job wrote ``shadow``
    names: tuple[str, ...] = ("master",)  # NVMe: the arrays the store holds for this group
    on_device: bool = False  # updated by the StreamedAdam ([Note: the streamed device update])
    resident: bool = False  # on_device, its state kept in device memory ([Note: resident state (Twin-Flow)])
    device_grad: torch.Tensor | None = None  # on_device: this step's reduced gradient chunk, left on the device
    computed: Any = None  # on_device: event after this step's update wrote the group's 16-bit parameters


@dataclass(frozen=True, slots=True, eq=False)
class _Job:
    """One group's CPU update, with what it must not read later than its submission."""

    host: _Host
    grad: torch.Tensor  # the pinned gradient buffer of the step it belongs to
    ready: Any  # the event after that buffer's D2H copy
    optimizer: torch.optim.Optimizer  # the real one, or a :func:`_frozen` view for a delayed update
    scale: float  # the gradient is ``grad × scale``
    upload: bool  # the worker copies the result to the device (see [Note: overlapping the CPU update])
    speculative: bool = False  # write the update into ``host.shadow`` ([Note: speculative update])


def host_update_threads(requested: int, *, local_world_size: int) -> int:
    """CPU threads for the host update: ``requested``, or with 0 this process's share of the CPUs it
    may run on (its affinity mask divided by the ``local_world_size`` processes of the node), less
    two for the threads that drive the GPU meanwhile (the Python thread and autograd's), at least one.

    The update streams 28 bytes of optimizer state per element, so it wants every core it can get;
    torchrun sets ``OMP_NUM_THREADS=1`` for each of several processes unless told otherwise, which
    would leave it one. But it must not take the cores of the threads that launch the forward and
    backward it overlaps with: measured on 32 cores, 1 GPU, ZeRO-2 with the delayed update
    (benchmarks/RESULTS.md), 32 update threads ran a step at 17.6 K tokens/s, 30 at 29.1 K, 24 at
    25.3 K. The count is applied in the worker thread that runs the update, whose OpenMP pool is its own.
    """
    if requested > 0:
        return requested
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    share = max(1, cpus // max(1, local_world_size))
    return max(1, share - 2 if share >= 8 else share - 1)


class OptimizerOffload:
    """Masters and optimizer state off the device; see [Note: the offloaded step]."""

    def __init__(self, *, config: OffloadOptimizerConfig, policy: StagePolicy, topo: Topology,
                 aio: AioConfig | None = None):
        self.config, self.policy, self.topo, self.aio = config, policy, topo, aio or AioConfig()
        self.device = topo.device
        # Gradients leave on their own stream so the copies overlap backward's compute and reductions.
        self.d2h = self.device.new_stream()
        # Updated parameters come back on another, overlapping the CPU update of the next group.
        self.h2d = self.device.new_stream()
        self.hosts: dict[int, _Host] = {}
        self.order: list[_Host] = []
        self.boundary = False
        self.shard_sink = None  # a ParamOffload at stage 3 with parameter offload
        self.host_threads = host_update_threads(config.host_threads, local_world_size=topo.local_world_size)
        # The worker's own OpenMP pool gets the threads (see host_update_threads).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zspeed-cpu-optim", initializer=torch.set_num_threads,
                                          initargs=(self.host_threads,))
        self.early_start = False  # set by OffloadStepper: see [Note: overlapping the CPU update]
        self.early_updates = 0  # updates submitted before step() (a count, for tests and logs)
        self.speculative = False  # set by OffloadStepper: see [Note: speculative update]
        self.speculation = {"kept": 0, "dropped": 0, "skipped": 0}  # steps, by what became of their speculation
        self.speculate_next = True  # the last step was not clipped ([Note: speculative update])
        self._queue: deque[_Host] = deque()  # submitted, not yet started (the worker prefetches the head)
        self._prefetched: dict[int, dict[str, Future]] = {}  # NVMe reads started ahead, by id(host)
        self._batch: list[_Host] = []  # this step's submitted updates
        self._pending: list[_Host] = []  # a delayed update, landing at the next step()
        self._parity = 0  # which of a host's two gradient buffers this step writes
        self.store = self._open_store() if config.device is OffloadDevice.NVME else None
        self._scratch = Scratch()  # the worker's fp32 gradient buffer (see [Note: the chunked host update])
        # [Note: the streamed device update]: made by bind() when config.device_share asks for it.
        self.streamed: StreamedAdam | None = None
        # updated, not yet on the device ([Note: overlapping the next forward])
        self._unpublished: dict[int, _Host] = {}
        self.overlap_forward = config.overlap_forward
        # The order updates are started in: ``self.order``, or with overlap_forward the order the last forward
        # published the groups in (``_published``, in the making), so the first needed is the first updated.
        self._need_order: list[_Host] = self.order
        self._published: list[_Host] = []
        # Per step, seconds from the start of the update to: the worker's last job done ("host_s"), the device's
        # last parameters written ("device_params_s") and its last state written back ("device_s"), and how long
        # publishing waited for the worker ("publish_wait_s"). Filled when the step's update has landed (at
        # the next drain); for logs and benchmarks.
        self.update_times: deque[dict[str, float]] = deque(maxlen=1000)  # the last 1000 steps
        self._timing: tuple | None = None
        self._host_end = 0.0
        self._publish_wait = 0.0  # seconds the main thread waited for the worker while publishing
        # Device bytes the streamed update may take during backward to upload state ahead of the step
        # ([Note: prefetching the state during backward]); replaced by tests.
        self.prefetch_budget = self._memory_under_peak
        self._hook_handles: list = []

    def _open_store(self) -> TensorStore:
        path = Path(self.config.nvme_path) / f"zspeed_optimizer_rank{self.topo.rank}"
        return TensorStore(config=nvme_store_config(path, self.aio), device=self.device)

    # -- construction ------------------------------------------------------------------------
    def adopt(self, g: FlatParamGroup, key: str) -> None:
        """Move a freshly initialised group's master off the device (stage 3: keep a 16-bit device chunk)."""
        if not g.trainable:
            return
        g.master_on_host = True
        if self.policy.shard_params:
            g.shard = g.master.to(g.dtype, copy=True)  # the gather source (see [Note: no 16-bit shard])
        host = torch.empty(g.master.shape, dtype=torch.float32, pin_memory=self._pin)
        host.copy_(g.master)
        h = _Host(group=g, key=key)
        if self.store is not None:
            self.store.put(f"{key}/master", host)
            host = torch.empty(0, dtype=torch.float32)
        g.master = host
        self.hosts[id(g)] = h
        self.order.append(h)

    @property
    def _pin(self) -> bool:
        return self.config.pin_memory and self.device.can_pin

    def attach(self, groups: list[FlatParamGroup]) -> None:
        """Stages 2-3: send each group's gradient as soon as its reduction is issued."""
        if not self.policy.shard_grads:
            return
        for g in groups:
            if g.trainable:
                g.on_grads_reduced = _chain(self._on_reduced, g.on_grads_reduced)

    # -- backward ----------------------------------------------------------------------------
    def arm(self, boundary: bool) -> None:
        """Called before each backward: only the last micro-batch of a step sends gradients."""
        self._publish_all()  # groups the forward did not touch ([Note: overlapping the next forward])
        self.boundary = boundary
        if boundary:
            if self.config.delayed_update is not None:
                self._parity ^= 1  # the pending update may still read the other buffer
            for h in self.order:
                h.sent = False

    def _on_reduced(self, g: FlatParamGroup) -> None:
        # On CUDA the reduction (and its accumulation into grad_shard) is queued on the reduce stream
        # (the current stream without a comm context), so the copy can follow it at once. On the CPU it
        # completes in wait_reductions(), after backward; collect() sends it then.
        if self.boundary and self.device.is_cuda:
            after = g.comm.reduce_stream if g.comm is not None else self.device.current_stream()
            h = self.hosts[id(g)]
            (self._keep_on_device if h.on_device else self._send)(h, g.grad_shard, after=after)
            g.grad_shard = None  # [Note: the device gradient after its copy]

    def collect(self, g: FlatParamGroup) -> None:
        """After backward at the boundary: send the group's gradient if the reduction hook did not."""
        h = self.hosts[id(g)]
        if h.sent:
            return
        if self.policy.shard_grads:
            grad = g.grad_shard if g.grad_shard is not None else torch.zeros(
                g.hi - g.lo, dtype=g.dtype, device=self.device.device)
            g.grad_shard = None  # [Note: the device gradient after its copy]
        else:
            grad = g.reduced_full_grad()
        (self._keep_on_device if h.on_device else self._send)(h, grad, after=self.device.current_stream())

    def _keep_on_device(self, h: _Host, grad: torch.Tensor, *, after) -> None:
        """A streamed group's gradient stays where it is: take its squared norm (on the D2H stream, where
        :meth:`grad_norm_sq` looks for the others') and remember it for :meth:`step`."""
        dev = self.device
        self.d2h.wait_stream(after)
        with dev.use_stream(self.d2h):
            h.norm_sq = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
            h.grad_ready = dev.new_event()
            h.grad_ready.record(self.d2h)
        dev.record_stream(grad, self.d2h)
        h.device_grad = grad
        h.sent = True
        self._prefetch_state()

    def _send(self, h: _Host, grad: torch.Tensor, *, after) -> None:
        dev = self.device
        buf = h.grads[self._parity]
        if buf is None or buf.dtype != grad.dtype:
            buf = h.grads[self._parity] = dev.pinned_empty(grad.shape, dtype=grad.dtype)
        h.grad = buf
        self.d2h.wait_stream(after)
        with dev.use_stream(self.d2h):
            h.norm_sq = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
            h.grad.copy_(grad, non_blocking=True)
            h.grad_ready = dev.new_event()
            h.grad_ready.record(self.d2h)
        dev.record_stream(grad, self.d2h)
        h.sent = True
        self._prefetch_state()
        speculate = self.speculative and self.speculate_next
        if (self.early_start or speculate) and h.job is None:
            self._submit(h, self._optimizer, 1.0, delayed=False, speculative=speculate)
            self.early_updates += 1

    # -- the step ----------------------------------------------------------------------------
    def grad_norm_sq(self) -> torch.Tensor:
        """This rank's sum of squared gradient elements (a device scalar, fp32)."""
        if not self.order:
            return torch.zeros((), dtype=torch.float32, device=self.device.device)
        self.device.current_stream().wait_stream(self.d2h)
        return torch.stack([h.norm_sq for h in self.order]).sum()

    def discard(self) -> None:
        """A skipped step: let the copies in flight finish, update nothing."""
        for h in self.order:
            if h.grad_ready is not None:
                h.grad_ready.synchronize()
            h.device_grad = None
        if self.streamed is not None:
            self.streamed.drop_prefetched()

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float, *, delay: bool = False) -> None:
        """Update every group (``grad × grad_scale`` is the gradient) and publish the new parameters;
        with ``delay``, leave the update running to land at the next step (see [Note: delayed parameter update])."""
        opt = _frozen(optimizer) if delay else optimizer
        if len(self._published) == len(self.order):  # the last forward's order ([Note: overlapping the next forward])
            self._need_order = self._published
        self._published = []
        started = time.perf_counter()
        start_event = self.device.new_event(timing=True)
        start_event.record(self.device.current_stream())
        for h in self._need_order:
            if h.job is None and not h.on_device:
                self._submit(h, opt, grad_scale, delayed=delay)
        streamed = self._step_on_device(optimizer, grad_scale)  # runs while the worker updates the rest
        self._timing = (started, start_event, streamed[-1].computed if streamed else None,
                        self.streamed.done if streamed else None)
        batch, self._batch = self._batch, []
        if delay:
            self._pending = batch
            return
        ids = {id(h) for h in batch} | {id(h) for h in streamed}
        self._unpublished = {id(h): h for h in self.order if id(h) in ids}
        if not self.overlap_forward:
            self._publish_all()

    def _publish_all(self) -> None:
        """Put every updated group still unpublished on the device, in ``self.order`` (every rank's order)."""
        if not self._unpublished:
            return
        for h in list(self._unpublished.values()):
            self._publish(h)
        if self.shard_sink is not None:
            self.shard_sink.after_update()

    def _publish(self, h: _Host) -> None:
        """Wait for one group's update and put its parameters on the device (and gather them)."""
        del self._unpublished[id(h)]
        if self.overlap_forward:
            self._published.append(h)
        if h.computed is not None:  # a streamed group: its parameters were written on the device
            self.device.current_stream().wait_event(h.computed)
            h.computed = None
            h.group.regather()
            return
        h.job, job = None, h.job
        t = time.perf_counter()
        job.result()
        self._publish_wait += time.perf_counter() - t
        if h.landed:
            h.landed = False
            self.device.current_stream().wait_event(h.uploaded)
            h.group.regather()
        else:
            self._upload(h)

    def install_publish_hooks(self, module: torch.nn.Module, groups: list[FlatParamGroup]) -> None:
        """``overlap_forward``: before each module's forward, publish the groups holding its own parameters
        (see [Note: overlapping the next forward])."""
        rank = {id(h): i for i, h in enumerate(self.order)}
        owner = {id(p): self.hosts[id(g)] for g in groups if id(g) in self.hosts for p in g.params}
        if self.policy.shard_params:  # stage 3 gathers units ahead of their forward: publish before the gather
            for g in groups:
                if id(g) in self.hosts:
                    g.before_gather = self._publish_group
        for m in module.modules():
            hosts = {id(owner[id(p)]): owner[id(p)] for p in m.parameters(recurse=False) if id(p) in owner}
            if hosts:
                mine = tuple(sorted(hosts.values(), key=lambda h: rank[id(h)]))
                self._hook_handles.append(m.register_forward_pre_hook(self._publish_hook(mine)))

    def _publish_group(self, g: FlatParamGroup) -> None:
        h = self.hosts.get(id(g))
        if h is not None and id(h) in self._unpublished:
            self._publish(h)

    def _publish_hook(self, hosts: tuple[_Host, ...]):
        # Stages 1-2 on several ranks: publishing gathers (a collective), so every rank must publish in the
        # same order even where the ranks' forwards differ (a mixture of experts routes tokens to different
        # experts per rank): a group is published with every unpublished group before it in ``self.order``.
        in_order = not self.policy.shard_params and self.topo.world_size > 1

        def before_forward(module, args) -> None:
            if self._unpublished:
                for h in hosts:
                    if id(h) in self._unpublished:
                        if in_order:
                            self._publish_through(h)
                        else:
                            self._publish(h)
        return before_forward

    def _publish_through(self, last: _Host) -> None:
        """Publish the unpublished groups up to ``last`` in ``self.order`` (the dict keeps that order)."""
        for h in list(self._unpublished.values()):
            self._publish(h)
            if h is last:
                return

    def _step_on_device(self, optimizer: torch.optim.Optimizer, grad_scale: float) -> list[_Host]:
        """Enqueue the streamed groups' updates (see [Note: the streamed device update]); returns them."""
        done = []
        for h in self._need_order:
            if not h.on_device:
                continue
            master = h.group.master
            plan = self._streamed_plan(master, optimizer)
            grad, ready = h.device_grad, h.grad_ready
            if grad is None:  # (never sent: no gradient this step) zeros, made before the update reads them
                grad = torch.zeros(master.numel(), dtype=h.group.dtype, device=self.device.device)
                ready = self.device.new_event()
                ready.record(self.device.current_stream())
            h.computed = self.streamed.update(plan, master=master, grad=grad, scale=grad_scale, key=h.key,
                                              out=self._destination(h.group), grad_ready=ready,
                                              resident=h.resident)
            h.device_grad = None
            record_step(optimizer)
            done.append(h)
        if done:
            self.streamed.release()
        return done

    def resolve_speculation(self, keep: bool) -> None:
        """Before :meth:`step`: wait for this step's speculative updates, then keep them (swap the arrays in)
        or drop them (see [Note: speculative update]). Groups that did not speculate are left to :meth:`step`."""
        batch = [h for h in self._batch if h.job is not None]  # (none: this step did not speculate)
        for h in batch:
            h.job.result()
        kept = []
        for h in batch:
            if keep and h.speculated:
                self._keep(h)
                kept.append(h)
            else:
                h.job, h.landed = None, False
            h.speculated = False
        self._batch = kept
        if kept:
            record_step(self._optimizer)
        self.speculation["kept" if keep and batch else "dropped" if batch else "skipped"] += 1
        self.speculate_next = keep

    def _keep(self, h: _Host) -> None:
        master = h.group.master
        state = self._optimizer.state[master]
        shadow_master, shadow_avg, shadow_sq = h.shadow
        old = master.data
        master.data = shadow_master.data
        shadow_master.data = old
        h.shadow = (shadow_master, state["exp_avg"], state["exp_avg_sq"])
        state["exp_avg"], state["exp_avg_sq"] = shadow_avg, shadow_sq
        state["step"].add_(1)

    def drain(self) -> None:
        """Land a delayed update still running (no-op without one)."""
        pending, self._pending = self._pending, []
        self._land(pending)
        self._publish_all()
        if self.streamed is not None:
            self.streamed.wait()  # the streamed groups' host arrays are written back
        self._record_times()

    def _record_times(self) -> None:
        if self._timing is None:
            return
        started, start, params, done = self._timing
        self._timing = None
        row = {"host_s": max(0.0, self._host_end - started), "publish_wait_s": self._publish_wait}
        self._publish_wait = 0.0
        if done is not None and self.device.is_cuda:
            row["device_params_s"] = self.device.elapsed_seconds(start, params)
            row["device_s"] = self.device.elapsed_seconds(start, done)
        self.update_times.append(row)

    def _submit(self, h: _Host, optimizer, grad_scale: float, *, delayed: bool, speculative: bool = False) -> None:
        sink = self.shard_sink is not None and self.shard_sink.owns(h.group)
        job = _Job(host=h, grad=h.grad, ready=h.grad_ready, optimizer=optimizer, scale=grad_scale,
                   upload=not delayed and not sink, speculative=speculative)
        self._queue.append(h)
        h.job = self._worker.submit(self._update, job)
        self._batch.append(h)

    def _land(self, batch: list[_Host]) -> None:
        """Wait for ``batch``'s updates and publish them, group by group in ``self.order``."""
        ids = {id(h) for h in batch}
        self._unpublished.update((id(h), h) for h in self.order if id(h) in ids)
        self._publish_all()

    def _update(self, job: _Job) -> None:
        h, optimizer = job.host, job.optimizer
        self._queue.popleft()  # ``h``: the worker runs jobs in submission order
        job.ready.synchronize()
        master = h.group.master
        if self.store is not None:
            self._swap_in(h, optimizer, self._prefetched.pop(id(h), None) or self._read_states(h))
            nxt = self._queue[0] if self._queue else None
            if nxt is not None:  # the next group's read is in flight while this one updates
                self._prefetched[id(nxt)] = self._read_states(nxt)
        if h.uploaded is not None:
            h.uploaded.synchronize()  # the previous upload of ``out`` is done: this update rewrites it
        if h.out is None:
            h.out = self.device.pinned_empty(master.shape, dtype=h.group.dtype)
        plan = fused_adam_plan(optimizer, master)
        if job.speculative:  # [Note: speculative update]
            if plan is None or plan.max_exp_avg_sq is not None:
                return  # left to step()
            if h.shadow is None:
                h.shadow = (torch.empty(master.shape, dtype=master.dtype, pin_memory=master.is_pinned()),
                            torch.empty_like(plan.exp_avg), torch.empty_like(plan.exp_avg_sq))
            chunked_adam_update(plan, master=master, grad=job.grad, scale=job.scale, out=h.out,
                                scratch=self._scratch, into=h.shadow)
            h.speculated = True
        elif plan is not None:  # see [Note: the chunked host update]
            chunked_adam_update(plan, master=master, grad=job.grad, scale=job.scale, out=h.out, scratch=self._scratch)
            record_step(optimizer)
        else:
            self._step_whole(job, master)
            h.out.copy_(master)
        if self.store is not None:
            self._swap_out(h, optimizer)
        if job.upload and (h.speculated or not job.speculative):
            self._copy_up(h)
            h.landed = True
        self._host_end = time.perf_counter()

    def _step_whole(self, job: _Job, master: torch.Tensor) -> None:
        """Any other optimizer: one ``optimizer.step()`` with ``master.grad = fp32(grad) × scale``, the
        fp32 gradient in the persistent scratch (a fresh tensor per step would page-fault all of it)."""
        grad = job.grad
        if grad.dtype != torch.float32:
            grad = self._scratch.take(grad.numel()).view(grad.shape).copy_(grad)
        if job.scale != 1.0:
            grad.mul_(job.scale)
        master.grad = grad
        job.optimizer.step()
        master.grad = None

    def _destination(self, g: FlatParamGroup) -> torch.Tensor:
        return g.shard if self.policy.shard_params else g.full[g.lo:g.hi]

    def _copy_up(self, h: _Host) -> None:
        dev = self.device
        with dev.use_stream(self.h2d):
            self._destination(h.group).copy_(h.out, non_blocking=True)
            h.uploaded = dev.new_event()
            h.uploaded.record(self.h2d)

    def _upload(self, h: _Host) -> None:
        g = h.group
        if self.shard_sink is not None and self.shard_sink.owns(g):
            self.shard_sink.write(g, h.out)
            return
        self.h2d.wait_stream(self.device.current_stream())
        self._copy_up(h)
        self.device.current_stream().wait_stream(self.h2d)
        g.regather()

    # -- NVMe: masters and states in the store -------------------------------------------------
    def _read_states(self, h: _Host) -> dict[str, Future]:
        return {name: self.store.get_async(f"{h.key}/{name}") for name in h.names}

    def _swap_in(self, h: _Host, optimizer, reads: dict[str, Future]) -> None:
        values = {name: f.result() for name, f in reads.items()}
        h.group.master.data = values.pop("master")
        state = optimizer.state.get(h.group.master)
        if state is not None:
            state.update(values)

    def _swap_out(self, h: _Host, optimizer) -> None:
        master = h.group.master
        self.store.put_async(f"{h.key}/master", master.data)
        names = ["master"]
        for k, v in optimizer.state.get(master, {}).items():
            if isinstance(v, torch.Tensor) and v.numel() == master.numel() and v.numel() > 1:
                self.store.put_async(f"{h.key}/{k}", v)
                optimizer.state[master][k] = torch.empty(0)
                names.append(k)
        h.names = tuple(names)
        master.data = torch.empty(0, dtype=torch.float32)

    # -- checkpoints and views -------------------------------------------------------------------
    def arrays(self, g: FlatParamGroup) -> dict[str, torch.Tensor]:
        """The master and state arrays of a group (host copies for NVMe), for checkpoints."""
        from .checkpoint_state import local_arrays

        self.drain()
        self._sync_resident()
        if self.store is None:
            return local_arrays(g, self._optimizer)
        h = self.hosts[id(g)]
        self.store.flush()
        return {name: self.store.get(f"{h.key}/{name}") for name in h.names}

    def master_values(self, g: FlatParamGroup) -> torch.Tensor:
        self.drain()
        self._sync_resident()
        if self.store is None:
            return g.master
        self.store.flush()
        return self.store.get(f"{self.hosts[id(g)].key}/master")

    def load_arrays(self, g: FlatParamGroup, arrays: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
        """Install loaded arrays (master and states) and publish the group's new parameters."""
        from .checkpoint_state import set_local_arrays

        self.drain()
        if self.streamed is not None:  # state on the device (uploaded ahead, or resident) is what was loaded over
            self.streamed.drop_prefetched()
            self.streamed.drop_resident()
        h = self.hosts[id(g)]
        if self.store is None:
            set_local_arrays(g, self._optimizer, arrays, scalars)
        else:
            for name, t in arrays.items():
                self.store.put(f"{h.key}/{name}", t.contiguous())
            h.names = tuple(arrays)
            if len(arrays) > 1:
                self._optimizer.state[g.master] = {k: _step_tensor(v) if k == "step" else v
                                                   for k, v in scalars.items()}
        h.out = self.device.pinned_empty((g.hi - g.lo,), dtype=g.dtype)
        h.out.copy_(arrays["master"])
        self._upload(h)

    def _sync_resident(self) -> None:
        """Bring the host copies of resident state up to date before the host reads them
        ([Note: resident state (Twin-Flow)])."""
        if self.streamed is not None:
            self.streamed.sync_host()

    def _streamed_plan(self, master: torch.Tensor, optimizer: torch.optim.Optimizer):
        """A streamed group's fused-Adam plan, its state made (first step) and pinned (copies from pageable
        memory are staged through a bounce buffer at a fraction of the link's speed)."""
        if master.device.type == "cpu" and self.device.can_pin and not master.is_pinned():
            master.data = torch.empty(master.shape, dtype=master.dtype, pin_memory=True).copy_(master)
        fused_adam_plan(optimizer, master)  # makes the state on the first step
        if self.device.can_pin:
            pin_state(optimizer.state[master], ("exp_avg", "exp_avg_sq"))
        return fused_adam_plan(optimizer, master)

    def _memory_under_peak(self) -> int:
        """Device bytes that can be taken now without raising this process's peak: the peak so far (the
        forward's, at the loss, when backward runs) less what is allocated, less a margin for what backward
        itself still allocates (a layer's gradients and temporaries)."""
        dev = self.device
        if not dev.is_cuda:
            return 0
        return dev.max_memory_allocated() - dev.memory_allocated() - PREFETCH_MARGIN

    def _prefetch_state(self) -> None:
        """Upload streamed groups' state while backward frees memory ([Note: prefetching the state during
        backward]): in the order the update will take them, whole chunks, within :attr:`prefetch_budget`."""
        if self.streamed is None or not self.boundary or self.streamed.prefetch_room() <= 0:
            return
        budget = self.prefetch_budget()
        for h in self._need_order:
            if budget <= 0 or self.streamed.prefetch_room() <= 0:
                return
            if h.on_device and not h.resident and not self.streamed.prefetched_whole(h.key):
                master = h.group.master
                plan = self._streamed_plan(master, self._optimizer)
                budget -= self.streamed.prefetch(h.key, (master, plan.exp_avg, plan.exp_avg_sq), budget=budget)

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._choose_streamed(optimizer)
        # A state dict taken off the optimizer itself (not through the engine's checkpoints) sees landed
        # updates and current host copies of resident state ([Note: resident state (Twin-Flow)]).
        self._hook_handles.append(optimizer.register_state_dict_pre_hook(self._before_state_dict))

    def _before_state_dict(self, optimizer: torch.optim.Optimizer) -> None:
        self.drain()
        self._sync_resident()

    def _choose_streamed(self, optimizer: torch.optim.Optimizer) -> None:
        """Mark the groups the device updates ([Note: the streamed device update]): the first trainable
        groups in unit order (their gradients are reduced last in backward, so keeping them on the device
        costs least) until ``device_share`` of the parameters, or ``1 - ratio`` where that is more; the first
        ``1 - ratio`` of them keep their state on the device ([Note: resident state (Twin-Flow)]). The choice
        counts whole groups' elements, the same on every rank, so every rank streams the same groups."""
        resident_share = 1.0 - self.config.ratio  # [Note: resident state (Twin-Flow)]
        share = max(self.config.device_share, resident_share)
        for h in self.order:
            h.on_device = h.resident = False
        if share <= 0 or not self.order:
            return
        why = None
        if self.store is not None:
            why = "the state is on NVMe"
        elif any(not fused_adam_usable(optimizer, h.group.master, streamed=True) for h in self.order):
            why = "the optimizer is not torch's fused Adam/AdamW without amsgrad"
        if why is not None:
            asked = (f"offload_optimizer.ratio={self.config.ratio}" if resident_share > self.config.device_share
                     else f"offload_optimizer.device_share={share}")
            raise ValueError(f"{asked}: the device cannot run this update ({why}); use torch's Adam/AdamW with "
                             "fused=True, or offload every update to the CPU (device_share 0, ratio 1)")
        total = sum(h.group.numel for h in self.order)
        taken = 0
        for h in self.order:
            if self.shard_sink is not None and self.shard_sink.owns(h.group):
                continue  # its update goes to the parameter store, from the host
            if taken + h.group.numel / 2 > share * total:
                break
            h.on_device = True
            h.resident = taken + h.group.numel / 2 <= resident_share * total
            taken += h.group.numel
        if self.streamed is None and taken:
            self.streamed = StreamedAdam(device=self.device, prefetch_depth=self.config.prefetch_depth)

    def close(self) -> None:
        self.drain()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._worker.shutdown(wait=True)
        if self.streamed is not None:
            self.streamed.close()
        if self.store is not None:
            self.store.close()


# What backward may still allocate beyond the memory it has freed when a prefetch is decided: a layer's 16-bit
# gradients and the temporaries of its backward (~0.3 GiB for a 2048-wide layer at 8K tokens), with room to spare.
PREFETCH_MARGIN = 1 << 30


def _step_tensor(value: float) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32)


def _frozen(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` with its hyperparameters as they are now: the same class, parameters and state, but
    param groups of its own, so an update that runs after the lr scheduler has stepped uses this step's
    lr (see [Note: delayed parameter update])."""
    view = object.__new__(type(optimizer))  # not copy.copy: Optimizer.__getstate__ drops the hooks
    view.__dict__.update(optimizer.__dict__)
    view.__dict__.pop("step", None)  # the lr scheduler's call-counting wrapper of the real optimizer's step
    view.param_groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)) if k != "params" else v
                          for k, v in g.items()} for g in optimizer.param_groups]
    return view


def _chain(first, then):
    def both(g: FlatParamGroup) -> None:
        first(g)
        if then is not None:
            then(g)
    return both


class OffloadStepper:
    """:class:`~zspeed.train.optimizer_step.MasterOptimizer`'s role when the optimizer is offloaded."""

    def __init__(self, *, offload: OptimizerOffload, optimizer: torch.optim.Optimizer, topo: Topology,
                 scaler: LossScaler | None = None, clip_norm: float = 0.0):
        self.offload, self.optimizer, self.topo = offload, optimizer, topo
        self.scaler, self.clip_norm = scaler, clip_norm
        self.delayed_update = offload.config.delayed_update  # see [Note: delayed parameter update]
        self.steps = 0
        offload.bind(optimizer)
        # See [Note: overlapping the CPU update]; a delayed update starts in step() instead.
        offload.early_start = clip_norm == 0 and scaler is None and self.delayed_update is None
        # With clipping: [Note: speculative update], where asked for.
        offload.speculative = (offload.config.speculative_update and clip_norm > 0 and scaler is None
                               and self.delayed_update is None and offload.store is None)

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale if self.scaler is not None else 1.0

    def step(self) -> StepOutcome:
        self.offload.drain()  # the previous step's delayed update lands before this one starts
        delay = self.delayed_update is not None and self.steps >= self.delayed_update
        self.steps += 1
        scale = self.loss_scale
        sq = self.offload.grad_norm_sq().reshape(1)
        all_reduce(sq, topo=self.topo, op=ReduceOp.SUM)  # see [Note: the global gradient norm]
        norm = float(sq.sqrt().item()) / scale
        if self.scaler is not None and not self.scaler.update(not math.isfinite(norm)):
            self.offload.discard()
            return StepOutcome(applied=False, grad_norm=math.nan, loss_scale=scale)
        coef = min(1.0, self.clip_norm / (norm + 1e-6)) if self.clip_norm > 0 else 1.0
        if self.offload.speculative:  # [Note: speculative update]
            self.offload.resolve_speculation(keep=coef == 1.0 and scale == 1.0)
        self.offload.step(self.optimizer, coef / scale, delay=delay)
        return StepOutcome(applied=True, grad_norm=norm, loss_scale=scale)
