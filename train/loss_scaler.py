"""Loss scaling for fp16 training, with DeepSpeed's semantics.

The engine multiplies the loss by ``loss_scale`` before backward, checks the
gradients with :func:`grads_have_inf_or_nan` (all ranks must agree, so it takes a
``reduce_flag`` hook that the engine points at an all-reduce), unscales them,
and calls ``update(overflow)``; a False return means: skip this optimizer step
(gradients are discarded, parameters untouched).

[Note: the dynamic scaler's rule]
Following DeepSpeed's ``DynamicLossScaler``, with ``hysteresis = h`` and
``loss_scale_window = w``:

* an overflow with hysteresis budget left only spends one unit of it (the scale
  stays); with the budget at 1 it halves the scale, never below
  ``min_loss_scale`` (and, if the scale is already at the minimum, raises
  :class:`LossScaleUnderflowError` unless ``raise_at_min_scale`` is off);
* ``w`` consecutive good steps double the scale and refill the budget to ``h``;
  with ``consecutive_hysteresis`` every good step refills it;
* every overflow step is skipped and counted in ``skipped_steps``.

"Consecutive good steps" is counted from the last overflow: the scale doubles
at iterations ``last_overflow + k·w`` (k = 1, 2, ...), iterations counted from 0
with ``last_overflow = -1`` at the start, exactly as DeepSpeed counts them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from .config_schema import FP16Config

__all__ = ["LossScaler", "StaticLossScaler", "DynamicLossScaler", "LossScaleUnderflowError",
           "grads_have_inf_or_nan", "make_loss_scaler"]


class LossScaleUnderflowError(RuntimeError):
    """Gradients still overflow at the minimum loss scale: training cannot recover."""


class LossScaler(Protocol):
    """What the engine needs from a loss scaler."""

    @property
    def loss_scale(self) -> float: ...

    @property
    def skipped_steps(self) -> int: ...

    def update(self, overflow: bool) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StaticLossScaler:
    """A fixed loss scale (``fp16.loss_scale > 0``). Overflowing steps are still skipped
    (applying inf/NaN gradients would destroy the weights), but the scale never changes."""

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"a static loss scale must be > 0, got {scale}")
        self._scale = float(scale)
        self._skipped = 0

    @property
    def loss_scale(self) -> float:
        return self._scale

    @property
    def skipped_steps(self) -> int:
        return self._skipped

    def update(self, overflow: bool) -> bool:
        """Record one step's overflow flag; return whether to apply the step."""
        if overflow:
            self._skipped += 1
        return not overflow

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "static", "cur_scale": self._scale, "skipped_steps": self._skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _expect_kind(state, "static")
        self._scale = float(state["cur_scale"])
        self._skipped = int(state["skipped_steps"])


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler (``fp16.loss_scale == 0``); see [Note: the dynamic scaler's rule]."""

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
        raise_at_min_scale: bool = True,
        scale_factor: float = 2.0,
    ) -> None:
        if not (init_scale > 0 and min_scale > 0 and scale_factor > 1):
            raise ValueError(f"need init_scale > 0, min_scale > 0, scale_factor > 1; got "
                             f"{init_scale}, {min_scale}, {scale_factor}")
        if scale_window < 1 or hysteresis < 1:
            raise ValueError(f"need scale_window >= 1 and hysteresis >= 1; got {scale_window}, {hysteresis}")
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_at_min_scale = raise_at_min_scale
        self.scale_factor = float(scale_factor)
        self._scale = float(init_scale)
        self._iter = 0  # updates seen so far
        self._last_overflow_iter = -1
        self._hysteresis_left = hysteresis
        self._skipped = 0

    @property
    def loss_scale(self) -> float:
        return self._scale

    @property
    def skipped_steps(self) -> int:
        return self._skipped

    @property
    def hysteresis_left(self) -> int:
        """Overflows that may still pass before the scale is halved (1 = the next one halves it)."""
        return self._hysteresis_left

    def update(self, overflow: bool) -> bool:
        """Record one step's (globally reduced) overflow flag; return whether to apply the step."""
        if overflow:
            self._on_overflow()
        else:
            self._on_good_step()
        self._iter += 1
        return not overflow

    def _on_overflow(self) -> None:
        self._skipped += 1
        self._last_overflow_iter = self._iter
        if self._hysteresis_left > 1:
            self._hysteresis_left -= 1
            return
        if self._scale <= self.min_scale and self.raise_at_min_scale:
            raise LossScaleUnderflowError(
                f"gradients overflow at the minimum loss scale {self.min_scale:g} "
                f"({self._skipped} steps skipped so far); lower the learning rate, use bf16, "
                "or lower fp16.min_loss_scale")
        self._scale = max(self._scale / self.scale_factor, self.min_scale)

    def _on_good_step(self) -> None:
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self._hysteresis_left = self.hysteresis
            self._scale *= self.scale_factor

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "dynamic", "cur_scale": self._scale, "cur_iter": self._iter,
                "last_overflow_iter": self._last_overflow_iter, "cur_hysteresis": self._hysteresis_left,
                "skipped_steps": self._skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _expect_kind(state, "dynamic")
        self._scale = float(state["cur_scale"])
        self._iter = int(state["cur_iter"])
        self._last_overflow_iter = int(state["last_overflow_iter"])
        self._hysteresis_left = int(state["cur_hysteresis"])
        self._skipped = int(state["skipped_steps"])


def _expect_kind(state: dict[str, Any], kind: str) -> None:
    if state.get("kind") != kind:
        raise ValueError(f"this is a {kind} loss scaler, but the state is from a {state.get('kind')!r} one")


def make_loss_scaler(fp16: FP16Config) -> StaticLossScaler | DynamicLossScaler | None:
    """The scaler an ``fp16`` config asks for; None when fp16 is off (bf16 and fp32 need none)."""
    if not fp16.enabled:
        return None
    if not fp16.dynamic:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        min_scale=fp16.min_loss_scale,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )


def grads_have_inf_or_nan(
    grads: Iterable[torch.Tensor | None],
    *,
    reduce_flag: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    device: torch.device | None = None,
) -> bool:
    """Whether any gradient holds an inf or NaN, on this rank or (through ``reduce_flag``) any rank.

    The local check is one max-abs reduction per tensor, with no host sync until
    the end. ``reduce_flag`` receives a one-element float32 tensor (1.0 = overflow
    here, 0.0 = none) and must combine it across ranks, either in place (e.g.
    ``lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX)``) or by returning the
    combined tensor. ``None`` entries (parameters without gradients) are skipped.
    ``device`` places the flag (default: the first gradient's device, else the
    CPU); give the communication device when a rank may hold no gradients.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g is not None and g.numel() > 0:
            by_device.setdefault(g.device, []).append(g)
    flag_device = device if device is not None else next(iter(by_device), torch.device("cpu"))
    flag = torch.zeros(1, dtype=torch.float32, device=flag_device)
    for device, tensors in by_device.items():
        amax = torch.stack([torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32) for t in tensors])
        bad = (~torch.isfinite(amax)).any().to(torch.float32)  # NaN propagates through the max
        flag += bad.to(flag_device).reshape(1)
    if reduce_flag is not None:
        reduced = reduce_flag(flag)
        flag = flag if reduced is None else reduced
    return bool(flag.item() > 0)
