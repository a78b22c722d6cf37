"""Where a serving step's time goes: the runner alone, resident weights, decode and mixed steps.

    python benchmarks/serve_step_profile.py [--preset llama-8b] [--num-layers 8] [--batch 1 32]
                                            [--prompt-len 128] [--profile]

Writes a random-weight checkpoint of the preset (``--num-layers`` decoder layers) under --weights-dir,
loads it resident, and times with CUDA events and host clocks: a decode-only step at each batch, and
the same step with one ``--prompt-len`` prompt prefilled in it. With ``--profile`` it prints the
torch.profiler table (self CPU time, device time) of a few decode steps at the largest batch.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from zspeed.serve.model_loader import LoadConfig, load_model
from zspeed.serve.presets import write_random_checkpoint
from zspeed.serve.request import SamplingParams
from zspeed.serve.runner import ModelRunner
from zspeed.serve.scheduler import DecodeItem, PrefillChunk, SchedulerOutput


def timed(fn, repeat: int) -> tuple[float, float]:
    """Median wall ms per call (after a sync) and median device ms, over ``repeat`` calls."""
    walls, devs = [], []
    cuda = torch.cuda.is_available()
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t = time.perf_counter()
        fn()
        if cuda:
            b.record()
            torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t))
        devs.append(a.elapsed_time(b) if cuda else float("nan"))
    return statistics.median(walls), statistics.median(devs)


def copy_gaps(prof, layers: int) -> None:
    """Host->device copies in the profile: busy and idle time between them, the largest gaps."""
    copies = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                    if "Memcpy HtoD" in e.name and e.time_range.end - e.time_range.start > 100)
    if len(copies) < 2:
        print("no large host->device copies in the profile")
        return
    busy = sum(b - a for a, b in copies)
    gaps = [(copies[i + 1][0] - copies[i][1], i + 1) for i in range(len(copies) - 1)]
    span = copies[-1][1] - copies[0][0]
    print(f"{len(copies)} copies over {span / 1e3:.2f} ms: busy {busy / 1e3:.2f} ms ({busy / span:.3f}), "
          f"mean copy {busy / len(copies) / 1e3:.3f} ms, idle {sum(g for g, _ in gaps) / 1e3:.2f} ms")
    for gap, i in sorted(gaps, reverse=True)[:8]:
        print(f"  gap {gap / 1e3:7.3f} ms before copy {i} (layer ~{i % layers})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-8b")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--weights-dir", default="/tmp/zspeed-profile")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--offload", choices=("none", "cpu"), default="none")
    ap.add_argument("--window", type=int, default=3)
    args = ap.parse_args()
    folder = Path(args.weights_dir) / f"{args.preset}-{args.num_layers}l-bf16"  # as bench_serve.py names it
    if not (folder / "model.safetensors.index.json").exists():
        write_random_checkpoint(args.preset, folder, num_layers=args.num_layers)
    model = load_model(LoadConfig(model=str(folder), offload=args.offload, window=args.window, progress=False))
    sp = SamplingParams()
    for batch in args.batch:
        runner = ModelRunner(model, max_batch_size=batch + 1, max_model_len=args.prompt_len + 64)
        prompt = tuple(range(1, args.prompt_len + 1))
        runner.step(SchedulerOutput(step=0, prefills=tuple(PrefillChunk(i, prompt, 0, True, sp)
                                                          for i in range(batch))))
        pos = [args.prompt_len]

        def decode(extra=()):
            runner.step(SchedulerOutput(step=1, prefills=extra,
                                        decodes=tuple(DecodeItem(i, 5, pos[0], sp) for i in range(batch))))
            pos[0] += 1

        def mixed():
            decode((PrefillChunk(batch, prompt, 0, True, sp),))
            runner.free(batch)

        decode(), mixed()
        wall, dev = timed(decode, args.repeat)
        mwall, mdev = timed(mixed, max(3, args.repeat // 3))
        layers = args.num_layers
        print(f"batch {batch:3d}: decode step {wall:7.2f} ms wall, {dev:7.2f} ms device "
              f"({wall / layers:.3f} ms/layer wall); + one {args.prompt_len}-token prefill: {mwall:7.2f} ms wall, "
              f"{mdev:7.2f} ms device ({mwall / wall:.2f}x)", flush=True)
        if args.profile and batch == max(args.batch):
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    decode()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            copy_gaps(prof, layers)
        pos[0] = args.prompt_len
        for i in range(batch):
            runner.free(i)
        del runner
    model.close()


if __name__ == "__main__":
    main()
