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
        parts = [json.loads(line).get("text", "") for line in p.read_text().splitlines() if line.strip()]
    elif p.suffix == ".json":
        parts = _json_paragraphs(json.loads(p.read_text()), p)
    else:
        parts = [p.read_text()]
    text = "\n\n".join(s for s in parts if s)
    if not text.strip():
        raise ValueError(f"{p} holds no text")
    return text[:max_chars] if max_chars else text


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
