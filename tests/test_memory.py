"""The ZeRO formulas, and a partitioned state that holds what they say (within padding)."""
import pytest
import torch

from tests.dist_utils import run_distributed
from zspeed.core.memory import MemoryEstimate, tensor_bytes, zero_memory_per_rank
from zspeed.core.partition import FlatPartition

PSI = 1_000_000


@pytest.mark.parametrize("stage, expect", [
    (0, (2, 2, 12)), (1, (2, 2, 12 / 4)), (2, (2, 2 / 4, 12 / 4)), (3, (2 / 4, 2 / 4, 12 / 4))])
def test_mixed_precision_adam_formulas(stage, expect):
    est = zero_memory_per_rank(PSI, stage=stage, world_size=4, precision="bf16")
    assert (est.params, est.grads, est.optimizer) == tuple(round(x * PSI) for x in expect)
    assert est.device_bytes == est.total and est.host_bytes == 0


def test_stage0_is_16_psi_and_stage3_divides_it():
    assert zero_memory_per_rank(PSI, stage=0, world_size=8).total == 16 * PSI
    assert zero_memory_per_rank(PSI, stage=3, world_size=8).total == 2 * PSI


def test_fp32_and_sgd_and_offload():
    assert zero_memory_per_rank(PSI, stage=0, world_size=2, precision="fp32").total == 16 * PSI  # 4+4+8
    assert zero_memory_per_rank(PSI, stage=0, world_size=2, precision="fp32", optimizer="sgd").total == 8 * PSI
    off = zero_memory_per_rank(PSI, stage=2, world_size=2, offload_optimizer=True)
    assert off.host_bytes == off.optimizer and off.device_bytes == off.params + off.grads
    with pytest.raises(ValueError, match="stage 3"):
        zero_memory_per_rank(PSI, stage=2, world_size=2, offload_param=True)
    with pytest.raises(ValueError, match="stage"):
        zero_memory_per_rank(PSI, stage=4, world_size=2)


def test_tensor_bytes_counts_storages_once():
    a = torch.zeros(100)
    assert tensor_bytes([a, a[10:], a.view(10, 10)]) == 400
    assert tensor_bytes([a, torch.zeros(3, dtype=torch.bfloat16)]) == 406


def _zero_state_bytes(topo, stage, shapes):
    """Hold model state the way ZeRO ``stage`` does on this rank; return the bytes it takes."""
    params = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    part = FlatPartition.build(params, world_size=topo.world_size, bucket_bytes=1 << 16)
    group = part.groups[torch.bfloat16]
    full_params = group.flatten(params)
    shard_params = group.shard_of(full_params, topo.rank)
    held_params = shard_params if stage >= 3 else full_params
    held_grads = group.new_shard() if stage >= 2 else group.new_full()
    master_src = shard_params if stage >= 1 else full_params
    optim = [master_src.float(), torch.zeros_like(master_src, dtype=torch.float32),
             torch.zeros_like(master_src, dtype=torch.float32)]
    return tensor_bytes([held_params, held_grads, *optim]), group.data_numel, part.world_size


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_partitioned_state_matches_formula(stage):
    shapes = [(64, 33), (33,), (100, 7), (5,), (257,)]
    for held, numel, world in run_distributed(_zero_state_bytes, 2, stage, shapes):
        est: MemoryEstimate = zero_memory_per_rank(numel, stage=stage, world_size=world)
        assert est.total <= held <= est.total * 1.05 + 16 * world * 16  # padding only


def test_stage3_without_a_separate_16bit_shard():
    est = zero_memory_per_rank(PSI, stage=3, world_size=4, separate_param_shard=False)
    assert (est.params, est.grads, est.optimizer) == (0, PSI // 2, 3 * PSI)
    # fp32 training has no master to cast from: the parameters are the shard
    assert zero_memory_per_rank(PSI, stage=3, world_size=4, precision="fp32",
                                separate_param_shard=False).params == PSI
