"""`zspeed-demo`: the core end to end on the CPU, with nothing to download.

1. Stream a small layered model from disk through the streamer (window 2) and
   check the output equals the in-memory model's.
2. On 2 gloo processes: shard the parameters, all-gather them back bit-exactly,
   reduce-scatter (average) gradients computed on different data, and compare
   each rank's holdings with the ZeRO formulas.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

from .comm import CommContext, ReduceOp, all_gather, reduce_scatter
from .device import DeviceHandle
from .memory import format_bytes, tensor_bytes, zero_memory_per_rank
from .partition import FlatPartition
from .store import StoreConfig, TensorStore, Tier
from .streamer import Streamer, StreamerConfig, UnitSpec
from .topology import Topology, TopologyConfig


def toy_layers(n_layers: int, width: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(width, width, generator=g) / width ** 0.5, "b": torch.randn(width, generator=g) * 0.1}
            for _ in range(n_layers)]


def layer_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w.T + b)


def demo_streaming(layers, *, window: int, workdir: str) -> None:
    dev = DeviceHandle.auto()
    x = torch.randn(8, layers[0]["w"].shape[0], generator=torch.Generator().manual_seed(1))
    ref = x
    for p in layers:
        ref = layer_forward(ref, p["w"], p["b"])
    with TensorStore(config=StoreConfig(tier=Tier.DISK, path=workdir), device=dev) as store:
        for i, p in enumerate(tqdm(layers, desc="write layers to disk", unit="layer")):
            for name, t in p.items():
                store.put(f"layer{i}.{name}", t)
        units = [UnitSpec(name=f"layer{i}", tensor_keys=(f"layer{i}.w", f"layer{i}.b")) for i in range(len(layers))]
        with Streamer(units=units, store=store, device=dev, config=StreamerConfig(window=window)) as streamer:
            h = x.to(dev.device)
            for i, t in tqdm(streamer.run(), total=len(units), desc=f"stream (window {window})", unit="layer"):
                assert streamer.resident_count <= window
                h = layer_forward(h, t[f"layer{i}.w"], t[f"layer{i}.b"])
            stats = streamer.stats
            io_mode = store.io_mode
    same = torch.equal(h.cpu(), ref)
    print(f"  streamed {stats.units_loaded} units, {format_bytes(stats.bytes_moved)} from disk ({io_mode} I/O), "
          f"stalled {stats.stall_seconds * 1e3:.1f} ms, max resident {streamer.max_resident_seen} <= {window}")
    print(f"  output equals the in-memory model: {same}")
    if not same:
        raise SystemExit("streamed output differs from the in-memory model")


def _rank_main(rank: int, world: int, port: int, layers, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    with Topology.from_env(TopologyConfig(backend="gloo", device="cpu")) as topo:
        queue.put(_shard_round_trip(topo, layers))


def _shard_round_trip(topo: Topology, layers) -> dict:
    params = [t.to(torch.bfloat16) for p in layers for t in p.values()]
    part = FlatPartition.build(params, world_size=topo.world_size, bucket_bytes=64 << 10)
    group = part.groups[torch.bfloat16]
    comm = CommContext(topo)
    shard = group.shard_of(group.flatten(params), topo.rank)  # all this rank keeps
    full = group.new_full()
    all_gather(group, shard=shard, full=full, topo=topo, comm=comm).wait()
    exact = all(torch.equal(v, p) for v, p in zip(group.views(full), params))
    # Gradients differ per rank (different data); the average lands sharded.
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(topo.rank * 1000 + i)).to(torch.bfloat16)
             for i, p in enumerate(params)]
    g_shard = group.new_shard()
    reduce_scatter(group, full=group.flatten(grads), shard=g_shard, topo=topo, comm=comm, op=ReduceOp.AVG,
                   reduce_dtype=torch.float32).wait()
    expect = torch.stack([group.flatten([torch.randn(p.shape, generator=torch.Generator().manual_seed(
        r * 1000 + i)).to(torch.bfloat16).double() for i, p in enumerate(params)], out=torch.zeros(
        group.full_numel, dtype=torch.float64)) for r in range(topo.world_size)]).mean(0)
    err = (g_shard.double() - group.shard_of(expect, topo.rank)).abs().max().item()
    held = tensor_bytes([shard, g_shard, shard.float(), torch.zeros(group.shard_numel), torch.zeros(group.shard_numel)])
    return dict(rank=topo.rank, exact=exact, grad_err=err, shard_bytes=held, numel=group.data_numel,
                buckets=len(group.buckets))


def run_sharding(layers, *, world: int) -> list[dict]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, layers, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="zspeed-demo", description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    layers = toy_layers(args.layers, args.width)
    print(f"[1/2] streaming a {args.layers}-layer model from disk")
    with tempfile.TemporaryDirectory(prefix="zspeed-demo-") as d:
        demo_streaming(layers, window=args.window, workdir=d)
    print(f"[2/2] sharding across {args.world} gloo processes")
    results = run_sharding(layers, world=args.world)
    for r in results:
        est = zero_memory_per_rank(r["numel"], stage=3, world_size=args.world)
        print(f"  rank {r['rank']}: all-gather bit-exact {r['exact']}, reduce-scatter max error {r['grad_err']:.2e}, "
              f"{r['buckets']} buckets; holds {format_bytes(r['shard_bytes'])} of model state "
              f"(ZeRO-3 formula: {format_bytes(est.total)})")
    ok = all(r["exact"] and r["grad_err"] < 1e-2 for r in results)
    print(f"done in {time.perf_counter() - t0:.1f} s: {'OK' if ok else 'FAILED'}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
