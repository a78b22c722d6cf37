"""Drop-in modules and the model transforms on a tiny Llama."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zspeed.compress import (GPTQConfig, MagnitudeConfig, QuantLinear, RTNConfig, SparseLinear, WandaConfig,
                             quantize_model, select_linears, sparsify_model)
from zspeed.compress.layer import quantize_linear, sparsify_linear
from zspeed.compress.tiny import tiny_llama



@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def calib():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (1, 64), generator=g) for _ in range(3)]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("config", [RTNConfig(bits=8), RTNConfig(bits=4, group_size=32),
                                    RTNConfig(bits=4, group_size=64, symmetric=True)])
def test_quant_linear_equals_dequantized_linear(config):
    lin = nn.Linear(128, 40)
    mod = quantize_linear(lin, config)
    x = torch.randn(2, 5, 128)
    torch.testing.assert_close(mod(x), F.linear(x, mod.dequantize(), lin.bias))
    assert mod(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("config", [MagnitudeConfig(), MagnitudeConfig(quant_bits=4, group_size=32),
                                    MagnitudeConfig(n=1, m=8)])
def test_sparse_linear_equals_dequantized_linear(config):
    lin = nn.Linear(64, 24)
    mod = sparsify_linear(lin, config)
    x = torch.randn(3, 64)
    torch.testing.assert_close(mod(x), F.linear(x, mod.dequantize(), lin.bias))


def test_modules_trace_under_torch_compile():
    """The custom ops have fake implementations, so dynamo traces them without graph breaks."""
    mods = [quantize_linear(nn.Linear(64, 32), RTNConfig(bits=4, group_size=32)),
            quantize_linear(nn.Linear(64, 32), RTNConfig(bits=8)),
            sparsify_linear(nn.Linear(64, 32), MagnitudeConfig()),
            sparsify_linear(nn.Linear(64, 32), MagnitudeConfig(quant_bits=4, group_size=32))]
    x = torch.randn(4, 64)
    for mod in mods:
        compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), mod(x))


def test_custom_ops_pass_opcheck():
    mod = quantize_linear(nn.Linear(64, 32), RTNConfig(bits=4, group_size=32))
    x = torch.randn(3, 64)
    torch.library.opcheck(torch.ops.zspeed.w4a16_mm, (x, mod.qweight, mod.scales, mod.zeros, 32))
    s = sparsify_linear(nn.Linear(64, 32), MagnitudeConfig())
    torch.library.opcheck(torch.ops.zspeed.sparse24_mm, (x, s.values, s.meta))


def test_default_selection_skips_lm_head_and_embeddings():
    model = tiny_llama()
    names = select_linears(model, RTNConfig().include, RTNConfig().exclude)
    assert len(names) == 14 and "lm_head" not in names
    quantize_model(model, RTNConfig(bits=8), progress=False)
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied weights untouched


def test_include_patterns_choose_modules():
    model = tiny_llama()
    quantize_model(model, RTNConfig(bits=8, include=("*.mlp.*",)), progress=False)
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if n.endswith("proj")}
    assert all(k == "QuantLinear" for n, k in kinds.items() if ".mlp." in n)
    assert all(k == "Linear" for n, k in kinds.items() if ".self_attn." in n)
    with pytest.raises(ValueError, match="no nn.Linear matches"):
        quantize_model(tiny_llama(), RTNConfig(include=("nothing.*",)), progress=False)


@pytest.mark.parametrize("config, bound", [(RTNConfig(bits=8), 0.02), (RTNConfig(bits=4, group_size=32), 0.25),
                                           (GPTQConfig(bits=4, group_size=32), 0.25)])
def test_quantize_model_stays_close(config, bound, ids, calib):
    model = tiny_llama()
    ref = model(ids).logits
    quantize_model(model, config, calib=calib, progress=False)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    assert _rel(model(ids).logits, ref) < bound


def test_gptq_model_error_below_rtn(ids, calib):
    ref_model = tiny_llama()
    ref = ref_model(ids).logits
    errs = {}
    for config in (RTNConfig(bits=4, group_size=128), GPTQConfig(bits=4, group_size=128)):
        model = quantize_model(tiny_llama(), config, calib=calib + [ids], progress=False)
        errs[config.method] = _rel(model(ids).logits, ref)
    assert errs["gptq"] < errs["rtn"], errs


def test_calibration_leaves_no_hooks(calib):
    model = tiny_llama()
    sparsify_model(model, WandaConfig(), calib=calib, progress=False)
    assert sum(isinstance(m, SparseLinear) for m in model.modules()) == 14
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


def test_calibrated_methods_need_data_and_right_transform():
    with pytest.raises(ValueError, match="needs calibration data"):
        quantize_model(tiny_llama(), GPTQConfig(), progress=False)
    with pytest.raises(ValueError, match="needs calibration data"):
        sparsify_model(tiny_llama(), WandaConfig(), calib=[], progress=False)
    with pytest.raises(TypeError, match="use sparsify_model"):
        quantize_model(tiny_llama(), MagnitudeConfig())
    with pytest.raises(TypeError, match="use quantize_model"):
        sparsify_model(tiny_llama(), RTNConfig())


def test_group_size_that_does_not_divide_names_the_module():
    model = nn.Sequential(nn.Linear(96, 32), nn.ReLU(), nn.Linear(32, 8))
    message = r"group_size=64 does not divide in_features=96 of 0: use group_size in \[32\]"
    with pytest.raises(ValueError, match=message):
        quantize_model(model, RTNConfig(group_size=64), progress=False)
    quantize_model(model, RTNConfig(group_size=64, pad_groups=True), progress=False)
    assert model[0].scales.shape == (32, 2)


def test_sparsify_model_without_blocks_uses_one_full_pass():
    """A model with no nn.ModuleList is calibrated in one pass over the whole model."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    batches = [torch.randn(8, 32) for _ in range(2)]
    ref = model(batches[0])
    sparsify_model(model, WandaConfig(), calib=batches, progress=False)
    assert isinstance(model[0], SparseLinear) and isinstance(model[2], SparseLinear)
    assert _rel(model(batches[0]), ref) < 0.8
