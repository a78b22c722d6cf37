"""GPU check: how consistently the kernel tuner picks, with and without its finalist round.

    python benchmarks/tuner_check.py [--shapes 4096x4096 ...] [--formats w4 w8] [--ms 1] [--repeats 3] [--json F]

For each shape, format and row count the real tuner (``_word.run_gemv``: every kind of GEMV config the path offers)
tunes the key ``--repeats`` times with the first pass alone (``FINALISTS = 0``) and as many times with the finalists
timed again ([Note: finalists] in kernels/_word.py), alternating, in one process, the tuning cache off. Every config
picked is then timed again, with cuBLAS bf16, all of them in interleaved rounds (50 calls a graph, L2 flushed before
each). A tuner that picks consistently picks the same config, or configs of the same time, every time; the report
gives each way's picks, the spread of their times, their speed-up over bf16 and the time it took to tune. Kernels are
compiled at the first tuning, or first in ``--jobs N`` processes, each its share of every key's candidates.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

DECODE_SHAPES = ("4096x6144", "4096x4096", "4096x28672", "14336x4096", "4096x128256")


def spread(times: list[float]) -> dict:
    """Summary of the times (us) of one way's picks: best, worst, and how far the worst is over the best."""
    return {"best_us": min(times), "worst_us": max(times), "worst_over_best": max(times) / min(times) - 1.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=list(DECODE_SHAPES), help="KxN")
    p.add_argument("--formats", nargs="*", default=["w4"], choices=["w4", "w8"])
    p.add_argument("--ms", nargs="*", type=int, default=[1])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--jobs", type=int, default=1, help="first compile every candidate in this many processes")
    p.add_argument("--shard", help=argparse.SUPPRESS)  # "i/N": compile share i of N and exit (a --jobs process)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("tuner_check needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("ZSPEED_TUNING_CACHE", "0")  # every tuning times the candidates (read at the first one)
    from zspeed.compress import quantize_int4, quantize_int8
    from zspeed.kernels import _word
    from zspeed.kernels._runtime import graph_time_ms

    from _jobs import parse_shard, quantizing, run_shares, tune_by_compiling_share  # benchmarks/_jobs.py

    shard = parse_shard(args.shard) if args.shard else None
    if shard:  # a --jobs process: each tuning compiles this share of its candidates and goes on with the first
        tune_by_compiling_share(shard)
    elif args.jobs > 1:
        same = ["--shapes", *args.shapes, "--formats", *args.formats, "--ms", *map(str, args.ms)]
        run_shares(__file__, same, args.jobs)
    ways = {"first pass": 0, "finalists": _word.FINALISTS}
    rows = []
    if not shard:
        print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        for fmt in args.formats:
            with quantizing(shard, "tuner-check"):  # the --jobs processes one at a time (the head: several GB)
                if fmt == "w4":
                    q = quantize_int4(w, group_size=128, scale_dtype=torch.bfloat16)
                    f, s, z, group = _word.FMT_W4, q.scales, q.zeros, 128
                else:
                    q = quantize_int8(w, scale_dtype=torch.bfloat16)
                    f, s, z, group = _word.FMT_W8, q.scales, None, 0
            words = q.qweight.view(torch.int32)
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

                def gemv():
                    return _word.run_gemv(x, words, s, z, None, fmt=f, group=group, n=n, k=k)

                if shard:
                    _word._tuning_cache.cache_clear()
                    gemv()
                    continue

                picks = {name: [] for name in ways}
                tuning_s = {name: [] for name in ways}
                key = None
                for _ in range(args.repeats):
                    for name, finalists in ways.items():
                        _word._BEST.clear()
                        _word._tuning_cache.cache_clear()  # off on disk, but it remembers in memory
                        _word.FINALISTS = finalists
                        start = time.perf_counter()
                        gemv()
                        torch.cuda.synchronize()
                        tuning_s[name].append(time.perf_counter() - start)
                        (key, config), = _word.tuned().items()
                        picks[name].append(config)
                distinct = list(dict.fromkeys(c for cs in picks.values() for c in cs))
                again: dict = {c: [] for c in [*distinct, "bf16"]}
                for r in range(3):  # every pick and cuBLAS bf16 timed again, interleaved, the median of 3 rounds
                    for c in ([*distinct, "bf16"] if r % 2 == 0 else ["bf16", *distinct[::-1]]):
                        if c == "bf16":
                            again[c].append(graph_time_ms(lambda: F.linear(x, w), reps=50, trials=7) * 1e3)
                            continue
                        _word._BEST.clear()
                        _word._BEST[key] = c
                        again[c].append(graph_time_ms(gemv, reps=50, trials=7) * 1e3)
                us = {c: statistics.median(ts) for c, ts in again.items()}
                row = {"k": k, "n": n, "format": fmt, "m": m, "bf16_us": us["bf16"],
                       "configs": {str(c): us[c] for c in distinct}}
                for name in ways:
                    times = [us[c] for c in picks[name]]
                    row[name] = {"picks_us": times, "tuning_s": tuning_s[name], **spread(times),
                                 "best_x": us["bf16"] / min(times), "worst_x": us["bf16"] / max(times)}
                    print(f"{k}x{n} {fmt} M={m} {name:10s}: picks {' '.join(f'{t:6.2f}' for t in times)} us "
                          f"({row[name]['worst_x']:.2f}-{row[name]['best_x']:.2f}x bf16's {us['bf16']:.1f} us); "
                          f"worst {row[name]['worst_over_best'] * 100:4.1f} % over best; tuning "
                          f"{statistics.median(tuning_s[name]):5.1f} s", flush=True)
                rows.append(row)
                if args.json:
                    with open(args.json, "w") as fh:
                        json.dump(rows, fh, indent=1)
    if not shard:
        _word.FINALISTS = ways["finalists"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
