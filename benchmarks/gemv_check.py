"""The GEMV kernels of the ``gemv`` path side by side at a few rows: tile, x-stationary, x-stationary + TMA, and for
2:4 (plain and + INT4) the kernels on sparse tensor cores (mma: the GEMV up to 8 rows, the GEMM above), for INT4
the GEMV on tensor cores (dense, up to 8 rows; ``dense_xs`` its configs that keep ``x`` in shared memory, [Note: x in
shared memory] in kernels/_dense_mma_kernels.py, ``dense`` the others, ``dense_fold`` the kernel with folded rows, up
to 4 rows); and at 9 to 16 rows, the ``wdot`` path's tiled kernels (``wdot``) beside the INT4 GEMV on ``wgmma``
(``wgmma``, [Note: INT4 GEMV on wgmma] in kernels/_stripe_wgmma_kernels.py), which that path tunes together.

    python benchmarks/gemv_check.py [--ms 1 4] [--shapes 8192x8192 8192x28672 28672x8192] [--formats w4 w8 s24]
                                    [--kinds tile stationary tma mma mma_stripe mma_fold dense dense_xs dense_fold
                                             wdot wgmma]
                                    [--late-sums 1 2] [--balanced] [--jobs N] [--json F]

For each shape (K x N), format (INT4 g128 with zero points, INT8, plain 2:4 by magnitude) and row count:
checks each kernel against the reference, tunes each over its own candidates ([Note: kernel tuning] in
kernels/_word.py), and prints the best time of each beside cuBLAS bf16 in the same process, as speed-ups over
bf16 (CUDA graphs, L2 flushed before each call: kernels/_runtime.py graph_time_ms). The mma kind checks every
config (and so does dense), each output on memory that was just filled with NaN, so an element left unwritten fails
the check.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from zspeed.compress import quantize_int4, quantize_int8
from zspeed.compress.nm import compress_nm, prune_nm
from zspeed.kernels import _dense_mma, _sparse_mma, _word, sparse24_ref, sparse24_w4a16_ref, w4a16_ref, w8a16_ref
from zspeed.kernels._runtime import graph_time_ms, m_bucket

from _jobs import parse_shard, quantizing, run_shares  # benchmarks/_jobs.py


def _shape(text: str) -> tuple[int, int]:
    k, n = text.lower().split("x")
    return int(k), int(n)


# kinds whose every config is checked, on NaN-filled memory
NAN_CHECKED = ("mma", "mma_stripe", "mma_fold", "dense", "dense_xs", "dense_fold", "wgmma")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", type=int, nargs="*", default=[1, 4])
    p.add_argument("--shapes", type=_shape, nargs="*", default=[(8192, 8192), (8192, 28672), (28672, 8192)])
    p.add_argument("--formats", nargs="*", default=["w4", "w8"], choices=["w4", "w8", "s24", "s24w4"])
    p.add_argument("--kinds", nargs="*", default=["tile", "stationary", "tma"],
                   choices=["tile", "stationary", "tma", "mma", "mma_stripe", "mma_fold", "dense", "dense_xs",
                            "dense_fold", "wdot", "wgmma"])
    p.add_argument("--late-sums", type=int, nargs="*", default=list(_word.FOLD_LATE_SUMS), choices=[1, 2],
                   help="with warps along K and folded rows (dense_fold, mma_fold), the ways of adding the warps' sums "
                        "after the last block to time beside a block at a time: 1 shared memory, 2 registers")
    p.add_argument("--balanced", action=argparse.BooleanOptionalAction, default=None,
                   help="dense_fold: also the runs of row blocks that spread them evenly over the SMs ([Note: balanced "
                   "runs] in kernels/_dense_mma_kernels.py); default: as the tuner, _word.FOLD_BALANCED")
    p.add_argument("--jobs", type=int, default=1,
                   help="first compile every config in this many processes at once, each a share, so that the checks "
                        "and timing here find them in Triton's disk cache (compiling is most of a run's time)")
    p.add_argument("--shard", help=argparse.SUPPRESS)  # "i/N": compile share i of N and exit (a --jobs process)
    p.add_argument("--json")
    args = p.parse_args()
    late = tuple(args.late_sums)
    shard = parse_shard(args.shard) if args.shard else None
    if args.jobs > 1 and shard is None:
        _precompile(args)
    if shard is None:
        print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for k, n in args.shapes:
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        for fmt in args.formats:
            with quantizing(shard, "gemv-check"):
                if fmt == "w4":
                    q = quantize_int4(w, group_size=128, scale_dtype=torch.bfloat16)
                    f, s, z, group = _word.FMT_W4, q.scales, q.zeros, 128
                    ref_fn = lambda x, q=q: w4a16_ref(x, q.qweight, q.scales, q.zeros, 128)  # noqa: E731
                elif fmt == "w8":
                    q = quantize_int8(w, scale_dtype=torch.bfloat16)
                    f, s, z, group = _word.FMT_W8, q.scales, None, 0
                    ref_fn = lambda x, q=q: w8a16_ref(x, q.qweight, q.scales)  # noqa: E731
                if fmt in ("s24", "s24w4"):
                    sp = compress_nm(prune_nm(w, w.abs(), n=2, m=4))
                if fmt == "s24":
                    words, meta = _word.word_view(_word.FMT_S24, sp.values, sp.meta, k)
                    f, s, z, group = _word.FMT_S24, sp.values, None, 1
                    ref_fn = lambda x, sp=sp: sparse24_ref(x, sp.values, sp.meta)  # noqa: E731
                elif fmt == "s24w4":  # 64 kept values = 128 original columns a group, as bench_kernels.py
                    v4 = quantize_int4(sp.values, group_size=64, scale_dtype=torch.bfloat16)
                    words, meta = _word.word_view(_word.FMT_S24W4, v4.qweight, sp.meta, k)
                    f, s, z, group = _word.FMT_S24W4, v4.scales, v4.zeros, 128
                    ref_fn = lambda x, v4=v4, sp=sp: sparse24_w4a16_ref(x, v4.qweight, sp.meta, v4.scales,  # noqa: E731
                                                                        v4.zeros, 128)
                else:
                    words, meta = q.qweight.view(torch.int32), None
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                base = graph_time_ms(lambda: F.linear(x, w)) if shard is None else 0.0
                ref = ref_fn(x).float()
                row = {"k": k, "n": n, "format": fmt, "m": m, "bf16_us": base * 1e3}
                stationary = _word.stationary_candidates(f, m, n, words.shape[1], group, x.device)
                mma = f == _word.FMT_S24 and _sparse_mma.sparse_mma_fits(x, words, sp.meta)
                mma_w4 = f == _word.FMT_S24W4 and _sparse_mma.sparse_mma_w4_fits(x, words, meta, s, z, group=group)
                gemm = m > _sparse_mma.MAX_M and f in (_word.FMT_S24, _word.FMT_S24W4) and _sparse_mma.sparse_gemm_fits(
                    x, words, sp.meta if f == _word.FMT_S24 else meta, w4=f == _word.FMT_S24W4, s=s, z=z, group=group)
                wdot = [], None  # the wdot path's candidates (with the GEMV on wgmma at 9-16 rows) and launch
                if f in (_word.FMT_W4, _word.FMT_W8) and {"wdot", "wgmma"} & set(args.kinds):
                    wdot = _word.wdot_launcher(x, words, s, z, fmt=f, group=group, n=n, k=k)[1:]
                dense = _word.dense_mma_w4_candidates(m, n, k, x.device) if f == _word.FMT_W4 \
                    and _dense_mma.dense_mma_w4_fits(x, words, s, z, group=group) else []
                kinds = {"tile": _word.gemv_candidates(f, m, n, words.shape[1], group, x.device),
                         "stationary": [c for c in stationary if not c.tma],
                         "tma": [c for c in stationary if c.tma],  # [Note: TMA weight stream]
                         "mma": _word.sparse_mma_candidates(m, n, k, x.device) if mma else
                         _word.sparse_mma_w4_candidates(m, n, k, group, x.device) if mma_w4
                         else _word.sparse_gemm_candidates(m, n, k, x.device, _sparse_mma.w4_stripe(group)
                                                           if f == _word.FMT_S24W4 else 1) if gemm
                         else [],
                         "dense": [c for c in dense if not c.x_shared], "dense_xs": [c for c in dense if c.x_shared],
                         "dense_fold": _word.dense_mma_w4_fold_candidates(m, n, k, x.device, late=late,
                                                                         balanced=args.balanced)
                         if dense and m <= 4
                         else [],  # [Note: INT4 GEMV with folded rows]
                         "mma_stripe": [c for c in _word.sparse_mma_stripe_candidates(m, n, k, x.device)
                                        if _sparse_mma.sparse_mma_stripe_fits(x, words, sp.meta, c.stripe)]
                         if mma else [],  # [Note: 2:4 stripes]
                         "mma_fold": _word.sparse_mma_fold_candidates(m, n, k, x.device)
                         if mma and _sparse_mma.sparse_mma_fold_fits(x, words, sp.meta)
                         else _word.sparse_mma_w4_fold_candidates(m, n, k, x.device, late=late)
                         if mma_w4 and _sparse_mma.sparse_mma_w4_fold_fits(x, words, meta, s, z, group=group)
                         else [],  # [Note: 2:4 folded rows]
                         "wdot": [c for c in wdot[0] if not c.wgmma_chunk],
                         "wgmma": [c for c in wdot[0] if c.wgmma_chunk]}  # [Note: INT4 GEMV on wgmma]
                for kind, cands in kinds.items():
                    if not cands or kind not in args.kinds:
                        continue
                    def launch(c, kind=kind):
                        if kind in ("wdot", "wgmma"):
                            return wdot[1](c)
                        if c.dense_mma:
                            return _word.run_dense_mma(x, words, s, z, c, n=n, group=group)
                        if c.sparse_mma and f == _word.FMT_S24W4:
                            return _word.run_sparse_mma(x, words, meta, c, n=n, s=s, z=z, group=group)
                        if c.sparse_mma:
                            return _word.run_sparse_mma(x, words, sp.meta, c, n=n)
                        if c.row_blocks:
                            return _word.run_stationary(x, words, s, z, c, fmt=f, group=group, n=n, meta=meta)
                        _word._BEST.clear()
                        key = ("gemv", f, group, z is not None, m_bucket(m), n, k, x.dtype)
                        _word._BEST[key] = c
                        return _word.run_gemv(x, words, s, z, meta, fmt=f, group=group, n=n, k=k)
                    if shard is not None:  # compile this process's share and go on
                        _word.compile_candidates(cands[shard[0]::shard[1]], launch)
                        continue
                    def checked(c):
                        if kind in NAN_CHECKED:  # the output lands on NaN: unwritten elements fail
                            torch.full((m, n), float("nan"), device="cuda", dtype=x.dtype)
                        return ((launch(c).float() - ref).abs().max() / ref.abs().max()).item()
                    err = max(checked(c) for c in (cands if kind in NAN_CHECKED else cands[:2]))
                    start = time.perf_counter()
                    timed = _word.time_candidates(cands, launch)
                    best = cands[timed[0][1]]
                    tuning = time.perf_counter() - start
                    row[f"{kind}_runners_up"] = [(round(t * 1e3, 1), str(cands[i])) for t, i in timed[1:4]]
                    row[f"{kind}_timed"] = [(round(t * 1e3, 2), str(cands[i])) for t, i in timed]
                    ms = graph_time_ms(lambda: launch(best))
                    err = max(err, ((launch(best).float() - ref).abs().max() / ref.abs().max()).item())
                    row[f"{kind}_us"] = ms * 1e3
                    row[f"{kind}_x"] = base / ms
                    row[f"{kind}_err"] = err
                    row[f"{kind}_config"] = str(best)
                    print(f"{k}x{n} {fmt} M={m}: {kind:10s} {ms * 1e3:7.1f} us = {base / ms:.2f}x bf16 "
                          f"({base * 1e3:.1f} us); rel err {err:.1e}; tuned {len(cands)} in {tuning:.0f} s: {best}",
                          flush=True)
                if shard is not None:
                    continue
                rows.append(row)
                if args.json:  # after each row, so that a run cut short keeps what it measured
                    with open(args.json, "w") as fh:
                        json.dump(rows, fh, indent=1)


def _precompile(args: argparse.Namespace) -> None:
    """``--jobs``: this script again in ``args.jobs`` processes, each compiling its share of every config of the same
    shapes, formats, rows and kinds (Triton keeps the kernels in its disk cache); waits for them all."""
    same = ["--ms", *map(str, args.ms), "--shapes", *(f"{k}x{n}" for k, n in args.shapes), "--formats", *args.formats,
            "--kinds", *args.kinds, "--late-sums", *map(str, args.late_sums)]
    same += [] if args.balanced is None else ["--balanced" if args.balanced else "--no-balanced"]
    run_shares(__file__, same, args.jobs)


if __name__ == "__main__":
    main()
