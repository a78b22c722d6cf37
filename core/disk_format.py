"""The on-disk format of one stored tensor, in one place.

[Note: tensor file layout]
::

    offset 0            prefix  <8s I I I I>: magic, version, header_size, json_len, json_crc32
    offset 24           JSON    {"key", "dtype", "shape", "nbytes", "checksum"}
    ... zero padding to header_size (a multiple of the alignment)
    offset header_size  payload: the tensor's bytes in memory order (``nbytes``)
    ... zero padding to a multiple of the alignment

The payload starts aligned so an O_DIRECT read can land in an aligned host
buffer (see [Note: aligned host buffers]); ``checksum`` is the CRC-32 of the
``nbytes`` payload bytes, or null when written without checksums. The header is
written last, after the payload, because it carries the payload's checksum.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import torch

from .store_config import StoreCorruptionError, TensorMeta, align_up

MAGIC = b"ZSPDTNSR"
VERSION = 1
SUFFIX = ".ztensor"
_PREFIX = struct.Struct("<8sIIII")


@dataclass(frozen=True, slots=True)
class FileHeader:
    """A parsed file header: the key, its metadata and where the payload starts."""

    key: str
    meta: TensorMeta
    header_size: int

    def file_size(self, alignment: int) -> int:
        return self.header_size + align_up(self.meta.nbytes, alignment)


def encode_header(key: str, meta: TensorMeta, alignment: int, *, size: int | None = None) -> bytes:
    """The header bytes, zero-padded to ``size`` (default: the next multiple of ``alignment``)."""
    body = json.dumps({
        "key": key,
        "dtype": str(meta.dtype).removeprefix("torch."),
        "shape": list(meta.shape),
        "nbytes": meta.nbytes,
        "checksum": meta.checksum,
    }).encode()
    needed = align_up(_PREFIX.size + len(body), alignment)
    size = needed if size is None else size
    if size < needed:
        raise ValueError(f"header of {needed} bytes does not fit in {size}")
    prefix = _PREFIX.pack(MAGIC, VERSION, size, len(body), zlib.crc32(body))
    return (prefix + body).ljust(size, b"\0")


def header_size_for(key: str, meta: TensorMeta, alignment: int) -> int:
    """The header size that fits ``key`` and ``meta`` with any checksum value."""
    widest = TensorMeta(meta.shape, meta.dtype, meta.nbytes, 0xFFFFFFFF)
    return len(encode_header(key, widest, alignment))


def prefix_header_size(block: bytes | memoryview, path: str) -> int:
    """The total header size read from the fixed prefix of the first block."""
    magic, version, size, _, _ = _unpack_prefix(block, path)
    return size


def decode_header(data: bytes | memoryview, path: str) -> FileHeader:
    """Parse a header (at least ``header_size`` bytes), raising StoreCorruptionError naming ``path``."""
    magic, version, size, json_len, json_crc = _unpack_prefix(data, path)
    body = bytes(data[_PREFIX.size:_PREFIX.size + json_len])
    if len(body) != json_len or zlib.crc32(body) != json_crc:
        raise StoreCorruptionError(f"{path}: header checksum mismatch (the file is corrupted)")
    fields = json.loads(body)
    dtype = getattr(torch, fields["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise StoreCorruptionError(f"{path}: unknown dtype {fields['dtype']!r} in header")
    meta = TensorMeta(tuple(fields["shape"]), dtype, int(fields["nbytes"]), fields["checksum"])
    return FileHeader(fields["key"], meta, size)


def _unpack_prefix(data: bytes | memoryview, path: str) -> tuple:
    if len(data) < _PREFIX.size:
        raise StoreCorruptionError(f"{path}: file too short for a header (truncated)")
    magic, version, size, json_len, json_crc = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise StoreCorruptionError(f"{path}: not a zspeed tensor file (bad magic {magic!r})")
    if version != VERSION:
        raise StoreCorruptionError(f"{path}: format version {version}, this zspeed reads version {VERSION}")
    if json_len > size - _PREFIX.size:
        raise StoreCorruptionError(f"{path}: header length {json_len} exceeds header size {size}")
    return magic, version, size, json_len, json_crc
