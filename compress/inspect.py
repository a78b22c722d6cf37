"""The ``zcompress inspect`` table: per module, format, bytes before/after and weight error."""
from __future__ import annotations

import os
from pathlib import Path

from safetensors import SafetensorError, safe_open

from .storage import TENSOR_FILE, CompressedFormatError, corrupt_file_error

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def module_rows(directory: str | os.PathLike, meta: dict) -> list[dict]:
    """One dict per compressed module: name, format, bytes before (dense, in the model's
    dtype) and after (stored tensors), and the error statistics recorded at compression."""
    dense_bytes = _DTYPE_BYTES.get(meta.get("dtype", "float32"), 4)
    sizes = _tensor_sizes(Path(directory) / TENSOR_FILE)
    stats = meta.get("stats") or {}
    rows = []
    for name, spec in sorted(meta["modules"].items()):
        n, k = spec["out_features"], spec["in_features"]
        before = (n * k + (n if spec["bias"] else 0)) * dense_bytes
        after = sum(size for key, size in sizes.items() if key.startswith(f"{name}."))
        fmt = spec["format"] + (f" g{spec['group_size']}" if spec.get("group_size") else "")
        rows.append({"module": name, "format": fmt, "before": before, "after": after, **(stats.get(name) or {})})
    return rows


_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _tensor_sizes(path: Path) -> dict[str, int]:
    """Stored bytes per tensor, read from the safetensors header (no tensor is loaded)."""
    if not path.is_file():
        raise CompressedFormatError(f"{path} not found: the checkpoint is incomplete")
    sizes = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                count = 1
                for d in sl.get_shape():
                    count *= d
                sizes[key] = count * _ST_BYTES[sl.get_dtype()]
    except (SafetensorError, OSError) as e:
        raise corrupt_file_error(path, e) from None
    return sizes


def format_table(rows: list[dict]) -> str:
    head = f"{'module':44s} {'format':18s} {'before':>10s} {'after':>10s} {'ratio':>6s} {'rel_err':>8s} {'max_abs':>9s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['module'][:44]:44s} {r['format']:18s} {_mb(r['before'])} {_mb(r['after'])} "
                     f"{r['before'] / max(r['after'], 1):6.2f} {_num(r.get('rel_err'), 8, 4)} "
                     f"{_num(r.get('max_abs_err'), 9, 5)}")
    before, after = sum(r["before"] for r in rows), sum(r["after"] for r in rows)
    lines += ["-" * len(head), f"{'total (' + str(len(rows)) + ' modules)':44s} {'':18s} {_mb(before)} "
              f"{_mb(after)} {before / max(after, 1):6.2f}"]
    return "\n".join(lines)


def _mb(b: int) -> str:
    return f"{b / 2**20:8.3f}MB"


def _num(v, width: int, digits: int) -> str:
    return f"{v:{width}.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>{width}s}"
