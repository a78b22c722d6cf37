"""The chunked causal-LM loss (train/chunked_loss.py): the model's own loss and gradients, less memory, and the
engine's parity with an unchunked reference at every stage, offloaded too."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.dist_utils import run_distributed
from tests.engine_cases import TOLERANCE, Case, Tolerance, cached_reference, compare, make_model, micro_batch
from zspeed.core.comm import ReduceOp, all_reduce
from zspeed.train.chunked_loss import ChunkedLossConfig, chunk_lm_loss, chunked_lm_loss, is_chunked, unchunk_lm_loss
from zspeed.train.config import load_config
from zspeed.train.engine import ZeroEngine

V = 97


def _llama(*, tied: bool, seed: int = 0, **extra) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=V, max_position_embeddings=64, tie_word_embeddings=tied,
                      **extra)
    return LlamaForCausalLM(cfg)


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 17), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100  # a masked prompt
    labels[2, 9:] = -100
    return ids, labels


def _loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(**kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 10_000])  # one position per chunk, odd chunks, everything in one
def test_loss_and_gradients_match_the_model(tied, rows):
    ref = _llama(tied=tied)
    model = chunk_lm_loss(copy.deepcopy(ref), ChunkedLossConfig(max_chunk_bytes=4 * V * rows))
    ids, labels = _batch()
    for extra in ({}, {"num_items_in_batch": 40}):
        want, want_g = _loss_and_grads(ref, input_ids=ids, labels=labels, **extra)
        got, got_g = _loss_and_grads(model, input_ids=ids, labels=labels, **extra)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert want_g.keys() == got_g.keys()
        for name in want_g:
            torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-5, atol=1e-6, msg=name)


def test_shift_labels_and_bf16():
    ref = _llama(tied=False).to(torch.bfloat16)
    model = chunk_lm_loss(copy.deepcopy(ref), ChunkedLossConfig(max_chunk_bytes=4 * V * 7))
    ids, labels = _batch(2)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    want, want_g = _loss_and_grads(ref, input_ids=ids, labels=labels)
    got, got_g = _loss_and_grads(model, input_ids=ids, labels=torch.zeros_like(labels), shift_labels=shifted)
    assert abs(got.float().item() - want.float().item()) < 2e-2
    for name in want_g:  # bf16: each chunk's product rounds on its own
        err = (got_g[name].float() - want_g[name].float()).norm() / want_g[name].float().norm()
        assert err < 2e-2, (name, err)


def test_autocast_with_fp32_weights():
    """Mixed precision by autocast (fp32 weights, bf16 products): the same loss and gradients as the model's own
    loss under autocast, the head's product recomputed in bf16 in backward as in forward."""
    ref = _llama(tied=False)
    model = chunk_lm_loss(copy.deepcopy(ref), ChunkedLossConfig(max_chunk_bytes=4 * V * 5))
    ids, labels = _batch(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(input_ids=ids, labels=labels).loss
        got = model(input_ids=ids, labels=labels).loss
        hidden = model.model(input_ids=ids).last_hidden_state.to(torch.bfloat16).detach().requires_grad_()
        head = copy.deepcopy(model.lm_head)
        loss16 = chunked_lm_loss(hidden, head, labels)  # bf16 hidden states, fp32 head weight
    want.backward()
    got.backward()
    loss16.backward()
    assert abs(got.item() - want.item()) < 1e-2 and abs(loss16.item() - want.item()) < 1e-2
    assert hidden.grad.dtype == torch.bfloat16 and head.weight.grad.dtype == torch.float32
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        err = (q.grad - p.grad).norm() / p.grad.norm()
        assert err < 2e-2, (name, err)


def test_without_labels_the_model_is_unchanged_and_transform_undoes():
    ref = _llama(tied=False)
    model = chunk_lm_loss(copy.deepcopy(ref))
    ids, labels = _batch()
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and out.loss is not None
    copied = copy.deepcopy(model)  # the copy's forward is bound to the copy, not to the original
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(0.5)
    assert copied(input_ids=ids, labels=labels).loss.item() != pytest.approx(out.loss.item())
    assert copied(input_ids=ids).logits.sub(model(input_ids=ids).logits).abs().max() > 0
    with pytest.raises(ValueError, match="already chunked"):
        chunk_lm_loss(model)
    assert is_chunked(model) and not is_chunked(unchunk_lm_loss(model))
    torch.testing.assert_close(model(input_ids=ids, labels=labels).logits, ref(input_ids=ids, labels=labels).logits)
    with pytest.raises(ValueError, match="not chunked"):
        unchunk_lm_loss(model)


def _saved_bytes(model, ids, labels) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=labels).loss
    return total


def test_backward_keeps_no_logits():
    """What autograd saves for backward: the unchunked loss keeps (B, T, V) logits in fp32 (several copies), the
    chunked one a log-sum-exp per position; everything else the two save is the same."""
    ref = _llama(tied=False)
    model = chunk_lm_loss(copy.deepcopy(ref), ChunkedLossConfig(max_chunk_bytes=4 * V * 4))
    ids, labels = _batch()
    unchunked, chunked = _saved_bytes(ref, ids, labels), _saved_bytes(model, ids, labels)
    logits_fp32 = ids.numel() * V * 4
    assert unchunked - chunked >= logits_fp32, (unchunked, chunked, logits_fp32)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        ChunkedLossConfig(max_chunk_bytes=0)
    with pytest.raises(ValueError, match="Hugging Face causal LM"):
        chunk_lm_loss(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        model = _llama(tied=False)
        model.config.final_logit_softcapping = 30.0
        chunk_lm_loss(model)
    model = chunk_lm_loss(_llama(tied=False))
    ids, labels = _batch()
    with pytest.raises(ValueError, match=f"below {V}"):
        model(input_ids=ids, labels=labels.clamp(max=V - 1) + 1)
    with pytest.raises(ValueError, match="must match the tokens"):
        chunked_lm_loss(torch.zeros(2, 5, 32), model.lm_head, labels)
    with pytest.raises(ValueError, match="linear layer"):
        chunked_lm_loss(torch.zeros(2, 5, 32), torch.nn.Embedding(4, 3), labels)
    assert torch.isnan(model(input_ids=ids, labels=torch.full_like(labels, -100)).loss)  # as F.cross_entropy


# -- the engine ------------------------------------------------------------------------------------------------------
ENGINE_CASES = [(0, {}), (1, {}), (2, {}), (3, {}), (2, {"offload_optimizer": {"device": "cpu"}}),
                (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})]


# fp32 sums the loss in another order: Adam's sign-like steps on near-zero gradients move a few elements by up to
# ~6e-5 (lr 1e-2) where the same-loss reference's bound is 5e-5; everything else is the fp32 tolerance.
CHUNKED_FP32 = Tolerance(loss=TOLERANCE["fp32"].loss, param_abs=2e-4, param_rel=TOLERANCE["fp32"].param_rel,
                         norm=TOLERANCE["fp32"].norm)


def _engine_grid(topo) -> list[str]:
    cache, errors = {}, []
    for stage, offload in ENGINE_CASES:
        case = Case(kind="llama", stage=stage, precision="fp32", gas=2, clip=1.0)
        cfg = case.ds_config(topo.world_size)
        cfg["zero_optimization"].update(offload)
        engine = ZeroEngine(module=chunk_lm_loss(make_model("llama"), ChunkedLossConfig(max_chunk_bytes=4 * 128 * 5)),
                            config=load_config(cfg, world_size=topo.world_size), topo=topo)
        losses, norms = [], []
        for step in range(case.steps):
            total = torch.zeros(1)
            for k in range(case.gas):
                batch = micro_batch("llama", step, k * topo.world_size + topo.rank)
                loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                engine.backward(loss)
                engine.step()
                total += loss.detach()
            losses.append(all_reduce(total, topo=topo, op=ReduceOp.AVG).item() / case.gas)
            norms.append(engine.last_outcome.grad_norm)
        got = {"losses": losses, "norms": norms, "params": engine.full_state_dict(master=True)}
        want = cached_reference(cache, case, topo.world_size)  # the unchunked model in plain PyTorch
        errors += compare(got, want, tol=CHUNKED_FP32, label=f"stage {stage} {offload}")
    return errors


def test_engine_stages_match_the_unchunked_reference():
    errors = run_distributed(_engine_grid, 2)
    assert errors == [[], []], "\n".join(errors[0] + errors[1])
