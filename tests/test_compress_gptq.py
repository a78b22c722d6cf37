"""GPTQ: the Hessian statistic, and lower output error than RTN on correlated inputs."""
import pytest
import torch

from zspeed.compress import GPTQConfig, RTNConfig, gptq_quantize, quantize_int4, quantize_int8
from zspeed.compress.calib import HessianStat


def _correlated_inputs(tokens=1024, k=128, seed=0):
    """Inputs with strongly correlated channels (a low-rank mix plus noise), as in real activations."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(16, k, generator=g)
    x = torch.randn(tokens, 16, generator=g) @ basis + 0.1 * torch.randn(tokens, k, generator=g)
    return x * torch.linspace(0.2, 3.0, k)  # channels of different scale


def _hessian(x):
    stat = HessianStat(x.shape[1], x.device)
    for chunk in x.split(300):  # several batches of different size
        stat.add(chunk)
    return stat.h


def test_hessian_stat_is_2xtx_over_n():
    x = _correlated_inputs(tokens=700, k=32)
    torch.testing.assert_close(_hessian(x), 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)


def _out_err(x, w, q):
    return ((x @ (w - q.dequantize()).t()).norm() / (x @ w.t()).norm()).item()


@pytest.mark.parametrize("bits,group,act_order", [(4, 32, False), (4, 128, False), (4, 128, True), (8, None, False),
                                                  (8, None, True)])
def test_gptq_beats_rtn_on_correlated_inputs(bits, group, act_order):
    x = _correlated_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    h = _hessian(x)
    if bits == 4:
        rtn = quantize_int4(w, group_size=group)
        gptq = gptq_quantize(w, h, GPTQConfig(bits=4, group_size=group, block_size=128, act_order=act_order))
    else:
        rtn = quantize_int8(w)
        gptq = gptq_quantize(w, h, GPTQConfig(bits=8, act_order=act_order))
    assert type(gptq) is type(rtn)
    e_rtn, e_gptq = _out_err(x, w, rtn), _out_err(x, w, gptq)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


def test_gptq_lazy_blocks_match_a_single_block():
    """The blocked (lazy-batch) update is an exact reorganisation of the column-by-column one."""
    x, w = _correlated_inputs(k=64), torch.randn(16, 64) * 0.02
    h = _hessian(x)
    a = gptq_quantize(w, h, GPTQConfig(bits=4, group_size=32, block_size=32))
    b = gptq_quantize(w, h, GPTQConfig(bits=4, group_size=32, block_size=64))
    assert (a.codes() != b.codes()).float().mean() < 0.01  # equal up to float rounding ties
    torch.testing.assert_close(a.scales, b.scales)


def test_gptq_handles_dead_inputs_and_symmetric_grid():
    x = _correlated_inputs(k=64)
    x[:, 5] = 0.0  # an input channel that never fires
    w = torch.randn(16, 64) * 0.02
    q = gptq_quantize(w, _hessian(x), GPTQConfig(bits=4, group_size=32, symmetric=True))
    assert q.zeros is None and torch.isfinite(q.dequantize()).all()
    assert (q.dequantize()[:, 5] == 0).all()  # dead columns are zeroed (they never contribute)


def test_gptq_rejects_a_mismatched_hessian():
    with pytest.raises(ValueError, match="does not match in_features=64"):
        gptq_quantize(torch.randn(4, 64), torch.eye(32), GPTQConfig(bits=8))


def test_rtn_config_is_not_gptq():
    assert RTNConfig.method == "rtn" and GPTQConfig.method == "gptq"


def test_static_groups_use_the_rtn_grid():
    """With act_order (static groups) the scales are fitted up front: exactly RTN's grid, better codes."""
    x, w = _correlated_inputs(k=64), torch.randn(16, 64) * 0.02
    rtn = quantize_int4(w, group_size=32)
    for cfg in (GPTQConfig(bits=4, group_size=32, act_order=True),
                GPTQConfig(bits=4, group_size=32, static_groups=True)):
        q = gptq_quantize(w, _hessian(x), cfg)
        assert torch.equal(q.scales, rtn.scales) and torch.equal(q.zeros, rtn.zeros)
        assert _out_err(x, w, q) < _out_err(x, w, rtn)
