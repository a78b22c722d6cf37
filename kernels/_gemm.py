"""The matmul skeleton shared by every weight format: ``out = x @ W^T``.

``x`` is ``(M, K)`` in bf16/fp16/fp32, ``W`` is ``(N, K)`` in a compressed format.
Where the packed rows can be read as int32 words (every aligned shape), the
word-wise paths of ``_word`` run: ``gemv`` for a few rows and ``wdot`` (INT8 and
INT4) above that; they are the fast ones. The generic skeleton below handles
every shape, rebuilding ``W`` tile by tile in registers with
``_tiles._load_w_tile``. Its three paths:

- **split-K** (small ``M``): the ``K`` loop is split over ``SPLIT_K`` programs so
  that a few output columns still fill the GPU; partial sums are added with
  fp32 atomics into a zeroed fp32 buffer. With ``BLOCK_M == 1`` each program is a
  GEMV over one row (multiply and reduce, no tensor cores); otherwise ``tl.dot``
  on ``BLOCK_M`` rows.
- **tiled** (medium ``M``): a classic tiled GEMM, one program per output tile,
  storing in the output dtype.
- **dense** (large ``M``): dequantize ``W`` once with ``_dequant_kernel`` and hand
  the matmul to cuBLAS, which is compute-bound there anyway.

[Note: interpreter dot] Triton 3.9's CPU interpreter computes ``tl.dot`` of bf16
operands wrongly, so under the interpreter (and for fp32 inputs) both operands
are upcast to fp32 (``DOT_F32``); on the GPU the dot runs in the input dtype
with fp32 accumulation.

The ``@triton.jit`` code lives in ``_kernels.py`` (skeleton) and ``_tiles.py``
(per-format tile loaders, picked by the compile-time ``FMT`` below).
"""
from __future__ import annotations

import functools

import torch

from ._runtime import cdiv, interpreting, m_bucket

FMT_W8 = 0  # INT8 per-channel
FMT_W4 = 1  # INT4 group-wise
FMT_S24 = 2  # 2:4 sparse, float kept values
FMT_S24W4 = 3  # 2:4 sparse, INT4 kept values


@functools.cache
def kernels():
    """The ``_kernels`` module, imported on first use (see its docstring for why)."""
    from . import _kernels

    return _kernels


def _row_stride(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None and t.dim() > 1 else 1


def _z(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like if t is None else t  # an unused pointer argument must still be a tensor


def run_splitk(x, w, s, z, meta, *, fmt: int, group: int, n: int, k: int) -> torch.Tensor:
    """Split-K path: fp32 atomics into a zeroed buffer, cast to ``x.dtype`` at the end. ``x``: (M, K)."""
    m = x.shape[0]
    out = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    grid = lambda c: (cdiv(m, c["BLOCK_M"]), cdiv(n, c["BLOCK_N"]), c["SPLIT_K"])
    kernels().splitk[grid](x, w, s, _z(z, s), _z(meta, w), out, m, n, k, m_bucket(m),
                           x.stride(0), w.stride(0), _row_stride(s), _row_stride(meta), out.stride(0),
                           FMT=fmt, GROUP=group, HAS_ZEROS=z is not None, DOT_F32=_dot_f32(x), ATOMIC=True)
    return out.to(x.dtype)


def run_tiled(x, w, s, z, meta, *, fmt: int, group: int, n: int, k: int) -> torch.Tensor:
    """Tiled path: one program per output tile, stored in ``x.dtype``. ``x``: (M, K)."""
    m = x.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = lambda c: (cdiv(m, c["BLOCK_M"]), cdiv(n, c["BLOCK_N"]), 1)
    kernels().tiled[grid](x, w, s, _z(z, s), _z(meta, w), out, m, n, k, m_bucket(m),
                          x.stride(0), w.stride(0), _row_stride(s), _row_stride(meta), out.stride(0),
                          FMT=fmt, GROUP=group, HAS_ZEROS=z is not None, DOT_F32=_dot_f32(x), ATOMIC=False)
    return out


def run_dequant(w, s, z, meta, *, fmt: int, group: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rebuild the dense ``(N, K)`` weight in ``dtype`` (the large-``M`` path hands it to cuBLAS)."""
    out = torch.empty(n, k, device=w.device, dtype=dtype)
    bn, bk = (32, 32) if interpreting() else (64, 128)
    grid = (cdiv(n, bn), cdiv(k, bk))
    kernels().dequant[grid](w, s, _z(z, s), _z(meta, w), out, n, k, w.stride(0), _row_stride(s), _row_stride(meta),
                            out.stride(0), FMT=fmt, GROUP=group, HAS_ZEROS=z is not None, BLOCK_N=bn, BLOCK_K=bk)
    return out


def run_dense(x, w, s, z, meta, *, fmt: int, group: int, n: int, k: int) -> torch.Tensor:
    """Dense path: dequantize, then ``torch.matmul`` (cuBLAS on the GPU). ``x``: (M, K)."""
    weight = run_dequant(w, s, z, meta, fmt=fmt, group=group, n=n, k=k, dtype=x.dtype)
    return x @ weight.t()


def _dot_f32(x: torch.Tensor) -> bool:
    return interpreting() or x.dtype == torch.float32


PATHS = {"splitk": run_splitk, "tiled": run_tiled, "dense": run_dense}
WORD_PATHS = ("gemv", "wdot")


def launch(name: str, fmt: int, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
           meta: torch.Tensor | None, *, group: int, n: int, k: int, path: str | None) -> torch.Tensor:
    """Run format ``fmt`` on ``x`` (M, K) through ``path`` (``None``: the policy in ``dispatch``)."""
    from .dispatch import kernel_policy

    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{name}: x must be (M, {k}), got {tuple(x.shape)}")
    from . import _word

    view = _word.word_view(fmt, w, meta, k)
    if path is None:
        from .semi import semi_supported

        semi = fmt == FMT_S24 and semi_supported(x, w)
        words = view is not None and _word.words_fit_groups(fmt, group)
        pipelined = fragment = False
        if fmt in (FMT_W4, FMT_W8) and x.shape[0] >= dict(kernel_policy().dense_min_m).get(name, 1024):  # matters
            from ._pipelined import pipelined_fits, specialized_possible

            pipelined = pipelined_fits(x, s, group=group, k=k, int8=fmt == FMT_W8)
            fragment = pipelined and specialized_possible(x.device, group=group if fmt == FMT_W4 else 64, k=k)
        sparse_mma = False
        policy = kernel_policy()
        if fmt in (FMT_S24, FMT_S24W4) and view is not None \
                and 1 < x.shape[0] <= max(policy.sparse_gemv_max_m, policy.sparse_gemm_max_m):
            from ._sparse_mma import MAX_M, sparse_gemm_fits, sparse_mma_fits, sparse_mma_w4_fits

            if x.shape[0] > MAX_M:  # the 2:4 GEMM
                sparse_mma = sparse_gemm_fits(x, view[0], view[1], w4=fmt == FMT_S24W4, s=s, z=z, group=group)
            else:
                sparse_mma = sparse_mma_fits(x, view[0], view[1]) if fmt == FMT_S24 else \
                    sparse_mma_w4_fits(x, view[0], view[1], s, z, group=group)
        dense_mma = False
        if fmt == FMT_W4 and view is not None and 1 < x.shape[0] <= policy.dense_gemv_max_m:
            from ._dense_mma import dense_mma_w4_fits

            dense_mma = dense_mma_w4_fits(x, view[0], s, z, group=group)
        path = kernel_policy().path(name, x.shape[0], words=words, semi=semi, wdot=_word.wdot_fits(fmt, group),
                                    pipelined=pipelined, sparse_mma=sparse_mma, fragment=fragment,
                                    dense_mma=dense_mma)
    if path not in PATHS and path not in WORD_PATHS and path != "semi":
        raise ValueError(f"{name}: unknown path {path!r}; use one of {sorted([*PATHS, *WORD_PATHS, 'semi'])}")
    if x.shape[0] == 0:
        return x.new_empty(0, n)
    if path == "semi":  # 2:4 on sparse tensor cores (kernels/semi.py)
        if fmt != FMT_S24:
            raise ValueError(f"{name}: the semi path runs plain 2:4 only; use gemv, splitk, tiled or dense")
        from .semi import run_semi

        return run_semi(x, w, meta)
    if path in WORD_PATHS:
        if view is None:
            raise ValueError(f"{name}: path {path!r} needs rows readable as int32 words (K={k} a multiple of "
                             f"{_word.CPW[fmt]}, contiguous, bf16 values for 2:4); use splitk, tiled or dense")
        run = _word.run_gemv if path == "gemv" else _word.run_wdot
        return run(x.contiguous(), view[0], s, z, view[1], fmt=fmt, group=group, n=n, k=k)
    return PATHS[path](x.contiguous(), w, s, z, meta, fmt=fmt, group=group, n=n, k=k)
