"""GPTQ (Frantar et al., 2022): quantize the columns of ``W`` one at a time and
push each column's rounding error onto the columns not yet quantized, weighted
by the inverse Hessian of the layer's reconstruction error ``||XW^T - XQ^T||²``.

With ``H = 2 X^T X / n`` (``X``: calibration inputs, ``(tokens, K)``) and ``U`` the
upper Cholesky factor of ``H^-1``, column ``i`` is quantized to ``q_i`` and the rest
updated by ``W[:, j] -= (w_i - q_i) / U[i, i] * U[i, j]`` for ``j > i``. Updates are
applied lazily in blocks of ``block_size`` columns (one matmul per block).
"""
from __future__ import annotations

import torch

from .config import GPTQConfig, with_scale_dtype
from .formats import Int4Weight, Int8Weight, check_group_size, grouped, int4_from_codes, int8_from_codes
from .uniform import SCALE_DTYPES, fit_scale_zero, from_codes, to_codes


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``; more damping if needed."""
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    mean_diag = h.diagonal().mean()
    for attempt in range(4):
        lower, info = torch.linalg.cholesky_ex(h + damp * (10**attempt) * mean_diag * eye)
        if info == 0:
            hinv = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(hinv, upper=True)
    raise ValueError(
        f"GPTQ: the calibration Hessian is not positive definite even with damp={damp * 1000}; "
        "use more (or more varied) calibration tokens, or a larger GPTQConfig.damp"
    )


def _fit(w: torch.Tensor, config: GPTQConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    return fit_scale_zero(w, bits=config.bits, symmetric=config.symmetric,
                          scale_dtype=SCALE_DTYPES[with_scale_dtype(config, w.dtype).scale_dtype])


class _Grid:
    """The scale/zero point each column is rounded with.

    INT8: one per row, fitted once. INT4 *static* (``act_order`` or ``static_groups``):
    every group fitted up front from the original weights. INT4 *dynamic* (default):
    a group is fitted when the sweep reaches its first column, from the weights as
    updated by the errors of earlier columns (the original GPTQ recipe).
    """

    def __init__(self, w: torch.Tensor, config: GPTQConfig) -> None:
        self.config, self.group = config, config.group_size
        self.per_channel = config.bits == 8
        self.static = self.per_channel or config.act_order or config.static_groups
        if self.per_channel:
            self.scales, self.zeros = _fit(w, config)  # (N,)
        elif self.static:
            self.scales, self.zeros = _fit(grouped(w, self.group), config)  # (N, ceil(K/G))
        else:
            self._scales, self._zeros = [], []

    def params(self, col: int, w: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale and zero (each ``(N,)``) for original column ``col``, at sweep position ``i`` of ``w``."""
        if self.per_channel:
            return self.scales, self.zeros
        if self.static:
            g = col // self.group
            return self.scales[:, g], None if self.zeros is None else self.zeros[:, g]
        if i % self.group == 0:
            scale, zero = _fit(w[:, i:i + self.group], self.config)  # from the updated weights
            self._scales.append(scale)
            self._zeros.append(zero)
        return self._scales[-1], self._zeros[-1]

    def pack(self, codes: torch.Tensor) -> Int4Weight | Int8Weight:
        if self.per_channel:
            return int8_from_codes(codes, self.scales)
        if self.static:
            return int4_from_codes(codes, self.scales, self.zeros, group_size=self.group)
        zeros = None if self.config.symmetric else torch.stack(self._zeros, dim=1)
        return int4_from_codes(codes, torch.stack(self._scales, dim=1), zeros, group_size=self.group)


def _sweep(w: torch.Tensor, u: torch.Tensor, grid: _Grid, perm: torch.Tensor, config: GPTQConfig) -> torch.Tensor:
    """Quantize the columns of ``w`` (already in sweep order ``perm``) with error feedback; int32 codes."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.int32, device=w.device)
    order = perm.tolist()
    for b0 in range(0, k, config.block_size):
        b1 = min(b0 + config.block_size, k)
        err = torch.empty(n, b1 - b0, device=w.device)
        for i in range(b0, b1):
            scale, zero = grid.params(order[i], w, i)
            col = w[:, i:i + 1]  # (N, 1)
            q = to_codes(col, scale, zero, bits=config.bits, symmetric=config.symmetric)
            codes[:, i:i + 1] = q
            e = (col - from_codes(q, scale, zero, bits=config.bits)) / u[i, i]  # (N, 1)
            w[:, i + 1:b1] -= e * u[i, i + 1:b1]
            err[:, i - b0] = e[:, 0]
        w[:, b1:] -= err @ u[b0:b1, b1:]  # lazy batch update of the remaining columns
    return codes


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, config: GPTQConfig, *,
                  cross: torch.Tensor | None = None) -> Int4Weight | Int8Weight:
    """Quantize ``weight`` ``(N, K)`` given the Hessian ``(K, K)`` of its inputs.

    With ``config.act_order`` columns are swept in order of decreasing Hessian
    diagonal (inputs with the most energy first), with static groups so the stored
    format is unchanged. ``cross`` ``(K, K)``: ``2/n * sum x x_fp^T`` (``GPTQConfig.fp_targets``);
    the sweep then approximates :func:`fp_target` instead of ``weight``.
    """
    n, k = weight.shape
    if hessian.shape != (k, k) or (cross is not None and cross.shape != (k, k)):
        raise ValueError(f"GPTQ: Hessian shape {tuple(hessian.shape)} does not match in_features={k}")
    if config.bits == 4:
        check_group_size(k, config.group_size, pad_groups=config.pad_groups)
    w = weight.detach().float().clone()
    if cross is not None:
        w = fp_target(w, hessian.float(), cross.float(), config.damp)
    h = hessian.float().clone()
    dead = h.diagonal() == 0  # inputs that were always zero: their columns do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    grid = _Grid(w, config)
    perm = torch.argsort(h.diagonal(), descending=True) if config.act_order else torch.arange(k, device=w.device)
    u = _inverse_hessian_factor(h[perm][:, perm], config.damp)
    codes = torch.empty_like(w, dtype=torch.int32)
    codes[:, perm] = _sweep(w[:, perm], u, grid, perm, config)
    return grid.pack(codes)


def fp_target(w: torch.Tensor, h: torch.Tensor, cross: torch.Tensor, damp: float) -> torch.Tensor:
    """The weight that best maps this layer's inputs ``x`` to the full-precision outputs ``w x_fp``.

    [Note: full-precision targets] Earlier layers are already quantized, so the inputs ``x`` differ from
    the full-precision model's ``x_fp``. With ``H = 2/n sum x x^T`` and ``cross = 2/n sum x x_fp^T``,
    ``sum ||w x_fp - q x||^2`` equals ``tr((w* - q) H (w* - q)^T)`` plus a constant, where
    ``w* = w cross^T H^-1``; so GPTQ on ``w*`` with ``H`` minimizes the error against the full-precision
    outputs (GPTAQ's asymmetric calibration, Li et al. 2025). Regularized toward ``w``:
    ``w* = w (cross^T + l I)(H + l I)^-1`` with ``l = damp * mean(diag H)``, so ``x = x_fp`` gives ``w``.
    """
    k = h.shape[0]
    eye = torch.eye(k, dtype=torch.float64, device=h.device)
    lam = damp * h.diagonal().mean().double()
    lower = torch.linalg.cholesky(h.double() + lam * eye)
    rhs = (cross.double() + lam * eye) @ w.double().t()  # (K, N) = (w (cross^T + l I))^T
    return torch.cholesky_solve(rhs, lower).t().float()  # (N, K)
