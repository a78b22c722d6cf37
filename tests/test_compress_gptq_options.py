"""GPTQ calibration options: true_sequential (stage by stage within a block) and fp_targets (fit the
full-precision model's outputs)."""
import pytest
import torch

from zspeed.compress import GPTQConfig, gptq_quantize, quantize_model
from zspeed.compress import transform
from zspeed.compress.gptq import fp_target
from zspeed.compress.tiny import tiny_llama
from zspeed.compress.transform import call_stages, capture_block_inputs, find_blocks, select_linears
from tests.test_compress_gptq import _correlated_inputs, _hessian


@pytest.mark.parametrize("field, value", [("true_sequential", 1), ("fp_targets", "yes")])
def test_bad_flags_name_the_fix(field, value):
    with pytest.raises(ValueError, match=f"GPTQConfig.{field}={value!r} is invalid: use True or False"):
        GPTQConfig(**{field: value})


def test_call_stages_follow_the_llama_block():
    model = tiny_llama(layers=1)
    targets = select_linears(model, ("*",), ("lm_head",))
    _, blocks = find_blocks(model, targets)
    sample = capture_block_inputs(model, blocks[0], [torch.randint(0, 256, (1, 16))])[0]
    stages = [[n.rsplit(".", 1)[1] for n in s] for s in call_stages(blocks[0], targets, sample)]
    assert stages == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]


def _recorded(monkeypatch, config, calib, stat_field):
    """quantize_model on a tiny Llama, recording ``stat_field`` of the statistic each Linear was quantized with."""
    seen = {}
    compress = transform.compress_linear

    def record(lin, cfg, stat=None):
        new = compress(lin, cfg, stat)
        seen[new] = getattr(stat, stat_field).clone()
        return new

    monkeypatch.setattr(transform, "compress_linear", record)
    model = quantize_model(tiny_llama(), config, calib=calib, progress=False)
    return model, {name: seen[mod] for name, mod in model.named_modules() if mod in seen}


@pytest.mark.parametrize("true_sequential", [True, False])
def test_true_sequential_calibrates_on_quantized_earlier_linears(monkeypatch, true_sequential):
    """With true_sequential each Linear's Hessian is that of its inputs in the final quantized model (all
    earlier Linears, of its own block too, already quantized); without it only earlier blocks are."""
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 256, (1, 48), generator=g) for _ in range(2)]
    config = GPTQConfig(bits=4, group_size=32, true_sequential=true_sequential)
    model, used = _recorded(monkeypatch, config, calib, "h")
    final = _inputs(model, set(used), calib)  # each Linear's inputs in the finished model
    assert len(used) == 14
    for name, h in used.items():
        x = final[name]
        same = torch.allclose(h, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-5)
        first_stage = name.endswith(("q_proj", "k_proj", "v_proj"))
        assert same == (true_sequential or first_stage), name


def test_fp_target_maps_drifted_inputs_to_full_precision_outputs():
    """fp_target(w) is w when the inputs did not drift, and otherwise fits w x_fp from the drifted x better than w."""
    x_fp = _correlated_inputs(k=64)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)) * 0.02
    h = _hessian(x_fp)
    torch.testing.assert_close(fp_target(w, h, h, 0.01), w, rtol=1e-4, atol=1e-6)
    drift = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)) * 0.05
    x = x_fp + x_fp @ drift  # (tokens, K): what the quantized model's earlier layers deliver
    target = fp_target(w, _hessian(x), 2 * x.t() @ x_fp / x.shape[0], 0.01)

    def err(m):
        return ((x @ m.t() - x_fp @ w.t()).norm() / (x_fp @ w.t()).norm()).item()

    assert err(target) < 0.2 * err(w), (err(target), err(w))


def test_gptq_with_fp_targets_is_closer_to_the_full_precision_outputs():
    x_fp = _correlated_inputs(k=128)
    x = x_fp + x_fp @ (torch.randn(128, 128, generator=torch.Generator().manual_seed(6)) * 0.02)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7)) * 0.02
    h, cross = _hessian(x), 2 * x.t() @ x_fp / x.shape[0]
    config = GPTQConfig(bits=4, group_size=32, act_order=True)

    def err(q):
        return ((x @ q.dequantize().t() - x_fp @ w.t()).norm() / (x_fp @ w.t()).norm()).item()

    plain, fp = err(gptq_quantize(w, h, config)), err(gptq_quantize(w, h, config, cross=cross))
    assert fp < 0.8 * plain, (fp, plain)


def test_fp_targets_pair_each_input_with_the_full_precision_one(monkeypatch):
    """With fp_targets (and true_sequential) each Linear's cross statistic is 2/n sum x x_fp^T: x its input in
    the final quantized model, x_fp the same Linear's input in the untouched model, token by token."""
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 256, (1, 40), generator=g) for _ in range(2)]
    config = GPTQConfig(bits=4, group_size=32, true_sequential=True, fp_targets=True)
    model, cross = _recorded(monkeypatch, config, calib, "cross")
    ins = {n: _inputs(m, set(cross), calib) for n, m in (("q", model), ("fp", tiny_llama()))}
    assert len(cross) == 14
    for name, c in cross.items():
        x, x_fp = ins["q"][name], ins["fp"][name]
        torch.testing.assert_close(c, 2 * x.t() @ x_fp / x.shape[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ins["q"]["model.layers.1.mlp.down_proj"], ins["fp"]["model.layers.1.mlp.down_proj"])


def _inputs(model, names, calib):
    """Every input row (tokens, K) of the Linears ``names`` over ``calib``."""
    rows = {n: [] for n in names}
    handles = [mod.register_forward_pre_hook(lambda _m, a, n=name: rows[n].append(a[0].reshape(-1, a[0].shape[-1])))
               for name, mod in model.named_modules() if name in names]
    with torch.no_grad():
        for batch in calib:
            model(batch)
    for h in handles:
        h.remove()
    return {n: torch.cat(r) for n, r in rows.items()}
