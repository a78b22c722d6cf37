"""``scale_dtype="auto"`` (compress/config.py, [Note: scale dtype]): INT4 scales of a bf16 model in bf16 (the GPU
kernels' packed path needs them in the activations' dtype), everything else fp16; zcompress reads the dtype a
checkpoint declares although it loads the weights in fp32."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zspeed.compress import GPTQConfig, RTNConfig, quantize_model
from zspeed.compress.cli import main
from zspeed.compress.config import MagnitudeConfig, NF4Config, with_scale_dtype
from zspeed.compress.modules import QuantLinear
from zspeed.compress.storage import META_FILE

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("config, model_dtype, want", [
    (RTNConfig(), BF16, "bfloat16"),
    (RTNConfig(group_size=32, symmetric=True), BF16, "bfloat16"),
    (GPTQConfig(), BF16, "bfloat16"),
    (RTNConfig(), F16, "float16"),
    (RTNConfig(), F32, "float16"),
    (RTNConfig(), None, "float16"),
    (RTNConfig(bits=8), BF16, "float16"),  # INT8's error bound needs fp16's mantissa
    (RTNConfig(scale_dtype="float16"), BF16, "float16"),  # named: kept
    (RTNConfig(bits=8, scale_dtype="bfloat16"), F32, "bfloat16"),
    (MagnitudeConfig(quant_bits=4), BF16, "bfloat16"),
    (MagnitudeConfig(), BF16, "float16"),
])
def test_auto_resolves_by_format_and_model_dtype(config, model_dtype, want):
    assert config.scale_dtype == "auto" or config.scale_dtype == want
    assert with_scale_dtype(config, model_dtype).scale_dtype == want
    nf4 = NF4Config()
    assert with_scale_dtype(nf4, BF16) is nf4


def test_bad_scale_dtype_names_the_choices():
    with pytest.raises(ValueError, match="use 'auto' or one of"):
        RTNConfig(scale_dtype="int8")


def _tiny(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(dtype)


def _scale_dtypes(model) -> set[torch.dtype]:
    return {m.scales.dtype for m in model.modules() if isinstance(m, QuantLinear)}


def test_quantize_model_follows_the_weights():
    assert _scale_dtypes(quantize_model(_tiny(BF16), RTNConfig(), progress=False)) == {BF16}
    assert _scale_dtypes(quantize_model(_tiny(BF16), RTNConfig(bits=8), progress=False)) == {F16}
    assert _scale_dtypes(quantize_model(_tiny(F32), RTNConfig(), progress=False)) == {F16}


def test_zcompress_reads_the_declared_dtype(tmp_path, capsys):
    """The folder declares bf16; zcompress loads it in fp32 (transformers then says fp32), and still stores bf16
    scales for INT4 unless told otherwise."""
    src = tmp_path / "bf16-model"
    _tiny(BF16).save_pretrained(src)
    assert json.loads((src / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    for extra, want in (([], "bfloat16"), (["--scale-dtype", "float16"], "float16")):
        out = tmp_path / f"q-{want}"
        code = main(["quantize", "--model", str(src), "--bits", "4", "--out", str(out), "--no-progress", *extra])
        assert code == 0, capsys.readouterr().err
        modules = json.loads((out / META_FILE).read_text())["modules"]
        assert {spec["scale_dtype"] for spec in modules.values()} == {want}
    code = main(["quantize", "--model", str(src), "--method", "nf4", "--scale-dtype", "bfloat16",
                 "--out", str(tmp_path / "nf4")])
    assert code == 2 and "--scale-dtype are INT4 options" in capsys.readouterr().err
