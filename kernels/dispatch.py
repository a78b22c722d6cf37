"""Which matmul path runs for a given number of rows ``M``.

[Note: crossover] At small ``M`` a weight-only layer is bound by weight bytes, so
reading 4-bit or sparse weights wins; split-K keeps the GPU full when the output
has few tiles. At medium ``M`` a tiled GEMM still saves bytes. At large ``M`` the
matmul is compute-bound and cuBLAS beats any Triton GEMM, so the weight is
dequantized once (cost ~ one pass over the dense weight) and handed to cuBLAS.
The thresholds are per format; ``benchmarks/bench_kernels.py`` prints every path
so they can be set from measurements with :func:`set_kernel_policy`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

PATH_NAMES = ("splitk", "tiled", "dense")


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelPolicy:
    """Row-count thresholds: split-K for ``M <= splitk_max_m``, dense (dequantize +
    cuBLAS) for ``M >= dense_min_m[format]``, tiled in between. ``force`` pins one
    path for every call (benchmarks, debugging); the env var ``ZSPEED_KERNEL_PATH``
    does the same."""

    splitk_max_m: int = 64
    dense_min_m: tuple[tuple[str, int], ...] = (("w8a16", 1024), ("w4a16", 1024), ("sparse24", 512),
                                                 ("sparse24_w4a16", 1024))
    force: str | None = None

    def __post_init__(self) -> None:
        if self.force is not None and self.force not in PATH_NAMES:
            raise ValueError(f"KernelPolicy.force={self.force!r} is invalid: use None or one of {PATH_NAMES}")
        if self.splitk_max_m < 0:
            raise ValueError(f"KernelPolicy.splitk_max_m={self.splitk_max_m} is invalid: use a count >= 0")

    def path(self, fmt: str, m: int) -> str:
        forced = self.force or os.environ.get("ZSPEED_KERNEL_PATH") or None
        if forced:
            if forced not in PATH_NAMES:
                raise ValueError(f"ZSPEED_KERNEL_PATH={forced!r} is invalid: use one of {PATH_NAMES}")
            return forced
        if m <= self.splitk_max_m:
            return "splitk"
        return "dense" if m >= dict(self.dense_min_m).get(fmt, 1024) else "tiled"


_POLICY = KernelPolicy()


def kernel_policy() -> KernelPolicy:
    return _POLICY


def set_kernel_policy(policy: KernelPolicy | None = None, **changes: object) -> KernelPolicy:
    """Replace the process-wide policy (or change some fields of it); returns the previous one."""
    global _POLICY
    previous = _POLICY
    _POLICY = replace(policy or _POLICY, **changes)
    return previous
