"""Where the INT4 x-stationary GEMV's time goes at M=1 ([Note: TMA weight stream] in kernels/_stationary_kernels.py).

    python benchmarks/gemv_anatomy.py stream     # the weight words alone: plain loads vs TMA, box shapes, runs
    python benchmarks/gemv_anatomy.py anatomy    # the TMA kernel without its fix-up / multiply-adds / x prologue

``stream`` streams the INT4 words of 8192x8192, 8192x28672 and 28672x8192 weights (K x N) through a kernel that
only reads them (an xor keeps the loads), over box shapes and runs per program, with plain loads and with TMA at
2-3 buffers: the ceiling for any kernel with this access pattern. ``anatomy`` times a copy of the production TMA
kernel with parts switched off (outputs then wrong, by design). Times are GPU time per call in CUDA graphs with
a cold L2 (kernels/_runtime.py graph_time_ms); JSON goes to ``$OUT`` (default /tmp).
"""
import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl

from zspeed.kernels._stationary_kernels import (_finish, _load_scales, _program_slice, _rows_w4, _store_rows,
                                                _x_planes4)


@triton.jit
def tma_load(w_desc, out_ptr, G: tl.constexpr, WG: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
             STAGES: tl.constexpr):
    """Reads program (slice, run)'s words through TMA, ``STAGES - 1`` boxes in flight; stores one checksum."""
    pid_k = tl.program_id(0)
    pid_r = tl.program_id(1)
    acc = tl.zeros((BN, G, WG), tl.int32)
    for b in tl.range(RB, num_stages=STAGES):
        w = w_desc.load([(pid_r * RB + b) * BN, pid_k * G, 0])
        acc = acc ^ (w + (w >> 3))
    tl.store(out_ptr + pid_r * tl.num_programs(0) + pid_k, tl.sum(tl.sum(tl.sum(acc, axis=2), axis=1), axis=0))


@triton.jit
def ldg_load(w_ptr, out_ptr, KW, G: tl.constexpr, WG: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr):
    """The same words through plain loads."""
    pid_k = tl.program_id(0)
    pid_r = tl.program_id(1)
    c = tl.arange(0, G * WG)
    n1 = tl.arange(0, BN)
    acc = tl.zeros((BN, G * WG), tl.int32)
    for b in range(RB):
        w = tl.load(w_ptr + ((pid_r * RB + b) * BN + n1)[:, None] * KW + pid_k * G * WG + c[None, :])
        acc = acc ^ (w + (w >> 3))
    tl.store(out_ptr + pid_r * tl.num_programs(0) + pid_k, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def var_kernel(x_ptr, w_desc, s_ptr, z_ptr, part_ptr, count_ptr, out_ptr, M, N, KW, SPLIT,
               stride_xm, stride_sn, stride_om, HAS_ZEROS: tl.constexpr, G: tl.constexpr, WG: tl.constexpr,
               BLOCK_N: tl.constexpr, ROW_BLOCKS: tl.constexpr, PARTIAL: tl.constexpr, FIX_K: tl.constexpr,
               STAGES: tl.constexpr, FIX: tl.constexpr, COMPUTE: tl.constexpr, XPRO: tl.constexpr):
    """``stationary_tma_kernel`` (INT4) with the fix-up (``FIX``), the multiply-adds (``COMPUTE``: else a
    checksum of the words) and the x planes (``XPRO``: else constants) switchable."""
    pid_m, pid_k, pid_r, word, live, x_row = _program_slice(x_ptr, stride_xm, KW, G, WG)
    if XPRO:
        x0, x1, x2, x3, x4, x5, x6, x7, x_sum = _x_planes4(x_row, word, live)
    else:
        one = tl.full(word.shape, 1.0, tl.float32) + pid_m
        x0, x1, x2, x3, x4, x5, x6, x7 = one, one * 2, one * 3, one * 4, one * 5, one * 6, one * 7, one * 8
        x_sum = tl.sum(one, axis=2)
    n1 = tl.arange(0, BLOCK_N)
    row0 = pid_r * (BLOCK_N * ROW_BLOCKS)
    s_next, z_next = _load_scales(s_ptr, z_ptr, row0 + n1, N, pid_k, KW, stride_sn, 1, HAS_ZEROS, G, WG)
    for b in tl.range(ROW_BLOCKS, num_stages=STAGES):
        s = s_next
        z = z_next
        rows = row0 + b * BLOCK_N + n1
        rmask = rows < N
        s_next, z_next = _load_scales(s_ptr, z_ptr, tl.where(b + 1 < ROW_BLOCKS, rows + BLOCK_N, N), N, pid_k, KW,
                                      stride_sn, 1, HAS_ZEROS, G, WG)
        w = w_desc.load([row0 + b * BLOCK_N, pid_k * G, 0])
        if COMPUTE:
            part = _rows_w4(w, x0, x1, x2, x3, x4, x5, x6, x7, x_sum, s, z, HAS_ZEROS)
        else:
            part = tl.sum(tl.sum(w ^ (w >> 3), axis=2), axis=1).to(tl.float32) + tl.sum(s + z, axis=1)
        _store_rows(part, out_ptr, part_ptr, pid_m, pid_k, rows, rmask, N, SPLIT, stride_om, PARTIAL)
    if PARTIAL and FIX:
        _finish(part_ptr, count_ptr, out_ptr, pid_m, pid_r, row0, N, SPLIT, stride_om, BLOCK_N * ROW_BLOCKS, FIX_K)


def stream(out_dir: str) -> None:
    """Ceilings: the words alone, through plain loads and through TMA, over box shapes and runs."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from zspeed.kernels._runtime import graph_time_ms
    res = []
    wg = 16
    for n, k in ((28672, 8192), (8192, 28672), (8192, 8192)):
        kw = k // 8
        w = torch.randint(-2**31, 2**31 - 1, (n, kw), dtype=torch.int32, device="cuda")
        mb = w.numel() * 4 / 1e6
        out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
        best = {}
        for g, bn, rb, warps in itertools.product((2, 4, 8), (16, 32, 64, 128), (4, 8, 16), (4,)):
            if bn * g * wg > 16384 or bn * g * wg < 1024 or n % (bn * rb):
                continue
            grid = (kw // (g * wg), n // (bn * rb))
            for kind, stages in (("ldg", 1), ("tma", 3), ("tma", 4)):
                if kind == "tma":
                    desc = TensorDescriptor.from_tensor(w.view(n, kw // wg, wg), [bn, g, wg])
                    fn = lambda: tma_load[grid](desc, out, G=g, WG=wg, BN=bn, RB=rb, STAGES=stages,  # noqa: E731
                                                num_warps=warps, num_stages=stages)
                else:
                    fn = lambda: ldg_load[grid](w, out, kw, G=g, WG=wg, BN=bn, RB=rb, num_warps=warps)  # noqa
                try:
                    t = graph_time_ms(fn) * 1e3
                except Exception as e:  # noqa: BLE001
                    print("fail", kind, g, bn, rb, warps, stages, repr(e)[:150], flush=True)
                    continue
                r = dict(n=n, k=k, kind=kind, g=g, bn=bn, rb=rb, warps=warps, stages=stages, us=round(t, 2),
                         tbs=round(mb / t, 3), programs=grid[0] * grid[1])
                res.append(r)
                key = (kind, stages)
                if key not in best or best[key]["us"] > t:
                    best[key] = r
        for key, r in sorted(best.items()):
            print("best", r, flush=True)
    with open(os.path.join(out_dir, "gemv_stream.json"), "w") as f:
        json.dump(res, f)



def anatomy(out_dir: str) -> None:
    """The INT4 TMA kernel with parts removed: the fix-up, the multiply-adds, the x prologue."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from zspeed.kernels._runtime import graph_time_ms
    res = []
    for n, k, bn, units, rb in ((28672, 8192, 32, 4, 8), (8192, 28672, 64, 4, 8), (8192, 28672, 64, 4, 4),
                                (8192, 8192, 32, 4, 8)):
        kw, wg = k // 8, 16
        qw = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        w = qw.view(torch.int32)
        s = (torch.rand(n, k // 128, device="cuda") * 0.01).to(torch.bfloat16)
        z = torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, device="cuda")
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = torch.empty(1 << 22, device="cuda", dtype=torch.float32)
        counters = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        bw = units * wg
        split = kw // bw
        runs = triton.cdiv(n, bn * rb)
        desc = TensorDescriptor.from_tensor(w.view(n, kw // wg, wg), [bn, units, wg])
        for fk in (8, 16):
            for fix, comp, xpro in itertools.product((1, 0), (1, 0), (1, 0)):
                if fk == 16 and not (fix and comp and xpro):
                    continue

                def go():
                    var_kernel[(1, split, runs)](x, desc, s, z, ws, counters, out, 1, n, kw, split, x.stride(0),
                                                 s.stride(0), out.stride(0), HAS_ZEROS=True, G=units, WG=wg,
                                                 BLOCK_N=bn, ROW_BLOCKS=rb, PARTIAL=True, FIX_K=fk, STAGES=3,
                                                 FIX=fix, COMPUTE=comp, XPRO=xpro, num_warps=4, num_stages=3)
                t = graph_time_ms(go) * 1e3
                r = dict(n=n, k=k, bn=bn, rb=rb, fk=fk, fix=fix, compute=comp, xpro=xpro, us=round(t, 2),
                         programs=split * runs)
                print(r, flush=True)
                res.append(r)
    with open(os.path.join(out_dir, "gemv_anatomy.json"), "w") as f:
        json.dump(res, f)



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=["stream", "anatomy"])
    args = p.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    if args.part == "stream":
        stream(out_dir)
    else:
        anatomy(out_dir)


if __name__ == "__main__":
    main()
