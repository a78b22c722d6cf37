"""Training throughput: zspeed beside plain PyTorch, DDP, FSDP2 and DeepSpeed on one workload.

One system per process group; run every system through the driver, which
launches each under torchrun in turn and prints one table:

    python benchmarks/bench_train.py --driver --nproc 2 --systems zspeed-z2,deepspeed-z2,fsdp2 [--json OUT]
    python benchmarks/bench_train.py --driver --nproc 1 2 4 8 --systems zspeed-z3,fsdp2,plain   # + the scaling
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --system zspeed-z3      # one system

Workload (../shared/TARGETS.md): Llama-shaped 1.1 B (hidden 2048, 22 layers, 32
heads, 4 KV heads, FFN 5632, vocab 32000), sequence 2048, micro-batch 4, bf16,
AdamW, gradient clipping 1.0, random tokens, SDPA attention; 3 warm-up steps,
then 8 timed steps. tokens/s per GPU = micro-batch x sequence / step time.
MFU counts 6 N + 12 L h T flops per token against 989 TFLOP/s (H100/H200 dense bf16).

With several ``--nproc`` counts the driver runs every system at each (plain PyTorch once, on one GPU) and then
prints, per run, the scaling efficiency (tokens/s per GPU over the system's own at its fewest GPUs), the ratio to
plain PyTorch on one GPU, and the peak less 12 bytes a parameter over the GPUs: the same at every count where a
system's memory follows the ZeRO formula (``scaling``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = ["plain", "ddp", "fsdp2", "deepspeed-z2", "deepspeed-z3", "zspeed-z2", "zspeed-z3", "zspeed-z1",
           "deepspeed-z1", "zspeed-z2-offload", "deepspeed-z2-offload", "zspeed-z3-offload", "deepspeed-z3-offload",
           "zspeed-z2-offload-dpu", "zspeed-z3-offload-dpu", "zspeed-z2-offload-noclip", "zspeed-z2-offload-spec",
           "zspeed-z3-offload-spec", "zspeed-z2-offload-dev", "zspeed-z3-offload-dev", "zspeed-z2-offload-fwd",
           "zspeed-z2-offload-devfwd", "zspeed-z3-offload-devfwd"]
PEAK_TFLOPS = 989.0
# ``-dpu``: zspeed's delayed parameter update (offload_optimizer.delayed_update, a zspeed extension) after this
# many exact steps, fewer than the warm-up steps, so every timed step is delayed. ``-noclip``: gradient_clipping 0,
# where zspeed starts each group's CPU update during backward (exact; see train/offload.py). ``-spec``: clipping
# on, with offload_optimizer.speculative_update (exact; the update starts during backward as if the clip will not
# fire and is redone if it does; the row counts the steps whose speculation was kept and dropped). ``-dev``:
# clipping on, exact, with offload_optimizer.device_share = --device-share (the first groups' updates run on the
# GPU with their state streamed from the host while the CPU updates the rest; train/streamed_adam.py). ``-fwd``:
# exact, offload_optimizer.overlap_forward (the next forward publishes each group as it reaches it); ``-devfwd``:
# both.
DPU_WARMUP = 2


def llama_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, intermediate_size=args.ffn, vocab_size=args.vocab,
                       max_position_embeddings=args.seq, attn_implementation="sdpa", use_cache=False,
                       tie_word_embeddings=False)


def ds_config(args, stage: int, offload: bool, *, delayed_update: int | None = None, clip: float = 1.0,
              speculative: bool = False) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if delayed_update is not None:  # zspeed only: DeepSpeed rejects the key
            zero["offload_optimizer"]["delayed_update"] = delayed_update
        if speculative:  # zspeed only
            zero["offload_optimizer"]["speculative_update"] = True
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "gradient_clipping": clip, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                       "weight_decay": 0.1,
                                                       **({} if offload else {"torch_adam": True})}},
            "steps_per_print": 10 ** 9}


def engine_step(engine):
    """One training step through a DeepSpeed-style engine (zspeed's or DeepSpeed's): step(ids) -> loss. Each call
    appends to ``step.marks`` the host times and current-stream events at its four boundaries (forward, backward,
    step), which :func:`phase_ms` turns into per-phase medians."""
    import torch

    def step(ids):
        marks = []

        def mark():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append((time.perf_counter(), event))
        mark()
        with torch.profiler.record_function("bench.forward"):
            loss = engine(input_ids=ids, labels=ids).loss
        mark()
        with torch.profiler.record_function("bench.backward"):
            engine.backward(loss)
        mark()
        with torch.profiler.record_function("bench.step"):
            engine.step()
        mark()
        step.marks.append(marks)
        return loss
    step.engine, step.marks = engine, []
    return step


def phase_ms(marks: list, steps: int) -> dict:
    """Medians over the last ``steps`` steps of each phase's host time (how long the call took) and GPU time
    (between events on the current stream; a forward that waits for an overlapped update counts the wait)."""
    import statistics
    out = {}
    for i, name in enumerate(("forward", "backward", "step")):
        host = [(m[i + 1][0] - m[i][0]) * 1e3 for m in marks[-steps:]]
        gpu = [m[i][1].elapsed_time(m[i + 1][1]) for m in marks[-steps:]]
        out[name] = {"host": round(statistics.median(host), 1), "gpu": round(statistics.median(gpu), 1)}
    return out


def build(system: str, args, model, device):
    """Return step(batch) -> loss for ``system``."""
    import torch
    system, *variants = system.split("@")
    if "closs" in variants:  # @closs, any system: the loss chunk by chunk (zspeed.train.chunked_loss), same loss
        from zspeed.train.chunked_loss import chunk_lm_loss
        chunk_lm_loss(model)
        variants.remove("closs")
    if "lean" in variants:  # @lean, any system: norms and gated MLPs keep fewer activations, same gradients
        from zspeed.train.lean_activations import lean_activations
        print(lean_activations(model), flush=True)
        variants.remove("lean")
    stage = int(system.split("-z")[1][0]) if "-z" in system else 0
    offload = "-offload" in system
    if system.startswith("zspeed"):
        import zspeed
        cfg = ds_config(args, stage, offload, delayed_update=DPU_WARMUP if system.endswith("-dpu") else None,
                        clip=0.0 if system.endswith("-noclip") else 1.0, speculative=system.endswith("-spec"))
        if offload and args.host_threads:
            cfg["zero_optimization"]["offload_optimizer"]["host_threads"] = args.host_threads
        if system.endswith(("-dev", "-devfwd")):
            cfg["zero_optimization"]["offload_optimizer"]["device_share"] = args.device_share
        if system.endswith("fwd"):
            cfg["zero_optimization"]["offload_optimizer"]["overlap_forward"] = True
        for variant in variants:
            if variant.startswith("pf"):  # @pfN: offload_optimizer.prefetch_depth = N
                cfg["zero_optimization"]["offload_optimizer"]["prefetch_depth"] = int(variant[2:])
            if variant.startswith("r"):  # @rF: offload_optimizer.ratio = F (the first 1 - F keep state on the GPU)
                cfg["zero_optimization"]["offload_optimizer"]["ratio"] = float(variant[1:])
        engine, *_ = zspeed.initialize(model=model, config=cfg)

        return engine_step(engine)
    if system.startswith("deepspeed"):
        import deepspeed
        cfg = ds_config(args, stage, offload)
        for variant in variants:  # @rF: DeepSpeed's own Twin-Flow (offload_optimizer.ratio, ZeRO-3)
            cfg["zero_optimization"]["offload_optimizer"]["ratio"] = float(variant[1:])
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())

        return engine_step(engine)
    model = model.to(device)
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        wrapped, autocast = model, False
    elif system == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        wrapped, autocast = DistributedDataParallel(model, device_ids=[device]), True
    else:
        wrapped, autocast = model, True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def run_one(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not args.system.startswith(("zspeed", "deepspeed")):
        dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    cfg = llama_config(args)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if args.memory_report:  # from before the engine exists: its persistent buffers are in the trace too
        torch.cuda.memory._record_memory_history(max_entries=500_000)
    step = build(args.system, args, model, device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    batches = [torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
               for _ in range(args.warmup + args.steps)]
    torch.cuda.reset_peak_memory_stats(device)  # (memory history, if asked, slows the steps: timings not comparable)
    losses = []
    prof = _profiler(torch, args.profile, len(batches) - 2) if args.profile and rank == 0 else None
    for i, ids in enumerate(batches):
        if i == args.warmup:
            torch.cuda.synchronize(device)
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
        losses.append(step(ids).item() if i in (0, len(batches) - 1) else step(ids))
        if prof is not None:
            prof.step()
    torch.cuda.synchronize(device)
    dt = (time.perf_counter() - t0) / args.steps
    if prof is not None:
        prof.stop()
        out = Path(args.profile) / f"{args.system.replace('@', '_')}-rank0.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out))
        subprocess.run(["gzip", "-f", str(out)], check=True)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2 ** 30], device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = args.micro_batch * args.seq / dt
    flops_per_token = 6 * n_params + 12 * args.layers * args.hidden * args.seq
    row = dict(system=args.system, gpus=world, tokens_per_s_per_gpu=tokens, step_s=dt, peak_gib=peak.item(),
               mfu=tokens * flops_per_token / (PEAK_TFLOPS * 1e12), params=n_params,
               first_loss=float(losses[0]), last_loss=float(losses[-1]), losses=[round(float(x), 5) for x in losses])
    if getattr(step, "marks", None):
        row["phase_ms"] = phase_ms(step.marks, args.steps)
    offload = getattr(getattr(step, "engine", None), "offload", None)
    times = getattr(offload, "update_times", None)
    if times:  # zspeed offload: where each step's update went (medians over the timed steps)
        import statistics
        timed_steps = list(times)[-args.steps + 1:] or list(times)
        row["update_ms"] = {k: round(statistics.median(t[k] for t in timed_steps if k in t) * 1e3, 1)
                            for k in timed_steps[-1]}
    streamed = getattr(offload, "streamed", None)
    if streamed is not None:  # -dev: elements whose state went up during backward, per step on average
        row["prefetched_per_step"] = streamed.prefetched_elements // max(1, len(losses))
        row["streamed_per_step"] = streamed.elements // max(1, len(losses))
        row["resident_elements"] = streamed.resident_elements  # @rF: elements whose state stays on the GPU
    if getattr(offload, "speculative", False):  # zspeed -spec: how often the clip let the speculation stand
        row["speculation"] = dict(offload.speculation)
    if args.memory_report:
        row["memory_report"] = memory_report(torch, device, Path(args.memory_report) / f"{args.system}-rank{rank}")
        row["timing_note"] = "memory history recorded: tokens/s not comparable"
    if args.profile:
        row["timing_note"] = "profiled: tokens/s not comparable"
    if rank == 0:
        print("RESULT " + json.dumps(row), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _profiler(torch, folder: str, first: int):
    """A torch profiler (host and CUDA activity) recording steps ``first`` on, i.e. the last two; its chrome trace
    goes to ``folder``/<system>-rank0.json.gz (rank 0 only). Profiling slows the steps: tokens/s not comparable."""
    from torch.profiler import ProfilerActivity, profile, schedule
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=first - 1, warmup=1, active=2, repeat=1), with_stack=True)
    prof.start()
    return prof


def memory_report(torch, device, stem: Path, top: int = 12) -> dict:
    """Replay the recorded allocation trace to the moment of peak allocated bytes and list the largest
    blocks alive then, each with the innermost frame of zspeed / deepspeed / torch / transformers code that
    allocated it; also dump the raw snapshot (``stem``.pickle, for https://pytorch.org/memory_viz)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    snap = torch.cuda.memory._snapshot()
    if stem.name.endswith("rank0"):
        torch.cuda.memory._dump_snapshot(str(stem) + ".pickle")
    torch.cuda.memory._record_memory_history(enabled=None)
    # Allocated bytes change at "alloc" and "free_completed" (a free deferred by record_stream completes
    # later). Blocks allocated before recording started appear only through their frees, or not at all.
    alive_end = sum(b["size"] for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
    trace = snap["device_traces"][device.index]
    live: dict[int, dict] = {}
    pre_freed = 0
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            if live.pop(ev["addr"], None) is None:
                pre_freed += ev["size"]
    before = alive_end - sum(ev["size"] for ev in live.values()) + pre_freed  # allocated when recording began
    cur, best, live, best_live = before, before, {}, {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > best:
                best, best_live = cur, dict(live)
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
            cur -= ev["size"]

    def where(ev) -> str:  # the two innermost frames of zspeed / peer / model code
        found = [f"{Path(fr.get('filename', '')).name}:{fr.get('line')} {fr.get('name')}"
                 for fr in ev.get("frames", []) if any(k in fr.get("filename", "") for k in (
                     "zspeed", "/train/", "/core/", "deepspeed", "transformers", "bench_train"))]
        return " < ".join(found[:2]) or "?"

    blocks = sorted(best_live.values(), key=lambda e: -e["size"])[:top]
    sites: dict[str, list[int]] = {}  # every block alive at the peak, summed by allocation site
    for ev in best_live.values():
        site = sites.setdefault(where(ev), [0, 0])
        site[0] += 1
        site[1] += ev["size"]
    report = {"peak_bytes_traced": best, "max_memory_allocated": torch.cuda.max_memory_allocated(device),
              "allocated_before_trace": before,
              "largest_alive_at_peak": [(ev["size"], where(ev)) for ev in blocks],
              "alive_at_peak_by_site": sorted(([k, *v] for k, v in sites.items()), key=lambda r: -r[2])}
    (stem.parent / (stem.name + ".json")).write_text(json.dumps(report, indent=1))
    return report


def driver(args) -> None:
    """Each system of ``args.systems`` under torchrun at each GPU count of ``args.nproc`` (``plain``: once, on one
    GPU), one at a time; then the table, and with several counts the scaling (:func:`scaling`)."""
    rows = []
    here = gpus_here()
    counts = sorted(set(args.nproc))
    if counts[-1] > here:
        print(f"skipping {', '.join(str(n) for n in counts if n > here)} GPUs: this machine has {here}", flush=True)
        counts = [n for n in counts if n <= here]
        if not counts:
            raise SystemExit(f"bench_train.py --driver: no --nproc count fits the {here} GPUs here")
    for n in counts:
        for system in args.systems.split(","):
            if system == "plain" and any(r["system"] == "plain" for r in rows):
                continue  # one GPU whatever the count
            rows.append(launch_system(args, system, 1 if system == "plain" else n, port=29500 + len(rows)))
    print(f"\n{'system':22s} {'GPUs':>4s} {'tok/s/GPU':>10s} {'peak GiB':>9s} {'MFU':>6s}  loss first->last")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:22s} {r['gpus']:4d} failed")
            continue
        print(f"{r['system']:22s} {r['gpus']:4d} {r['tokens_per_s_per_gpu']:10.0f} {r['peak_gib']:9.1f} "
              f"{r['mfu']:6.3f}  {r['first_loss']:.3f}->{r['last_loss']:.3f}")
    table = scaling(rows)
    if len({r["gpus"] for r in table}) > 1:
        print("\nscaling: per-GPU tokens/s over the system's own at its fewest GPUs, over plain PyTorch on one GPU; "
              f"peak less {STATE_BYTES} bytes a parameter over the GPUs (the sharded fp32 master and AdamW state)")
        print(f"{'system':22s} {'GPUs':>4s} {'efficiency':>10s} {'vs plain':>9s} {f'peak - {STATE_BYTES}P/N':>13s}")
        for r in table:
            eff = "" if r["efficiency"] is None else f"{r['efficiency']:.3f}"
            plain = "" if r["vs_plain"] is None else f"{r['vs_plain']:.3f}"
            print(f"{r['system']:22s} {r['gpus']:4d} {eff:>10s} {plain:>9s} {r['peak_less_state_gib']:10.3f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def gpus_here() -> int:
    """The GPUs this driver can hand its runs."""
    import torch

    return torch.cuda.device_count()


def launch_system(args, system: str, nproc: int, *, port: int) -> dict:
    """One system under torchrun on ``nproc`` GPUs: its result row, or ``{system, gpus, error}``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port", str(port),
           __file__, "--system", system, *args.passthrough]
    from zspeed.train.cli import threads_per_worker

    # Every system gets the same CPU threads per process: the node's CPUs shared by its processes.
    # torchrun would otherwise set OMP_NUM_THREADS=1 at 2 processes, which DeepSpeedCPUAdam (OpenMP)
    # and torch's CPU ops obey (zspeed's offload picks the same count itself: host_threads = 0).
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_worker(nproc)))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired as err:  # one stuck system must not cost the others their turn
        out = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        proc = subprocess.CompletedProcess(cmd, -9, out(err.stdout), out(err.stderr) + f"\ntimed out after "
                                           f"{args.timeout} s")
    found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not found:
        tail = (proc.stdout + proc.stderr)[-3000:]
        print(f"== {system} on {nproc} failed (rc {proc.returncode}, {time.time() - t0:.0f} s)\n{tail}", flush=True)
        return dict(system=system, gpus=nproc, error=tail[-500:])
    print(f"== {system}: {found[0]} ({time.time() - t0:.0f} s)", flush=True)
    return found[0]


STATE_BYTES = 12  # a parameter's fp32 master, AdamW momentum and variance: what every sharded system splits over N


def scaling(rows: list[dict]) -> list[dict]:
    """The driver's runs as scaling (failed runs left out): for each run, ``efficiency`` (tokens/s per GPU over the
    same system's at the fewest GPUs it ran on, ``None`` there), ``vs_plain`` (over plain PyTorch's on one GPU,
    ``None`` without such a run), and ``peak_less_state_gib``: the per-GPU peak less ``STATE_BYTES`` a parameter over
    the GPUs. Where a system's memory follows the ZeRO formula, that rest is the same at every count (what is not
    sharded: activations, gathered layers, ZeRO-2's 16-bit parameters)."""
    ok = [r for r in rows if "error" not in r]
    fewest = {}
    for r in sorted(ok, key=lambda r: r["gpus"]):
        fewest.setdefault(r["system"], r)
    plain = fewest.get("plain")
    out = []
    for r in ok:
        base = fewest[r["system"]]
        out.append(dict(system=r["system"], gpus=r["gpus"],
                        efficiency=None if base is r else r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"],
                        vs_plain=None if plain is None or r["system"] == "plain"
                        else r["tokens_per_s_per_gpu"] / plain["tokens_per_s_per_gpu"],
                        peak_less_state_gib=r["peak_gib"] - STATE_BYTES * r["params"] / r["gpus"] / 2**30))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", action="store_true")
    ap.add_argument("--systems", default="zspeed-z2,deepspeed-z2,zspeed-z3,deepspeed-z3,fsdp2,plain")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2],
                    help="GPUs a system (the driver); several counts run every system at each and print the scaling")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--memory-report", metavar="DIR", help="record every CUDA allocation and report (DIR/<system>-"
                    "rank<r>.json) the largest blocks alive at the peak; slows the steps")
    ap.add_argument("--profile", metavar="DIR", help="torch-profile the last two steps on rank 0 and write the chrome "
                    "trace to DIR/<system>-rank0.json.gz; slows the steps")
    ap.add_argument("--system", type=_system, help="one of SYSTEMS; -dev systems may end in @pfN (offload_optimizer."
                    "prefetch_depth = N) and @rF (offload_optimizer.ratio = F), e.g. zspeed-z3-offload-devfwd@r0.6; "
                    "any system may end in @closs (the loss chunk by chunk, zspeed.train.chunked_loss) and @lean "
                    "(norms and gated MLPs keep fewer activations, zspeed.train.lean_activations)")
    ap.add_argument("--host-threads", type=int, default=0,
                    help="zspeed offload systems: offload_optimizer.host_threads (0 = zspeed's auto)")
    ap.add_argument("--device-share", type=float, default=0.75,
                    help="-dev systems: offload_optimizer.device_share (the share of the update run on the GPU)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    args.passthrough = _strip_driver_values(sys.argv[1:])
    if args.driver:
        driver(args)
    else:
        run_one(args)


def _system(name: str) -> str:
    base, *variants = name.split("@")

    variants = [v for v in variants if v not in ("closs", "lean")]  # @closs, @lean: any system

    def known(v: str) -> bool:
        if v[:2] == "pf":
            return v[2:].isdigit()
        try:
            return v[:1] == "r" and 0.0 <= float(v[1:]) <= 1.0
        except ValueError:
            return False
    twin_flow = base == "deepspeed-z3-offload" and all(v[:1] == "r" for v in variants)
    if base not in SYSTEMS or (variants and not ((base.endswith(("-dev", "-devfwd")) or twin_flow)
                                                 and all(map(known, variants)))):
        raise argparse.ArgumentTypeError(f"unknown system {name!r}: use one of {SYSTEMS}; a -dev system may end "
                                         "in @pfN (prefetch depth) and/or @rF (offload_optimizer.ratio), "
                                         "deepspeed-z3-offload in @rF; any system in @closs (chunked loss) and "
                                         "@lean (lean activations)")
    return name


def _strip_driver_values(argv: list[str]) -> list[str]:
    """The workload flags to pass to each system's process (driver-only flags removed)."""
    out, skip, counts = [], False, False
    for a in argv:
        if skip:
            skip = False
            continue
        if counts and not a.startswith("-"):  # the counts after --nproc
            continue
        counts = False
        if a == "--driver":
            continue
        if a == "--nproc":  # one or more counts
            counts = True
            continue
        if a in ("--systems", "--json", "--timeout"):
            skip = True
            continue
        if a.startswith(("--systems=", "--nproc=", "--json=", "--timeout=")):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
