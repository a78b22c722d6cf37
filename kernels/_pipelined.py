"""Launcher of the pipelined INT4 GEMM for Hopper ([Note: pipelined wdot] in ``_pipelined_kernels``).

The ``wdot`` path offers it beside the full-depth kernel's tiles where :func:`pipelined_fits`; it runs only
compiled, on an sm_90 GPU (the interpreter cannot run Gluon), so CPU tests compile it for sm_90 and check its
schedule, and GPU runs check its outputs (``benchmarks/wdot_tiles.py``, ``benchmarks/packed_check.py``).
"""
from __future__ import annotations

import functools

import torch

from ._runtime import cdiv, interpreting

TILE_K = 64  # columns per tile (``_pipelined_kernels.BK``)
# registers a thread of the warp-specialized kernel's dequantizing warps, by their number: 64 (4 warps) or 32 values
# a thread and tile, what no spill needs (sm_90 SASS); the MMA warp groups take the rest of the register file
SPECIALIZED_DQ_REGS = {4: 152, 8: 88}
_GL = {torch.bfloat16: "bfloat16", torch.float16: "float16"}  # x's dtype -> its Gluon name


@functools.cache
def _gluon_ok() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    from . import _pipelined_kernels

    return _pipelined_kernels


def pipelined_possible(device: torch.device, *, group: int, k: int) -> bool:
    """Whether the pipelined kernel can run here: an sm_90 GPU, compiled (not interpreted), a Triton with Gluon,
    groups of whole 64-column tiles and at least two tiles of ``K``."""
    if interpreting() or device.type != "cuda" or group % TILE_K or k % TILE_K or k // TILE_K < 2:
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) == (9, 0) and _gluon_ok()


def pipelined_fits(x: torch.Tensor, s: torch.Tensor, *, group: int, k: int, int8: bool = False) -> bool:
    """:func:`pipelined_possible`, with ``x`` bf16 or fp16 and, for INT4, scales in the same dtype (INT8's
    per-channel scales are applied in fp32, whatever their dtype)."""
    if x.dtype not in _GL or (not int8 and s.dtype != x.dtype):
        return False
    return pipelined_possible(x.device, group=TILE_K if int8 else group, k=k)


def words_readable(words: torch.Tensor) -> bool:
    """Whether TMA can read these INT4 words: a 16-byte aligned base and row stride, unit column stride."""
    return words.stride(1) == 1 and words.data_ptr() % 16 == 0 and (words.stride(0) * words.element_size()) % 16 == 0


def run_pipelined(x: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, *, group: int,
                  n: int, k: int, block_m: int, block_n: int, stages: int, q_stages: int, split_k: int = 1,
                  workspace: tuple[torch.Tensor, torch.Tensor] | None = None, int8: bool = False) -> torch.Tensor:
    """``x @ dequant(W)^T`` in ``x``'s dtype: ``x`` (M, K) bf16 or fp16, ``words`` (N, K / 8) int32
    (:func:`words_readable`), ``s`` (N, groups) in ``x``'s dtype, ``z`` (N, groups) uint8 or ``None`` (symmetric).
    ``block_n`` 64 (4 warps), 128 (8) or 256 (16); ``block_m`` 16-256;
    ``stages`` buffers of ``x`` tiles and ``q_stages`` of word tiles; ``split_k`` slices of ``K``, their partials
    summed in ``workspace`` ``(partials, counters)`` ([Note: split-K fix-up] in ``_word``). With ``int8``: INT8
    words (N, K / 4), ``s`` the per-channel scales (N,) in any float dtype, ``group`` and ``z`` unused."""
    if split_k > 1 and workspace is None:
        raise ValueError("run_pipelined: split_k > 1 needs the fix-up workspace (partials, counters)")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m = x.shape[0]
    if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous() if x.data_ptr() % 16 == 0 else x.clone()  # TMA: 16-byte aligned base and rows
    dt = getattr(gl, _GL[x.dtype])
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, TILE_K],
                              gl.NVMMASharedLayout.get_default_for([block_m, TILE_K], dt))
    kw = words.shape[1]
    wpt = TILE_K // (4 if int8 else 8)  # words per tile row
    w_desc = TensorDescriptor(words, [n, kw], [words.stride(0), 1], [block_n, wpt],
                              gl.NVMMASharedLayout.get_default_for([block_n, wpt], gl.int32))
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts, counters = workspace if split_k > 1 else (out, words)
    _kernels().w4_pipelined_kernel[(cdiv(n, block_n), cdiv(m, block_m), split_k)](
        x_desc, w_desc, s, z if z is not None else s, out, parts, counters, m, n, k, split_k, s.stride(0),
        out.stride(0), GROUP=TILE_K if int8 else group, HAS_ZEROS=z is not None, BLOCK_N=block_n, BLOCK_M=block_m,
        XSTAGES=stages, QSTAGES=q_stages, INT8=int8,
        W_LAYOUT=gl.NVMMASharedLayout.get_default_for([block_n, TILE_K], dt), num_warps=block_n // 16)
    return out


@functools.cache
def _specialized_kernels():
    from . import _specialized_kernels

    return _specialized_kernels


def specialized_possible(device: torch.device, *, group: int, k: int) -> bool:
    """:func:`pipelined_possible`, with a Triton whose Gluon has ``warp_specialize``."""
    if not pipelined_possible(device, group=group, k=k):
        return False
    from triton.experimental.gluon import language as gl

    return hasattr(gl, "warp_specialize")


def run_specialized(x: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, *, group: int,
                    n: int, k: int, block_m: int, block_n: int, stages: int, q_stages: int, w_stages: int = 2,
                    dq_warps: int = 4, split_k: int = 1,
                    workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The warp-specialized INT4 kernel ([Note: warp-specialized wdot] in ``_specialized_kernels``), arguments as
    :func:`run_pipelined`; ``w_stages`` shared buffers of dequantized tiles, ``dq_warps`` dequantizing warps (4 or 8);
    ``block_n // 16`` warps issue the MMAs."""
    if dq_warps not in (4, 8):
        raise ValueError(f"run_specialized: dq_warps must be 4 or 8, not {dq_warps}")
    if split_k > 1 and workspace is None:
        raise ValueError("run_specialized: split_k > 1 needs the fix-up workspace (partials, counters)")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m = x.shape[0]
    if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous() if x.data_ptr() % 16 == 0 else x.clone()
    dt = getattr(gl, _GL[x.dtype])
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, TILE_K],
                              gl.NVMMASharedLayout.get_default_for([block_m, TILE_K], dt))
    wpt = TILE_K // 8
    w_desc = TensorDescriptor(words, [n, words.shape[1]], [words.stride(0), 1], [block_n, wpt],
                              gl.NVMMASharedLayout.get_default_for([block_n, wpt], gl.int32))
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    parts, counters = workspace if split_k > 1 else (out, words)
    _specialized_kernels().w4_specialized_kernel[(cdiv(n, block_n), cdiv(m, block_m), split_k)](
        x_desc, w_desc, s, z if z is not None else s, out, parts, counters, m, n, k, split_k, s.stride(0),
        out.stride(0), GROUP=group, HAS_ZEROS=z is not None, BLOCK_N=block_n, BLOCK_M=block_m, XSTAGES=stages,
        QSTAGES=q_stages, WSTAGES=w_stages, DQ_WARPS=dq_warps, DQ_REGS=SPECIALIZED_DQ_REGS[dq_warps],
        W_LAYOUT=gl.NVMMASharedLayout.get_default_for([block_n, TILE_K], dt), num_warps=block_n // 16)
    return out
