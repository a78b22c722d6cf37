"""2:4 sparse weights (kept values + 2-bit positions) times activations.

Storage: ``values`` ``(N, K/2)`` in the activation dtype (kept values of blocks of
4 columns, in order), ``meta`` uint8 ``(N, K/8)`` (four 2-bit positions per
byte). The kernel reads half the weight bytes (plus 1/16 for metadata) and
rebuilds the dense tile in registers, which pays off while weight bytes dominate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._gemm import FMT_S24, launch
from ._ref import densify_24
from ._runtime import HAS_TRITON


def sparse24_ref(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Reference: scatter kept values into a dense matrix, ``F.linear``. (M, K) → (M, N)."""
    return F.linear(x, densify_24(values, meta).to(x.dtype))


def sparse24_matmul(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, *,
                    path: str | None = None) -> torch.Tensor:
    """Triton 2:4 matmul ``(M, K) x (N, K)^T → (M, N)`` in ``x.dtype``."""
    n, k = values.shape[0], values.shape[1] * 2
    return launch("sparse24", FMT_S24, x, values, values, None, meta, group=1, n=n, k=k, path=path)


@torch.library.custom_op("zspeed::sparse24_mm", mutates_args=())
def sparse24_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """``x @ densify(values, meta)^T``; Triton on CUDA, the reference elsewhere."""
    return sparse24_ref(x, values, meta)


@sparse24_mm.register_kernel("cuda")
def _sparse24_mm_cuda(x, values, meta):
    return sparse24_matmul(x, values, meta) if HAS_TRITON else sparse24_ref(x, values, meta)


@sparse24_mm.register_fake
def _sparse24_mm_fake(x, values, meta):
    return x.new_empty(x.shape[0], values.shape[0])
