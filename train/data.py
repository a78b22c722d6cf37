"""Local training data for ``ztrain``: read, tokenize, pack, split, and shard by rank.

The pipeline, each step a function:

1. :func:`read_documents` reads ``.jsonl`` files (one object per line, with a
   ``"text"`` field, or ``"prompt"`` and ``"completion"``) and ``.txt`` files
   (each file one document), from files or folders, and checks all of it
   first: a missing or empty file, or a malformed line (``file:line``), is a
   :class:`DataError` before any tokenization.
2. :func:`build_splits` shuffles the documents by seed, holds out the last
   ``eval_fraction`` of the tokens for eval (see [Note: held-out split]
After the seeded document shuffle, the documents are concatenated and the
last ``eval_fraction`` of the tokens (rounded up) is held out for eval. The
shuffle makes that tail a random sample of whole documents, the two splits
share no token, and at most one document (the one at the cut) has a part in
each. The cut is on tokens, not documents, so a single long document (one
.txt file) splits too.

[Note: global order]) and resumes from a :class:`DataCursor`.

[Note: packing]
Documents are concatenated, each followed by the EOS id, and cut into rows of
``seq_len`` tokens; a document may continue into the next row. Labels equal the
input ids except on prompt tokens of prompt/completion records, which are
-100 (completion-only loss), and on padding. The last, partial row is padded
with the pad id (labels -100). A row with no trained label after its first
position (Hugging Face causal-LM losses shift labels by one) is dropped: its
loss would be 0/0.

[Note: held-out split]
After the seeded document shuffle, eval takes whole documents from the end of
the order until it holds at least ``eval_fraction`` of the tokens. When that
would leave training nothing (a single long document, say), the split falls on
a token boundary instead: the last ``eval_fraction`` of the token stream.
Either way the two splits share no token, and at most one document is cut.

[Note: global order]
For epoch ``e`` the global order is a permutation of the training rows seeded
by ``(seed, e)`` and nothing else. Global batch ``k`` of the epoch is positions
``[p0 + k·G, p0 + (k+1)·G)`` of that order (``G`` = ``train_batch_size``,
``p0`` = the cursor's position at the start of this run), and rank ``r`` of
``W`` takes its positions ``r, r+W, r+2W, ...``, cut into micro-batches in that
order. So the set of rows in each global batch, hence the averaged gradient,
does not depend on ``W``; a :class:`DataCursor` (epoch, rows consumed) saved at
one world size resumes at another. A trailing partial global batch is dropped.
"""
from __future__ import annotations

import array
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Sampler

from .tokenizer import TextTokenizer

__all__ = ["DataError", "Document", "DataConfig", "PackedDataset", "DataSplits", "DataCursor", "TrainStep",
           "GlobalOrderSampler", "resolve_data_files", "read_documents", "build_splits", "check_seq_len",
           "collate"]

IGNORE_INDEX = -100
DATA_SUFFIXES = (".jsonl", ".txt")
_TOKENIZE_BATCH = 256


class DataError(ValueError):
    """Unusable training data; the message names the file (and line)."""


@dataclass(frozen=True, slots=True)
class Document:
    """One training document: ``text``, or a ``prompt`` (not trained on) and its ``completion``."""

    source: str  # "file" or "file:line"
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None

    @property
    def chars(self) -> int:
        return len(self.text or "") + len(self.prompt or "") + len(self.completion or "")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """How documents become training rows.

    seq_len: tokens per row (≥ 2).
    seed: document shuffle and per-epoch order.
    eval_fraction: share of the tokens held out for eval loss (0 = no eval split).
    """

    seq_len: int
    seed: int = 0
    eval_fraction: float = 0.05

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise DataError(f"seq_len must be an integer >= 2, got {self.seq_len!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise DataError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")


# -- reading -----------------------------------------------------------------------------------

def resolve_data_files(paths: Sequence[str | Path]) -> list[Path]:
    """The data files named by ``paths`` (files, or folders searched recursively for .jsonl/.txt).

    Raises:
        DataError: a path that does not exist, a file of another type, a folder
            with no data files, or an empty file; each names the path.
    """
    if not paths:
        raise DataError("no data given: pass a .jsonl file, .txt files, or a folder of them")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
            if not found:
                raise DataError(f"data folder {path} holds no .jsonl or .txt files")
            files.extend(found)
        elif path.is_file():
            if path.suffix.lower() not in DATA_SUFFIXES:
                raise DataError(f"data file {path}: unsupported type {path.suffix or '(no suffix)'!r}; "
                                f"expected .jsonl (text or prompt/completion records) or .txt")
            files.append(path)
        else:
            raise DataError(f"data path {path} does not exist")
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"data file {f} is empty")
    return files


def read_documents(paths: Sequence[str | Path]) -> list[Document]:
    """Every document in ``paths``, checked (see the module docstring); file order, then line order.

    Records whose trained text is empty (``"text": ""``, ``"completion": ""``) are skipped.

    Raises:
        DataError: naming the file (and ``file:line`` for JSONL problems).
    """
    docs: list[Document] = []
    for f in resolve_data_files(paths):
        found = _read_jsonl(f) if f.suffix.lower() == ".jsonl" else _read_txt(f)
        if not found:
            raise DataError(f"data file {f} holds no text (every record is empty)")
        docs.extend(found)
    return docs


def _read_txt(path: Path) -> list[Document]:
    text = _read_utf8(path)
    return [Document(source=str(path), text=text)] if text.strip() else []


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text (bad byte at offset {e.start})") from None


def _read_jsonl(path: Path) -> list[Document]:
    docs: list[Document] = []
    for lineno, line in enumerate(_read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        doc = _record_to_document(record, where)
        if doc is not None:
            docs.append(doc)
    return docs


def _record_to_document(record: Any, where: str) -> Document | None:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with \"text\" or \"prompt\"/\"completion\", "
                        f"got {type(record).__name__}")
    has_text, has_pc = "text" in record, ("prompt" in record or "completion" in record)
    if has_text and has_pc:
        raise DataError(f"{where}: has both \"text\" and \"prompt\"/\"completion\"; give one form per record")
    if not has_text and not has_pc:
        keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        raise DataError(f"{where}: needs a \"text\" field, or \"prompt\" and \"completion\" fields "
                        f"(found keys: {keys})")
    if has_text:
        text = _string_field(record, "text", where)
        return Document(source=where, text=text) if text else None
    for name in ("prompt", "completion"):
        if name not in record:
            other = "completion" if name == "prompt" else "prompt"
            raise DataError(f"{where}: has \"{other}\" but no \"{name}\"")
    prompt, completion = _string_field(record, "prompt", where), _string_field(record, "completion", where)
    return Document(source=where, prompt=prompt, completion=completion) if completion else None


def _string_field(record: dict, name: str, where: str) -> str:
    value = record[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: \"{name}\" must be a string, got {type(value).__name__}")
    return value


# -- checks against the model ------------------------------------------------------------------

def check_seq_len(seq_len: int, max_positions: int | None, *, model: str = "the model") -> None:
    """Refuse rows longer than the model's position limit (``max_position_embeddings``)."""
    if max_positions is not None and seq_len > max_positions:
        raise DataError(f"sequence length {seq_len} is longer than {model} allows "
                        f"(max_position_embeddings = {max_positions}); use --seq-len {max_positions} or less")


# -- tokenizing and packing --------------------------------------------------------------------

class PackedDataset(Dataset):
    """Rows of ``seq_len`` tokens: ``input_ids`` and ``labels``, each ``(rows, seq_len)``."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        if input_ids.shape != labels.shape or input_ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must be "
                             "the same (rows, seq_len) shape")
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i].long(), "labels": self.labels[i].long()}

    def trained_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def collate(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack rows into a batch: ``input_ids`` and ``labels`` of shape ``(B, seq_len)``."""
    return {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}


@dataclass
class DataSplits:
    """The packed training rows, the eval rows (None without an eval split), and counts for the log."""

    train: PackedDataset
    eval: PackedDataset | None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Stream:
    """A run of tokens and their labels, concatenated documents."""

    ids: array.array = field(default_factory=lambda: array.array("q"))
    labels: array.array = field(default_factory=lambda: array.array("q"))

    def __len__(self) -> int:
        return len(self.ids)

    def split_at(self, n: int) -> tuple["_Stream", "_Stream"]:
        return (_Stream(self.ids[:n], self.labels[:n]), _Stream(self.ids[n:], self.labels[n:]))


def build_splits(docs: Sequence[Document], tokenizer: TextTokenizer, config: DataConfig) -> DataSplits:
    """Shuffle, tokenize, split and pack ``docs`` (see the module's notes).

    Raises:
        DataError: the documents give no trainable row.
    """
    if not docs:
        raise DataError("no documents to train on")
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(config.seed)).tolist()
    streams = _tokenize([docs[i] for i in order], tokenizer)  # one per document, shuffled order
    train, held = _split(streams, config.eval_fraction)
    train_rows = _pack(train, config.seq_len, tokenizer.pad_token_id)
    if len(train_rows) == 0:
        raise DataError(f"the data gives no training row of {config.seq_len} tokens with a trained label "
                        f"({sum(len(s) for s in streams)} tokens in {len(docs)} documents)")
    eval_rows = _pack(held, config.seq_len, tokenizer.pad_token_id) if len(held) else None
    if eval_rows is not None and len(eval_rows) == 0:
        eval_rows = None
    stats = {"documents": len(docs), "tokens": sum(len(s) for s in streams), "train_rows": len(train_rows),
             "eval_rows": 0 if eval_rows is None else len(eval_rows), "seq_len": config.seq_len,
             "train_trained_tokens": train_rows.trained_tokens()}
    return DataSplits(train=train_rows, eval=eval_rows, stats=stats)


def _tokenize(docs: Sequence[Document], tokenizer: TextTokenizer) -> list[_Stream]:
    """One stream per document: its tokens then EOS; prompt tokens labelled -100."""
    out: list[_Stream] = []
    eos = tokenizer.eos_token_id
    for start in range(0, len(docs), _TOKENIZE_BATCH):
        batch = docs[start:start + _TOKENIZE_BATCH]
        texts = [d.text if d.text is not None else d.completion for d in batch]
        trained = tokenizer.encode_batch(texts)
        prompts = tokenizer.encode_batch([d.prompt or "" for d in batch])
        for t, p in zip(trained, prompts):
            s = _Stream()
            s.ids.extend(p)
            s.labels.extend([IGNORE_INDEX] * len(p))
            s.ids.extend(t)
            s.ids.append(eos)
            s.labels.extend(t)
            s.labels.append(eos)
            out.append(s)
    return out


def _split(streams: list[_Stream], eval_fraction: float) -> tuple[_Stream, _Stream]:
    """Training and eval streams; see [Note: held-out split]."""
    whole = _concat(streams)
    held = math.ceil(len(whole) * eval_fraction) if eval_fraction > 0 else 0
    return whole.split_at(len(whole) - held)


def _concat(streams: Sequence[_Stream]) -> _Stream:
    out = _Stream()
    for s in streams:
        out.ids.extend(s.ids)
        out.labels.extend(s.labels)
    return out


def _pack(stream: _Stream, seq_len: int, pad_id: int) -> PackedDataset:
    """Rows of ``seq_len``; see [Note: packing]."""
    n = len(stream)
    rows = max(1, math.ceil(n / seq_len))
    ids = torch.full((rows * seq_len,), pad_id, dtype=torch.int64)
    labels = torch.full((rows * seq_len,), IGNORE_INDEX, dtype=torch.int64)
    if n:
        ids[:n] = torch.frombuffer(stream.ids, dtype=torch.int64)
        labels[:n] = torch.frombuffer(stream.labels, dtype=torch.int64)
    ids, labels = ids.view(rows, seq_len), labels.view(rows, seq_len)  # (rows, T)
    keep = (labels[:, 1:] != IGNORE_INDEX).any(dim=1)
    dtype = torch.int32 if max(pad_id, int(ids.max()) if n else 0) < 2**31 else torch.int64
    return PackedDataset(ids[keep].to(dtype), labels[keep].to(dtype))


# -- the order of rows across ranks and epochs -------------------------------------------------

@dataclass(frozen=True, slots=True)
class DataCursor:
    """Where training is in the data: ``position`` rows of epoch ``epoch``'s global order are consumed."""

    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataCursor":
        try:
            epoch, position = int(d["epoch"]), int(d["position"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"a data cursor needs integer 'epoch' and 'position', got {d!r}") from None
        if epoch < 0 or position < 0:
            raise DataError(f"a data cursor cannot be negative, got {d!r}")
        return cls(epoch=epoch, position=position)


@dataclass(frozen=True, slots=True)
class TrainStep:
    """One optimizer step's data for this rank: its micro-batches (row indices) and the cursor after it."""

    epoch: int
    micro_batches: tuple[tuple[int, ...], ...]
    cursor_after: DataCursor


class GlobalOrderSampler(Sampler[int]):
    """This rank's rows, in the world-size-independent global order (see [Note: global order]).

    Args:
        num_rows: rows in the training set.
        global_batch: rows per optimizer step over all ranks (``train_batch_size``).
        micro_batch: rows per forward on one rank; ``global_batch`` must be a
            multiple of ``micro_batch × world_size``.
        rank, world_size: this process's place.
        seed: the order's seed.
        cursor: where to start (default: the beginning of epoch 0).

    As a torch ``Sampler`` it yields this rank's row indices from the cursor to
    the end of the cursor's epoch, micro-batch after micro-batch (use it with
    ``DataLoader(batch_size=micro_batch, drop_last=True)``); :meth:`steps` is
    the explicit form the trainer uses.
    """

    def __init__(self, num_rows: int, *, global_batch: int, micro_batch: int, rank: int, world_size: int,
                 seed: int = 0, cursor: DataCursor = DataCursor()):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if micro_batch < 1 or global_batch % (micro_batch * world_size):
            raise DataError(f"the global batch ({global_batch}) must be a multiple of micro-batch ({micro_batch}) "
                            f"× world size ({world_size}) = {micro_batch * world_size}")
        if num_rows < global_batch:
            raise DataError(f"the training split has {num_rows} rows, fewer than one global batch of "
                            f"{global_batch}; add data, or lower the global batch or the sequence length")
        self.num_rows, self.global_batch, self.micro_batch = num_rows, global_batch, micro_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.cursor = cursor
        self._order_cache: tuple[int, list[int]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch (from position 0)."""
        return self.num_rows // self.global_batch

    def epoch_order(self, epoch: int) -> list[int]:
        """The global order of rows in ``epoch`` (a permutation; depends only on seed and epoch)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            g = torch.Generator().manual_seed(_mix(self.seed, epoch))
            self._order_cache = (epoch, torch.randperm(self.num_rows, generator=g).tolist())
        return self._order_cache[1]

    def global_batch_at(self, epoch: int, position: int) -> list[int]:
        """The ``global_batch`` rows at ``position`` of ``epoch``'s order."""
        return self.epoch_order(epoch)[position:position + self.global_batch]

    def rank_rows(self, global_rows: Sequence[int]) -> list[int]:
        """This rank's part of a global batch: positions ``rank, rank + W, ...``."""
        return list(global_rows[self.rank::self.world_size])

    def steps(self, *, epochs: int | None = None, max_steps: int | None = None,
              cursor: DataCursor | None = None) -> Iterator[TrainStep]:
        """The steps from ``cursor`` (default: the sampler's) until ``epochs`` epochs or ``max_steps`` steps."""
        if epochs is None and max_steps is None:
            raise ValueError("give epochs or max_steps")
        cur = cursor or self.cursor
        taken = 0
        while (epochs is None or cur.epoch < epochs) and (max_steps is None or taken < max_steps):
            if cur.position + self.global_batch > self.num_rows:
                cur = DataCursor(epoch=cur.epoch + 1, position=0)
                continue
            mine = self.rank_rows(self.global_batch_at(cur.epoch, cur.position))
            micro = tuple(tuple(mine[i:i + self.micro_batch]) for i in range(0, len(mine), self.micro_batch))
            cur_after = DataCursor(epoch=cur.epoch, position=cur.position + self.global_batch)
            yield TrainStep(epoch=cur.epoch, micro_batches=micro, cursor_after=cur_after)
            cur, taken = cur_after, taken + 1

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (as ``DistributedSampler.set_epoch``)."""
        self.cursor = DataCursor(epoch=epoch, position=0)

    def __iter__(self) -> Iterator[int]:
        for step in self.steps(epochs=self.cursor.epoch + 1):
            for mb in step.micro_batches:
                yield from mb

    def __len__(self) -> int:
        remaining = (self.num_rows - self.cursor.position) // self.global_batch
        return max(0, remaining) * (self.global_batch // self.world_size)


def _mix(seed: int, epoch: int) -> int:
    """One generator seed per (seed, epoch) pair, distinct across pairs in practice."""
    return (seed * 0x9E3779B1 + epoch * 0x85EBCA77 + 0x165667B1) % (2**63)
