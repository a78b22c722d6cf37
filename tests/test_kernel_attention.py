"""The slot attention kernel ([Note: slot attention kernel]) under the Triton interpreter vs its reference."""
from __future__ import annotations

import pytest
import torch

from zspeed.kernels.attention import attention_work, slot_attention, slot_attention_ref


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def cache(slots, kv_heads, max_len, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, kv_heads, max_len, dim, generator=g).to(dtype)
    values = torch.randn(slots, kv_heads, max_len, dim, generator=g).to(dtype)
    keys[:, :, -3:] = float("nan")  # never read: past every sequence's position
    values[:, :, -3:] = float("nan")
    return keys, values


def test_work_items_cut_segments_into_blocks():
    assert attention_work([(3, 0, 0, 5), (1, 7, 5, 1)], 2) == [3, 0, 0, 2, 3, 2, 2, 2, 3, 4, 4, 1, 1, 7, 5, 1]


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 2)], ids=["gqa4", "mha", "gqa3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 128])
def test_mixed_step_matches_reference(heads, kv_heads, dtype, dim):
    """A packed row: a whole prompt, a chunk after a cached prefix, decodes with lengths across key blocks."""
    keys, values = cache(5, kv_heads, 80, dim, dtype)
    # (slot, start, row, length): prompt of 7 at row 0, decode, chunk of 5 at position 30, decodes
    segments = [(2, 0, 0, 7), (0, 16, 7, 1), (4, 30, 8, 5), (3, 76, 13, 1), (1, 0, 14, 1)]
    query = torch.randn(heads, 15, dim).to(dtype)
    work = torch.tensor(attention_work(segments, 4), dtype=torch.int32)
    got = slot_attention(query, keys, values, work, 0.25, block_m=4, block_n=16)
    want = slot_attention_ref(query, keys, values, work.view(-1, 4), 0.25)
    assert got.shape == (15, heads, dim) and got.dtype == dtype and torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_decodes_only_strided_query_and_bad_shapes():
    """One-row items (block_m 1); the runner passes a view of its packed queries; bad head shapes refused."""
    keys, values = cache(2, 2, 40, 16, torch.float32)
    packed = torch.randn(1, 4, 9, 16)[:, :, :7]  # (1, heads, N, D) view, as a layer hands it over
    work = torch.tensor(attention_work([(1, 4, 6, 1), (0, 35, 3, 1)], 1), dtype=torch.int32)
    got = slot_attention(packed[0], keys, values, work, 0.3, block_m=1, block_n=16)
    want = slot_attention_ref(packed[0], keys, values, work.view(-1, 4), 0.3)
    torch.testing.assert_close(got[[6, 3]], want[[6, 3]], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        slot_attention(torch.randn(4, 3, 12), *cache(2, 2, 40, 12, torch.float32), work, 0.3, block_m=1)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        slot_attention(torch.randn(3, 3, 16), keys, values, work, 0.3, block_m=1)
