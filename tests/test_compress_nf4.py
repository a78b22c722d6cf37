"""NF4 through bitsandbytes: the reference table, packing and quantizer against bitsandbytes' own.

bitsandbytes 0.50.2 runs on the CPU here (``quantize_4bit``, ``dequantize_4bit`` and
``matmul_4bit`` all work on CPU tensors), so its results are compared with the
plain-PyTorch reference directly. Its CUDA path (what ``NF4Linear`` calls on a GPU)
is not exercised by these CPU tests.
"""
import json
import sys

import pytest
import torch
from safetensors import safe_open
from torch import nn

from zspeed.compress import (CompressedFormatError, NF4Config, NF4Linear, load_compressed, make_config,
                             quantize_model, read_metadata, save_compressed)
from zspeed.compress.cli import main
from zspeed.compress.nf4 import (NF4Weight, bnb_matmul, nf4_table, pack_nf4, quantize_nf4, require_bitsandbytes,
                                 unpack_nf4)
from zspeed.compress.storage import META_FILE, TENSOR_FILE
from zspeed.compress.tiny import tiny_llama

bnb = require_bitsandbytes("the NF4 tests")  # never skipped: a missing bitsandbytes fails with the install hint
F = bnb.functional
GEN = torch.Generator().manual_seed(0)
SHAPES = [(48, 128, 64), (33, 64, 32), (16, 576, 64), (8, 512, 256)]  # (N, K, blocksize)


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


# -- the table and the packing ----------------------------------------------------------------------------------
def test_table_from_definition_is_bitsandbytes_table():
    table = nf4_table()
    assert torch.equal(table, F.get_4bit_type("nf4", device="cpu"))  # bit for bit
    assert table.shape == (16,) and table[0] == -1 and table[7] == 0 and table[15] == 1
    assert bool((table.diff() > 0).all())


@pytest.mark.parametrize("length", [1, 2, 7, 64, 129])
def test_pack_unpack_round_trip(length):
    codes = torch.randint(0, 16, (length,), generator=GEN, dtype=torch.uint8)
    packed = pack_nf4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == ((length + 1) // 2,)
    assert torch.equal(unpack_nf4(packed, length), codes)


def test_pack_layout_high_nibble_first_and_pad_with_zero_code():
    assert pack_nf4(torch.tensor([1, 2, 3])).tolist() == [0x12, 0x37]  # 7 is the code of 0.0
    with pytest.raises(TypeError, match="uint8"):
        unpack_nf4(torch.zeros(2, dtype=torch.int8), 4)


# -- the quantizer ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k, blocksize", SHAPES)
def test_error_within_nf4_bound_per_block(n, k, blocksize):
    w = _randn(n, k) * torch.logspace(-3, 1, n)[:, None]  # rows of very different scale
    q = quantize_nf4(w, blocksize=blocksize)
    assert q.qweight.shape == (n * k // 2,) and q.absmax.shape == (n * k // blocksize,)
    blocks, deq = w.reshape(-1, blocksize), q.dequantize().reshape(-1, blocksize)  # (nblocks, B)
    assert torch.equal(q.absmax, blocks.abs().amax(dim=1))
    half_gap = nf4_table().diff().max() / 2  # nearest rounding: within half the widest gap
    err = (deq - blocks).abs()
    assert bool((err <= q.absmax[:, None] * half_gap * (1 + 1e-6)).all())
    # each code is the nearest table value to w / absmax
    scaled = blocks / q.absmax[:, None]
    nearest = (scaled[..., None] - nf4_table()).abs().min(dim=-1).values
    chosen = (scaled - nf4_table()[q.codes().long()].reshape(-1, blocksize)).abs()
    assert torch.allclose(chosen, nearest, atol=1e-6, rtol=0)
    peak = blocks.abs().argmax(dim=1, keepdim=True)
    assert torch.equal(deq.gather(1, peak), blocks.gather(1, peak))  # ±absmax is exact


def test_zero_block_and_bad_input():
    w = torch.zeros(2, 64)
    w[1] = _randn(64)
    q = quantize_nf4(w, blocksize=64)
    assert q.absmax[0] == 0 and torch.equal(q.dequantize()[0], torch.zeros(64))
    with pytest.raises(ValueError, match="blocksize=48"):
        quantize_nf4(w, blocksize=48)
    with pytest.raises(ValueError, match="2-D"):
        quantize_nf4(torch.zeros(64), blocksize=64)


# -- against bitsandbytes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, k, blocksize", SHAPES)
def test_bitsandbytes_quantize_matches_reference(n, k, blocksize, dtype):
    w = _randn(n, k, dtype=dtype)
    ours = quantize_nf4(w, blocksize=blocksize)
    packed, state = F.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
    assert torch.equal(packed.reshape(-1), ours.qweight) and torch.equal(state.absmax, ours.absmax)
    theirs = NF4Weight(qweight=packed.reshape(-1), absmax=state.absmax, shape=(n, k), blocksize=blocksize)
    assert torch.equal(theirs.dequantize(dtype), F.dequantize_4bit(packed, state))  # identical, not close


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("m", [1, 5])
def test_bitsandbytes_matmul_matches_reference(m, dtype, atol):
    q = quantize_nf4(_randn(96, 128), blocksize=64)
    x = _randn(m, 128, dtype=dtype)
    ref = x.float() @ q.dequantize(dtype).float().t()
    y = bnb_matmul(x, q)
    assert y.shape == (m, 96) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, atol=atol, rtol=0.02)


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(ImportError, match=r"pip install 'zspeed\[quant\]'"):
        bnb_matmul(torch.zeros(1, 64), quantize_nf4(torch.ones(4, 64)))


# -- the module, the transform, storage ---------------------------------------------------------------------------
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def dense_and_nf4():
    dense = tiny_llama()
    model = quantize_model(tiny_llama(), NF4Config(blocksize=64), progress=False)
    return dense, model


def test_quantize_model_swaps_linears(dense_and_nf4):
    dense, model = dense_and_nf4
    swapped = {n for n, m in model.named_modules() if isinstance(m, NF4Linear)}
    assert len(swapped) == 14 and "lm_head" not in swapped and type(model.lm_head) is nn.Linear
    mod = model.model.layers[0].mlp.down_proj
    assert mod.compress_stats["rel_err"] < 0.12  # NF4 on Gaussian weights: ~0.09
    with torch.no_grad():
        a, b = dense(IDS).logits, model(IDS).logits
    assert ((a - b).norm() / a.norm()) < 0.15


def test_module_forward_is_reference_and_keeps_input_dtype():
    lin = nn.Linear(128, 40)
    mod = quantize_model(nn.Sequential(lin), NF4Config(compute_dtype="bfloat16"), progress=False)[0]
    x = _randn(3, 7, 128)
    y = mod(x)
    want = (x.bfloat16() @ mod.dequantize(torch.bfloat16).t() + lin.bias.bfloat16()).float()
    assert y.dtype == torch.float32 and torch.equal(y, want)


def test_save_load_identical_outputs(tmp_path, dense_and_nf4):
    _, model = dense_and_nf4
    config = NF4Config(blocksize=64)
    save_compressed(model, tmp_path, config=config)
    loaded = load_compressed(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    spec = read_metadata(tmp_path)["modules"]["model.layers.1.self_attn.q_proj"]
    assert spec["format"] == "nf4" and spec["blocksize"] == 64 and spec["quant_type"] == "nf4"
    assert read_metadata(tmp_path)["method"]["name"] == "nf4"
    with safe_open(str(tmp_path / TENSOR_FILE), framework="pt") as f:
        qw = f.get_tensor("model.layers.1.self_attn.q_proj.qweight")
        am = f.get_tensor("model.layers.1.self_attn.q_proj.absmax")
    assert qw.dtype == torch.uint8 and qw.shape == (128 * 128 // 2,)
    assert am.dtype == torch.float32 and am.shape == (128 * 128 // 64,)


def test_load_rejects_bad_nf4_metadata(tmp_path, dense_and_nf4):
    save_compressed(dense_and_nf4[1], tmp_path)
    meta = json.loads((tmp_path / META_FILE).read_text())
    spec = meta["modules"]["model.layers.0.mlp.up_proj"]
    del spec["blocksize"]
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CompressedFormatError, match="lacks its 'blocksize'"):
        load_compressed(tmp_path)
    spec["blocksize"] = 48
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CompressedFormatError, match="blocksize=48"):
        load_compressed(tmp_path)


# -- bad configs and the CLI --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"blocksize": 48}, "NF4Config.blocksize=48 is invalid"),
    ({"compute_dtype": "int8"}, "NF4Config.compute_dtype='int8' is invalid"),
    ({"include": (1,)}, "NF4Config.include"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NF4Config(**kwargs)


def test_bad_config_fields_and_shapes():
    with pytest.raises(ValueError, match="no field"):
        make_config("nf4", group_size=64)
    assert make_config("nf4", blocksize=128) == NF4Config(blocksize=128)
    with pytest.raises(ValueError, match=r"in_features=96 of 0: use blocksize in \[32\]"):
        quantize_model(nn.Sequential(nn.Linear(96, 8)), NF4Config(blocksize=64), progress=False)


def test_cli_quantize_nf4_and_inspect(tmp_path, capsys):
    out = tmp_path / "nf4"
    assert main(["quantize", "--model", "tiny", "--method", "nf4", "--blocksize", "32", "--out", str(out),
                 "--no-progress"]) == 0
    assert "14 modules compressed" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    assert "nf4 g32" in capsys.readouterr().out
    assert main(["quantize", "--model", "tiny", "--method", "nf4", "--bits", "8", "--out", "X"]) == 2
    assert "nf4 is 4-bit" in capsys.readouterr().err
    assert main(["quantize", "--model", "tiny", "--method", "nf4", "--blocksize", "48", "--out", "X"]) == 2
    assert "NF4Config.blocksize=48" in capsys.readouterr().err
