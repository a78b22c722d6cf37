"""Which matmul path runs for a given number of rows ``M``.

[Note: crossover] At small ``M`` a weight-only layer is bound by weight bytes, so
reading 4-bit or sparse weights wins: ``gemv`` (word-wise, CUDA cores) for up to
``gemv_max_m`` rows, then ``wdot`` (word-wise, tensor cores) for INT8/INT4 up to
``dense_min_m``; plain 2:4 from ``semi_min_m`` rows on runs on the sparse tensor
cores (``semi``). The defaults come from the H200 run in benchmarks/RESULTS.md
(gemv beats wdot only at one row; wdot beats dequantize + cuBLAS up to 64 rows;
sparse tensor cores beat everything for 2:4 from 256 rows); since the full-depth
``wdot`` kernel (session 8, H100) it also beats dequantize + cuBLAS at 256 rows for
INT8 and INT4, so those go dense only from 512 rows (257-511 rows not measured). Where
INT4 can take the pipelined Gluon kernel (Hopper, scales in ``x``'s bf16 / fp16; [Note:
pipelined wdot] in ``_pipelined_kernels``) it beats dequantize + cuBLAS up to 1023 rows (H100,
8192x8192: 0.77x against 0.58x at 512 rows, 0.75x against 0.73x at 1024, 0.69x against 0.82x
at 2048; kernels runs 50-51), so INT4 goes dense from ``pipelined_dense_min_m`` rows there;
INT8 too, on the same kernel (bf16 / fp16 activations; 0.64-0.80x at 512 rows against dense
0.55x, kernels runs 51 and 64). Where INT4 can take the kernel that dequantizes into the
``wgmma``'s registers ([Note: fragment wdot] in ``_fragment_kernels``, Gluon with ``warp_specialize``)
it beats dequantize + cuBLAS up to 2048 rows on all three benchmark shapes (kernels run 106, with
the tail split, paired and overlapped tiles of session 18: 0.78-0.89x against 0.78-0.84x at 2048)
and loses at 4096 (0.89-0.99x against 0.95-1.02x), so INT4 goes dense only from
``fragment_dense_min_m`` rows there (3072, between the two; not measured at 3072 itself). INT8 takes that
kernel too ([Note: INT8 fragments]) and has the same crossover (kernels run 126, H100: 0.93-0.97x against
dequantize + cuBLAS's 0.82-0.85x at 2048 rows, 0.87-0.97x against 0.89-1.03x at 4096). 2:4, plain
or + INT4, with bf16 ``x`` keeps ``gemv`` up to ``sparse_gemv_max_m`` rows where its GEMV on sparse
tensor cores runs ([Note: 2:4 GEMV on sparse tensor cores] in ``_sparse_mma_kernels``): the rows of
``x`` are that MMA's 8 columns, so 1 to 8 rows read the weights once. From 9 rows up to
``sparse_gemm_max_m`` the ``gemv`` path runs the 2:4 GEMM on sparse tensor cores instead ([Note: 2:4
GEMM on sparse tensor cores] in ``_sparse_gemm_kernels``; H100, kernels runs 148-149: 1.10-1.41x of bf16
at 16 rows, 0.89-1.33x at 32 and 0.63-1.06x at 64, where split-K gave 0.73-0.86x, 0.50-0.57x and
0.68-0.79x; at 64 rows split-K still wins on 8192x8192 by 5-7 %, the GEMM on the larger shapes by
16-38 %). From 128 rows plain 2:4 takes cuSPARSELt (``semi``) and 2:4 + INT4 goes dense (the GEMM
gave 0.42-0.50x there against dense 0.42-0.46x). INT4 with bf16 ``x`` and groups of a multiple of 128
columns keeps ``gemv`` up to ``dense_gemv_max_m`` rows where its GEMV on tensor cores runs ([Note: INT4 GEMV
on tensor cores] in ``_dense_mma_kernels``), for the same reason: 1 to 8 rows of ``x`` are one MMA's
columns (H100, kernels runs 163-164: 2.36-2.57x of bf16 at 4 rows and 2.11-2.41x at 8, where ``wdot`` gave
1.94-2.25x at 4 rows, run 153). From 9 rows it would run two blocks of 8 through each fragment, and lost to
``wdot`` there (1.30-1.61x at 16 rows against 1.90-2.22x, runs 149 and 163), so ``wdot`` keeps them; its tuner
also times the GEMV on ``wgmma`` there ([Note: INT4 GEMV on wgmma] in ``_stripe_wgmma_kernels``).
Shapes the word kernels cannot read, and the 2:4 formats above ``gemv_max_m``, use
the generic skeleton: split-K keeps the GPU full when the output has few tiles. At
medium ``M`` a tiled GEMM still saves bytes. At large ``M`` the matmul is compute-bound
and cuBLAS beats any Triton GEMM, so the weight is dequantized once (cost ~ one pass
over the dense weight) and handed to cuBLAS.
The thresholds are per format; ``benchmarks/bench_kernels.py`` prints every path
so they can be set from measurements with :func:`set_kernel_policy`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

PATH_NAMES = ("gemv", "wdot", "splitk", "tiled", "dense", "semi")
WDOT_FORMATS = ("w8a16", "w4a16")


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelPolicy:
    """Row-count thresholds: word-wise ``gemv`` for ``M <= gemv_max_m``; dense (dequantize
    + cuBLAS) for ``M >= dense_min_m[format]``; in between ``wdot`` for INT8/INT4, and
    for the rest split-K up to ``splitk_max_m`` then tiled. ``force`` pins one path for
    every call (benchmarks, debugging); the env var ``ZSPEED_KERNEL_PATH`` does the same."""

    gemv_max_m: int = 1
    splitk_max_m: int = 64
    dense_min_m: tuple[tuple[str, int], ...] = (("w8a16", 512), ("w4a16", 512), ("sparse24", 512),
                                                 ("sparse24_w4a16", 128))
    semi_min_m: int = 128
    pipelined_dense_min_m: int = 1024  # INT4 / INT8 where the pipelined kernel runs ([Note: crossover])
    fragment_dense_min_m: int = 3072  # INT4 / INT8 where the register-operand kernel runs ([Note: crossover])
    sparse_gemv_max_m: int = 8  # 2:4 (plain, + INT4) keeps gemv up to here where it runs on sparse tensor cores
    sparse_gemm_max_m: int = 64  # and from there up to here on the 2:4 GEMM on sparse tensor cores
    dense_gemv_max_m: int = 8  # INT4 keeps gemv up to here where it runs on tensor cores
    force: str | None = None

    def __post_init__(self) -> None:
        if self.force is not None and self.force not in PATH_NAMES:
            raise ValueError(f"KernelPolicy.force={self.force!r} is invalid: use None or one of {PATH_NAMES}")
        if self.splitk_max_m < 0 or self.gemv_max_m < 0:
            raise ValueError(f"KernelPolicy thresholds must be counts >= 0, got gemv_max_m={self.gemv_max_m}, "
                             f"splitk_max_m={self.splitk_max_m}")

    def path(self, fmt: str, m: int, *, words: bool = True, semi: bool = False, wdot: bool = True,
             pipelined: bool = False, sparse_mma: bool = False, fragment: bool = False,
             dense_mma: bool = False) -> str:
        """The path for ``m`` rows; ``words``: whether the weight can be read word-wise (``_word.word_view``,
        ``_word.words_fit_groups``); ``semi``: whether plain 2:4 can run on sparse tensor cores
        (``semi.semi_supported``); ``wdot``: whether the tensor-core word kernel has a tile for the groups;
        ``pipelined``: whether INT4 / INT8 can take the pipelined kernel (``_pipelined.pipelined_fits``);
        ``sparse_mma``: whether 2:4 (plain or + INT4) can take the GEMV (up to 8 rows) or the GEMM (more) on sparse
        tensor cores (``_sparse_mma``);
        ``fragment``: whether INT4 / INT8 can also take the register-operand kernel
        (``_pipelined.specialized_possible``); ``dense_mma``: whether INT4 can take the GEMV on tensor cores
        (``_dense_mma.dense_mma_w4_fits``)."""
        forced = self.force or os.environ.get("ZSPEED_KERNEL_PATH") or None
        if forced:
            if forced not in PATH_NAMES:
                raise ValueError(f"ZSPEED_KERNEL_PATH={forced!r} is invalid: use one of {PATH_NAMES}")
            return forced
        if words and m <= self.gemv_max_m:
            return "gemv"
        if words and sparse_mma and fmt in ("sparse24", "sparse24_w4a16") \
                and m <= max(self.sparse_gemv_max_m, self.sparse_gemm_max_m):
            return "gemv"
        if words and dense_mma and fmt == "w4a16" and m <= self.dense_gemv_max_m:
            return "gemv"
        if semi and fmt == "sparse24" and m >= self.semi_min_m:
            return "semi"
        dense_min = dict(self.dense_min_m).get(fmt, 1024)
        if pipelined and fmt in WDOT_FORMATS and words and wdot:
            dense_min = max(dense_min, self.pipelined_dense_min_m)
            if fragment:
                dense_min = max(dense_min, self.fragment_dense_min_m)
        if m >= dense_min:
            return "dense"
        if words and wdot and fmt in WDOT_FORMATS:
            return "wdot"
        return "splitk" if m <= self.splitk_max_m else "tiled"


_POLICY = KernelPolicy()


def kernel_policy() -> KernelPolicy:
    return _POLICY


def set_kernel_policy(policy: KernelPolicy | None = None, **changes: object) -> KernelPolicy:
    """Replace the process-wide policy (or change some fields of it); returns the previous one."""
    global _POLICY
    previous = _POLICY
    _POLICY = replace(policy or _POLICY, **changes)
    return previous
