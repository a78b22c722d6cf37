"""Plain-PyTorch helpers the kernel references share (no dependency on ``zspeed.compress``)."""
from __future__ import annotations

import torch


def unpack_fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``(R, B)`` → int64 ``(R, B * 8 // bits)``, lowest bits first (see ``_tiles`` layouts)."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    fields = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (R, B, per)
    return fields.reshape(packed.shape[0], -1).long()


def group_dequant(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int) -> torch.Tensor:
    """``(codes - zero) * scale`` with one scale/zero per ``group`` columns (the last
    group may be short); fp32 ``(R, C)``."""
    rows, cols = codes.shape
    c = torch.nn.functional.pad(codes.float(), (0, -cols % group)).reshape(rows, -1, group)  # (R, ceil(C/G), G)
    z = 8.0 if zeros is None else zeros.float().unsqueeze(-1)
    return ((c - z) * scales.float().unsqueeze(-1)).reshape(rows, -1)[:, :cols]


def densify_24(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Kept values ``(N, K/2)`` + 2-bit positions ``(N, K/8)`` → dense ``(N, K)``."""
    rows, kept = values.shape
    pos = unpack_fields(meta, 2).reshape(rows, kept // 2, 2)  # (N, K/4, 2)
    dense = torch.zeros(rows, kept // 2, 4, dtype=values.dtype, device=values.device)
    return dense.scatter_(-1, pos, values.reshape(rows, kept // 2, 2)).reshape(rows, kept * 2)
