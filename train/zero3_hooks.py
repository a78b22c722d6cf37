"""Stage 3: gather each unit around its forward and backward, release it after.

[Note: stage-3 unit lifecycle]
For a unit (a submodule and its parameters, see :mod:`zspeed.train.units`):

* pre-forward: unshard (all-gather) and wait, then start gathering the next
  units in the recorded forward order (up to ``prefetch_numel`` elements);
* post-forward: reshard (free the full parameters), and hook the output
  tensors so that the gradient reaching them triggers ...
* pre-backward: unshard and wait, then prefetch the units that precede this
  one in forward order (backward runs them next);
* post-backward: once every trainable group of the unit has reduce-scattered
  its gradients (the groups' post-accumulate-grad hooks), reshard.

At the end of every backward (an autograd callback) every non-persistent unit
is resharded, so units whose parameters got no gradient are released too.
The first forward records the execution order; later iterations prefetch along
it. A wrong prediction costs only a wasted gather: every use waits on its own
gather first.

Activation checkpointing re-runs a block's forward inside backward. The
phase is then ``BACKWARD``: the recompute gathers (a no-op, pre-backward
already did) but neither prefetches forward nor releases, since the block's
backward follows at once.
"""
from __future__ import annotations

import enum
import functools
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .param_group_state import FlatParamGroup
from .units import Unit

__all__ = ["Phase", "Zero3Hooks"]


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Zero3Hooks:
    """The module hooks of stage 3 (see ``[Note: stage-3 unit lifecycle]``)."""

    def __init__(self, *, root: nn.Module, units: list[Unit], prefetch_numel: int):
        self.root = root
        self.units = [u for u in units if not u.persistent and u.module is not None]
        self.prefetch_numel = prefetch_numel
        self.phase = Phase.IDLE
        self.order: list[Unit] = []
        self.recording = True
        self._after: dict[int, list[Unit]] = {}
        self._before: dict[int, list[Unit]] = {}
        self._handles: list = []

    # -- installation ------------------------------------------------------------------------
    def install(self) -> None:
        self._handles.append(self.root.register_forward_pre_hook(self._root_pre_forward))
        self._handles.append(self.root.register_forward_hook(self._root_post_forward))
        for u in self.units:
            self._handles.append(u.module.register_forward_pre_hook(functools.partial(self._pre_forward, u)))
            self._handles.append(u.module.register_forward_hook(functools.partial(self._post_forward, u)))
            for g in u.groups:
                g.on_grads_reduced = functools.partial(self._post_backward, u)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for u in self.units:
            for g in u.groups:
                g.on_grads_reduced = None

    # -- forward -----------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() and self.phase is Phase.FORWARD:
            self.release_all()  # no backward will follow (evaluation)
            self._end_iteration()

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        if self.phase is Phase.FORWARD and self.recording:
            self.order.append(unit)
        unit.unshard()
        unit.wait()
        if self.phase is Phase.FORWARD:
            self._prefetch(self._after.get(unit.index, []))

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self.phase is Phase.BACKWARD:
            return  # a recompute under activation checkpointing: backward of this unit follows
        unit.reshard()
        if torch.is_grad_enabled():
            hook = functools.partial(self._pre_backward, unit)
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)

    # -- backward ----------------------------------------------------------------------------
    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        unit.unshard()
        unit.wait()
        self._prefetch(self._before.get(unit.index, []))

    def _post_backward(self, unit: Unit, group: FlatParamGroup) -> None:
        unit.reduced += 1
        if unit.reduced >= len(unit.groups):  # frozen groups never report: their unit waits for the end
            unit.reduced = 0
            unit.reshard()

    def _finish_backward(self) -> None:
        self.release_all()
        self._end_iteration()

    # -- shared ------------------------------------------------------------------------------
    def release_all(self) -> None:
        for u in self.units:
            u.reduced = 0
            u.reshard()

    def _prefetch(self, units: list[Unit]) -> None:
        for u in units:
            u.unshard()

    def _end_iteration(self) -> None:
        self.phase = Phase.IDLE
        if self.recording and self.order:
            self.recording = False
            self._plan_prefetch()

    def _plan_prefetch(self) -> None:
        """For each unit, the units to gather while it runs, in forward and in backward."""
        seq = self.order
        for i, u in enumerate(seq):
            self._after.setdefault(u.index, self._window(seq[i + 1:]))
        for i in range(len(seq) - 1, -1, -1):
            self._before.setdefault(seq[i].index, self._window(seq[:i][::-1]))

    def _window(self, candidates: list[Unit]) -> list[Unit]:
        out: list[Unit] = []
        total = 0
        for u in candidates:
            if total >= self.prefetch_numel or u in out:
                break
            out.append(u)
            total += u.numel
        return out
