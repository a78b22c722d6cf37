"""Three calls of the register-operand INT4 kernel ([Note: fragment wdot] in kernels/_fragment_kernels.py) on one
shape, for a profiler to pick one (the first compiles and warms up). On an sm_90 GPU, e.g. (kernels run 90):

    ncu --clock-control none -k regex:w4_fragment -s 2 -c 1 --section SpeedOfLight --section WarpStateStats \\
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \\
        python benchmarks/profile_fragment.py --shape 8192x28672 --m 512

Where each instruction's warps stall (kernels run 100): ``--set full -o rep`` instead of the sections, then
``ncu -i rep.ncu-rep --page source --csv --print-source sass``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from zspeed.compress import quantize_int4
from zspeed.kernels._pipelined import run_fragment
from zspeed.kernels._word import _stationary_workspace

sys.path.insert(0, str(Path(__file__).parent))
from gemv_check import _shape  # noqa: E402  (the same "KxN" shape argument)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=_shape, default=(8192, 28672))
    p.add_argument("--m", type=int, default=512)
    p.add_argument("--block-m", type=int, default=256)
    p.add_argument("--pair", action="store_true", help="two tiles a wgmma round ([Note: paired tiles])")
    p.add_argument("--overlap", action="store_true", help="each wgmma in flight during the next tile's "
                   "dequantization ([Note: overlapped fragments])")
    p.add_argument("--split", type=int, default=1, help="slices of K of every tile (uniform split-K)")
    p.add_argument("--q-stages", type=int, default=8, help="word tiles in the ring")
    args = p.parse_args()
    k, n = args.shape
    q = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, group_size=128, scale_dtype=torch.bfloat16)
    x = torch.randn(args.m, k, device="cuda").bfloat16()
    ws = _stationary_workspace(x.device) if args.split > 1 else None
    for _ in range(3):
        run_fragment(x, q.qweight.view(torch.int32), q.scales, q.zeros, group=128, n=n, k=k, block_m=args.block_m,
                     stages=4, q_stages=args.q_stages, split_k=args.split, pair=args.pair, overlap=args.overlap,
                     workspace=ws)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
