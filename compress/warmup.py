"""Tune the Triton kernels of a model's compressed layers before the first request needs them.

The first call of a compressed layer on CUDA for a new (shape, row bucket) tunes its
kernel (kernels/_word.py, [Note: kernel tuning]): about a second each, which a
server would otherwise spend inside the first requests. :func:`warm_up_kernels`
runs every distinct compressed layer once per row count a decode or small batch
can have, on zeros, so that tuning happens at start-up (and lands in the on-disk
tuning cache for the next start). Larger row counts take the dequantize + cuBLAS
path, which needs no tuning.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .modules import QuantLinear, SparseLinear

WARM_ROWS = (1, 2, 4, 8, 16, 32, 64)


def warm_up_kernels(modules: Iterable[nn.Module], *, dtype: torch.dtype, device: torch.device,
                    rows: Iterable[int] = WARM_ROWS) -> int:
    """Run each distinct compressed layer among ``modules`` that lives on ``device`` once per count in
    ``rows``; returns how many calls that made (identical layers are run once)."""
    seen: set[str] = set()
    calls = 0
    for module in modules:
        if not isinstance(module, (QuantLinear, SparseLinear)):
            continue
        tensors = [*module.parameters(), *module.buffers()]
        if not tensors or tensors[0].device != device:
            continue
        key = f"{type(module).__name__}{sorted(module.spec().items())}"
        if key in seen:
            continue
        seen.add(key)
        with torch.no_grad():
            for m in rows:
                module(torch.zeros(m, module.in_features, dtype=dtype, device=device))
                calls += 1
    return calls
