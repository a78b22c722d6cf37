"""Units: the parameters that are communicated together.

A unit is a list of parameters; each of its (compute dtype, optimizer param
group) runs becomes one :class:`~zspeed.train.param_group_state.FlatParamGroup`
(one collective). How parameters form units is the stage policy's
:class:`~zspeed.train.stage_policy.UnitSplit`:

* ``BY_SIZE`` (stages 0-2): consecutive parameters, in registration order, up
  to ``bucket_numel`` elements. Backward produces gradients roughly in reverse
  order, so the last unit's gradients are reduced first.
* ``BY_MODULE`` (stage 3): one unit per *block* (an instance of one of the
  ``block_classes``; by default the Hugging Face model's ``_no_split_modules``,
  e.g. ``LlamaDecoderLayer``) holding all parameters beneath it, and one unit
  per other module that has parameters of its own. Parameters with at most
  ``persistence_threshold`` elements, and parameters used by several modules
  (tied embeddings), go to a single *persistent* unit that is always gathered.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch.nn as nn

from .param_group_state import FlatParamGroup
from .stage_policy import UnitSplit

__all__ = ["UnitPlan", "Unit", "plan_units", "default_block_classes"]


@dataclass(eq=False)
class UnitPlan:
    """Which parameters form a unit, before buffers exist."""

    names: list[str]
    params: list[nn.Parameter]
    module: nn.Module | None = None  # stage 3: gathered around this module's forward and backward
    persistent: bool = False


@dataclass(eq=False)
class Unit:
    """A unit's flat groups, gathered and released together."""

    index: int
    module: nn.Module | None
    groups: list[FlatParamGroup]
    persistent: bool
    reduced: int = field(default=0)  # groups whose gradients were reduced this micro-batch

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def trainable_groups(self) -> int:
        return sum(g.trainable for g in self.groups)

    def unshard(self) -> None:
        for g in self.groups:
            g.unshard()

    def wait(self) -> None:
        for g in self.groups:
            g.wait_unshard()

    def reshard(self) -> None:
        for g in self.groups:
            g.reshard()

    def __repr__(self) -> str:
        name = type(self.module).__name__ if self.module is not None else "-"
        return f"Unit({self.index}, {name}, numel={self.numel}, persistent={self.persistent})"


def default_block_classes(module: nn.Module) -> tuple[str, ...]:
    """Class names of a model's transformer blocks: Hugging Face's ``_no_split_modules``."""
    return tuple(getattr(module, "_no_split_modules", None) or ())


def plan_units(module: nn.Module, *, split: UnitSplit, bucket_numel: int, persistence_threshold: int = 0,
               block_classes: Iterable[str | type] = ()) -> list[UnitPlan]:
    if split is UnitSplit.BY_SIZE:
        return _plan_by_size(list(module.named_parameters()), bucket_numel)
    return _plan_by_module(module, persistence_threshold, tuple(block_classes))


def _plan_by_size(named: list[tuple[str, nn.Parameter]], bucket_numel: int) -> list[UnitPlan]:
    plans: list[UnitPlan] = []
    cur, cur_numel = UnitPlan(names=[], params=[]), 0
    for name, p in named:
        if cur.params and cur_numel + p.numel() > bucket_numel:
            plans.append(cur)
            cur, cur_numel = UnitPlan(names=[], params=[]), 0
        cur.names.append(name)
        cur.params.append(p)
        cur_numel += p.numel()
    if cur.params:
        plans.append(cur)
    return plans


def _is_block(m: nn.Module, block_classes: tuple[str | type, ...]) -> bool:
    return any(type(m).__name__ == c if isinstance(c, str) else isinstance(m, c) for c in block_classes)


def _shared_params(module: nn.Module) -> set[int]:
    """Parameters that are direct parameters of more than one module (e.g. tied embeddings)."""
    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, n in owners.items() if n > 1}


def _plan_by_module(module: nn.Module, threshold: int, block_classes: tuple) -> list[UnitPlan]:
    names = {id(p): n for n, p in module.named_parameters()}
    shared = _shared_params(module)
    inside_block: set[int] = set()
    for m in module.modules():
        if id(m) not in inside_block and _is_block(m, block_classes):
            inside_block.update(id(s) for s in m.modules() if s is not m)
    persistent = UnitPlan(names=[], params=[], persistent=True)
    plans: list[UnitPlan] = []
    taken: set[int] = set()
    for m in module.modules():
        if id(m) in inside_block:
            continue
        members = m.parameters() if _is_block(m, block_classes) else m.parameters(recurse=False)
        plan = UnitPlan(names=[], params=[], module=m)
        for p in members:
            if id(p) in taken:
                continue
            taken.add(id(p))
            target = persistent if (p.numel() <= threshold or id(p) in shared) else plan
            target.names.append(names[id(p)])
            target.params.append(p)
        if plan.params:
            plans.append(plan)
    return plans + ([persistent] if persistent.params else [])


def build_units(plans: list[UnitPlan], *, opt_index: dict[int, int | None], make_group) -> list[Unit]:
    """Turn plans into units: one flat group per (compute dtype, optimizer group) within a unit.

    ``make_group(params=, names=, opt_index=, persistent=)`` builds a
    :class:`FlatParamGroup`; ``opt_index`` maps ``id(param)`` to its optimizer
    param group (None: frozen).
    """
    units: list[Unit] = []
    for plan in plans:
        runs: dict[tuple, tuple[list, list]] = {}
        for name, p in zip(plan.names, plan.params):
            key = (p.dtype, p.is_floating_point(), opt_index.get(id(p)))
            runs.setdefault(key, ([], []))
            runs[key][0].append(p)
            runs[key][1].append(name)
        groups = [make_group(params=ps, names=ns, opt_index=key[2], persistent=plan.persistent)
                  for key, (ps, ns) in runs.items()]
        units.append(Unit(index=len(units), module=plan.module, groups=groups, persistent=plan.persistent))
    return units
