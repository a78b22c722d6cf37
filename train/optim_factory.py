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

__all__ = ["build_optimizer", "flat_adam_state", "fused_supported"]

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


def flat_adam_state(optimizer: torch.optim.Optimizer, *, on_cpu: bool = False) -> bool:
    """Give torch's Adam / AdamW their moments up front, as views of one flat buffer per moment
    (per device and dtype) instead of one tensor per parameter made at the first ``step()``.

    The values are what torch would make (zeros, and its own ``step`` tensor), so the updates are
    the same bit for bit. What changes is the allocator's view: two allocations made at build time,
    in fresh memory, instead of two per parameter made after the first backward, when the cache is
    full of freed activation blocks that the moments would land in with unsplit slack (half of the
    2 MB by which the ZeRO-2 benchmark's peak exceeded DeepSpeed's, whose moments are one flat
    buffer each; the rest was the groups' own buffers: train/storage_pack.py).

    Returns False and changes nothing for other optimizers, ``amsgrad``, CPU
    parameters unless ``on_cpu`` (the host update of offload keeps its own layout, and a checkpoint
    writes CPU tensors without copying them, which safetensors refuses for views of one buffer) or
    state that already exists.
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or optimizer.state:
        return False
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    on_host = any(p.device.type == "cpu" for p in params)
    if not params or any(g.get("amsgrad") for g in groups) or (on_host and not on_cpu):
        return False
    from torch.optim.optimizer import _get_scalar_dtype  # the dtype torch gives ``step``

    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.device, p.dtype), []).append(p)
    for (device, dtype), ps in by_kind.items():
        total = sum(p.numel() for p in ps)
        moments = [torch.zeros(total, dtype=dtype, device=device) for _ in range(2)]
        offset = 0
        for p in ps:
            views = [m[offset:offset + p.numel()].view_as(p) for m in moments]
            offset += p.numel()
            optimizer.state[p] = {"exp_avg": views[0], "exp_avg_sq": views[1]}
    # ``step`` too: on the device (fused or capturable) torch makes one 0-dim tensor per parameter, each
    # its own 512-byte block; here they are elements of one buffer per group (each still counted apart).
    # Off the device they stay separate CPU scalars, as torch makes them.
    for g in groups:
        if g["capturable"] or g["fused"]:
            steps = torch.zeros(len(g["params"]), dtype=_get_scalar_dtype(is_fused=g["fused"]),
                                device=g["params"][0].device)
            for i, p in enumerate(g["params"]):
                optimizer.state[p]["step"] = steps[i]
        else:
            for p in g["params"]:
                optimizer.state[p]["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
    return True
