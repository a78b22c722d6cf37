"""The ZeRO training engine: a DeepSpeed-compatible facade over flat groups and a stage policy.

Build it with :func:`zspeed.initialize`. What happens in one optimizer step:

1. ``engine(batch)`` runs the module (stage 3: hooks gather each unit, see
   :mod:`zspeed.train.zero3_hooks`);
2. ``engine.backward(loss)`` backpropagates ``loss × loss_scale / accumulation``;
   gradients are reduced as the stage policy says (see
   ``[Note: gradient accumulation and communication]`` in
   :mod:`zspeed.train.stage_policy`); at the accumulation boundary every
   master's ``.grad`` holds this rank's reduced fp32 gradient;
3. ``engine.step()`` at the boundary checks for overflow (fp16), unscales,
   clips to the global norm, steps the torch optimizer over the master shards,
   publishes the new values to the compute parameters, zeroes gradients and
   steps the lr scheduler; between boundaries it only counts the micro-step.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from ..core.comm import CommContext, all_gather
from ..core.memory import optimizer_state_tensors
from ..core.topology import Topology
from .config_schema import ConfigError, ZSpeedConfig
from .loss_scaler import make_loss_scaler
from .lr_schedules import build_lr_scheduler
from .meta_init import CurrentValues, UnitInitializer
from .mixed_precision import MixedPrecision
from .optim_factory import build_optimizer, flat_adam_state
from .storage_pack import pack_persistent_storage
from .offload import OffloadStepper, adopt_unit, build_offload, units_in_flight
from .optimizer_step import MasterOptimizer, StepOutcome
from .param_group_state import FlatParamGroup
from .stage_policy import StagePolicy
from .step_log import StepLogger, count_tokens
from .units import Unit, build_units, default_block_classes, plan_units
from .zero3_hooks import Phase, Zero3Hooks

__all__ = ["ZeroEngine"]


MAX_BUCKET_NUMEL = 1 << 25


class ZeroEngine:
    """Trains ``module`` with ZeRO stage ``config.zero_stage`` across ``topo``'s data-parallel ranks.

    Use as DeepSpeed's engine: ``loss = engine(batch)...``, ``engine.backward(loss)``,
    ``engine.step()``. Prefer :func:`zspeed.initialize` to constructing it directly.

    Args:
        module: the model. Its parameters become views of the engine's flat
            buffers (stage 3: storage freed between uses); floating parameters are
            cast to the compute dtype. Its buffers move to ``topo``'s device.
        config: the parsed config (:func:`zspeed.train.config.load_config`).
        topo: this process's topology.
        optimizer: a client torch optimizer built over ``module``'s parameters; it is
            re-pointed at the master shards (its hyperparameters and param groups
            are kept). Mutually exclusive with ``config.optimizer``.
        model_parameters: the parameters (or param-group dicts) to train, when the
            optimizer comes from the config; default: every parameter that requires grad.
        lr_scheduler: an LR scheduler over ``optimizer``, or a callable building one
            from the engine's optimizer; default: from ``config.scheduler``.
        block_classes: class names (or classes) of the model's blocks: stage 3 gathers
            each block as one unit, activation checkpointing wraps them. Default: the
            Hugging Face model's ``_no_split_modules``.
        init: where initial values come from: by default the parameters' current
            values; for a model built on the meta device a
            :class:`~zspeed.train.meta_init.ModuleInit` or
            :class:`~zspeed.train.meta_init.StateDictInit` (each rank then
            materialises one module at a time and keeps only its shard).
    """

    def __init__(self, *, module: nn.Module, config: ZSpeedConfig, topo: Topology,
                 optimizer: torch.optim.Optimizer | None = None, model_parameters: Iterable | None = None,
                 lr_scheduler: Any = None, block_classes: Iterable[str | type] | None = None,
                 init: UnitInitializer | None = None):
        if topo.world_size != config.world_size:
            raise ConfigError(f"the config was resolved for world_size={config.world_size}, "
                              f"but this topology has {topo.world_size} ranks")
        _check_supported(config)
        self.module, self.config, self.topo = module, config, topo
        self.policy = StagePolicy.for_stage(config.zero_stage)
        self.mp = MixedPrecision(precision=config.precision)
        self.comm = CommContext(topo) if topo.is_distributed else None
        self.block_classes = tuple(block_classes) if block_classes is not None else default_block_classes(module)
        self.offload, self.param_offload = build_offload(config, policy=self.policy, topo=topo)
        groups_spec = _param_groups(module, optimizer, model_parameters)
        self.units = self._build_units(groups_spec, init or CurrentValues())
        self.groups: list[FlatParamGroup] = [g for u in self.units for g in u.groups]
        pack_persistent_storage(self.groups, topo.device.device)  # see [Note: packed persistent storage]
        self.optimizer = self._build_optimizer(optimizer, groups_spec)
        if self.offload is None:
            flat_adam_state(self.optimizer)  # two flat moment buffers, as DeepSpeed keeps them
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.scaler = make_loss_scaler(config.fp16)
        self.stepper = self._build_stepper()
        self.hooks = self._install_zero3_hooks()
        if self.offload is not None:
            self.offload.attach(self.groups)
            if config.zero_optimization.offload_optimizer.overlap_forward:
                self.offload.install_publish_hooks(self.module, self.groups)
        self.micro_steps = 0
        self.global_steps = 0
        self.last_outcome: StepOutcome | None = None
        self.log = StepLogger(topo=topo, steps_per_print=config.steps_per_print,
                              wall_clock_breakdown=config.wall_clock_breakdown)
        if config.activation_checkpointing is not None:
            self.enable_activation_checkpointing()

    # -- construction ----------------------------------------------------------------------------
    def _build_units(self, groups_spec: list[dict], init: UnitInitializer) -> list[Unit]:
        z = self.config.zero_optimization
        bucket = min(z.reduce_bucket_size, z.allgather_bucket_size) if self.policy.shard_optimizer \
            else z.reduce_bucket_size
        # The configured sizes are upper bounds. Past ~32 Mi elements a bucket gains no bandwidth
        # (benchmarks/RESULTS.md, bench_comm) but its gradient and fp32 reduce buffers cost memory.
        bucket = min(bucket, MAX_BUCKET_NUMEL)
        plans = plan_units(self.module, split=self.policy.unit_split, bucket_numel=bucket,
                           persistence_threshold=z.stage3_param_persistence_threshold,
                           block_classes=self.block_classes)
        opt_index = {id(p): i for i, g in enumerate(groups_spec) for p in g["params"]}

        def make_group(**kw: Any) -> FlatParamGroup:
            return FlatParamGroup(policy=self.policy, mp=self.mp, topo=self.topo, comm=self.comm, **kw)
        units = build_units(plans, opt_index=opt_index, make_group=make_group)
        for u in units:
            init.init_unit(u)
            for g in u.groups:
                g.init_grads()
            adopt_unit(u, self.offload, self.param_offload)  # off the device one unit at a time
        init.finish(self.module, self.topo.device.device)
        return units

    def _build_optimizer(self, client: torch.optim.Optimizer | None, groups_spec: list[dict]):
        masters: list[list[torch.Tensor]] = [[] for _ in groups_spec]
        for g in self.groups:
            if g.trainable:
                masters[g.opt_index].append(g.master)
        if client is not None:
            if self.config.optimizer is not None:
                raise ConfigError("an optimizer was passed to initialize() and the config has an 'optimizer' "
                                  "section; give one or the other")
            for pg, ms in zip(client.param_groups, masters):
                pg["params"] = ms
            client.state.clear()
            return client
        if self.config.optimizer is None:
            raise ConfigError("no optimizer: pass one to initialize() or add an 'optimizer' section to the config")
        groups = [dict({k: v for k, v in spec.items() if k != "params"}, params=ms)
                  for spec, ms in zip(groups_spec, masters) if ms]
        return build_optimizer(groups, self.config.optimizer)

    def _build_stepper(self) -> MasterOptimizer | OffloadStepper:
        if self.offload is not None:
            return OffloadStepper(offload=self.offload, optimizer=self.optimizer, topo=self.topo,
                                  scaler=self.scaler, clip_norm=self.config.gradient_clipping)
        return MasterOptimizer(optimizer=self.optimizer, groups=self.groups, policy=self.policy, topo=self.topo,
                               scaler=self.scaler, clip_norm=self.config.gradient_clipping)

    def _build_scheduler(self, client: Any):
        if client is None:
            return build_lr_scheduler(self.optimizer, self.config.scheduler)
        if isinstance(client, torch.optim.lr_scheduler.LRScheduler):
            return client
        return client(self.optimizer)

    def _install_zero3_hooks(self) -> Zero3Hooks | None:
        if not self.policy.shard_params:
            return None
        z = self.config.zero_optimization
        largest = max((u.numel for u in self.units if not u.persistent), default=0)
        hooks = Zero3Hooks(root=self.module, units=self.units,
                           prefetch_numel=min(z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters - largest))
        hooks.install()
        if self.param_offload is not None:
            self.param_offload.set_window(units_in_flight(hooks))
        return hooks

    # -- the training loop -----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.mp.cast_inputs(args, kwargs)
        if self.module.training:
            self.log.on_forward(count_tokens(args, kwargs))
        with self.log.timed("forward"):
            return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> torch.Tensor:
        """Backpropagate ``loss`` (this micro-batch's mean loss); reduce gradients per the stage."""
        self.log.on_backward(loss)
        with self.log.timed("backward"):
            self._backward(loss, retain_graph)
        return loss

    def _backward(self, loss: torch.Tensor, retain_graph: bool) -> None:
        scale = self.stepper.loss_scale / self.config.gradient_accumulation_steps
        boundary = self.is_gradient_accumulation_boundary()
        if self.policy.keeps_full_grads:
            for g in self._trainable():
                g.attach_grads()
        if self.offload is not None:
            self.offload.arm(boundary)
        (loss.float() * scale).backward(retain_graph=retain_graph)
        if self.policy.shard_grads:
            for g in self._trainable():
                g.flush_grads()
            for g in self._trainable():
                g.wait_reductions()
                if boundary:
                    self.offload.collect(g) if self.offload is not None else g.sharded_grad_to_master()
        elif boundary:
            for g in self._trainable():
                self.offload.collect(g) if self.offload is not None else g.reduce_at_boundary()

    def step(self) -> None:
        """At an accumulation boundary: the optimizer step (see the module docstring); else count."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        with self.log.timed("step"):
            outcome = self.stepper.step()
            for g in self._trainable():
                g.zero_grads()
        if self.param_offload is not None and self.hooks is not None and not self.hooks.recording:
            self.param_offload.follow(self.hooks.order)
        if outcome.applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.last_outcome = outcome
        self.log.on_step(step=self.global_steps, lr=self.get_lr(), loss_scale=outcome.loss_scale,
                         grad_norm=outcome.grad_norm, skipped=self.skipped_steps)

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        """Save the sharded training state under ``save_dir/tag`` (default tag ``global_step<N>``),
        then point ``save_dir/latest`` at it; collective. ``client_state`` (JSON) comes back from
        :meth:`load_checkpoint`. See :mod:`zspeed.train.checkpoint`."""
        from .checkpoint import save_checkpoint
        self._land_updates()
        return str(save_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest))

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Load ``load_dir/tag`` (default: the ``latest`` tag), saved at any world size and stage;
        returns ``(folder, client_state)``, ``(None, None)`` when there is no checkpoint.
        ``load_module_strict`` is accepted for DeepSpeed compatibility (loading is always strict)."""
        from .checkpoint import load_checkpoint
        self._land_updates()  # an update still landing (DPU, overlap_forward) must not land over what is loaded
        return load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """The whole model's 16-bit weights in one safetensors file (DeepSpeed's method); collective.
        At stage 3 only with ``stage3_gather_16bit_weights_on_model_save``. See :mod:`zspeed.train.save_16bit`."""
        from .save_16bit import save_16bit_model
        return save_16bit_model(self, save_dir, save_filename)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def zero_grad(self) -> None:
        """Gradients are zeroed by :meth:`step`; kept for DeepSpeed compatibility."""

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    # -- facts -----------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.stepper.loss_scale

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler is not None else 0

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    @property
    def device(self) -> torch.device:
        return self.topo.device.device

    def model_state_tensors(self) -> list[torch.Tensor]:
        """Every persistent tensor of model state this rank holds: flat buffers and optimizer state."""
        held = [t for g in self.groups for t in g.held_tensors()]
        return held + optimizer_state_tensors(self.optimizer)

    def _land_updates(self) -> None:
        """Publish an optimizer update still running on the CPU (offload's DPU or ``overlap_forward``;
        else a no-op)."""
        if self.offload is not None:
            self.offload.drain()

    def publish_updates(self) -> None:
        """Wait for the last step's offloaded update and put every updated parameter on the device.
        Only needed with ``offload_optimizer.overlap_forward``, before reading the module's parameters
        directly between :meth:`step` and the next forward (the engine's own state dicts, checkpoints and
        exports do it themselves)."""
        self._land_updates()

    def _trainable(self) -> list[FlatParamGroup]:
        return [g for g in self.groups if g.trainable]

    # -- whole-model views -----------------------------------------------------------------------
    def full_state_dict(self, *, master: bool = False, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The whole model's state dict (every rank gets it; collective at stages 1-3).

        ``master=True`` returns the fp32 master values of trainable parameters
        instead of the compute (16-bit) ones. Keys are ``module.state_dict()``'s.
        """
        self._land_updates()
        values: dict[int, torch.Tensor] = {}
        for u in self.units:
            u.unshard()
            u.wait()
            for g in u.groups:
                full = self._gathered_master(g) if (master and g.trainable) else g.full
                for p, view in zip(g.params, g.group.views(full)):
                    values[id(p)] = view.detach().to(device, copy=True)
            if self.hooks is None or self.hooks.phase is Phase.IDLE:
                u.reshard()
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            out[name] = values.get(id(t), None)
            if out[name] is None:
                out[name] = t.detach().to(device, copy=True)
        return out

    def _gathered_master(self, g: FlatParamGroup) -> torch.Tensor:
        master = self.offload.master_values(g) if self.offload is not None else g.master
        if not self.policy.shard_optimizer:
            return master
        full = torch.zeros(g.group.full_numel, dtype=master.dtype, device=self.device)
        full[g.lo:g.hi].copy_(master)
        all_gather(g.group, shard=full[g.lo:g.hi], full=full, topo=self.topo, comm=self.comm, async_op=False)
        return full

    def enable_activation_checkpointing(self) -> int:
        """Checkpoint every block's activations (recomputed in backward); returns the number wrapped."""
        from .checkpointing import apply_activation_checkpointing
        ac = self.config.activation_checkpointing
        if ac is not None and (ac.partition_activations or ac.cpu_checkpointing or ac.contiguous_memory_optimization):
            raise NotImplementedError("activation_checkpointing: partition_activations, cpu_checkpointing and "
                                      "contiguous_memory_optimization are not implemented by zspeed")
        return apply_activation_checkpointing(self.module, block_classes=self.block_classes)

    def __repr__(self) -> str:
        return (f"ZeroEngine(stage={self.policy.stage}, precision={self.mp.precision.value}, units={len(self.units)}, "
                f"groups={len(self.groups)}, {self.topo})")


def _param_groups(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                  model_parameters: Iterable | None) -> list[dict]:
    """The optimizer param groups, as dicts of ``params`` (module parameters) and hyperparameters."""
    if optimizer is not None:
        groups = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        items = list(model_parameters)
        groups = [dict(i) for i in items] if items and isinstance(items[0], dict) else [{"params": items}]
    else:
        groups = [{"params": [p for p in module.parameters() if p.requires_grad]}]
    seen: set[int] = set()
    for g in groups:
        g["params"] = list(g["params"])
        seen.update(id(p) for p in g["params"])
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"parameters that require grad but are in no optimizer param group: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}; add them, or set requires_grad=False")
    return groups



def _check_supported(config: ZSpeedConfig) -> None:
    """Refuse what the config allows but this engine does not do yet, rather than ignore it.

    Accepted without effect on results: ``overlap_comm`` and ``contiguous_gradients`` (always on at
    stages 2-3), ``reduce_scatter`` / ``allgather_partitions`` (the collectives differ, the values do
    not), ``stage3_max_reuse_distance`` (units are released after every use: distance 0).
    """
    z = config.zero_optimization
    if z.offload_optimizer.overlap_forward and z.offload_param.enabled:
        raise ConfigError("zero_optimization.offload_optimizer.overlap_forward does not combine with offload_param "
                          "(the updated shards go to the parameter store in one batch after the update); turn one "
                          "of them off")
    if z.offload_param.enabled and not z.offload_optimizer.enabled:
        raise ConfigError("zero_optimization.offload_param needs offload_optimizer too in zspeed: at stage 3 the "
                          "fp32 master is the only device copy of the parameters, so offloading the 16-bit "
                          "chunk alone saves nothing; set offload_optimizer.device to 'cpu' or 'nvme'")
