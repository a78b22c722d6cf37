"""Finding a model's files and reading its tensors one at a time (safetensors only).

A model is named by a local folder (a Hugging Face checkpoint, or a folder
written by ``zcompress``) or by a Hugging Face id already in the local cache
(looked up with ``HF_HUB_OFFLINE``: nothing is downloaded). Pickle-based
checkpoints (``.bin``, ``.pt``) are refused: loading them can run arbitrary
code. :class:`Checkpoint` opens the safetensors files memory-mapped and reads
a tensor only when asked, so no more than one tensor need be in host memory.
"""
from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from zspeed.compress.storage import META_FILE as COMPRESSED_META_FILE
from zspeed.compress.storage import TENSOR_FILE as COMPRESSED_TENSOR_FILE
from zspeed.compress.storage import read_metadata

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """The model cannot be found, or its files are not a checkpoint this server reads."""


def resolve_model_dir(spec: str) -> Path:
    """The local folder of ``spec``: a path, or a Hugging Face id found in the local cache."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"--model {spec!r} is a file; give the folder holding config.json and *.safetensors")
        return path
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _from_hf_cache(spec)
    raise CheckpointError(f"--model {spec!r}: no such folder, and not a Hugging Face id (org/name)")


def _from_hf_cache(repo_id: str) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise CheckpointError(f"--model {repo_id!r} is not in the local Hugging Face cache and nothing is downloaded "
                              f"(HF_HUB_OFFLINE); fetch it first or give a local folder") from None


class Checkpoint:
    """Lazy, read-only access to the tensors of one checkpoint folder.

    ``kind`` is ``"hf"`` (a Hugging Face folder) or ``"zcompress"``; for the
    latter ``compressed`` holds its metadata (module formats, tied aliases).
    ``hf_config`` is the model's ``config.json`` as a dict. Use as a context
    manager or call :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.compressed: dict | None = None
        if (self.directory / COMPRESSED_META_FILE).is_file():
            self.kind = "zcompress"
            self.compressed = read_metadata(self.directory)
            self.hf_config = self.compressed.get("hf_config")
            if not self.hf_config:
                raise CheckpointError(f"{self.directory}: the zcompress folder records no Hugging Face config")
            files = [self.directory / COMPRESSED_TENSOR_FILE]
        else:
            self.kind = "hf"
            self.hf_config = _read_json(self.directory / "config.json")
            files = _safetensors_files(self.directory)
        self.files = files
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for file in files:
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except (SafetensorError, OSError) as e:
                self._stack.close()
                raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
            self._where.update(dict.fromkeys(handle.keys(), handle))
        self.aliases: dict[str, str] = dict(self.compressed.get("tied", {})) if self.compressed else {}

    # -- facts -----------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._where or name in self.aliases

    def keys(self) -> list[str]:
        return list(self._where)

    def fingerprint(self) -> dict:
        """Names, sizes and modification times of the tensor files (to tell a changed checkpoint)."""
        return {"directory": str(self.directory.resolve()),
                "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]}

    # -- reading -----------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        """Reads one tensor (following tied aliases) into host memory."""
        return self._handle(name).get_tensor(self._source(name))

    def _source(self, name: str) -> str:
        return self.aliases.get(name, name)

    def _handle(self, name: str):
        try:
            return self._where[self._source(name)]
        except KeyError:
            raise CheckpointError(f"{self.directory}: no tensor {name!r} in the checkpoint") from None

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a Hugging Face checkpoint folder holds config.json")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise CheckpointError(f"{directory}: shards named in {index.name} are missing: {missing[:3]}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{directory} holds only pickle checkpoints ({', '.join(pickles[:3])}); they are not "
                              "loaded because unpickling can run arbitrary code: convert them to safetensors")
    raise CheckpointError(f"{directory}: no *.safetensors files")
