"""The DISK tier: one file per key, O_DIRECT where the file system allows it.

[Note: atomic tensor writes]
A put writes the whole file (payload, then header) to a temporary file in the
store directory, fsyncs it, ``os.replace``s it over the key's file and fsyncs
the directory. A reader therefore sees either the previous complete file or
the new one, never a mix; a crash or a full disk mid-put leaves the previous
version untouched and, at worst, a temporary file named
``.<name>.<pid>.<nonce>.tmp``. Temporary files whose writer process is gone are
removed when a store opens the directory (one writer process per directory).

File layout: see [Note: tensor file layout] in :mod:`zspeed.core.disk_format`.
"""
from __future__ import annotations

import errno
import hashlib
import os
import threading
import uuid
import warnings
import zlib
from pathlib import Path
from urllib.parse import quote

import torch

from .disk_format import SUFFIX, FileHeader, decode_header, encode_header, header_size_for, prefix_header_size
from .pinned_pool import PinnedBufferPool, aligned_empty
from .store_config import (StoreConfig, StoreCorruptionError, StoreError, TensorMeta, align_up, as_bytes,
                           missing_key_message)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_MAX_HEADER = 64 << 20


def file_name(key: str) -> str:
    """An injective, file-system-safe name for ``key`` (long keys end in a hash)."""
    name = quote(key, safe="")
    if len(name) > 200:  # "%%" never occurs in quote()'s output, so this cannot collide
        name = name[:150] + "%%" + hashlib.sha256(key.encode()).hexdigest()[:32]
    return name + SUFFIX


class DiskTier:
    """Tensor files under one directory; every method is safe to call from any thread."""

    def __init__(self, *, config: StoreConfig, pool: PinnedBufferPool):
        self.config = config
        self.pool = pool
        self.root = Path(config.path).expanduser().absolute()
        self._make_root()
        self.direct = self._probe_direct()
        self.index: dict[str, TensorMeta] = {}
        self._lock = threading.Lock()
        self._remove_stale_temps()
        self._scan()

    # -- lifecycle: open -------------------------------------------------------
    def _make_root(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"store path {self.root} exists and is not a directory; set StoreConfig.path "
                             "to a directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the store directory {self.root}: {e.strerror or e}; set "
                             "StoreConfig.path to a writable directory (e.g. on a local NVMe)") from e

    def _probe_direct(self) -> bool:
        """Write one aligned block with O_DIRECT; fall back to buffered I/O where refused."""
        want = self.config.direct_io
        if want is not False and _O_DIRECT:
            try:
                self._probe_write(_O_DIRECT)
                return True
            except OSError as e:
                if e.errno != errno.EINVAL or want is True:
                    raise self._probe_error(e, direct=True) from e
        elif want is True:
            raise StoreError("StoreConfig.direct_io=True but this platform has no O_DIRECT; use 'auto'")
        try:
            self._probe_write(0)
        except OSError as e:
            raise self._probe_error(e, direct=False) from e
        return False

    def _probe_write(self, flags: int) -> None:
        probe = self.root / f".probe.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        block = aligned_empty(self.config.alignment, alignment=self.config.alignment)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644)
            try:
                _pwrite_all(fd, _view(block), 0)
            finally:
                os.close(fd)
        finally:
            _unlink_quietly(probe)

    def _probe_error(self, e: OSError, *, direct: bool) -> StoreError:
        if direct and e.errno == errno.EINVAL:
            return StoreError(f"StoreConfig.direct_io=True but {self.root} refuses O_DIRECT (e.g. tmpfs); "
                              "use direct_io='auto' or a directory on a block device")
        return StoreError(f"the store directory {self.root} is not writable ({e.strerror or e}); set "
                          "StoreConfig.path to a directory this process can write")

    def _remove_stale_temps(self) -> None:
        for path in self.root.glob(".*.tmp"):
            pid = path.name.split(".")[-3]
            if pid.isdigit() and not _pid_alive(int(pid)):
                _unlink_quietly(path)

    def _scan(self) -> None:
        for path in self.root.glob("*" + SUFFIX):
            try:
                with open(path, "rb") as f:
                    size = prefix_header_size(f.read(self.config.alignment), str(path))
                    f.seek(0)
                    header = decode_header(f.read(min(size, _MAX_HEADER)), str(path))
            except (OSError, ValueError, KeyError, TypeError, StoreCorruptionError) as e:
                warnings.warn(f"zspeed store: skipping unreadable file {path}: {e}", stacklevel=2)
                continue
            self.index[header.key] = header.meta

    # -- lifecycle: write ------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor) -> TensorMeta:
        """Store ``tensor`` under ``key``, atomically (see [Note: atomic tensor writes])."""
        src = as_bytes(tensor.detach().contiguous())
        final = self.root / file_name(key)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        meta = TensorMeta.of(tensor)
        try:
            meta = self._write_file(tmp, key, meta, src)
            os.replace(tmp, final)
            self._fsync_dir()
        except OSError as e:
            _unlink_quietly(tmp)
            raise _write_error(key, final, e) from e
        except BaseException:
            _unlink_quietly(tmp)
            raise
        with self._lock:
            self.index[key] = meta
        return meta

    def _write_file(self, tmp: Path, key: str, meta: TensorMeta, src: torch.Tensor) -> TensorMeta:
        header_size = header_size_for(key, meta, self.config.alignment)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags(), 0o644)
        try:
            crc = self._write_payload(fd, src, header_size)
            meta = TensorMeta(meta.shape, meta.dtype, meta.nbytes, crc)
            with self.pool.acquire(header_size) as buf:
                header = encode_header(key, meta, self.config.alignment, size=header_size)
                _view(buf.tensor)[:] = header
                _pwrite_all(fd, _view(buf.tensor), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        return meta

    def _write_payload(self, fd: int, src: torch.Tensor, offset: int) -> int | None:
        """Write the payload padded to the alignment; returns its CRC-32 (or None)."""
        if self._is_direct_target(src):
            return self._write_in_place(fd, src, offset)
        return self._write_chunked(fd, src, offset)

    def _write_in_place(self, fd: int, src: torch.Tensor, offset: int) -> int | None:
        n, a = src.numel(), self.config.alignment
        body = n - n % a if self.direct else n
        view = _view(src)
        _pwrite_all(fd, view[:body], offset)
        rest = align_up(n, a) - body  # the unaligned tail plus zero padding
        if rest:
            with self.pool.acquire(rest) as buf:
                buf.tensor.zero_()
                buf.tensor[:n - body].copy_(src[body:])
                _pwrite_all(fd, _view(buf.tensor), offset + body)
        return zlib.crc32(view) if self.config.verify_checksums else None

    def _write_chunked(self, fd: int, src: torch.Tensor, offset: int) -> int | None:
        n, chunk = src.numel(), self.config.chunk_bytes
        crc = 0
        with self.pool.acquire(min(chunk, align_up(max(n, 1), self.config.alignment))) as buf:
            for start in range(0, n, chunk):
                length = min(chunk, n - start)
                padded = align_up(length, self.config.alignment)
                staged = buf.capacity[:padded]
                staged[:length].copy_(src[start:start + length])
                staged[length:].zero_()
                if self.config.verify_checksums:
                    crc = zlib.crc32(_view(staged[:length]), crc)
                _pwrite_all(fd, _view(staged), offset + start)
        return crc if self.config.verify_checksums else None

    # -- lifecycle: read -------------------------------------------------------
    def read(self, key: str, out: torch.Tensor | None) -> torch.Tensor:
        """The tensor stored under ``key``, filled into ``out`` when given."""
        path = self.root / file_name(key)
        fd = self._open_read(path, key)
        try:
            header = self._read_header(fd, path, key)
            if header.header_size % self.config.alignment and self.direct:
                os.close(fd)
                fd = os.open(path, os.O_RDONLY)  # written with a smaller alignment: read buffered
            target = _target_for(header.meta, out, key, self.config.alignment)
            self._read_payload(fd, as_bytes(target), header, path)
            return target
        finally:
            os.close(fd)

    def _open_read(self, path: Path, key: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | self._flags())
        except FileNotFoundError:
            raise KeyError(missing_key_message(key, list(self.index))) from None

    def _read_header(self, fd: int, path: Path, key: str) -> FileHeader:
        a = self.config.alignment
        with self.pool.acquire(a) as buf:
            got = _pread_upto(fd, _view(buf.tensor), 0)
            size = prefix_header_size(_view(buf.tensor)[:got], str(path))
            if size <= a:
                header = decode_header(_view(buf.tensor)[:got], str(path))
        if size > a:
            header = self._read_long_header(fd, path, size)
        if header.key != key:
            raise StoreCorruptionError(f"{path}: holds key {header.key!r}, expected {key!r}")
        actual = os.fstat(fd).st_size
        if actual < header.header_size + header.meta.nbytes:
            raise StoreCorruptionError(f"{path}: truncated file: {actual} bytes, the header promises "
                                       f"{header.header_size + header.meta.nbytes}")
        return header

    def _read_long_header(self, fd: int, path: Path, size: int) -> FileHeader:
        if size > _MAX_HEADER or size % 512:
            raise StoreCorruptionError(f"{path}: implausible header size {size} (the file is corrupted)")
        with self.pool.acquire(align_up(size, self.config.alignment)) as buf:
            got = _pread_upto(fd, _view(buf.tensor), 0)
            return decode_header(_view(buf.tensor)[:got], str(path))

    def _read_payload(self, fd: int, dst: torch.Tensor, header: FileHeader, path: Path) -> None:
        if self._is_direct_target(dst):
            crc = self._read_in_place(fd, dst, header.header_size)
        else:
            crc = self._read_chunked(fd, dst, header.header_size)
        expected = header.meta.checksum
        if crc is not None and expected is not None and crc != expected:
            raise StoreCorruptionError(f"{path}: payload checksum mismatch for key {header.key!r} (stored "
                                       f"{expected:#010x}, read {crc:#010x}); the file is corrupted, "
                                       "rewrite the key")

    def _read_in_place(self, fd: int, dst: torch.Tensor, offset: int) -> int | None:
        n, a = dst.numel(), self.config.alignment
        body = n - n % a if self.direct else n
        view = _view(dst)
        _pread_exact(fd, view[:body], offset)
        if n > body:
            with self.pool.acquire(align_up(n - body, a)) as buf:
                _pread_upto(fd, _view(buf.tensor), offset + body, need=n - body)
                dst[body:].copy_(buf.tensor[:n - body])
        return zlib.crc32(view) if self.config.verify_checksums else None

    def _read_chunked(self, fd: int, dst: torch.Tensor, offset: int) -> int | None:
        n, chunk, a = dst.numel(), self.config.chunk_bytes, self.config.alignment
        crc = 0
        with self.pool.acquire(min(chunk, align_up(max(n, 1), a))) as buf:
            for start in range(0, n, chunk):
                length = min(chunk, n - start)
                staged = buf.capacity[:align_up(length, a)]
                _pread_upto(fd, _view(staged), offset + start, need=length)
                if self.config.verify_checksums:
                    crc = zlib.crc32(_view(staged[:length]), crc)
                dst[start:start + length].copy_(staged[:length])
        return crc if self.config.verify_checksums else None

    # -- lifecycle: delete -----------------------------------------------------
    def delete(self, key: str) -> None:
        path = self.root / file_name(key)
        try:
            path.unlink()
        except FileNotFoundError:
            raise KeyError(missing_key_message(key, list(self.index))) from None
        self._fsync_dir()
        with self._lock:
            self.index.pop(key, None)

    # -- helpers ---------------------------------------------------------------
    def _flags(self) -> int:
        return _O_DIRECT if self.direct else 0

    def _is_direct_target(self, t: torch.Tensor) -> bool:
        """Whether file bytes can move straight to/from ``t`` (see [Note: aligned host buffers])."""
        return t.device.type == "cpu" and (not self.direct or t.data_ptr() % self.config.alignment == 0)

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _target_for(meta: TensorMeta, out: torch.Tensor | None, key: str, alignment: int) -> torch.Tensor:
    if out is None:
        raw = aligned_empty(meta.nbytes, alignment=alignment)
        return raw.view(meta.dtype).view(meta.shape)
    if not meta.matches(out):
        raise ValueError(f"out for key {key!r} is {tuple(out.shape)} {out.dtype}, the stored tensor is "
                         f"{meta.shape} {meta.dtype}")
    if not out.is_contiguous():
        raise ValueError(f"out for key {key!r} must be contiguous to be filled in place")
    return out


def _view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor."""
    return memoryview(t.numpy())


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pread_exact(fd: int, view: memoryview, offset: int) -> None:
    if _pread_upto(fd, view, offset) < len(view):
        raise OSError(errno.EIO, "short read: the file shrank while it was read")


def _pread_upto(fd: int, view: memoryview, offset: int, *, need: int | None = None) -> int:
    """Read into ``view`` until it is full, at least ``need`` bytes arrived, or end of file."""
    need = len(view) if need is None else need
    got = 0
    while got < need:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _write_error(key: str, path: Path, e: OSError) -> StoreError:
    if e.errno in _NO_SPACE:
        return StoreError(f"no space to store key {key!r} at {path} ({e.strerror}); the key's previous "
                          "version and all other keys are intact; free space or move StoreConfig.path")
    return StoreError(f"writing key {key!r} to {path} failed: {e.strerror or e}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
