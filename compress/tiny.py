"""A tiny, randomly initialised Llama (byte-level vocabulary) for demos and tests.

``zcompress ... --model tiny`` uses it, so every subcommand can be tried with no
checkpoint. Being random, its perplexity means nothing beyond "before vs after".
"""
from __future__ import annotations

import torch

TINY_NAME = "tiny"


def tiny_llama(*, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 256,
               seed: int = 0, dtype: torch.dtype = torch.float32):
    """A ``LlamaForCausalLM`` with a 256-token (byte) vocabulary and tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def byte_tokenize(text: str) -> torch.Tensor:
    """UTF-8 bytes as token ids (the tiny model's vocabulary), int64 ``(L,)``."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
