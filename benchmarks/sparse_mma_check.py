"""The 2:4 GEMV on sparse tensor cores checked bit for bit on a GPU ([Note: 2:4 GEMV on sparse tensor cores] in
kernels/_sparse_mma_kernels.py).

    python benchmarks/sparse_mma_check.py

Small integer weights and activations (exact in bf16, and every sum exact in fp32), odd row counts (rows past ``N``
masked), ``K`` not a multiple of a slice (tiles past ``K`` masked), 1 to 8 rows of ``x``, one and several slices,
none, one or two blocks loaded ahead, whole and partial runs of rows; each output lands on memory just filled with
NaN, so an element left unwritten fails. Prints one line per case and exits non-zero on any mismatch.
"""
from __future__ import annotations

import sys

import torch

from zspeed.compress.nm import compress_nm
from zspeed.kernels import _word, sparse24_ref
from zspeed.kernels._sparse_mma import run_sparse_mma

CASES = ((16, 64, 1, 2), (16, 64, 8, 2), (64, 256, 3, 4), (200, 96, 5, 2), (1000, 512, 1, 4), (1000, 8192, 2, 8),
         (1024, 4096, 1, 16), (2048, 8192, 7, 16))  # (N, K, M, tiles per slice)
CONFIGS = ((1, 1, 1), (4, 2, 2), (2, 4, 2), (8, 1, 1), (4, 2, 0), (2, 4, 0), (1, 1, 0))  # (warps, row blocks,
# blocks ahead)


def main() -> int:
    torch.manual_seed(0)
    bad = 0
    ws = _word._stationary_workspace(torch.device("cuda"))
    for n, k, m, kt in CASES:
        w = torch.randint(-4, 5, (n, k), device="cuda").float().view(n, k // 4, 4)
        keep = torch.rand(n, k // 4, 4, device="cuda").argsort(-1)[..., :2]
        w = (w * torch.zeros_like(w).scatter_(-1, keep, 1.0)).view(n, k).to(torch.bfloat16)
        sp = compress_nm(w)
        x = torch.randint(-3, 4, (m, k), device="cuda").to(torch.bfloat16)
        ref = sparse24_ref(x, sp.values, sp.meta).float()
        for warps, rb, depth in CONFIGS:
            torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed: the output lands on it
            out = run_sparse_mma(x, sp.values.view(torch.int32), sp.meta, n=n, tiles_per_slice=kt, row_blocks=rb,
                                 warps=warps, depth=depth, workspace=ws).float()
            ok = torch.equal(out, ref)
            bad += not ok
            print(f"N={n} K={k} M={m} tiles/slice={kt} warps={warps} row blocks={rb} ahead={depth}: "
                  + ("exact" if ok else f"MISMATCH (max {(out - ref).abs().max().item()}, "
                                        f"{out.isnan().sum().item()} NaN)"), flush=True)
    print("all exact" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
