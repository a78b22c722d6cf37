"""Layout of the flat partition: every element owned exactly once, views round-trip."""
import math

import pytest
import torch

from zspeed.core.partition import FlatPartition

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def mixed_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 3), (1,), (129,), (), (33, 5, 2), (0,), (1000,), (3, 3)]
    out = []
    for i, shape in enumerate(shapes):
        dtype = DTYPES[i % len(DTYPES)]
        t = torch.randn(shape, generator=g) * 50
        out.append(t.to(dtype))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket_bytes", [math.inf, 64, 1000, 3])
def test_every_element_owned_once(world, bucket_bytes):
    tensors = mixed_tensors()
    part = FlatPartition.build(tensors, world_size=world, bucket_bytes=bucket_bytes)
    for group in part:
        owned = [torch.zeros(s.numel, dtype=torch.int32) for s in group.slots]
        for rank in range(world):
            for piece in group.pieces(rank):
                owned[group.slots.index(piece.slot)][piece.tensor_start:piece.tensor_start + piece.numel] += 1
                assert 0 <= piece.shard_start and piece.shard_start + piece.numel <= group.shard_numel
        for o in owned:
            assert torch.all(o == 1)
        assert group.full_numel == world * group.shard_numel
        assert group.full_numel >= group.data_numel


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_reassemble_bit_exact(world):
    tensors = mixed_tensors(1)
    part = FlatPartition.build(tensors, world_size=world, bucket_bytes=200)
    for group in part:
        mine = [tensors[s.index] for s in group.slots]
        full = group.flatten(mine)
        shards = [group.shard_of(full, r) for r in range(world)]
        # rebuild the full buffer from shards alone
        rebuilt = group.new_full()
        for r, shard in enumerate(shards):
            for b in group.buckets:
                lo, hi = b.chunk_range(r)
                rebuilt[lo:hi] = group.bucket_shard(shard, b)
        for slot, view in zip(group.slots, group.views(rebuilt)):
            assert view.shape == tensors[slot.index].shape
            assert torch.equal(view.view(torch.uint8) if view.numel() else view,
                               tensors[slot.index].view(torch.uint8) if view.numel() else tensors[slot.index])
        # pieces say exactly which values a shard holds
        for r, shard in enumerate(shards):
            for p in group.pieces(r):
                src = tensors[p.slot.index].reshape(-1)[p.tensor_start:p.tensor_start + p.numel]
                assert torch.equal(shard[p.shard_start:p.shard_start + p.numel], src)


def test_alignment_and_padding():
    t = [torch.zeros(10, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.float32)]
    part = FlatPartition.build(t, world_size=3, align_bytes=64)
    bf = part.groups[torch.bfloat16]
    assert bf.buckets[0].chunk % 32 == 0  # 64 bytes of bf16
    f32 = part.groups[torch.float32]
    assert f32.buckets[0].chunk % 16 == 0
    assert part.shard_bytes() * 3 == part.full_bytes()


def test_tensor_larger_than_bucket_and_shard():
    t = [torch.zeros(5), torch.zeros(10_000), torch.zeros(5)]
    part = FlatPartition.build(t, world_size=4, bucket_bytes=1024)
    g = part.groups[torch.float32]
    big = g.slots[1]
    assert g.buckets[big.bucket].slots == (1,)  # a bucket of its own
    assert g.ranks_of(big) == [0, 1, 2, 3]  # spans every rank's chunk
    assert g.ranks_of(g.slots[0]) == [0, 1]  # 5 elements over chunks of 4


def test_units_split_buckets():
    t = [torch.zeros(4) for _ in range(6)]
    part = FlatPartition.build(t, world_size=2, unit_ids=[0, 0, 1, 1, 1, 2])
    g = part.groups[torch.float32]
    assert [b.slots for b in g.buckets] == [(0, 1), (2, 3, 4), (5,)]


def test_meta_tensors_describe_layout_without_memory():
    t = [torch.empty(1 << 20, device="meta"), torch.empty(3, 5, device="meta", dtype=torch.bfloat16)]
    part = FlatPartition.build(t, world_size=8)
    assert part.groups[torch.float32].shard_numel * 8 >= 1 << 20


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size"),
    (dict(world_size=2, bucket_bytes=0), "bucket_bytes"),
    (dict(world_size=2, names=["a"]), "names"),
    (dict(world_size=2, unit_ids=[1, 0]), "non-decreasing"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlatPartition.build([torch.zeros(2), torch.zeros(3)], **kwargs)


def test_flatten_rejects_wrong_shape():
    part = FlatPartition.build([torch.zeros(2, 3)], world_size=2, names=["w"])
    with pytest.raises(ValueError, match="'w'"):
        part.groups[torch.float32].flatten([torch.zeros(3, 2)])
