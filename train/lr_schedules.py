"""DeepSpeed's learning-rate schedules as torch ``LRScheduler`` objects.

``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR`` take DeepSpeed's parameter
names and follow its formulas, written here as pure functions of the step
index ``t`` (:func:`warmup_gamma`, :func:`warmup_decay_gamma`,
:func:`warmup_cosine_ratio`). The scheduler classes are thin: each evaluates its
formula at ``last_epoch`` for every parameter group, so they save, load and
resume like any torch scheduler (``state_dict`` round-trips).

[Note: which step index an optimizer step sees]
torch's convention is used: constructing the scheduler sets the learning rate to
``f(0)`` and each ``scheduler.step()`` (after ``optimizer.step()``) moves to
``f(t+1)``, so optimizer step ``k`` (counting from 1) runs at ``f(k-1)``.
DeepSpeed's engine applies its schedulers one step later (its first two
optimizer steps both run at the warmup start; WarmupCosineLR's first at lr 0).
A config's ``last_batch_iteration = L`` (the last step index already used)
resumes at ``f(L+1)``.

[Note: past total_num_steps]
DeepSpeed's cosine keeps going past ``total_num_steps`` and the learning rate
climbs again; here it holds at ``cos_min_ratio``. WarmupDecayLR holds at 0 in
both.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from .config_schema import (
    SchedulerConfig,
    SchedulerType,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    WarmupType,
)

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_lr_scheduler",
           "warmup_gamma", "warmup_decay_gamma", "warmup_cosine_ratio"]


# -- the formulas ------------------------------------------------------------------------------

def effective_warmup_steps(warmup_num_steps: int) -> int:
    """DeepSpeed warms up over at least 2 steps (its log curve divides by log(n))."""
    return max(2, warmup_num_steps)


def warmup_gamma(t: int, warmup_num_steps: int, warmup_type: WarmupType | str) -> float:
    """Warmup progress in [0, 1] at step t: log(t+1)/log(n) or t/n while t < n, then 1."""
    n = effective_warmup_steps(warmup_num_steps)
    if t >= n:
        return 1.0
    if WarmupType(warmup_type) is WarmupType.LOG:
        return math.log(t + 1) / math.log(n)
    return t / n


def warmup_decay_gamma(t: int, warmup_num_steps: int, total_num_steps: int,
                       warmup_type: WarmupType | str) -> float:
    """WarmupDecayLR: warmup, then (total - t) / (total - n), linearly to 0 at total, then 0."""
    n = effective_warmup_steps(warmup_num_steps)
    if t < n:
        return warmup_gamma(t, warmup_num_steps, warmup_type)
    return max(0.0, (total_num_steps - t) / max(1, total_num_steps - n))


def warmup_cosine_ratio(t: int, *, warmup_num_steps: int, total_num_steps: int, warmup_min_ratio: float,
                        cos_min_ratio: float, warmup_type: WarmupType | str) -> float:
    """WarmupCosineLR's multiplier of the optimizer's lr at step t.

    Warmup: ``warmup_min_ratio + (1 - warmup_min_ratio) · gamma(t)``. Then, with
    ``p = (t - n + 1) / (total - n)`` (held at 1 past the end, see the note),
    ``cos_min_ratio + (1 - cos_min_ratio) · (1 + cos(π·p)) / 2``.
    """
    n = effective_warmup_steps(warmup_num_steps)
    if t < n:
        return warmup_min_ratio + (1.0 - warmup_min_ratio) * warmup_gamma(t, warmup_num_steps, warmup_type)
    progress = min(1.0, (t - n + 1) / max(1, total_num_steps - n))
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0)


# -- the schedulers ----------------------------------------------------------------------------

def _per_group(value: float | Sequence[float] | None, optimizer: Optimizer, name: str) -> list[float] | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return [float(value)] * len(optimizer.param_groups)
    values = [float(v) for v in value]
    if len(values) != len(optimizer.param_groups):
        raise ValueError(f"{name} has {len(values)} values but the optimizer has "
                         f"{len(optimizer.param_groups)} parameter groups")
    return values


class _ClosedForm(LRScheduler):
    """A schedule whose learning rate is a formula of the step index (see the module note)."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1) -> None:
        if last_batch_iteration < -1:
            raise ValueError(f"last_batch_iteration must be >= -1, got {last_batch_iteration}")
        super().__init__(optimizer)
        if last_batch_iteration >= 0:  # resuming: the next optimizer step is last_batch_iteration + 1
            self.last_epoch = last_batch_iteration + 1
            self._apply()

    def lr_at(self, t: int, group: int) -> float:
        """The learning rate of param group ``group`` at step ``t`` (each schedule defines it)."""
        raise TypeError(f"{type(self).__name__} must define lr_at(t, group); use WarmupLR, WarmupDecayLR "
                        "or WarmupCosineLR")

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch, i) for i in range(len(self.optimizer.param_groups))]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name: the index of the step whose learning rate is in effect."""
        return self.last_epoch

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from :meth:`state_dict`, or DeepSpeed's ``{"last_batch_iteration": t}``."""
        if set(state_dict) == {"last_batch_iteration"}:
            self.last_epoch = int(state_dict["last_batch_iteration"]) + 1
            self._apply()
            return
        super().load_state_dict(state_dict)


class WarmupLR(_ClosedForm):
    """Warm up each group's lr from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` steps (log or linear curve), then hold it.

    ``warmup_max_lr=None`` uses each group's lr at construction.
    """

    def __init__(self, optimizer: Optimizer, *, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: WarmupType | str = WarmupType.LOG, last_batch_iteration: int = -1) -> None:
        self.warmup_num_steps = warmup_num_steps
        self.warmup_type = WarmupType(warmup_type).value  # a str: the state_dict stays JSON-serialisable
        self.min_lrs = _per_group(warmup_min_lr, optimizer, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, optimizer, "warmup_max_lr") or [
            float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def gamma(self, t: int) -> float:
        return warmup_gamma(t, self.warmup_num_steps, self.warmup_type)

    def lr_at(self, t: int, group: int) -> float:
        lo, hi = self.min_lrs[group], self.max_lrs[group]
        return lo + (hi - lo) * self.gamma(t)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then decay linearly to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: Optimizer, *, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: WarmupType | str = WarmupType.LOG, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                         warmup_num_steps=warmup_num_steps, warmup_type=warmup_type,
                         last_batch_iteration=last_batch_iteration)

    def gamma(self, t: int) -> float:
        return warmup_decay_gamma(t, self.warmup_num_steps, self.total_num_steps, self.warmup_type)


class WarmupCosineLR(_ClosedForm):
    """Scale each group's lr (as at construction) by :func:`warmup_cosine_ratio`."""

    def __init__(self, optimizer: Optimizer, *, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: WarmupType | str = WarmupType.LOG, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = warmup_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = WarmupType(warmup_type).value
        self.peak_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, t: int) -> float:
        return warmup_cosine_ratio(t, warmup_num_steps=self.warmup_num_steps, total_num_steps=self.total_num_steps,
                                   warmup_min_ratio=self.warmup_min_ratio, cos_min_ratio=self.cos_min_ratio,
                                   warmup_type=self.warmup_type)

    def lr_at(self, t: int, group: int) -> float:
        return self.peak_lrs[group] * self.ratio(t)


def build_lr_scheduler(optimizer: Optimizer, config: SchedulerConfig | None) -> LRScheduler | None:
    """The scheduler a parsed ``scheduler`` section asks for (None when there is none)."""
    if config is None:
        return None
    p = config.params
    if config.type is SchedulerType.WARMUP_LR:
        assert isinstance(p, WarmupLRParams)
        return WarmupLR(optimizer, warmup_min_lr=p.warmup_min_lr, warmup_max_lr=p.warmup_max_lr,
                        warmup_num_steps=p.warmup_num_steps, warmup_type=p.warmup_type,
                        last_batch_iteration=p.last_batch_iteration)
    if config.type is SchedulerType.WARMUP_DECAY_LR:
        assert isinstance(p, WarmupDecayLRParams)
        return WarmupDecayLR(optimizer, total_num_steps=p.total_num_steps, warmup_min_lr=p.warmup_min_lr,
                             warmup_max_lr=p.warmup_max_lr, warmup_num_steps=p.warmup_num_steps,
                             warmup_type=p.warmup_type, last_batch_iteration=p.last_batch_iteration)
    assert isinstance(p, WarmupCosineLRParams)
    return WarmupCosineLR(optimizer, total_num_steps=p.total_num_steps, warmup_min_ratio=p.warmup_min_ratio,
                          warmup_num_steps=p.warmup_num_steps, cos_min_ratio=p.cos_min_ratio,
                          warmup_type=p.warmup_type, last_batch_iteration=p.last_batch_iteration)
