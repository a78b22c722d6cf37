"""Shared by the serving tests: a tiny random-weight Llama on disk and its Hugging Face greedy outputs."""
from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest
import torch

# Prompts of different lengths (token ids of the byte vocabulary), longer than the
# step budgets the tests use so that prompts are fed in chunks.
PROMPTS = [
    [72, 101, 108, 108, 111],
    list(range(30, 67)),
    [200, 17],
    list(range(100, 121)),
    [9],
    [(7 * i) % 250 + 3 for i in range(60)],
]
NEW_TOKENS = 24


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def build_tiny_model(seed: int = 0):
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_config()).eval()


class Reference:
    """Hugging Face ``generate(do_sample=False)`` of one model, memoized per (prompt, length)."""

    def __init__(self, model) -> None:
        self.model = model

    @functools.lru_cache(maxsize=None)
    def _greedy(self, prompt: tuple[int, ...], max_new_tokens: int, ignore_eos: bool) -> tuple[int, ...]:
        eos = None if ignore_eos else self.model.config.eos_token_id
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt)))
        return tuple(out[0, len(prompt):].tolist())

    def greedy(self, prompt, max_new_tokens: int = NEW_TOKENS, *, ignore_eos: bool = False) -> tuple[int, ...]:
        return self._greedy(tuple(prompt), max_new_tokens, ignore_eos)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny model saved with ``save_pretrained`` (safetensors)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model().save_pretrained(out)
    assert (out / "model.safetensors").is_file()
    return out


@pytest.fixture(scope="session")
def reference(tiny_dir) -> Reference:
    from transformers import LlamaForCausalLM

    return Reference(LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval())


def load_tiny(path, **overrides):
    from zspeed.serve.model_loader import LoadConfig, load_model

    return load_model(LoadConfig(model=str(path), device="cpu", progress=False, **overrides))


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def scrape(server) -> dict[tuple[str, tuple], float]:
    """A server's metrics page: ``{(sample name, sorted labels): value}``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def status_of(call):
    """The ``(grpc.StatusCode, details)`` that ``call()`` fails with (it must fail)."""
    import grpc

    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def check_concurrent_requests(client, reference) -> None:
    """All prompts at once (a barrier), different lengths: each output equals HF's for that prompt alone."""
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(PROMPTS))

    def one(i: int) -> None:
        barrier.wait()
        results[i] = client.generate(PROMPTS[i], max_new_tokens=10 + 3 * i, ignore_eos=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(PROMPTS):
        assert results[i].token_ids == reference.greedy(prompt, 10 + 3 * i, ignore_eos=True), i
