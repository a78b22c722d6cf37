"""Offload benchmarks on the GPU: throughput beside DeepSpeed, and capacity on one GPU.

    python benchmarks/bench_offload.py --mode throughput [--nproc 1|2] [--json OUT]
    python benchmarks/bench_offload.py --mode capacity [--sizes 1b,3b,8b] [--systems ...] [--json OUT]

throughput: the workload of ../shared/TARGETS.md (Llama-shaped 1.1 B, sequence 2048, micro-batch 4,
bf16, AdamW, clip 1.0) through benchmarks/bench_train.py: ZeRO-2 with CPU optimizer offload on 1 GPU
(zspeed-z2-offload, deepspeed-z2-offload) and ZeRO-3 with CPU optimizer offload on 2 GPUs
(zspeed-z3-offload, deepspeed-z3-offload), each zspeed system also with a quarter of the update on the
host and three on the GPU, state streamed (``-dev``: offload_optimizer.device_share 0.75) and with that plus
the next forward overlapping the update (``-devfwd``: overlap_forward), all exact; bench_train.py also has
``-dpu`` (delayed update), ``-noclip`` and ``-spec`` (speculative update) variants to pass with
``--systems``. Targets (issue 4): zspeed ≥ 2× DeepSpeed's tokens/s at
ZeRO-2 on 1 GPU at no more GPU memory, ≥ 3× at ZeRO-3 on 2 GPUs.

capacity: on one GPU, each (model size, system) in its own process: Llama-shaped models up to the
8 B class (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256), sequence 2048,
micro-batch 1, bf16, activation checkpointing, AdamW on the CPU (pinned); 2 warm-up and 3 timed steps.
zspeed builds the model on the meta device and materialises one module at a time
(:class:`zspeed.train.meta_init.ModuleInit`); DeepSpeed under ``deepspeed.zero.Init`` at stage 3.
Systems: ``zspeed-z3-offload`` (optimizer and parameters on the CPU), ``zspeed-z2-offload``
(optimizer only), ``zspeed-z3-offload-devfwd`` (optimizer on the CPU, ``--device-share`` of its update run on
the GPU with the state streamed, overlap_forward; ``@rF`` adds offload_optimizer.ratio F),
``deepspeed-z3-offload``, ``deepspeed-z2-offload``. Each row reports tokens/s, step
time, peak GPU GiB and peak host RSS GiB, or the error (OOM) that stopped it; the largest size that
trains is the system's capacity.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_train  # noqa: E402  (the throughput workload and its systems)

SIZES = {  # hidden, layers, heads, kv heads, ffn, vocab
    "1b": (2048, 22, 32, 4, 5632, 32000),
    "3b": (3072, 28, 24, 8, 8192, 128256),
    "8b": (4096, 32, 32, 8, 14336, 128256),
}
THROUGHPUT_SETS = ((1, "zspeed-z2-offload-devfwd,zspeed-z2-offload-dev,zspeed-z2-offload,deepspeed-z2-offload"),
                   (2, "zspeed-z3-offload-devfwd,zspeed-z3-offload,deepspeed-z3-offload"))
CAPACITY_SYSTEMS = ["zspeed-z3-offload", "deepspeed-z3-offload", "zspeed-z2-offload", "deepspeed-z2-offload",
                    "zspeed-z3-offload-devfwd"]


def capacity_config(args, stage: int, system: str) -> dict:
    """bench_train's DeepSpeed config, plus parameter offload at stage 3 and activation checkpointing."""
    ns = argparse.Namespace(micro_batch=1)
    cfg = bench_train.ds_config(ns, stage, True)
    system, *variants = system.split("@")
    opt = cfg["zero_optimization"]["offload_optimizer"]
    if system.endswith("-devfwd"):  # parameters on the GPU; device_share of the update there, state streamed
        opt.update(device_share=args.device_share, overlap_forward=True)
        for v in variants:  # @rF: offload_optimizer.ratio = F (the first 1 - F keep their state on the GPU)
            opt["ratio"] = float(v[1:])
    elif stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 5e7
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1e5
    if system.startswith("zspeed"):
        cfg["activation_checkpointing"] = {}
    return cfg


def build_capacity(system: str, cfg_model, ds: dict):
    """Return step(ids) -> loss for one capacity system on this process's GPU."""
    import torch
    from transformers import LlamaForCausalLM
    stage = 3 if "-z3" in system else 2
    if system.startswith("zspeed"):
        import zspeed
        from zspeed.train.meta_init import ModuleInit
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg_model)
        init = ModuleInit(model, model._init_weights, device="cuda")
        engine, *_ = zspeed.initialize(model=model, config=ds, init=init)
    else:
        import deepspeed
        if stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=ds):
                model = LlamaForCausalLM(cfg_model)
        else:
            model = LlamaForCausalLM(cfg_model).to(torch.bfloat16)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())

    from bench_train import engine_step  # this script's folder is on sys.path
    return engine_step(engine)


def run_capacity_one(args) -> None:
    import torch
    torch.cuda.set_device(0)
    if args.memory_report:  # every CUDA allocation from before the build (bench_train.memory_report)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    hidden, layers, heads, kv, ffn, vocab = SIZES[args.size]
    ns = argparse.Namespace(hidden=hidden, layers=layers, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab,
                            seq=args.seq)
    cfg_model = bench_train.llama_config(ns)
    row = {"system": args.system, "size": args.size, "seq": args.seq}
    try:
        t_build = time.perf_counter()
        step = build_capacity(args.system, cfg_model, capacity_config(args, 3 if "-z3" in args.system else 2,
                                                                      args.system))
        row["build_s"] = time.perf_counter() - t_build
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, vocab, (1, args.seq), generator=g).cuda() for _ in range(args.warmup + args.steps)]
        torch.cuda.reset_peak_memory_stats()
        losses = []
        for i, ids in enumerate(batches):
            if i == args.warmup:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            losses.append(float(step(ids).item()))
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        n_params = hidden * vocab * 2 + layers * (4 * hidden * hidden * (1 + kv / heads) / 2 + 3 * hidden * ffn)
        row.update(ok=True, params_b=round(n_params / 1e9, 2), tokens_per_s=args.seq / dt, step_s=dt,
                   peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30, first_loss=losses[0], last_loss=losses[-1])
        if args.memory_report:  # the blocks alive at the peak, by allocation site (no raw snapshot: too large)
            stem = Path(args.memory_report) / f"{args.size}-{args.system}"
            report = bench_train.memory_report(torch, torch.device("cuda", 0), stem)
            row["memory_report"] = {"peak_bytes_traced": report["peak_bytes_traced"],
                                    "alive_at_peak_by_site": report["alive_at_peak_by_site"][:16]}
            row["timing_note"] = "memory history recorded: tokens/s not comparable"
    except Exception as e:  # an OOM (GPU or host) is a result here, not a failure of the benchmark
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    row["host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print("RESULT " + json.dumps(row), flush=True)


def capacity_driver(args) -> list[dict]:
    rows = []
    for size in args.sizes.split(","):
        for system in args.systems.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-port",
                   str(29600 + len(rows)), __file__, "--capacity-one", "--size", size, "--system", system,
                   "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--device-share", str(args.device_share)]
            if args.memory_report:
                cmd += ["--memory-report", args.memory_report]
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired as e:
                out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                              for x in (e.stdout, e.stderr))
                row = {"system": system, "size": size, "ok": False,
                       "error": f"timed out after {args.timeout} s: {out[-400:]}"}
            else:
                found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                row = found[0] if found else {"system": system, "size": size, "ok": False,
                                              "error": f"rc {proc.returncode}: {(proc.stdout + proc.stderr)[-400:]}"}
            rows.append(row)
            print(f"== {size} {system}: {row} ({time.time() - t0:.0f} s)", flush=True)
            if args.json:  # after every row: a call cut short by its time limit keeps what finished
                Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\n{'size':5s} {'system':22s} {'tok/s':>8s} {'step s':>7s} {'GPU GiB':>8s} {'host GiB':>9s}")
    for r in rows:
        if r.get("ok"):
            print(f"{r['size']:5s} {r['system']:22s} {r['tokens_per_s']:8.0f} {r['step_s']:7.2f} {r['peak_gib']:8.1f} "
                  f"{r['host_rss_gib']:9.1f}")
        else:
            print(f"{r['size']:5s} {r['system']:22s} failed: {r.get('error', '')[:80]}")
    return rows


def throughput_driver(args) -> list[dict]:
    """bench_train's driver, twice: the ZeRO-2 pair on 1 GPU, the ZeRO-3 pair on 2."""
    rows = []
    for nproc, systems in [(n, sy) for n, sy in THROUGHPUT_SETS if args.nproc in (None, n)]:
        out = Path(args.json or "bench_offload.json").with_suffix(f".{nproc}gpu.json")
        cmd = [sys.executable, str(Path(__file__).parent / "bench_train.py"), "--driver", "--nproc", str(nproc),
               "--systems", systems, "--json", str(out), "--timeout", str(args.timeout)]
        subprocess.run(cmd, check=False)
        if out.is_file():
            rows += json.loads(out.read_text())
    pairs = [(f"zspeed-z{s}-offload{v}", f"deepspeed-z{s}-offload") for s in (2, 3)
             for v in ("", "-dev", "-devfwd", "-spec", "-dpu", "-noclip")]
    for pair in pairs:
        got = {r["system"]: r for r in rows if r["system"] in pair and "error" not in r}
        if len(got) == 2:
            z, d = got[pair[0]], got[pair[1]]
            print(f"{pair[0]}: {z['tokens_per_s_per_gpu'] / d['tokens_per_s_per_gpu']:.2f}x DeepSpeed's tokens/s, "
                  f"peak {z['peak_gib']:.1f} vs {d['peak_gib']:.1f} GiB"
                  + (f"; speculation {z['speculation']}" if "speculation" in z else ""))
    return rows


def _capacity_system(name: str) -> str:
    base, *variants = name.split("@")
    ok = base in CAPACITY_SYSTEMS and (not variants or (base.endswith("-devfwd") and all(
        v[:1] == "r" and v[1:].replace(".", "", 1).isdigit() and float(v[1:]) <= 1 for v in variants)))
    if not ok:
        raise argparse.ArgumentTypeError(f"unknown capacity system {name!r}: one of {CAPACITY_SYSTEMS}; "
                                         "-devfwd may end in @rF (offload_optimizer.ratio)")
    return name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("throughput", "capacity"), default="capacity")
    ap.add_argument("--sizes", default="1b,3b,8b")
    ap.add_argument("--systems", default=",".join(CAPACITY_SYSTEMS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--json", default=None)
    ap.add_argument("--nproc", type=int, choices=(1, 2), default=None,
                    help="throughput: only the 1-GPU (ZeRO-2) or the 2-GPU (ZeRO-3) set; default both")
    ap.add_argument("--capacity-one", action="store_true", help="(internal) one capacity run in this process")
    ap.add_argument("--size", choices=sorted(SIZES))
    ap.add_argument("--system", type=_capacity_system)
    ap.add_argument("--device-share", type=float, default=0.75, help="-devfwd systems: offload_optimizer.device_share")
    ap.add_argument("--memory-report", metavar="DIR", help="capacity: record every CUDA allocation and write what is "
                    "alive at the peak, by allocation site, to DIR/<size>-<system>.json (slows the run)")
    args = ap.parse_args()
    if args.capacity_one:
        run_capacity_one(args)
        return
    capacity_driver(args) if args.mode == "capacity" else throughput_driver(args)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
