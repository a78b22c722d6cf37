"""The on-disk format of a sharded training state: per-rank safetensors files plus one JSON file.

Written by the engine's ``save_checkpoint`` (each rank its own file), read by
``load_checkpoint`` at any world size and by :mod:`zspeed.train.export`
(consolidation into a Hugging Face folder) without ever holding the model
whole.

[Note: sharded state layout]
A checkpoint (one tag) is a folder::

    <root>/<tag>/
        zspeed_state.json          the metadata below
        rank00000.safetensors      rank 0's arrays, one 1-D tensor per (group, array)
        rank00001.safetensors      ...
        config.json, tokenizer*    optional: the model's HF config and tokenizer, copied by export
    <root>/latest                  the newest complete tag (text), replaced last

``zspeed_state.json``::

    {
      "format": "zspeed.sharded_state", "version": 1,
      "world_size": 2,
      "files": [{"rank": 0, "name": "rank00000.safetensors", "nbytes": 123, "crc32": "1a2b3c4d"}, ...],
      "groups": [{
          "name": "u3.bf16",                     # unique; the engine's unit/group id
          "dtype": "bfloat16",                   # dtype of the layout (the compute parameters)
          "arrays": {"param": "bfloat16",        # array name -> dtype; every array has the layout
                     "master": "float32", "exp_avg": "float32", "exp_avg_sq": "float32"},
          "holders": [{"rank": 0, "numel": 4608}, {"rank": 1, "numel": 4608}],
          "tensors": [{"name": "model.layers.0.mlp.up_proj.weight", "shape": [96, 96],
                       "pieces": [[0, 0, 0, 4608],       # [rank, shard_start, tensor_start, numel]
                                  [1, 0, 4608, 4608]]}],  # one per rank holding part of it
          "buckets": [{"full_offset": 0, "numel": 9216, "chunk": 4608,
                       "shard_offset": 0, "data_numel": 9216}]      # informational (FlatGroup's)
      }, ...],
      "aliases": {"lm_head.weight": "model.embed_tokens.weight"},   # tied names -> stored name
      "state": {...}                                                # free JSON for the engine
    }

Array ``A`` of group ``G`` is the 1-D tensor ``"G/A"`` in every holder's file,
with ``holder.numel`` elements of the array's dtype. Tensor element ``k`` (of
the flattened tensor, row-major) lives at element ``shard_start + (k -
tensor_start)`` of that array in the file of the piece's rank, for the piece
with ``tensor_start <= k < tensor_start + numel``. The pieces of a tensor tile
``[0, numel)`` exactly; :func:`read_meta` checks that, and that every piece
lies inside its holder's array. This is exactly what
:meth:`~zspeed.core.partition.FlatGroup.pieces` describes, so :func:`group_layout`
writes it from a ``FlatGroup``; a tensor kept whole on one rank is a group
with one holder.

``state`` carries what the engine needs back (global step, stage, loss scaler,
lr scheduler, data cursor, RNG states, client state) as plain JSON. Small
tensors that do not fit JSON go into rank files under keys outside the
``"G/A"`` scheme (``"__state__/..."``).

[Note: atomic checkpoints]
Ranks write into ``<root>/<tag>.tmp`` (:func:`staging_dir`); each file is
written to a temporary name, fsynced and renamed (:func:`write_rank_file`).
When every rank is done (a barrier), rank 0 writes the metadata with the
files' checksums, fsyncs the folder and renames it to ``<root>/<tag>``
(:func:`commit_dir`), then replaces ``latest`` (:func:`update_latest`). A
process killed at any point leaves the previous tag and ``latest`` intact. A
tag saved again over itself is swapped in with one atomic exchange of the two
folders (Linux ``renameat2``); where that is not available the old folder is
moved aside first, and a reader that finds the tag missing but its moved-aside
folder present (a kill between the two renames) moves it back
(:func:`read_latest`). A reader verifies each file's CRC-32 (:func:`verify_files`)
and names the file that does not match.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

__all__ = ["FORMAT", "VERSION", "META_FILE", "LATEST_FILE", "CheckpointFormatError", "CheckpointCorruptError",
           "Piece", "TensorLayout", "BucketLayout", "GroupLayout", "FileRecord", "ShardedStateMeta",
           "rank_file_name", "array_key", "group_layout", "dtype_name", "parse_dtype", "file_crc32",
           "write_rank_file", "write_meta", "read_meta", "verify_files", "staging_dir", "commit_dir",
           "update_latest", "read_latest", "fsync_dir", "atomic_output_dir", "check_matches_model"]

FORMAT = "zspeed.sharded_state"
VERSION = 1
META_FILE = "zspeed_state.json"
LATEST_FILE = "latest"
_CRC_BLOCK = 8 << 20

_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2")}


class CheckpointFormatError(ValueError):
    """Metadata that does not describe a readable state (names the file and the problem)."""


class CheckpointCorruptError(CheckpointFormatError):
    """A file whose bytes do not match the checksum recorded for it."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointFormatError(f"dtype {dtype} is not storable in a zspeed checkpoint")
    return name


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointFormatError(f"unknown dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def array_key(group: str, array: str) -> str:
    """The safetensors key of array ``array`` of group ``group`` in a rank file."""
    return f"{group}/{array}"


# -- the metadata -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[tensor_start, tensor_start + numel)`` of a tensor, at ``shard_start`` of ``rank``'s array."""

    rank: int
    shard_start: int
    tensor_start: int
    numel: int


@dataclass(frozen=True, slots=True)
class TensorLayout:
    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """One bucket of a bucket-major :class:`~zspeed.core.partition.FlatGroup` (informational)."""

    full_offset: int
    numel: int
    chunk: int
    shard_offset: int
    data_numel: int


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Tensors laid out flat over the arrays of some ranks; see [Note: sharded state layout]."""

    name: str
    dtype: str
    arrays: dict[str, str]
    holders: dict[int, int]  # rank -> elements of each array in that rank's file
    tensors: tuple[TensorLayout, ...]
    buckets: tuple[BucketLayout, ...] = ()


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One rank file and its checksum."""

    rank: int
    name: str
    nbytes: int
    crc32: str  # 8 lower-case hex digits


@dataclass(frozen=True, slots=True)
class ShardedStateMeta:
    world_size: int
    groups: tuple[GroupLayout, ...]
    files: tuple[FileRecord, ...]
    aliases: dict[str, str] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def file_of(self, rank: int) -> FileRecord:
        for f in self.files:
            if f.rank == rank:
                return f
        raise CheckpointFormatError(f"no file is recorded for rank {rank}")

    def tensor_names(self) -> list[str]:
        return [t.name for g in self.groups for t in g.tensors]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "world_size": self.world_size,
            "files": [{"rank": f.rank, "name": f.name, "nbytes": f.nbytes, "crc32": f.crc32} for f in self.files],
            "groups": [_group_to_json(g) for g in self.groups],
            "aliases": dict(self.aliases), "state": self.state,
        }


def _group_to_json(g: GroupLayout) -> dict[str, Any]:
    return {
        "name": g.name, "dtype": g.dtype, "arrays": dict(g.arrays),
        "holders": [{"rank": r, "numel": n} for r, n in sorted(g.holders.items())],
        "tensors": [{"name": t.name, "shape": list(t.shape),
                     "pieces": [[p.rank, p.shard_start, p.tensor_start, p.numel] for p in t.pieces]}
                    for t in g.tensors],
        "buckets": [{"full_offset": b.full_offset, "numel": b.numel, "chunk": b.chunk,
                     "shard_offset": b.shard_offset, "data_numel": b.data_numel} for b in g.buckets],
    }


def group_layout(name: str, group, *, arrays: Mapping[str, torch.dtype],
                 ranks: Sequence[int] | None = None) -> GroupLayout:
    """The layout of a :class:`~zspeed.core.partition.FlatGroup` whose shard arrays each rank stores.

    Args:
        name: the group's unique name in the checkpoint.
        group: the ``FlatGroup`` (its ``pieces(rank)`` give every tensor's pieces).
        arrays: the arrays stored with this layout (``{"param": bf16, "master": fp32, ...}``).
        ranks: the global rank holding the group's shard ``i``; default ``0..group.world_size-1``.
            (A replicated array stored by rank 0 only: a world-1 group with ``ranks=[0]``.)
    """
    ranks = list(range(group.world_size)) if ranks is None else list(ranks)
    if len(ranks) != group.world_size:
        raise ValueError(f"group {name!r} has {group.world_size} shards but {len(ranks)} ranks were given")
    by_slot: dict[int, list[Piece]] = {}
    for i, rank in enumerate(ranks):
        for p in group.pieces(i):
            by_slot.setdefault(p.slot.index, []).append(
                Piece(rank=rank, shard_start=p.shard_start, tensor_start=p.tensor_start, numel=p.numel))
    tensors = tuple(TensorLayout(name=s.name, shape=tuple(s.shape),
                                 pieces=tuple(sorted(by_slot.get(s.index, []), key=lambda p: p.tensor_start)))
                    for s in group.slots)
    buckets = tuple(BucketLayout(full_offset=b.full_offset, numel=b.numel, chunk=b.chunk,
                                 shard_offset=b.shard_offset, data_numel=b.data_numel) for b in group.buckets)
    return GroupLayout(name=name, dtype=dtype_name(group.dtype),
                       arrays={a: dtype_name(d) for a, d in arrays.items()},
                       holders={r: group.shard_numel for r in ranks}, tensors=tensors, buckets=buckets)


# -- reading and checking metadata -----------------------------------------------------------

def read_meta(folder: str | os.PathLike) -> ShardedStateMeta:
    """Parse and check ``folder/zspeed_state.json``.

    Raises:
        CheckpointFormatError: naming the file and the first problem: not JSON, another
            format or version, a tensor whose pieces do not tile it, a piece outside its
            holder's array, a rank without a recorded file.
    """
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise CheckpointFormatError(f"{path} does not exist: {folder} is not a zspeed checkpoint")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None
    try:
        meta = _meta_from_json(raw)
        _check_meta(meta)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointFormatError(f"{path}: malformed metadata ({type(e).__name__}: {e})") from None
    return meta


def _meta_from_json(raw: dict[str, Any]) -> ShardedStateMeta:
    if raw.get("format") != FORMAT:
        raise CheckpointFormatError(f"format is {raw.get('format')!r}, expected {FORMAT!r}")
    if raw.get("version") != VERSION:
        raise CheckpointFormatError(f"version {raw.get('version')!r} is not supported (this zspeed reads {VERSION})")
    files = tuple(FileRecord(rank=int(f["rank"]), name=str(f["name"]), nbytes=int(f["nbytes"]),
                             crc32=str(f["crc32"])) for f in raw["files"])
    groups = tuple(GroupLayout(
        name=str(g["name"]), dtype=str(g["dtype"]), arrays={str(k): str(v) for k, v in g["arrays"].items()},
        holders={int(h["rank"]): int(h["numel"]) for h in g["holders"]},
        tensors=tuple(TensorLayout(name=str(t["name"]), shape=tuple(int(d) for d in t["shape"]),
                                   pieces=tuple(Piece(*(int(x) for x in p)) for p in t["pieces"]))
                      for t in g["tensors"]),
        buckets=tuple(BucketLayout(**{k: int(v) for k, v in b.items()}) for b in g.get("buckets", [])),
    ) for g in raw["groups"])
    return ShardedStateMeta(world_size=int(raw["world_size"]), groups=groups, files=files,
                            aliases={str(k): str(v) for k, v in raw.get("aliases", {}).items()},
                            state=dict(raw.get("state", {})))


def _check_meta(meta: ShardedStateMeta) -> None:
    if meta.world_size < 1:
        raise CheckpointFormatError(f"world_size must be >= 1, got {meta.world_size}")
    recorded = {f.rank for f in meta.files}
    names: set[str] = set()
    group_names: set[str] = set()
    for g in meta.groups:
        if g.name in group_names:
            raise CheckpointFormatError(f"group {g.name!r} appears twice")
        group_names.add(g.name)
        parse_dtype(g.dtype)
        for dt in g.arrays.values():
            parse_dtype(dt)
        for rank in g.holders:
            if rank not in recorded:
                raise CheckpointFormatError(f"group {g.name!r} is held by rank {rank}, which has no file")
        for t in g.tensors:
            if t.name in names:
                raise CheckpointFormatError(f"tensor {t.name!r} appears twice")
            names.add(t.name)
            _check_pieces(g, t)
    for alias, target in meta.aliases.items():
        if target not in names:
            raise CheckpointFormatError(f"alias {alias!r} points at {target!r}, which is not stored")


def _check_pieces(g: GroupLayout, t: TensorLayout) -> None:
    at = 0
    for p in sorted(t.pieces, key=lambda p: p.tensor_start):
        if p.numel == 0:
            continue
        if p.tensor_start != at:
            raise CheckpointFormatError(f"tensor {t.name!r}: pieces leave elements [{at}, {p.tensor_start}) "
                                        "uncovered or overlap")
        held = g.holders.get(p.rank)
        if held is None or p.shard_start < 0 or p.shard_start + p.numel > held:
            raise CheckpointFormatError(f"tensor {t.name!r}: piece {list(_astuple(p))} lies outside rank "
                                        f"{p.rank}'s array of group {g.name!r} ({held} elements)")
        at += p.numel
    if at != t.numel:
        raise CheckpointFormatError(f"tensor {t.name!r}: pieces cover {at} of its {t.numel} elements")


def _astuple(p: Piece) -> tuple[int, int, int, int]:
    return (p.rank, p.shard_start, p.tensor_start, p.numel)


def check_matches_model(meta: ShardedStateMeta, shapes: Mapping[str, Sequence[int]], *, where: str = "the checkpoint",
                        model: str = "the model") -> None:
    """Refuse a checkpoint of another model: ``shapes`` maps each model tensor name to its shape.

    Tied names may be stored once (``meta.aliases``). The first tensor, in the
    model's order, that the checkpoint lacks or holds with another shape is
    named; then the first stored tensor the model does not have.

    Raises:
        CheckpointFormatError: naming that tensor and both shapes.
    """
    stored = {t.name: t.shape for g in meta.groups for t in g.tensors}
    for alias, target in meta.aliases.items():
        stored.setdefault(alias, stored[target])
    for name, shape in shapes.items():
        if name not in stored:
            raise CheckpointFormatError(f"{where} is not of {model}: tensor {name!r} (shape {list(shape)}) is "
                                        "not in it")
        if tuple(stored[name]) != tuple(shape):
            raise CheckpointFormatError(f"{where} is not of {model}: the first mismatching tensor is {name!r}, shape "
                                        f"{list(stored[name])} in the checkpoint but {list(shape)} in the model")
    extra = [n for n in stored if n not in shapes]
    if extra:
        raise CheckpointFormatError(f"{where} is not of {model}: it holds tensor {extra[0]!r}, which the model "
                                    "does not have")


# -- files, checksums and atomic writes ----------------------------------------------------

def file_crc32(path: str | os.PathLike) -> str:
    """CRC-32 of a file's bytes, streamed in blocks, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def verify_files(folder: str | os.PathLike, meta: ShardedStateMeta, ranks: Sequence[int] | None = None) -> None:
    """Check that each rank file exists with its recorded size and checksum.

    Raises:
        CheckpointCorruptError: naming the first file that is missing, truncated or changed.
    """
    for rec in meta.files:
        if ranks is not None and rec.rank not in ranks:
            continue
        path = Path(folder) / rec.name
        if not path.is_file():
            raise CheckpointCorruptError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != rec.nbytes:
            raise CheckpointCorruptError(f"checkpoint file {path} has {size} bytes, {rec.nbytes} were written "
                                         "(truncated or replaced)")
        crc = file_crc32(path)
        if crc != rec.crc32:
            raise CheckpointCorruptError(f"checkpoint file {path} is corrupted: CRC-32 {crc} does not match the "
                                         f"recorded {rec.crc32}")


def fsync_dir(folder: str | os.PathLike) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rank_file(folder: str | os.PathLike, rank: int, tensors: Mapping[str, torch.Tensor],
                    *, metadata: Mapping[str, str] | None = None) -> FileRecord:
    """Write rank ``rank``'s arrays (``{array_key(g, a): 1-D tensor}``) atomically; return its record."""
    from safetensors.torch import save_file

    folder = Path(folder)
    final = folder / rank_file_name(rank)
    tmp = folder / f".{final.name}.tmp-{os.getpid()}"
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(tmp), metadata={"format": "pt", "zspeed_rank": str(rank), **(metadata or {})})
    _fsync_file(tmp)
    os.replace(tmp, final)
    return FileRecord(rank=rank, name=final.name, nbytes=final.stat().st_size, crc32=file_crc32(final))


def write_meta(folder: str | os.PathLike, meta: ShardedStateMeta) -> Path:
    """Check ``meta`` and write it as ``folder/zspeed_state.json`` (temporary name, fsync, rename)."""
    _check_meta(meta)
    path = Path(folder) / META_FILE
    _write_text_atomic(path, json.dumps(meta.to_json(), indent=1) + "\n")
    return path


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def staging_dir(root: str | os.PathLike, tag: str) -> Path:
    """The folder ranks write tag ``tag`` into before :func:`commit_dir` (``<root>/<tag>.tmp``)."""
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST_FILE:
        raise ValueError(f"invalid checkpoint tag {tag!r}")
    return Path(root) / f"{tag}.tmp"


def commit_dir(staging: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Fsync every file of ``staging`` and the folder, then rename it to ``final``.

    An existing ``final`` is replaced: the two folders swapped atomically where the system can
    (:func:`_exchange`), else the old one moved aside and the new one renamed in; then the old one deleted.
    """
    staging, final = Path(staging), Path(final)
    for p in staging.iterdir():
        if p.is_file():
            _fsync_file(p)
    fsync_dir(staging)
    old = None
    if final.exists():
        if _exchange(staging, final):  # ``staging`` now holds the old folder
            fsync_dir(final.parent)
            shutil.rmtree(staging, ignore_errors=True)
            return final
        old = _aside(final)
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _aside(final: Path) -> Path:
    """Where :func:`commit_dir` moves an existing ``final`` while the new folder is renamed in."""
    return final.with_name(f".{final.name}.old-{os.getpid()}")


_RENAME_EXCHANGE = 2  # (linux/fs.h)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where this system
    or file system cannot, so the caller falls back to two renames."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28)
        return False
    at_cwd = -100
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _restore_aside(root: Path, tag: str) -> None:
    """A replacement killed between its two renames (:func:`commit_dir` without :func:`_exchange`) left ``tag``
    missing and the old folder moved aside: move it back."""
    if (root / tag).exists() or not root.is_dir():
        return
    aside = sorted(p for p in root.iterdir() if p.name.startswith(f".{tag}.old-"))
    if aside:
        try:
            os.replace(aside[-1], root / tag)
        except FileNotFoundError:  # another rank moved it back first
            return
        fsync_dir(root)


def update_latest(root: str | os.PathLike, tag: str) -> None:
    """Point ``<root>/latest`` at ``tag`` (atomically; call after :func:`commit_dir`)."""
    _write_text_atomic(Path(root) / LATEST_FILE, tag + "\n")


def read_latest(root: str | os.PathLike) -> str | None:
    """The tag in ``<root>/latest``, or None when there is none."""
    path = Path(root) / LATEST_FILE
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if tag:
        _restore_aside(Path(root), tag)
    return tag or None


@contextlib.contextmanager
def atomic_output_dir(final: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """A temporary sibling folder to fill; renamed to ``final`` when the block succeeds, deleted if not.

    Raises:
        FileExistsError: ``final`` exists and ``overwrite`` is False.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists (pass overwrite=True to replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(tmp, final)
