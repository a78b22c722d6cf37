"""N:M masks, compressed storage, magnitude and Wanda pruning, 2:4 + INT4."""
import pytest
import torch
from torch import nn

from zspeed.compress import MagnitudeConfig, WandaConfig, compress_nm, nm_mask, prune_nm
from zspeed.compress.calib import ColumnNormStat
from zspeed.compress.layer import sparsify_linear


def _w(n=16, k=64, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (1, 8), (3, 16)])
def test_mask_keeps_exactly_n_per_block(n, m):
    scores = _w(k=64).abs()
    scores[0] = 1.0  # all ties in row 0
    mask = nm_mask(scores, n=n, m=m)
    assert (mask.reshape(16, -1, m).sum(-1) == n).all()
    kept = scores.reshape(16, -1, m)[mask.reshape(16, -1, m)].reshape(16, -1, n)
    dropped = scores.reshape(16, -1, m)[~mask.reshape(16, -1, m)].reshape(16, -1, m - n)
    assert (kept.min(-1).values >= dropped.max(-1).values).all()  # the n largest are kept


@pytest.mark.parametrize("n,m", [(2, 4), (1, 8), (4, 8), (3, 16)])
def test_compress_round_trip(n, m):
    w = _w(k=128)
    pruned = prune_nm(w, w.abs(), n=n, m=m)
    c = compress_nm(pruned, n=n, m=m)
    assert c.values.shape == (16, 128 * n // m)
    assert torch.equal(c.dequantize(), pruned)
    pos = c.positions()
    assert (pos[..., 1:] > pos[..., :-1]).all() and pos.max() < m  # sorted, distinct, in range


def test_2_4_metadata_is_two_bits_per_kept_value():
    c = compress_nm(prune_nm(_w(k=64), _w(k=64).abs()))
    assert c.meta.dtype == torch.uint8 and c.meta.shape == (16, 64 // 8)


def test_blocks_with_fewer_nonzeros_are_fine():
    w = torch.zeros(2, 8)
    w[0, 1] = 3.0
    assert torch.equal(compress_nm(w).dequantize(), w)


def test_dense_weight_is_rejected_with_location():
    w = _w()
    with pytest.raises(ValueError, match=r"not 2:4 sparse: row 0, block 0 \(columns 0..3\) has 4 nonzeros"):
        compress_nm(w)


def test_shape_that_does_not_tile_is_rejected():
    with pytest.raises(ValueError, match="not a multiple of m=4"):
        compress_nm(torch.zeros(2, 10))
    with pytest.raises(ValueError, match="whole bytes"):
        compress_nm(torch.zeros(2, 12))  # 6 positions of 2 bits: not whole bytes


def test_wanda_uses_input_norms():
    """Column 0 has small weights but a huge input norm: Wanda keeps it, magnitude drops it."""
    lin = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[0.1, 1.0, 0.9, 0.8, 1, 2, 3, 4]]).repeat(4, 1))
    stat = ColumnNormStat(8, torch.device("cpu"))
    x = torch.ones(10, 8)
    x[:, 0] = 100.0
    stat.add(x)
    mag = sparsify_linear(lin, MagnitudeConfig()).dequantize()
    wanda = sparsify_linear(lin, WandaConfig(), stat).dequantize()
    assert mag[0, 0] == 0 and mag[0, 1] != 0
    assert wanda[0, 0] != 0
    assert ((wanda.reshape(4, 2, 4) != 0).sum(-1) == 2).all()


def test_sparse_int4_keeps_pattern_and_bounds_error():
    lin = nn.Linear(128, 24)
    mod = sparsify_linear(lin, MagnitudeConfig(quant_bits=4, group_size=64))
    dense = mod.dequantize()
    pruned = prune_nm(lin.weight.detach(), lin.weight.detach().abs())
    assert ((dense != 0) <= (pruned != 0)).all()  # nothing outside the kept positions
    step = mod.scales.float().repeat_interleave(64, dim=1)  # (N, K): one scale per 64 original columns
    assert ((dense - pruned).abs() <= step / 2 + 1e-6)[pruned != 0].all()
