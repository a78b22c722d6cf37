"""Loading the models ``zcompress`` works on: a Hugging Face folder, a GGUF file,
a compressed folder, or the built-in tiny Llama."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from .storage import META_FILE, TENSOR_FILE, corrupt_file_error, load_compressed
from .transform import DECLARED_DTYPE
from .tiny import TINY_NAME, byte_tokenize, tiny_llama


def is_compressed(path: str | os.PathLike) -> bool:
    return (Path(path) / META_FILE).is_file()


def load_model(spec: str, *, dtype: torch.dtype = torch.float32, flag: str = "--model"
               ) -> tuple[nn.Module, object | None]:
    """``(model, tokenizer or None)`` for ``tiny``, a compressed folder, an HF folder or a ``.gguf`` file.
    ``flag`` names the option that gave ``spec``, for error messages."""
    if spec == TINY_NAME:
        return tiny_llama(dtype=dtype), None
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"model {spec!r} not found: give a Hugging Face folder, a .gguf file, a folder "
                                f"written by zcompress, or {TINY_NAME!r}")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{flag} {spec} is a file; {flag} takes the model's folder (here {path.parent}), "
                         "or a .gguf file")
    if path.is_dir() and is_compressed(path):
        return load_compressed(path), _tokenizer(path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{flag} {spec} is not a zcompress output: no {META_FILE} (nor a Hugging Face "
                         "folder: no config.json)")
    return _load_hf(path, dtype), _tokenizer(path)


def vocab_size(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (the token ids it accepts), when it has one."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return getattr(emb, "num_embeddings", None)


def _load_hf(path: Path, dtype: torch.dtype) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        model.config.__dict__.pop("quantization_config", None)  # weights are already expanded to floats
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        except SafetensorError as e:
            raise corrupt_file_error(path / TENSOR_FILE, e) from None
        declared = _declared_dtype(path)
        if declared is not None:  # what config.json names (scale dtype "auto": compress/config.py with_scale_dtype)
            setattr(model, DECLARED_DTYPE, declared)
    return model.eval()


def _declared_dtype(path: Path) -> torch.dtype | None:
    """The dtype a Hugging Face folder's ``config.json`` declares (``dtype``, or ``torch_dtype`` before
    transformers 5), if it names a floating dtype."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _tokenizer(path: Path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None  # no tokenizer files: byte-level ids (the tiny model's vocabulary)
    return AutoTokenizer.from_pretrained(str(path))


def tokenize(text: str, tokenizer) -> torch.Tensor:
    """Token ids ``(L,)``: the model's tokenizer, or UTF-8 bytes without one."""
    if tokenizer is None:
        return byte_tokenize(text)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
