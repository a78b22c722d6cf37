"""Models too big for one rank: build on the meta device, materialise one module at a time.

Construct the model under ``with torch.device("meta"):`` (no memory), then hand
the engine an initializer (``zspeed.initialize(..., init=...)``):

* :class:`ModuleInit` runs an init function (``model._init_weights`` for a
  Hugging Face model, ``reset_parameters`` for torch layers) on each module
  that owns parameters, one module at a time, on a *proxy*: a shallow copy
  with fresh parameter and buffer tensors and no children, so the real
  module's parameters (already views of flat buffers) are never touched. Each
  module's RNG is seeded from ``seed`` and its qualified name, so every rank
  computes the same values and the values do not depend on the stage or on
  how parameters were grouped into units. Each rank keeps only its shard.
* :class:`StateDictInit` copies from a state dict only the pieces of each
  tensor that this rank's shard holds (a lazily loading mapping reads no more).

:func:`init_module_` applies :class:`ModuleInit`'s values to a whole model in
one process (a reference, or for single-process use).
"""
from __future__ import annotations

import copy
import zlib
from typing import Callable, Mapping, Protocol

import torch
import torch.nn as nn

from .units import Unit

__all__ = ["UnitInitializer", "CurrentValues", "ModuleInit", "StateDictInit", "init_module_"]

InitFn = Callable[[nn.Module], None]


class UnitInitializer(Protocol):
    """Gives each unit's flat groups their initial values (``group.init_from_full`` / ``init_from_shard``)."""

    def init_unit(self, unit: Unit) -> None: ...

    def finish(self, module: nn.Module, device: torch.device) -> None:
        """Materialise what no unit covers (buffers of parameter-free modules)."""


class CurrentValues:
    """The default: the parameters' current values (the model was built for real)."""

    def init_unit(self, unit: Unit) -> None:
        for g in unit.groups:
            g.init_from_full([p.detach() for p in g.params])

    def finish(self, module: nn.Module, device: torch.device) -> None:
        _move_buffers(module, device)


class ModuleInit:
    """Per-module initialisation of a meta-device model (see the module docstring)."""

    def __init__(self, root: nn.Module, init_fn: InitFn, *, seed: int = 0, device: str | torch.device = "cpu"):
        self.root, self.init_fn, self.seed, self.device = root, init_fn, seed, torch.device(device)
        self._names = {m: n for n, m in root.named_modules()}
        self._owners: dict[int, list[nn.Module]] = {}
        for m in root.modules():
            for p in m.parameters(recurse=False):
                self._owners.setdefault(id(p), []).append(m)

    def init_unit(self, unit: Unit) -> None:
        ids = {id(p) for g in unit.groups for p in g.params}
        owners = [m for m in self._names if any(id(p) in ids for p in m.parameters(recurse=False))]
        values: dict[int, torch.Tensor] = {}
        for m in owners:
            values.update(self.module_values(m))
        for g in unit.groups:
            g.init_from_full([values[id(p)] for p in g.params])

    def module_values(self, m: nn.Module) -> dict[int, torch.Tensor]:
        """Initial values of ``m``'s direct parameters (by id) and meta buffers (set on ``m``)."""
        proxy = _proxy(m, self.device)
        torch.manual_seed(_module_seed(self.seed, self._names[m]))
        with torch.no_grad():
            self.init_fn(proxy)
        for name, b in m.named_buffers(recurse=False):
            if b is not None and b.is_meta:
                setattr(m, name, proxy._buffers[name])
        return {id(p): proxy._parameters[name].detach() for name, p in m.named_parameters(recurse=False)}

    def finish(self, module: nn.Module, device: torch.device) -> None:
        for m in module.modules():
            if any(b is not None and b.is_meta for b in m.buffers(recurse=False)):
                self.module_values(m)
        _move_buffers(module, device)


class StateDictInit:
    """Initial values from a state dict; each rank reads only its shard's pieces of each tensor.

    Buffers come from the state dict when present there (persistent buffers);
    meta buffers missing from it (non-persistent ones such as rotary
    frequencies) need ``buffer_init`` (e.g. a :class:`ModuleInit`).
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor], *, buffer_init: ModuleInit | None = None):
        self.state_dict, self.buffer_init = state_dict, buffer_init

    def init_unit(self, unit: Unit) -> None:
        for g in unit.groups:
            shard = torch.zeros(g.hi - g.lo, dtype=torch.float32 if g.dtype.is_floating_point else g.dtype)
            for piece in g.group.pieces(g.topo.rank):
                src = self._tensor(piece.slot.name).reshape(-1)
                shard[piece.shard_start:piece.shard_start + piece.numel].copy_(
                    src[piece.tensor_start:piece.tensor_start + piece.numel])
            g.init_from_shard(shard)

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self.state_dict:
            raise KeyError(f"parameter {name!r} is missing from the state dict")
        return self.state_dict[name]

    def finish(self, module: nn.Module, device: torch.device) -> None:
        for mname, m in module.named_modules():
            for name, b in m.named_buffers(recurse=False):
                key = f"{mname}.{name}" if mname else name
                if b is not None and b.is_meta and key in self.state_dict:
                    setattr(m, name, self.state_dict[key].to(device, b.dtype))
        if self.buffer_init is not None:
            self.buffer_init.finish(module, device)
        missing = [n for n, b in module.named_buffers() if b.is_meta]
        if missing:
            raise ValueError(f"buffers {missing[:5]} are on the meta device and not in the state dict; "
                             "pass buffer_init=ModuleInit(model, init_fn) to compute them")
        _move_buffers(module, device)


def init_module_(root: nn.Module, init_fn: InitFn, *, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
    """Give a whole model (meta or real) the values :class:`ModuleInit` would, in one process."""
    init = ModuleInit(root, init_fn, seed=seed, device=device)
    values: dict[int, torch.Tensor] = {}
    for m in root.modules():
        if any(True for _ in m.parameters(recurse=False)):
            values.update(init.module_values(m))
    for p in root.parameters():
        p.data = values[id(p)]
    init.finish(root, torch.device(device))
    return root


def _proxy(m: nn.Module, device: torch.device) -> nn.Module:
    """A shallow copy of ``m`` with fresh, uninitialised parameters and buffers and no children."""
    proxy = copy.copy(m)
    proxy.__dict__["_parameters"] = {n: None if p is None else nn.Parameter(
        torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for n, p in m._parameters.items()}
    proxy.__dict__["_buffers"] = {n: None if b is None else torch.empty(b.shape, dtype=b.dtype, device=device)
                                  for n, b in m._buffers.items()}
    proxy.__dict__["_modules"] = {}
    return proxy


def _module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for m in module.modules():
        for name, b in m.named_buffers(recurse=False):
            if b is not None and b.device != device:
                setattr(m, name, b.to(device))
