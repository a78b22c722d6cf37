"""save_compressed → load_compressed gives identical outputs; bad checkpoints fail clearly."""
import json

import pytest
import torch
from torch import nn

from zspeed.compress import (CompressedFormatError, GPTQConfig, MagnitudeConfig, RTNConfig, WandaConfig,
                             load_compressed, quantize_model, read_metadata, save_compressed, sparsify_model)
from zspeed.compress.storage import FORMAT_VERSION, META_FILE, TENSOR_FILE
from zspeed.compress.tiny import tiny_llama


IDS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
CALIB = [torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _compressed(config):
    model = tiny_llama(hidden=96, ffn=192)  # 96 = 1.5 x 64: short groups with pad_groups
    transform = quantize_model if isinstance(config, (RTNConfig, GPTQConfig)) else sparsify_model
    return transform(model, config, calib=CALIB, progress=False)


@pytest.mark.parametrize("config", [
    RTNConfig(bits=8), RTNConfig(bits=4, group_size=32), RTNConfig(bits=4, group_size=64, pad_groups=True),
    GPTQConfig(bits=4, group_size=32, symmetric=True), MagnitudeConfig(), WandaConfig(n=1, m=8),
    MagnitudeConfig(quant_bits=4, group_size=32),
], ids=lambda c: f"{c.method}")
def test_save_load_gives_identical_outputs(tmp_path, config):
    model = _compressed(config)
    save_compressed(model, tmp_path, config=config)
    loaded = load_compressed(tmp_path)
    assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tie restored
    meta = read_metadata(tmp_path)
    assert meta["format_version"] == FORMAT_VERSION and meta["method"]["name"] == config.method
    assert len(meta["modules"]) == 14 and meta["hf_config"]["hidden_size"] == 96
    spec = meta["modules"]["model.layers.0.mlp.down_proj"]
    if config.method in ("rtn", "gptq"):
        assert spec["bits"] == config.bits and spec["group_size"] == config.group_size
    else:
        assert spec["pattern"] == config.pattern


def test_plain_module_round_trip_with_skeleton(tmp_path):
    def make():
        return nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))

    model = quantize_model(make(), RTNConfig(bits=4, group_size=32), progress=False)
    save_compressed(model, tmp_path)
    x = torch.randn(5, 64)
    with pytest.raises(CompressedFormatError, match="pass model="):
        load_compressed(tmp_path)
    assert torch.equal(load_compressed(tmp_path, model=make())(x), model(x))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_compressed(_compressed(RTNConfig(bits=4, group_size=32)), path)
    return path


def _edit_meta(src, dst, edit):
    dst.mkdir(exist_ok=True)
    (dst / TENSOR_FILE).write_bytes((src / TENSOR_FILE).read_bytes())
    meta = json.loads((src / META_FILE).read_text())
    edit(meta)
    (dst / META_FILE).write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(format_version=FORMAT_VERSION + 1), "newer than this zspeed reads"),
    (lambda m: m.update(format_version="one"), "format_version='one' is corrupt"),
    (lambda m: m.update(format="other"), "not zspeed compressed-model metadata"),
    (lambda m: m["modules"]["model.layers.0.mlp.up_proj"].update(format="int3"), "unknown format 'int3'"),
    (lambda m: m["modules"]["model.layers.0.mlp.up_proj"].pop("bits"), r"lacks \['bits'\]"),
    (lambda m: m["modules"].update({"model.layers.9.mlp.up_proj": m["modules"]["model.layers.0.mlp.up_proj"]}),
     "which the model does not have"),
    (lambda m: m["modules"]["model.layers.0.mlp.up_proj"].update(group_size=64), "in the file but the metadata"),
    (lambda m: m["hf_config"].update(intermediate_size=128),
     r"is Linear\(128→96\) in the model but Linear\(192→96\) in the checkpoint"),
])
def test_bad_metadata_is_named(saved, tmp_path, edit, message):
    bad = _edit_meta(saved, tmp_path / "bad", edit)
    with pytest.raises(CompressedFormatError, match=message):
        load_compressed(bad)


def test_missing_corrupt_and_truncated_files(saved, tmp_path):
    with pytest.raises(CompressedFormatError, match="not written by zspeed"):
        load_compressed(tmp_path)
    bad = _edit_meta(saved, tmp_path / "json", lambda m: None)
    (bad / META_FILE).write_text("{not json")
    with pytest.raises(CompressedFormatError, match="corrupt"):
        load_compressed(bad)
    bad = _edit_meta(saved, tmp_path / "trunc", lambda m: None)
    (bad / TENSOR_FILE).write_bytes((saved / TENSOR_FILE).read_bytes()[:1000])
    with pytest.raises(CompressedFormatError, match="corrupt or truncated"):
        load_compressed(bad)
