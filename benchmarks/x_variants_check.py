"""Which x-load variant of the W4A16 GEMV wins at M=1 (kernels/_word_kernels.py, [Note: x layouts])?

    python benchmarks/x_variants_check.py [--k 8192 --n 8192]

Tunes the INT4 g128 GEMV over every tile with each of the three x loads (plane-major 1D, plane-major 2D,
natural order 2D), prints the best time of each variant and cuBLAS bf16 in the same process (CUDA graphs,
cold L2: kernels/_runtime.py graph_time_ms).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from zspeed.compress import quantize_int4
from zspeed.kernels import _word
from zspeed.kernels._runtime import graph_time_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    args = p.parse_args()
    w = (torch.randn(args.n, args.k, device="cuda") * 0.02).to(torch.bfloat16)
    q = quantize_int4(w, group_size=128, scale_dtype=torch.bfloat16)
    x = torch.randn(1, args.k, device="cuda", dtype=torch.bfloat16)
    base = graph_time_ms(lambda: F.linear(x, w))
    print(f"cuBLAS bf16 {base * 1e3:.1f} us", flush=True)
    words = q.qweight.view(torch.int32)
    for variant in ((False, False), (True, False), (True, True)):
        _word.X_VARIANTS = (variant,)
        _word._BEST.clear()
        _word._tuning_cache.cache_clear()
        start = time.perf_counter()
        key_fn = lambda: _word.run_gemv(x, words, q.scales, q.zeros, None, fmt=_word.FMT_W4, group=128,  # noqa: E731
                                        n=args.n, k=args.k)
        key_fn()
        tuning = time.perf_counter() - start
        ms = graph_time_ms(key_fn)
        best = next(iter(_word.tuned().values()))
        print(f"x2d={variant[0]} xnat={variant[1]}: {ms * 1e3:.1f} us = {base / ms:.2f}x bf16 "
              f"(tuned in {tuning:.0f} s: {best})", flush=True)


if __name__ == "__main__":
    main()
