"""DeepSpeed JSON config → :class:`ZSpeedConfig`: the one place the raw dictionary is read.

Entry point: :func:`load_config`. Everything downstream receives the typed,
validated dataclasses of :mod:`zspeed.train.config_schema`.

What the parser guarantees:

* every key is either understood, or an error: an unknown key names its dotted
  path and suggests the closest valid key; a DeepSpeed key that zspeed does not
  implement says so (see [Note: unsupported keys are errors, never ignored] in
  :mod:`zspeed.train.config_deepspeed_keys`);
* numbers may be written as JSON numbers or strings (``5e8``, ``"5e8"``); an
  integer field accepts an integral float;
* ``"auto"`` values are filled from an :class:`AutoContext` (what the caller
  knows: the model's hidden size, CLI flags), following DeepSpeed's Hugging Face
  integration rules, or fail naming the key and what would fill it;
* the batch-size triangle is completed from any two of its sides (DeepSpeed's
  rules) and checked; a mismatch shows the arithmetic;
* all problems found are reported together, one per line.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from .config_deepspeed_keys import ALIASES, UNSUPPORTED, UNSUPPORTED_OPTIMIZERS, UNSUPPORTED_SCHEDULERS
from .config_schema import (
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
    ActivationCheckpointingConfig,
    ConfigError,
    OptimizerConfig,
    OptimizerType,
    SchedulerConfig,
    SchedulerType,
    ZeroConfig,
    ZSpeedConfig,
)

__all__ = ["AutoContext", "ConfigError", "load_config", "config_to_dict", "resize_for_world_size",
           "describe_keys"]

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoContext:
    """What the caller knows, used to fill ``"auto"`` values (None = not known).

    The engine fills ``hidden_size`` from the model; ``ztrain`` fills the rest
    from its flags. Rules follow DeepSpeed's Hugging Face integration.
    """

    hidden_size: int | None = None  # reduce_bucket_size=h², stage3_prefetch_bucket_size=0.9·h², persistence=10·h
    lr: float | None = None  # optimizer.params.lr, scheduler.params.warmup_max_lr
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    train_batch_size: int | None = None
    micro_batch_size: int | None = None  # train_micro_batch_size_per_gpu
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    fp16: bool | None = None
    bf16: bool | None = None
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    warmup_min_lr: float | None = None  # None → 0, as in the HF integration
    warmup_num_steps: int | None = None
    total_num_steps: int | None = None


def _hidden(f: Callable[[int], int]) -> Callable[[AutoContext], int | None]:
    return lambda c: None if c.hidden_size is None else f(c.hidden_size)


# dotted key → (value from the context or None, what is needed when it is None)
_AUTO_RULES: dict[str, tuple[Callable[[AutoContext], Any], str]] = {
    "train_batch_size": (lambda c: c.train_batch_size, "the global batch size, or two of the batch sizes"),
    "train_micro_batch_size_per_gpu": (lambda c: c.micro_batch_size, "the per-rank micro-batch size "
                                       "(AutoContext.micro_batch_size, e.g. ztrain's batch-size flag)"),
    "gradient_accumulation_steps": (lambda c: c.gradient_accumulation_steps,
                                    "the accumulation steps (AutoContext.gradient_accumulation_steps)"),
    "gradient_clipping": (lambda c: c.gradient_clipping, "a clip norm (AutoContext.gradient_clipping)"),
    "fp16.enabled": (lambda c: c.fp16, "whether to train in fp16 (AutoContext.fp16)"),
    "bf16.enabled": (lambda c: c.bf16, "whether to train in bf16 (AutoContext.bf16, e.g. ztrain --bf16)"),
    "optimizer.params.lr": (lambda c: c.lr, "a learning rate (AutoContext.lr, e.g. ztrain --lr)"),
    "optimizer.params.betas": (lambda c: c.betas, "Adam betas (AutoContext.betas)"),
    "optimizer.params.eps": (lambda c: c.eps, "Adam eps (AutoContext.eps)"),
    "optimizer.params.weight_decay": (lambda c: c.weight_decay, "a weight decay (AutoContext.weight_decay)"),
    "scheduler.params.warmup_min_lr": (lambda c: 0.0 if c.warmup_min_lr is None else c.warmup_min_lr, ""),
    "scheduler.params.warmup_max_lr": (lambda c: c.lr, "a learning rate (AutoContext.lr, e.g. ztrain --lr)"),
    "scheduler.params.warmup_num_steps": (lambda c: c.warmup_num_steps,
                                          "the warmup steps (AutoContext.warmup_num_steps)"),
    "scheduler.params.total_num_steps": (lambda c: c.total_num_steps, "the number of optimizer steps of the "
                                         "run (AutoContext.total_num_steps, e.g. from ztrain's --max-steps)"),
    "zero_optimization.stage": (lambda c: c.zero_stage, "a ZeRO stage (AutoContext.zero_stage, ztrain --zero-stage)"),
    "zero_optimization.offload_optimizer.device": (lambda c: c.offload_optimizer_device,
                                                   "an offload device (AutoContext.offload_optimizer_device)"),
    "zero_optimization.offload_param.device": (lambda c: c.offload_param_device,
                                               "an offload device (AutoContext.offload_param_device)"),
    "zero_optimization.reduce_bucket_size": (_hidden(lambda h: h * h),
                                             "the model's hidden size h (AutoContext.hidden_size; rule: h²)"),
    "zero_optimization.stage3_prefetch_bucket_size": (_hidden(lambda h: int(0.9 * h * h)),
                                                      "the model's hidden size h (AutoContext.hidden_size; "
                                                      "rule: 0.9·h²)"),
    "zero_optimization.stage3_param_persistence_threshold": (_hidden(lambda h: 10 * h),
                                                             "the model's hidden size h "
                                                             "(AutoContext.hidden_size; rule: 10·h)"),
}


# -- public entry points -------------------------------------------------------------------

def load_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    world_size: int,
    auto_context: AutoContext = AutoContext(),
) -> ZSpeedConfig:
    """Parse a DeepSpeed config (a dict, or the path of a JSON file) into a :class:`ZSpeedConfig`.

    Args:
        config: the DeepSpeed-style config. A path is read as JSON (duplicate keys
            are an error, as in DeepSpeed).
        world_size: data-parallel ranks; completes and checks the batch-size
            triangle ``train_batch_size = micro_batch × accumulation × world_size``.
            Of the three sizes, any two determine the third; with only
            ``train_batch_size`` accumulation is 1, with only the micro-batch,
            accumulation is 1 (DeepSpeed's rules).
        auto_context: values for keys written ``"auto"`` (see :class:`AutoContext`).

    Raises:
        ConfigError: listing every problem found: unknown keys (with the closest
            valid key), DeepSpeed keys zspeed does not support, ``"auto"`` values
            nothing fills, values of the wrong type or out of range, and
            inconsistent combinations.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    raw = _read(config)
    parser = _Parser(auto_context)
    result = parser.top_level(raw, world_size)
    parser.raise_if_any()
    assert result is not None
    return result


def resize_for_world_size(config: ZSpeedConfig, world_size: int, *,
                          train_batch_size: int | None = None) -> ZSpeedConfig:
    """The same config at another world size, keeping the global batch (or setting it to
    ``train_batch_size``: the one a checkpoint was trained with) and the micro-batch, so gradient
    accumulation changes, as an elastic restart needs."""
    tbs, mbs = train_batch_size or config.train_batch_size, config.train_micro_batch_size_per_gpu
    per_step = mbs * world_size
    if tbs % per_step:
        raise ConfigError(
            f"cannot keep train_batch_size={tbs} at world_size={world_size}: it is not divisible by "
            f"train_micro_batch_size_per_gpu ({mbs}) × world_size ({world_size}) = {per_step} "
            f"({tbs} / {per_step} = {tbs / per_step:g})")
    return dataclasses.replace(config, world_size=world_size, train_batch_size=tbs,
                               gradient_accumulation_steps=tbs // per_step)


def config_to_dict(config: ZSpeedConfig) -> dict[str, Any]:
    """The DeepSpeed-style JSON dict of a config; ``load_config`` of it gives the config back."""
    return _to_json(config)


def describe_keys() -> dict[str, str]:
    """Every key zspeed reads, dotted, → what it means (from the schema's field docs)."""
    docs: dict[str, str] = {}
    _describe(ZSpeedConfig, "", docs)
    for kind, table in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        by_key: dict[str, list[str]] = {}
        for t, cls in table.items():
            for f in dataclasses.fields(cls):
                by_key.setdefault(f.name, [])
                if t.value not in by_key[f.name]:
                    by_key[f.name].append(t.value)
                docs.setdefault(f"{kind}.params.{f.name}", f.metadata["doc"])
        for name, owners in by_key.items():
            docs[f"{kind}.params.{name}"] = f"[{', '.join(owners)}] {docs[f'{kind}.params.{name}']}"
    return dict(sorted(docs.items()))


# -- reading ---------------------------------------------------------------------------------

def _read(config: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}")
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a JSON object, got {type(data).__name__}")
    return data


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError(f"duplicate key {k!r} in the config JSON")
        out[k] = v
    return out


# -- parsing ---------------------------------------------------------------------------------

class _Bad(Exception):
    """A value error inside the parser, collected rather than raised at once."""


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _json_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("json", True)}


class _Parser:
    """Walks the raw dict once, building the dataclasses and collecting every problem."""

    def __init__(self, ctx: AutoContext) -> None:
        self.ctx = ctx
        self.errors: list[str] = []

    def raise_if_any(self) -> None:
        if len(self.errors) == 1:
            raise ConfigError(self.errors[0])
        if self.errors:
            lines = "\n".join(f"  - {e}" for e in self.errors)
            raise ConfigError(f"{len(self.errors)} problems in the training config:\n{lines}")

    # -- sections --------------------------------------------------------------------------
    def top_level(self, raw: Mapping[str, Any], world_size: int) -> ZSpeedConfig | None:
        raw = self._dealias(raw, "")
        handlers: dict[str, Callable[[Any, str], Any]] = {
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "zero_optimization": self.zero,
            "activation_checkpointing": lambda v, p: None if v is None else self.section(
                ActivationCheckpointingConfig, v, p),
        }
        values = self.fields(ZSpeedConfig, raw, "", handlers=handlers, skip=_BATCH_KEYS)
        batch = self.batch_sizes({k: raw[k] for k in _BATCH_KEYS if k in raw}, world_size)
        if batch is None or values is None:
            return None
        return self.build(ZSpeedConfig, {**values, **batch, "world_size": world_size}, "")

    def batch_sizes(self, raw: dict[str, Any], world: int) -> dict[str, int] | None:
        given: dict[str, int] = {}
        auto_unfilled: list[str] = []
        for name, value in raw.items():
            if value == "auto" and _AUTO_RULES[name][0](self.ctx) is None:
                auto_unfilled.append(name)  # left for the triangle to derive
                continue
            try:
                v = self.value(value, int, name)
            except _Bad as e:
                self.errors.append(str(e))
                return None
            if v is not None:
                given[name] = v
        try:
            return _complete_batch_triangle(given, world, auto_unfilled)
        except _Bad as e:
            self.errors.append(str(e))
            return None

    def optimizer(self, raw: Any, path: str) -> OptimizerConfig | None:
        if raw is None:
            return None
        kind = self.typed_section(raw, path, OptimizerType, UNSUPPORTED_OPTIMIZERS, "optimizer")
        if kind is None:
            return None
        params = self.section(OPTIMIZER_PARAMS[kind], raw.get("params") or {}, _join(path, "params"),
                              owner=kind.value, siblings=OPTIMIZER_PARAMS)
        return None if params is None else self.build(OptimizerConfig, {"type": kind, "params": params}, path)

    def scheduler(self, raw: Any, path: str) -> SchedulerConfig | None:
        if raw is None:
            return None
        kind = self.typed_section(raw, path, SchedulerType, UNSUPPORTED_SCHEDULERS, "lr scheduler")
        if kind is None:
            return None
        params = self.section(SCHEDULER_PARAMS[kind], raw.get("params") or {}, _join(path, "params"),
                              owner=kind.value, siblings=SCHEDULER_PARAMS)
        return None if params is None else self.build(SchedulerConfig, {"type": kind, "params": params}, path)

    def typed_section(self, raw: Any, path: str, kinds: type[enum.Enum], unsupported: dict[str, str],
                      what: str) -> Any:
        """Check a {"type": ..., "params": {...}} section; return its type (an enum) or None."""
        if not isinstance(raw, Mapping):
            self.errors.append(f"{path} must be an object with \"type\" and \"params\", got {raw!r}")
            return None
        for k, v in raw.items():
            if k not in ("type", "params"):
                self.other_key(_join(path, k), k, v, ["type", "params"])
        if "type" not in raw:
            self.errors.append(f"{path}.type is missing; choose one of {_choices(kinds)}")
            return None
        name = raw["type"]
        folded = str(name).replace("_", "").lower()
        for kind in kinds:
            if kind.value.lower() == folded:
                return kind
        if folded in unsupported:
            self.errors.append(f"{path}.type {name!r}: {unsupported[folded]} is a DeepSpeed {what} that zspeed "
                               f"does not support; choose one of {_choices(kinds)}")
        else:
            self.errors.append(f"{path}.type {name!r} is not a known {what}; choose one of {_choices(kinds)}"
                               f"{_suggest(str(name), [k.value for k in kinds])}")
        return None

    def zero(self, raw: Any, path: str) -> ZeroConfig | None:
        if not isinstance(raw, Mapping):
            self.errors.append(f"{path} must be an object, got {raw!r}")
            return None
        raw = self._dealias(raw, path)
        values = self.fields(ZeroConfig, raw, path)
        if values is None:
            return None
        if "overlap_comm" not in values:  # DeepSpeed: overlapped by default only in stage 3
            values["overlap_comm"] = values.get("stage", 0) == 3
        return self.build(ZeroConfig, values, path)

    def section(self, cls: type, raw: Any, path: str, **kw: Any) -> Any:
        """Build dataclass ``cls`` from the dict at ``path``; None after recording problems."""
        if not isinstance(raw, Mapping):
            self.errors.append(f"{path} must be an object, got {raw!r}")
            return None
        raw = self._dealias(raw, path)
        values = self.fields(cls, raw, path, **kw)
        return None if values is None else self.build(cls, values, path, owner=kw.get("owner"))

    def fields(self, cls: type, raw: Mapping[str, Any], path: str, *, handlers: dict | None = None,
               skip: tuple[str, ...] = (), owner: str | None = None, siblings: dict | None = None
               ) -> dict[str, Any] | None:
        """Coerce the keys of ``raw`` that are fields of ``cls``; record every other key."""
        known = _json_fields(cls)
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        bad_value = False  # unknown keys do not stop the build: its range checks still report
        for name, value in raw.items():
            dotted = _join(path, name)
            if name in skip:
                continue
            if name not in known:
                self.other_key(dotted, name, value, list(known), owner=owner, siblings=siblings)
                continue
            before = len(self.errors)
            try:
                if handlers and name in handlers:
                    values[name] = handlers[name](value, dotted)
                else:
                    values[name] = self.value(value, hints[name], dotted)
            except _Bad as e:
                self.errors.append(str(e))
            bad_value |= len(self.errors) > before
        return None if bad_value else values

    def build(self, cls: type, values: dict[str, Any], path: str, *, owner: str | None = None) -> Any:
        for f in dataclasses.fields(cls):
            if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                where = f" for {owner}" if owner else ""
                self.errors.append(f"{_join(path, f.name)} is required{where} ({f.metadata['doc']})")
                return None
        try:
            return cls(**values)
        except ConfigError as e:
            self.errors.append(str(e))
            return None

    # -- keys ------------------------------------------------------------------------------
    def _dealias(self, raw: Mapping[str, Any], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in raw.items():
            target = ALIASES.get(_join(path, k))
            name = target.rsplit(".", 1)[-1] if target else k
            if name in out:
                self.errors.append(f"{_join(path, k)} and {_join(path, name)} are the same setting; give only one")
                continue
            out[name] = v
        return out

    def other_key(self, dotted: str, name: str, value: Any, valid: list[str], *, owner: str | None = None,
                  siblings: dict | None = None) -> None:
        """A key that is not a field here: accepted-unsupported, unsupported, or unknown."""
        entry = UNSUPPORTED.get(dotted)
        if entry is not None:
            if not entry.accepts(value):
                self.errors.append(f"{dotted} is a DeepSpeed option that zspeed does not support "
                                   f"({entry.what}); {entry.remedy()}")
            return
        if owner and siblings:
            others = [t.value for t, c in siblings.items() if name in _json_fields(c)]
            if others:
                self.errors.append(f"{dotted} is not a parameter of {owner} (it is one of {', '.join(others)}); "
                                   f"{owner} takes: {', '.join(valid)}")
                return
        section = dotted.rsplit(".", 1)[0] if "." in dotted else ""
        unsupported_here = [k.rsplit(".", 1)[-1] for k in UNSUPPORTED
                            if (k.rsplit(".", 1)[0] if "." in k else "") == section]
        hint = _suggest(name, valid + unsupported_here) or _elsewhere(name)
        where = f" in {section}" if section else ""
        self.errors.append(f"unknown config key {dotted!r}{hint or f'; valid keys{where}: ' + ', '.join(valid)}")

    # -- values ----------------------------------------------------------------------------
    def value(self, value: Any, hint: Any, dotted: str) -> Any:
        if isinstance(value, str) and value == "auto":
            value = self.auto(dotted)
        return _coerce(value, hint, dotted, self)

    def auto(self, dotted: str) -> Any:
        rule = _AUTO_RULES.get(dotted)
        if rule is None:
            raise _Bad(f"{dotted} is \"auto\", but zspeed has no rule to fill it; give a value")
        filled = rule[0](self.ctx)
        if filled is None:
            raise _Bad(f"{dotted} is \"auto\" and nothing fills it: it needs {rule[1]}; pass it in the "
                       f"auto_context (or the matching CLI flag), or write a value in the config")
        return filled


def _complete_batch_triangle(given: dict[str, int], world: int, auto_unfilled: list[str]) -> dict[str, int]:
    """DeepSpeed's rules: any two of (global, micro, accumulation) give the third."""
    tbs, mbs, gas = (given.get(k) for k in _BATCH_KEYS)
    for k, v in given.items():
        if v < 1:
            raise _Bad(f"{k} must be >= 1, got {v}")

    def divide(total: int, parts: list[tuple[str, int]], result: str) -> int:
        denom = math.prod(v for _, v in parts)
        shown = " × ".join(f"{n} ({v})" for n, v in parts)
        if total % denom:
            raise _Bad(f"train_batch_size ({total}) is not divisible by {shown} = {denom}: {total} / {denom} = "
                       f"{total / denom:g}, so {result} would not be a whole number")
        return total // denom

    w = ("world_size", world)
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world:
            raise _Bad(f"train_batch_size ({tbs}) != train_micro_batch_size_per_gpu ({mbs}) × "
                       f"gradient_accumulation_steps ({gas}) × world_size ({world}) = {mbs * gas * world}")
    elif tbs is not None and mbs is not None:
        gas = divide(tbs, [("train_micro_batch_size_per_gpu", mbs), w], "gradient_accumulation_steps")
    elif tbs is not None and gas is not None:
        mbs = divide(tbs, [("gradient_accumulation_steps", gas), w], "train_micro_batch_size_per_gpu")
    elif mbs is not None and gas is not None:
        tbs = mbs * gas * world
    elif tbs is not None:
        gas = 1
        mbs = divide(tbs, [w], "train_micro_batch_size_per_gpu")
    elif mbs is not None:
        gas, tbs = 1, mbs * world
    else:
        autos = f" ({', '.join(auto_unfilled)} {'is' if len(auto_unfilled) == 1 else 'are'} \"auto\" with no " \
                f"value in the auto_context)" if auto_unfilled else ""
        raise _Bad("the batch size is not determined: give train_batch_size or train_micro_batch_size_per_gpu "
                   f"(and optionally gradient_accumulation_steps){autos}")
    return dict(zip(_BATCH_KEYS, (tbs, mbs, gas)))


# -- value coercion --------------------------------------------------------------------------

def _coerce(value: Any, hint: Any, dotted: str, parser: _Parser) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            if len(args) < len(typing.get_args(hint)):
                return None
            raise _Bad(f"{dotted} must not be null")
        if len(args) == 1:
            return _coerce(value, args[0], dotted, parser)
        raise _Bad(f"{dotted}: cannot read a value of type {hint}")  # schema bug, not user error
    if dataclasses.is_dataclass(hint):
        return parser.section(hint, value, dotted)  # None after recording its problems
    if origin is tuple:
        return _to_tuple(value, typing.get_args(hint), dotted)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _to_enum(value, hint, dotted)
    if hint is bool:
        return _to_bool(value, dotted)
    if hint is int:
        return _to_int(value, dotted)
    if hint is float:
        return _to_float(value, dotted)
    if hint is str:
        if not isinstance(value, str):
            raise _Bad(f"{dotted} must be a string, got {value!r}")
        return value
    raise _Bad(f"{dotted}: cannot read a value of type {hint}")


def _to_bool(value: Any, dotted: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _Bad(f"{dotted} must be true or false, got {value!r}")


def _to_float(value: Any, dotted: str) -> float:
    if isinstance(value, bool):
        raise _Bad(f"{dotted} must be a number, got {value!r}")
    try:
        out = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise _Bad(f"{dotted} must be a number (like 1e-4 or \"1e-4\"), got {value!r}") from None
    if not math.isfinite(out):
        raise _Bad(f"{dotted} must be finite, got {value!r}")
    return out


def _to_int(value: Any, dotted: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value.strip())
    try:
        as_float = _to_float(value, dotted)
    except _Bad:
        raise _Bad(f"{dotted} must be a whole number (like 2 or \"2\"), got {value!r}") from None
    if not as_float.is_integer():
        raise _Bad(f"{dotted} must be a whole number, got {value!r}")
    return int(as_float)


def _to_tuple(value: Any, item_types: tuple[Any, ...], dotted: str) -> tuple:
    if not isinstance(value, (list, tuple)) or len(value) != len(item_types):
        raise _Bad(f"{dotted} must be a list of {len(item_types)} numbers, got {value!r}")
    return tuple(_to_float(v, f"{dotted}[{i}]") for i, v in enumerate(value))


def _to_enum(value: Any, kind: type[enum.Enum], dotted: str) -> enum.Enum:
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        for member in kind:
            if member.value.lower() == value.strip().lower():
                return member
    raise _Bad(f"{dotted} must be one of {_choices(kind)}, got {value!r}"
               f"{_suggest(str(value), [m.value for m in kind])}")


# -- messages --------------------------------------------------------------------------------

def _choices(kind: type[enum.Enum]) -> str:
    return ", ".join(repr(m.value) for m in kind)


def _suggest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if not match:
        lowered = {c.lower(): c for c in candidates}
        match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
        match = [lowered[m] for m in match]
    return f"; did you mean {match[0]!r}?" if match else ""


def _elsewhere(name: str) -> str:
    """A key written in the wrong section: say where it belongs."""
    homes = [k for k in describe_keys() if k.rsplit(".", 1)[-1] == name and "." in k]
    return f"; it belongs under {homes[0].rsplit('.', 1)[0]!r}" if homes else ""


# -- writing and describing --------------------------------------------------------------------

def _to_json(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.metadata.get("json", True)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, tuple):
        return [_to_json(v) for v in obj]
    return obj


def _describe(cls: type, path: str, docs: dict[str, str]) -> None:
    hints = get_type_hints(cls)
    for name, f in _json_fields(cls).items():
        dotted = _join(path, name)
        if name == "params":
            continue  # described per optimizer / scheduler type
        docs[dotted] = f.metadata["doc"]
        for t in (hints[name], *typing.get_args(hints[name])):
            if dataclasses.is_dataclass(t):
                _describe(t, dotted, docs)
