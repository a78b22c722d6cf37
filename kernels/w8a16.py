"""W8A16: INT8 per-output-channel weights times bf16/fp16/fp32 activations.

Storage: ``qweight`` int8 ``(N, K)``, ``scales`` ``(N,)``; ``W = qweight * scales[:, None]``.
The kernel converts codes to the activation dtype in registers (exact: |q| <= 128)
and applies the scale once per output column after the ``k`` loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._gemm import FMT_W8, launch
from ._runtime import HAS_TRITON


def w8a16_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Reference: dequantize in fp32, cast to ``x.dtype``, ``F.linear``. ``x``: (M, K) → (M, N)."""
    w = qweight.float() * scales.float()[:, None]  # (N, K)
    return F.linear(x, w.to(x.dtype))


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *,
                 path: str | None = None) -> torch.Tensor:
    """Triton W8A16 matmul ``(M, K) x (N, K)^T → (M, N)`` in ``x.dtype``."""
    n, k = qweight.shape
    return launch("w8a16", FMT_W8, x, qweight, scales, None, None, group=1, n=n, k=k, path=path)


@torch.library.custom_op("zspeed::w8a16_mm", mutates_args=())
def w8a16_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ dequant(qweight, scales)^T``; Triton on CUDA, the reference elsewhere."""
    return w8a16_ref(x, qweight, scales)


@w8a16_mm.register_kernel("cuda")
def _w8a16_mm_cuda(x, qweight, scales):
    return w8a16_matmul(x, qweight, scales) if HAS_TRITON else w8a16_ref(x, qweight, scales)


@w8a16_mm.register_fake
def _w8a16_mm_fake(x, qweight, scales):
    return x.new_empty(x.shape[0], qweight.shape[0])
