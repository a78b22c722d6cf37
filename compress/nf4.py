"""NF4 (4-bit NormalFloat, QLoRA) weights in bitsandbytes' layout, with a plain-PyTorch reference.

An NF4 weight stores, per block of ``blocksize`` consecutive elements of the
row-major ``(N, K)`` weight, the block's absolute maximum (fp32), and per element
a 4-bit index into the 16-value NF4 table: ``W ≈ table[code] * absmax``.

[Note: NF4 layout] The tensors are exactly what ``bitsandbytes.functional.quantize_4bit``
returns for ``quant_type="nf4"`` without double quantization, so they go to
bitsandbytes' kernels as they are, with no repacking:
- blocks run over the *flattened* weight, so a block may span two rows when
  ``blocksize`` does not divide ``K``; the last block may be short;
- ``qweight`` is uint8 ``(ceil(N*K/2),)``: element ``2i`` in the *high* nibble of
  byte ``i``, element ``2i+1`` in the low nibble (the opposite of
  ``packing.pack_bits``, which INT4 uses); an odd count is padded with the code of 0.0;
- ``absmax`` is fp32 ``(ceil(N*K/blocksize),)``.

[Note: NF4 table] Dettmers et al., "QLoRA" (2023), define NF4 from quantiles of
N(0, 1): 8 positive values at quantiles evenly spaced from ``0.5`` to ``δ`` and 7
negative ones from ``0.5`` to ``δ`` (mirrored), plus an exact 0, all divided by the
largest, so the table spans [-1, 1] and 0 is representable.
``δ = ½((1 - 1/32) + (1 - 1/30)) ≈ 0.9677083``, used at the 7 published digits.
Evaluating the quantile points in fp32, the inverse CDF in fp64 and the
normalization in fp32 reproduces bitsandbytes' shipped table bit for bit (the
test checks it), so reference and bitsandbytes dequantize identically.

[Note: NF4 blocks within rows] The layout allows a block to span two rows, and the
reference handles it, but bitsandbytes 0.50.2's CPU ``dequantize_4bit`` reads
blocks per row and returns wrong values when ``blocksize`` does not divide ``K``
(its own quantizer and its pure-PyTorch backend agree with the reference). So
``NF4Linear`` requires ``K % blocksize == 0``: every block lies within one row and
``absmax`` viewed as ``(N, K/blocksize)`` is per-row groups, as for INT4.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

NF4_OFFSET = 0.9677083  # δ of [Note: NF4 table]
NF4_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes accepts
_ZERO_CODE = 7  # table[7] == 0.0
INSTALL_HINT = "pip install 'zspeed[quant]'"


@cache
def _table_cpu() -> torch.Tensor:
    def quantile_points(count: int) -> torch.Tensor:  # `count - 1` points from δ down to (not incl.) 0.5
        return torch.linspace(NF4_OFFSET, 0.5, count, dtype=torch.float32)[:-1].double()

    positive = torch.special.ndtri(quantile_points(9))  # 8 values
    negative = -torch.special.ndtri(quantile_points(8))  # 7 values
    values = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).float().sort().values
    return values / values.max()  # (16,) in [-1, 1]


@cache
def _table_on(device: torch.device) -> torch.Tensor:
    return _table_cpu().to(device)


def nf4_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 NF4 values, ascending, fp32 (see [Note: NF4 table]); cached per device, do not modify."""
    return _table_on(torch.device(device))


def check_blocksize(blocksize: int) -> None:
    if blocksize not in NF4_BLOCKSIZES:
        raise ValueError(f"NF4 blocksize={blocksize} is invalid: use one of {NF4_BLOCKSIZES} (bitsandbytes' sizes)")


def check_nf4_shape(in_features: int, blocksize: int, *, name: str = "weight") -> None:
    """Blocks must not span rows: see [Note: NF4 blocks within rows]."""
    check_blocksize(blocksize)
    if in_features % blocksize:
        fits = [b for b in NF4_BLOCKSIZES[:4] if in_features % b == 0]
        hint = f"use blocksize in {fits}" if fits else "no blocksize of 32/64/128/256 divides it"
        raise ValueError(f"NF4 blocksize={blocksize} does not divide in_features={in_features} of {name}: {hint}, "
                         "or leave this module uncompressed (add its name to `exclude`)")


@dataclass(frozen=True, slots=True)
class NF4Weight:
    """An NF4-quantized ``(N, K)`` weight in bitsandbytes' layout (see [Note: NF4 layout])."""

    qweight: torch.Tensor  # uint8 (ceil(N*K/2),)
    absmax: torch.Tensor  # float32 (ceil(N*K/blocksize),)
    shape: tuple[int, int]
    blocksize: int

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def codes(self) -> torch.Tensor:
        """Unpacked table indices, uint8 ``(N*K,)`` in [0, 15]."""
        return unpack_nf4(self.qweight, self.numel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = nf4_table(self.qweight.device)[self.codes().long()]  # (N*K,) fp32
        blocks = _blocks(values, self.blocksize)  # (nblocks, B)
        w = (blocks * self.absmax.float()[:, None]).reshape(-1)[: self.numel]
        return w.reshape(self.shape).to(dtype)


def pack_nf4(codes: torch.Tensor) -> torch.Tensor:
    """Flat codes ``(L,)`` in [0, 15] → uint8 ``(ceil(L/2),)``, first code in the high nibble."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_full((1,), _ZERO_CODE)])
    pairs = c.reshape(-1, 2)  # (L/2, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


def unpack_nf4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_nf4`: uint8 ``(ceil(L/2),)`` → uint8 codes ``(numel,)``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed NF4 codes must be uint8, got {packed.dtype}")
    p = packed.reshape(-1)
    return torch.stack([p >> 4, p & 0xF], dim=1).reshape(-1)[:numel]  # (2 * bytes,) → (numel,)


def _blocks(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``(L,)`` → ``(ceil(L/B), B)``, zero-padding a short last block."""
    pad = -flat.numel() % blocksize
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.reshape(-1, blocksize)


def nearest_nf4(scaled: torch.Tensor) -> torch.Tensor:
    """Index of the NF4 value nearest to each element of ``scaled`` (in [-1, 1]); ties go down."""
    table = nf4_table(scaled.device)
    midpoints = (table[:-1] + table[1:]) / 2  # (15,) decision boundaries
    return torch.bucketize(scaled.float(), midpoints)


def quantize_nf4(w: torch.Tensor, *, blocksize: int = 64) -> NF4Weight:
    """Round-to-nearest NF4: per block, divide by the block's absmax and take the nearest table value."""
    check_blocksize(blocksize)
    if w.dim() != 2:
        raise ValueError(f"NF4 quantizes 2-D (out_features, in_features) weights, got shape {tuple(w.shape)}")
    blocks = _blocks(w.detach().reshape(-1).float(), blocksize)  # (nblocks, B); padding never raises absmax
    absmax = blocks.abs().amax(dim=1)  # (nblocks,)
    scaled = blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]  # all-zero block → 0 → code 7
    codes = nearest_nf4(scaled).reshape(-1)[: w.numel()]
    return NF4Weight(qweight=pack_nf4(codes), absmax=absmax, shape=tuple(w.shape), blocksize=blocksize)


# -- bitsandbytes ---------------------------------------------------------------------------------------------------
def require_bitsandbytes(what: str):
    """Import bitsandbytes, or raise an ``ImportError`` that says how to install it."""
    try:
        import bitsandbytes
    except ImportError as e:
        raise ImportError(f"{what} runs bitsandbytes' kernels, but bitsandbytes is not installed: "
                          f"{INSTALL_HINT}") from e
    return bitsandbytes


def bnb_matmul(x: torch.Tensor, q: NF4Weight) -> torch.Tensor:
    """``x @ W.T`` through ``bitsandbytes.matmul_4bit``, in ``x``'s dtype; ``x`` is ``(..., K)``."""
    bnb = require_bitsandbytes("NF4 matmul")
    state = bnb.functional.QuantState(absmax=q.absmax, shape=torch.Size(q.shape), code=nf4_table(x.device),
                                      blocksize=q.blocksize, quant_type="nf4", dtype=x.dtype)
    # bitsandbytes' Linear4bit passes its (ceil(N*K/2), 1) weight transposed; keep that convention.
    return bnb.matmul_4bit(x, q.qweight.view(-1, 1).t(), quant_state=state)
