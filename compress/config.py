"""Typed, validated configuration for every compression method.

Each method has one frozen, keyword-only dataclass; invalid values fail at
construction with a message that names the field and says how to fix it.
Module selection: a ``nn.Linear`` is compressed when its qualified name matches
one of ``include`` and none of ``exclude`` (``fnmatch`` patterns). By default the
output head (``lm_head``) is left alone; embeddings are not ``nn.Linear`` and are
never touched.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from .nf4 import NF4_BLOCKSIZES
from .uniform import SCALE_DTYPES

DEFAULT_EXCLUDE: tuple[str, ...] = ("lm_head", "*.lm_head", "*embed*")
GROUP_SIZES = (32, 64, 128)


def _fail(cls: type, field: str, value: object, fix: str) -> None:
    raise ValueError(f"{cls.__name__}.{field}={value!r} is invalid: {fix}")


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # resolving defaults of a frozen dataclass


def _check_patterns(obj: object) -> None:
    for name in ("include", "exclude"):
        value = getattr(obj, name)
        if isinstance(value, str):
            value = (value,)
        if not all(isinstance(p, str) for p in value):
            _fail(type(obj), name, value, "give a tuple of fnmatch pattern strings, e.g. ('*.mlp.*',)")
        _set(obj, name, tuple(value))


SCALE_AUTO = "auto"


def _check_scale_dtype(obj: object) -> None:
    if obj.scale_dtype != SCALE_AUTO and obj.scale_dtype not in SCALE_DTYPES:
        _fail(type(obj), "scale_dtype", obj.scale_dtype, f"use {SCALE_AUTO!r} or one of {sorted(SCALE_DTYPES)}")


def with_scale_dtype(config, model_dtype: torch.dtype | None):
    """``config`` with ``scale_dtype="auto"`` made concrete for a model whose weights are ``model_dtype`` (its
    declared dtype: zcompress loads in fp32). [Note: scale dtype] INT4 scales of a bf16 model are stored in bf16:
    the packed INT4 dequantization of the GPU kernels needs scales in the activations' dtype (kernels/
    _wmma_kernels.py; with fp16 scales a bf16 model runs the slower fp32 path, 1.70x against 1.92x over bf16 at
    g128 in benchmarks/RESULTS.md, kernels run 43), and an INT4 grid step loses nothing that matters to bf16's 8
    mantissa bits. Everything else keeps fp16 scales: INT8's per-channel error bound needs fp16's 11 bits, and no
    INT8 path wants bf16 scales. Configs with a named dtype are returned as they are."""
    if getattr(config, "scale_dtype", None) != SCALE_AUTO:
        return config
    int4 = getattr(config, "bits", None) == 4 or getattr(config, "quant_bits", None) == 4
    return replace(config, scale_dtype="bfloat16" if int4 and model_dtype == torch.bfloat16 else "float16")


@dataclass(frozen=True, kw_only=True, slots=True)
class _QuantBase:
    bits: int = 4
    group_size: int | None = None
    symmetric: bool | None = None
    scale_dtype: str = SCALE_AUTO
    pad_groups: bool = False
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE

    def __post_init__(self) -> None:
        cls = type(self)
        if self.bits not in (4, 8):
            _fail(cls, "bits", self.bits, "use 4 (INT4, group-wise) or 8 (INT8, per output channel)")
        if self.bits == 8:
            self._resolve_int8(cls)
        else:
            self._resolve_int4(cls)
        _check_scale_dtype(self)
        _check_patterns(self)

    def _resolve_int8(self, cls: type) -> None:
        if self.group_size is not None:
            _fail(cls, "group_size", self.group_size, "INT8 is per output channel; leave group_size unset for bits=8")
        if self.symmetric is False:
            _fail(cls, "symmetric", False, "INT8 is symmetric only; leave symmetric unset or True for bits=8")
        _set(self, "symmetric", True)

    def _resolve_int4(self, cls: type) -> None:
        if self.group_size is None:
            _set(self, "group_size", 128)
        if self.group_size not in GROUP_SIZES:
            _fail(cls, "group_size", self.group_size, f"use one of {GROUP_SIZES} for bits=4")
        if self.symmetric is None:
            _set(self, "symmetric", False)


@dataclass(frozen=True, kw_only=True, slots=True)
class RTNConfig(_QuantBase):
    """Round-to-nearest weight-only quantization.

    ``bits=8``: INT8, symmetric, per output channel. ``bits=4``: INT4 with one
    scale per ``group_size`` (32/64/128, default 128) input columns, asymmetric
    with an integer zero point unless ``symmetric=True``. ``scale_dtype`` is the
    storage dtype of scales: ``"auto"`` (default) is bf16 for INT4 in a bf16 model,
    else fp16 (:func:`with_scale_dtype`). ``pad_groups=True`` accepts layers
    whose ``in_features`` the group size does not divide (their last group is short).
    """

    method: ClassVar[str] = "rtn"


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTQConfig(_QuantBase):
    """GPTQ: quantize columns in order, pushing each column's error onto the
    not-yet-quantized columns through the inverse Hessian ``(2 X^T X)^-1`` of the
    layer's calibration inputs.

    ``damp``: fraction of the mean Hessian diagonal added to its diagonal.
    ``block_size``: columns updated together (lazy batch); a multiple of the
    group size. ``act_order``: sweep columns by decreasing Hessian diagonal (with
    static groups). ``static_groups``: fit every group's scale before the sweep
    instead of when it is reached. ``true_sequential``: within each block,
    calibrate each Linear on the outputs of the block's already-quantized earlier
    Linears (compress/transform.py, [Note: true sequential]); a Llama block is
    run about 2.7 times instead of 2. ``fp_targets``: fit each Linear to the
    full-precision model's outputs on the same tokens, not to its own weights
    applied to its (already degraded) inputs (compress/gptq.py, [Note:
    full-precision targets]); doubles the block runs. Needs calibration batches
    (``quantize_model(..., calib=...)``).
    """

    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    static_groups: bool = False
    true_sequential: bool = False
    fp_targets: bool = False
    method: ClassVar[str] = "gptq"

    def __post_init__(self) -> None:
        _QuantBase.__post_init__(self)
        for name in ("true_sequential", "fp_targets"):
            if not isinstance(getattr(self, name), bool):
                _fail(type(self), name, getattr(self, name), "use True or False")
        if not 0.0 < self.damp < 1.0:
            _fail(type(self), "damp", self.damp, "use a fraction in (0, 1), typically 0.01")
        if self.block_size <= 0 or (self.bits == 4 and self.block_size % self.group_size):
            _fail(type(self), "block_size", self.block_size, f"use a positive multiple of group_size={self.group_size}")


@dataclass(frozen=True, kw_only=True, slots=True)
class NF4Config:
    """NF4 (4-bit NormalFloat, as in QLoRA and bitsandbytes): per block of
    ``blocksize`` consecutive weights of a row, an fp32 absmax and 16-value
    NormalFloat codes; round to nearest, data-free. Runs bitsandbytes' kernels
    on CUDA (``pip install 'zspeed[quant]'``), a plain-PyTorch reference elsewhere.

    ``blocksize``: one of 32..4096 (powers of two, default 64) dividing every
    selected layer's ``in_features``. ``compute_dtype``: the dtype the matmul runs
    in (``None``: the input's dtype); outputs are cast back to the input's dtype.
    """

    blocksize: int = 64
    compute_dtype: str | None = None
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    method: ClassVar[str] = "nf4"
    bits: ClassVar[int] = 4

    def __post_init__(self) -> None:
        if self.blocksize not in NF4_BLOCKSIZES:
            _fail(type(self), "blocksize", self.blocksize, f"use one of {NF4_BLOCKSIZES} (64 is bitsandbytes' default)")
        if self.compute_dtype is not None and self.compute_dtype not in SCALE_DTYPES:
            _fail(type(self), "compute_dtype", self.compute_dtype,
                  f"use None (the input's dtype) or one of {sorted(SCALE_DTYPES)}")
        _check_patterns(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class _SparseBase:
    n: int = 2
    m: int = 4
    quant_bits: int | None = None
    group_size: int = 128
    symmetric: bool = False
    scale_dtype: str = SCALE_AUTO
    pad_groups: bool = False
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE

    def __post_init__(self) -> None:
        cls = type(self)
        if not 2 <= self.m <= 256:
            _fail(cls, "m", self.m, "use a block size between 2 and 256 (4 for 2:4)")
        if not 0 < self.n < self.m:
            _fail(cls, "n", self.n, f"keep between 1 and m-1={self.m - 1} values per block")
        if self.quant_bits not in (None, 4):
            _fail(cls, "quant_bits", self.quant_bits, "use None (keep floats) or 4 (INT4 kept values)")
        if self.quant_bits and (self.group_size % self.m or (self.group_size * self.n // self.m) % 2):
            _fail(cls, "group_size", self.group_size,
                  f"use a multiple of m={self.m} holding an even number of kept values")
        _check_scale_dtype(self)
        _check_patterns(self)

    @property
    def pattern(self) -> str:
        return f"{self.n}:{self.m}"


@dataclass(frozen=True, kw_only=True, slots=True)
class MagnitudeConfig(_SparseBase):
    """N:M pruning that keeps the ``n`` largest ``|W|`` in each block of ``m``
    input columns (default 2:4); ``quant_bits=4`` also quantizes kept values."""

    method: ClassVar[str] = "magnitude"


@dataclass(frozen=True, kw_only=True, slots=True)
class WandaConfig(_SparseBase):
    """N:M pruning by Wanda scores ``|W_ij| * ||X_j||_2`` (input-channel norms over
    calibration tokens). Needs calibration batches."""

    method: ClassVar[str] = "wanda"


QuantConfig = RTNConfig | GPTQConfig | NF4Config
SparseConfig = MagnitudeConfig | WandaConfig
METHODS: dict[str, type] = {c.method: c for c in (RTNConfig, GPTQConfig, MagnitudeConfig, WandaConfig, NF4Config)}


def make_config(method: str, **kwargs: object) -> QuantConfig | SparseConfig:
    """Build the config of ``method`` (``rtn``, ``gptq``, ``magnitude``, ``wanda``, ``nf4``) from keywords."""
    if method not in METHODS:
        raise ValueError(f"unknown compression method {method!r}; valid methods: {', '.join(METHODS)}")
    cls = METHODS[method]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; valid fields: {sorted(known)}")
    return cls(**kwargs)
