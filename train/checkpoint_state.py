"""What an engine checkpoint holds besides the format: per-group arrays, engine state as JSON, RNG states.

Used by :mod:`zspeed.train.checkpoint`. A flat group's *arrays* are 1-D
tensors over this rank's chunk ``[lo, hi)`` of the group's full flat layout
(see :class:`~zspeed.train.param_group_state.FlatParamGroup`):

* trainable groups: ``master`` (fp32) and every optimizer-state tensor with the
  master's size (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...);
* frozen groups: ``param`` (the compute dtype).

Stage 0 keeps whole (replicated) buffers; each rank still stores only its chunk,
so every stage writes the same layout (:func:`~zspeed.train.checkpoint_format.group_layout`
of the group's ``FlatGroup``). Scalar optimizer state (Adam's ``step``) is the
same for every master and goes into the JSON metadata.
"""
from __future__ import annotations

import json
import random
from typing import Any

import torch

from .checkpoint_format import CheckpointFormatError
from .param_group_state import FlatParamGroup

__all__ = ["MASTER", "PARAM", "chunk_of", "local_arrays", "set_local_arrays", "optimizer_scalars",
           "optimizer_hyperparams", "restore_hyperparams", "rng_state", "restore_rng", "jsonable",
           "tied_aliases", "parameter_shapes"]

MASTER = "master"
PARAM = "param"


def chunk_of(g: FlatParamGroup, t: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of ``t``: ``t`` itself when it is already the chunk, else ``t[lo:hi]``."""
    return t if t.numel() == g.hi - g.lo else t[g.lo:g.hi]


def local_arrays(g: FlatParamGroup, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The group's arrays as they live on this rank (device or host), chunked."""
    if not g.trainable:
        if g.source is not None:  # parameter offload: the chunk lives in the store
            return {PARAM: g.source.values(g)}
        return {PARAM: chunk_of(g, g.shard if g.shard is not None else g.full)}
    state = optimizer.state.get(g.master, {})
    out = {MASTER: chunk_of(g, g.master)}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.numel() == g.master.numel() and v.numel() > 1:
            out[k] = chunk_of(g, v)
        elif isinstance(v, torch.Tensor) and v.numel() > 1:
            raise CheckpointFormatError(f"optimizer state {k!r} of {g.names[0]!r} has {v.numel()} elements for a "
                                        f"parameter chunk of {g.master.numel()}: quantized or factored optimizer "
                                        "state is not checkpointable by zspeed; use Adam, AdamW or SGD")
    return out


def set_local_arrays(g: FlatParamGroup, optimizer: torch.optim.Optimizer, arrays: dict[str, torch.Tensor],
                     scalars: dict[str, Any]) -> None:
    """Write loaded arrays (host, covering the range the group keeps) into the group and the optimizer."""
    if not g.trainable:
        return
    g.master.copy_(arrays[MASTER])
    states = {k: v for k, v in arrays.items() if k != MASTER}
    if not states:
        return
    pg = next(pg for pg in optimizer.param_groups if any(p is g.master for p in pg["params"]))
    state: dict[str, Any] = {k: v.to(g.master.device, g.master.dtype) for k, v in states.items()}
    for k, value in scalars.items():
        state[k] = _scalar_tensor(value, pg, g.master) if k == "step" else value
    optimizer.state[g.master] = state


def _scalar_tensor(value: float, pg: dict[str, Any], master: torch.Tensor) -> torch.Tensor:
    """Adam's ``step`` as torch keeps it: on the parameter's device for fused/capturable, else on the CPU."""
    on_param = pg.get("fused") or pg.get("capturable")
    return torch.tensor(float(value), dtype=torch.float32, device=master.device if on_param else "cpu")


def optimizer_scalars(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Scalar per-parameter state (``step``), from the first parameter that has state."""
    for state in optimizer.state.values():
        out = {}
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                out[k] = float(v.item())
            elif isinstance(v, (int, float)):
                out[k] = v
        return out
    return {}


_HYPER_TYPES = (int, float, bool, tuple, list, type(None))


def optimizer_hyperparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in pg.items()
             if k != "params" and isinstance(v, _HYPER_TYPES)} for pg in optimizer.param_groups]


def restore_hyperparams(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointFormatError(f"the checkpoint has {len(saved)} optimizer param groups, this engine "
                                    f"{len(optimizer.param_groups)}; build the optimizer with the same groups")
    for pg, values in zip(optimizer.param_groups, saved):
        for k, v in values.items():
            if k in pg and isinstance(pg[k], _HYPER_TYPES):
                pg[k] = tuple(v) if isinstance(pg[k], tuple) else v


def rng_state(device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's generator states: tensors (torch CPU and device) and JSON (Python, NumPy)."""
    tensors = {"rng_cpu": torch.get_rng_state()}
    dev = device.get_rng_state()
    if dev is not None:
        tensors["rng_device"] = dev.cpu()
    version, internal, gauss = random.getstate()
    plain: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        plain["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return tensors, plain


def restore_rng(device, tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    if "rng_cpu" in tensors:
        torch.set_rng_state(tensors["rng_cpu"])
    if "rng_device" in tensors and device.is_cuda:
        device.set_rng_state(tensors["rng_device"])
    if "python" in plain:
        version, internal, gauss = plain["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in plain:
        import numpy as np
        kind, keys, pos, has_gauss, cached = plain["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def jsonable(value: Any, what: str) -> Any:
    """``value`` if it survives a JSON round trip unchanged in kind, else a clear error."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable (numbers, strings, lists, dicts) to go into "
                        f"zspeed_state.json: {e}; convert it (e.g. tensors with .tolist())") from None


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """Tied parameter names -> the first name of the same parameter."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def parameter_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in module.named_parameters(remove_duplicate=False)}
