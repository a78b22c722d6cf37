"""Shared pieces of the ztrain tests: a tiny Llama, a fake sharded checkpoint of it, and a synthetic corpus."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from zspeed.core.partition import FlatPartition
from zspeed.train.checkpoint_format import (
    ShardedStateMeta,
    array_key,
    commit_dir,
    group_layout,
    staging_dir,
    update_latest,
    write_meta,
    write_rank_file,
)
from zspeed.train.tokenizer import ByteTokenizer

VOCAB = 259


def tiny_llama(seed: int = 0, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                      tie_word_embeddings=tie, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def save_sharded(model, root: Path, *, world: int, bucket_bytes: float = 24_000, tag: str = "global_step7",
                 arrays=(("param", None),)) -> Path:
    """Write ``model``'s parameters as ``world`` fake ranks would, through the checkpoint format."""
    names, params = zip(*[(n, p.detach()) for n, p in model.named_parameters()])
    part = FlatPartition.build(params, world_size=world, names=names, bucket_bytes=bucket_bytes)
    staging = staging_dir(root, tag)
    staging.mkdir(parents=True)
    layouts, fulls = [], {}
    for gi, (dtype, group) in enumerate(part.groups.items()):
        name = f"g{gi}.{str(dtype).removeprefix('torch.')}"
        fulls[name] = (group, group.flatten([p for p in params if p.dtype == dtype]))
        layouts.append(group_layout(name, group, arrays={a: d or dtype for a, d in arrays}))
    files = []
    for rank in range(world):
        tensors = {}
        for name, (group, full) in fulls.items():
            for a, d in arrays:
                tensors[array_key(name, a)] = group.shard_of(full, rank).to(d or full.dtype)
        files.append(write_rank_file(staging, rank, tensors))
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if model.config.tie_word_embeddings else {}
    write_meta(staging, ShardedStateMeta(world_size=world, groups=tuple(layouts), files=tuple(files),
                                         aliases=tied, state={"global_steps": 7}))
    model.config.save_pretrained(staging)
    ByteTokenizer().save_pretrained(staging)
    final = commit_dir(staging, root / tag)
    update_latest(root, tag)
    return final


def synthetic_corpus(path: Path, n: int = 160) -> Path:
    rng = random.Random(0)
    animals = ["cat", "dog", "fox", "owl", "bee", "cow"]
    verbs = ["sees", "likes", "chases", "follows"]
    lines = []
    for _ in range(n):
        sentence = " ".join(f"The {rng.choice(animals)} {rng.choice(verbs)} the {rng.choice(animals)}."
                            for _ in range(rng.randint(1, 3)))
        lines.append(json.dumps({"text": sentence}))
    path.write_text("\n".join(lines) + "\n")
    return path
