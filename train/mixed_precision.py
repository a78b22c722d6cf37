"""Mixed precision: which dtype each of the engine's tensors has.

[Note: where each dtype lives]
* Compute parameters (the module's ``nn.Parameter`` views) and the gradients
  autograd produces are in ``param_dtype`` (bf16, fp16 or fp32).
* Gradients are reduced across ranks in ``reduce_dtype`` (fp32 for 16-bit
  training: a bf16 sum of many ranks loses bits) and kept, between micro-batches,
  in ``param_dtype`` (the ZeRO formulas count 2 bytes per gradient).
* The optimizer updates an fp32 *master* copy (``master_dtype``) of this rank's
  shard. In fp32 training there is no separate master: the fp32 parameters
  themselves (or this rank's chunk of them) are what the optimizer updates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .config_schema import Precision

__all__ = ["MixedPrecision"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPrecision:
    """The dtypes of one training run (see ``[Note: where each dtype lives]``).

    precision: the run's precision (fp32, bf16, fp16).
    cast_forward_inputs: cast floating-point tensors passed to the engine's forward
        to ``param_dtype`` (integer inputs such as token ids are left alone).
    """

    precision: Precision = Precision.FP32
    cast_forward_inputs: bool = True

    @property
    def param_dtype(self) -> torch.dtype:
        return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16,
                Precision.FP16: torch.float16}[self.precision]

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def reduce_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def has_master(self) -> bool:
        """Whether the optimizer updates a separate fp32 copy (16-bit training)."""
        return self.param_dtype != self.master_dtype

    @property
    def needs_loss_scaling(self) -> bool:
        return self.precision is Precision.FP16

    def compute_dtype_for(self, tensor: torch.Tensor) -> torch.dtype:
        """The dtype a parameter trains in: floating parameters take ``param_dtype``."""
        return self.param_dtype if tensor.is_floating_point() else tensor.dtype

    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if not (self.cast_forward_inputs and self.has_master):
            return args, kwargs
        dtype = self.param_dtype

        def cast(x: Any) -> Any:
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        return tree_map(cast, args), tree_map(cast, kwargs)

