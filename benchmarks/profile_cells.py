"""One profiled call of the kernel that zspeed's default path runs, per (format, shape, rows) cell of
``bench_kernels.py``, for Nsight Compute. Each cell is tuned and warmed up first, outside the profiled range
(``cudaProfilerStart`` / ``Stop`` around the one call); ``bf16`` is cuBLAS on the dense weight. On an sm_90 GPU, e.g.
(kernels run 151):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \\
        --section SchedulerStats python benchmarks/profile_cells.py bf16:8192x8192:1 sparse24_w4a16:8192x8192:1

A cell is ``FORMAT:KxN:M`` with FORMAT one of bf16, w4a16, w8a16, sparse24, sparse24_w4a16. Under ncu the tuner's
own timings are distorted (kernels run 154 picked another kernel than without it), so to profile what a benchmark
runs, run this once without ncu first and leave the tuning cache on: the profiled run then reads the picks.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import make_weights, zspeed_cases  # noqa: E402  (the same weights and calls as the benchmark)

FORMATS = ("bf16", "w4a16", "w8a16", "sparse24", "sparse24_w4a16")


def _cell(text: str) -> tuple[str, int, int, int]:
    try:
        fmt, shape, m = text.split(":")
        k, n = (int(v) for v in shape.lower().split("x"))
        m = int(m)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cell {text!r}: write FORMAT:KxN:M, e.g. w4a16:8192x8192:1") from None
    if fmt not in FORMATS:
        raise argparse.ArgumentTypeError(f"cell {text!r}: the format must be one of {FORMATS}")
    return fmt, k, n, m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cells", type=_cell, nargs="+")
    args = p.parse_args()
    shapes: dict = {}
    for fmt, k, n, m in args.cells:
        if (k, n) not in shapes:  # one shape's weights at a time
            shapes.clear()
            torch.cuda.empty_cache()
            wt = make_weights(k, n)
            shapes[(k, n)] = (wt, zspeed_cases(wt))
        wt, cases = shapes[(k, n)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        fn = (lambda: F.linear(x, wt["dense"])) if fmt == "bf16" else (lambda f=cases[fmt][0]: f(x, None))
        for _ in range(3):  # tunes, compiles, warms up
            fn()
        torch.cuda.synchronize()
        print(f"cell {fmt} {k}x{n} M={m}", flush=True)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
