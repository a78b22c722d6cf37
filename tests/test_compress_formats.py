"""Bit packing, INT8/INT4 round-to-nearest error bounds, and config validation."""
import pytest
import torch

from zspeed.compress import (GPTQConfig, MagnitudeConfig, RTNConfig, WandaConfig, make_config, pack_bits,
                             quantize_int4, quantize_int8, unpack_bits)
from zspeed.compress.formats import Int4Weight, grouped
from zspeed.compress.packing import index_bits

SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _weight(n=24, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, 3] = 1.5  # an outlier
    w[1] = 0.0  # an all-zero row (zero scale guard)
    w[2, :64] = torch.rand(64, generator=g)  # a one-signed group
    return w


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_round_trip(bits):
    values = torch.randint(0, 1 << bits, (5, 7, 8 * 3), dtype=torch.uint8)
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 7, 3 * bits)
    assert torch.equal(unpack_bits(packed, bits), values)


def test_int4_packing_layout_is_low_nibble_first():
    packed = pack_bits(torch.tensor([[1, 2, 15, 0]]), 4)
    assert packed.tolist() == [[0x21, 0x0F]]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 2"):
        pack_bits(torch.zeros(3, 5, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        pack_bits(torch.full((1, 2), 16), 4)
    with pytest.raises(ValueError, match="one of"):
        pack_bits(torch.zeros(1, 6), 3)


def test_index_bits():
    assert [index_bits(m) for m in (2, 4, 8, 16, 32)] == [1, 2, 4, 4, 8]


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_int8_rtn_error_within_half_a_step(scale_dtype):
    w = _weight()
    q = quantize_int8(w, scale_dtype=scale_dtype)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (w.shape[0],) and q.scales.dtype == scale_dtype
    bound = q.scales.float()[:, None] / 2
    assert ((w - q.dequantize()).abs() <= bound * (1 + 1e-6) + 1e-12).all()
    assert torch.equal(q.dequantize()[1], torch.zeros(w.shape[1]))


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_rtn_error_within_half_a_step(group, symmetric, scale_dtype):
    w = _weight()
    q = quantize_int4(w, group_size=group, symmetric=symmetric, scale_dtype=scale_dtype)
    n, k = w.shape
    assert q.qweight.shape == (n, k // 2) and q.scales.shape == (n, k // group)
    assert (q.zeros is None) == symmetric
    step = q.scales.float().repeat_interleave(group, dim=1)  # (N, K)
    assert ((w - q.dequantize()).abs() <= step / 2 * (1 + 1e-6) + 1e-12).all()
    assert q.codes().max() <= 15


def test_int4_requantization_is_exact():
    """Dequantized weights lie on the grid: quantizing them again changes nothing."""
    q = quantize_int4(_weight(), group_size=64)
    again = quantize_int4(q.dequantize(), group_size=64)
    assert torch.allclose(again.dequantize(), q.dequantize(), atol=1e-6)


def test_int4_short_last_group_when_padding_is_asked_for():
    w = _weight(k=96)
    with pytest.raises(ValueError, match="does not divide in_features=96.*pad_groups=True"):
        quantize_int4(w, group_size=64)
    q = quantize_int4(w, group_size=64, pad_groups=True)
    assert q.scales.shape == (w.shape[0], 2)
    step = grouped(torch.ones_like(w), 64) * q.scales.float()[..., None]  # (N, 2, 64)
    step = step.reshape(w.shape[0], -1)[:, :96]
    assert ((w - q.dequantize()).abs() <= step / 2 * (1 + 1e-6) + 1e-12).all()


def test_int4_weight_round_trips_through_its_fields():
    q = quantize_int4(_weight(), group_size=32)
    rebuilt = Int4Weight(qweight=q.qweight.clone(), scales=q.scales, zeros=q.zeros, group_size=32)
    assert torch.equal(rebuilt.dequantize(), q.dequantize())


# -- configs --------------------------------------------------------------------------------------
def test_config_defaults_resolve():
    assert RTNConfig().group_size == 128 and RTNConfig().symmetric is False
    c8 = RTNConfig(bits=8)
    assert c8.group_size is None and c8.symmetric is True
    assert "lm_head" in RTNConfig().exclude
    with pytest.raises(Exception):
        RTNConfig(bits=4).bits = 8  # frozen
    with pytest.raises(TypeError):
        RTNConfig(4)  # keyword-only


@pytest.mark.parametrize("make, field, hint", [
    (lambda: RTNConfig(bits=3), "bits", "use 4"),
    (lambda: RTNConfig(bits=4, group_size=96), "group_size", "32, 64, 128"),
    (lambda: RTNConfig(bits=8, group_size=128), "group_size", "leave group_size unset"),
    (lambda: RTNConfig(bits=8, symmetric=False), "symmetric", "symmetric only"),
    (lambda: RTNConfig(scale_dtype="int8"), "scale_dtype", "float16"),
    (lambda: RTNConfig(exclude=(3,)), "exclude", "pattern strings"),
    (lambda: GPTQConfig(damp=0.0), "damp", "fraction"),
    (lambda: GPTQConfig(group_size=128, block_size=96), "block_size", "multiple of group_size"),
    (lambda: MagnitudeConfig(n=4, m=4), "n", "m-1"),
    (lambda: WandaConfig(m=1), "m", "between 2 and 256"),
    (lambda: MagnitudeConfig(quant_bits=8), "quant_bits", "None"),
    (lambda: MagnitudeConfig(quant_bits=4, group_size=6), "group_size", "multiple of m"),
])
def test_invalid_config_names_field_and_fix(make, field, hint):
    with pytest.raises(ValueError) as info:
        make()
    assert f".{field}=" in str(info.value) and hint in str(info.value)


def test_make_config():
    assert make_config("gptq", bits=8) == GPTQConfig(bits=8)
    assert make_config("wanda", n=1, m=4).pattern == "1:4"
    valid = "valid methods: rtn, gptq, magnitude, wanda"
    with pytest.raises(ValueError, match=f"unknown compression method 'awq'; {valid}"):
        make_config("awq")
    with pytest.raises(ValueError, match="no field"):
        make_config("rtn", groupsize=64)
    assert RTNConfig(exclude="lm_head").exclude == ("lm_head",)
