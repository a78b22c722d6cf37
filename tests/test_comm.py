"""Collectives on 2 and 3 gloo processes: all-gather is bit-exact, reduce-scatter matches the reference."""
import math

import pytest
import torch

from tests.dist_utils import run_distributed
from zspeed.core.comm import CommContext, ReduceOp, all_gather, reduce_scatter
from zspeed.core.partition import FlatPartition

SHAPES = [(7, 3), (1,), (129,), (), (33, 5, 2), (0,), (1000,), (3, 3), (17,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
BUCKETS = [math.inf, 256, 40, 4096]


def tensors_for(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 20).to(DTYPES[i % len(DTYPES)]) for i, s in enumerate(SHAPES)]


def _gather_case(topo):
    """Each rank fills only its shard from the common tensors; the gather must rebuild them all."""
    comm = CommContext(topo)
    tensors = tensors_for(0)
    for bucket_bytes in BUCKETS:
        part = FlatPartition.build(tensors, world_size=topo.world_size, bucket_bytes=bucket_bytes)
        handles = []
        for group in part:
            reference = group.flatten([tensors[s.index] for s in group.slots])
            shard = group.shard_of(reference, topo.rank)
            full = torch.full_like(reference, 99)  # poison: every element must be written
            handles.append((group, full, all_gather(group, shard=shard, full=full, topo=topo, comm=comm)))
        for group, full, h in handles:  # several gathers in flight at once
            h.wait()
            for slot, view in zip(group.slots, group.views(full)):
                expect = tensors[slot.index]
                assert torch.equal(view.view(torch.uint8) if view.numel() else view,
                                   expect.view(torch.uint8) if expect.numel() else expect), \
                    (bucket_bytes, slot.name)
    return True


def _gather_subset_case(topo):
    tensors = tensors_for(3)
    part = FlatPartition.build(tensors, world_size=topo.world_size, bucket_bytes=64)
    group = part.groups[torch.float32]
    ref = group.flatten([tensors[s.index] for s in group.slots])
    full = torch.zeros_like(ref)
    all_gather(group, shard=group.shard_of(ref, topo.rank), full=full, topo=topo, buckets=[1], async_op=False)
    b = group.buckets[1]
    assert torch.equal(group.bucket_full(full, b), group.bucket_full(ref, b))
    others = torch.cat([group.bucket_full(full, x) for x in group.buckets if x.index != 1])
    assert torch.all(others == 0)
    return True


def _reduce_case(topo, op_name, grad_dtype, reduce_dtype, accumulate):
    op = ReduceOp(op_name)
    comm = CommContext(topo)
    world = topo.world_size
    shapes = [(7, 3), (129,), (1,), (40, 4), (5,)]
    for bucket_bytes in BUCKETS:
        grads_by_rank = [[torch.randn(s, generator=torch.Generator().manual_seed(100 * r + i)).to(grad_dtype)
                          for i, s in enumerate(shapes)] for r in range(world)]
        part = FlatPartition.build(grads_by_rank[0], world_size=world, bucket_bytes=bucket_bytes)
        group = part.groups[grad_dtype]
        full = group.flatten(grads_by_rank[topo.rank])
        start = torch.randn(group.shard_numel, generator=torch.Generator().manual_seed(7)).to(grad_dtype)
        shard = start.clone()
        reduce_scatter(group, full=full, shard=shard, topo=topo, op=op, reduce_dtype=reduce_dtype,
                       accumulate=accumulate, comm=comm).wait()
        # Reference in float64: sum (or mean) of every rank's full buffer, then our chunk.
        fulls = [group.flatten([t.double() for t in grads_by_rank[r]], out=torch.zeros(group.full_numel,
                 dtype=torch.float64)) for r in range(world)]
        total = torch.stack(fulls).sum(0)
        if op is ReduceOp.AVG:
            total /= world
        expect = group.shard_of(total, topo.rank)
        if accumulate:
            expect += start.double()
        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[grad_dtype]
        torch.testing.assert_close(shard.double(), expect, rtol=tol, atol=tol)
    return True


REDUCE_CASES = [("sum", torch.float32, None, False), ("avg", torch.float32, None, True),
                ("avg", torch.bfloat16, torch.float32, False), ("sum", torch.float16, torch.float32, True),
                ("avg", torch.bfloat16, None, False)]


def _reduce_cases(topo):
    return all(_reduce_case(topo, *case) for case in REDUCE_CASES)


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_bit_exact(world):
    assert all(run_distributed(_gather_case, world))


def test_all_gather_selected_buckets():
    assert all(run_distributed(_gather_subset_case, 2))


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_matches_reference(world):
    assert all(run_distributed(_reduce_cases, world))


@pytest.mark.parametrize("grad_dtype,reduce_dtype,shard_dtype", [
    (torch.bfloat16, torch.float32, torch.bfloat16), (torch.float16, torch.float32, torch.float32),
    (torch.float32, None, torch.bfloat16), (torch.float32, torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_reduce_scatter_over_one_rank_is_bit_exact(grad_dtype, reduce_dtype, shard_dtype, accumulate, monkeypatch):
    """[Note: one rank]: the shortcut gives, bit for bit, what the general path computes (forced by reporting a
    world of two to the shortcut's test); reduce dtypes that round the gradients (bf16 for fp32 gradients, fp16
    for bf16 ones) still round them."""
    import zspeed.core.comm as comm_mod
    from zspeed.core.topology import Topology

    topo = Topology.single()
    g = torch.Generator().manual_seed(5)
    grads = [(torch.randn(s, generator=g) * 300).to(grad_dtype) for s in [(7, 3), (129,), (40, 4)]]
    for bucket_bytes in BUCKETS:
        group = FlatPartition.build(grads, world_size=1, bucket_bytes=bucket_bytes).groups[grad_dtype]
        start = torch.randn(group.shard_numel, generator=g).to(shard_dtype)
        outs = []
        for shortcut in (True, False):
            if not shortcut:
                monkeypatch.setattr(comm_mod, "_exact_in", lambda *a: False)
            shard = start.clone()
            reduce_scatter(group, full=group.flatten(grads), shard=shard, topo=topo, op=ReduceOp.AVG,
                           reduce_dtype=reduce_dtype, accumulate=accumulate, async_op=False)
            outs.append(shard)
        monkeypatch.undo()
        assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8)), bucket_bytes
        full = group.flatten(grads).to(reduce_dtype or grad_dtype)
        expect = start + full.to(shard_dtype) if accumulate else full.to(shard_dtype)
        assert torch.equal(outs[0], expect)


def _piecewise_case(topo):
    """A bucket larger than the cast piece reduces in pieces with the same result."""
    import zspeed.core.comm as comm_mod
    comm_mod.CAST_PIECE_NUMEL = 7  # force several pieces, one of them partial
    return _reduce_case(topo, "avg", torch.bfloat16, torch.float32, True) and \
        _reduce_case(topo, "sum", torch.float16, torch.float32, False)


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_in_cast_pieces(world):
    assert all(run_distributed(_piecewise_case, world))
