"""Build the optimizer a parsed ``optimizer`` config section asks for.

Adam / AdamW / SGD are torch's own, in their ``fused`` form where every
parameter lives on one device type that has fused kernels (CUDA and, since
torch 2.4, the CPU: the CPU-offload step runs there) with a float32/16/bf16
dtype, and in their ``foreach`` form otherwise. ``AdamW8bit`` comes from
bitsandbytes, imported only when asked for.

DeepSpeed semantics kept: ``"type": "Adam"`` applies weight decay decoupled
(AdamW) unless ``adam_w_mode`` is false, as DeepSpeed's fused and CPU Adam do.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .config_schema import AdamParams, AdamW8bitParams, OptimizerConfig, OptimizerType, SGDParams

__all__ = ["build_optimizer", "fused_supported"]

_FUSED_DEVICE_TYPES = frozenset({"cuda", "cpu"})
_FUSED_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def fused_supported(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether torch's fused optimizer kernels can update all of ``tensors`` together."""
    tensors = list(tensors)
    if not tensors:
        return False
    device_types = {t.device.type for t in tensors}
    return (len(device_types) == 1 and device_types <= _FUSED_DEVICE_TYPES
            and all(t.dtype in _FUSED_DTYPES and not t.is_sparse for t in tensors))


def build_optimizer(params: ParamsT, config: OptimizerConfig, *, fused: bool | None = None) -> torch.optim.Optimizer:
    """Build ``config``'s optimizer over ``params`` (tensors, or torch param-group dicts).

    Args:
        params: the tensors to optimise, or param groups; a group's own keys
            (e.g. ``weight_decay: 0.0`` for biases) override the config.
        config: the parsed ``optimizer`` section.
        fused: None picks ``fused`` when :func:`fused_supported`, else ``foreach``;
            True / False force one (ignored for AdamW8bit).

    Raises:
        ImportError: AdamW8bit without bitsandbytes installed, saying how to install it.
    """
    groups = _as_groups(params)
    if config.type is OptimizerType.ADAMW_8BIT:
        assert isinstance(config.params, AdamW8bitParams)
        return _adamw_8bit(groups, config.params)
    all_params = [p for g in groups for p in g["params"]]
    use_fused = fused_supported(all_params) if fused is None else fused
    impl: dict[str, Any] = {"fused": True} if use_fused else {"foreach": True}
    if config.type is OptimizerType.SGD:
        p = config.params
        assert isinstance(p, SGDParams)
        return torch.optim.SGD(groups, lr=p.lr, momentum=p.momentum, dampening=p.dampening,
                               weight_decay=p.weight_decay, nesterov=p.nesterov, **impl)
    p = config.params
    assert isinstance(p, AdamParams)
    decoupled = config.type is OptimizerType.ADAMW or p.adam_w_mode
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(groups, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay, amsgrad=p.amsgrad, **impl)


def _as_groups(params: ParamsT) -> list[dict[str, Any]]:
    items = list(params)
    if not items:
        raise ValueError("build_optimizer got no parameters to optimise")
    if all(isinstance(i, dict) for i in items):
        return [dict(g, params=list(g["params"])) for g in items]
    if all(isinstance(i, torch.Tensor) for i in items):
        return [{"params": items}]
    raise TypeError("params must be all tensors or all param-group dicts")


def _adamw_8bit(groups: list[dict[str, Any]], p: AdamW8bitParams) -> torch.optim.Optimizer:
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError(
            "optimizer type AdamW8bit needs bitsandbytes, which is not installed: "
            "pip install 'zspeed[quant]'  (or: pip install 'bitsandbytes>=0.45')") from e
    return bnb.optim.AdamW8bit(groups, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay,
                               amsgrad=p.amsgrad)
