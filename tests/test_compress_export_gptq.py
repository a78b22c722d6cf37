"""zcompress export: the GPTQ folder's tensors, read back by an unpacker written from the GPTQ layout
(not zspeed's code), give zspeed's own dequantized weights; what GPTQ cannot hold is refused by name."""
import json

import pytest
import torch
from safetensors.torch import load_file

from zspeed.compress import RTNConfig, quantize_model, save_compressed
from zspeed.compress.cli import main as zcompress
from zspeed.compress.export_gptq import GPTQExportError, export_gptq
from zspeed.compress.storage import compressed_modules
from zspeed.compress.tiny import tiny_llama


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                fmt: str) -> torch.Tensor:
    """The (out, in) weight a GPTQ loader computes: eight 4-bit fields per int32, field j at bits 4j;
    qweight packs along the input rows, qzeros along the output columns, 'gptq' zeros stored minus one."""
    shifts = torch.arange(8, dtype=torch.int32) * 4
    q = ((qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15).reshape(-1, qweight.shape[1])  # (in, out)
    z = ((qzeros.unsqueeze(2) >> shifts.view(1, 1, 8)) & 15).reshape(qzeros.shape[0], -1)  # (groups, out)
    if fmt == "gptq":
        z = z + 1
    w = (q - z[g_idx.long()]).float() * scales[g_idx.long()].float()
    return w.t()


def _model(symmetric: bool, group_size: int = 32):
    model = tiny_llama(hidden=128, ffn=256)
    return quantize_model(model, RTNConfig(bits=4, group_size=group_size, symmetric=symmetric), progress=False)


@pytest.mark.parametrize("symmetric,fmt", [(False, "gptq"), (True, "gptq"), (False, "gptq_v2")])
def test_export_round_trips_through_the_gptq_layout(tmp_path, symmetric, fmt):
    model = _model(symmetric)
    modules = compressed_modules(model)
    if not symmetric and fmt == "gptq":  # a zero point of 0 cannot be written as zero - 1: avoid it here
        for m in modules.values():
            m.zeros.clamp_(min=1)
    save_compressed(model, tmp_path / "z", config=RTNConfig(bits=4, group_size=32, symmetric=symmetric))
    out = export_gptq(tmp_path / "z", tmp_path / "g", checkpoint_format=fmt)
    tensors = load_file(str(out / "model.safetensors"))
    for name, m in modules.items():
        want = _dequant(m)  # zspeed's own dequantization
        got = gptq_weight(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"],
                          tensors[f"{name}.g_idx"], fmt)
        assert tensors[f"{name}.qweight"].dtype == torch.int32 and tensors[f"{name}.qweight"].shape == (
            m.in_features // 8, m.out_features)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=0)  # fp16 scales
        assert f"{name}.weight" not in tensors
    state = model.state_dict()
    assert torch.equal(tensors["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    assert "lm_head.weight" not in tensors  # tied: transformers ties it again from the config
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"], q["checkpoint_format"]) == (
        "gptq", 4, 32, symmetric, False, fmt)
    assert config["hidden_size"] == 128 and json.loads((out / "quantize_config.json").read_text())["bits"] == 4


def _dequant(m) -> torch.Tensor:
    from zspeed.compress.formats import Int4Weight
    return Int4Weight(qweight=m.qweight, scales=m.scales, zeros=m.zeros, group_size=m.group_size).dequantize()


def test_export_refuses_what_gptq_cannot_hold(tmp_path):
    model = _model(symmetric=False)
    first = next(iter(compressed_modules(model).values()))
    first.zeros[0, 0] = 0
    save_compressed(model, tmp_path / "z", config=RTNConfig(bits=4, group_size=32))
    with pytest.raises(GPTQExportError, match="zero point 0.*--format gptq_v2"):
        export_gptq(tmp_path / "z", tmp_path / "g")
    assert not (tmp_path / "g").exists() and not list(tmp_path.glob(".g.*"))  # nothing half-written
    export_gptq(tmp_path / "z", tmp_path / "g2", checkpoint_format="gptq_v2")
    with pytest.raises(GPTQExportError, match="exists"):
        export_gptq(tmp_path / "z", tmp_path / "g2", checkpoint_format="gptq_v2")
    int8 = quantize_model(tiny_llama(hidden=128, ffn=256), RTNConfig(bits=8), progress=False)
    save_compressed(int8, tmp_path / "z8", config=RTNConfig(bits=8))
    with pytest.raises(GPTQExportError, match="GPTQ holds 4-bit group-wise weights; this module is INT8"):
        export_gptq(tmp_path / "z8", tmp_path / "g8")
    padded = quantize_model(tiny_llama(hidden=96, ffn=192), RTNConfig(bits=4, group_size=64, pad_groups=True),
                            progress=False)
    save_compressed(padded, tmp_path / "zp", config=RTNConfig(bits=4, group_size=64, pad_groups=True))
    with pytest.raises(GPTQExportError, match="does not divide the 96 inputs"):
        export_gptq(tmp_path / "zp", tmp_path / "gp")


def test_zcompress_export_command(tmp_path, capsys):
    model = _model(symmetric=True)
    save_compressed(model, tmp_path / "z", config=RTNConfig(bits=4, group_size=32, symmetric=True))
    assert zcompress(["export", "--model", str(tmp_path / "z"), "--out", str(tmp_path / "g")]) == 0
    assert (tmp_path / "g" / "model.safetensors").is_file()
    assert zcompress(["export", "--model", str(tmp_path / "z"), "--out", str(tmp_path / "g")]) == 2
    assert "exists" in capsys.readouterr().err
