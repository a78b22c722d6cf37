"""``ztrain``'s flags and a DeepSpeed JSON config, merged into one config dict.

[Note: flags and the config file]
Without ``--config`` the flags (and their defaults) build the whole config:
AdamW, a linear-warmup cosine schedule to ``total_num_steps``, gradient
clipping 1.0. With ``--config`` the file is the base, and each flag the user
actually gave must agree with it: a key the file leaves out is added, a key
written ``"auto"`` is filled from the flag (through
:class:`~zspeed.train.config.AutoContext`, as DeepSpeed's Hugging Face
integration does), and a key with a different value is an error naming both.
Keys the run decides (``total_num_steps``, ``warmup_num_steps``) are ``"auto"``
in the flag-built config and resolved once the data is packed.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import AutoContext
from .config_schema import ConfigError

__all__ = ["FlagValues", "DEFAULTS", "build_config_dict", "auto_context"]

DEFAULTS = {"lr": 3e-4, "micro_batch": 4, "zero_stage": 2, "offload": "none", "bf16": False}
# ``--offload cpu`` on CUDA at stages 1-2: this share of the optimizer update runs on the GPU (state streamed from
# host memory) and the next forward overlaps the update; 0.6-0.85 measured alike on H100/H200 hosts.
FAST_DEVICE_SHARE = 0.75


@dataclass(frozen=True, kw_only=True, slots=True)
class FlagValues:
    """The config-related flags; None = not given on the command line."""

    zero_stage: int | None = None
    offload: str | None = None
    nvme_path: str | None = None
    bf16: bool | None = None
    lr: float | None = None
    micro_batch: int | None = None
    global_batch: int | None = None
    cuda: bool = False  # not a flag: whether training runs on CUDA (chooses the fast offload settings)

    def get(self, name: str) -> Any:
        value = getattr(self, name)
        return DEFAULTS.get(name) if value is None else value


def auto_context(flags: FlagValues, *, hidden_size: int | None = None, total_steps: int | None = None,
                 warmup_steps: int | None = None) -> AutoContext:
    """What fills ``"auto"`` values: the flags (or their defaults) and what the run knows."""
    offload = flags.get("offload")
    return AutoContext(hidden_size=hidden_size, lr=flags.get("lr"), train_batch_size=flags.global_batch,
                       micro_batch_size=flags.get("micro_batch"), bf16=flags.get("bf16"), fp16=False,
                       zero_stage=flags.get("zero_stage"), offload_optimizer_device=offload,
                       offload_param_device=offload if flags.get("zero_stage") == 3 else "none",
                       gradient_clipping=1.0, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8,
                       total_num_steps=total_steps, warmup_num_steps=warmup_steps)


def build_config_dict(flags: FlagValues, config_path: str | Path | None) -> dict[str, Any]:
    """The DeepSpeed config dict of the run (see [Note: flags and the config file]).

    Raises:
        ConfigError: an unreadable file, or a flag that contradicts the file.
    """
    if config_path is None:
        return _from_flags(flags)
    base = _read_json(Path(config_path))
    conflicts: list[str] = []
    for dotted, value in _given(flags):
        _merge(base, dotted, value, conflicts, config_path)
    if "optimizer" not in base:
        base["optimizer"] = {"type": "AdamW", "params": {"lr": flags.get("lr"), "weight_decay": 0.01}}
    if conflicts:
        raise ConfigError("the flags contradict the config file:\n" + "\n".join(f"  - {c}" for c in conflicts))
    return base


def _from_flags(flags: FlagValues) -> dict[str, Any]:
    stage, offload = flags.get("zero_stage"), flags.get("offload")
    zero: dict[str, Any] = {"stage": stage}
    if offload != "none":
        zero["offload_optimizer"] = _offload_section(offload, flags.nvme_path)
        if offload == "cpu" and flags.cuda:  # the fastest exact offload (benchmarks/RESULTS.md, issue 4)
            zero["offload_optimizer"]["pin_memory"] = True
            if stage in (1, 2):  # at stage 3 the flags offload parameters too, which both exclude
                zero["offload_optimizer"].update(device_share=FAST_DEVICE_SHARE, overlap_forward=True)
        if stage == 3:
            zero["offload_param"] = _offload_section(offload, flags.nvme_path)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": flags.get("micro_batch"),
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": flags.get("lr"), "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_type": "linear",
            "cos_min_ratio": 0.1}},
        "bf16": {"enabled": bool(flags.get("bf16"))},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,  # ztrain shows progress itself
    }
    if flags.global_batch is not None:
        cfg["train_batch_size"] = flags.global_batch
    return cfg


def _offload_section(device: str, nvme_path: str | None) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def _given(flags: FlagValues) -> list[tuple[str, Any]]:
    """(dotted key, value) for each config flag the user gave."""
    out: list[tuple[str, Any]] = []
    if flags.zero_stage is not None:
        out.append(("zero_optimization.stage", flags.zero_stage))
    if flags.micro_batch is not None:
        out.append(("train_micro_batch_size_per_gpu", flags.micro_batch))
    if flags.global_batch is not None:
        out.append(("train_batch_size", flags.global_batch))
    if flags.lr is not None:
        out.append(("optimizer.params.lr", flags.lr))
    if flags.bf16 is not None:
        out.append(("bf16.enabled", flags.bf16))
    if flags.offload is not None:
        out.append(("zero_optimization.offload_optimizer.device", flags.offload))
        if flags.nvme_path is not None:
            out.append(("zero_optimization.offload_optimizer.nvme_path", flags.nvme_path))
    return out


def _merge(base: dict[str, Any], dotted: str, value: Any, conflicts: list[str], path: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = base
    for p in parents:
        child = node.get(p)
        if child is None:
            if p == "optimizer":
                return  # no optimizer section: the default one is added with the flag's lr
            node[p] = child = {}
        if not isinstance(child, dict):
            return  # a malformed section: load_config reports it
        node = child
    if leaf not in node:
        node[leaf] = copy.deepcopy(value)
    elif node[leaf] != "auto" and not _same(node[leaf], value):
        conflicts.append(f"{dotted} is {node[leaf]!r} in {path} but the flag gives {value!r}; change one "
                         "(or write \"auto\" in the file)")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a JSON object, got {type(data).__name__}")
    return data
