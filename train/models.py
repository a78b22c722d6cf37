"""The models ``ztrain`` trains: a named tiny architecture (random weights) or a local Hugging Face folder.

* Named architectures (:data:`TINY_ARCHITECTURES`, e.g. ``tiny-llama``) are built
  from a config with random weights, seeded; their vocabulary is the
  tokenizer's, so they pair with the byte-level fallback for demos and tests.
* A folder is loaded with ``AutoModelForCausalLM.from_pretrained(folder,
  use_safetensors=True, local_files_only=True)``: safetensors weights only,
  never pickle files, nothing fetched.

:func:`inspect_model` reads only the config (no weights), so the CLI can check
sequence length and vocabulary before any work.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .tokenizer import TextTokenizer, load_tokenizer

__all__ = ["ModelError", "TINY_ARCHITECTURES", "ModelSource", "resolve_model", "inspect_model", "model_config",
           "build_model", "check_vocab", "max_positions", "tokenizer_for", "parameter_shapes"]

# name → LlamaConfig arguments (vocab_size comes from the tokenizer).
TINY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
                       rope_theta=10000.0, rms_norm_eps=1e-5, use_cache=False),
}


class ModelError(ValueError):
    """A model that cannot be used: missing folder, no safetensors weights, vocabulary mismatch."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the model comes from: a named architecture, or a folder."""

    name: str  # the architecture name, or the folder as given
    folder: Path | None  # None for a named architecture

    @property
    def is_named(self) -> bool:
        return self.folder is None


def resolve_model(spec: str) -> ModelSource:
    """Check ``spec`` names a tiny architecture or a usable model folder.

    Raises:
        ModelError: no such folder; no ``config.json``; no ``.safetensors`` weights
            (a folder with only pickle ``.bin``/``.pt`` weights is refused by name).
    """
    if spec in TINY_ARCHITECTURES:
        return ModelSource(name=spec, folder=None)
    folder = Path(spec)
    if not folder.is_dir():
        names = ", ".join(TINY_ARCHITECTURES)
        raise ModelError(f"model {spec!r} is neither a folder nor a named architecture ({names})")
    if not (folder / "config.json").is_file():
        raise ModelError(f"model folder {folder} has no config.json")
    if not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        detail = (f"; it holds pickle weights ({', '.join(pickles[:3])}), which zspeed never loads: convert them "
                  "to safetensors first") if pickles else ""
        raise ModelError(f"model folder {folder} has no .safetensors weights{detail}")
    return ModelSource(name=spec, folder=folder)


def tokenizer_for(source: ModelSource) -> TextTokenizer:
    """The folder's tokenizer, or the byte-level fallback (always, for a named architecture)."""
    return load_tokenizer(source.folder)


def model_config(source: ModelSource, *, vocab_size: int | None = None):
    """The model's ``PretrainedConfig`` (no weights read). ``vocab_size`` sizes a named architecture."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if source.is_named:
        from transformers import LlamaConfig

        if vocab_size is None:
            raise ModelError(f"{source.name} takes its vocabulary size from the tokenizer; pass vocab_size")
        return LlamaConfig(vocab_size=vocab_size, **TINY_ARCHITECTURES[source.name])
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(source.folder), local_files_only=True)
    except Exception as e:  # many exception types; all mean "this config.json is not usable"
        raise ModelError(f"cannot read {source.folder / 'config.json'}: {type(e).__name__}: {e}") from e


def inspect_model(source: ModelSource, tokenizer: TextTokenizer):
    """The config, checked against the tokenizer (see :func:`check_vocab`)."""
    cfg = model_config(source, vocab_size=tokenizer.vocab_size)
    check_vocab(cfg, tokenizer, model=source.name)
    return cfg


def max_positions(config) -> int | None:
    """The longest sequence the model takes (``max_position_embeddings``; None when it does not say)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_vocab(config, tokenizer: TextTokenizer, *, model: str = "the model") -> None:
    """Every token id must index the embedding: ``tokenizer.vocab_size <= config.vocab_size``.

    A larger embedding than the tokenizer (padded vocabularies) is fine.
    """
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise ModelError(f"{model}'s config has no vocab_size")
    if tokenizer.vocab_size > vocab:
        raise ModelError(f"the tokenizer has {tokenizer.vocab_size} tokens but {model}'s embedding has only "
                         f"{vocab} rows (config vocab_size); token ids >= {vocab} would be out of range. Use the "
                         "model's own tokenizer files in its folder")


def build_model(source: ModelSource, tokenizer: TextTokenizer, *, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model, in training mode: random weights (seeded) for a named architecture, else the folder's."""
    cfg = inspect_model(source, tokenizer)
    if source.is_named:
        from transformers import LlamaForCausalLM

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = LlamaForCausalLM(cfg).to(dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(source.folder), use_safetensors=True,
                                                     local_files_only=True, dtype=dtype)
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # no KV cache in training
    return model.train()


def parameter_shapes(source: ModelSource, tokenizer: TextTokenizer) -> dict[str, tuple[int, ...]]:
    """Every parameter name (tied names included) and shape, from the config alone (built on the meta device)."""
    cfg = inspect_model(source, tokenizer)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
