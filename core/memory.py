"""Memory accounting: what ZeRO says each rank holds, and what it really holds.

[Note: the ZeRO formulas]
With Ψ parameters trained by Adam in mixed precision, a rank of a replicated
(stage 0) job holds 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and
12Ψ of optimizer state (fp32 master weights, momentum and variance): 16Ψ.
Stage 1 divides the optimizer state by the world size N, stage 2 the
gradients too, stage 3 the parameters too:

    stage 0: 2Ψ + 2Ψ + 12Ψ        stage 2: 2Ψ + (2Ψ + 12Ψ)/N
    stage 1: 2Ψ + 2Ψ + 12Ψ/N      stage 3: (2Ψ + 2Ψ + 12Ψ)/N

In fp32 there is no master copy: 4Ψ parameters, 4Ψ gradients, 8Ψ Adam state.
SGD with momentum keeps one state tensor (plus the fp32 master in mixed
precision), plain SGD none. Offloaded state lives in host memory, not on the
device; :func:`zero_memory_per_rank` reports both.

At stage 3 in mixed precision the 16-bit parameter shard duplicates the fp32
master; an implementation may instead cast the master when it gathers (FSDP2
and zspeed do), which leaves 14Ψ/N: ``separate_param_shard=False``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable

import torch


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def param_bytes(self) -> int:
        return 4 if self is Precision.FP32 else 2


class OptimizerKind(enum.Enum):
    ADAM = "adam"  # Adam and AdamW: two fp32 moments
    SGD_MOMENTUM = "sgd_momentum"
    SGD = "sgd"

    @property
    def state_bytes(self) -> int:
        """fp32 optimizer-state bytes per parameter, master copy excluded."""
        return {OptimizerKind.ADAM: 8, OptimizerKind.SGD_MOMENTUM: 4, OptimizerKind.SGD: 0}[self]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Bytes per rank, split by kind and by where they live."""

    params: int
    grads: int
    optimizer: int
    device_bytes: int
    host_bytes: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def zero_memory_per_rank(num_params: int, *, stage: int, world_size: int,
                         precision: Precision | str = Precision.BF16,
                         optimizer: OptimizerKind | str = OptimizerKind.ADAM,
                         offload_optimizer: bool = False, offload_param: bool = False,
                         separate_param_shard: bool = True) -> MemoryEstimate:
    """Model-state bytes one rank holds under ZeRO ``stage`` (see ``[Note: the ZeRO formulas]``).

    Exact shards are fractional here; real partitions add a little padding
    (at most ``world_size × alignment`` elements per bucket).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size}, {num_params}")
    if offload_param and stage != 3:
        raise ValueError("parameter offload needs ZeRO stage 3 (only stage 3 partitions parameters)")
    prec, opt = Precision(precision), OptimizerKind(optimizer)
    master = 0 if prec is Precision.FP32 else 4
    p, g, o = prec.param_bytes * num_params, prec.param_bytes * num_params, (master + opt.state_bytes) * num_params
    n = world_size
    params = p / n if stage >= 3 else p
    if stage == 3 and master and not separate_param_shard:
        params = 0  # the gathered 16-bit copy is cast from the fp32 master on demand
    grads = g / n if stage >= 2 else g
    optim = o / n if stage >= 1 else o
    host = (optim if offload_optimizer else 0) + (params if offload_param else 0)
    params, grads, optim = round(params), round(grads), round(optim)
    return MemoryEstimate(params=params, grads=grads, optimizer=optim,
                          device_bytes=params + grads + optim - round(host), host_bytes=round(host))


def tensor_bytes(tensors: Iterable[torch.Tensor], *, device_type: str | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once).

    With ``device_type`` only storages on that kind of device count.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        if device_type is not None and t.device.type != device_type:
            continue
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's per-parameter state (``step`` counters included)."""
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
