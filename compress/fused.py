"""Sibling projections that read the same input, run as one matmul: the modules.

[Note: fused projections] At batch-1 decode a projection such as ``k_proj``
(4096 -> 1024) is too small to keep the GPU busy: most of its time is the
ramp-up and tail of one short kernel, not its weight bytes. Projections that
read the same input (``q/k/v``, ``gate/up``) can share one launch: their weight
rows are concatenated into one module (``FusedProjection.linear``, of the same
type: ``nn.Linear``, ``QuantLinear`` or ``SparseLinear``), and each original
child is replaced by a ``ProjectionSlice`` that returns its columns of the
fused output. The model's own forward is untouched: it still calls ``q_proj(x)``,
``k_proj(x)``, ``v_proj(x)`` in turn.

The first slice (the *leader*, ``index == 0``) computes the whole fused output
and keeps the other slices' columns, together with the input it was computed
from; a later slice returns its kept columns only when it is called with *that
same tensor object* (and, outside ``torch.compile`` and ``torch.inference_mode``,
the same version of it: inference tensors keep no version counter, so there an
in-place change of the input between siblings goes unseen).
Any other call (another input, as in cross-attention; a different call order; a
slice called twice) computes the slice's own rows alone, from a row view of the
fused weight. So the result is always what the separate modules computed, and
the fast path is taken in the usual order. Kept columns are dropped as soon as
they are taken, so nothing outlives the layer's forward in the usual order.
``torch.compile`` traces this (the kept columns are a Python-side effect Dynamo
replays), and the compiled graph holds one matmul per group.

Outputs are column views of the fused output (non-contiguous along the last
dimension): ``view`` that splits the last dimension works, as Hugging Face's
attention does; code that needs contiguous memory must call ``.contiguous()``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedProjection(nn.Module):
    """The concatenated rows of sibling projections ``names`` (``sizes`` output features each), run once."""

    def __init__(self, linear: nn.Module, names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
        super().__init__()
        if linear.out_features != sum(sizes) or len(names) != len(sizes):
            raise ValueError(f"FusedProjection: {len(names)} names and sizes {sizes} do not match a module of "
                             f"{linear.out_features} output features")
        self.linear, self.names, self.sizes = linear, tuple(names), tuple(sizes)
        self.in_features = linear.in_features
        self._kept: tuple | None = None  # (input, its version, outputs not yet taken) of the leader's last call

    def offset(self, index: int) -> int:
        return sum(self.sizes[:index])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every sibling's output, as column views of one matmul. (..., K) -> tuple of (..., N_i)."""
        return tuple(self.linear(x).split(self.sizes, dim=-1))

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``index``'s output for input ``x`` (see [Note: fused projections])."""
        kept = self._kept
        if kept is not None and kept[0] is x and kept[2][index] is not None and kept[1] == _version(x):
            rest = list(kept[2])
            out, rest[index] = rest[index], None
            self._kept = None if all(o is None for o in rest) else (x, kept[1], tuple(rest))
            return out
        if index == 0:
            outs = self(x)
            self._kept = (x, _version(x), (None, *outs[1:])) if len(outs) > 1 else None
            return outs[0]
        return self.part(index, x)

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``index`` alone, through a row view of the fused weight (no copy; gradients reach it)."""
        r0, rows = self.offset(index), self.sizes[index]
        if type(self.linear) is nn.Linear:
            bias = self.linear.bias
            bias = None if bias is None else bias.narrow(0, r0, rows)
            return F.linear(x, self.linear.weight.narrow(0, r0, rows), bias)
        return narrow_rows(self.linear, r0, rows)(x)  # compressed modules: buffers only

    def extra_repr(self) -> str:
        return f"names={self.names}, sizes={self.sizes}"


class ProjectionSlice(nn.Module):
    """Stands where sibling ``index`` of a ``FusedProjection`` was; holds no tensors of its own.

    The ``FusedProjection`` is registered in the parent module (so ``to()``,
    ``state_dict()`` and ``named_modules()`` see it once); the slice refers to it
    without registering it."""

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a child: the parent owns it
        self.index = index
        self.in_features, self.out_features = fused.in_features, fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.output(self.index, x)

    def extra_repr(self) -> str:
        r0 = self.fused.offset(self.index)
        return f"rows {r0}:{r0 + self.out_features} of {'+'.join(self.fused.names)}"


def _version(x: torch.Tensor) -> int:
    """The tensor's in-place version counter; 0 while Dynamo traces (it sees no in-place change between siblings
    that it would not also see in the graph) and for inference tensors (they have no counter)."""
    if torch.compiler.is_compiling() or x.is_inference():
        return 0
    return x._version


def empty_rows(mod: nn.Module, rows: int) -> nn.Module:
    """An empty (``meta``) module of ``mod``'s type and format with ``rows`` output features."""
    from .modules import QuantLinear, SparseLinear
    from .storage import module_from_spec

    if type(mod) is nn.Linear:
        return nn.Linear(mod.in_features, rows, bias=mod.bias is not None, device="meta", dtype=mod.weight.dtype)
    if isinstance(mod, (QuantLinear, SparseLinear)):
        dtype = mod.bias.dtype if mod.bias is not None else torch.float32
        return module_from_spec({**mod.spec(), "out_features": rows}, dtype)
    raise TypeError(f"cannot split or join the rows of {type(mod).__name__}; nn.Linear, QuantLinear and "
                    "SparseLinear can be fused")


def row_tensors(mod: nn.Module) -> dict[str, tuple[bool, torch.Tensor | None]]:
    """``name -> (is a parameter, tensor)`` of every tensor of ``mod``; each has one row per output feature."""
    out = {name: (True, t) for name, t in mod._parameters.items()}
    out.update({name: (False, t) for name, t in mod._buffers.items()})
    return out


def _set(mod: nn.Module, name: str, is_param: bool, t: torch.Tensor | None, grad: bool = False) -> None:
    if t is None:
        (mod._parameters if is_param else mod._buffers)[name] = None
    elif is_param:
        mod._parameters[name] = nn.Parameter(t, requires_grad=grad)
    else:
        mod._buffers[name] = t


def narrow_rows(mod: nn.Module, start: int, rows: int, *, clone: bool = False) -> nn.Module:
    """Output rows ``start:start + rows`` of ``mod`` as a module of its type: views of its tensors (copies with
    ``clone``)."""
    out = empty_rows(mod, rows)
    for name, (is_param, t) in row_tensors(mod).items():
        part = None if t is None else t.detach().narrow(0, start, rows)
        if part is not None and clone:
            part = part.clone()
        _set(out, name, is_param, part, t is not None and t.requires_grad)
    return out


def concat_rows(mods: list[nn.Module]) -> nn.Module:
    """One module of the siblings' type whose output rows are theirs, in order (copies)."""
    out = empty_rows(mods[0], sum(m.out_features for m in mods))
    for name, (is_param, t) in row_tensors(mods[0]).items():
        if t is None:
            _set(out, name, is_param, None)
            continue
        joined = torch.cat([row_tensors(m)[name][1].detach() for m in mods], dim=0)
        _set(out, name, is_param, joined, t.requires_grad)
    return out
