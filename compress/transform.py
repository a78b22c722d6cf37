"""Model transforms: swap selected ``nn.Linear`` modules for compressed drop-ins.

[Note: layer-by-layer calibration] Methods that need data (GPTQ, Wanda) run the
model in pieces so memory stays bounded: the inputs of the first block of the
model's largest ``nn.ModuleList`` (the decoder layers) are captured once; then
for each block, hooks gather statistics of its Linears' inputs over all
calibration batches, the block's Linears are compressed and swapped, and the
block is run again to produce the next block's inputs — with compressed weights,
so later layers calibrate against the errors of earlier ones. Only statistics
are kept (``calib.py``), never per-layer activations beyond one block's input.
Linears outside the blocks (if selected) get one more full-model pass.

[Note: true sequential] Within a block all Linears are calibrated on the block's
inputs at once, except with ``GPTQConfig(true_sequential=True)``: then the block's
Linears are split into stages in the order the block calls them (Linears reading
the same tensor, as q/k/v or gate/up, form one stage), and each stage is
calibrated on a run of the block whose earlier stages are already quantized
(the GPTQ reference's ``--true-sequential``). Each such run stops just before
the stage's last Linear: a Llama block is run about 2.7 times instead of 2.

With ``GPTQConfig(fp_targets=True)`` a full-precision copy of each block runs
beside it on the full-precision model's block inputs (kept as a second list of
block inputs), token for token, so each Linear's statistics pair its inputs with
the full-precision ones (compress/gptq.py, [Note: full-precision targets]); this
doubles the block runs.
"""
from __future__ import annotations

import contextlib
import copy
from fnmatch import fnmatch
from typing import Iterable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from .calib import attach_stats, detach_hooks
from .config import GPTQConfig, MagnitudeConfig, NF4Config, RTNConfig, WandaConfig, with_scale_dtype
from .layer import check_linear, compress_linear, stat_type

Batch = torch.Tensor | dict


def select_linears(model: nn.Module, include: Iterable[str], exclude: Iterable[str]) -> dict[str, nn.Linear]:
    """``nn.Linear`` modules whose names match an ``include`` and no ``exclude`` pattern."""
    inc, exc = tuple(include), tuple(exclude)
    return {name: mod for name, mod in model.named_modules()
            if type(mod) is nn.Linear and any(fnmatch(name, p) for p in inc)
            and not any(fnmatch(name, p) for p in exc)}


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def quantize_model(model: nn.Module, config: RTNConfig | GPTQConfig | NF4Config, *,
                   calib: Iterable[Batch] | None = None, progress: bool = True) -> nn.Module:
    """Replace the selected ``nn.Linear`` modules of ``model`` (in place) by :class:`QuantLinear`
    (or :class:`NF4Linear` for :class:`NF4Config`).

    ``config``: :class:`RTNConfig` or :class:`NF4Config` (data-free) or :class:`GPTQConfig`, which needs
    ``calib``: batches of token ids ``(B, T)`` or dicts of model keywords. Layers
    are processed one block at a time (see [Note: layer-by-layer calibration])
    with a progress bar. Returns ``model``.
    """
    if not isinstance(config, (RTNConfig, GPTQConfig, NF4Config)):
        raise TypeError(f"quantize_model takes RTNConfig, GPTQConfig or NF4Config, got {type(config).__name__}; "
                        "use sparsify_model for MagnitudeConfig/WandaConfig")
    return _compress_model(model, config, calib, progress)


def sparsify_model(model: nn.Module, config: MagnitudeConfig | WandaConfig, *,
                   calib: Iterable[Batch] | None = None, progress: bool = True) -> nn.Module:
    """Prune the selected ``nn.Linear`` modules of ``model`` (in place) to N:M and
    replace them by :class:`SparseLinear` (compressed values + positions).

    ``config``: :class:`MagnitudeConfig` (data-free) or :class:`WandaConfig`, which
    needs ``calib`` (as in :func:`quantize_model`). Returns ``model``.
    """
    if not isinstance(config, (MagnitudeConfig, WandaConfig)):
        raise TypeError(f"sparsify_model takes MagnitudeConfig or WandaConfig, got {type(config).__name__}; "
                        "use quantize_model for RTNConfig/GPTQConfig/NF4Config")
    return _compress_model(model, config, calib, progress)


DECLARED_DTYPE = "_zspeed_declared_dtype"  # set by zcompress's loader: the dtype the checkpoint declares


def declared_dtype(model: nn.Module, targets: dict[str, nn.Linear]) -> torch.dtype | None:
    """The dtype ``model``'s weights are meant to run in: what its checkpoint declares (zcompress loads in fp32,
    and transformers then overwrites ``config.dtype``), else that of the weights themselves."""
    declared = getattr(model, DECLARED_DTYPE, None)
    if declared is not None:
        return declared
    return next((lin.weight.dtype for lin in targets.values()), None)


def _compress_model(model: nn.Module, config, calib, progress: bool) -> nn.Module:
    targets = select_linears(model, config.include, config.exclude)
    if not targets:
        raise ValueError(f"no nn.Linear matches include={config.include} and exclude={config.exclude}")
    for name, lin in targets.items():
        check_linear(name, lin, config)
    config = with_scale_dtype(config, declared_dtype(model, targets))
    make = stat_type(config)
    with torch.no_grad():
        if make is None:
            for name, lin in tqdm(targets.items(), desc=f"{config.method}", disable=not progress):
                replace_module(model, name, compress_linear(lin, config))
            return model
        batches = list(calib) if calib is not None else []
        if not batches:
            raise ValueError(f"{type(config).__name__} needs calibration data: pass calib=[token-id batches ...]")
        _calibrated(model, targets, config, make, batches, progress)
    return model


def _calibrated(model: nn.Module, targets: dict[str, nn.Linear], config, make: type, batches: list,
                progress: bool) -> None:
    prefix, blocks = find_blocks(model, targets)
    done: set[str] = set()
    gptq = config if isinstance(config, GPTQConfig) else None
    if blocks is not None:
        inputs = capture_block_inputs(model, blocks[0], batches)
        fp_inputs = inputs if gptq and gptq.fp_targets else None  # [Note: full-precision targets]
        for i, block in enumerate(tqdm(blocks, desc=f"{config.method} layers", disable=not progress)):
            names = {n: m for n, m in targets.items() if n.startswith(f"{prefix}.{i}.")}
            fp_block = None if fp_inputs is None else copy.deepcopy(block)
            stages = call_stages(block, names, inputs[0]) if gptq and gptq.true_sequential else [list(names)]
            for j, stage in enumerate(stages):  # [Note: true sequential]
                stop = None if j == len(stages) - 1 else stage[-1]
                run = _BlockRun(block, inputs, stop, fp_block, fp_inputs, f"{prefix}.{i}.")
                _compress_group(model, {n: names[n] for n in stage}, config, make, run)
            if fp_block is not None:
                fp_inputs = _next_inputs(fp_block, fp_inputs)
            inputs = _next_inputs(block, inputs)
            done |= names.keys()
    rest = {n: m for n, m in targets.items() if n not in done}
    if rest:
        _compress_group(model, rest, config, make, lambda _stats: [_run_model(model, b) for b in batches])


def _next_inputs(block: nn.Module, inputs: list) -> list:
    return [((_first(_run_block(block, a, kw)),) + tuple(a[1:]), kw) for a, kw in inputs]


def _compress_group(model: nn.Module, linears: dict[str, nn.Linear], config, make: type, run) -> None:
    """Gather statistics for ``linears`` while ``run(stats)`` executes, then compress and swap them."""
    if not linears:
        return
    stats, handles = attach_stats(linears, make)
    try:
        run(stats)
    finally:
        detach_hooks(handles)
    for name, lin in linears.items():
        replace_module(model, name, compress_linear(lin, config, stats.pop(name)))


class _BlockRun:
    """One calibration pass over a block: every batch of ``inputs`` through ``block``, stopping just before the
    Linear named ``stop`` (``None``: the whole block). With ``fp_block`` (the block's full-precision copy) each
    batch of ``fp_inputs`` first runs through it, queueing its Linears' inputs for the stats (``CrossHessianStat``)."""

    def __init__(self, block: nn.Module, inputs: list, stop: str | None, fp_block: nn.Module | None,
                 fp_inputs: list | None, prefix: str) -> None:
        self.block, self.inputs, self.prefix = block, inputs, prefix
        self.fp_block, self.fp_inputs = fp_block, fp_inputs
        self.stop = None if stop is None else stop[len(prefix):]  # name inside the block

    def __call__(self, stats: dict) -> None:
        fp_handles = [] if self.fp_block is None else [
            self.fp_block.get_submodule(name[len(self.prefix):]).register_forward_pre_hook(
                lambda _m, args, s=stat: s.pending.append(args[0].detach()))
            for name, stat in stats.items()]
        try:
            for k, (args, kwargs) in enumerate(self.inputs):
                if self.fp_block is not None:
                    _run_block_until(self.fp_block, *self.fp_inputs[k], self._stop_in(self.fp_block))
                _run_block_until(self.block, args, kwargs, self._stop_in(self.block))
        finally:
            detach_hooks(fp_handles)

    def _stop_in(self, block: nn.Module) -> nn.Module | None:
        return None if self.stop is None else block.get_submodule(self.stop)


def call_stages(block: nn.Module, linears: dict[str, nn.Linear], sample: tuple[tuple, dict]) -> list[list[str]]:
    """``linears`` grouped in the order ``block`` calls them on ``sample``; consecutive calls on the same input
    tensor (q/k/v, gate/up) form one stage. Linears the block never calls join the last stage."""
    calls: list[tuple[str, torch.Tensor]] = []  # the input tensors are kept alive, so `is` cannot alias
    handles = [lin.register_forward_pre_hook(lambda _m, args, n=name: calls.append((n, args[0])))
               for name, lin in linears.items()]
    try:
        _run_block(block, *sample)
    finally:
        detach_hooks(handles)
    stages: list[list[str]] = []
    seen: set[str] = set()
    last = None
    for name, x in calls:
        if name in seen:
            continue
        if stages and x is last:
            stages[-1].append(name)
        else:
            stages.append([name])
        seen.add(name)
        last = x
    missed = [n for n in linears if n not in seen]
    if not stages:
        return [missed]
    stages[-1].extend(missed)
    return stages


def find_blocks(model: nn.Module, targets: dict[str, nn.Linear]) -> tuple[str, nn.ModuleList | None]:
    """The ``nn.ModuleList`` holding the most target Linears (e.g. ``model.layers``), with its name."""
    best, best_count = ("", None), 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            count = sum(1 for t in targets if t.startswith(f"{name}."))
            if count > best_count:
                best, best_count = (name, mod), count
    return best


class _Captured(Exception):
    pass


def capture_block_inputs(model: nn.Module, block: nn.Module, batches: list) -> list[tuple[tuple, dict]]:
    """Run ``model`` on each batch up to ``block`` and record its ``(args, kwargs)``."""
    inputs: list[tuple[tuple, dict]] = []

    def grab(_mod, args, kwargs):
        inputs.append((args, kwargs))
        raise _Captured

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in batches:
            with contextlib.suppress(_Captured):
                _run_model(model, batch)
    finally:
        handle.remove()
    if len(inputs) != len(batches):
        raise ValueError(f"only {len(inputs)} of {len(batches)} calibration batches reached the first block "
                         f"({type(block).__name__}); check the batches are valid model inputs")
    return inputs


def _run_model(model: nn.Module, batch: Batch):
    with _no_cache(model):
        return model(**batch) if isinstance(batch, dict) else model(batch)


def _run_block(block: nn.Module, args: tuple, kwargs: dict):
    return block(*args, **kwargs)


def _run_block_until(block: nn.Module, args: tuple, kwargs: dict, stop: nn.Module | None) -> None:
    """Run ``block``, stopping just before ``stop`` runs (after its input statistics are taken); all of it
    when ``stop`` is None."""
    if stop is None:
        _run_block(block, args, kwargs)
        return

    def halt(_mod, _args):
        raise _Captured

    handle = stop.register_forward_pre_hook(halt)
    try:
        with contextlib.suppress(_Captured):
            _run_block(block, args, kwargs)
    finally:
        handle.remove()


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@contextlib.contextmanager
def _no_cache(model: nn.Module) -> Iterator[None]:
    """HF models: no KV cache while calibrating (it would grow across blocks)."""
    cfg = getattr(model, "config", None)
    old = getattr(cfg, "use_cache", None)
    if old is not None:
        cfg.use_cache = False
    try:
        yield
    finally:
        if old is not None:
            cfg.use_cache = old
