"""The ZeRO stage as a policy: what is sharded, and when gradients are reduced.

One engine, one set of buffers (:mod:`zspeed.train.param_group_state`); the
stage only decides which buffers are full and which are this rank's shard:

=========  ==========================  ==============================  ===========================
stage      optimizer state + master    gradients                       parameters
=========  ==========================  ==============================  ===========================
0          full (replicated)           full; all-reduced at boundary   full
1          shard                       full; reduce-scattered at       full; all-gathered after step
                                       boundary
2          shard                       shard; reduce-scattered per     full; all-gathered after step
                                       unit as backward produces them
3          shard                       shard (as stage 2)              shard; gathered per unit
                                                                       around its forward/backward
=========  ==========================  ==============================  ===========================

[Note: gradient accumulation and communication]
Stages 0 and 1 hold full gradients anyway, so micro-batches accumulate locally
into the full gradient buffer (autograd adds into it in place) and nothing is
communicated before the accumulation boundary. Stages 2 and 3 keep only a
gradient shard; holding full gradients across micro-batches would cost the
memory those stages exist to save, so every micro-batch reduce-scatters each
unit's gradients (in fp32) and adds them into the shard (``accumulate=True``).
That is DeepSpeed's choice for stage 2 as well.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["GradReduction", "UnitSplit", "StagePolicy"]


class GradReduction(enum.Enum):
    """How and when gradients cross ranks."""

    ALL_REDUCE_AT_BOUNDARY = "all_reduce_at_boundary"
    REDUCE_SCATTER_AT_BOUNDARY = "reduce_scatter_at_boundary"
    REDUCE_SCATTER_PER_UNIT = "reduce_scatter_per_unit"


class UnitSplit(enum.Enum):
    """How parameters are grouped into units (one collective per unit and dtype)."""

    BY_SIZE = "by_size"  # consecutive parameters up to a bucket size (stages 0-2)
    BY_MODULE = "by_module"  # one unit per submodule, gathered around its use (stage 3)


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePolicy:
    stage: int
    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool

    @classmethod
    def for_stage(cls, stage: int) -> "StagePolicy":
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        return cls(stage=stage, shard_optimizer=stage >= 1, shard_grads=stage >= 2, shard_params=stage >= 3)

    @property
    def grad_reduction(self) -> GradReduction:
        if self.shard_grads:
            return GradReduction.REDUCE_SCATTER_PER_UNIT
        if self.shard_optimizer:
            return GradReduction.REDUCE_SCATTER_AT_BOUNDARY
        return GradReduction.ALL_REDUCE_AT_BOUNDARY

    @property
    def unit_split(self) -> UnitSplit:
        return UnitSplit.BY_MODULE if self.shard_params else UnitSplit.BY_SIZE

    @property
    def keeps_full_grads(self) -> bool:
        """Whether a full gradient buffer lives across micro-batches (stages 0-1)."""
        return not self.shard_grads

    @property
    def grads_replicated(self) -> bool:
        """Whether every rank ends up with the whole reduced gradient (stage 0): the
        global norm is then local, not a sum over shards."""
        return not self.shard_optimizer
