"""The optimizer step over master shards: overflow check, unscale, clip, step, publish.

The torch optimizer's parameters are the groups' ``master`` tensors (one flat
fp32 tensor per flat group: this rank's shard from stage 1 on), so its state
is sharded exactly as the masters are. Before it steps, every ``master.grad``
holds this rank's reduced fp32 gradient (see
:meth:`FlatParamGroup.reduce_at_boundary` and
:meth:`FlatParamGroup.sharded_grad_to_master`).

[Note: the global gradient norm]
Each rank sums the squares of its shard's gradient (padding is zero, so it adds
nothing), one all-reduce adds the ranks' sums, and the square root is the norm
of the whole gradient, the number ``torch.nn.utils.clip_grad_norm_`` computes
on an unsharded model. At stage 0 every rank holds the whole gradient, so the
local sum is already the total.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.comm import ReduceOp, all_reduce, all_reduce_max
from ..core.topology import Topology
from .loss_scaler import LossScaler, grads_have_inf_or_nan
from .param_group_state import FlatParamGroup
from .stage_policy import StagePolicy

__all__ = ["StepOutcome", "MasterOptimizer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutcome:
    applied: bool  # False: skipped because a gradient overflowed (fp16)
    grad_norm: float  # global norm before clipping (nan when skipped)
    loss_scale: float  # the scale the gradients were computed with (1.0 without fp16)


class MasterOptimizer:
    """Runs one optimizer step over the flat groups' masters."""

    def __init__(self, *, optimizer: torch.optim.Optimizer, groups: list[FlatParamGroup], policy: StagePolicy,
                 topo: Topology, scaler: LossScaler | None = None, clip_norm: float = 0.0):
        self.optimizer = optimizer
        self.groups = [g for g in groups if g.trainable]
        self.policy, self.topo, self.scaler, self.clip_norm = policy, topo, scaler, clip_norm

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale if self.scaler is not None else 1.0

    def step(self) -> StepOutcome:
        scale = self.loss_scale
        grads = [g.master.grad for g in self.groups]
        if self.scaler is not None:
            overflow = grads_have_inf_or_nan(grads, reduce_flag=lambda t: all_reduce_max(t, topo=self.topo))
            if not self.scaler.update(overflow):
                return StepOutcome(applied=False, grad_norm=math.nan, loss_scale=scale)
            if scale != 1.0:
                torch._foreach_mul_(grads, 1.0 / scale)
        norm = self.global_grad_norm(grads)
        if self.clip_norm > 0:
            coef = min(1.0, self.clip_norm / (norm + 1e-6))
            torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        for g in self.groups:
            g.publish()
        return StepOutcome(applied=True, grad_norm=norm, loss_scale=scale)

    def global_grad_norm(self, grads: list[torch.Tensor]) -> float:
        """See ``[Note: the global gradient norm]``."""
        device = self.topo.device.device
        if grads:
            sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()
        else:
            sq = torch.zeros((), dtype=torch.float32, device=device)
        sq = sq.reshape(1).to(device)
        if not self.policy.grads_replicated:
            all_reduce(sq, topo=self.topo, op=ReduceOp.SUM)
        return float(sq.sqrt().item())
