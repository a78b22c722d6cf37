"""Tokenizers for ``ztrain``: a model folder's own (Hugging Face), or a byte-level fallback.

Everything in :mod:`zspeed.train.data` talks to the small :class:`TextTokenizer`
protocol: encode a batch of texts (no special tokens added), and say the
vocabulary size and the EOS / pad ids. Two implementations:

* :class:`HFTokenizer` wraps ``AutoTokenizer.from_pretrained(folder)``, loaded
  from the local folder only (no hub access);
* :class:`ByteTokenizer`, used when the folder has no tokenizer files (and for
  the named tiny architectures): token ``b`` is the byte ``b`` of the UTF-8
  text (0-255), then three special tokens, ``<|bos|>`` 256, ``<|eos|>`` 257,
  ``<|pad|>`` 258, so ``vocab_size == 259``. :meth:`ByteTokenizer.save_pretrained`
  writes an equivalent Hugging Face ``tokenizer.json`` (byte-level BPE with no
  merges), so an exported model folder loads with ``AutoTokenizer`` and gives
  the same ids.

[Note: special-token text in training data]
Text that happens to contain a special token's spelling (``"<|eos|>"``,
``"</s>"``) is tokenized as ordinary characters, never as the control token:
documents are separated by the EOS *id* that packing inserts, and a stray
string in the data must not end a document early. :class:`ByteTokenizer` does
this by construction; :class:`HFTokenizer` passes ``split_special_tokens=True``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

__all__ = ["TextTokenizer", "ByteTokenizer", "HFTokenizer", "TokenizerError", "load_tokenizer",
           "has_tokenizer_files", "tokenizer_summary", "TOKENIZER_FILES"]

# Files that make up a Hugging Face tokenizer; any one of the first four means "the folder has one".
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.txt")
_DEFINING_FILES = TOKENIZER_FILES[:4]


class TokenizerError(ValueError):
    """A tokenizer that cannot be used for training (no EOS token, unreadable files)."""


@runtime_checkable
class TextTokenizer(Protocol):
    """What packing needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (every id is ``< vocab_size``)."""

    @property
    def eos_token_id(self) -> int: ...

    @property
    def pad_token_id(self) -> int: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write Hugging Face tokenizer files into ``folder``."""


# -- the byte-level fallback ------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map, which byte-level BPE models use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0-255) plus ``<|bos|>`` 256, ``<|eos|>`` 257, ``<|pad|>`` 258."""

    SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 256 + len(SPECIAL_TOKENS)
    is_fallback = True

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text (invalid UTF-8 replaced); special tokens are dropped."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write an equivalent Hugging Face tokenizer (``tokenizer.json`` + config) into ``folder``."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        chars = _bytes_to_unicode()
        vocab = {chars[b]: b for b in range(256)}
        vocab.update({s: 256 + i for i, s in enumerate(self.SPECIAL_TOKENS)})
        core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        core.decoder = decoders.ByteLevel()
        core.add_special_tokens(list(self.SPECIAL_TOKENS))
        bos, eos, pad = self.SPECIAL_TOKENS
        hf = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=pad)
        hf.save_pretrained(str(folder))

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


# -- a model folder's tokenizer ---------------------------------------------------------------

class HFTokenizer:
    """A Hugging Face tokenizer seen through :class:`TextTokenizer`."""

    is_fallback = False

    def __init__(self, tokenizer, *, source: str = "<tokenizer>"):
        self.tokenizer = tokenizer
        self.source = source
        eos = tokenizer.eos_token_id
        if eos is None:
            raise TokenizerError(f"the tokenizer in {source} has no EOS token, which packing puts between "
                                 "documents; set eos_token in its tokenizer_config.json")
        self._eos = int(eos)
        pad = tokenizer.pad_token_id
        self._pad = self._eos if pad is None else int(pad)  # padded positions carry label -100 anyway

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def pad_token_id(self) -> int:
        return self._pad

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        # See [Note: special-token text in training data].
        out = self.tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True,
                             return_attention_mask=False, verbose=False)
        return [list(ids) for ids in out["input_ids"]]

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        self.tokenizer.save_pretrained(str(folder))

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.tokenizer).__name__} from {self.source}, vocab_size={self.vocab_size})"


def has_tokenizer_files(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a Hugging Face tokenizer (a ``tokenizer.json``, ``.model``, ...)."""
    path = Path(folder)
    return path.is_dir() and any((path / name).is_file() for name in _DEFINING_FILES)


def load_tokenizer(folder: str | os.PathLike | None) -> TextTokenizer:
    """The tokenizer of a local model folder, or :class:`ByteTokenizer` when it has none (or no folder).

    Loads with ``AutoTokenizer.from_pretrained(folder, local_files_only=True)``;
    nothing is fetched from a hub.

    Raises:
        TokenizerError: the files exist but do not load, or the tokenizer has no EOS token.
    """
    if folder is None or not has_tokenizer_files(folder):
        return ByteTokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many types here; all mean "cannot load this folder's tokenizer"
        raise TokenizerError(f"cannot load the tokenizer in {folder}: {type(e).__name__}: {e}") from e
    return HFTokenizer(tok, source=str(folder))


def tokenizer_summary(tok: TextTokenizer) -> dict:
    """A JSON-able description for logs."""
    return {"kind": "bytes" if getattr(tok, "is_fallback", False) else "hf", "vocab_size": tok.vocab_size,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
