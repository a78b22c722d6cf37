"""Serving benchmarks (issue 6): weight streaming vs raw H2D, a model larger than a GPU memory cap beside
DeepSpeed ZeRO-Inference, an open-loop load test over gRPC, and a Llama-70B-shaped model served from disk.

    python benchmarks/bench_serve.py stream  --preset llama-8b --window 3 --batch 1 16 64 --gpu-mem-cap-gib 10
    python benchmarks/bench_serve.py zero-inference --preset llama-8b --batch 1 16 64 --gpu-mem-cap-gib 10
    python benchmarks/bench_serve.py offline --preset llama-8b --offload none --batch 1 32
    python benchmarks/bench_serve.py load    --preset llama-8b --offload none --batch 32 --rate-fractions 0.5 0.8
    python benchmarks/bench_serve.py nvme    --preset llama-70b --num-layers 8 --new-tokens 3
    python benchmarks/bench_serve.py summary --json serve.json        # one line per target, with ratios

Weights are random, of the preset's shape (bf16), written once to ``--weights-dir``
(default /tmp/zspeed-bench) by ``write_random_checkpoint``, one layer in memory at a time;
``--num-layers`` cuts the layer count where host memory or disk is too small (per-layer
figures scale linearly: ``nvme`` prints the extrapolation to the preset's full depth).

Every generation runs B requests of ``--prompt-len`` random tokens, ``--new-tokens`` each
(EOS ignored), after a warm-up of the same shapes. Its step times are split into phases:
prefill (the steps that feed prompts; ``ttft_s`` ends with the last of them) and decode
(``decode_step_s`` = time from the end of the last prefill step to the end of the last
step, over the number of decode steps; scheduler work between steps is included).

stream   raw pinned host->device bandwidth (1 GiB copy, median of 10) and, in the same
         process, the runner with its layers in pinned CPU memory (offload cpu): every decode
         step moves every layer over PCIe once, so its streaming bandwidth is layer bytes /
         decode_step_s; ratio_to_raw is the target (a) figure at batch 1.
offline  the runner alone (no gRPC), any --offload; tokens/s per phase.
zero-inference  the peer: HF generate on the same checkpoint under DeepSpeed ZeRO-3 with
         offload_param cpu (pinned), i.e. ZeRO-Inference, one process (no launcher), same
         batches and lengths; prefill and decode timed by forward hooks. ``--engine hf``
         runs plain HF generate instead (the same harness; CPU dry runs).
         With ``--gpu-mem-cap-gib X`` (stream, offline, zero-inference) each process's
         caching allocator is capped at X GiB, so a model larger than X must stream in both.
load     offline tokens/s at each --batch (same scheduler limits as the server), then
         ``zserve`` in a subprocess on loopback: a warm-up, a saturation run (--requests at
         once) compared with offline at the largest batch, then open-loop Poisson arrivals
         at --rates req/s and at --rate-fractions of the saturation request rate; each
         bounded by --requests and --max-seconds. p50/p99 TTFT and inter-token latency.
         Before each rate is measured, --rate-warmups unmeasured passes at that rate (other
         arrival seeds) run its mix of batch shapes once: the warm-up of one full batch covers
         only batch-sized shapes, and on the CPU the first step of every new packed length
         pays ~3 ms of oneDNN bf16 matmul setup (a cold run's ITL p99 counts those steps).
nvme     ``zserve --offload nvme`` in a subprocess (layers in O_DIRECT files under
         --nvme-path), one real gRPC request; decode step, per-layer time, effective disk
         bandwidth beside ``dd iflag=direct`` over the first layer's files (afterwards: the very
         files the server streamed), extrapolation to the preset's full depth.
summary  reads the JSON rows (--json) and prints one line per target: value, peer or limit, ratio.
env      versions (torch, transformers, deepspeed, grpcio, protobuf), whether zserve imports, free disk.
Rows go to stdout as JSON lines and are appended, as they come, to ``--json FILE``.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as zserve: idle OpenMP workers must not starve our threads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # serve_peer.py: the DeepSpeed peer; bench_stream.py: raw H2D
from bench_stream import raw_h2d as raw_h2d_gbps  # noqa: E402  (one raw-copy measurement for both benchmarks)
from zspeed.core.device import DeviceHandle  # noqa: E402
from zspeed.serve.engine_loop import EngineLoop  # noqa: E402
from zspeed.serve.model_loader import LoadConfig, load_model  # noqa: E402
from zspeed.serve.presets import PRESETS, is_complete, preset_config, write_random_checkpoint  # noqa: E402
from zspeed.serve.request import Request, SamplingParams  # noqa: E402
from zspeed.serve.runner import ModelRunner  # noqa: E402
from zspeed.serve.scheduler import RunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput  # noqa: E402

JSON_PATH: Path | None = None
GIB = 1 << 30


def emit(**row) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if JSON_PATH is not None:
        with JSON_PATH.open("a") as f:
            f.write(line + "\n")


def note(msg: str) -> None:
    print(f"[bench_serve] {msg}", file=sys.stderr, flush=True)


# -- shared ---------------------------------------------------------------------------------------------------------
def num_layers(args) -> int:
    return args.num_layers or PRESETS[args.preset]["num_hidden_layers"]


def weights(args) -> Path:
    out = Path(args.weights_dir) / f"{args.preset}-{num_layers(args)}l-bf16"
    if not is_complete(out):
        start = time.perf_counter()
        note(f"writing random {args.preset} weights ({num_layers(args)} layers) to {out}")
        write_random_checkpoint(args.preset, out, num_layers=args.num_layers, dtype=torch.bfloat16)
        note(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return out


def bench_device(args) -> DeviceHandle:
    return DeviceHandle.auto() if args.device == "auto" else DeviceHandle.for_device(args.device)


def apply_cap(args, dev: DeviceHandle) -> dict:
    """Caps this process's device memory at --gpu-mem-cap-gib (CUDA only); the row says whether it holds."""
    if args.gpu_mem_cap_gib is None:
        return {"gpu_mem_cap_gib": None}
    if not dev.is_cuda:
        note("--gpu-mem-cap-gib has no effect on the CPU (dry run)")
        return {"gpu_mem_cap_gib": args.gpu_mem_cap_gib, "cap_applied": False}
    dev.limit_memory(int(args.gpu_mem_cap_gib * GIB))
    return {"gpu_mem_cap_gib": args.gpu_mem_cap_gib, "cap_applied": True,
            "device_total_gib": dev.total_memory() / GIB}


def fit_fields(model_bytes: int, cap: dict) -> dict:
    """``model_gb`` and, under a cap, whether the model could have been held (it must not, for target b)."""
    out = {"model_gb": model_bytes / 1e9}
    if cap.get("gpu_mem_cap_gib") is not None:
        out["exceeds_cap"] = model_bytes > cap["gpu_mem_cap_gib"] * GIB
        if not out["exceeds_cap"]:
            note(f"the model ({model_bytes / 1e9:.2f} GB) fits under the cap: this is not a does-not-fit run")
    return out


def layer_parameters(config) -> int:
    """Parameters of one Llama decoder layer of ``config`` (projections and two norms)."""
    h, ffn = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    return h * q + 2 * h * kv + q * h + 3 * h * ffn + 2 * h


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 30000)) for _ in range(length)] for _ in range(n)]


def release_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- phases of a generation -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StepTime:
    start: float
    end: float
    prefill_tokens: int
    decodes: int


class TimedRunner:
    """A :class:`ModelRunner` that notes each step's host start and end (``step`` returns after its
    sampled tokens reached the host, so ``end`` follows the device's work)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.inner = runner
        self.steps: list[StepTime] = []

    def step(self, batch: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        out = self.inner.step(batch)
        self.steps.append(StepTime(start, time.perf_counter(), sum(len(c.token_ids) for c in batch.prefills),
                                   len(batch.decodes)))
        return out

    def free(self, seq_id: int) -> None:
        self.inner.free(seq_id)


def phases(steps: list[StepTime], start: float) -> dict:
    """Prefill and decode figures of the steps of one generation that began at ``start``."""
    prefill = [s for s in steps if s.prefill_tokens]
    prefill_end = max((s.end for s in prefill), default=start)
    decode = [s for s in steps if not s.prefill_tokens and s.start >= prefill_end]
    row = {"ttft_s": prefill_end - start, "prefill_s": sum(s.end - s.start for s in prefill),
           "prefill_steps": len(prefill), "decode_steps": len(decode)}
    if decode:
        span = decode[-1].end - prefill_end
        row.update(decode_step_s=span / len(decode), decode_tokens_per_s=sum(s.decodes for s in decode) / span,
                   decode_step_runner_median_s=statistics.median(s.end - s.start for s in decode))
    return row


def scheduler_config(*, batch: int, budget: int, max_model_len: int, queue: int) -> SchedulerConfig:
    return SchedulerConfig(max_batch_size=batch, max_num_batched_tokens=max(budget, batch),
                           max_model_len=max_model_len, max_queue_size=queue)


def offline_run(model, args, *, batch: int) -> dict:
    """B requests admitted at once through the engine loop, after a warm-up of the same shapes."""
    max_model_len = args.prompt_len + args.new_tokens + 8
    runner = TimedRunner(ModelRunner(model, max_batch_size=batch, max_model_len=max_model_len,
                                     attention_kernel=args.attention_kernel))
    config = scheduler_config(batch=batch, budget=args.max_num_batched_tokens, max_model_len=max_model_len,
                              queue=batch)
    vocab = model.description.vocab_size
    model.device.reset_peak_memory()
    with EngineLoop(Scheduler(config, kv_capacity=runner.inner.kv_capacity), runner) as engine:
        def generate(tag: str, new_tokens: int) -> list:
            sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
            handles = [engine.submit(Request(request_id=f"{tag}{i}", prompt_token_ids=p, sampling=sampling))
                       for i, p in enumerate(prompts(batch, args.prompt_len, vocab))]
            return [h.result() for h in handles]

        generate("warmup", 3)  # the same shapes: kernels load and caches fill outside the timed run
        runner.steps.clear()
        start = time.perf_counter()
        results = generate("r", args.new_tokens)
        seconds = time.perf_counter() - start
    generated = sum(len(r.token_ids) for r in results)
    return {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "budget_tokens": config.max_num_batched_tokens, "generated_tokens": generated, "seconds": seconds,
            "tokens_per_s": generated / seconds, "peak_device_gb": model.device.max_memory_allocated() / 1e9,
            **phases(runner.steps, start), "first_tokens": list(results[0].token_ids[:8])}


def load(args, offload: str):
    nvme = args.nvme_path or str(Path(args.weights_dir) / f"{args.preset}-{num_layers(args)}l-store")
    return load_model(LoadConfig(model=str(weights(args)), offload=offload, nvme_path=nvme if offload == "nvme"
                                 else None, window=args.window, device=args.device, progress=False))


def model_bytes(model) -> int:
    resident = sum(p.numel() * p.element_size() for m in (model.embed, model.norm, model.lm_head)
                   for p in m.parameters())
    layers = getattr(model.layers, "store", None)
    if layers is not None:
        return resident + layers.nbytes()
    return resident + sum(p.numel() * p.element_size() for i in range(len(model.layers))
                          for p in model.layers.acquire(i).parameters())


# -- stream and offline ---------------------------------------------------------------------------------------------
def cmd_offline(args, *, bench: str = "offline", offload: str | None = None) -> None:
    dev = bench_device(args)
    cap = apply_cap(args, dev)
    raw = raw_h2d_gbps(dev) if bench == "stream" and dev.is_cuda else float("nan")
    release_device_memory()
    model = load(args, offload or args.offload)
    desc = model.description
    streamed = getattr(model.layers, "store", None)
    layer_bytes = streamed.nbytes() if streamed is not None else 0
    if streamed is not None and args.window >= desc.num_layers:
        note("window >= layers: the layers stay resident and nothing streams")
    base = {"bench": bench, "preset": args.preset, "layers": desc.num_layers, "offload": desc.offload.value,
            "window": args.window, "device": str(dev), **cap, **fit_fields(model_bytes(model), cap)}
    for batch in args.batch:
        before = model.layers.streamer.stats if streamed is not None else None
        row = offline_run(model, args, batch=batch)
        if streamed is not None:
            stats = model.layers.streamer.stats
            moved, transfer = stats.bytes_moved - before.bytes_moved, stats.transfer_seconds - before.transfer_seconds
            row.update(layer_bytes=layer_bytes, streamer_gbps=moved / transfer / 1e9 if transfer else float("nan"))
            if "decode_step_s" in row:
                row["effective_stream_gbps"] = layer_bytes / row["decode_step_s"] / 1e9
        if bench == "stream" and "effective_stream_gbps" in row:
            row.update(raw_h2d_gbps=raw, ratio_to_raw=row["effective_stream_gbps"] / raw,
                       pure_transfer_step_s=layer_bytes / raw / 1e9)
        emit(**base, **row)
        release_device_memory()
    model.close()


def cmd_stream(args) -> None:
    cmd_offline(args, bench="stream", offload="cpu")


# -- load: zserve on loopback ---------------------------------------------------------------------------------------
def start_server(args, *, batch: int, offload: str, nvme_path: str | None = None) -> tuple[subprocess.Popen, int]:
    """``zserve`` in a subprocess (same process group: an outer ``timeout`` stops it too); its port."""
    # -P: the repository root (the working directory) stays off sys.path, so its top-level folders (kernels/,
    # core/, ...) are not found as packages of those names by code that probes for them (transformers does)
    cmd = [sys.executable, "-P", "-m", "zspeed.serve.cli", "--model", str(weights(args)), "--offload", offload,
           "--window", str(args.window), "--device", args.device, "--port", "0", "--no-progress",
           "--max-batch-size", str(batch), "--max-queue-size", str(max(args.requests, batch)),
           "--max-num-batched-tokens", str(max(args.max_num_batched_tokens, batch)),
           "--max-model-len", str(args.prompt_len + args.new_tokens + 8), "--max-new-tokens", str(args.new_tokens)]
    if nvme_path:
        cmd += ["--nvme-path", nvme_path]
    if not args.engine_process:
        cmd.append("--no-engine-process")
    if args.step_log:
        cmd += ["--step-log", args.step_log]
    if args.max_prefill_tokens_per_step is not None:  # 0: no cap; unset: zserve's default
        cmd += ["--max-prefill-tokens-per-step", str(args.max_prefill_tokens_per_step)]
    if args.prefill_pacing_steps is not None:  # 0: no pacing; unset: zserve's default
        cmd += ["--prefill-pacing-steps", str(args.prefill_pacing_steps)]
    cmd += ["--attention-kernel", args.attention_kernel]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write("[zserve] " + line)
        found = re.search(r"listening on \S+:(\d+)", line)
        if found:
            threading.Thread(target=lambda: [sys.stderr.write("[zserve] " + x) for x in proc.stderr],
                             daemon=True).start()
            return proc, int(found.group(1))
    raise RuntimeError(f"zserve exited with {proc.wait()} before listening")


def stop_server(proc: subprocess.Popen, *, grace: float = 60.0) -> None:
    proc.terminate()  # drains: requests in flight finish
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def one_request(stub, pb, prompt: list[int], new_tokens: int, record: list) -> None:
    """Streams one request; its entry in ``record`` fills as tokens arrive (an interrupted run keeps them)."""
    msg = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=new_tokens, ignore_eos=True)
    entry = {"sent": time.perf_counter(), "times": [], "counts": [], "done": False}
    record.append(entry)
    async for piece in stub.GenerateStream(msg):
        if piece.token_ids:
            entry["times"].append(time.perf_counter())
            entry["counts"].append(len(piece.token_ids))
    entry["done"] = True


def request_stats(entry: dict) -> dict | None:
    """TTFT, inter-token latencies (a message carrying n steps' tokens shares its gap among them), tokens."""
    times, counts = entry["times"], entry["counts"]
    if not times:
        return None
    itl = [(b - a) / n for a, b, n in zip(times, times[1:], counts[1:]) for _ in range(n)]
    return {"sent": entry["sent"], "ttft": times[0] - entry["sent"], "itl": itl, "tokens": sum(counts),
            "end": times[-1]}


async def open_loop(stub, pb, *, rate: float | None, n: int, args, vocab: int, new_tokens: int | None = None,
                    seed: int = 2) -> dict:
    """``n`` requests, all at once (rate None) or with Poisson arrivals; arrivals stop after --max-seconds
    and the wait for completions is bounded too (requests still running then count as timed out)."""
    record: list[dict] = []
    rng = random.Random(seed)
    t_start = time.monotonic()
    tasks, start = [], time.perf_counter()
    arrival = start
    for p in prompts(n, args.prompt_len, vocab, seed=seed):
        if rate is not None:
            arrival += rng.expovariate(rate)
            if arrival - start > args.max_seconds:
                break
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(one_request(stub, pb, p, new_tokens or args.new_tokens, record)))
    done, pending = await asyncio.wait(tasks, timeout=args.max_seconds + 60)
    for t in pending:
        t.cancel()
    errors = [repr(t.exception()) for t in done if not t.cancelled() and t.exception() is not None]
    if errors:
        note(f"{len(errors)} requests failed, e.g. {errors[0]}")
    record = [request_stats(e) for e in record if e["done"]]
    if not record:
        return {"rate_rps": rate, "requests_sent": len(tasks), "requests_done": 0, "errors": len(errors)}
    itl = [x for r in record for x in r["itl"]]
    span = max(r["end"] for r in record) - min(r["sent"] for r in record)
    ttft = [r["ttft"] for r in record]
    return {"rate_rps": rate, "requests_sent": len(tasks), "requests_done": len(record), "errors": len(errors),
            "t_start": t_start, "t_end": time.monotonic(), "timed_out": len(pending), "span_s": span,
            "tokens_per_s": sum(r["tokens"] for r in record) / span,
            "requests_per_s": len(record) / span, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90), "itl_p95_s": percentile(itl, 95),
            "itl_p99_s": percentile(itl, 99), "itl_max_s": max(itl, default=float("nan")),
            "itl_p99_over_p50": percentile(itl, 99) / percentile(itl, 50) if itl else float("nan")}


async def load_session(port: int, args, *, batch: int, offline_tps: float | None, vocab: int) -> None:
    import grpc

    from zspeed.serve._proto import serve_pb2, serve_pb2_grpc

    base = {"bench": "load", "preset": args.preset, "layers": num_layers(args), "offload": args.offload,
            "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "budget_tokens": max(args.max_num_batched_tokens, batch), "engine_process": args.engine_process,
            "prefill_cap": args.max_prefill_tokens_per_step, "prefill_pacing": args.prefill_pacing_steps,
            "attention_kernel": args.attention_kernel}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = serve_pb2_grpc.GenerationServiceStub(channel)
        await open_loop(stub, serve_pb2, rate=None, n=batch, args=args, vocab=vocab, new_tokens=3, seed=1)  # warm-up
        sat = await open_loop(stub, serve_pb2, rate=None, n=args.requests, args=args, vocab=vocab)
        extra = {"offline_tokens_per_s": offline_tps}
        if offline_tps and "tokens_per_s" in sat:
            extra["ratio_to_offline"] = sat["tokens_per_s"] / offline_tps
        emit(**base, saturation=True, **sat, **extra)
        rates = [*args.rates, *[f * sat.get("requests_per_s", 0.0) for f in args.rate_fractions]]
        for rate in (r for r in rates if r > 0):
            for i in range(args.rate_warmups):  # unmeasured: this rate's batch shapes run once (see load)
                await open_loop(stub, serve_pb2, rate=rate, n=args.requests, args=args, vocab=vocab, seed=100 + i)
            row = await open_loop(stub, serve_pb2, rate=rate, n=args.requests, args=args, vocab=vocab, seed=3)
            emit(**base, saturation=False, saturation_rps=sat.get("requests_per_s"), rate_warmups=args.rate_warmups,
                 **row)


def cmd_load(args) -> None:
    batch = max(args.batch)
    offline: dict[int, float] = {}
    if not args.skip_offline:
        model = load(args, args.offload)
        for b in sorted(set(args.batch)):
            row = offline_run(model, args, batch=b)
            emit(bench="offline", preset=args.preset, layers=model.description.num_layers, offload=args.offload, **row)
            offline[b] = row["tokens_per_s"]
        model.close()
        del model
        release_device_memory()
    proc, port = start_server(args, batch=batch, offload=args.offload, nvme_path=args.nvme_path)
    grace = 3.0  # interrupted: do not wait for a drain
    try:
        asyncio.run(load_session(port, args, batch=batch, offline_tps=offline.get(batch),
                                 vocab=preset_config(args.preset).vocab_size))
        grace = 60.0
    finally:
        stop_server(proc, grace=grace)


# -- nvme: a model served from disk over gRPC -------------------------------------------------------------------------
def dd_direct_gbps(paths: list[Path]) -> float:
    """``dd iflag=direct bs=16M`` over ``paths`` one after another: bytes / seconds (nan where O_DIRECT or dd
    is unavailable)."""
    total_bytes, total_s = 0, 0.0
    for path in paths:
        try:
            out = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return float("nan")
        found = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out.stderr)
        if not found:
            return float("nan")
        total_bytes, total_s = total_bytes + int(found.group(1)), total_s + float(found.group(2))
    return total_bytes / total_s / 1e9 if total_s else float("nan")


def cmd_nvme(args) -> None:
    ckpt = weights(args)
    config = preset_config(args.preset, num_layers=num_layers(args))
    layer_bytes = layer_parameters(config) * 2  # bf16
    layers, full = config.num_hidden_layers, PRESETS[args.preset]["num_hidden_layers"]
    row = {"bench": "nvme", "preset": args.preset, "layers": layers, "window": args.window,
           "layer_bytes": layer_bytes, "dd_direct_gbps": float("nan"), "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "completed": False}
    nvme_path = args.nvme_path or str(Path(args.weights_dir) / f"{args.preset}-{layers}l-store")
    record: list[dict] = []
    proc, start = None, time.perf_counter()
    try:
        proc, port = start_server(args, batch=1, offload="nvme", nvme_path=nvme_path)
        row["server_load_s"] = time.perf_counter() - start
        asyncio.run(_one_grpc_request(port, args, config.vocab_size, record))
        # after the request, so the files are long written back: the very files the server streamed
        first_layer = sorted(Path(nvme_path).glob("model.layers.0.*")) or sorted(ckpt.glob("model-*"))[1:2]
        row["dd_direct_gbps"] = dd_direct_gbps(first_layer)
    except BaseException as e:  # a timeout or an outer SIGTERM: report what arrived, then go on unwinding
        row["error"] = repr(e)
        raise
    finally:
        _nvme_figures(row, record, layers=layers, full=full)
        emit(**row)
        if proc is not None:
            stop_server(proc, grace=3.0 if "error" in row else 60.0)


def _nvme_figures(row: dict, record: list[dict], *, layers: int, full: int) -> None:
    """Per-layer time from the decode steps that arrived (even if the request did not finish)."""
    stats = request_stats(record[0]) if record else None
    if stats is None:
        return
    row.update(completed=record[0]["done"], tokens=stats["tokens"], ttft_s=stats["ttft"])
    if stats["itl"]:
        step = statistics.median(stats["itl"])
        per_layer = step / layers
        disk = row["layer_bytes"] / per_layer / 1e9
        row.update(decode_step_s=step, per_layer_s=per_layer, disk_gbps=disk, ratio_to_dd=disk / row["dd_direct_gbps"],
                   full_layers=full, extrapolated_step_s=per_layer * full,
                   extrapolated_tokens_per_s_batch1=1 / (per_layer * full))


async def _one_grpc_request(port: int, args, vocab: int, record: list) -> None:
    import grpc

    from zspeed.serve._proto import serve_pb2, serve_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = serve_pb2_grpc.GenerationServiceStub(channel)
        prompt = prompts(1, args.prompt_len, vocab, seed=4)[0]
        await asyncio.wait_for(one_request(stub, serve_pb2, prompt, args.new_tokens, record), args.max_seconds)


# -- the peer: DeepSpeed ZeRO-Inference (serve_peer.py) ----------------------------------------------------------
def cmd_zero_inference(args) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from serve_peer import ForwardTimer, hf_generate, zero_inference_model

    dev = bench_device(args)
    cap = apply_cap(args, dev)
    path = weights(args)
    if args.engine == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            emit(bench="zero-inference", engine="deepspeed", preset=args.preset, skipped="deepspeed is not installed")
            return
        if not dev.is_cuda:
            raise SystemExit("zero-inference with --engine deepspeed needs a CUDA device (use --engine hf to dry-run)")
        prefetch = layer_parameters(AutoConfig.from_pretrained(path))  # one decoder layer ahead
        model, ds_config, _keep = zero_inference_model(path, dev, prefetch_elems=prefetch)
    else:
        model, ds_config = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev.device).eval(), None
    total_bytes = int(json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["total_size"])
    timer = ForwardTimer(model, dev)
    base = {"bench": "zero-inference", "engine": args.engine, "preset": args.preset,
            "layers": model.config.num_hidden_layers, "device": str(dev), **cap, **fit_fields(total_bytes, cap),
            "ds_zero": ds_config and ds_config["zero_optimization"]}
    for batch in args.batch:
        ids = torch.tensor(prompts(batch, args.prompt_len, model.config.vocab_size), device=dev.device)
        dev.reset_peak_memory()
        hf_generate(model, ids, 3)  # warm-up, same shapes
        timer.calls.clear()
        dev.synchronize()
        start = time.perf_counter()
        out = hf_generate(model, ids, args.new_tokens)
        dev.synchronize()
        seconds = time.perf_counter() - start
        generated = (out.shape[1] - ids.shape[1]) * batch
        emit(**base, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens, generated_tokens=generated,
             seconds=seconds, tokens_per_s=generated / seconds, peak_device_gb=dev.max_memory_allocated() / 1e9,
             **timer.phases(start, batch), first_tokens=out[0, ids.shape[1]:ids.shape[1] + 8].tolist())
        release_device_memory()


# -- summary ----------------------------------------------------------------------------------------------------------
def _verdict(ratio: float, *, at_least: float | None = None, at_most: float | None = None) -> str:
    if ratio is None or math.isnan(ratio):
        return "n/a"
    ok = (at_least is None or ratio >= at_least) and (at_most is None or ratio <= at_most)
    return "MET" if ok else "NOT MET"


def cmd_summary(args) -> None:
    """One line per target from the rows in --json (see benchmarks/RESULTS.md, issue 6)."""
    rows = [json.loads(x) for x in Path(args.json).read_text().splitlines() if x.strip()]
    by = lambda bench: [r for r in rows if r.get("bench") == bench]  # noqa: E731
    for r in by("stream"):
        if "ratio_to_raw" not in r:
            continue
        target = (f"target >= 0.90: {_verdict(r['ratio_to_raw'], at_least=0.9)}" if r["batch"] == 1
                  else "the target is at batch 1")
        print(f"SUMMARY (a) stream {r['preset']} {r['layers']}l window {r['window']} batch {r['batch']}: decode step "
              f"{r['decode_step_s'] * 1e3:.1f} ms vs {r['pure_transfer_step_s'] * 1e3:.1f} ms of pure transfer; "
              f"{r['effective_stream_gbps']:.1f} GB/s vs raw H2D {r['raw_h2d_gbps']:.1f} GB/s = "
              f"{r['ratio_to_raw']:.3f}x ({target}); "
              f"prefill {r['prefill_s']:.3f} s (TTFT {r['ttft_s']:.3f} s)")
    peers = {}  # a DeepSpeed row wins over an HF one (dry runs) of the same shape
    for r in sorted(by("zero-inference"), key=lambda r: r.get("engine") == "deepspeed"):
        if "tokens_per_s" in r:
            peers[(r["preset"], r["layers"], r["batch"], r["prompt_len"], r["new_tokens"])] = r
    for r in by("stream") + by("offline"):
        peer = peers.get((r["preset"], r["layers"], r["batch"], r["prompt_len"], r["new_tokens"]))
        if (peer is None or "decode_tokens_per_s" not in r or "decode_tokens_per_s" not in peer
                or r.get("gpu_mem_cap_gib") != peer.get("gpu_mem_cap_gib")):
            continue  # only the same model, shape and memory cap are compared
        cap = r.get("gpu_mem_cap_gib")
        if not (r.get("cap_applied") and peer.get("cap_applied")):
            fits = f"CAUTION: no memory cap applied (cap {cap})"
        elif r.get("exceeds_cap") and peer.get("exceeds_cap"):
            fits = f"model {r['model_gb']:.1f} GB > cap {cap} GiB applied to both: both stream"
        else:
            fits = f"CAUTION: the model fits under the cap of {cap} GiB"
        dec, tot = r["decode_tokens_per_s"] / peer["decode_tokens_per_s"], r["tokens_per_s"] / peer["tokens_per_s"]
        name = "ZeRO-Inference" if peer["engine"] == "deepspeed" else "plain HF generate (not the peer)"
        same = "same" if r.get("first_tokens") == peer.get("first_tokens") else "different"
        print(f"SUMMARY (b) {r['bench']} {r['preset']} {r['layers']}l offload {r['offload']} batch {r['batch']} "
              f"({r['prompt_len']}+{r['new_tokens']} tokens; {fits}): decode {r['decode_tokens_per_s']:.1f} tok/s vs "
              f"{name} {peer['decode_tokens_per_s']:.1f} = {dec:.2f}x; end to end {r['tokens_per_s']:.1f} vs "
              f"{peer['tokens_per_s']:.1f} = {tot:.2f}x; prefill {r['prefill_s']:.2f} s vs {peer['prefill_s']:.2f} s; "
              f"peak GPU {r['peak_device_gb']:.1f} vs {peer['peak_device_gb']:.1f} GB; first tokens {same}")
    for r in by("load"):
        tag = (f"{'engine process' if r.get('engine_process', True) else 'one process'}, budget {r['budget_tokens']}"
               + (f", prefill cap {r['prefill_cap']}" if r.get("prefill_cap") else "")
               + (f", pacing {r['prefill_pacing']}" if r.get("prefill_pacing") is not None else "")
               + (f", {r['attention_kernel']} attention" if r.get("attention_kernel", "auto") != "auto" else ""))
        if r.get("requests_done", 0) == 0:
            print(f"SUMMARY (c) load rate {r.get('rate_rps')}: no request completed ({r.get('errors')} errors)")
        elif r.get("saturation"):
            ratio = r.get("ratio_to_offline", float("nan"))
            print(f"SUMMARY (c) load [{tag}] saturation batch {r['batch']} ({r['requests_done']} requests): "
                  f"{r['tokens_per_s']:.1f} tok/s vs offline {r.get('offline_tokens_per_s') or float('nan'):.1f} = "
                  f"{ratio:.3f}x (target >= 0.90: {_verdict(ratio, at_least=0.9)}); TTFT p50/p99 "
                  f"{r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f} s; ITL p50/p99 {r['itl_p50_s'] * 1e3:.1f}/"
                  f"{r['itl_p99_s'] * 1e3:.1f} ms; {r['errors']} errors, {r['timed_out']} timed out")
        else:
            frac = r["rate_rps"] / r["saturation_rps"] if r.get("saturation_rps") else float("nan")
            print(f"SUMMARY (c) load [{tag}] rate {r['rate_rps']:.2f} req/s ({frac:.2f} of saturation, "
                  f"{r['requests_done']} requests after {r.get('rate_warmups', 0)} warm-up passes, "
                  f"{r['tokens_per_s']:.1f} tok/s): "
                  f"TTFT p50/p99 {r['ttft_p50_s']:.3f}/"
                  f"{r['ttft_p99_s']:.3f} s; "
                  f"ITL p50/p99 {r['itl_p50_s'] * 1e3:.1f}/{r['itl_p99_s'] * 1e3:.1f} ms = "
                  f"{r['itl_p99_over_p50']:.2f}x (target <= 1.2: {_verdict(r['itl_p99_over_p50'], at_most=1.2)})")
    for r in by("nvme"):
        state = f"completed ({r['tokens']} tokens)" if r.get("completed") else \
            f"did NOT complete ({r.get('tokens', 0)} tokens arrived; {r.get('error', '')})"
        if "per_layer_s" not in r:
            print(f"SUMMARY (d) nvme {r['preset']} {r['layers']}l over gRPC: {state}; no decode step to time")
            continue
        print(f"SUMMARY (d) nvme {r['preset']} {r['layers']}l over gRPC: {state}; decode step "
              f"{r['decode_step_s']:.2f} s = {r['per_layer_s'] * 1e3:.0f} ms/layer of {r['layer_bytes'] / 1e9:.2f} GB "
              f"-> {r['disk_gbps']:.2f} GB/s vs dd O_DIRECT {r['dd_direct_gbps']:.2f} GB/s = {r['ratio_to_dd']:.2f}x; "
              f"extrapolated to {r['full_layers']} layers: {r['extrapolated_step_s']:.1f} s/token at batch 1 "
              f"({r['extrapolated_tokens_per_s_batch1']:.3f} tok/s); TTFT {r['ttft_s']:.1f} s; "
              f"server load {r.get('server_load_s', float('nan')):.0f} s")


def cmd_env(args) -> None:
    """What the other commands need: versions, the gRPC stubs (they check grpcio/protobuf at import), disk, memory."""
    import importlib.metadata as md
    import shutil

    versions = {}
    for name in ("torch", "transformers", "deepspeed", "grpcio", "protobuf", "grpcio-health-checking",
                 "grpcio-reflection", "safetensors"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    try:
        import zspeed.serve.server  # noqa: F401
        server = "ok"
    except Exception as e:  # reported, not raised: the other steps still run
        server = f"FAILED ({e!r}): load and nvme cannot start zserve"
    Path(args.weights_dir).mkdir(parents=True, exist_ok=True)
    emit(bench="env", **versions, server_import=server, cuda=torch.cuda.is_available(),
         gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
         weights_dir_free_gb=shutil.disk_usage(args.weights_dir).free / 1e9,
         host_ram_gb=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, cpus=os.cpu_count())


# -- main -----------------------------------------------------------------------------------------------------
COMMANDS = {"stream": cmd_stream, "offline": cmd_offline, "load": cmd_load, "nvme": cmd_nvme,
            "zero-inference": cmd_zero_inference, "summary": cmd_summary, "env": cmd_env}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench", choices=sorted(COMMANDS))
    p.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    p.add_argument("--num-layers", type=int)
    p.add_argument("--weights-dir", default="/tmp/zspeed-bench")
    p.add_argument("--offload", default="cpu", choices=("none", "cpu", "nvme"))
    p.add_argument("--nvme-path", help="offload nvme: layer files (default: beside the weights)")
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-mem-cap-gib", type=float, help="cap this process's GPU memory (stream, offline, "
                   "zero-inference): a model larger than the cap must stream")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of a step (offline and "
                   "the server alike)")
    p.add_argument("--engine", default="deepspeed", choices=("deepspeed", "hf"), help="zero-inference: the peer")
    p.add_argument("--rates", type=float, nargs="*", default=[], help="load: Poisson arrival rates, req/s")
    p.add_argument("--rate-fractions", type=float, nargs="*", default=[],
                   help="load: arrival rates as fractions of the measured saturation request rate")
    p.add_argument("--requests", type=int, default=64, help="load: requests per rate (at most)")
    p.add_argument("--max-seconds", type=float, default=30.0, help="load/nvme: stop arrivals (wait) after this")
    p.add_argument("--skip-offline", action="store_true", help="load: do not measure the offline throughput")
    p.add_argument("--max-prefill-tokens-per-step", type=int, help="load: zserve's cap on prompt tokens per step "
                   "while sequences decode (0: none; default: zserve's)")
    p.add_argument("--prefill-pacing-steps", type=int, help="load: zserve's prefill pacing (0: none; "
                   "default: zserve's)")
    p.add_argument("--attention-kernel", choices=("auto", "sdpa", "triton"), default="auto",
                   help="offline runner and zserve: attention through SDPA or the Triton slot kernel")
    p.add_argument("--step-log", help="load: zserve appends a JSON line per step here (rows carry t_start/t_end "
                   "on the same monotonic clock, to tell the passes apart)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="load/nvme: zserve runs the model in a process of its own (its default)")
    p.add_argument("--rate-warmups", type=int, default=1, help="load: unmeasured passes at each rate before "
                   "measuring it (0: measure cold)")
    p.add_argument("--json", help="append result rows here (summary: read them from here)")
    return p.parse_args(argv)


def _on_sigterm(*_) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main() -> None:
    global JSON_PATH
    args = parse_args()
    if args.bench != "summary" and args.json:
        JSON_PATH = Path(args.json)
    # An outer `timeout` sends SIGTERM (to us and to our process group, so maybe twice): unwind once,
    # so that rows so far are written and a zserve child is stopped.
    signal.signal(signal.SIGTERM, _on_sigterm)
    COMMANDS[args.bench](args)


if __name__ == "__main__":
    main()
