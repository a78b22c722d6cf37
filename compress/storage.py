"""Saving and loading compressed models: safetensors + a versioned JSON file.

A directory written by :func:`save_compressed` holds
- ``model.safetensors``: every tensor of the model's state (compressed buffers,
  remaining float weights, and non-persistent buffers such as rotary tables),
  each stored once (tied weights are recorded as aliases);
- ``zspeed_compress.json``: format tag and version, per compressed module its
  format (bits, group size, symmetry, sparsity pattern, NF4 block size, shapes), the method
  config, tied aliases, and the Hugging Face config and class when present.

:func:`load_compressed` validates the metadata before touching tensors, builds
the model skeleton on the ``meta`` device (no dense weights are allocated for
compressed layers), swaps in the compressed modules, and assigns tensors read
with safetensors (never pickle).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

import zspeed

from .modules import NF4Linear, QuantLinear, SparseLinear

FORMAT_TAG = "zspeed-compressed"
FORMAT_VERSION = 1
META_FILE = "zspeed_compress.json"
TENSOR_FILE = "model.safetensors"
_SPEC_KEYS = ("format", "in_features", "out_features", "bias", "bits", "group_size", "symmetric", "scale_dtype")


class CompressedFormatError(ValueError):
    """A compressed checkpoint is missing, corrupt, from an unknown version, or does not match the model."""


# -- saving -------------------------------------------------------------------------------------------------------
def compressed_modules(model: nn.Module) -> dict[str, QuantLinear | SparseLinear | NF4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, SparseLinear, NF4Linear))}


def save_compressed(model: nn.Module, directory: str | os.PathLike, *, config: object | None = None,
                    extra: dict | None = None) -> Path:
    """Write ``model`` (after ``quantize_model``/``sparsify_model``) to ``directory``.

    ``config`` (the method config used) and ``extra`` (JSON-able, e.g. the source
    model) are recorded for reference. Returns the directory.
    """
    from .fuse import fused_projections

    fused = fused_projections(model)
    if fused:
        raise ValueError(f"save_compressed: the model has fused projections ({next(iter(fused))}, ...), whose "
                         "tensors a plain model would not find; call zspeed.compress.unfuse_projections(model) "
                         "before saving and fuse_projections again after loading")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors, tied, non_persistent = _unique_tensors(model)
    save_file(tensors, str(out / TENSOR_FILE), metadata={"format": FORMAT_TAG})
    meta = {
        "format": FORMAT_TAG,
        "format_version": FORMAT_VERSION,
        "zspeed_version": zspeed.__version__,
        "modules": {name: mod.spec() for name, mod in compressed_modules(model).items()},
        "method": None if config is None else {"name": config.method, **_jsonable(dataclasses.asdict(config))},
        "tied": tied,
        "non_persistent": non_persistent,
        "dtype": _float_dtype(model),
        "stats": {name: getattr(mod, "compress_stats", None) for name, mod in compressed_modules(model).items()},
        "extra": extra or {},
        **_hf_fields(model),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    return out


def _unique_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    state = dict(model.state_dict(keep_vars=False))
    persistent = set(state)
    for name, buf in model.named_buffers(remove_duplicate=False):
        state.setdefault(name, buf)
    tensors, tied, seen = {}, {}, {}
    for name, t in state.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.device) if t.numel() else None
        if key is not None and key in seen:
            tied[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t.detach().contiguous().cpu()
    return tensors, tied, sorted(set(tensors) - persistent)


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _float_dtype(model: nn.Module) -> str:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


def _hf_fields(model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return {"hf_config": None, "hf_class": None}
    d = cfg.to_dict()
    d.pop("quantization_config", None)
    return {"hf_config": d, "hf_class": type(model).__name__}


@contextmanager
def new_folder(out: str | os.PathLike):
    """Yield a temporary folder beside ``out`` that becomes ``out`` when the block succeeds; on failure it is
    removed, so ``out`` appears whole or not at all. ``out`` must not exist, or be an empty folder."""
    out = Path(out)
    check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it 0700; give the folder the usual permissions
        os.replace(tmp, out)  # replaces an empty folder too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_new_folder(out: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse an output path that exists as a file or a non-empty folder (nothing is overwritten)."""
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) or out.exists() and not out.is_dir():
        kind = "a folder that is not empty" if out.is_dir() else "a file"
        raise FileExistsError(f"{flag} {out} is {kind}; choose a new output folder (nothing is overwritten)")


def corrupt_file_error(path: str | os.PathLike, e: Exception) -> CompressedFormatError:
    return CompressedFormatError(f"{path} is corrupt or truncated: {e}")


# -- loading ------------------------------------------------------------------------------------------------------
def read_metadata(directory: str | os.PathLike) -> dict:
    """Read and validate ``zspeed_compress.json``; raise :class:`CompressedFormatError` naming the problem."""
    path = Path(directory) / META_FILE
    if not Path(directory).exists():
        raise CompressedFormatError(f"{directory} does not exist")
    if not path.is_file():
        raise CompressedFormatError(f"{path} not found: {directory} was not written by zspeed save_compressed")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CompressedFormatError(f"{path} is corrupt (not valid JSON: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_TAG:
        raise CompressedFormatError(f"{path} is not zspeed compressed-model metadata (format tag != {FORMAT_TAG!r})")
    version = meta.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CompressedFormatError(f"{path}: format_version={version!r} is corrupt (expected a positive integer)")
    if version > FORMAT_VERSION:
        raise CompressedFormatError(
            f"{path}: format_version {version} is newer than this zspeed reads ({FORMAT_VERSION}); upgrade zspeed")
    _check_module_specs(path, meta.get("modules"))
    return meta


def _check_module_specs(path: Path, modules: object) -> None:
    if not isinstance(modules, dict):
        raise CompressedFormatError(f"{path}: 'modules' is missing or not a mapping")
    for name, spec in modules.items():
        missing = [k for k in _SPEC_KEYS if not isinstance(spec, dict) or k not in spec]
        if missing:
            raise CompressedFormatError(f"{path}: module {name!r} lacks {missing}")
        fmt = spec["format"]
        if fmt not in ("int8", "int4", "nf4") and not str(fmt).startswith("sparse"):
            raise CompressedFormatError(
                f"{path}: module {name!r} has unknown format {fmt!r} (int8, int4, nf4, sparseN:M)")
        if fmt == "nf4" and "blocksize" not in spec:
            raise CompressedFormatError(f"{path}: nf4 module {name!r} lacks its 'blocksize'")
        if str(fmt).startswith("sparse") and "pattern" not in spec:
            raise CompressedFormatError(f"{path}: sparse module {name!r} lacks its 'pattern'")


def load_compressed(directory: str | os.PathLike, *, model: nn.Module | None = None,
                    device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a model saved by :func:`save_compressed`, with its compressed modules.

    ``model``: a skeleton to fill (its ``nn.Linear`` modules named in the metadata
    are replaced); by default it is built from the saved Hugging Face config on the
    ``meta`` device. Tensors are read with safetensors onto ``device``. Raises
    :class:`CompressedFormatError` on missing/corrupt/unknown-version metadata or
    when modules or tensors do not match it.
    """
    directory = Path(directory)
    meta = read_metadata(directory)
    model = _skeleton(meta) if model is None else model
    for name, spec in meta["modules"].items():
        _swap_in(model, name, spec, getattr(torch, meta.get("dtype", "float32")))
    tensors = _read_tensors(directory / TENSOR_FILE, device)
    _check_tensors(model, tensors, meta)
    model.load_state_dict({k: v for k, v in tensors.items() if k not in meta["non_persistent"]},
                          strict=False, assign=True)
    for name in meta["non_persistent"]:
        _set_tensor(model, name, tensors[name])
    for alias, source in meta["tied"].items():
        _set_tensor(model, alias, model.get_parameter(source) if _is_param(model, source) else tensors[source])
    _check_materialized(model)
    return model.eval()


def _skeleton(meta: dict) -> nn.Module:
    if not meta.get("hf_config") or not meta.get("hf_class"):
        raise CompressedFormatError("the checkpoint has no Hugging Face config: pass model=<skeleton module>")
    import transformers
    from transformers import CONFIG_MAPPING

    cls = getattr(transformers, meta["hf_class"], None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CompressedFormatError(f"unknown Hugging Face model class {meta['hf_class']!r}")
    cfg_dict = dict(meta["hf_config"])
    cfg = CONFIG_MAPPING[cfg_dict["model_type"]].from_dict(cfg_dict)
    with torch.device("meta"):
        return cls(cfg).to(getattr(torch, meta.get("dtype", "float32")))


def _swap_in(model: nn.Module, name: str, spec: dict, dtype: torch.dtype) -> None:
    from .transform import replace_module

    try:
        old = model.get_submodule(name)
    except AttributeError:
        raise CompressedFormatError(f"the metadata names module {name!r}, which the model does not have") from None
    k, n = spec["in_features"], spec["out_features"]
    if isinstance(old, nn.Linear) and (old.in_features, old.out_features) != (k, n):
        raise CompressedFormatError(f"module {name!r} is Linear({old.in_features}→{old.out_features}) in the model "
                                    f"but Linear({k}→{n}) in the checkpoint: a different model")
    replace_module(model, name, module_from_spec(spec, dtype))


def module_from_spec(spec: dict, dtype: torch.dtype) -> nn.Module:
    """An empty (``meta``) compressed Linear of the format a metadata entry ``spec`` records."""
    common = dict(bias=spec["bias"], scale_dtype=spec["scale_dtype"], dtype=dtype, device="meta")
    k, n = spec["in_features"], spec["out_features"]
    if spec["format"] == "nf4":
        return _nf4_from_spec(spec, dtype)
    if spec["format"] in ("int8", "int4"):
        return QuantLinear(k, n, bits=spec["bits"], group_size=spec["group_size"],
                           symmetric=spec["symmetric"], **common)
    pn, pm = (int(v) for v in spec["pattern"].split(":"))
    return SparseLinear(k, n, n=pn, m=pm, quant_bits=spec["bits"], group_size=spec["group_size"] or 128,
                        symmetric=bool(spec["symmetric"]), **common)


def _nf4_from_spec(spec: dict, dtype: torch.dtype) -> NF4Linear:
    try:
        return NF4Linear(spec["in_features"], spec["out_features"], blocksize=spec["blocksize"],
                         compute_dtype=spec.get("compute_dtype"), bias=spec["bias"], dtype=dtype, device="meta")
    except ValueError as e:
        raise CompressedFormatError(f"nf4 module metadata is invalid: {e}") from None


def _read_tensors(path: Path, device) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CompressedFormatError(f"{path} not found: the checkpoint is incomplete")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise corrupt_file_error(path, e) from None


def _check_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    expected = {**dict(model.state_dict()), **dict(model.named_buffers(remove_duplicate=False))}
    missing = sorted(set(expected) - set(tensors) - set(meta["tied"]))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CompressedFormatError(f"tensors do not match the model: missing {missing[:5]}, "
                                    f"unexpected {unexpected[:5]}")
    for name, t in tensors.items():
        want = expected[name]
        if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
            raise CompressedFormatError(f"tensor {name!r} is {t.dtype} {tuple(t.shape)} in the file but the metadata "
                                        f"implies {want.dtype} {tuple(want.shape)}")


def _is_param(model: nn.Module, name: str) -> bool:
    return name in dict(model.named_parameters())


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if leaf in owner._parameters:
        owner._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def _check_materialized(model: nn.Module) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CompressedFormatError(f"no tensor in the checkpoint for {left[:5]}")
