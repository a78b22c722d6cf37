"""Launchers of the Gluon GEMMs for Hopper: the pipelined INT4 / INT8 kernel ([Note: pipelined wdot] in
``_pipelined_kernels``), the warp-specialized INT4 kernel ([Note: warp-specialized wdot] in ``_specialized_kernels``)
and the INT4 kernel that dequantizes into the ``wgmma``'s register operand ([Note: fragment wdot] in
``_fragment_kernels``).

The ``wdot`` path offers them beside the full-depth kernel's tiles where :func:`pipelined_fits` (the last two also
where :func:`specialized_possible`); they run only compiled, on an sm_90 GPU (the interpreter cannot run Gluon), so
CPU tests compile them for sm_90 and check their schedules, and GPU runs check their outputs
(``benchmarks/wdot_tiles.py``, ``benchmarks/packed_check.py``, ``benchmarks/fragment_check.py``).
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


def _operands(x: torch.Tensor, words: torch.Tensor, *, n: int, k: int, block_m: int, block_n: int, wpt: int):
    """``(x_desc, w_desc, out, dt)`` of a Gluon GEMM: TMA descriptors of ``x`` (copied where TMA cannot read it: a
    16-byte aligned base and rows) in ``(block_m, 64)`` blocks and of the words in ``(block_n, wpt)`` blocks, the
    output ``(M, N)`` in ``x``'s dtype, and that dtype's Gluon name."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m = x.shape[0]
    if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous() if x.data_ptr() % 16 == 0 else x.clone()
    dt = getattr(gl, _GL[x.dtype])
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, TILE_K],
                              gl.NVMMASharedLayout.get_default_for([block_m, TILE_K], dt))
    w_desc = TensorDescriptor(words, [n, words.shape[1]], [words.stride(0), 1], [block_n, wpt],
                              gl.NVMMASharedLayout.get_default_for([block_n, wpt], gl.int32))
    return x_desc, w_desc, torch.empty(m, n, device=x.device, dtype=x.dtype), dt


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

    m = x.shape[0]
    x_desc, w_desc, out, dt = _operands(x, words, n=n, k=k, block_m=block_m, block_n=block_n,
                                        wpt=TILE_K // (4 if int8 else 8))
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

    m = x.shape[0]
    x_desc, w_desc, out, dt = _operands(x, words, n=n, k=k, block_m=block_m, block_n=block_n, wpt=TILE_K // 8)
    parts, counters = workspace if split_k > 1 else (out, words)
    _specialized_kernels().w4_specialized_kernel[(cdiv(n, block_n), cdiv(m, block_m), split_k)](
        x_desc, w_desc, s, z if z is not None else s, out, parts, counters, m, n, k, split_k, s.stride(0),
        out.stride(0), GROUP=group, HAS_ZEROS=z is not None, BLOCK_N=block_n, BLOCK_M=block_m, XSTAGES=stages,
        QSTAGES=q_stages, WSTAGES=w_stages, DQ_WARPS=dq_warps, DQ_REGS=SPECIALIZED_DQ_REGS[dq_warps],
        W_LAYOUT=gl.NVMMASharedLayout.get_default_for([block_n, TILE_K], dt), num_warps=block_n // 16)
    return out


@functools.cache
def _fragment_kernels():
    from . import _fragment_kernels

    return _fragment_kernels


def run_fragment(x: torch.Tensor, words: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, *, group: int,
                 n: int, k: int, block_m: int, stages: int, q_stages: int, split_k: int = 1, whole: int = 0,
                 pair: bool = False, overlap: bool = False, sub: int = 1, warp_groups: int = 2,
                 mma_regs: int | None = None, workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                 int8: bool = False) -> torch.Tensor:
    """The INT4 (or INT8) kernel that dequantizes into the ``wgmma``'s register operand ([Note: fragment wdot] in
    ``_fragment_kernels``): 128 weight rows a program in two MMA warp groups, one loader warp; other arguments as
    :func:`run_pipelined`. With ``split_k > 1`` the tiles after the first ``whole`` (numbered weight-row block first)
    each run in ``split_k`` slices of ``K`` ([Note: tail split]), their partials ``(tiles - whole) x split_k x 128 x
    block_m`` floats in ``workspace``, two counters a tile. ``pair``: two tiles a ``wgmma`` round ([Note: paired
    tiles]); ``overlap``: each ``wgmma`` in flight while the next tile is dequantized ([Note: overlapped fragments]);
    ``sub``: tiles a ring slot (2: [Note: slots of two tiles]; ``stages`` and ``q_stages`` then count slots);
    ``warp_groups``: MMA warp groups, 64 weight rows each (4: [Note: four warp groups at small M]), each with
    ``mma_regs`` registers a thread (default 232 for two, 104 for four). With ``int8``: INT8 words (N, K / 4), ``s``
    the per-channel scales (N,), ``z`` and ``group`` unused ([Note: INT8 fragments]).
    """
    if warp_groups not in (2, 4) or (warp_groups == 4 and (block_m > 64 or pair)):
        raise ValueError(f"run_fragment: warp_groups={warp_groups} is invalid: use 2, or 4 with blocks of at most 64 "
                         f"rows of x (got {block_m}) and no paired tiles ([Note: four warp groups at small M])")
    block_n = 64 * warp_groups
    mma_regs = mma_regs or (232 if warp_groups == 2 else 104)
    if pair and overlap:
        raise ValueError("run_fragment: pair and overlap are two schedules of the same loop; pick one")
    if sub not in (1, 2) or (sub == 2 and (pair or not overlap or k % (TILE_K * sub))):
        raise ValueError(f"run_fragment: sub={sub} is invalid: slots of two tiles ([Note: slots of two tiles]) run "
                         f"only with overlap=True, pair=False and K a multiple of {TILE_K * 2} (got K={k}); else use "
                         "sub=1")
    if stages > q_stages:
        raise ValueError(f"run_fragment: stages={stages} x buffers exceed q_stages={q_stages} word buffers: the loader "
                         "keeps the words ahead of x, so it would never issue the last ones; use stages <= q_stages")
    tiles = cdiv(n, block_n) * cdiv(x.shape[0], block_m)
    if split_k < 1 or not 0 <= whole <= tiles:
        raise ValueError(f"run_fragment: split_k must be >= 1 (got {split_k}) and whole within 0..{tiles} tiles "
                         f"(got {whole})")
    if split_k > 1 and workspace is None:
        raise ValueError("run_fragment: split_k > 1 needs the fix-up workspace (partials, counters)")
    if split_k > 1 and ((tiles - whole) * split_k * block_n * block_m > workspace[0].numel()
                        or warp_groups * tiles > workspace[1].numel()):
        raise ValueError(f"run_fragment: {tiles - whole} split tiles x {split_k} slices need "
                         f"{(tiles - whole) * split_k * block_n * block_m} partial sums and {warp_groups * tiles} "
                         f"counters; the "
                         f"workspace has {workspace[0].numel()} and {workspace[1].numel()}: split fewer tiles")
    m = x.shape[0]
    x_desc, w_desc, out, _ = _operands(x, words, n=n, k=k, block_m=block_m, block_n=block_n,
                                       wpt=TILE_K // (4 if int8 else 8))
    if int8:
        group, z = TILE_K, None
    parts, counters = workspace if split_k > 1 else (out, words)
    if split_k == 1:  # every tile whole; SPLIT_K is then unused, and a 1 (which Triton would make a constant)
        whole, split_k = tiles, 2  # fails to compile in Triton 3.6's Gluon
    _fragment_kernels().w4_fragment_kernel[(whole + (tiles - whole) * split_k, )](
        x_desc, w_desc, s, z if z is not None else s, out, parts, counters, m, n, k, whole, split_k, s.stride(0),
        out.stride(0), GROUP=group, HAS_ZEROS=z is not None, BLOCK_M=block_m, XSTAGES=stages, QSTAGES=q_stages,
        MMA_REGS=mma_regs, PAIR=pair, num_warps=4, **({"OVERLAP": True} if overlap else {}),
        **({"SUB": sub} if sub > 1 else {}), **({"NWG": warp_groups} if warp_groups != 2 else {}))  # (an older
    # kernel has none of these: benchmarks/fragment_ab.py)
    return out
