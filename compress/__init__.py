"""zspeed.compress: weight-only quantization and N:M sparsity for ``nn.Linear`` layers.

Typical use::

    from zspeed.compress import GPTQConfig, quantize_model, save_compressed, load_compressed
    quantize_model(model, GPTQConfig(bits=4, group_size=128), calib=batches)
    save_compressed(model, "out/")
    model = load_compressed("out/")

Formats: INT8 per output channel (W8A16), INT4 group-wise (W4A16), N:M sparse
(2:4 by default), 2:4 + INT4, and NF4 in bitsandbytes' layout. Methods: RTN,
GPTQ, NF4 (round to nearest), magnitude, Wanda. Every format has a plain-PyTorch
reference here; the integer and sparse formats have Triton kernels in
``zspeed.kernels``, NF4 runs bitsandbytes' kernels on CUDA.
"""
from .config import (DEFAULT_EXCLUDE, METHODS, GPTQConfig, MagnitudeConfig, NF4Config, RTNConfig, WandaConfig,
                     make_config)
from .fuse import FuseConfig, fuse_projections, fused_projections, unfuse_projections
from .formats import Int4Weight, Int8Weight, quantize_int4, quantize_int8
from .gptq import gptq_quantize
from .modules import NF4Linear, QuantLinear, SparseLinear
from .nf4 import NF4Weight, nf4_table, quantize_nf4
from .nm import NMWeight, compress_nm, nm_mask, prune_nm
from .packing import pack_bits, unpack_bits
from .storage import CompressedFormatError, load_compressed, read_metadata, save_compressed
from .transform import quantize_model, select_linears, sparsify_model

__all__ = [
    "DEFAULT_EXCLUDE", "METHODS", "GPTQConfig", "MagnitudeConfig", "NF4Config", "RTNConfig", "WandaConfig",
    "make_config",
    "Int4Weight", "Int8Weight", "quantize_int4", "quantize_int8", "gptq_quantize",
    "QuantLinear", "SparseLinear", "NF4Linear", "NF4Weight", "nf4_table", "quantize_nf4", "NMWeight", "compress_nm",
    "nm_mask", "prune_nm",
    "pack_bits", "unpack_bits", "CompressedFormatError", "load_compressed", "read_metadata", "save_compressed",
    "quantize_model", "select_linears", "sparsify_model",
    "FuseConfig", "fuse_projections", "fused_projections", "unfuse_projections",
]
