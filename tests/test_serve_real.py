"""The serving runner on real weights: SmolLM2-135M (GGUF, shared/DATA.md) written as a Hugging Face folder,
loaded by zserve's loader, prompts from Wikipedia, greedy against HF generate; both attention paths.

The tiny random models of the other runner tests make near-ties rare but not impossible and never look like a
trained model's attention; this is the check that the Triton slot attention ([Note: slot attention kernel], the
interpreter on the CPU) and the SDPA path give a real model's tokens with chunked prefill.
"""
import copy

import pytest
import torch

from zspeed.compress.assets import smollm2_gguf, wikipedia_json
from zspeed.compress.data import read_text
from zspeed.compress.hf import load_model as load_gguf, tokenize
from zspeed.serve.engine_loop import EngineLoop
from zspeed.serve.model_loader import LoadConfig, load_model
from zspeed.serve.request import Request, SamplingParams
from zspeed.serve.runner import ModelRunner
from zspeed.serve.scheduler import Scheduler, SchedulerConfig

NEW = 8


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(HF folder of SmolLM2 in fp32, three Wikipedia prompts, HF's greedy continuations)."""
    if smollm2_gguf() is None or wikipedia_json() is None:  # a set-up error, as in test_compress_real
        raise ImportError("offline assets not installed: install them as the README's test command does")
    model, tokenizer = load_gguf(str(smollm2_gguf()))
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):  # the GGUF loader marks the model; the weights are plain tensors
        del cfg.quantization_config
    plain = type(model)(cfg).float().eval()
    plain.load_state_dict(model.state_dict())
    folder = tmp_path_factory.mktemp("smollm2")
    plain.save_pretrained(folder, safe_serialization=True)
    ids = tokenize(read_text(wikipedia_json(), max_chars=4000), tokenizer)
    prompts = [ids[0:40].tolist(), ids[100:123].tolist(), ids[300:335].tolist()]
    with torch.no_grad():
        want = [plain.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    return folder, prompts, want


@pytest.mark.parametrize("kernel,graphs", [("sdpa", None), ("triton", None), ("triton", True)],
                         ids=["sdpa", "triton", "triton-whole-step"])
def test_smollm2_greedy_matches_hf_generate(smollm2, kernel, graphs, monkeypatch):
    folder, prompts, want = smollm2
    new = NEW
    if kernel == "triton":  # the interpreted attention kernel is the slow part (padded steps slower still): two
        # prompts (still chunked prefill, 40 tokens in chunks of 16), the first 4 tokens of HF's continuations;
        # SDPA decodes all three prompts' 8
        prompts, new = prompts[:2], 4
        want = [w[:new] for w in want[:2]]
    if kernel == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = load_model(LoadConfig(model=str(folder), device="cpu", dtype="float32", progress=False))
    # graphs=True with Triton: padded steps as the whole-step graphs run them ([Note: whole-step graphs])
    runner = ModelRunner(model, max_batch_size=4, max_model_len=256, attention_kernel=kernel, graphs=graphs)
    assert (runner._whole is not None) == bool(graphs)
    config = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=16, max_model_len=256,  # chunked prefill
                             eos_token_ids=frozenset())
    with EngineLoop(Scheduler(config, kv_capacity=runner.kv_capacity), runner) as engine:
        handles = [engine.submit(Request(request_id=f"r{i}", prompt_token_ids=p,
                                         sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)))
                   for i, p in enumerate(prompts)]
        got = [list(h.result(timeout=600).token_ids) for h in handles]
    assert runner.attention_kernel == kernel
    assert got == want
