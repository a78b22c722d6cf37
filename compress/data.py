"""Text for calibration and evaluation: read a file, tokenize, cut into windows."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def read_text(path: str | os.PathLike, *, max_chars: int | None = None) -> str:
    """Plain text from ``.txt``, ``.jsonl`` (a ``"text"`` field per line) or ``.json``
    (a list of strings, or a mapping whose values carry ``"extract"``/``"text"`` —
    e.g. the Wikipedia summaries of DATA.md). Paragraphs are joined by blank lines."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file {p} not found")
    if p.suffix == ".jsonl":
        parts = [_jsonl_text(line, p, i) for i, line in enumerate(p.read_text().splitlines(), 1) if line.strip()]
    elif p.suffix == ".json":
        parts = _json_paragraphs(_parse(p.read_text(), p), p)
    else:
        parts = [p.read_text()]
    text = "\n\n".join(s for s in parts if s)
    if not text.strip():
        raise ValueError(f"{p} holds no text")
    return text[:max_chars] if max_chars else text


def _parse(text: str, p: Path, line: int | None = None) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{p}, line {line}" if line else str(p)
        raise ValueError(f"{where} is not valid JSON ({e})") from None


def _jsonl_text(line: str, p: Path, number: int) -> str:
    item = _parse(line, p, number)
    if not isinstance(item, dict):
        raise ValueError(f'{p}, line {number}: expected a JSON object with a "text" field')
    return item.get("text", "")


def _json_paragraphs(data: object, p: Path) -> list[str]:
    items = data.values() if isinstance(data, dict) else data
    if not isinstance(items, (list, type({}.values()))):
        raise ValueError(f"{p}: expected a JSON list or mapping of paragraphs")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            out.append(item.get("extract") or item.get("text") or "")
    return out


def windows(tokens: torch.Tensor, *, seq_len: int, count: int | None = None) -> list[torch.Tensor]:
    """Consecutive, non-overlapping ``(1, seq_len)`` windows of a 1-D token tensor."""
    n = tokens.numel() // seq_len
    if n == 0:
        raise ValueError(f"only {tokens.numel()} tokens: fewer than one window of seq_len={seq_len}")
    n = n if count is None else min(n, count)
    return [tokens[i * seq_len:(i + 1) * seq_len].unsqueeze(0) for i in range(n)]  # each (1, T)
