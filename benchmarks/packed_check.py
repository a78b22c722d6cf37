"""INT4 `wdot` (the tensor-core path for 2-511 rows) beside cuBLAS bf16, with its exactness on one-hot rows.

    ZSPEED_TUNING_CACHE=0 ZSPEED_PACKED_DEQUANT=1 python benchmarks/packed_check.py [--ms 4 16 64 256]
    ZSPEED_TUNING_CACHE=0 ZSPEED_PACKED_DEQUANT=0 python benchmarks/packed_check.py      # the fp32 path, to compare
    python benchmarks/packed_check.py --x-dtype float16 --ms 128 256                     # fp16 activations
    python benchmarks/packed_check.py --groups 32 64 128 256 --symmetric --shapes 4096x4096  # other grids
    ZSPEED_TUNING_CACHE=0 python benchmarks/packed_check.py --groups 32 64 128 --symmetric \
        --shapes 4096x4096 4096x14336 --ms 4 16 64   # g32/g64: tiles spanning groups, packed

For each shape (K x N) and row count: INT4 g128 with zero points (``--groups``, ``--symmetric``: other grids),
scales in ``x``'s dtype (bf16, or fp16 with ``--x-dtype float16``; on the square shape also in the other one,
which keeps the fp32 path), timed with the L2 flushed in CUDA
graphs (kernels/_runtime.py graph_time_ms) beside ``F.linear`` in ``x``'s dtype in the same process. Exactness: rows of ``x``
that are one-hot pick columns of the weight, so the kernel's output must equal the reference's dequantized weight
bit for bit ([Note: packed INT4 dequantization] in kernels/_wmma_kernels.py). One JSON line per cell, with the
``PACKED`` the launcher chose (0: the fp32 path) and the tuned config; ``$OUT/packed_<mode>.json`` when ``OUT`` is
set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from zspeed.compress import quantize_int4
from zspeed.kernels import _word, w4a16_matmul
from zspeed.kernels._runtime import graph_time_ms, m_bucket

sys.path.insert(0, str(Path(__file__).parent))
from gemv_check import _shape  # noqa: E402  (the same "KxN" shape argument)


def cell(q, w: torch.Tensor, deq: torch.Tensor, m: int, g: torch.Generator) -> dict:
    k = w.shape[1]
    call = lambda xx: w4a16_matmul(xx, q.qweight, q.scales, q.zeros, q.group_size, path="wdot")  # noqa: E731
    cols = torch.randperm(k, device="cuda", generator=g)[:m]
    onehot = torch.zeros(m, k, device="cuda", dtype=w.dtype)
    onehot[torch.arange(m), cols] = 1
    want = deq[:, cols].t().contiguous()
    call(onehot)  # tunes: every candidate runs, and their outputs are freed
    poison = torch.full((m, w.shape[0]), float("nan"), device="cuda", dtype=w.dtype)
    del poison  # the next output most likely gets this block: an element the kernel leaves unwritten is NaN
    got = call(onehot)
    x = torch.randn(m, k, device="cuda", dtype=w.dtype, generator=g)
    ref = x.float() @ deq.float().t()
    err = ((call(x).float() - ref).norm() / ref.norm()).item()
    t_q, t_b = graph_time_ms(lambda: call(x)), graph_time_ms(lambda: F.linear(x, w))
    packed = _word.packed_dequant(_word.FMT_W4, x.dtype, q.scales.dtype, "cuda", q.group_size)
    key = ("wdot", _word.FMT_W4, q.group_size, q.zeros is not None, m_bucket(m), w.shape[0], k, x.dtype)
    config = _word.tuned().get(key + ((f"packed{packed}",) if packed else ()))  # the key run_wdot tunes
    return dict(m=m, exact=torch.equal(got, want), ndiff=(got != want).sum().item(), rel_err=err, us=t_q * 1e3,
                bf16_us=t_b * 1e3, speedup=t_b / t_q, packed=packed, config=str(config))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", type=int, nargs="*", default=[4, 16, 64, 256])
    p.add_argument("--shapes", type=_shape, nargs="*", default=[(8192, 8192), (8192, 28672), (28672, 8192)])
    p.add_argument("--groups", type=int, nargs="*", default=[128])
    p.add_argument("--symmetric", action="store_true", help="also the symmetric grid (no zero points)")
    p.add_argument("--x-dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="the activations' and bf16 baseline's dtype (default bfloat16)")
    args = p.parse_args()
    mode = os.environ.get("ZSPEED_PACKED_DEQUANT", "1")
    rows = []
    for k, n in args.shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        xdt = getattr(torch, args.x_dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(xdt)
        other = torch.float16 if xdt == torch.bfloat16 else torch.bfloat16  # scales not in x's dtype: fp32 path
        grids = [(gs, sym, sdt) for gs in args.groups for sym in ((False, True) if args.symmetric else (False,))
                 for sdt in ([xdt, other] if k == n else [xdt])]
        for group, symmetric, sdt in grids:
            q = quantize_int4(w, group_size=group, symmetric=symmetric, scale_dtype=sdt)
            deq = q.dequantize(torch.float32).to(xdt)  # rounded once, as the kernels must
            for m in args.ms:
                row = dict(mode=mode, x=args.x_dtype, k=k, n=n, group=group, symmetric=symmetric,
                           scales=str(sdt).removeprefix("torch."), **cell(q, w, deq, m, g))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"packed_{mode}.json"), "w") as f:
            json.dump(rows, f)
    bad = [r for r in rows if not r["exact"]]
    if bad:
        raise SystemExit(f"{len(bad)} cells differ from the reference bit for bit: {bad[:3]}")


if __name__ == "__main__":
    main()
