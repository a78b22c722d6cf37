"""Fused sibling projections (q/k/v, gate/up): same outputs as the separate modules, one matmul per group."""
import copy
import warnings

import pytest
import torch
from torch import nn

from zspeed.compress import (FuseConfig, MagnitudeConfig, RTNConfig, fuse_projections, fused_projections,
                             quantize_model, save_compressed, sparsify_model, unfuse_projections)
from zspeed.compress.fused import FusedProjection, ProjectionSlice
from zspeed.compress.layer import quantize_linear
from zspeed.compress.tiny import tiny_llama

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _tiny(kind: str):
    model = tiny_llama()
    if kind == "int4":
        quantize_model(model, RTNConfig(bits=4, group_size=32), progress=False)
    elif kind == "int8":
        quantize_model(model, RTNConfig(bits=8), progress=False)
    elif kind == "s24":
        sparsify_model(model, MagnitudeConfig(), progress=False)
    elif kind == "s24w4":
        sparsify_model(model, MagnitudeConfig(quant_bits=4, group_size=32), progress=False)
    return model


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("kind", ["linear", "int4", "int8", "s24", "s24w4"])
def test_fused_model_gives_the_same_logits(kind):
    model = _tiny(kind)
    want = _logits(model)
    fuse_projections(model)
    fused = fused_projections(model)
    assert sorted(fused) == [f"model.layers.{i}.{p}" for i in range(2)
                             for p in ("mlp.gate_proj+up_proj", "self_attn.q_proj+k_proj+v_proj")]
    assert isinstance(model.model.layers[0].self_attn.k_proj, ProjectionSlice)
    torch.testing.assert_close(_logits(model), want, rtol=1e-5, atol=1e-5)
    assert all(f._kept is None for f in fused.values())  # every kept output was taken: nothing outlives a layer


def test_one_matmul_per_group():
    model = _tiny("int4")
    fuse_projections(model)
    calls = []
    for name, mod in model.named_modules():
        if type(mod).__name__ == "QuantLinear":
            mod.register_forward_hook(lambda m, i, o, name=name: calls.append(name))
    _logits(model)
    layer0 = [c.removeprefix("model.layers.0.") for c in calls if c.startswith("model.layers.0.")]
    assert layer0 == ["self_attn.q_proj+k_proj+v_proj.linear", "self_attn.o_proj",
                      "mlp.gate_proj+up_proj.linear", "mlp.down_proj"]


class _Siblings(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, n) for n in (8, 4, 4))
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))


def test_any_call_pattern_gives_the_separate_results():
    """The kept columns are used only for the very input tensor they came from (see [Note: fused projections])."""
    ref = _Siblings()
    mod = fuse_projections(copy.deepcopy(ref), FuseConfig(groups=(("q_proj", "k_proj", "v_proj"),)))
    x, y = torch.randn(3, 16), torch.randn(3, 16)
    # cross-attention: keys and values from another tensor
    torch.testing.assert_close(mod.q_proj(x), ref.q_proj(x))
    torch.testing.assert_close(mod.k_proj(y), ref.k_proj(y))
    torch.testing.assert_close(mod.v_proj(y), ref.v_proj(y))
    # another order, a slice twice, an equal but distinct tensor
    torch.testing.assert_close(mod.v_proj(x), ref.v_proj(x))
    torch.testing.assert_close(mod.q_proj(x), ref.q_proj(x))
    torch.testing.assert_close(mod.k_proj(x.clone()), ref.k_proj(x))
    torch.testing.assert_close(mod.k_proj(x), ref.k_proj(x))
    torch.testing.assert_close(mod.k_proj(x), ref.k_proj(x))
    # the input changed in place between the leader and a sibling
    mod.q_proj(x)
    x.mul_(2.0)
    torch.testing.assert_close(mod.k_proj(x), ref.k_proj(x))


def test_inference_mode_takes_the_fused_path():
    """Inference tensors keep no version counter (the server steps under ``torch.inference_mode``): the same
    logits, and still one matmul per group."""
    model = _tiny("int4")
    want = _logits(model)
    fuse_projections(model)
    calls = []
    for name, mod in model.named_modules():
        if type(mod).__name__ == "QuantLinear" and name.startswith("model.layers.0."):
            mod.register_forward_hook(lambda m, i, o, name=name: calls.append(name.removeprefix("model.layers.0.")))
    with torch.inference_mode():
        got = model(input_ids=IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == ["self_attn.q_proj+k_proj+v_proj.linear", "self_attn.o_proj", "mlp.gate_proj+up_proj.linear",
                     "mlp.down_proj"]


def test_gradients_reach_the_fused_weight():
    ref = _Siblings()
    mod = fuse_projections(copy.deepcopy(ref), FuseConfig(groups=(("q_proj", "k_proj", "v_proj"),)))
    x = torch.randn(5, 16)
    for m in (ref, mod):
        (m.q_proj(x).sum() + 2 * m.k_proj(x).sum() + 3 * m.v_proj(x.clone()).pow(2).sum()).backward()
    fused = mod.get_submodule("q_proj+k_proj+v_proj").linear
    want = torch.cat([ref.q_proj.weight.grad, ref.k_proj.weight.grad, ref.v_proj.weight.grad])
    torch.testing.assert_close(fused.weight.grad, want)
    torch.testing.assert_close(fused.bias.grad, torch.cat([ref.q_proj.bias.grad, ref.k_proj.bias.grad,
                                                           ref.v_proj.bias.grad]))


def test_unfuse_restores_the_state_dict_and_save_refuses_fused(tmp_path):
    model = _tiny("int4")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    assert not any(k.endswith("q_proj.qweight") for k in model.state_dict())
    with pytest.raises(ValueError, match="unfuse_projections"):
        save_compressed(model, tmp_path / "fused")
    assert not (tmp_path / "fused").exists()
    unfuse_projections(model)
    after = model.state_dict()
    assert sorted(after) == sorted(before) and not fused_projections(model)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert type(model.model.layers[1].mlp.up_proj).__name__ == "QuantLinear"
    save_compressed(model, tmp_path / "plain")


def test_copies_and_dtype_moves_keep_each_slice_on_its_own_fused_weight():
    model = fuse_projections(_tiny("linear"))
    twin = copy.deepcopy(model)
    want = _logits(model)
    with torch.no_grad():
        model.get_submodule("model.layers.0.self_attn.q_proj+k_proj+v_proj").linear.weight.zero_()
    torch.testing.assert_close(_logits(twin), want)
    assert twin.model.layers[0].self_attn.k_proj.fused is twin.get_submodule(
        "model.layers.0.self_attn.q_proj+k_proj+v_proj")
    half = twin.to(torch.float64)
    assert _logits(half).dtype == torch.float64


def test_compiled_graph_holds_one_matmul_per_group():
    model = fuse_projections(_tiny("int4"))
    want = _logits(model)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=IDS).logits
    torch.testing.assert_close(got, want)
    assert sum("w4a16_mm" in o for o in ops) == 4 * 2  # q/k/v, o, gate/up, down in each of 2 layers


def test_mismatched_siblings_are_left_alone_with_a_warning():
    model = tiny_llama()
    attn = model.model.layers[0].self_attn
    attn.q_proj = quantize_linear(attn.q_proj, RTNConfig(bits=4, group_size=32))
    attn.k_proj = quantize_linear(attn.k_proj, RTNConfig(bits=8))
    with pytest.warns(UserWarning, match=r"self_attn.\{q_proj,k_proj,v_proj\}: different module types"):
        fuse_projections(model)
    assert "model.layers.0.self_attn.q_proj+k_proj+v_proj" not in fused_projections(model)
    assert "model.layers.1.self_attn.q_proj+k_proj+v_proj" in fused_projections(model)
    fused = fuse_projections(tiny_llama())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fuse_projections(fused)  # a second call finds slices, not Linears: nothing to do, nothing to warn
    assert len(fused_projections(fused)) == 4


@pytest.mark.parametrize("groups, match", [((("q_proj",),), "two or more"), ((("a", "a"),), "distinct"),
                                           ((("a.b", "c"),), "not a child"), ((("a", "b"), ("b", "c")), "two groups")])
def test_config_rejects_bad_groups(groups, match):
    with pytest.raises(ValueError, match=match):
        FuseConfig(groups=groups)


def test_fused_projection_checks_its_sizes():
    with pytest.raises(ValueError, match="do not match"):
        FusedProjection(nn.Linear(4, 6), ("a", "b"), (2, 3))
