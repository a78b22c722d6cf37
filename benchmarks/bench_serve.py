"""Serving benchmarks: weight streaming vs raw H2D, offline tokens/s, and an open-loop load test over gRPC.

    python benchmarks/bench_serve.py stream  --preset llama-8b --num-layers 16 --window 3
    python benchmarks/bench_serve.py offline --preset llama-70b --num-layers 40 --offload cpu --batch 1 16 64
    python benchmarks/bench_serve.py load    --preset llama-8b --offload none --batch 32 --rates 2 4 8 --requests 200
    python benchmarks/bench_serve.py zero-inference --preset llama-70b --num-layers 40 --batch 16   # DeepSpeed peer

Weights are random, of the preset's shape (bf16), written once to
``--weights-dir`` (default /tmp/zspeed-bench) by ``write_random_checkpoint``;
``--num-layers`` cuts the layer count where host memory or disk is too small
(per-layer figures scale linearly: write the extrapolation down with the result).

stream   raw pinned host->device bandwidth (1 GiB copy, median of 10) and, in the same
         process, decode steps of a streamed model (offload cpu, batch 1: compute is
         small, so a step is one pass of every layer's weights over PCIe): effective
         streaming bandwidth = layer bytes per step / step time, and its ratio to raw.
offline  the runner alone (no gRPC): B requests of --prompt-len tokens generating
         --new-tokens each, all admitted at once; generated tokens/s, step time.
load     ``zserve`` in a subprocess on loopback; Poisson arrivals at each --rates (req/s),
         bounded by --requests and --max-seconds per rate; p50/p99 time to first token
         and inter-token latency, throughput; plus a saturation run (all requests at
         once) to compare with the offline throughput at the same batch.
zero-inference  DeepSpeed ZeRO-3 with offload_param cpu + HF generate on the same
         checkpoint and batch (needs deepspeed; run under ``deepspeed --num_gpus 1``).
Results go to stdout as JSON lines (and ``--json FILE``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from zspeed.core.device import DeviceHandle
from zspeed.serve.engine_loop import EngineLoop
from zspeed.serve.model_loader import LoadConfig, load_model
from zspeed.serve.presets import PRESETS, is_complete, preset_config, write_random_checkpoint
from zspeed.serve.request import Request, SamplingParams
from zspeed.serve.runner import ModelRunner
from zspeed.serve.scheduler import Scheduler, SchedulerConfig

RESULTS: list[dict] = []


def emit(**row) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def weights(args) -> Path:
    layers = args.num_layers or PRESETS[args.preset]["num_hidden_layers"]
    out = Path(args.weights_dir) / f"{args.preset}-{layers}l-bf16"
    if not is_complete(out):
        print(f"writing random {args.preset} weights ({layers} layers) to {out}", file=sys.stderr)
        write_random_checkpoint(args.preset, out, num_layers=args.num_layers, dtype=torch.bfloat16)
    return out


def load(args, offload: str):
    return load_model(LoadConfig(model=str(weights(args)), offload=offload, nvme_path=args.nvme_path,
                                 window=args.window, device=args.device))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 30000)) for _ in range(length)] for _ in range(n)]


# -- stream -------------------------------------------------------------------------------------------------------
def raw_h2d_gbps(dev: DeviceHandle, nbytes: int = 1 << 30) -> float:
    src = dev.pinned_empty((nbytes,), dtype=torch.uint8)
    dst = dev.empty((nbytes,), dtype=torch.uint8)
    times = []
    for _ in range(12):
        start, end = dev.new_event(timing=True), dev.new_event(timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        times.append(dev.elapsed_seconds(start, end))
    return nbytes / statistics.median(times[2:]) / 1e9


def offline_run(model, *, batch: int, prompt_len: int, new_tokens: int, max_model_len: int) -> dict:
    runner = ModelRunner(model, max_batch_size=batch, max_model_len=max_model_len)
    config = SchedulerConfig(max_batch_size=batch, max_num_batched_tokens=max(batch * prompt_len, batch),
                             max_model_len=max_model_len, max_queue_size=batch)
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with EngineLoop(Scheduler(config, kv_capacity=runner.kv_capacity), runner) as engine:
        engine.generate(Request(request_id="warmup", prompt_token_ids=[11, 12, 13],
                                sampling=SamplingParams(max_new_tokens=2)))
        start = time.perf_counter()
        handles = [engine.submit(Request(request_id=f"r{i}", prompt_token_ids=p, sampling=sampling))
                   for i, p in enumerate(prompts(batch, prompt_len, model.description.vocab_size))]
        results = [h.result() for h in handles]
        seconds = time.perf_counter() - start
    generated = sum(len(r.token_ids) for r in results)
    return {"batch": batch, "generated_tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds,
            "step_s": seconds / new_tokens}


def cmd_stream(args) -> None:
    dev = DeviceHandle.for_device(args.device) if args.device != "auto" else DeviceHandle.auto()
    raw = raw_h2d_gbps(dev) if dev.is_cuda else float("nan")
    model = load(args, "cpu")
    layer_bytes = model.layers.store.nbytes()
    if args.window >= model.description.num_layers:
        print("warning: window >= layers: the layers stay resident and nothing streams", file=sys.stderr)
    for batch in args.batch:
        stats_before = model.layers.streamer.stats
        row = offline_run(model, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                          max_model_len=args.prompt_len + args.new_tokens + 8)
        stats = model.layers.streamer.stats
        moved = stats.bytes_moved - stats_before.bytes_moved
        transfer = stats.transfer_seconds - stats_before.transfer_seconds
        effective = layer_bytes / row["step_s"] / 1e9
        emit(bench="stream", preset=args.preset, layers=model.description.num_layers, window=args.window,
             device=str(dev), raw_h2d_gbps=raw, layer_bytes=layer_bytes, effective_stream_gbps=effective,
             ratio_to_raw=effective / raw, streamer_gbps=moved / transfer / 1e9 if transfer else float("nan"),
             stall_s=stats.stall_seconds - stats_before.stall_seconds, **row)
    model.close()


# -- offline ------------------------------------------------------------------------------------------------------
def cmd_offline(args) -> None:
    model = load(args, args.offload)
    free_gb = torch.cuda.mem_get_info()[0] / 1e9 if model.device.is_cuda else float("nan")
    for batch in args.batch:
        row = offline_run(model, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                          max_model_len=args.prompt_len + args.new_tokens + 8)
        emit(bench="offline", preset=args.preset, layers=model.description.num_layers, offload=args.offload,
             window=args.window, params_b=model.description.num_parameters / 1e9,
             peak_device_gb=model.device.max_memory_allocated() / 1e9, device_free_gb_at_load=free_gb, **row)
    model.close()


# -- load ---------------------------------------------------------------------------------------------------------
def start_server(args, batch: int) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "zspeed.serve.cli", "--model", str(weights(args)), "--offload", args.offload,
           "--window", str(args.window), "--device", args.device, "--port", "0", "--no-progress",
           "--max-batch-size", str(batch), "--max-queue-size", str(args.requests),
           "--max-num-batched-tokens", str(max(batch * 4, args.prompt_len * 2)),
           "--max-model-len", str(args.prompt_len + args.new_tokens + 8), "--max-new-tokens", str(args.new_tokens)]
    if args.nvme_path:
        cmd += ["--nvme-path", args.nvme_path]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        found = re.search(r"listening on \S+:(\d+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, int(found.group(1))
    raise RuntimeError(f"zserve exited with {proc.wait()} before listening")


async def one_request(stub, pb, prompt: list[int], new_tokens: int, record: list) -> None:
    msg = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=new_tokens, ignore_eos=True)
    sent = time.perf_counter()
    times, counts = [], []
    async for piece in stub.GenerateStream(msg):
        if piece.token_ids:
            times.append(time.perf_counter())
            counts.append(len(piece.token_ids))
    itl = [(b - a) / n for a, b, n in zip(times, times[1:], counts[1:]) for _ in range(n)]
    record.append({"sent": sent, "ttft": times[0] - sent, "itl": itl, "tokens": sum(counts), "end": times[-1]})


async def open_loop(port: int, rate: float | None, args, vocab: int) -> dict:
    import grpc

    from zspeed.serve._proto import serve_pb2, serve_pb2_grpc

    record: list[dict] = []
    rng = random.Random(1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = serve_pb2_grpc.GenerationServiceStub(channel)
        tasks, start = [], time.perf_counter()
        for p in prompts(args.requests, args.prompt_len, vocab, seed=2):
            if rate is not None:
                await asyncio.sleep(rng.expovariate(rate))
                if time.perf_counter() - start > args.max_seconds:
                    break
            tasks.append(asyncio.create_task(one_request(stub, serve_pb2, p, args.new_tokens, record)))
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=args.max_seconds * 4)
    itl = [x for r in record for x in r["itl"]]
    span = max(r["end"] for r in record) - min(r["sent"] for r in record)
    return {"rate_rps": rate, "requests": len(record), "tokens_per_s": sum(r["tokens"] for r in record) / span,
            "ttft_p50_s": percentile([r["ttft"] for r in record], 50),
            "ttft_p99_s": percentile([r["ttft"] for r in record], 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


def cmd_load(args) -> None:
    batch = max(args.batch)
    offline_tps = None
    if not args.skip_offline:
        model = load(args, args.offload)
        offline_tps = offline_run(model, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                  max_model_len=args.prompt_len + args.new_tokens + 8)["tokens_per_s"]
        model.close()
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    vocab = preset_config(args.preset).vocab_size
    proc, port = start_server(args, batch)
    try:
        for rate in [None, *args.rates]:
            row = asyncio.run(open_loop(port, rate, args, vocab))
            extra = {"offline_tokens_per_s": offline_tps}
            if offline_tps:
                extra["ratio_to_offline"] = row["tokens_per_s"] / offline_tps
            emit(bench="load", preset=args.preset, offload=args.offload, batch=batch,
                 saturation=rate is None, itl_p99_over_p50=row["itl_p99_s"] / row["itl_p50_s"], **row, **extra)
    finally:
        proc.terminate()
        proc.wait(120)


# -- DeepSpeed ZeRO-Inference peer ---------------------------------------------------------------------------------
def cmd_zero_inference(args) -> None:
    """HF generate under DeepSpeed ZeRO-3 with parameters offloaded to pinned CPU (ZeRO-Inference)."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    ds_config = {"fp16": {"enabled": False}, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                       "stage3_prefetch_bucket_size": 2e8, "stage3_param_persistence_threshold": 0},
                 "train_micro_batch_size_per_gpu": 1}
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (must live while the model is built: zero.Init)
    model = AutoModelForCausalLM.from_pretrained(weights(args), dtype=torch.bfloat16)
    engine = deepspeed.initialize(model=model, config_params=ds_config)[0]
    engine.module.eval()
    for batch in args.batch:
        ids = torch.tensor(prompts(batch, args.prompt_len, model.config.vocab_size), device="cuda")
        engine.module.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.module.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     do_sample=False, synced_gpus=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        generated = (out.shape[1] - ids.shape[1]) * batch
        emit(bench="zero-inference", preset=args.preset, layers=model.config.num_hidden_layers, batch=batch,
             generated_tokens=generated, seconds=seconds, tokens_per_s=generated / seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench", choices=("stream", "offline", "load", "zero-inference"))
    p.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    p.add_argument("--num-layers", type=int)
    p.add_argument("--weights-dir", default="/tmp/zspeed-bench")
    p.add_argument("--offload", default="cpu", choices=("none", "cpu", "nvme"))
    p.add_argument("--nvme-path")
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rates", type=float, nargs="*", default=[], help="load: Poisson arrival rates, req/s")
    p.add_argument("--requests", type=int, default=100, help="load: requests per rate")
    p.add_argument("--max-seconds", type=float, default=120.0, help="load: stop arrivals after this")
    p.add_argument("--skip-offline", action="store_true", help="load: do not measure the offline throughput")
    p.add_argument("--json", help="also write the result rows here")
    args = p.parse_args()
    {"stream": cmd_stream, "offline": cmd_offline, "load": cmd_load, "zero-inference": cmd_zero_inference}[
        args.bench](args)
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in RESULTS) + "\n")


if __name__ == "__main__":
    main()
