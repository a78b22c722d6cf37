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


def check(model, batch: int, prompt_len: int, steps: int, chunk: int = 32) -> None:
    """Greedy tokens of ``batch`` different prompts, ``steps`` each: with graphs, without, with graphs and the
    prompts fed in ``chunk``-token pieces, with piecewise graphs around the Triton attention kernel, and with
    whole-step graphs; how many differ from the first (the last from the Triton piecewise run: same kernels)."""
    sp = SamplingParams()
    vocab = model.description.vocab_size
    prompts = [tuple((7 * i + 13 * j) % (vocab - 1) + 1 for j in range(prompt_len)) for i in range(batch)]
    outputs = {}
    for mode in ("graphs", "eager", "chunked", "triton", "triton-whole"):
        runner = ModelRunner(model, max_batch_size=batch, max_model_len=prompt_len + steps + 1,
                             graphs=mode != "eager", attention_kernel="triton" if "triton" in mode else "sdpa",
                             whole_step=mode == "triton-whole")
        pieces = [(0, prompt_len)] if mode != "chunked" else \
            [(a, min(a + chunk, prompt_len)) for a in range(0, prompt_len, chunk)]
        for k, (a, b) in enumerate(pieces):
            out = runner.step(SchedulerOutput(step=k, prefills=tuple(
                PrefillChunk(i, p[a:b], a, b == prompt_len, sp) for i, p in enumerate(prompts)))).new_token_ids
        tokens = [[out[i][0]] for i in range(batch)]
        for k in range(steps - 1):
            out = runner.step(SchedulerOutput(step=100 + k, decodes=tuple(
                DecodeItem(i, tokens[i][-1], prompt_len + k, sp) for i in range(batch)))).new_token_ids
            for i in range(batch):
                tokens[i].append(out[i][0])
        outputs[mode] = tokens
        del runner
    for base, mode in (("graphs", "eager"), ("graphs", "chunked"), ("graphs", "triton"), ("triton", "triton-whole")):
        first_diff = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), None)
                      for x, y in zip(outputs[base], outputs[mode])]
        same = sum(d is None for d in first_diff)
        print(f"check: {same}/{batch} sequences identical over {steps} greedy tokens, {base} vs {mode}; "
              f"first differences at steps {[d for d in first_diff if d is not None]}", flush=True)


def series(decode, n: int, room: int) -> None:
    """``n`` decode steps timed one by one (wall, after a sync): percentiles, then medians of blocks of 25."""
    times = []
    for _ in range(min(n, room)):
        t = time.perf_counter()
        decode()
        times.append(1e3 * (time.perf_counter() - t))
    q = statistics.quantiles(times, n=100)
    print(f"series of {len(times)} decode steps: ms p10 {q[9]:.2f} p50 {q[49]:.2f} p90 {q[89]:.2f} "
          f"p99 {q[98]:.2f} max {max(times):.2f}")
    print("  block medians:", " ".join(f"{statistics.median(times[i:i + 25]):.1f}" for i in range(0, len(times), 25)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-8b")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--weights-dir", default="/tmp/zspeed-profile")
    ap.add_argument("--model", default=None, help="profile this folder (an HF or zcompress folder, e.g. INT4 "
                    "weights) instead of a random checkpoint of --preset; --num-layers must be its layer count")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--offload", choices=("none", "cpu"), default="none")
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--graphs", choices=("auto", "on", "off", "piecewise"), default="auto",
                    help="the runner's CUDA graphs (auto: where supported; with the Triton kernel one per step, "
                    "[Note: whole-step graphs]; piecewise: graphs around each layer's attention even then)")
    ap.add_argument("--attention-kernel", choices=("sdpa", "triton"), default="sdpa",
                    help="the runner's attention (the timed runs; --check compares both)")
    ap.add_argument("--check", type=int, default=0, help="first generate this many greedy tokens per sequence "
                    "at the largest batch with graphs and without, and count where they differ")
    ap.add_argument("--series", type=int, default=0, help="also time this many single decode steps in a row at "
                    "the largest batch and print their spread over time (host-time regimes)")
    args = ap.parse_args()
    folder = Path(args.weights_dir) / f"{args.preset}-{args.num_layers}l-bf16"  # as bench_serve.py names it
    if args.model is not None:
        folder = Path(args.model)
    elif not (folder / "model.safetensors.index.json").exists():
        write_random_checkpoint(args.preset, folder, num_layers=args.num_layers)
    model = load_model(LoadConfig(model=str(folder), offload=args.offload, window=args.window, progress=False))
    sp = SamplingParams()
    graphs = {"auto": None, "on": True, "off": False, "piecewise": True}[args.graphs]
    if args.check:
        check(model, max(args.batch), args.prompt_len, args.check)
    for batch in args.batch:
        runner = ModelRunner(model, max_batch_size=batch + 1, graphs=graphs, attention_kernel=args.attention_kernel,
                             whole_step=args.graphs != "piecewise",
                             max_model_len=args.prompt_len + 64 + args.series + 4 * args.repeat)
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
            if torch.cuda.is_available():  # the device side: kernels (inside graphs too), by device time
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))
            copy_gaps(prof, layers)
        if args.series and batch == max(args.batch):
            series(decode, args.series, runner.max_model_len - pos[0] - 1)
        pos[0] = args.prompt_len
        for i in range(batch):
            runner.free(i)
        del runner
    model.close()


if __name__ == "__main__":
    main()
