"""Drop-in replacements for ``nn.Linear`` holding compressed weights.

``QuantLinear`` and ``SparseLinear`` run through the ``zspeed::*`` custom ops: the
Triton kernels on CUDA, the plain-PyTorch references elsewhere. ``NF4Linear``
runs bitsandbytes' kernels on CUDA and its reference elsewhere. Compressed
tensors are buffers (not parameters), so ``state_dict`` holds exactly what is saved.
"""
from __future__ import annotations

import torch
from torch import nn

import zspeed.kernels  # noqa: F401  (registers the torch.ops.zspeed custom ops)

from .formats import Int4Weight, Int8Weight, check_group_size
from .nf4 import NF4Weight, bnb_matmul, check_nf4_shape
from .nm import NMWeight, check_nm_shape
from .packing import index_bits
from .uniform import SCALE_DTYPES


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _apply(x: torch.Tensor, out_features: int, bias: torch.Tensor | None, op, *args) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    y = op(x2, *args)  # (M, N)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], out_features)  # (..., N)


class QuantLinear(nn.Module):
    """``nn.Linear`` with INT8 (per output channel, symmetric) or INT4 (group-wise) weights.

    Build from a float Linear with :meth:`from_linear`; construct directly (empty
    buffers) only to load a saved state dict. Activations keep their dtype.
    """

    def __init__(self, in_features: int, out_features: int, *, bits: int = 4, group_size: int | None = 128,
                 symmetric: bool = False, bias: bool = True, scale_dtype: str = "float16",
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"QuantLinear: bits={bits} is invalid; use 4 or 8")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.group_size = group_size if bits == 4 else None
        self.symmetric = True if bits == 8 else symmetric
        self.scale_dtype = scale_dtype
        sdt, n, k = SCALE_DTYPES[scale_dtype], out_features, in_features
        if bits == 8:
            self.register_buffer("qweight", torch.empty(n, k, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(n, dtype=sdt, device=device))
        else:
            check_group_size(k, group_size, pad_groups=True)  # the config decides whether short groups are allowed
            self.register_buffer("qweight", torch.empty(n, k // 2, dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty(n, _cdiv(k, group_size), dtype=sdt, device=device))
        zeros = None if self.symmetric else torch.empty(n, _cdiv(k, group_size), dtype=torch.uint8, device=device)
        self.register_buffer("zeros", zeros)
        self.register_buffer("bias", torch.empty(n, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_weight(cls, q: Int8Weight | Int4Weight, bias: torch.Tensor | None, *,
                    dtype: torch.dtype = torch.float32) -> "QuantLinear":
        """Wrap an already quantized weight (and optional float bias)."""
        n, k = q.shape
        bits = 8 if isinstance(q, Int8Weight) else 4
        mod = cls(k, n, bits=bits, group_size=getattr(q, "group_size", None),
                  symmetric=bits == 8 or q.zeros is None, bias=bias is not None,
                  scale_dtype=_dtype_name(q.scales.dtype), dtype=dtype, device="meta")
        mod.qweight, mod.scales = q.qweight, q.scales
        mod.zeros = None if bits == 8 else q.zeros
        mod.bias = None if bias is None else bias.detach().clone()
        return mod

    def packed(self) -> Int8Weight | Int4Weight:
        """The stored weight as a format object (no copy)."""
        if self.bits == 8:
            return Int8Weight(qweight=self.qweight, scales=self.scales)
        return Int4Weight(qweight=self.qweight, scales=self.scales, zeros=self.zeros, group_size=self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``(out_features, in_features)`` weight this module multiplies by."""
        return self.packed().dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return _apply(x, self.out_features, self.bias, torch.ops.zspeed.w8a16_mm, self.qweight, self.scales)
        return _apply(x, self.out_features, self.bias, torch.ops.zspeed.w4a16_mm, self.qweight, self.scales,
                      self.zeros, self.group_size)

    def spec(self) -> dict:
        """What ``save_compressed`` records to rebuild this module."""
        return {"format": f"int{self.bits}", "bits": self.bits, "group_size": self.group_size,
                "symmetric": self.symmetric, "scale_dtype": self.scale_dtype, "in_features": self.in_features,
                "out_features": self.out_features, "bias": self.bias is not None}

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}, symmetric={self.symmetric}" if self.bits == 4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}{g}"


class SparseLinear(nn.Module):
    """``nn.Linear`` with N:M sparse weights stored compressed, optionally with INT4 kept values.

    2:4 runs the Triton kernels on CUDA; other N:M patterns rebuild the dense
    weight on each call (a storage format, not a speed-up).
    """

    def __init__(self, in_features: int, out_features: int, *, n: int = 2, m: int = 4, quant_bits: int | None = None,
                 group_size: int = 128, symmetric: bool = False, bias: bool = True, scale_dtype: str = "float16",
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        check_nm_shape(in_features, n, m)
        if quant_bits not in (None, 4):
            raise ValueError(f"SparseLinear: quant_bits={quant_bits} is invalid; use None or 4")
        self.in_features, self.out_features, self.n, self.m = in_features, out_features, n, m
        self.quant_bits, self.group_size = quant_bits, group_size
        self.symmetric, self.scale_dtype = symmetric, scale_dtype
        rows, kept = out_features, in_features // m * n
        self.register_buffer("meta", torch.empty(rows, kept * index_bits(m) // 8, dtype=torch.uint8, device=device))
        if quant_bits is None:
            self.register_buffer("values", torch.empty(rows, kept, dtype=dtype, device=device))
        else:
            self._init_int4(rows, kept, dtype, device)
        self.register_buffer("bias", torch.empty(rows, dtype=dtype, device=device) if bias else None)

    def _init_int4(self, rows: int, kept: int, dtype: torch.dtype, device) -> None:
        check_group_size(self.in_features, self.group_size, pad_groups=True)
        groups = _cdiv(self.in_features, self.group_size)
        sdt = SCALE_DTYPES[self.scale_dtype]
        self.register_buffer("qvalues", torch.empty(rows, kept // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(rows, groups, dtype=sdt, device=device))
        zeros = None if self.symmetric else torch.empty(rows, groups, dtype=torch.uint8, device=device)
        self.register_buffer("zeros", zeros)

    @classmethod
    def from_weight(cls, w: NMWeight, bias: torch.Tensor | None, *, group_size: int = 128,
                    dtype: torch.dtype = torch.float32) -> "SparseLinear":
        """Wrap a compressed N:M weight. For INT4 values, ``group_size`` counts original columns."""
        rows, k = w.shape
        q = w.values if isinstance(w.values, Int4Weight) else None
        mod = cls(k, rows, n=w.n, m=w.m, quant_bits=4 if q is not None else None, group_size=group_size,
                  symmetric=q is not None and q.zeros is None, bias=bias is not None,
                  scale_dtype=_dtype_name(q.scales.dtype) if q is not None else "float16", dtype=dtype, device="meta")
        mod.meta = w.meta
        if q is None:
            mod.values = w.values
        else:
            mod.qvalues, mod.scales, mod.zeros = q.qweight, q.scales, q.zeros
        mod.bias = None if bias is None else bias.detach().clone()
        return mod

    def packed(self) -> NMWeight:
        values = self.values if self.quant_bits is None else Int4Weight(
            qweight=self.qvalues, scales=self.scales, zeros=self.zeros, group_size=self.group_size * self.n // self.m)
        return NMWeight(values=values, meta=self.meta, n=self.n, m=self.m, in_features=self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``(out_features, in_features)`` weight, zeros where pruned."""
        return self.packed().dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.zspeed
        if (self.n, self.m) != (2, 4):
            return _apply(x, self.out_features, self.bias, lambda x2: x2 @ self.dequantize(x.dtype).t())
        if self.quant_bits is None:
            return _apply(x, self.out_features, self.bias, ops.sparse24_mm, self.values, self.meta)
        return _apply(x, self.out_features, self.bias, ops.sparse24_w4a16_mm, self.qvalues, self.meta, self.scales,
                      self.zeros, self.group_size)

    def spec(self) -> dict:
        fmt = f"sparse{self.n}:{self.m}" + ("+int4" if self.quant_bits else "")
        return {"format": fmt, "pattern": f"{self.n}:{self.m}", "bits": self.quant_bits,
                "group_size": self.group_size if self.quant_bits else None,
                "symmetric": self.symmetric if self.quant_bits else None, "scale_dtype": self.scale_dtype,
                "in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None}

    def extra_repr(self) -> str:
        q = f", int4 group_size={self.group_size}" if self.quant_bits else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, pattern={self.n}:{self.m}{q}"


class NF4Linear(nn.Module):
    """``nn.Linear`` with NF4 weights in bitsandbytes' layout (``zspeed.compress.nf4``).

    On CUDA the matmul is ``bitsandbytes.matmul_4bit`` (an ``ImportError`` naming
    ``pip install 'zspeed[quant]'`` if bitsandbytes is missing); elsewhere the weight
    is dequantized by the plain-PyTorch reference. ``compute_dtype`` (``None``: the
    input's) is the dtype the matmul runs in; the output has the input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, *, blocksize: int = 64, compute_dtype: str | None = None,
                 bias: bool = True, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        check_nf4_shape(in_features, blocksize)
        if compute_dtype is not None and compute_dtype not in SCALE_DTYPES:
            raise ValueError(f"NF4Linear: compute_dtype={compute_dtype!r} is invalid; "
                             f"use None or {sorted(SCALE_DTYPES)}")
        self.in_features, self.out_features = in_features, out_features
        self.blocksize, self.compute_dtype = blocksize, compute_dtype
        numel = in_features * out_features
        self.register_buffer("qweight", torch.empty(_cdiv(numel, 2), dtype=torch.uint8, device=device))
        self.register_buffer("absmax", torch.empty(_cdiv(numel, blocksize), dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_weight(cls, q: NF4Weight, bias: torch.Tensor | None, *, compute_dtype: str | None = None,
                    dtype: torch.dtype = torch.float32) -> "NF4Linear":
        """Wrap an already quantized weight (and optional float bias)."""
        n, k = q.shape
        mod = cls(k, n, blocksize=q.blocksize, compute_dtype=compute_dtype, bias=bias is not None, dtype=dtype,
                  device="meta")
        mod.qweight, mod.absmax = q.qweight, q.absmax
        mod.bias = None if bias is None else bias.detach().clone()
        return mod

    def packed(self) -> NF4Weight:
        return NF4Weight(qweight=self.qweight, absmax=self.absmax, shape=(self.out_features, self.in_features),
                         blocksize=self.blocksize)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``(out_features, in_features)`` weight this module multiplies by."""
        return self.packed().dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cdt = x.dtype if self.compute_dtype is None else SCALE_DTYPES[self.compute_dtype]
        return _apply(x.to(cdt), self.out_features, self.bias, self._matmul).to(x.dtype)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        if x2.device.type == "cuda":
            return bnb_matmul(x2, self.packed())
        return x2 @ self.dequantize(x2.dtype).t()

    def spec(self) -> dict:
        """What ``save_compressed`` records; ``group_size`` is the block size (blocks lie within rows)."""
        return {"format": "nf4", "bits": 4, "group_size": self.blocksize, "blocksize": self.blocksize,
                "symmetric": None, "scale_dtype": "float32", "compute_dtype": self.compute_dtype,
                "quant_type": "nf4", "in_features": self.in_features, "out_features": self.out_features,
                "bias": self.bias is not None}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, nf4 blocksize={self.blocksize}"
                f", compute_dtype={self.compute_dtype}")
