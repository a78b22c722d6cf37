"""The 2:4 GEMVs on sparse tensor cores, plain and with INT4 kept values, checked bit for bit on a GPU ([Note: 2:4
GEMV on sparse tensor cores] in kernels/_sparse_mma_kernels.py).

    python benchmarks/sparse_mma_check.py [--stripes | --fold | --w4-fold]
        (plain 2:4 in stripes, or with folded rows, or 2:4 + INT4 with folded rows, alone)

Small integer weights and activations (exact in bf16, and every sum exact in fp32), odd row counts (rows past ``N``
masked), ``K`` not a multiple of a slice (tiles past ``K`` masked), 1 to 8 rows of ``x``, one and several slices,
none, one or two blocks loaded ahead, whole and partial runs of rows; each output lands on memory just filled with
NaN, so an element left unwritten fails. 2:4 + INT4: random codes, with and without zero points, scales that are
powers of two (so that the reference's bf16 weights are exact), groups of 64, 128 and 256 original columns; with folded
rows also 4 to 16 warps along K ([Note: fold warps along K] in kernels/_dense_mma_kernels.py). Prints one line per
case and exits non-zero on any mismatch.
"""
from __future__ import annotations

import sys

import torch

from zspeed.compress.nm import compress_nm
from zspeed.kernels import _word, sparse24_ref, sparse24_w4a16_ref
from zspeed.kernels._sparse_mma import (run_sparse_gemm, run_sparse_gemm_w4, run_sparse_mma, run_sparse_mma_fold,
                                        run_sparse_mma_stripe, run_sparse_mma_w4, run_sparse_mma_w4_fold)

CASES = ((16, 64, 1, 2), (16, 64, 8, 2), (64, 256, 3, 4), (200, 96, 5, 2), (1000, 512, 1, 4), (1000, 8192, 2, 8),
         (1024, 4096, 1, 16), (2048, 8192, 7, 16))  # (N, K, M, tiles per slice)
CONFIGS = ((1, 1, 1), (4, 2, 2), (2, 4, 2), (8, 1, 1), (4, 2, 0), (2, 4, 0), (1, 1, 0))  # (warps, row blocks,
# blocks ahead)


W4_CASES = ((16, 128, 1, 4, 128, True), (64, 512, 8, 4, 128, False), (200, 384, 5, 8, 128, True),
            (1000, 1024, 3, 8, 256, True), (1024, 8192, 1, 16, 128, True), (2048, 8192, 7, 8, 128, False),
            (200, 320, 4, 2, 64, True), (96, 448, 8, 4, 64, False), (1000, 8192, 1, 16, 64, True))
# (N, K, M, tiles per slice, group of original columns, zero points): stripes of 4 tiles for groups of 128 and
# 256 columns, of 2 for 64 ([Note: INT4 stripes]); slices with a partial last one

FOLD_K_CONFIGS = ((8, 1, 1, 8), (8, 2, 1, 4), (16, 1, 1, 16), (4, 2, 0, 4))  # (warps, row blocks, blocks ahead,
# warps along K)

W4_FOLD_CASES = ((16, 128, 1, 4, 128, True), (64, 512, 4, 8, 128, False), (200, 384, 3, 8, 128, True),
                 (1000, 1024, 2, 8, 256, True), (1024, 8192, 1, 32, 128, True), (2048, 8192, 4, 16, 128, False),
                 (200, 640, 4, 16, 128, True), (96, 1152, 3, 32, 128, True), (100, 768, 1, 4, 256, False))
# (N, K, M, tiles per slice, group, zero points) of 2:4 + INT4 with folded rows ([Note: 2:4 folded rows]): 1-4 rows of
# x, pairs of MMAs of 128 columns, partial last slices (384, 640), one slice past K (1152 = 9 pairs in slices of 8)


STRIPE_CASES = ((16, 128, 1, 4, 4), (16, 128, 8, 4, 2), (200, 384, 5, 8, 4), (1000, 512, 3, 4, 2),
                (1000, 8192, 2, 16, 4), (1024, 4096, 1, 16, 2), (2048, 8192, 7, 32, 4), (200, 320, 4, 4, 2),
                (96, 448, 8, 8, 2), (100, 640, 6, 16, 4))
# (N, K, M, tiles per slice, tiles a stripe) of plain 2:4 in stripes ([Note: 2:4 stripes]): slices with a partial
# last one (384, 320, 448), one slice past K (640 = 20 tiles in slices of 16), rows past N

FOLD_CASES = ((16, 128, 1, 4), (16, 128, 4, 4), (200, 384, 3, 8), (1000, 512, 2, 4), (1000, 8192, 1, 16),
              (1024, 4096, 1, 32), (2048, 8192, 4, 16), (200, 320, 4, 4), (96, 448, 3, 8), (100, 640, 2, 16))
# (N, K, M, tiles per slice) of plain 2:4 with folded rows ([Note: 2:4 folded rows]; 0-2 blocks ahead): 1-4 rows of
# x, slices with a partial last one (384; 320 and 448 end in half a pair of MMAs), one slice past K (640 = 20 tiles
# in slices of 16), rows past N


def _pattern(n: int, k: int) -> torch.Tensor:
    """A random 2:4 matrix of small integers (each block keeps two positions, some of its values zero)."""
    w = torch.randint(-4, 5, (n, k), device="cuda").float().view(n, k // 4, 4)
    keep = torch.rand(n, k // 4, 4, device="cuda").argsort(-1)[..., :2]
    return (w * torch.zeros_like(w).scatter_(-1, keep, 1.0)).view(n, k).to(torch.bfloat16)


def _w4_case(n: int, k: int, m: int, group: int, zeros: bool):
    """Random 2:4 + INT4 operands (scales powers of two) and the reference output: (x, codes, meta, scales, zero
    points, reference)."""
    meta = compress_nm(_pattern(n, k)).meta
    codes = torch.randint(0, 256, (n, k // 4), device="cuda", dtype=torch.uint8)
    scales = (2.0 ** torch.randint(-2, 2, (n, k // group), device="cuda")).to(torch.bfloat16)
    z = torch.randint(0, 16, (n, k // group), device="cuda", dtype=torch.uint8) if zeros else None
    x = torch.randint(-3, 4, (m, k), device="cuda").to(torch.bfloat16)
    return x, codes, meta, scales, z, sparse24_w4a16_ref(x, codes, meta, scales, z, group).float()


def _verdict(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    """(bit for bit, the line's ending)."""
    if torch.equal(out, ref):
        return True, "exact"
    return False, f"MISMATCH (max {(out - ref).abs().max().item()}, {out.isnan().sum().item()} NaN)"


def check_plain(ws, *, kind: str) -> int:
    """Plain 2:4, tile by tile (``CASES``), in stripes (``STRIPE_CASES``, at most one block ahead) or with folded rows
    (``FOLD_CASES``), bit for bit."""
    bad = 0
    stripes = kind == "stripes"
    for n, k, m, kt, *stripe in {"tiles": CASES, "stripes": STRIPE_CASES, "fold": FOLD_CASES}[kind]:
        sp = compress_nm(_pattern(n, k))
        x = torch.randint(-3, 4, (m, k), device="cuda").to(torch.bfloat16)
        ref = sparse24_ref(x, sp.values, sp.meta).float()
        for warps, rb, depth in CONFIGS:
            kw = dict(n=n, tiles_per_slice=kt, row_blocks=rb, warps=warps, workspace=ws)
            torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed: the output lands on it
            if stripes:
                depth = min(depth, 1)  # at most one block ahead
                out = run_sparse_mma_stripe(x, sp.values.view(torch.int32), sp.meta, stripe=stripe[0], depth=depth,
                                            **kw)
            elif kind == "fold":
                out = run_sparse_mma_fold(x, sp.values.view(torch.int32), sp.meta, depth=depth, **kw)
            else:
                out = run_sparse_mma(x, sp.values.view(torch.int32), sp.meta, depth=depth, **kw)
            ok, verdict = _verdict(out.float(), ref)
            bad += not ok
            name = {"tiles": "", "stripes": f"2:4 stripes of {stripe[0] if stripe else 0} ",
                    "fold": "2:4 folded "}[kind]
            print(f"{name}N={n} K={k} M={m} tiles/slice={kt} warps={warps} row blocks={rb} ahead={depth}: {verdict}",
                  flush=True)
    return bad


def check_w4(ws, *, fold: bool = False) -> int:
    """2:4 + INT4 (``W4_CASES``), or with folded rows (``W4_FOLD_CASES``), bit for bit."""
    bad = 0
    run = run_sparse_mma_w4_fold if fold else run_sparse_mma_w4
    for n, k, m, kt, group, zeros in W4_FOLD_CASES if fold else W4_CASES:
        x, codes, meta, scales, z, ref = _w4_case(n, k, m, group, zeros)
        # with folded rows also warps along K, each taking the case's tiles ([Note: fold warps along K]), their sums
        # added a block at a time, or after the last block from shared memory or registers
        for warps, rb, depth, wk, late in [c + (1, 0) for c in CONFIGS] + (
                [c + (late,) for c in FOLD_K_CONFIGS for late in (0, 1, 2)] if fold else []):
            depth = min(depth, 1)  # the 2:4 + INT4 GEMVs load at most one block ahead
            along = {"k_warps": wk, "late_sums": late} if fold else {}
            torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed: the output lands on it
            out = run(x, codes.view(torch.int32), meta.view(torch.int16), scales, z, n=n, group=group,
                      tiles_per_slice=kt * wk, row_blocks=rb, warps=warps, depth=depth, workspace=ws,
                      **along).float()
            ok, verdict = _verdict(out, ref)
            bad += not ok
            print(f"2:4+INT4{' folded' if fold else ''} g{group} zeros={zeros} N={n} K={k} M={m} tiles/slice={kt * wk} "
                  f"warps={warps} along K={wk} late sums={late} row blocks={rb} ahead={depth}: {verdict}",
                  flush=True)
    return bad


GEMM_CASES = ((64, 256, 9, 2, 2, 1, 4, 1), (200, 1024, 16, 4, 2, 2, 4, 0), (1000, 1056, 23, 8, 4, 3, 4, 1),
              (96, 512, 40, 2, 8, 1, 8, 1), (1000, 8192, 64, 4, 8, 4, 8, 1), (2048, 8192, 130, 4, 8, 2, 4, 0),
              (1024, 4096, 33, 16, 2, 1, 4, 0), (1000, 8192, 64, 8, 8, 2, 8, 1), (1000, 1056, 23, 4, 4, 3, 4, 1, 2),
              (2048, 8192, 130, 2, 8, 2, 8, 1, 2), (200, 1024, 16, 4, 2, 2, 4, 1, 2))
# (N, K, M, tiles per chunk, groups of 8 rows of x, slices, warps, next chunk's weights loaded first[, blocks of 16
# weight rows a warp]) of the 2:4 GEMM
GEMM_W4_CASES = ((64, 256, 9, 4, 2, 1, 4, 1, 128, True), (200, 1024, 16, 4, 2, 2, 4, 0, 128, False),
                 (1000, 3072, 23, 8, 4, 3, 4, 1, 256, True), (96, 512, 40, 4, 8, 1, 8, 0, 128, True),
                 (1000, 8192, 64, 4, 8, 4, 8, 1, 128, True), (2048, 8192, 130, 4, 8, 2, 4, 0, 128, False),
                 (1000, 8192, 61, 8, 8, 2, 8, 1, 128, True), (1000, 3072, 23, 4, 4, 3, 4, 1, 256, True, 2),
                 (2048, 8192, 130, 4, 8, 2, 8, 1, 128, False, 2), (64, 256, 9, 4, 2, 1, 4, 1, 128, True, 2),
                 (200, 384, 20, 8, 4, 1, 4, 1, 128, True), (200, 320, 12, 2, 2, 1, 4, 1, 64, True),
                 (96, 448, 24, 4, 4, 2, 4, 0, 64, False, 2))
# (N, K, M, tiles per chunk, groups, slices, warps, next chunk loaded first, group of original columns, zero
# points[, blocks of 16 weight rows a warp]): stripes of 4 tiles for groups of 128 and 256 columns, of 2 for 64
# ([Note: INT4 stripes] in kernels/_sparse_mma_kernels.py); a chunk past K (384) and a partial last one (448)


def check_gemm(ws) -> int:
    """The 2:4 GEMM (9 rows of x and more), plain and + INT4, bit for bit."""
    bad = 0
    for n, k, m, kt, groups, split, warps, depth, *more in GEMM_CASES:
        blocks = more[0] if more else 1
        sp = compress_nm(_pattern(n, k))
        x = torch.randint(-3, 4, (m, k), device="cuda").to(torch.bfloat16)
        ref = sparse24_ref(x, sp.values, sp.meta).float()
        torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # freed: the output lands on it
        out = run_sparse_gemm(x, sp.values.view(torch.int32), sp.meta, n=n, tiles_per_chunk=kt, groups=groups,
                              split=split, warps=warps, depth=depth, blocks=blocks, workspace=ws).float()
        ok, verdict = _verdict(out, ref)
        bad += not ok
        print(f"GEMM N={n} K={k} M={m} tiles/chunk={kt} groups={groups} slices={split} warps={warps} ahead={depth} "
              f"blocks={blocks}: {verdict}", flush=True)
    for n, k, m, kt, groups, split, warps, depth, group, zeros, *more in GEMM_W4_CASES:
        blocks = more[0] if more else 1
        x, codes, meta, scales, z, ref = _w4_case(n, k, m, group, zeros)
        torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = run_sparse_gemm_w4(x, codes.view(torch.int32), meta.view(torch.int16), scales, z, n=n, group=group,
                                 tiles_per_chunk=kt, groups=groups, split=split, warps=warps, depth=depth,
                                 blocks=blocks, workspace=ws).float()
        ok, verdict = _verdict(out, ref)
        bad += not ok
        print(f"GEMM 2:4+INT4 g{group} zeros={zeros} N={n} K={k} M={m} tiles/chunk={kt} groups={groups} slices={split} "
              f"warps={warps} ahead={depth} blocks={blocks}: {verdict}", flush=True)
    return bad


def main() -> int:
    torch.manual_seed(0)
    bad = 0
    ws = _word._stationary_workspace(torch.device("cuda"))
    if sys.argv[1:] in (["--stripes"], ["--fold"], ["--w4-fold"]):  # one kind alone
        bad = check_w4(ws, fold=True) if sys.argv[1] == "--w4-fold" else check_plain(ws, kind=sys.argv[1][2:])
        print("all exact" if not bad else f"{bad} mismatches")
        return 1 if bad else 0
    for kind in ("tiles", "stripes", "fold"):
        bad += check_plain(ws, kind=kind)
    bad += check_w4(ws)
    bad += check_w4(ws, fold=True)
    bad += check_gemm(ws)
    print("all exact" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
