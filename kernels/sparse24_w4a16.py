"""2:4 sparse weights whose kept values are INT4: about 2.6 bits per weight at g128.

Storage: ``qvalues`` uint8 ``(N, K/4)`` (kept values' INT4 codes, two per byte),
``meta`` uint8 ``(N, K/8)``, ``scales``/``zeros`` ``(N, K/G)``: one group spans
``G`` original columns, i.e. ``G/2`` kept values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._gemm import FMT_S24W4, launch
from ._ref import densify_24, group_dequant, unpack_fields
from ._runtime import HAS_TRITON


def sparse24_w4a16_ref(x: torch.Tensor, qvalues: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """Reference: dequantize kept values, scatter them, ``F.linear``. (M, K) → (M, N)."""
    values = group_dequant(unpack_fields(qvalues, 4), scales, zeros, group_size // 2)  # (N, K/2)
    return F.linear(x, densify_24(values, meta).to(x.dtype))


def sparse24_w4a16_matmul(x: torch.Tensor, qvalues: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor | None, group_size: int, *, path: str | None = None) -> torch.Tensor:
    """Triton 2:4 + INT4 matmul ``(M, K) x (N, K)^T → (M, N)`` in ``x.dtype``."""
    n, k = qvalues.shape[0], qvalues.shape[1] * 4
    return launch("sparse24_w4a16", FMT_S24W4, x, qvalues, scales, zeros, meta, group=group_size, n=n, k=k,
                  path=path)


@torch.library.custom_op("zspeed::sparse24_w4a16_mm", mutates_args=())
def sparse24_w4a16_mm(x: torch.Tensor, qvalues: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """``x @ densify(dequant(qvalues), meta)^T``; Triton on CUDA, the reference elsewhere."""
    return sparse24_w4a16_ref(x, qvalues, meta, scales, zeros, group_size)


@sparse24_w4a16_mm.register_kernel("cuda")
def _sparse24_w4a16_mm_cuda(x, qvalues, meta, scales, zeros, group_size):
    if not HAS_TRITON:
        return sparse24_w4a16_ref(x, qvalues, meta, scales, zeros, group_size)
    return sparse24_w4a16_matmul(x, qvalues, meta, scales, zeros, group_size)


@sparse24_w4a16_mm.register_fake
def _sparse24_w4a16_mm_fake(x, qvalues, meta, scales, zeros, group_size):
    return x.new_empty(x.shape[0], qvalues.shape[0])
