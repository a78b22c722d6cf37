"""Lean activations (train/lean_activations.py): the model's own gradients, bit for bit in 16-bit models, from
fewer saved activations; modules that are not of the recognised forms are left alone."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

import zspeed.train.lean_activations as lean_mod
from zspeed.train.checkpointing import apply_activation_checkpointing
from zspeed.train.lean_activations import LeanConfig, is_lean, lean_activations, unlean_activations

V, H, F_ = 97, 32, 72


def _llama(*, layers: int = 2, tied: bool = False, seed: int = 0, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=H, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=F_, vocab_size=V, max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).to(dtype)


def _ids(seed: int = 1, t: int = 13) -> torch.Tensor:
    return torch.randint(0, V, (2, t), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tied", [False, True])
def test_16bit_gradients_are_the_models_own_bit_for_bit(dtype, tied):
    ref = _llama(tied=tied, dtype=dtype)
    model = copy.deepcopy(ref)
    report = lean_activations(model)
    assert len(report.norms) == 2 * 2 + 1 and len(report.mlps) == 2 and not report.skipped
    want, want_g = _loss_and_grads(ref, _ids())
    got, got_g = _loss_and_grads(model, _ids())
    assert torch.equal(got, want)
    for name in want_g:
        assert torch.equal(got_g[name], want_g[name]), name


def test_fp32_gradients_match_up_to_the_order_of_one_sum():
    """In fp32 the norm's input is the residual stream itself, whose gradient autograd sums over three uses in its
    own order; the lean norm hands it one sum of two. Everything else is the same operations."""
    ref = _llama()
    model = copy.deepcopy(ref)
    lean_activations(model)
    want, want_g = _loss_and_grads(ref, _ids())
    got, got_g = _loss_and_grads(model, _ids())
    assert torch.equal(got, want)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-5, atol=1e-7, msg=name)
    only_mlp = copy.deepcopy(ref)  # the MLP alone changes no sum: exact in fp32 too
    lean_activations(only_mlp, LeanConfig(norms=False))
    _, mlp_g = _loss_and_grads(only_mlp, _ids())
    assert all(torch.equal(mlp_g[n], want_g[n]) for n in want_g)


def test_autocast_with_fp32_weights():
    ref = _llama()
    model = copy.deepcopy(ref)
    lean_activations(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_g = _loss_and_grads(ref, _ids(2))
        got, got_g = _loss_and_grads(model, _ids(2))
    assert torch.equal(got, want)
    for name in want_g:
        err = (got_g[name] - want_g[name]).norm() / want_g[name].norm()
        assert err < 1e-5, (name, err)


def _saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for backward (parameters aside) in a forward with labels."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss
    return sum(kept.values())


def test_saved_bytes_drop_by_the_norms_copies_and_the_mlp_products(monkeypatch):
    """Counting what is saved needs a saved-tensor hook, which makes the MLP keep its product (another hook owns
    what is kept); the count is taken with that check off, so it sees everything but what the recipe replaces."""
    monkeypatch.setattr(lean_mod, "_saved_tensor_hook_active", lambda: False)
    ref = _llama(layers=3, dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    lean_activations(model)
    ids = _ids(t=16)
    tokens = ids.numel()
    full, lean = _saved_bytes(ref, ids), _saved_bytes(model, ids)
    norms, mlps = 3 * 2 + 1, 3
    # per token: a norm no longer keeps its fp32 input (4 bytes a channel) and its normalised bf16 copy (2) but
    # keeps its bf16 input (2); an MLP no longer keeps act(gate) and the product (2 + 2 bytes a channel)
    expected = tokens * (norms * H * 4 + mlps * F_ * 4)
    assert full - lean >= expected, (full, lean, expected)
    assert lean < 0.75 * full, (full, lean)


def test_the_mlp_product_is_freed_after_forward():
    """Without any saved-tensor hook (as in training), ``down_proj``'s input is not kept alive by its backward."""
    def product_alive(model) -> bool:
        refs = []
        handle = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
            lambda _m, args: refs.append(weakref.ref(args[0])))
        loss = model(input_ids=_ids(), labels=_ids()).loss
        handle.remove()
        gc.collect()
        alive = refs[0]() is not None
        loss.backward()
        return alive
    ref = _llama(dtype=torch.bfloat16)
    assert product_alive(ref)
    model = copy.deepcopy(ref)
    lean_activations(model)
    assert not product_alive(model)


@pytest.mark.parametrize("how", ["hf", "zspeed"])
def test_with_activation_checkpointing(how):
    """Checkpointed layers: the checkpoint's own hook owns what is kept (the recipe steps aside), and the
    gradients are still the model's own."""
    ref = _llama(dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    lean_activations(model)
    for m in (ref, model):
        m.train()
        if how == "hf":
            apply_activation_checkpointing(m)
        else:
            for layer in m.model.layers:
                layer.forward = __import__("zspeed.train.checkpointing", fromlist=["x"]).checkpointed(layer.forward)
    want, want_g = _loss_and_grads(ref, _ids(4))
    got, got_g = _loss_and_grads(model, _ids(4))
    assert torch.equal(got, want)
    assert all(torch.equal(got_g[n], want_g[n]) for n in want_g)


class GemmaStyleNorm(nn.Module):  # weight applied as (1 + w): not the Llama form
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width) * 0.1)
        self.eps = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


GemmaStyleNorm.__name__ = "GemmaStyleRMSNorm"


class ScaledMLP(nn.Module):  # a gated MLP with an extra term
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(H, F_), nn.Linear(H, F_), nn.Linear(F_, H)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 0.5


def test_other_forms_are_left_alone_and_reported():
    model = _llama()
    model.model.layers[0].input_layernorm = GemmaStyleNorm(H)
    model.model.layers[1].mlp = ScaledMLP()
    before = copy.deepcopy(model)
    report = lean_activations(model)
    assert set(report.skipped) == {"model.layers.0.input_layernorm", "model.layers.1.mlp"}
    assert "bit for bit" in report.skipped["model.layers.1.mlp"]
    assert "model.layers.1.mlp" not in report.mlps and "model.layers.0.mlp" in report.mlps
    assert "forward" not in model.model.layers[1].mlp.__dict__
    _, want_g = _loss_and_grads(before, _ids())
    _, got_g = _loss_and_grads(model, _ids())
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-5, atol=1e-7, msg=name)


def test_meta_parameters_are_refused_with_the_fix():
    with torch.device("meta"):
        model = _llama()
    with pytest.raises(ValueError, match="after the weights are loaded"):
        lean_activations(model)


def test_no_grad_deepcopy_and_undo():
    ref = _llama()
    model = copy.deepcopy(ref)
    lean_activations(model)
    assert is_lean(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)
    copied = copy.deepcopy(model)  # the copy's forwards are bound to the copy's modules
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(0.5)
        assert not torch.equal(copied(input_ids=_ids()).logits, model(input_ids=_ids()).logits)
        assert torch.equal(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)
    with pytest.raises(ValueError, match="already lean"):
        lean_activations(model)
    unlean_activations(model)
    assert not is_lean(model) and all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match="not lean"):
        unlean_activations(model)
    with pytest.raises(ValueError, match="probe_tokens"):
        LeanConfig(probe_tokens=0)


def test_lora_adapters_after_the_transform_get_the_same_gradients():
    peft = pytest.importorskip("peft", reason="LoRA goes through peft, an optional extra ([lora])")
    ref = _llama(dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    lean_activations(model)
    cfg = dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"], lora_dropout=0.0)

    def adapted(m):
        torch.manual_seed(3)
        m = peft.get_peft_model(m, peft.LoraConfig(**cfg))
        for n, p in m.named_parameters():
            if "lora_B" in n:  # zero at init: give the adapters a gradient path through B too
                nn.init.normal_(p, std=0.1)
        return m
    ref, model = adapted(ref), adapted(model)
    _, want_g = _loss_and_grads(ref, _ids(5))
    _, got_g = _loss_and_grads(model, _ids(5))
    assert want_g.keys() == got_g.keys()
    assert all(torch.equal(got_g[n], want_g[n]) for n in want_g)


LEAN_ENGINE_CASES = [(2, {"offload_optimizer": {"device": "cpu"}}, False),
                     (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, False),
                     (3, {}, True)]  # stage 3 with activation checkpointing


def _engine_run(topo, stage: int, offload: dict, act_ckpt: bool, lean: bool) -> dict:
    from tests.engine_cases import Case, make_model, micro_batch
    from zspeed.train.config import load_config
    from zspeed.train.engine import ZeroEngine

    case = Case(kind="llama", stage=stage, precision="bf16", gas=2, clip=1.0, steps=3, act_ckpt=act_ckpt)
    cfg = case.ds_config(topo.world_size)
    cfg["zero_optimization"].update(offload)
    model = make_model("llama")
    if lean:
        lean_activations(model)
    engine = ZeroEngine(module=model, config=load_config(cfg, world_size=topo.world_size), topo=topo)
    losses = []
    for step in range(case.steps):
        for k in range(case.gas):
            batch = micro_batch("llama", step, k * topo.world_size + topo.rank)
            loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return {"losses": losses, "params": engine.full_state_dict(master=True)}


def _engine_grid(topo) -> list[str]:
    errors = []
    for stage, offload, act_ckpt in LEAN_ENGINE_CASES:
        want = _engine_run(topo, stage, offload, act_ckpt, lean=False)
        got = _engine_run(topo, stage, offload, act_ckpt, lean=True)
        label = f"stage {stage} {offload} act_ckpt={act_ckpt}"
        if got["losses"] != want["losses"]:
            errors.append(f"{label}: losses {got['losses']} vs {want['losses']}")
        errors += [f"{label}: {n} differs" for n in want["params"] if not torch.equal(got["params"][n],
                                                                                      want["params"][n])]
    return errors


def test_engine_trains_bit_for_bit_as_without_the_transform():
    """bf16 engine on 2 gloo ranks, ZeRO-2 with optimizer offload, ZeRO-3 with parameter offload (the norms'
    weights sharded and gathered again for the recompute), ZeRO-3 with activation checkpointing: the same losses
    and fp32 masters, bit for bit, with and without lean activations."""
    from tests.dist_utils import run_distributed
    errors = run_distributed(_engine_grid, 2)
    assert errors == [[], []], "\n".join(errors[0] + errors[1])
