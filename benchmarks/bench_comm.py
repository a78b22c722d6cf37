"""Bucketed all-gather / reduce-scatter vs one plain large NCCL collective, in the same run.

    torchrun --nproc-per-node 2 benchmarks/bench_comm.py [--mib 512] [--json OUT.json]

Bus bandwidth follows nccl-tests: busbw = bytes × (n − 1) / n / time, where
bytes is the size of the full (gathered, or pre-reduction) buffer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from zspeed.core.comm import CommContext, ReduceOp, all_gather, reduce_scatter
from zspeed.core.partition import FlatPartition
from zspeed.core.topology import Topology


def timed(fn, topo, iters: int, warmup: int = 3, back_to_back: int = 5) -> float:
    """Median seconds per call of ``fn``, timed with CUDA events over ``back_to_back`` calls.

    Calls are issued back to back, as training issues them (asynchronously,
    ahead of need), so the host cost of issuing call i+1 overlaps call i on
    the GPU; plain collectives are timed the same way.
    """
    dev = topo.device
    for _ in range(warmup):
        fn()
    dev.synchronize()
    times = []
    for _ in range(iters):
        topo.barrier()
        start, end = dev.new_event(timing=True), dev.new_event(timing=True)
        start.record()
        for _ in range(back_to_back):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / back_to_back)
    return statistics.median(times)


def layer_shapes(total_bytes: int) -> list[tuple[int, ...]]:
    """Llama-8B-like parameter shapes repeated until ``total_bytes`` of bf16."""
    h, f, kv = 4096, 14336, 1024
    layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    shapes, size = [], 0
    while size < total_bytes:
        for s in layer:
            shapes.append(s)
            size += 2 * torch.Size(s).numel()
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    topo = Topology.from_env()
    dev, n = topo.device, topo.world_size
    torch.manual_seed(topo.rank)
    total = args.mib << 20
    rows = []

    busbw = lambda t, nbytes: nbytes * (n - 1) / n / t / 1e9  # noqa: E731
    shapes = layer_shapes(total)
    metas = [torch.empty(s, dtype=torch.bfloat16, device="meta") for s in shapes]
    total = sum(2 * m.numel() for m in metas)  # whole layers: compare plain and bucketed on the same bytes

    # Plain collectives on one big contiguous buffer of the same size: the ceiling.
    full = torch.randn(total // 2 // n * n, device=dev.device).to(torch.bfloat16)
    shard = torch.randn(full.numel() // n, device=dev.device).to(torch.bfloat16)
    t_ag = timed(lambda: dist.all_gather_into_tensor(full, shard), topo, args.iters)
    t_rs = timed(lambda: dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.SUM), topo, args.iters)
    plain = {"ag": busbw(t_ag, full.numel() * 2), "rs": busbw(t_rs, full.numel() * 2)}
    rows.append(dict(name="plain all_gather_into_tensor", bytes=full.numel() * 2, s=t_ag, busbw=plain["ag"]))
    rows.append(dict(name="plain reduce_scatter_tensor", bytes=full.numel() * 2, s=t_rs, busbw=plain["rs"]))
    del full, shard

    for bucket_mib in (25, 64, 200):
        part = FlatPartition.build(metas, world_size=n, bucket_bytes=bucket_mib << 20)
        group = part.groups[torch.bfloat16]
        nbytes = group.full_numel * 2
        g_full = torch.randn(group.full_numel, device=dev.device).to(torch.bfloat16)
        g_shard = torch.randn(group.shard_numel, device=dev.device).to(torch.bfloat16)
        tag = f"{len(group.buckets)} buckets of <={bucket_mib} MiB"
        for coalesce in (True, False):
            comm = CommContext(topo, coalesce=coalesce)
            how = "coalesced" if coalesce else "one call per bucket"
            t = timed(lambda: all_gather(group, shard=g_shard, full=g_full, topo=topo, comm=comm).wait(),
                      topo, args.iters)
            rows.append(dict(name=f"zspeed all_gather, {tag}, {how}", bytes=nbytes, s=t, busbw=busbw(t, nbytes),
                             vs_plain=busbw(t, nbytes) / plain["ag"]))
            t = timed(lambda: reduce_scatter(group, full=g_full, shard=g_shard, topo=topo, comm=comm,
                                             op=ReduceOp.SUM).wait(), topo, args.iters)
            rows.append(dict(name=f"zspeed reduce_scatter bf16, {tag}, {how}", bytes=nbytes, s=t,
                             busbw=busbw(t, nbytes), vs_plain=busbw(t, nbytes) / plain["rs"]))
        del g_full, g_shard

    if topo.is_main:
        print(f"\n{'collective':72s} {'MiB':>6s} {'ms':>8s} {'busbw GB/s':>11s} {'vs plain':>9s}")
        for r in rows:
            vs = f"{r['vs_plain']:.3f}" if "vs_plain" in r else "1.000"
            print(f"{r['name']:72s} {r['bytes'] / 2**20:6.0f} {r['s'] * 1e3:8.2f} {r['busbw']:11.1f} {vs:>9s}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world_size=n, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    topo.barrier()
    topo.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
