"""The word kernels' tuning choices, kept on disk so a machine tunes each shape once.

One JSON file per GPU model and Triton version (a choice made on one does not
carry to another) under ``$ZSPEED_CACHE_DIR`` (default ``~/.cache/zspeed``);
``ZSPEED_TUNING_CACHE=0`` turns it off. Writes are atomic (temporary file, then
rename), so concurrent processes at worst both tune a shape. A file that cannot be
read or parsed, or an entry that names fields this version does not have, is
ignored (and replaced at the next write), never an error: the cache only saves time.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

FORMAT_VERSION = 1


class TuningCache:
    """``key tuple -> WordConfig``, backed by one JSON file (``None``: in memory only)."""

    def __init__(self, path: Path | None):
        self.path = path
        self._entries: dict[str, dict] | None = None

    @classmethod
    def default(cls) -> "TuningCache":
        if os.environ.get("ZSPEED_TUNING_CACHE", "1") in ("0", "false", "no"):
            return cls(None)
        import torch
        import triton

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{gpu}-triton{triton.__version__}")
        root = Path(os.environ.get("ZSPEED_CACHE_DIR") or Path.home() / ".cache" / "zspeed")
        return cls(root / "kernel-tuning" / f"{name}.json")

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = {}
            if self.path is not None:
                try:
                    data = json.loads(self.path.read_text())
                    if data.get("version") == FORMAT_VERSION and isinstance(data.get("entries"), dict):
                        self._entries = data["entries"]
                except (OSError, ValueError, AttributeError):
                    pass
        return self._entries

    def get(self, key: tuple):
        from ._word import WordConfig

        raw = self._load().get(_key(key))
        names = {f.name for f in fields(WordConfig)}
        if not isinstance(raw, dict) or set(raw) != names:
            return None
        try:
            return WordConfig(**raw)
        except TypeError:
            return None

    def put(self, key: tuple, config) -> None:
        self._load()[_key(key)] = asdict(config)
        if self.path is None:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": FORMAT_VERSION, "entries": self._entries}, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
            tmp = None
        except OSError:
            pass  # a read-only home or a full disk costs re-tuning, nothing else
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def _key(key: tuple) -> str:
    return "|".join(str(k) for k in key)
