"""Text <-> token ids for the server: the model's Hugging Face tokenizer, or UTF-8 bytes without one.

Both are safe to call from several threads (gRPC handlers encode, the engine
thread decodes); the Hugging Face one is serialized by a lock because a fast
tokenizer refuses concurrent use of one instance.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Protocol, Sequence

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (models with no tokenizer, e.g. the ``tiny`` preset).

    Decoding skips ids above 255 and shows broken UTF-8 as U+FFFD, which the
    scheduler's text stream holds back until the next byte completes it.
    """

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer: prompts get the model's special tokens (e.g. BOS); output skips them."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._lock = threading.Lock()
        self.name = type(tokenizer).__name__

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self._tok(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(directory: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer saved in ``directory``, or :class:`ByteTokenizer` when there is none."""
    if directory is None or not any((Path(directory) / f).is_file() for f in _TOKENIZER_FILES):
        return ByteTokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(directory)))
