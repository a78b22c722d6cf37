"""W4A16: INT4 group-wise weights times bf16/fp16/fp32 activations.

Storage: ``qweight`` uint8 ``(N, K/2)`` (two codes per byte, even column low),
``scales`` ``(N, K/G)``, ``zeros`` uint8 ``(N, K/G)`` or ``None`` (symmetric: zero
point 8). ``W[n, k] = (code - zero[n, k // G]) * scale[n, k // G]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._gemm import FMT_W4, launch
from ._ref import group_dequant, unpack_fields
from ._runtime import HAS_TRITON


def w4a16_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              group_size: int) -> torch.Tensor:
    """Reference: unpack, dequantize in fp32, cast to ``x.dtype``, ``F.linear``. (M, K) → (M, N)."""
    w = group_dequant(unpack_fields(qweight, 4), scales, zeros, group_size)  # (N, K)
    return F.linear(x, w.to(x.dtype))


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group_size: int, *, path: str | None = None) -> torch.Tensor:
    """Triton W4A16 matmul ``(M, K) x (N, K)^T → (M, N)`` in ``x.dtype``."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    return launch("w4a16", FMT_W4, x, qweight, scales, zeros, None, group=group_size, n=n, k=k, path=path)


@torch.library.custom_op("zspeed::w4a16_mm", mutates_args=())
def w4a16_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             group_size: int) -> torch.Tensor:
    """``x @ dequant(qweight)^T``; Triton on CUDA, the reference elsewhere."""
    return w4a16_ref(x, qweight, scales, zeros, group_size)


@w4a16_mm.register_kernel("cuda")
def _w4a16_mm_cuda(x, qweight, scales, zeros, group_size):
    if not HAS_TRITON:
        return w4a16_ref(x, qweight, scales, zeros, group_size)
    return w4a16_matmul(x, qweight, scales, zeros, group_size)


@w4a16_mm.register_fake
def _w4a16_mm_fake(x, qweight, scales, zeros, group_size):
    return x.new_empty(x.shape[0], qweight.shape[0])
