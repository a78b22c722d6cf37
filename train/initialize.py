"""``zspeed.initialize``: DeepSpeed's entry point, same arguments, same return value."""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..core.topology import Topology
from .config import AutoContext, load_config
from .config_schema import ZSpeedConfig
from .engine import ZeroEngine
from .meta_init import UnitInitializer

__all__ = ["initialize"]


def initialize(*, model: nn.Module, config: Mapping[str, Any] | str | os.PathLike | ZSpeedConfig | None = None,
               optimizer: torch.optim.Optimizer | None = None, model_parameters: Iterable | None = None,
               lr_scheduler: Any = None, training_data: Dataset | None = None,
               collate_fn: Callable | None = None, config_params: Mapping[str, Any] | None = None,
               topology: Topology | None = None, block_classes: Iterable[str | type] | None = None,
               init: UnitInitializer | None = None, args: Any = None, **unused: Any):
    """Wrap ``model`` for ZeRO training, as ``deepspeed.initialize`` does.

    Args:
        model: the ``nn.Module`` to train (may be built on the meta device for
            stage 3; see :mod:`zspeed.train.meta_init`).
        config: a DeepSpeed config: dict, path of a JSON file, or an already parsed
            :class:`ZSpeedConfig`. ``config_params`` is DeepSpeed's older name for it.
            ``"auto"`` bucket sizes are filled from ``model.config.hidden_size`` when present.
        optimizer: a client optimizer over ``model``'s parameters (its param groups
            and hyperparameters are kept; it is re-pointed at the master shards), or
            None to build the config's ``optimizer``.
        model_parameters: what to train when the config builds the optimizer (params
            or param-group dicts); default: every parameter that requires grad.
        lr_scheduler: a scheduler over ``optimizer``, or a callable ``f(optimizer)``;
            default: the config's ``scheduler``.
        training_data: a map-style dataset; a distributed data loader over it is
            returned (micro-batch ``train_micro_batch_size_per_gpu``, each rank its part).
        collate_fn: the data loader's ``collate_fn``.
        topology: this process's :class:`Topology`; default ``Topology.from_env()``
            (torchrun's environment, or a single process).
        block_classes: the model's block classes (stage-3 units, activation
            checkpointing); default the Hugging Face ``_no_split_modules``.
        init: initial values for a model built on the meta device
            (:class:`~zspeed.train.meta_init.ModuleInit`,
            :class:`~zspeed.train.meta_init.StateDictInit`); default: the current values.
        args: ignored (DeepSpeed reads ``args.deepspeed_config``; pass ``config``).

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``: the :class:`ZeroEngine`, the
        torch optimizer over the master shards, the data loader (None without
        ``training_data``) and the scheduler (None without one).
    """
    if unused:
        raise TypeError(f"initialize() got unsupported arguments: {sorted(unused)}")
    if config is not None and config_params is not None:
        raise ValueError("give config or config_params, not both")
    config = config if config is not None else config_params
    if config is None:
        raise ValueError("initialize() needs a config (dict, JSON path or ZSpeedConfig)")
    topo = topology or Topology.from_env()
    cfg = config if isinstance(config, ZSpeedConfig) else load_config(
        config, world_size=topo.world_size, auto_context=AutoContext(hidden_size=_hidden_size(model)))
    engine = ZeroEngine(module=model, config=cfg, topo=topo, optimizer=optimizer, model_parameters=model_parameters,
                        lr_scheduler=lr_scheduler, block_classes=block_classes, init=init)
    loader = None
    if training_data is not None:
        loader = make_dataloader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu, topo=topo,
                                 collate_fn=collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def make_dataloader(dataset: Dataset, *, batch_size: int, topo: Topology, collate_fn: Callable | None = None,
                    shuffle: bool = True, seed: int = 0) -> DataLoader:
    """A loader giving this rank its share of ``dataset`` in micro-batches (DeepSpeed's default sampler)."""
    sampler = DistributedSampler(dataset, num_replicas=topo.world_size, rank=topo.rank, shuffle=shuffle, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=True)


def _hidden_size(model: nn.Module) -> int | None:
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    return size if isinstance(size, int) else None
