"""Export to a Hugging Face model folder, streaming: never the whole model in host memory.

Two sources:

* :func:`export_checkpoint` consolidates a sharded training state (per-rank
  safetensors files + ``zspeed_state.json``, see ``[Note: sharded state layout]``
  in :mod:`zspeed.train.checkpoint_format`) at any world size;
* :func:`export_state_dict` writes a state dict already in memory (what
  ``engine.full_state_dict()`` returns).

Both write ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` files
of at most ``max_shard_bytes`` each, with ``model.safetensors.index.json``),
``config.json`` and the tokenizer files, into a temporary folder renamed into
place at the end (see ``[Note: atomic checkpoints]``), so the result loads
with ``AutoModelForCausalLM.from_pretrained``.

[Note: streaming consolidation]
The output files are planned from the metadata alone (names, shapes, dtypes),
so each safetensors header is written first and every tensor's bytes follow in
order. A tensor's bytes are copied from its pieces in ``tensor_start`` order;
each piece is read from its rank's file with ``safe_open(...).get_slice``
(memory-mapped, only that range is touched) in runs of at most
``read_chunk_bytes``, converted to the output dtype, and written. Host memory
is therefore bounded by about two read chunks (the slice and its converted
copy), whatever the size of the model or of its largest tensor; no tensor is
ever assembled whole. Each rank file's CRC-32 is verified before any byte of
it is used.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Sequence

import torch

from .checkpoint_format import (
    CheckpointFormatError,
    GroupLayout,
    ShardedStateMeta,
    TensorLayout,
    array_key,
    atomic_output_dir,
    parse_dtype,
    read_meta,
    verify_files,
)
from .tokenizer import TOKENIZER_FILES

__all__ = ["ExportConfig", "ExportReport", "ShardReader", "export_checkpoint", "export_state_dict",
           "SAFETENSORS_INDEX"]

SAFETENSORS_INDEX = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportConfig:
    """How to export.

    max_shard_bytes: largest output file (a tensor larger than this gets a file of its own).
    dtype: output dtype of floating tensors; None keeps the stored dtype.
    arrays: from a checkpoint, which array to export per group: the first of these it has
        (``master`` = fp32 master weights, ``param`` = the compute copy).
    read_chunk_bytes: most bytes read from a shard file at once (the memory bound).
    verify: check each rank file's CRC-32 before reading it.
    write_aliases: also write tied names (``lm_head.weight``); Hugging Face re-ties them on load.
    overwrite: replace an existing output folder.
    """

    max_shard_bytes: int = 2 << 30
    dtype: torch.dtype | None = None
    arrays: tuple[str, ...] = ("master", "param")
    read_chunk_bytes: int = 64 << 20
    verify: bool = True
    write_aliases: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.max_shard_bytes < 1 or self.read_chunk_bytes < 1:
            raise ValueError("max_shard_bytes and read_chunk_bytes must be positive")
        if not self.arrays:
            raise ValueError("arrays must name at least one array")


@dataclass(frozen=True, slots=True)
class ExportReport:
    folder: Path
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    largest_read_bytes: int  # the largest single slice read from a shard file (0 for a state dict)


@dataclass(frozen=True, slots=True)
class _OutTensor:
    """One output tensor: what its header says, and how to stream its bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    write: Callable[[BinaryIO], None]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _element_size(self.dtype)


# -- public entry points -----------------------------------------------------------------------

def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      hf_config: Mapping[str, Any] | str | os.PathLike | None = None,
                      tokenizer: Any = None, config: ExportConfig = ExportConfig()) -> ExportReport:
    """Consolidate a sharded state into a Hugging Face folder (see [Note: streaming consolidation]).

    Args:
        checkpoint_dir: a checkpoint tag folder (with ``zspeed_state.json``).
        out_dir: the folder to create.
        hf_config: the model's config (a dict, or the path of a ``config.json``);
            default ``checkpoint_dir/config.json``.
        tokenizer: a folder to copy tokenizer files from, or an object with
            ``save_pretrained``; default: tokenizer files in ``checkpoint_dir``.
        config: see :class:`ExportConfig`.

    Raises:
        CheckpointFormatError: bad metadata, a group without any of ``config.arrays``,
            a rank file whose array has the wrong size.
        CheckpointCorruptError: a rank file that fails its checksum (named).
    """
    src = Path(checkpoint_dir)
    meta = read_meta(src)
    if config.verify:
        verify_files(src, meta)
    cfg = _read_hf_config(hf_config if hf_config is not None else src / "config.json")
    with _ShardReader(src, meta, chunk_bytes=config.read_chunk_bytes) as reader:
        tensors = _checkpoint_tensors(meta, reader, config)
        report = _write_folder(out_dir, tensors, cfg, tokenizer if tokenizer is not None else src, config)
        return ExportReport(folder=report.folder, files=report.files, tensors=report.tensors,
                            total_bytes=report.total_bytes, largest_read_bytes=reader.largest_read_bytes)


def export_state_dict(state_dict: Mapping[str, torch.Tensor], out_dir: str | os.PathLike, *,
                      hf_config: Mapping[str, Any] | str | os.PathLike, tokenizer: Any = None,
                      config: ExportConfig = ExportConfig()) -> ExportReport:
    """Write an in-memory state dict as a Hugging Face folder, one tensor at a time.

    A tensor that is the same object as an earlier one (tied weights, as
    ``engine.full_state_dict()`` returns them) is written once, like
    ``save_pretrained`` does, unless ``config.write_aliases``.
    """
    seen: set[int] = set()
    tensors: list[_OutTensor] = []
    for name, t in state_dict.items():
        if id(t) in seen and not config.write_aliases:
            continue
        seen.add(id(t))
        dtype = _out_dtype(t.dtype, config.dtype)
        tensors.append(_OutTensor(name=name, shape=tuple(t.shape), dtype=dtype,
                                  write=lambda f, t=t, dtype=dtype: _write_bytes(f, t.detach().to("cpu", dtype))))
    return _write_folder(out_dir, tensors, _read_hf_config(hf_config), tokenizer, config)


# -- reading shards --------------------------------------------------------------------------

class _ShardReader:
    """Open rank files (lazily) and read ranges of their 1-D arrays, in bounded chunks."""

    def __init__(self, folder: Path, meta: ShardedStateMeta, *, chunk_bytes: int):
        self.folder, self.meta, self.chunk_bytes = folder, meta, chunk_bytes
        self._stack = contextlib.ExitStack()
        self._handles: dict[int, Any] = {}
        self._checked: set[tuple[int, str]] = set()
        self.largest_read_bytes = 0

    def __enter__(self) -> "_ShardReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _handle(self, rank: int):
        if rank not in self._handles:
            from safetensors import safe_open

            path = self.folder / self.meta.file_of(rank).name
            self._handles[rank] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[rank]

    def _slice(self, rank: int, key: str, expected_numel: int):
        handle = self._handle(rank)
        name = self.meta.file_of(rank).name
        if (rank, key) not in self._checked:
            if key not in handle.keys():
                raise CheckpointFormatError(f"{self.folder / name}: array {key!r} is missing")
            shape = handle.get_slice(key).get_shape()
            if list(shape) != [expected_numel]:
                raise CheckpointFormatError(f"{self.folder / name}: array {key!r} has shape {list(shape)}, the "
                                            f"metadata says [{expected_numel}]")
            self._checked.add((rank, key))
        return handle.get_slice(key)

    def read(self, rank: int, key: str, expected_numel: int, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of array ``key`` in ``rank``'s file (a fresh tensor)."""
        out = self._slice(rank, key, expected_numel)[start:stop]
        self.largest_read_bytes = max(self.largest_read_bytes, out.numel() * out.element_size())
        return out

    def copy_pieces(self, f: BinaryIO, group: GroupLayout, tensor: TensorLayout, array: str,
                    dtype: torch.dtype) -> None:
        """Stream ``tensor``'s bytes (converted to ``dtype``) into ``f``, chunk by chunk."""
        key = array_key(group.name, array)
        step = max(1, self.chunk_bytes // _element_size(parse_dtype(group.arrays[array])))
        for p in sorted(tensor.pieces, key=lambda p: p.tensor_start):
            for lo in range(p.shard_start, p.shard_start + p.numel, step):
                hi = min(lo + step, p.shard_start + p.numel)
                _write_bytes(f, self.read(p.rank, key, group.holders[p.rank], lo, hi).to(dtype))


ShardReader = _ShardReader  # public name: engine checkpoint loading reads pieces through it too


def _checkpoint_tensors(meta: ShardedStateMeta, reader: _ShardReader, config: ExportConfig) -> list[_OutTensor]:
    by_name: dict[str, tuple[GroupLayout, TensorLayout, str]] = {}
    out: list[_OutTensor] = []
    for g in meta.groups:
        array = next((a for a in config.arrays if a in g.arrays), None)
        if array is None:
            raise CheckpointFormatError(f"group {g.name!r} has arrays {sorted(g.arrays)}, none of "
                                        f"{list(config.arrays)} asked for export")
        stored = parse_dtype(g.arrays[array])
        dtype = _out_dtype(stored, config.dtype)
        for t in g.tensors:
            by_name[t.name] = (g, t, array)
            out.append(_OutTensor(name=t.name, shape=t.shape, dtype=dtype,
                                  write=lambda f, g=g, t=t, a=array, d=dtype: reader.copy_pieces(f, g, t, a, d)))
    if config.write_aliases:
        for alias, target in meta.aliases.items():
            src = next(o for o in out if o.name == target)
            out.append(_OutTensor(name=alias, shape=src.shape, dtype=src.dtype, write=src.write))
    return out


# -- writing the folder ----------------------------------------------------------------------

def _write_folder(out_dir: str | os.PathLike, tensors: Sequence[_OutTensor], hf_config: dict[str, Any],
                  tokenizer: Any, config: ExportConfig) -> ExportReport:
    if not tensors:
        raise ValueError("nothing to export: no tensors")
    plan = _plan_files(tensors, config.max_shard_bytes)
    names = ([_SINGLE_FILE] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    with atomic_output_dir(out_dir, overwrite=config.overwrite) as tmp:
        for name, members in zip(names, plan):
            _write_safetensors(tmp / name, members)
        if len(plan) > 1:
            weight_map = {t.name: name for name, members in zip(names, plan) for t in members}
            index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
            (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        _write_hf_config(tmp / "config.json", hf_config, _main_dtype(tensors))
        _write_tokenizer(tmp, tokenizer)
    return ExportReport(folder=Path(out_dir), files=tuple(names), tensors=len(tensors),
                        total_bytes=sum(t.nbytes for t in tensors), largest_read_bytes=0)


def _plan_files(tensors: Sequence[_OutTensor], max_bytes: int) -> list[list[_OutTensor]]:
    """Consecutive tensors into files of at most ``max_bytes`` (a bigger tensor alone)."""
    plan: list[list[_OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if plan[-1] and size + t.nbytes > max_bytes:
            plan.append([])
            size = 0
        plan[-1].append(t)
        size += t.nbytes
    return plan


def _write_safetensors(path: Path, tensors: Sequence[_OutTensor]) -> None:
    """A safetensors file: 8-byte header length, JSON header, then each tensor's bytes in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        start = f.tell()
        for t in tensors:
            lo, hi = header[t.name]["data_offsets"]
            t.write(f)
            if f.tell() - start != hi:
                raise RuntimeError(f"{path}: tensor {t.name!r} wrote {f.tell() - start - lo} bytes, "
                                   f"expected {hi - lo}")
        f.flush()
        os.fsync(f.fileno())


def _write_bytes(f: BinaryIO, t: torch.Tensor) -> None:
    if sys.byteorder != "little":  # safetensors is little-endian
        raise RuntimeError("exporting safetensors needs a little-endian host")
    flat = t.reshape(-1)
    if flat.numel():
        f.write(flat.contiguous().view(torch.uint8).numpy().data)


def _read_hf_config(source: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"the model's config.json is needed for export: {path} does not exist "
                                "(pass hf_config)")
    return json.loads(path.read_text())


def _write_hf_config(path: Path, cfg: dict[str, Any], dtype: torch.dtype) -> None:
    cfg = dict(cfg)
    name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = name  # what from_pretrained(dtype="auto") loads in
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(folder: Path, tokenizer: Any) -> None:
    if tokenizer is None:
        return
    if not isinstance(tokenizer, (str, os.PathLike)):
        tokenizer.save_pretrained(folder)  # a TextTokenizer or a Hugging Face tokenizer
        return
    src = Path(tokenizer)
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (src / name).is_file():
            shutil.copyfile(src / name, folder / name)


# -- dtypes -------------------------------------------------------------------------------------

def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _out_dtype(stored: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    if wanted is None or not stored.is_floating_point:
        return stored
    return wanted


def _main_dtype(tensors: Sequence[_OutTensor]) -> torch.dtype:
    floating = [t.dtype for t in tensors if t.dtype.is_floating_point]
    return max(set(floating), key=floating.count) if floating else tensors[0].dtype
