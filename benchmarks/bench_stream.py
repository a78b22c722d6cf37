"""Weight streaming through the core's store and streamer, beside the raw limits, in one run.

    python benchmarks/bench_stream.py [--layers 8] [--disk-dir /tmp/zspeed-bench] [--json OUT.json]

Measures, on one GPU:
  * raw pinned host->device copy bandwidth (one 1 GiB copy, median of 10);
  * the streamer from the CPU tier (pinned), window 2 and 3, no compute;
  * `dd iflag=direct bs=16M` over the very files the DISK tier wrote, and the
    streamer from the DISK tier (disk -> pinned staging -> device);
  * overlap: per-unit compute sized at ~1.3x a unit's transfer; hidden share =
    (compute-only + transfer-only - both) / transfer-only.
Units are Llama-8B-shaped decoder layers in bf16 (436 MB each).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time

import torch

from zspeed.core.device import DeviceHandle
from zspeed.core.store import StoreConfig, TensorStore, Tier
from zspeed.core.streamer import Streamer, StreamerConfig, UnitSpec

H, F, KV = 4096, 14336, 1024


def layer_shapes() -> dict[str, tuple[int, ...]]:
    return {"q": (H, H), "k": (KV, H), "v": (KV, H), "o": (H, H), "gate": (F, H), "up": (F, H), "down": (H, F),
            "norm1": (H,), "norm2": (H,)}


def fill_store(store: TensorStore, layers: int) -> list[UnitSpec]:
    units = []
    for i in range(layers):
        keys = []
        for name, shape in layer_shapes().items():
            key = f"layer{i}.{name}"
            store.put(key, torch.randn(shape, dtype=torch.bfloat16))
            keys.append(key)
        units.append(UnitSpec(name=f"layer{i}", tensor_keys=tuple(keys)))
    store.flush()
    return units


def raw_h2d(dev: DeviceHandle, nbytes: int = 1 << 30) -> float:
    src = dev.pinned_empty((nbytes,), dtype=torch.uint8)
    src.random_(0, 255)
    dst = dev.empty((nbytes,), dtype=torch.uint8)
    times = []
    for _ in range(12):
        s, e = dev.new_event(timing=True), dev.new_event(timing=True)
        s.record()
        dst.copy_(src, non_blocking=True)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return nbytes / statistics.median(times[2:]) / 1e9


def stream_pass(streamer: Streamer, dev: DeviceHandle, compute=None, passes: int = 3) -> tuple[float, float]:
    """(seconds per pass, GB/s) over every unit, after one warm-up pass.

    Streamers here are built with ``cyclic=False``: nothing is prefetched past a
    pass's last unit, so every byte a pass moves is moved between its two
    synchronisations (with wrap-around prefetch, the next pass's first K units
    would load in the untimed gap between passes and inflate the figure).
    Bandwidth counts the bytes the streamer really loaded (its stats).
    """
    times = []
    moved = 0
    for p in range(passes + 1):
        dev.synchronize()
        before = streamer.stats.bytes_moved
        t0 = time.perf_counter()
        for _, tensors in streamer.run():
            if compute is not None:
                compute(tensors)
        dev.synchronize()
        if p:
            times.append(time.perf_counter() - t0)
            moved += streamer.stats.bytes_moved - before
    return statistics.median(times), moved / sum(times) / 1e9


def make_compute(dev: DeviceHandle, seconds: float):
    """A matmul loop on the unit's weights lasting about ``seconds``."""
    x = torch.randn(2048 if H >= 1024 else 64, H, device=dev.device, dtype=torch.bfloat16)
    w = torch.randn(H, H, device=dev.device, dtype=torch.bfloat16)
    for _ in range(3):
        x @ w
    dev.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        x @ w
    dev.synchronize()
    per = (time.perf_counter() - t0) / 50
    reps = max(1, round(seconds / per))

    def compute(tensors):
        y = x
        q = tensors["q" if "q" in tensors else next(k for k in tensors if k.endswith(".q"))]
        for _ in range(reps):
            y = x @ q
        return y
    return compute


def dd_direct(files: list[str]) -> float:
    total, t0 = 0, time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        total += os.path.getsize(f)
    return total / (time.perf_counter() - t0) / 1e9


def dd_direct_big(directory: str, nbytes: int) -> float:
    """dd iflag=direct over one large file of ``nbytes`` (no per-process start-up per file)."""
    path = os.path.join(directory, "dd-probe.bin")
    block = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        return dd_direct([path])
    finally:
        os.remove(path)


def check_bytes(streamer: Streamer, store: TensorStore) -> None:
    """Streamed tensors equal the stored ones (first and last unit)."""
    for i in (0, len(streamer) - 1):
        tensors = streamer.acquire(i)
        for key, t in tensors.items():
            if not torch.equal(t.cpu(), store.get(key)):
                raise AssertionError(f"streamed {key} differs from the store")
        streamer.release(i)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--disk-dir", default="/tmp/zspeed-bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--small", action="store_true", help="tiny shapes: a smoke test on the CPU")
    args = ap.parse_args()
    if args.small:
        global H, F, KV
        H, F, KV = 256, 512, 64
    dev = DeviceHandle.auto()
    rows: dict[str, float] = {}
    rows["raw_h2d_gbps"] = raw_h2d(dev, (1 << 30) if not args.small else (1 << 24))

    with TensorStore(config=StoreConfig(tier=Tier.CPU), device=dev) as cpu_store:
        units = fill_store(cpu_store, args.layers)
        unit_bytes = sum(cpu_store.meta(k).nbytes for k in units[0].tensor_keys)
        total = unit_bytes * len(units)
        for k in (2, 3):
            with Streamer(units=units, store=cpu_store, device=dev, config=StreamerConfig(window=k, cyclic=False)) as s:
                if k == 2:
                    check_bytes(s, cpu_store)
                _, rows[f"cpu_stream_k{k}_gbps"] = stream_pass(s, dev)
        transfer = total / rows["cpu_stream_k2_gbps"] / 1e9 / len(units)
        compute = make_compute(dev, 1.3 * transfer)
        with Streamer(units=units, store=cpu_store, device=dev, config=StreamerConfig(window=2, cyclic=False)) as s:
            t_transfer, _ = stream_pass(s, dev)
            t_both, _ = stream_pass(s, dev, compute)
            resident = s.acquire(0)
            dev.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                for _ in units:
                    compute(resident)
            dev.synchronize()
            t_compute = (time.perf_counter() - t0) / 3
            s.release(0)
        rows.update(overlap_transfer_s=t_transfer, overlap_compute_s=t_compute, overlap_both_s=t_both,
                    overlap_hidden_share=(t_compute + t_transfer - t_both) / t_transfer)

    shutil.rmtree(args.disk_dir, ignore_errors=True)
    with TensorStore(config=StoreConfig(tier=Tier.DISK, path=args.disk_dir, io_threads=8), device=dev) as disk:
        units = fill_store(disk, args.layers)
        rows["disk_io_mode"] = disk.io_mode
        files = sorted(os.path.join(args.disk_dir, f) for f in os.listdir(args.disk_dir)
                       if os.path.isfile(os.path.join(args.disk_dir, f)))
        rows["dd_direct_gbps"] = dd_direct(files)
        with Streamer(units=units, store=disk, device=dev, config=StreamerConfig(window=3, cyclic=False)) as s:
            check_bytes(s, disk)
            _, rows["disk_stream_gbps"] = stream_pass(s, dev, passes=2)
            rows["disk_stream_stats_stall_s"] = s.stats.stall_seconds
        rows["dd_direct_gbps_after"] = dd_direct(files)
        rows["dd_direct_big_file_gbps"] = dd_direct_big(args.disk_dir, total)
    shutil.rmtree(args.disk_dir, ignore_errors=True)

    rows["cpu_stream_share_of_raw"] = rows["cpu_stream_k2_gbps"] / rows["raw_h2d_gbps"]
    # The reference is the best dd figure of the run (conservative for us).
    dd = max(rows["dd_direct_gbps"], rows["dd_direct_gbps_after"], rows["dd_direct_big_file_gbps"])
    rows["disk_stream_share_of_dd"] = rows["disk_stream_gbps"] / dd
    rows.update(device=torch.cuda.get_device_name() if dev.is_cuda else "cpu", unit_bytes=unit_bytes,
                layers=args.layers)
    for k, v in rows.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
