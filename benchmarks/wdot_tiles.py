"""Every tile of the full-depth `wdot` kernel timed alone, beside cuBLAS bf16: which tiles the tuner should offer.

    python benchmarks/wdot_tiles.py                          # INT4 g128, 16 / 64 / 256 rows, the three shapes
    python benchmarks/wdot_tiles.py --formats w8 --ms 256    # INT8
    python benchmarks/wdot_tiles.py --only-tuned             # just the tuner's own candidates (`FULL_TILES`)

For each shape (K x N) and row count, the tuner's candidates (``_word.full_depth_candidates``: ``FULL_TILES``
with their split-K and scales-ahead variants) and the ``TRIAL_TILES`` below, each timed alone in CUDA graphs
with the L2 flushed (kernels/_runtime.py ``graph_time_ms``) and its output checked against the dequantized
weight. One JSON line per config, then per cell the best of the tuner's set and the best of all, as speed-ups
over ``F.linear`` in bf16 timed in the same process. ``$OUT/wdot_tiles.json`` when ``OUT`` is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from zspeed.compress import quantize_int4, quantize_int8
from zspeed.kernels import _word
from zspeed.kernels._runtime import cdiv, graph_time_ms, m_bucket

sys.path.insert(0, str(Path(__file__).parent))
from gemv_check import _shape  # noqa: E402  (the same "KxN" shape argument)

# (BM, BN, warps, stages, swap, columns per tile), by the row bucket they are tried at: tiles that are not (yet)
# the tuner's, e.g. shallower ones that leave room for two or more programs per SM ([Note: tile depth] in _word)
TRIAL_TILES = {
    16: ((16, 64, 4, 4, False, 64), (16, 128, 4, 4, False, 64), (16, 64, 4, 4, True, 64), (16, 128, 4, 4, True, 64),
         (16, 64, 4, 6, False, 64), (16, 128, 4, 6, True, 64)),
    64: ((64, 64, 4, 3, False, 128), (64, 64, 4, 3, False, 64), (64, 128, 4, 3, False, 64),
         (64, 128, 4, 4, False, 64), (64, 64, 4, 4, True, 64), (64, 128, 8, 3, True, 64), (64, 256, 8, 3, False, 64)),
    256: ((128, 64, 4, 2, False, 128), (128, 64, 4, 3, False, 64), (128, 64, 4, 4, False, 64),
          (128, 128, 8, 3, False, 64), (128, 128, 8, 2, False, 128), (256, 64, 8, 3, False, 64),
          (256, 128, 8, 2, False, 64), (64, 128, 4, 3, False, 64), (64, 64, 4, 3, False, 128),
          (64, 64, 4, 4, False, 64)),
}


def trial_configs(fmt: int, m: int, n: int, kw: int, group: int, packed: int, sms: int) -> list[_word.WordConfig]:
    tiles = TRIAL_TILES.get(max(16, min(256, m_bucket(m))), ())
    out = []
    for bm, bn, warps, stages, swap, cols in tiles:
        bw = _word._full_block_w(fmt, group, cols)
        if bw is None:
            continue
        for sp in _word._splits(cdiv(m, bm) * cdiv(n, bn), cdiv(kw, bw), sms, (1, 4)):
            out.append(_word.WordConfig(bm, bn, bw, sp, warps, stages, full_depth=True, order=3, swap=swap,
                                        fixup=sp > 1 and _word._fixup_fits(m, n, sp, bm, bn)))
    if packed and m_bucket(m) >= 64:
        out += [replace(c, scales_ahead=True) for c in out]
    return out


def pipelined_configs(m: int, n: int, kw: int, sms: int) -> list[_word.WordConfig]:
    """Tiles of the pipelined Gluon kernel ([Note: pipelined wdot] in kernels/_pipelined_kernels.py) below the rows
    where the tuner offers it (``_word.PIPELINED_MIN_M``), each with split-K to fill the GPU once or four times."""
    mb = max(16, min(256, m_bucket(m)))
    if mb >= _word.PIPELINED_MIN_M:
        return []
    out = []
    for bn, xs, qs in ((64, 4, 8), (64, 6, 16), (128, 4, 8)):
        progs = cdiv(m, mb) * cdiv(n, bn)
        for sp in _word._splits(progs, kw // 8, sms, (1, 4)):
            if sp == 1 or _word._fixup_fits(m, n, sp, mb, bn):
                out.append(_word.WordConfig(mb, bn, 8, sp, bn // 16, xs, qs, full_depth=True, order=3,
                                            pipelined=True, fixup=sp > 1))
    return out


# (BM, BN, x buffers, dequantized buffers, dequantizing warps) of the warp-specialized kernel ([Note:
# warp-specialized wdot] in kernels/_specialized_kernels.py) beyond the tuner's (``_word.SPECIALIZED_TILES``); 16
# warps (BN 128 with 8 dequantizing warps) leave 128 registers a thread, too few for a 64 x 256 accumulator, so 8
# dequantizing warps come with BM 128 only
SPECIALIZED_TRIALS = ((256, 128, 4, 3, 4), (128, 128, 4, 2, 4), (128, 128, 6, 3, 4), (128, 128, 4, 2, 8),
                      (128, 128, 6, 3, 8), (256, 64, 4, 3, 4),  # kernels run 80
                      (256, 64, 5, 2, 4), (256, 64, 6, 2, 4), (256, 128, 5, 2, 4), (256, 64, 4, 2, 8),
                      (256, 64, 6, 2, 8))  # run 82


def specialized_configs(m: int, n: int, kw: int, sms: int) -> list[_word.WordConfig]:
    """The warp-specialized kernel's trial tiles, from 128 rows, whole and split just under one wave."""
    saved = _word.SPECIALIZED_TILES
    try:
        _word.SPECIALIZED_TILES = tuple(t for t in SPECIALIZED_TRIALS if t[0] <= max(128, m_bucket(m)))
        return _word.specialized_candidates(m, n, kw, sms)
    finally:
        _word.SPECIALIZED_TILES = saved


# (BM, x buffers) of the kernel that dequantizes into the wgmma's register operand ([Note: fragment wdot] in
# kernels/_fragment_kernels.py) beyond the tuner's (``_word.FRAGMENT_TILES``); run 86 timed these too
FRAGMENT_TRIALS = ((256, 5), (128, 6))


def fragment_configs(m: int, n: int, kw: int, sms: int) -> list[_word.WordConfig]:
    """The register-operand kernel's trial tiles, whole and split just under one wave."""
    saved = _word.FRAGMENT_TILES
    try:
        _word.FRAGMENT_TILES = FRAGMENT_TRIALS
        return _word.fragment_candidates(m, n, kw, sms)
    finally:
        _word.FRAGMENT_TILES = saved


def one_cell(fmt_name: str, w: torch.Tensor, m: int, g: torch.Generator, only_tuned: bool,
             pipelined: bool = True, trial: bool = True, specialized: bool = False, fragment: bool = False) -> dict:
    n, k = w.shape
    if fmt_name == "w4":
        q = quantize_int4(w, group_size=128, scale_dtype=torch.bfloat16)
        fmt, s, z, group = _word.FMT_W4, q.scales, q.zeros, 128
    else:
        q = quantize_int8(w)
        fmt, s, z, group = _word.FMT_W8, q.scales, None, 0
    words = q.qweight.view(torch.int32)
    deq = q.dequantize(torch.float32).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = x.float() @ deq.float().t()
    key, tuned, launch = _word.wdot_launcher(x, words, s, z, fmt=fmt, group=group, n=n, k=k)
    packed = _word.packed_dequant(fmt, x.dtype, s.dtype, "cuda", group)
    tuned = [c for c in tuned if c.full_depth]
    trials = [] if only_tuned or not trial else [c for c in trial_configs(fmt, m, n, words.shape[1], group, packed,
                                                             _word._sm_count(0)) if c not in tuned]
    if pipelined and packed == 1:
        from zspeed.kernels._pipelined import pipelined_fits

        if pipelined_fits(x, s, group=group, k=k):
            trials += [c for c in pipelined_configs(m, n, words.shape[1], _word._sm_count(0)) if c not in tuned]
            if specialized and m_bucket(m) >= 128:
                trials += [c for c in specialized_configs(m, n, words.shape[1], _word._sm_count(0)) if c not in tuned]
            if fragment and m_bucket(m) >= 128:
                trials += [c for c in fragment_configs(m, n, words.shape[1], _word._sm_count(0)) if c not in tuned]
    bf16_us = graph_time_ms(lambda: F.linear(x, w)) * 1e3
    rows = []
    for origin, configs in (("tuned", tuned), ("trial", trials)):
        for c in configs:
            try:
                poison = torch.full((m, n), float("nan"), device="cuda", dtype=x.dtype)
                del poison  # the output most likely gets this block: an element the kernel leaves unwritten is NaN
                out = launch(c)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = graph_time_ms(lambda c=c: launch(c), reps=10, trials=3) * 1e3
            except Exception as e:  # noqa: BLE001  (a tile the compiler rejects: out of shared memory, registers)
                if c.pipelined:  # a new kernel: report its failure and go on with the others
                    print(json.dumps(dict(fmt=fmt_name, k=k, n=n, m=m, origin=origin, failed=repr(e)[-2000:],
                                          config=asdict(c))), flush=True)
                    continue
                if "out of resource" not in str(e).lower() and "OutOfResources" not in type(e).__name__:
                    raise
                continue
            row = dict(fmt=fmt_name, k=k, n=n, m=m, origin=origin, us=us, speedup=bf16_us / us, rel_err=err,
                       config={f: v for f, v in asdict(c).items() if v not in (0, False)})
            rows.append(row)
            print(json.dumps(row), flush=True)
    bad = [r for r in rows if not r["rel_err"] < 1e-2]
    if bad:
        print(f"WRONG: {len(bad)} configs differ from the reference: {bad[:3]}", flush=True)
        rows = [r for r in rows if r["rel_err"] < 1e-2]
    best = lambda rs: min(rs, key=lambda r: r["us"]) if rs else None  # noqa: E731
    bt, ba = best([r for r in rows if r["origin"] == "tuned"]), best(rows)
    bw = best([r for r in rows if not r["config"].get("pipelined")])  # the kernels before the pipelined one
    bp = best([r for r in rows if r["config"].get("pipelined") and not r["config"].get("specialized")
               and not r["config"].get("fragment")])
    bs = best([r for r in rows if r["config"].get("specialized")])
    bf = best([r for r in rows if r["config"].get("fragment")])
    summary = dict(fmt=fmt_name, k=k, n=n, m=m, bf16_us=bf16_us, tuned_us=bt and bt["us"],
                   wmma_speedup=bw and bw["speedup"], pipelined_speedup=bp and bp["speedup"],
                   specialized_speedup=bs and bs["speedup"], specialized_config=bs and bs["config"],
                   fragment_speedup=bf and bf["speedup"], fragment_config=bf and bf["config"],
                   tuned_speedup=bt and bt["speedup"], tuned_config=bt and bt["config"], best_us=ba["us"],
                   best_speedup=ba["speedup"], best_origin=ba["origin"], best_config=ba["config"])
    print("SUMMARY " + json.dumps(summary), flush=True)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", nargs="*", default=["w4"], choices=["w4", "w8"])
    p.add_argument("--ms", type=int, nargs="*", default=[16, 64, 256])
    p.add_argument("--shapes", type=_shape, nargs="*", default=[(8192, 8192), (8192, 28672), (28672, 8192)])
    p.add_argument("--only-tuned", action="store_true", help="time the tuner's candidates only")
    p.add_argument("--no-trial-tiles", action="store_true", help="leave out TRIAL_TILES (the pipelined stay)")
    p.add_argument("--no-pipelined", action="store_true", help="leave out the pipelined Gluon kernel")
    p.add_argument("--specialized", action="store_true", help="time the warp-specialized kernel's tiles too")
    p.add_argument("--fragment", action="store_true", help="time the register-operand kernel's tiles too")
    args = p.parse_args()
    summaries = []
    for fmt_name in args.formats:
        for k, n in args.shapes:
            g = torch.Generator(device="cuda").manual_seed(0)
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
            for m in args.ms:
                summaries.append(one_cell(fmt_name, w, m, g, args.only_tuned, not args.no_pipelined,
                                          not args.no_trial_tiles, args.specialized, args.fragment))
    print("\n| format | shape (K x N) | M | bf16 us | best without pipelined x | best pipelined x | best specialized x "
          "| best fragment x | tuner's set x | best x | best config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    f2 = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for s in summaries:
        print(f"| {s['fmt']} | {s['k']}x{s['n']} | {s['m']} | {s['bf16_us']:.1f} | {f2(s['wmma_speedup'])} | "
              f"{f2(s['pipelined_speedup'])} | {f2(s['specialized_speedup'])} | {f2(s['fragment_speedup'])} | "
              f"{s['tuned_speedup']:.2f} | "
              f"{s['best_speedup']:.2f} ({s['best_origin']}) | {s['best_config']} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wdot_tiles.json"), "w") as f:
            json.dump(summaries, f)


if __name__ == "__main__":
    main()
