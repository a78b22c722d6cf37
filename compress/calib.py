"""Calibration statistics gathered from a Linear's inputs by a forward hook.

Only running statistics are kept, never the activations: ``HessianStat``
(``2 X^T X / n``, ``(K, K)``) for GPTQ, ``CrossHessianStat`` (that and ``2 X^T X_fp / n``)
for GPTQ with ``fp_targets``, and ``ColumnNormStat`` (``||X_j||²`` per input channel,
``(K,)``) for Wanda. Memory per layer is bounded by ``2 K²`` floats (and one batch of
full-precision inputs queued by ``CrossHessianStat``).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Stat(Protocol):
    def add(self, x: torch.Tensor) -> None: ...


class HessianStat:
    """Running ``H = 2/n * sum x x^T`` over all ``n`` input rows seen, in fp32."""

    def __init__(self, in_features: int, device: torch.device) -> None:
        self.h = torch.zeros(in_features, in_features, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # (tokens, K)
        new = self.rows + x.shape[0]
        self.h *= self.rows / new
        x = x * (2.0 / new) ** 0.5
        self.h += x.t() @ x
        self.rows = new


class CrossHessianStat(HessianStat):
    """``HessianStat`` of the inputs ``x`` plus ``cross = 2/n * sum x x_fp^T``, with ``x_fp`` the same
    Linear's input in the full-precision model on the same tokens (``GPTQConfig.fp_targets``).

    A hook on the full-precision copy of the Linear queues ``x_fp`` in ``pending`` before the quantized
    model's forward reaches ``add(x)``, which pairs ``x`` with the oldest queued input (``x`` itself when
    none is queued: no full-precision copy)."""

    def __init__(self, in_features: int, device: torch.device) -> None:
        super().__init__(in_features, device)
        self.cross = torch.zeros(in_features, in_features, device=device)
        self.pending: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # (tokens, K)
        x_fp = self.pending.pop(0).reshape(-1, x.shape[-1]).float() if self.pending else x
        if x_fp.shape != x.shape:
            raise ValueError(f"full-precision input {tuple(x_fp.shape)} does not pair with {tuple(x.shape)}")
        new = self.rows + x.shape[0]
        self.cross *= self.rows / new
        self.cross += (2.0 / new) * x.t() @ x_fp
        super().add(x)


class ColumnNormStat:
    """Running sum of squares per input channel; ``norms()`` gives ``||X_j||_2``."""

    def __init__(self, in_features: int, device: torch.device) -> None:
        self.sq = torch.zeros(in_features, device=device, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()  # (tokens, K)
        self.sq += (x * x).sum(dim=0)
        self.rows += x.shape[0]

    def norms(self) -> torch.Tensor:
        return self.sq.sqrt().float()


def attach_stats(linears: dict[str, nn.Linear], make: type) -> tuple[dict[str, Stat], list]:
    """Hook every Linear so each forward adds its input to a fresh ``make(K, device)``."""
    stats: dict[str, Stat] = {}
    handles = []
    for name, lin in linears.items():
        stat = make(lin.in_features, lin.weight.device)
        stats[name] = stat
        handles.append(lin.register_forward_pre_hook(lambda _m, args, s=stat: s.add(args[0].detach())))
    return stats, handles


def detach_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
