"""2:4 on the GPU's sparse tensor cores, through torch's semi-structured sparse tensors.

[Note: sparse tensor cores at large M] At large ``M`` a 2:4 matmul is compute-bound;
Hopper's sparse tensor cores (through ``torch.sparse.to_sparse_semi_structured``:
CUTLASS or cuSPARSELt) run it at up to twice the dense rate, which no Triton kernel
over our compressed layout matches. The semi-structured form is built once per
weight from our (values, meta) and cached per ``values`` tensor (weakly: the entry
goes when the tensor does) and its version (a weight changed in place is rebuilt); it holds the same kept values in
torch's own layout, so a layer that runs both small-``M`` (our kernels) and
large-``M`` (this path) batches keeps both copies: ~0.56x of the dense bytes on top of
ours. :func:`clear_semi_cache` drops them. Needs a CUDA device of compute capability
8.0 or more, bf16/fp16 values and inputs of the values' dtype.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ._ref import densify_24

_CACHE: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}  # id(values) -> (ref, versions, sparse form)


def clear_semi_cache() -> None:
    _CACHE.clear()


def semi_supported(x: torch.Tensor, values: torch.Tensor) -> bool:
    return (x.is_cuda and values.dtype in (torch.bfloat16, torch.float16) and x.dtype == values.dtype
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


def semi_weight(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The semi-structured sparse form of the 2:4 weight (cached; see the module note)."""
    versions = (values._version, meta.untyped_storage().data_ptr(), meta._version)
    hit = _CACHE.get(id(values))
    if hit is not None and hit[0]() is values and hit[1] == versions:
        return hit[2]
    from torch.sparse import to_sparse_semi_structured

    sparse = to_sparse_semi_structured(densify_24(values, meta).to(values.dtype))
    key = id(values)
    _CACHE[key] = (weakref.ref(values, lambda _ref, key=key: _drop(key, _ref)), versions, sparse)
    return sparse


def _drop(key: int, ref: weakref.ref) -> None:
    entry = _CACHE.get(key)
    if entry is not None and entry[0] is ref:  # not an entry made since for a new tensor with the same id
        del _CACHE[key]


def run_semi(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    if not semi_supported(x, values):
        raise ValueError("the semi path needs CUDA (sm80+), bf16/fp16 kept values and x of the same dtype; "
                         "use gemv, splitk, tiled or dense")
    return F.linear(x, semi_weight(values, meta))
