"""Named model shapes, and random-weight checkpoints of those shapes written layer by layer.

``tiny`` is a toy for tests and demos (byte vocabulary); ``llama-8b`` and
``llama-70b`` are the shapes of Llama-3 8B and 70B, for benchmarks and demos
where real weights are not at hand. :func:`write_random_checkpoint` writes a
Hugging Face folder (``config.json``, one safetensors shard per decoder layer
plus one for the rest, ``model.safetensors.index.json``) that any loader of HF
checkpoints reads, holding one layer in memory at a time.

[Note: parallel random fill] Drawing normals is the slow part of writing a
large random checkpoint (about 200 M values/s on one core: 45 s for eight
Llama-70B layers). Each tensor is therefore drawn in chunks of ``_CHUNK``
values, each from a generator seeded by (seed, tensor name, chunk index), on
a thread pool (``normal_`` releases the GIL), so the values depend on the
seed alone, not on the number of threads.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
               bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)

PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False),
    "llama-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8),
    "llama-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8),
}

INDEX_FILE = "model.safetensors.index.json"
_CHUNK = 1 << 22  # values drawn by one generator (see [Note: parallel random fill])


def preset_config(name: str, *, num_layers: int | None = None, dtype: torch.dtype = torch.bfloat16):
    """The ``LlamaConfig`` of preset ``name``, optionally with fewer (or more) decoder layers."""
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers}: use at least 1")
        fields["num_hidden_layers"] = num_layers
    config = LlamaConfig(**fields)
    config.dtype = dtype
    return config


def write_random_checkpoint(arch, out_dir: str | os.PathLike, *, num_layers: int | None = None,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0, progress: bool = True) -> Path:
    """Writes a random-weight checkpoint of ``arch`` (a preset name or an HF config) to ``out_dir``.

    Tensors are drawn one at a time (normal with the config's
    ``initializer_range``, norms at one) and written one shard per decoder
    layer, so memory holds at most one layer. The index file is written last:
    its presence marks a complete checkpoint (see :func:`is_complete`).
    Returns ``out_dir``.
    """
    config = preset_config(arch, num_layers=num_layers, dtype=dtype) if isinstance(arch, str) else arch
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX_FILE).unlink(missing_ok=True)
    config.save_pretrained(out)
    groups = _tensor_groups(config)
    std = getattr(config, "initializer_range", 0.02)
    weight_map, total = {}, 0
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="zspeed-random") as pool:
        for n, (_, shapes) in enumerate(tqdm(groups, desc="random weights", unit="shard", disable=not progress)):
            shard = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {name: _random(name, shape, dtype, std, seed, pool) for name, shape in shapes.items()}
            save_file(tensors, str(out / shard), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, shard))
            del tensors
    index = {"metadata": {"total_size": total, "zspeed_random_seed": seed}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1))
    return out


def is_complete(out_dir: str | os.PathLike) -> bool:
    """Whether ``out_dir`` holds a checkpoint :func:`write_random_checkpoint` finished."""
    return (Path(out_dir) / INDEX_FILE).is_file() and (Path(out_dir) / "config.json").is_file()


def _tensor_groups(config) -> list[tuple[str, dict[str, tuple[int, ...]]]]:
    """Names and shapes of every tensor, grouped as shards: the non-layer tensors, then one group per layer."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers_prefix = next(n for n, m in model.named_modules() if m is model.model.layers)
    groups: dict[str, dict[str, tuple[int, ...]]] = {"rest": {}}
    for name, tensor in model.state_dict().items():
        if name.startswith(layers_prefix + "."):
            index = name[len(layers_prefix) + 1:].split(".", 1)[0]
            groups.setdefault(f"layer{index}", {})[name] = tuple(tensor.shape)
        elif not (config.tie_word_embeddings and name == "lm_head.weight"):
            groups["rest"][name] = tuple(tensor.shape)
    return list(groups.items())


def _random(name: str, shape: tuple[int, ...], dtype: torch.dtype, std: float, seed: int,
            pool: ThreadPoolExecutor) -> torch.Tensor:
    """Norms at one, biases at zero, the rest normal(0, std) drawn in parallel chunks
    (see [Note: parallel random fill])."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    base = int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=5).digest(), "little") << 20

    def fill(start: int) -> None:
        gen = torch.Generator().manual_seed(base + start // _CHUNK)
        flat[start:start + _CHUNK].normal_(0.0, std, generator=gen)

    list(pool.map(fill, range(0, flat.numel(), _CHUNK)))
    return out
