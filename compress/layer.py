"""Compress one ``nn.Linear`` according to a method config (the per-layer step of
``quantize_model`` / ``sparsify_model``)."""
from __future__ import annotations

import torch
from torch import nn

from .calib import ColumnNormStat, CrossHessianStat, HessianStat
from .config import GPTQConfig, MagnitudeConfig, NF4Config, RTNConfig, WandaConfig, with_scale_dtype
from .formats import check_group_size, quantize_int4, quantize_int8
from .gptq import gptq_quantize
from .modules import NF4Linear, QuantLinear, SparseLinear
from .nf4 import check_nf4_shape, quantize_nf4
from .nm import NMWeight, check_nm_shape, compress_nm, prune_nm
from .uniform import SCALE_DTYPES


def stat_type(config) -> type | None:
    """The calibration statistic a method needs (``None``: data-free)."""
    if isinstance(config, GPTQConfig) and config.fp_targets:
        return CrossHessianStat
    return {GPTQConfig: HessianStat, WandaConfig: ColumnNormStat}.get(type(config))


def check_linear(name: str, linear: nn.Linear, config) -> None:
    """Fail early, naming the module, when its shape does not fit the format."""
    k = linear.in_features
    if isinstance(config, NF4Config):
        check_nf4_shape(k, config.blocksize, name=name)
        return
    if isinstance(config, (RTNConfig, GPTQConfig)):
        if config.bits == 4:
            check_group_size(k, config.group_size, name=name, pad_groups=config.pad_groups)
        return
    check_nm_shape(k, config.n, config.m, name=name)
    if config.quant_bits:
        check_group_size(k, config.group_size, name=name, pad_groups=config.pad_groups)


def quantize_linear(linear: nn.Linear, config: RTNConfig | GPTQConfig, stat: HessianStat | None = None) -> QuantLinear:
    """INT8/INT4 by RTN, or by GPTQ with the layer's Hessian ``stat``."""
    w = linear.weight.detach()
    sdt = SCALE_DTYPES[with_scale_dtype(config, w.dtype).scale_dtype]
    if isinstance(config, GPTQConfig):
        if stat is None:
            raise ValueError("GPTQ needs calibration data: pass calib=... to quantize_model")
        cross = stat.cross if isinstance(stat, CrossHessianStat) else None
        q = gptq_quantize(w, stat.h, config, cross=cross)
    elif config.bits == 8:
        q = quantize_int8(w, scale_dtype=sdt)
    else:
        q = quantize_int4(w, group_size=config.group_size, symmetric=config.symmetric, scale_dtype=sdt,
                          pad_groups=config.pad_groups)
    return QuantLinear.from_weight(q, linear.bias, dtype=w.dtype)


def nf4_linear(linear: nn.Linear, config: NF4Config) -> NF4Linear:
    """NF4 by round-to-nearest (the plain-PyTorch reference; bitsandbytes' quantizer gives the same codes)."""
    w = linear.weight.detach()
    q = quantize_nf4(w, blocksize=config.blocksize)
    return NF4Linear.from_weight(q, linear.bias, compute_dtype=config.compute_dtype, dtype=w.dtype)


def prune_scores(w: torch.Tensor, config: MagnitudeConfig | WandaConfig,
                 stat: ColumnNormStat | None = None) -> torch.Tensor:
    """Magnitude: ``|W|``. Wanda: ``|W_ij| * ||X_j||_2``."""
    scores = w.abs().float()
    if isinstance(config, WandaConfig):
        if stat is None:
            raise ValueError("Wanda needs calibration data: pass calib=... to sparsify_model")
        scores = scores * stat.norms().to(scores.device)[None, :]
    return scores


def sparsify_linear(linear: nn.Linear, config: MagnitudeConfig | WandaConfig,
                    stat: ColumnNormStat | None = None) -> SparseLinear:
    """Prune to N:M, store compressed, and (``quant_bits=4``) quantize the kept values."""
    w = linear.weight.detach()
    pruned = prune_nm(w, prune_scores(w, config, stat), n=config.n, m=config.m)
    nm = compress_nm(pruned, n=config.n, m=config.m)
    if config.quant_bits:
        group_c = config.group_size * config.n // config.m  # kept values per group
        q = quantize_int4(nm.values, group_size=group_c, symmetric=config.symmetric,
                          scale_dtype=SCALE_DTYPES[with_scale_dtype(config, w.dtype).scale_dtype],
                          pad_groups=config.pad_groups)
        nm = NMWeight(values=q, meta=nm.meta, n=nm.n, m=nm.m, in_features=nm.in_features)
    return SparseLinear.from_weight(nm, linear.bias, group_size=config.group_size, dtype=w.dtype)


def compress_linear(linear: nn.Linear, config, stat=None) -> nn.Module:
    """The drop-in module for ``linear`` under ``config``; its ``compress_stats``
    record the weight error (``save_compressed`` writes them, ``zcompress inspect`` shows them)."""
    if isinstance(config, NF4Config):
        new = nf4_linear(linear, config)
    elif isinstance(config, (RTNConfig, GPTQConfig)):
        new = quantize_linear(linear, config, stat)
    else:
        new = sparsify_linear(linear, config, stat)
    new.compress_stats = weight_error(linear.weight.detach(), new.dequantize(torch.float32))
    return new


def weight_error(w: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """Relative Frobenius error, max and mean absolute error of ``approx`` against ``w``."""
    w = w.float()
    diff = (approx.to(w.device) - w)
    return {"rel_err": (diff.norm() / w.norm().clamp(min=1e-30)).item(),
            "max_abs_err": diff.abs().max().item(), "mean_abs_err": diff.abs().mean().item()}
