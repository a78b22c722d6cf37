"""The register-operand INT4 kernel ([Note: fragment wdot] in kernels/_fragment_kernels.py) against the
warp-specialized one, bit for bit: both dequantize ``(q - z) * s`` with one rounding and run the same ``wgmma``
steps in the same order, so their outputs must be identical. On an sm_90 GPU:

    python benchmarks/fragment_check.py [--small]

Odd row and column counts, split-K (2 and 3 slices: odd tile counts), symmetric and fp16, each also with paired
tiles ([Note: paired tiles]); every output on NaN-filled memory.
Then the tail split ([Note: tail split]): each tile it runs whole must equal the unsplit kernel's output and each
tile it splits the uniformly split kernel's, bit for bit. Then small blocks of ``x`` (8 to 64 rows), overlapped and
not, in ring slots of two tiles ([Note: slots of two tiles]) and with four MMA warp groups ([Note: four warp
groups at small M]), bit for bit, all near the fp32 reference. Then INT8 words ([Note: INT8 fragments]): the
plain, overlapped and paired schedules bit for bit, near the fp32 reference. Prints
one JSON line per case and ``ALL EXACT`` or the cases that differ.
"""
from __future__ import annotations

import argparse
import json

import torch

from zspeed.compress import quantize_int4, quantize_int8
from zspeed.kernels import _word
from zspeed.kernels._pipelined import run_fragment, run_specialized

CASES = [  # (K, N, M, block_m, split_k, symmetric, dtype)
    (8192, 8192, 256, 256, 1, False, torch.bfloat16),
    (8192, 8192, 200, 128, 1, False, torch.bfloat16),
    (4096 + 128, 1000, 77, 128, 1, False, torch.bfloat16),
    (8192, 4096, 300, 256, 2, False, torch.bfloat16),
    (28672, 8192, 256, 256, 2, False, torch.bfloat16),
    (8192, 8192, 100, 128, 3, False, torch.bfloat16),
    (8192, 8192, 512, 256, 1, True, torch.bfloat16),
    (4096, 14336, 256, 256, 1, False, torch.float16),
]

TAIL_CASES = [  # (K, N, M, block_m, split_k, whole tiles, symmetric, dtype)
    (8192, 28672, 512, 256, 2, 396, False, torch.bfloat16),  # what the tuner offers on 132 SMs
    (4096 + 128, 1000, 300, 128, 3, 16, False, torch.bfloat16),  # 24 tiles, odd edges
    (8192, 4096, 700, 256, 5, 3, True, torch.float16),  # 96 tiles
]

# one block of x as small as the rows allow, eight x and word buffers ([Note: fragment wdot at small M]): the plain
# and overlapped schedules and slots of two tiles bit for bit, all against the fp32 reference
SMALL_CASES = [  # (K, N, M, block_m, split_k, symmetric, dtype)
    (8192, 8192, 1, 8, 2, False, torch.bfloat16),
    (4096 + 128, 1000, 5, 8, 1, False, torch.bfloat16),
    (8192, 4096, 16, 16, 3, True, torch.bfloat16),
    (8192, 8192, 33, 64, 2, False, torch.float16),
    (28672, 8192, 64, 64, 2, False, torch.bfloat16),
]

# INT8 words ([Note: INT8 fragments]): plain, overlapped and paired schedules bit for bit, near the fp32 reference
INT8_CASES = [  # (K, N, M, block_m, split_k, MMA warp groups, dtype)
    (8192, 8192, 256, 256, 1, 2, torch.bfloat16),
    (4096 + 128, 1000, 77, 128, 3, 2, torch.bfloat16),
    (8192, 4096, 300, 256, 2, 2, torch.float16),
    (8192, 8192, 16, 16, 2, 4, torch.bfloat16),
    (4096 + 128, 1000, 5, 8, 1, 4, torch.float16),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="only the small blocks of x (and slots of two tiles)")
    args = p.parse_args()
    small = args.small  # (``args`` is reused below for each case's launch arguments)
    g = torch.Generator(device="cuda").manual_seed(0)
    bad = []
    for k, n, m, bm, sp, sym, dt in [] if args.small else CASES:
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.float32) * 0.02
        q = quantize_int4(w, group_size=128, symmetric=sym, scale_dtype=dt)
        words = q.qweight.view(torch.int32)
        x = torch.randn(m, k, device="cuda", generator=g).to(dt)
        ws = _word._stationary_workspace(x.device) if sp > 1 else None
        outs = []
        for fn, extra in ((run_fragment, {}), (run_specialized, dict(block_n=128))):
            torch.empty(m, n, device="cuda", dtype=dt).fill_(float("nan"))  # the block the output most likely gets
            outs.append(fn(x, words, q.scales, q.zeros, group=128, n=n, k=k, block_m=bm, stages=4, q_stages=8,
                           split_k=sp, workspace=ws, **extra))
        paired = run_fragment(x, words, q.scales, q.zeros, group=128, n=n, k=k, block_m=bm, stages=4, q_stages=8,
                              split_k=sp, workspace=ws, pair=True)  # [Note: paired tiles]: the same sums
        ref = x.float() @ q.dequantize(torch.float32).to(dt).float().t()
        overlapped = run_fragment(x, words, q.scales, q.zeros, group=128, n=n, k=k, block_m=bm, stages=4,
                                  q_stages=8, split_k=sp, workspace=ws, overlap=True)  # [Note: overlapped fragments]
        diff = int((outs[0] != outs[1]).sum()) + int((paired != outs[0]).sum()) + int((overlapped != outs[0]).sum())
        err = ((outs[0].float() - ref).norm() / ref.norm()).item()
        row = dict(k=k, n=n, m=m, block_m=bm, split_k=sp, symmetric=sym, dtype=str(dt), ndiff=diff,
                   nan=bool(outs[0].isnan().any()), rel_err=err)
        print(json.dumps(row), flush=True)
        if diff or row["nan"] or not err < 1e-2:
            bad.append(row)
    for k, n, m, bm, sp, whole, sym, dt in [] if args.small else TAIL_CASES:
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.float32) * 0.02
        q = quantize_int4(w, group_size=128, symmetric=sym, scale_dtype=dt)
        words = q.qweight.view(torch.int32)
        x = torch.randn(m, k, device="cuda", generator=g).to(dt)
        tiles_n, tiles_m = -(-n // 128), -(-m // bm)
        # room for the uniform split's partials (every tile), past the tuner's workspace for the large case
        ws = (torch.empty(tiles_n * tiles_m * sp * 128 * bm, device="cuda"),
              torch.zeros(2 * tiles_n * tiles_m, device="cuda", dtype=torch.int32))
        args = dict(group=128, n=n, k=k, block_m=bm, stages=4, q_stages=8, workspace=ws)
        torch.empty(m, n, device="cuda", dtype=dt).fill_(float("nan"))
        got = run_fragment(x, words, q.scales, q.zeros, split_k=sp, whole=whole, pair=True, **args)
        one = run_fragment(x, words, q.scales, q.zeros, split_k=1, **args)
        split = run_fragment(x, words, q.scales, q.zeros, split_k=sp, whole=0, **args)
        tile = ((torch.arange(m, device="cuda") // bm)[:, None] * tiles_n
                + (torch.arange(n, device="cuda") // 128)[None, :])  # each output element's tile number
        want = torch.where(tile < whole, one, split)
        diff = int((got != want).sum())
        row = dict(k=k, n=n, m=m, block_m=bm, split_k=sp, whole=whole, tiles=tiles_n * tiles_m, symmetric=sym,
                   dtype=str(dt), ndiff=diff, nan=bool(got.isnan().any()),
                   split_differs=int((one != split).sum()))  # > 0: the check can tell the two apart
        print(json.dumps(row), flush=True)
        if diff or row["nan"] or not row["split_differs"]:
            bad.append(row)
    for k, n, m, bm, sp, sym, dt in SMALL_CASES:  # [Note: fragment wdot at small M]
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.float32) * 0.02
        q = quantize_int4(w, group_size=128, symmetric=sym, scale_dtype=dt)
        words = q.qweight.view(torch.int32)
        x = torch.randn(m, k, device="cuda", generator=g).to(dt)
        ws = _word._stationary_workspace(x.device) if sp > 1 else None
        args = dict(group=128, n=n, k=k, block_m=bm, stages=8, q_stages=8, split_k=sp, workspace=ws)
        torch.empty(m, n, device="cuda", dtype=dt).fill_(float("nan"))
        plain = run_fragment(x, words, q.scales, q.zeros, **args)
        overlapped = run_fragment(x, words, q.scales, q.zeros, overlap=True, **args)
        # [Note: slots of two tiles]: the same tiles in the same order; K is sliced in whole slots, so where that
        # moves a slice's bounds (128 tiles in three slices: 43, 43, 42 tiles or 44, 44, 40) the partials differ
        slots = run_fragment(x, words, q.scales, q.zeros, overlap=True, sub=2, **{**args, "stages": 3, "q_stages": 3})
        # [Note: four warp groups at small M]: other programs, the same sums for every row
        four = run_fragment(x, words, q.scales, q.zeros, overlap=True, warp_groups=4, **args)
        same_slices = -(-(k // 64) // sp) == 2 * -(-(k // 128) // sp)
        ref = x.float() @ q.dequantize(torch.float32).to(dt).float().t()
        err = max(((o.float() - ref).norm() / ref.norm()).item() for o in (overlapped, slots))
        row = dict(k=k, n=n, m=m, block_m=bm, split_k=sp, symmetric=sym, dtype=str(dt), same_slices=same_slices,
                   ndiff=int((plain != overlapped).sum()) + int((four != overlapped).sum())
                   + (int((slots != overlapped).sum()) if same_slices else 0),
                   slots_ndiff=int((slots != overlapped).sum()),
                   nan=bool(overlapped.isnan().any() or slots.isnan().any() or four.isnan().any()), rel_err=err)
        print(json.dumps(row), flush=True)
        if row["ndiff"] or row["nan"] or not err < 1e-2:
            bad.append(row)
    for k, n, m, bm, sp, nwg, dt in [] if small else INT8_CASES:  # [Note: INT8 fragments]
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.float32) * 0.02
        q = quantize_int8(w, scale_dtype=torch.bfloat16)
        words = q.qweight.view(torch.int32)
        x = torch.randn(m, k, device="cuda", generator=g).to(dt)
        ws = _word._stationary_workspace(x.device) if sp > 1 else None
        args8 = dict(group=64, n=n, k=k, block_m=bm, stages=4, q_stages=8, split_k=sp,
                     workspace=ws, warp_groups=nwg, int8=True)
        torch.empty(m, n, device="cuda", dtype=dt).fill_(float("nan"))
        plain = run_fragment(x, words, q.scales, None, **args8)
        overlapped = run_fragment(x, words, q.scales, None, overlap=True, **args8)
        paired = run_fragment(x, words, q.scales, None, pair=True, **args8) if nwg == 2 else overlapped
        ref = x.float() @ q.dequantize(torch.float32).t()  # the scale on the sums: against fp32 weights
        err = ((overlapped.float() - ref).norm() / ref.norm()).item()
        row = dict(int8=True, k=k, n=n, m=m, block_m=bm, split_k=sp, warp_groups=nwg, dtype=str(dt),
                   ndiff=int((plain != overlapped).sum()) + int((paired != overlapped).sum()),
                   nan=bool(plain.isnan().any() or overlapped.isnan().any()), rel_err=err)
        print(json.dumps(row), flush=True)
        if row["ndiff"] or row["nan"] or not err < 1e-2:
            bad.append(row)
    print("ALL EXACT" if not bad else f"DIFFER: {bad}")


if __name__ == "__main__":
    main()
