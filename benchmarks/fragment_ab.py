"""The register-operand INT4 kernel ([Note: fragment wdot] in kernels/_fragment_kernels.py) against another version
of itself, in one process: a copy of ``kernels/_fragment_kernels.py`` from another commit. On an sm_90 GPU:

    git show 10aadef:kernels/_fragment_kernels.py > /tmp/base.py     # here, before the run
    python benchmarks/fragment_ab.py --base /tmp/base.py [--ms 128 256 512 1024 2048] [--shapes 8192x8192 ...]
                                     [--overlap | --overlap-both]

For each shape (K x N), row count and config (128- or 256-row blocks of ``x``, paired tiles or not, the tuner's
split: [Note: tail split]), both versions run the same config twice in turn (A, B, A, B) and the best of each is
printed as a speed-up over cuBLAS bf16 in the same process (CUDA graphs, L2 flushed: kernels/_runtime.py
``graph_time_ms``), with the number of output elements where the two differ (0 expected where only speed changed).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from zspeed.compress import quantize_int4
from zspeed.kernels import _fragment_kernels, _pipelined, _word
from zspeed.kernels._runtime import cdiv, graph_time_ms, m_bucket

sys.path.insert(0, str(Path(__file__).parent))
from gemv_check import _shape  # noqa: E402  (the same "KxN" shape argument)


def _load_base(path: str):
    """The other version as ``zspeed.kernels._fragment_base`` (its relative imports resolve in ``zspeed.kernels``)."""
    spec = importlib.util.spec_from_file_location("zspeed.kernels._fragment_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _split(m: int, n: int, k: int, bm: int, sms: int) -> tuple[int, int]:
    """``(split_k, whole)`` as the tuner's candidates have them: a short last wave split, or a grid under one wave
    split just under it."""
    tiles = cdiv(m, bm) * cdiv(n, 128)
    if tiles > sms:
        sp = _word._tail_split(tiles, k // 64, sms)
        return (sp, tiles - tiles % sms) if sp > 1 else (1, tiles)
    sp = _word._under_wave(tiles, sms)
    return (sp, 0) if sp > 1 else (1, tiles)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="a copy of kernels/_fragment_kernels.py from another commit")
    p.add_argument("--ms", type=int, nargs="*", default=[128, 256, 512, 1024, 2048])
    p.add_argument("--shapes", type=_shape, nargs="*", default=[(8192, 8192), (8192, 28672), (28672, 8192)])
    p.add_argument("--overlap", action="store_true",
                   help="run this version with each wgmma in flight during the next tile's dequantization "
                        "([Note: overlapped fragments]); the base as it is")
    p.add_argument("--overlap-both", action="store_true", help="both versions with overlapped fragments")
    args = p.parse_args()
    versions = (("base", _load_base(args.base)), ("new", _fragment_kernels))
    g = torch.Generator(device="cuda").manual_seed(0)
    sms = _word._sm_count(0)
    for k, n in args.shapes:
        q = quantize_int4(torch.randn(n, k, device="cuda", generator=g) * 0.02, group_size=128,
                          scale_dtype=torch.bfloat16)
        words, wd = q.qweight.view(torch.int32), q.dequantize(torch.bfloat16)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            bf = graph_time_ms(lambda: F.linear(x, wd))
            row = dict(k=k, n=n, m=m, bf16_us=round(bf * 1e3, 1))
            ws = _word._stationary_workspace(x.device)
            small = m_bucket(m) < _word.FRAGMENT_MIN_M  # one block of x ([Note: fragment wdot at small M])
            blocks = ((max(8, m_bucket(m)), False), ) if small else ((128, False), (256, False), (256, True))
            xs, qs = _word.FRAGMENT_SMALL_STAGES if small else (4, 8)
            for bm, pair in blocks:
                if bm > max(128, m):
                    continue
                sp, whole = _split(m, n, k, bm, sms)

                def fn(extra):
                    return _pipelined.run_fragment(x, words, q.scales, q.zeros, group=128, n=n, k=k, block_m=bm,
                                                   stages=xs, q_stages=qs, split_k=sp, whole=whole, pair=pair,
                                                   workspace=ws, **extra)

                best, outs = {}, {}
                for _ in range(2):
                    for name, module in versions:
                        _pipelined._fragment_kernels = lambda module=module: module
                        overlap = (args.overlap and name == "new") or args.overlap_both
                        extra = dict(overlap=True) if overlap and not pair else {}
                        outs[name] = fn(extra)
                        best[name] = max(best.get(name, 0.0), bf / graph_time_ms(lambda: fn(extra)))
                row[f"bm{bm}{'_pair' if pair else ''}_split{sp}"] = dict(
                    base=round(best["base"], 3), new=round(best["new"], 3),
                    ndiff=int((outs["base"] != outs["new"]).sum()))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
