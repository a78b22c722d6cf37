"""What the kernels need to know about the Triton runtime.

[Note: lazy triton] Nothing here imports triton. ``@triton.jit`` (including
triton's own ``tl`` helpers) decides at decoration time whether it builds an
interpreted CPU kernel or a compiled GPU one, from ``TRITON_INTERPRET``. So
triton is imported only when a kernel is first launched (``_gemm.kernels()``),
and a test module can set ``TRITON_INTERPRET=1`` after ``zspeed.kernels`` (and
``zspeed.compress``) were imported. Under the interpreter each kernel gets one
small fixed config, so nothing is autotuned on the CPU.
"""
from __future__ import annotations

import importlib.util
import os

HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def m_bucket(m: int) -> int:
    """Autotuning key for the number of rows: the next power of two (so tuning
    happens once per bucket, not once per batch size)."""
    return 1 << max(0, (m - 1).bit_length())


def bench_fn(fn, quantiles):
    """Short autotuning benchmark: enough to rank configs, cheap enough to tune
    dozens of shapes in a benchmark run."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)
