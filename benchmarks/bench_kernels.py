"""GPU benchmark: zspeed's Triton matmuls over compressed weights vs cuBLAS bf16 and peers.

    python benchmarks/bench_kernels.py            # all shapes, M in {1,4,16,64,256,4096}; ~3-4 min on an H100
    python benchmarks/bench_kernels.py --quick    # one shape
    python benchmarks/bench_kernels.py --dry-run  # CPU, Triton interpreter, tiny shapes: checks the script only

For each weight shape ``K x N`` (in x out) and each number of rows ``M`` it times,
inside CUDA graphs with the L2 flushed before every call (GPU time per call, host
launch cost excluded: kernels/_runtime.py, [Note: timing small kernels]):
cuBLAS bf16 (``F.linear``), zspeed W4A16 (INT4 g128, asymmetric), W8A16, 2:4
(bf16 kept values), 2:4 + INT4 (g128), each through every applicable path
(split-K / tiled / dequantize + cuBLAS) and through the default policy; torch's
``_weight_int4pack_mm`` (tinygemm, INT4 g128); ``to_sparse_semi_structured``
(cuSPARSELt/CUTLASS 2:4); bitsandbytes NF4 and LLM.int8() when importable.
Every kernel's output is checked against its reference before it is timed; a
failed check is reported, not timed. Prints speed-up over cuBLAS bf16 (higher is
better), checks the issue-5 targets, and writes JSON to ``$OUT/bench_kernels.json``
when ``OUT`` is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = [(8192, 8192), (8192, 28672), (28672, 8192)]  # (K in_features, N out_features)
MS = [1, 4, 16, 64, 256, 4096]
# M where a path is worth timing, per format (the generic split-K / tiled paths only where no word path runs)
_WORD = {"gemv": (1, 16), "wdot": (1, 4096), "dense": (64, 4096)}  # wdot at every M (tensor cores)
_SPARSE = {"gemv": (1, 16), "splitk": (4, 64), "tiled": (64, 1024), "dense": (64, 4096)}
PATH_RANGE = {"w4a16": _WORD, "w8a16": _WORD, "sparse24": {**_SPARSE, "semi": (64, 4096)}, "sparse24_w4a16": _SPARSE}
TARGETS = [("w4a16", 1, 3.0), ("w4a16", 16, 2.5), ("w4a16", 64, 1.0), ("w8a16", 1, 1.8), ("sparse24", 1, 1.5),
           ("sparse24", 4096, 1.0), ("sparse24_w4a16", 1, 4.0)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="only the 8192x8192 shape")
    p.add_argument("--ms", type=int, nargs="*", default=MS)
    p.add_argument("--no-paths", action="store_true", help="time only the default policy, not every path")
    p.add_argument("--rep", type=int, default=40, help="do_bench rep in ms (default 40)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: tiny shapes on the CPU under the Triton "
                   "interpreter, wall-clock timing (exercises the script, measures nothing)")
    return p.parse_args()


DEVICE = "cuda"


def bench(fn, rep: int) -> float:
    """GPU milliseconds of one ``fn()`` with a cold L2, in a CUDA graph (kernels/_runtime.py,
    [Note: timing small kernels]); ``do_bench`` (eager, host launch included) if ``fn`` cannot be captured."""
    if DEVICE == "cpu":  # --dry-run
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]
    from zspeed.kernels._runtime import graph_time_ms

    try:
        return graph_time_ms(fn, reps=max(5, rep // 2))
    except Exception as e:  # noqa: BLE001  (a peer that cannot run inside a graph)
        print(f"  [eager timing] {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
        torch.cuda.synchronize()
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


# -- weights in every format ---------------------------------------------------------------------------------------
def make_weights(k: int, n: int) -> dict:
    from zspeed.compress import compress_nm, prune_nm, quantize_int4, quantize_int8

    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * 0.02).to(torch.bfloat16)
    q4 = quantize_int4(w, group_size=128, scale_dtype=torch.bfloat16)
    q8 = quantize_int8(w, scale_dtype=torch.bfloat16)
    nm = compress_nm(prune_nm(w, w.abs()))
    v4 = quantize_int4(nm.values, group_size=64, scale_dtype=torch.bfloat16)  # 64 kept = 128 original columns
    return {"dense": w, "q4": q4, "q8": q8, "nm": nm, "v4": v4, "pruned": nm.dequantize(torch.bfloat16)}


def zspeed_cases(wt: dict) -> dict:
    """name → (fn(x, path), reference fn(x)) for zspeed's four formats."""
    from zspeed import kernels as K

    q4, q8, nm, v4 = wt["q4"], wt["q8"], wt["nm"], wt["v4"]
    vals = nm.values.to(torch.bfloat16)
    return {
        "w4a16": (lambda x, p: K.w4a16_matmul(x, q4.qweight, q4.scales, q4.zeros, 128, path=p),
                  lambda x: K.w4a16_ref(x, q4.qweight, q4.scales, q4.zeros, 128)),
        "w8a16": (lambda x, p: K.w8a16_matmul(x, q8.qweight, q8.scales, path=p),
                  lambda x: K.w8a16_ref(x, q8.qweight, q8.scales)),
        "sparse24": (lambda x, p: K.sparse24_matmul(x, vals, nm.meta, path=p),
                     lambda x: K.sparse24_ref(x, vals, nm.meta)),
        "sparse24_w4a16": (lambda x, p: K.sparse24_w4a16_matmul(x, v4.qweight, nm.meta, v4.scales, v4.zeros, 128,
                                                                path=p),
                           lambda x: K.sparse24_w4a16_ref(x, v4.qweight, nm.meta, v4.scales, v4.zeros, 128)),
    }


def peer_cases(wt: dict) -> dict:
    """name → (fn(x), reference fn(x)) for peers; a peer that cannot be set up is left out (printed)."""
    cases = {}
    for name, build in (("tinygemm_int4", _tinygemm), ("semi_structured_24", _semi_structured),
                        ("bnb_nf4", _bnb_nf4), ("bnb_int8", _bnb_int8)):
        try:
            cases[name] = build(wt)
        except Exception as e:  # noqa: BLE001  (a missing or incompatible peer is reported, not fatal)
            print(f"  [skip] {name}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
    return cases


def _tinygemm(wt: dict):
    """torch's int4 tinygemm from the same INT4 g128 codes: w = (q - 8) * s + (8 - z) * s."""
    q4 = wt["q4"]
    codes = q4.codes().to(torch.int32)  # (N, K)
    packed_u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)  # tinygemm: even column in the high nibble
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    s = q4.scales.to(torch.bfloat16)  # (N, K/G)
    zf = ((8 - q4.zeros.float()) * q4.scales.float()).to(torch.bfloat16)
    sz = torch.stack([s, zf], dim=-1).transpose(0, 1).contiguous()  # (K/G, N, 2)
    ref_w = q4.dequantize(torch.bfloat16)
    return (lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, 128, sz), lambda x: F.linear(x, ref_w))


def _semi_structured(wt: dict):
    from torch.sparse import to_sparse_semi_structured

    pruned = wt["pruned"]
    sparse = to_sparse_semi_structured(pruned)
    return (lambda x: F.linear(x, sparse), lambda x: F.linear(x, pruned))


def _bnb_nf4(wt: dict):
    import bitsandbytes as bnb

    w = wt["dense"]
    lin = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(w.cpu(), requires_grad=False, quant_type="nf4", blocksize=64)
    lin = lin.cuda()
    return (lambda x: lin(x), lambda x: F.linear(x, w))


def _bnb_int8(wt: dict):
    import bitsandbytes as bnb

    w = wt["dense"]
    lin = bnb.nn.Linear8bitLt(w.shape[1], w.shape[0], bias=False, has_fp16_weights=False, threshold=6.0)
    lin.weight = bnb.nn.Int8Params(w.cpu(), requires_grad=False, has_fp16_weights=False)
    lin = lin.cuda()
    return (lambda x: lin(x), lambda x: F.linear(x, w))


# -- the run -------------------------------------------------------------------------------------------------------
CHECK_TOL = {"w4a16": 2e-2, "w8a16": 2e-2, "sparse24": 2e-2, "sparse24_w4a16": 2e-2,
             "tinygemm_int4": 2e-2, "semi_structured_24": 2e-2, "bnb_nf4": 0.15, "bnb_int8": 0.05}


EAGER_ONLY = {"bnb_int8"}  # its host-side work cannot be captured in a CUDA graph (and breaks the capture)


def timed(name: str, fn, ref, x, rep: int) -> dict:
    """Check ``fn(x)`` against ``ref(x)``, then time it."""
    try:
        err = rel_err(fn(x), ref(x))
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    if not err <= CHECK_TOL[name]:
        return {"error": f"wrong result: relative error {err:.3g}", "rel_err": err}
    if name in EAGER_ONLY and DEVICE == "cuda":
        from triton.testing import do_bench

        return {"ms": do_bench(lambda: fn(x), warmup=10, rep=rep, return_mode="median"), "rel_err": err,
                "timing": "eager (do_bench, host launch included)"}
    return {"ms": bench(lambda: fn(x), rep), "rel_err": err}


def run_shape(k: int, n: int, args) -> list[dict]:
    from zspeed.kernels import kernel_policy
    from zspeed.kernels._dense_mma import dense_mma_possible
    from zspeed.kernels._pipelined import pipelined_possible, specialized_possible
    from zspeed.kernels._sparse_mma import sparse_mma_possible

    wt = make_weights(k, n)
    ours, peers = zspeed_cases(wt), peer_cases(wt)
    rows = []
    for m in args.ms:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        base_ms = bench(lambda: F.linear(x, wt["dense"]), args.rep)
        row = {"K": k, "N": n, "M": m, "cublas_bf16_ms": base_ms, "results": {}}
        for name, (fn, ref) in ours.items():
            s24 = name == "sparse24"  # bf16 kept values on a GPU: sparse tensor cores where they run
            mma = name in ("sparse24", "sparse24_w4a16") and sparse_mma_possible(x.device)
            pipe = name in ("w4a16", "w8a16") and pipelined_possible(x.device, group=128 if name == "w4a16" else 64,
                                                                     k=k)  # the Hopper GEMM keeps wdot to 1023 rows
            frag = name == "w4a16" and specialized_possible(x.device, group=128, k=k)
            dense = name == "w4a16" and dense_mma_possible(x.device)  # the INT4 GEMV on tensor cores, to 8 rows
            chosen = kernel_policy().path(name, m, semi=s24, sparse_mma=mma, pipelined=pipe, fragment=frag,
                                          dense_mma=dense)
            row["results"][name] = {**timed(name, lambda x_: fn(x_, None), ref, x, args.rep), "path": chosen}
            if not args.no_paths:
                for path, (lo, hi) in PATH_RANGE[name].items():
                    if lo <= m <= hi and path != chosen:
                        row["results"][f"{name}[{path}]"] = timed(name, lambda x_, p=path: fn(x_, p), ref, x, args.rep)
        for name, (fn, ref) in peers.items():
            row["results"][name] = timed(name, fn, ref, x, args.rep)
        rows.append(row)
        print(_line(row), flush=True)
    del wt
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


COLUMNS = ["w4a16", "w8a16", "sparse24", "sparse24_w4a16", "tinygemm_int4", "semi_structured_24", "bnb_nf4",
           "bnb_int8"]


def _speedup(row: dict, name: str) -> str:
    r = row["results"].get(name)
    if r is None:
        return "-"
    if "ms" not in r:
        return "ERR"
    return f"{row['cublas_bf16_ms'] / r['ms']:.2f}x"


def _line(row: dict) -> str:
    cells = " ".join(f"{_speedup(row, c):>8s}" for c in COLUMNS)
    return f"{row['K']:>6d}x{row['N']:<6d} M={row['M']:<5d} bf16 {row['cublas_bf16_ms'] * 1e3:9.1f}us {cells}"


def print_report(rows: list[dict]) -> None:
    print("\nspeed-up over cuBLAS bf16 (higher is better); zspeed columns use the default path policy")
    print(f"{'shape':>13s} {'M':>7s} {'bf16':>11s} " + " ".join(f"{c[:8]:>8s}" for c in COLUMNS))
    for row in rows:
        print(_line(row))
    print("\nzspeed per path (speed-up over bf16; * = the policy's choice):")
    for row in rows:
        parts = []
        for name in ("w4a16", "w8a16", "sparse24", "sparse24_w4a16"):
            chosen = row["results"][name].get("path")
            cells = [f"{p}{'*' if p == chosen else ''}={_speedup(row, name if p == chosen else f'{name}[{p}]')}"
                     for p in PATH_RANGE[name] if p == chosen or f"{name}[{p}]" in row["results"]]
            parts.append(f"{name}: " + " ".join(cells))
        print(f"  {row['K']}x{row['N']} M={row['M']}: " + " | ".join(parts))
    errors = [(row["K"], row["N"], row["M"], k, r["error"]) for row in rows for k, r in row["results"].items()
              if "error" in r]
    for e in errors:
        print(f"  ERROR {e[0]}x{e[1]} M={e[2]} {e[3]}: {e[4]}")
    _check_targets(rows)
    from zspeed.kernels import _word

    print("\nword-kernel configs chosen by tuning (path, format, group, zeros, M bucket, N, K, dtype -> config):")
    for key, cfg in _word.tuned().items():
        print(f"  {key[:7]} -> {cfg}")


def _check_targets(rows: list[dict]) -> None:
    print("\nissue-5 targets (worst shape):")
    for name, m, want in TARGETS:
        got = [row["cublas_bf16_ms"] / row["results"][name]["ms"] for row in rows
               if row["M"] == m and "ms" in row["results"].get(name, {})]
        if got:
            verdict = "PASS" if min(got) >= want else "FAIL"
            print(f"  {name:15s} M={m:<5d} >= {want:.1f}x: worst {min(got):.2f}x {verdict}")
    floor = [row["cublas_bf16_ms"] / row["results"]["w4a16"]["ms"] for row in rows if "ms" in row["results"]["w4a16"]]
    if floor:
        print(f"  w4a16 every M   >= 0.9x: worst {min(floor):.2f}x {'PASS' if min(floor) >= 0.9 else 'FAIL'}")


def main() -> int:
    global DEVICE
    args = parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before zspeed first imports triton (kernels/_runtime.py)
        DEVICE, shapes, args.ms = "cpu", [(256, 96)], [m for m in (1, 16, 64) if m in args.ms] or [1]
    elif not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    start = time.perf_counter()
    print(f"device: {name}  torch {torch.__version__}", flush=True)
    print(f"{'shape':>13s} {'M':>7s} {'bf16':>11s} " + " ".join(f"{c[:8]:>8s}" for c in COLUMNS), flush=True)
    rows = []
    for k, n in shapes:
        rows += run_shape(k, n, args)
    print_report(rows)
    print(f"\ntotal {time.perf_counter() - start:.0f}s")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "bench_kernels.json"
        out.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
