"""The transform that fuses sibling projections (``q/k/v``, ``gate/up``) into one matmul, and its inverse.

Why and how: [Note: fused projections] in ``fused.py``. Typical use, after
quantizing or loading and before ``torch.compile``::

    quantize_model(model, RTNConfig(bits=4))   # or load_compressed(...)
    fuse_projections(model)                    # q/k/v and gate/up of every layer: one launch each
    ...
    unfuse_projections(model)                  # before save_compressed
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from fnmatch import fnmatch

from torch import nn

from .fused import FusedProjection, ProjectionSlice, concat_rows, narrow_rows
from .modules import QuantLinear, SparseLinear

DEFAULT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True, kw_only=True, slots=True)
class FuseConfig:
    """Which sibling projections to fuse.

    ``groups``: child names that read the same input, called in this order by their
    parent's forward (the first computes all of them; see [Note: fused projections]).
    ``include``: patterns (fnmatch) of the *parent* modules' names to consider."""

    groups: tuple[tuple[str, ...], ...] = DEFAULT_GROUPS
    include: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for group in self.groups:
            if not isinstance(group, tuple) or len(group) < 2 or len(set(group)) != len(group):
                raise ValueError(f"FuseConfig.groups: {group!r} is invalid; each group is a tuple of two or more "
                                 "distinct child names, e.g. ('q_proj', 'k_proj', 'v_proj')")
            bad = [n for n in group if not isinstance(n, str) or not n or "." in n or "+" in n]
            if bad:
                raise ValueError(f"FuseConfig.groups: {bad[0]!r} is not a child module name (no '.' or '+')")
            if seen & set(group):
                raise ValueError(f"FuseConfig.groups: {sorted(seen & set(group))} appear in two groups")
            seen |= set(group)
        if not self.include:
            raise ValueError("FuseConfig.include is empty: nothing would be fused; use ('*',) for every module")


def fuse_projections(model: nn.Module, config: FuseConfig | None = None) -> nn.Module:
    """Fuse each group of sibling projections of ``model`` (in place) into one ``FusedProjection``.

    A group is fused where a parent module (matching ``config.include``) has every
    child it names, all of one type (``nn.Linear``, ``QuantLinear`` or ``SparseLinear``)
    and one format (bits, group size, symmetry, pattern, dtype, bias or not), with
    the same number of input features, on one device, and without hooks. Where the
    children are present but differ, the group is left as it is and a warning names
    the reason. Fusing copies the weights (the originals are freed) and changes the
    model's ``state_dict`` keys: fuse after loading, and call
    :func:`unfuse_projections` before saving. Returns ``model``."""
    config = config or FuseConfig()
    skipped = []
    for parent_name, parent in list(model.named_modules()):
        if not any(fnmatch(parent_name, p) for p in config.include):
            continue
        for names in config.groups:
            children = [getattr(parent, n, None) for n in names]
            if not all(isinstance(c, nn.Module) for c in children) or any(
                    isinstance(c, ProjectionSlice) for c in children):
                continue  # a group this model does not have, or one fused already
            reason = _why_not(children)
            if reason:
                skipped.append(f"{parent_name or '<model>'}.{{{','.join(names)}}}: {reason}")
                continue
            _fuse(parent, names, children)
    if skipped:
        warnings.warn("fuse_projections left these groups unfused:\n  " + "\n  ".join(skipped), stacklevel=2)
    return model


def unfuse_projections(model: nn.Module) -> nn.Module:
    """Undo :func:`fuse_projections` (in place): every slice becomes a module of its own again (copies of its
    rows), and the fused modules go. Returns ``model``."""
    for _, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, FusedProjection):
                for index, name in enumerate(child.names):
                    if isinstance(getattr(parent, name, None), ProjectionSlice):
                        rows = narrow_rows(child.linear, child.offset(index), child.sizes[index], clone=True)
                        setattr(parent, name, rows)
                delattr(parent, child_name)
    return model


def fused_projections(model: nn.Module) -> dict[str, FusedProjection]:
    """Every ``FusedProjection`` of ``model`` by module name."""
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, FusedProjection)}


def _fuse(parent: nn.Module, names: tuple[str, ...], children: list[nn.Module]) -> None:
    fused = FusedProjection(concat_rows(children), names, tuple(c.out_features for c in children))
    parent.add_module("+".join(names), fused)
    for index, name in enumerate(names):
        setattr(parent, name, ProjectionSlice(fused, index))


def _why_not(children: list[nn.Module]) -> str | None:
    """Why these siblings cannot be fused (``None``: they can)."""
    kinds = {type(c) for c in children}
    if len(kinds) > 1:
        return "different module types " + ", ".join(sorted(k.__name__ for k in kinds))
    kind = kinds.pop()
    if kind is not nn.Linear and kind not in (QuantLinear, SparseLinear):
        return f"{kind.__name__} cannot be fused (nn.Linear, QuantLinear and SparseLinear can)"
    if len({id(c) for c in children}) < len(children):
        return "one module appears under two names"
    if len({c.in_features for c in children}) > 1:
        return "different input features " + str(sorted({c.in_features for c in children}))
    if any(c._forward_hooks or c._forward_pre_hooks for c in children):
        return "a module has forward hooks, which a fused module would not run"
    spec = [_format(c) for c in children]
    if any(s != spec[0] for s in spec):
        return f"different formats: {spec[0]} vs {next(s for s in spec if s != spec[0])}"
    return None


def _format(mod: nn.Module) -> tuple:
    """Everything two siblings must share to be fused: the format without the output features, and each
    tensor's dtype, device and presence."""
    spec = {k: v for k, v in mod.spec().items() if k != "out_features"} if hasattr(mod, "spec") else {}
    tensors = {**mod._parameters, **mod._buffers}
    return (sorted(spec.items()),
            sorted((n, None if t is None else (t.dtype, t.device, t.shape[1:])) for n, t in tensors.items()))
