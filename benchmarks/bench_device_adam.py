"""The offloaded optimizer update split between the host and the device (zspeed.train.streamed_adam).

    python benchmarks/bench_device_adam.py [--numel 400000000] [--shares 0,0.25,0.4,0.5,0.6,0.75,1]
                                           [--threads 0] [--repeat 3] [--json OUT]

``--numel`` fp32 masters with AdamW moments in pinned host memory, a bf16 gradient (on the host for the
host part, on the device for the device part), clip coefficient != 1. For each share s, the first
s × numel elements are updated by :class:`~zspeed.train.streamed_adam.StreamedAdam` (state streamed through
device slots) while a worker thread runs the host's chunked update
(:func:`~zspeed.train.host_adam.chunked_adam_update`) on the rest, as ``offload_optimizer.device_share``
does in training. Each line gives the wall time of the whole update (median of ``--repeat`` after one
warm-up), the elements per second, and each side's own time. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from zspeed.core.device import DeviceHandle
from zspeed.train import host_adam
from zspeed.train.offload import host_update_threads
from zspeed.train.streamed_adam import StreamedAdam

SCALE = 0.37
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8, "amsgrad": False,
         "maximize": False}


def plan_for(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> host_adam.AdamPlan:
    return host_adam.AdamPlan(step=torch.zeros((), dtype=torch.float32), exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                              max_exp_avg_sq=None, kernel=torch._fused_adamw_, hyper=HYPER)


def check(dev: DeviceHandle, n: int = (1 << 20) * 3 + 77, steps: int = 3) -> None:
    """The streamed update against the host's on a small group: how many elements differ after ``steps``."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(steps)]
    want = [base.clone(), torch.zeros(n), torch.zeros(n)]
    got = [base.clone().pin_memory(), torch.zeros(n).pin_memory(), torch.zeros(n).pin_memory()]
    hplan, dplan = plan_for(want[1], want[2]), plan_for(got[1], got[2])
    streamed = StreamedAdam(device=dev, chunk_numel=1 << 20)
    out_h, out_d = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16, device=dev.device)
    ready = dev.new_event()
    for gr in grads:
        host_adam.chunked_adam_update(hplan, master=want[0], grad=gr, scale=SCALE, out=out_h,
                                      scratch=host_adam.Scratch())
        gd = gr.to(dev.device)
        ready.record(dev.current_stream())
        streamed.update(dplan, master=got[0], grad=gd, scale=SCALE, out=out_d, grad_ready=ready)
        streamed.wait()
    torch.cuda.synchronize()
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), want, got):
        diff = (a - b).abs()
        print(f"check {name}: {int((diff > 0).sum())} of {n} differ, max |diff| {float(diff.max()):.3g} "
              f"(max |value| {float(a.abs().max()):.3g})")
    print(f"check bf16 out: {int((out_h != out_d.cpu()).sum())} of {n} differ", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=400_000_000)
    ap.add_argument("--shares", default="0,0.25,0.4,0.5,0.6,0.75,1")
    ap.add_argument("--threads", type=int, default=0, help="host update threads (0 = zspeed's auto)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = DeviceHandle.auto()
    if not dev.is_cuda:
        raise SystemExit("bench_device_adam needs CUDA")
    check(dev)
    threads = host_update_threads(args.threads, local_world_size=1)
    n = args.numel // host_adam.ALIGN * host_adam.ALIGN
    t0 = time.perf_counter()
    master, m, v = (torch.empty(n, dtype=torch.float32, pin_memory=True) for _ in range(3))
    master.normal_()
    m.zero_()
    v.zero_()
    grad_host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True).normal_()
    out_host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    grad_dev = grad_host.to(dev.device)
    out_dev = torch.empty(n, dtype=torch.bfloat16, device=dev.device)
    print(f"numel {n:,}, {threads} host threads, set-up {time.perf_counter() - t0:.1f} s", flush=True)
    worker = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
    streamed = StreamedAdam(device=dev)
    scratch = host_adam.Scratch()
    ready = dev.new_event()
    ready.record(dev.current_stream())
    rows = []
    for share in [float(s) for s in args.shares.split(",")]:
        k = int(n * share) // host_adam.ALIGN * host_adam.ALIGN
        dplan, hplan = plan_for(m[:k], v[:k]), plan_for(m[k:], v[k:])

        def host_part() -> float:
            t = time.perf_counter()
            if k < n:
                host_adam.chunked_adam_update(hplan, master=master[k:], grad=grad_host[k:], scale=SCALE,
                                              out=out_host[k:], scratch=scratch)
            return time.perf_counter() - t

        def one() -> tuple[float, float, float]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            fut = worker.submit(host_part)
            if k:
                streamed.update(dplan, master=master[:k], grad=grad_dev[:k], scale=SCALE, out=out_dev[:k],
                                grad_ready=ready)
                streamed.wait()
                torch.cuda.current_stream().wait_stream(streamed.compute)
                torch.cuda.synchronize()
            dev_s = time.perf_counter() - t
            host_s = fut.result()
            return time.perf_counter() - t, host_s, dev_s

        one()
        times = [one() for _ in range(args.repeat)]
        wall = statistics.median(t[0] for t in times)
        row = {"share": share, "wall_ms": wall * 1e3, "host_ms": statistics.median(t[1] for t in times) * 1e3,
               "device_ms": statistics.median(t[2] for t in times) * 1e3, "G_elements_per_s": n / wall / 1e9}
        rows.append(row)
        print(f"share {share:4.2f}: {row['wall_ms']:7.1f} ms  {row['G_elements_per_s']:5.2f} G elements/s  "
              f"(host part {row['host_ms']:6.1f} ms, device part {row['device_ms']:6.1f} ms)", flush=True)
    worker.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": n, "threads": threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
