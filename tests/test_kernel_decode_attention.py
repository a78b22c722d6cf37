"""The slot decode-attention kernel ([Note: slot decode attention]) under the Triton interpreter vs its reference."""
from __future__ import annotations

import os

import pytest
import torch

from zspeed.kernels.decode_attention import slot_decode_attention, slot_decode_attention_ref


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert os.environ["TRITON_INTERPRET"] == "1"


def cache(slots, kv_heads, max_len, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, kv_heads, max_len, dim, generator=g).to(dtype)
    values = torch.randn(slots, kv_heads, max_len, dim, generator=g).to(dtype)
    keys[:, :, -3:] = float("nan")  # never read: past every sequence's length
    values[:, :, -3:] = float("nan")
    return keys, values


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 2)], ids=["gqa4", "mha", "gqa3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 128])
def test_kernel_matches_reference(heads, kv_heads, dtype, dim):
    max_len = 80
    keys, values = cache(5, kv_heads, max_len, dim, dtype)
    # decodes in a packed row of 9 tokens: rows out of order, lengths across block boundaries (BLOCK_N 16 here)
    slots, lengths, rows = torch.tensor([3, 0, 4, 1]), torch.tensor([1, 17, 77, 32]), torch.tensor([8, 2, 0, 5])
    query = torch.randn(heads, 9, dim).to(dtype)
    got = slot_decode_attention(query, keys, values, slots, lengths, rows, 0.25, block_n=16)
    want = slot_decode_attention_ref(query, keys, values, slots, lengths, rows, 0.25)
    assert got.shape == (4, heads, dim) and got.dtype == dtype and torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_strided_query_view_and_bad_shapes():
    """The runner passes a view of its packed queries ``(heads, N, D)``; odd head_dims and groups are refused."""
    keys, values = cache(2, 2, 40, 16, torch.float32)
    packed = torch.randn(1, 4, 7, 16)  # (1, heads, N, D), as the layer hands it over
    args = (torch.tensor([1, 0]), torch.tensor([5, 36]), torch.tensor([6, 3]), 0.3)
    got = slot_decode_attention(packed[0, :, :7], keys, values, *args, block_n=16)
    torch.testing.assert_close(got, slot_decode_attention_ref(packed[0], keys, values, *args), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        slot_decode_attention(torch.randn(4, 3, 12), *cache(2, 2, 40, 12, torch.float32), *args)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        slot_decode_attention(torch.randn(3, 3, 16), keys, values, *args)
