"""The host update of one offloaded group: the old path against the chunked one (zspeed.train.host_adam).

    python benchmarks/bench_cpu_adam.py [--numel 50000000] [--threads 16] [--repeat 5]
                                        [--chunks 262144,1048576,4194304,16777216] [--json OUT]

One group of ``--numel`` fp32 masters with fused AdamW state (weight decay) on the CPU, its gradient in
bf16, scaled by a clip coefficient != 1, its update cast to a bf16 output buffer (pinned when CUDA is
there, as the offload keeps them). Paths, each timed ``--repeat`` times after one warm-up update:

* ``old``: ``grad = g16.to(fp32)`` (a fresh tensor each step), ``mul_``, ``master.grad = grad;
  optimizer.step()``, ``out.copy_(master)``: what OptimizerOffload._update did, with its stages timed;
* ``step+scratch``: the same with the fp32 gradient in a persistent buffer (the non-Adam path now);
* ``chunked <size>``: :func:`~zspeed.train.host_adam.chunked_adam_update` with ``CHUNK_NUMEL = size``
  (the module's value is 1M).

The paths take turns. Each line gives the median and best ms, and GB/s of state traffic over those
times: 28 bytes per element (master, exp_avg and exp_avg_sq read and written, the bf16 gradient read,
the bf16 output written).
First, on a small group, every chunk size is checked to give the old path's masters bit for bit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from zspeed.train import host_adam

BYTES_PER_ELEMENT = 28
SCALE = 0.37  # a clip coefficient: the mul_ runs, as it does with clipping or fp16
DTYPE = torch.bfloat16


class Group:
    """One master with its optimizer, state, 16-bit gradient and output buffer."""

    def __init__(self, numel: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        pin = torch.cuda.is_available()
        self.master = torch.randn(numel, generator=g)
        self.grad16 = torch.empty(numel, dtype=DTYPE, pin_memory=pin).copy_(torch.randn(numel, generator=g))
        self.out = torch.empty(numel, dtype=DTYPE, pin_memory=pin)
        self.optimizer = torch.optim.AdamW([self.master], lr=1e-3, weight_decay=0.01, fused=True)
        self.scratch = host_adam.Scratch()

    def old(self, stages: dict[str, list[float]] | None = None) -> None:
        t = [time.perf_counter()]
        grad = self.grad16.to(torch.float32)
        t.append(time.perf_counter())
        grad.mul_(SCALE)
        t.append(time.perf_counter())
        self._step(grad)
        t.append(time.perf_counter())
        self.out.copy_(self.master)
        t.append(time.perf_counter())
        if stages is not None:
            for name, a, b in zip(("alloc+cast", "mul", "step", "out cast"), t, t[1:]):
                stages.setdefault(name, []).append(b - a)

    def step_scratch(self) -> None:
        grad = self.scratch.take(self.master.numel()).copy_(self.grad16)
        grad.mul_(SCALE)
        self._step(grad)
        self.out.copy_(self.master)

    def chunked(self) -> None:
        plan = host_adam.fused_adam_plan(self.optimizer, self.master)
        host_adam.chunked_adam_update(plan, master=self.master, grad=self.grad16, scale=SCALE, out=self.out,
                                      scratch=self.scratch)

    def _step(self, grad: torch.Tensor) -> None:
        self.master.grad = grad
        self.optimizer.step()
        self.master.grad = None


def timed(paths: dict[str, Callable[[], None]], repeat: int) -> dict[str, list[float]]:
    """Seconds per call of each path, after one warm-up call each; the paths take turns, so that a
    stretch of noise from other processes falls on all of them alike."""
    for fn in paths.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeat):
        for name, fn in paths.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def check_exact(chunks: list[int], numel: int = (1 << 22) + 13, steps: int = 2) -> None:
    """Every chunk size updates a small group bit for bit as the old path does."""
    want = Group(numel)
    for _ in range(steps):
        want.old()
    for chunk in chunks:
        _set_chunk(chunk)
        got = Group(numel)
        for _ in range(steps):
            got.chunked()
        if not (torch.equal(got.master, want.master) and torch.equal(got.out, want.out)):
            raise SystemExit(f"chunk {chunk}: the chunked update differs from optimizer.step()")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=50_000_000, help="elements in the group")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    ap.add_argument("--repeat", type=int, default=5, help="timed updates per path (after one warm-up)")
    ap.add_argument("--chunks", default="262144,1048576,4194304,16777216",
                    help="comma-separated CHUNK_NUMEL values (elements) to time")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chunks = [int(c) for c in args.chunks.split(",")]
    check_exact(chunks)
    g = Group(args.numel)
    stages: dict[str, list[float]] = {}
    paths = {"old": lambda: g.old(stages), "step+scratch": g.step_scratch}
    paths.update({f"chunked {c}": _with_chunk(g, c) for c in chunks})
    rows = timed(paths, args.repeat)
    old = statistics.median(rows["old"])
    print(f"numel {args.numel:,}, threads {torch.get_num_threads()}, bf16 gradient, AdamW, "
          f"pinned {torch.cuda.is_available()}; median and best of {args.repeat}")
    gbytes = BYTES_PER_ELEMENT * args.numel / 1e9
    for name, times in rows.items():
        med, best = statistics.median(times), min(times)
        print(f"  {name:<18} {med * 1e3:8.1f} ms (best {best * 1e3:6.1f})  "
              f"{gbytes / med:5.1f} GB/s (best {gbytes / best:5.1f})  {old / med:5.2f}x")
    print("  old path stages (median): "
          + ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in stages.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "threads": torch.get_num_threads(),
                       "ms": {k: [t * 1e3 for t in v] for k, v in rows.items()}}, f, indent=1)


def _with_chunk(g: Group, chunk: int) -> Callable[[], None]:
    def run() -> None:
        _set_chunk(chunk)
        g.chunked()
    return run


def _set_chunk(chunk: int) -> None:
    host_adam.CHUNK_NUMEL = chunk


if __name__ == "__main__":
    main()
