"""GPU benchmark: batch-1 decode of a Llama-8B-shaped model, bf16 vs zspeed INT4 / INT8 weights.

    python benchmarks/bench_decode.py [--layers 32] [--tokens 64] [--json FILE]
    python benchmarks/bench_decode.py --dry-run     # CPU, 2 tiny layers: checks the script only
    python benchmarks/bench_decode.py --compile     # every system's decode step through torch.compile first
    python benchmarks/bench_decode.py --compile --head --profile   # + INT4 with lm_head quantized; GPU time by kernel
    python benchmarks/bench_decode.py --compile --fuse             # + bf16 and INT4 with q/k/v and gate/up fused
    python benchmarks/bench_decode.py --compile --systems bf16,zspeed-int4+head+fused   # just these
    python benchmarks/bench_decode.py --compile --jobs 8     # the tuner's configs compiled first in 8 processes

Hugging Face ``LlamaForCausalLM`` of the Llama-3-8B shape (hidden 4096, FFN 14336,
32 heads, 8 KV heads, vocabulary 128,256), random bf16 weights, a ``StaticCache``;
one decode step (one token, batch 1) is captured in a CUDA graph and replayed, so
the figure is the GPU's time per token, not Python's. Then every decoder-layer
Linear is swapped for zspeed's INT4 (g128, RTN, asymmetric) and, separately, INT8
``QuantLinear`` (embeddings and ``lm_head`` stay bf16, zspeed's default), warmed up
eagerly (which tunes the kernels; see [Note: kernel tuning] in kernels/_word.py),
captured and replayed the same way. Reports tokens/s and the speed-up over bf16 in
the same process; issue 5's target is INT4 >= 2.5x bf16. Each quantized model's
one-token logits are first checked against a bf16 model holding its dequantized
weights (relative error printed); the greedy tokens are compared with bf16's too
(agreement printed: random weights, so any flip diverges; no check).

``--head`` adds a system with ``lm_head`` quantized to INT4 as well (a 1 GB bf16 read per token otherwise; an
opt-in through ``exclude=("*embed*",)``, reported beside the default, not instead of it). ``--profile`` runs
16 steps of each system one launch at a time under the profiler and prints their GPU time per token by kernel kind
(zspeed's matmuls, cuBLAS, attention, Inductor's fused kernels, other) beside the graph's time per token: the
difference is about the time the GPU idles between kernels in the graph. ``--fuse`` adds bf16 and INT4 (and with
``--head`` INT4 + head) with sibling projections fused (``zspeed.compress.fuse_projections``: q/k/v and gate/up,
one matmul each); fused INT4 is also reported over fused bf16. ``--systems`` runs only the named systems.
"""
from __future__ import annotations

import argparse
import copy
import functools
import inspect
import json
import sys
import time

import torch

SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0)


def build(layers: int, device: str, tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512, max_position_embeddings=256) if tiny else SHAPE
    cfg = LlamaConfig(num_hidden_layers=layers, torch_dtype=torch.bfloat16, **shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).to_empty(device=device)  # bf16 while on meta: no fp32 copy is ever made
    # to_empty leaves buffers unwritten too: the rotary table (inv_freq) would be whatever the allocator held,
    # NaN at times. A fresh rotary module computes it (in fp32, as a checkpoint-loaded model keeps it).
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=cfg).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    model.eval()
    return model


def cache_keyword(model) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``cache`` in recent transformers (which warn that
    ``past_key_values`` goes in 5.40), ``past_key_values`` in older ones (the GPU image's 5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Decoder:
    """One decode step of ``model`` on a static cache, captured in a CUDA graph (eager on the CPU)."""

    def __init__(self, model, prompt: torch.Tensor, max_len: int, *, compile: bool = False):
        from transformers import StaticCache

        self.model, self.device = model, prompt.device
        # --compile: Inductor fuses the norms, rotary embeddings and residual adds (a batch-1 decode step of
        # the 8B shape is ~20 small non-matmul kernels per layer); zspeed's matmuls are custom ops, left opaque
        self.forward = torch.compile(model.forward, dynamic=False) if compile else model.forward
        self.cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=max_len,
                                 device=self.device, dtype=torch.bfloat16)
        self.cache_kw = cache_keyword(model)
        with torch.no_grad():
            pos = torch.arange(prompt.shape[1], device=self.device)
            logits = model(input_ids=prompt, **{self.cache_kw: self.cache}, cache_position=pos, use_cache=True).logits
        self.first = logits[:, -1].argmax(-1, keepdim=True)
        self.ids = self.first.clone()
        self.pos = torch.tensor([prompt.shape[1]], device=self.device)
        self.graph = None

    def _seek(self, position: int) -> None:
        """The next step decodes at ``position``: our position tensor, and the write position that recent
        transformers' static cache layers keep themselves (``cumulative_length``, a device tensor every step adds
        to; without this rewind, repeated runs write past the cache's end)."""
        self.pos.fill_(position)
        for layer in getattr(self.cache, "layers", ()):
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.fill_(position)

    def _step(self) -> torch.Tensor:
        out = self.forward(input_ids=self.ids, **{self.cache_kw: self.cache}, cache_position=self.pos, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def capture(self) -> None:
        if self.device.type != "cuda":
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(3):  # warm-up (and kernel tuning) outside the graph; the cache rows it writes are rewritten
                self._step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.next = self._step()

    def run(self, tokens: int) -> tuple[list[int], float]:
        """Greedy ``tokens`` steps from the prompt's last position; returns (tokens, seconds)."""
        self.ids.copy_(self.first)
        start_pos = int(self.pos.item())
        out = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(tokens):
                self._seek(start_pos + i)
                if self.graph is not None:
                    self.graph.replay()
                    nxt = self.next
                else:
                    nxt = self._step()
                self.ids.copy_(nxt)
                out.append(nxt)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        self._seek(start_pos)
        return [int(t) for t in torch.cat(out).flatten().tolist()], secs


def quantized(model, bits: int, *, head: bool = False):
    from zspeed.compress import RTNConfig, quantize_model

    q = copy.deepcopy(model) if bits else model
    extra = {"exclude": ("*embed*",)} if head else {}
    cfg = RTNConfig(bits=bits, group_size=128, **extra) if bits == 4 else RTNConfig(bits=8, **extra)
    return quantize_model(q, cfg, progress=False)


def fused(model, *, copy_first: bool):
    """``model`` (a copy if ``copy_first``) with q/k/v and gate/up fused into one matmul each ([Note: fused
    projections] in compress/fused.py)."""
    from zspeed.compress import fuse_projections

    return fuse_projections(copy.deepcopy(model) if copy_first else model)


# name -> (bits (0: bf16), lm_head quantized too, projections fused)
SYSTEMS = {"bf16": (0, False, False), "zspeed-int4": (4, False, False), "zspeed-int8": (8, False, False),
           "zspeed-int4+head": (4, True, False), "bf16+fused": (0, False, True), "zspeed-int4+fused": (4, False, True),
           "zspeed-int4+head+fused": (4, True, True), "zspeed-int8+fused": (8, False, True)}


def chosen_systems(args) -> list[str]:
    if args.systems:
        names = [n.strip() for n in args.systems.split(",") if n.strip()]
        bad = [n for n in names if n not in SYSTEMS]
        if bad or "bf16" not in names:
            raise SystemExit(f"--systems: {bad or 'bf16 missing'}; choose from {', '.join(SYSTEMS)} "
                             "(bf16, the baseline, is required)")
        return ["bf16"] + [n for n in names if n != "bf16"]
    names = ["bf16", "zspeed-int4", "zspeed-int8"] + (["zspeed-int4+head"] if args.head else [])
    if args.fuse:
        names += ["bf16+fused", "zspeed-int4+fused"] + (["zspeed-int4+head+fused"] if args.head else [])
    return names


KINDS = (("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
         ("cuBLAS", ("nvjet", "gemv", "gemm", "xmma", "cutlass", "cublas", "splitk")), ("inductor", ("triton_",)))


@functools.cache
def zspeed_kernels() -> frozenset[str]:
    """The names of zspeed's GPU kernels: every ``def <name>_kernel(`` in the sources of ``zspeed.kernels``, read
    rather than imported (its Gluon modules import only where Gluon exists). The profiler names a Triton kernel by
    its function, so a kernel added to the library is counted as zspeed's without a list kept here (session 36's
    profile counted the GEMVs on tensor cores as "other" under the substrings this replaced)."""
    import importlib.util
    import re
    from pathlib import Path

    root = Path(importlib.util.find_spec("zspeed.kernels").submodule_search_locations[0])
    return frozenset(name for path in root.glob("*.py")
                     for name in re.findall(r"^def (\w+_kernel)\(", path.read_text(), flags=re.M))


def kernel_kind(name: str) -> str:
    """``name``'s kind in ``--profile``: zspeed's matmul kernels by their exact names, the others by substrings."""
    low = name.lower()
    if name in zspeed_kernels() and "attention" not in low:
        return "zspeed"
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_step(dec, tokens: int, wall_ms: float) -> dict:
    """GPU time per token by kernel kind (see the module docstring), the steps launched one by one (a kernel's
    duration does not depend on how it was launched); ``wall_ms`` is the graph's time per token."""
    from torch.profiler import ProfilerActivity, profile

    start = int(dec.pos.item())
    dec.ids.copy_(dec.first)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(tokens):
            dec._seek(start + i)
            dec.ids.copy_(dec._step())
        torch.cuda.synchronize()
    dec._seek(start)
    by_kind: dict[str, float] = {}
    top = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us <= 0:
            continue
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + us / tokens / 1e3
        top.append((us / tokens / 1e3, e.count / tokens, kind, e.key[:90]))
    top.sort(reverse=True)
    gpu = sum(by_kind.values())
    print(f"  profile: graph {wall_ms:.3f} ms/token, GPU kernels {gpu:.3f} ms/token: "
          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])), flush=True)
    for ms, n, kind, key in top[:12]:
        print(f"    {ms:7.3f} ms  {n:6.1f}/token  {kind:9s} {key}", flush=True)
    return {"graph_ms": wall_ms, "gpu_ms": gpu, "by_kind_ms": by_kind,
            "top": [dict(ms=ms, per_token=n, kind=kind, kernel=key) for ms, n, kind, key in top[:12]]}


def kernel_error(q, prompt) -> float:
    """Relative L2 error of ``q``'s one-token logits (its matmuls at M=1, the decode path) against the same model
    with every ``QuantLinear`` replaced by a bf16 ``nn.Linear`` of its dequantized weight: checks the kernels
    where greedy-token agreement cannot (random weights make near-ties, so one flipped token diverges)."""
    from zspeed.compress.modules import QuantLinear

    ref = copy.deepcopy(q)
    for name, mod in list(ref.named_modules()):
        for child, sub in list(mod.named_children()):
            if isinstance(sub, QuantLinear):
                lin = torch.nn.Linear(sub.in_features, sub.out_features, bias=sub.bias is not None,
                                      device=prompt.device, dtype=torch.bfloat16)
                with torch.no_grad():
                    lin.weight.copy_(sub.dequantize(torch.bfloat16))
                    if sub.bias is not None:
                        lin.bias.copy_(sub.bias)
                setattr(mod, child, lin)
    with torch.no_grad():
        got = q(input_ids=prompt[:, :1], use_cache=False).logits.float()
        want = ref(input_ids=prompt[:, :1], use_cache=False).logits.float()
    del ref
    return float((got - want).norm() / want.norm())


def measure(name: str, model, prompt, args, phases: dict[str, float]) -> dict:
    """Times ``model``'s decode; ``phases`` (seconds of wall time by phase, this system's so far) gains the prefill
    (where the kernels of the prompt's rows are tuned), the first compiled step (Inductor, the decode kernels' tuning)
    and the capture, and goes into the row."""
    start = time.perf_counter()
    dec = Decoder(model, prompt, max_len=prompt.shape[1] + args.tokens + 8, compile=args.compile)
    phases["prefill"] = time.perf_counter() - start
    if args.compile:
        with torch.no_grad():
            dec._step()  # compile outside the graph capture's warm-up
    phases["first step"] = time.perf_counter() - start - phases["prefill"]
    dec.capture()
    dec.run(4)  # one untimed pass
    phases["capture"] = time.perf_counter() - start - phases["prefill"] - phases["first step"]
    toks, secs = dec.run(args.tokens)
    row = {"system": name, "compiled": args.compile, "tokens": args.tokens, "seconds": secs,
           "tokens_per_s": args.tokens / secs, "ms_per_token": secs / args.tokens * 1e3, "graph": dec.graph is not None,
           "ids": toks, "phase_seconds": phases}
    print(json.dumps({k: v for k, v in row.items() if k not in ("ids", "phase_seconds")}), flush=True)
    print(f"{name}: wall time by phase: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()), flush=True)
    if args.profile and dec.graph is not None:
        row["profile"] = profile_step(dec, 16, row["ms_per_token"])
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--json")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile every system's decode step (bf16 too), so "
                   "that the step's small non-matmul kernels are fused for all of them alike")
    p.add_argument("--head", action="store_true", help="also time INT4 with lm_head quantized (opt-in)")
    p.add_argument("--profile", action="store_true", help="GPU time per token by kernel kind (after the timed run)")
    p.add_argument("--fuse", action="store_true", help="also time bf16 and INT4 with q/k/v and gate/up fused "
                   "(zspeed.compress.fuse_projections)")
    p.add_argument("--systems", help=f"comma-separated subset of: {', '.join(SYSTEMS)} (overrides --head/--fuse)")
    p.add_argument("--inductor-pdl", action="store_true", help="with --compile: Inductor's kernels launched as "
                   "programmatic dependents too (torch._inductor.config.triton.enable_pdl), for every system alike")
    p.add_argument("--jobs", type=int, default=1, help="first compile every kernel config the tuner will time in "
                   "this many processes at once, each a share, on a one-layer model of the same shape (compiling is "
                   "most of the tuning's time; Triton's disk cache hands the kernels over)")
    p.add_argument("--shard", help=argparse.SUPPRESS)  # "i/N": compile share i of N and exit (a --jobs process)
    args = p.parse_args()
    if args.inductor_pdl:
        import torch._inductor.config as inductor_config

        if not hasattr(inductor_config.triton, "enable_pdl"):
            print("--inductor-pdl: this torch's Inductor has no triton.enable_pdl", file=sys.stderr)
            return 2
        inductor_config.triton.enable_pdl = True
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    if args.shard:
        return compile_share(args, device)
    if args.jobs > 1:
        precompile(args)
    if args.dry_run:
        args.layers, args.tokens = 2, 4
    model = build(args.layers, device, tiny=args.dry_run)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device=device,
                           generator=torch.Generator(device=device).manual_seed(1))
    rows = []
    for name in chosen_systems(args):
        bits, head, fuse = SYSTEMS[name]
        start = time.perf_counter()
        q = quantized(model, bits, head=head) if bits else model
        q = fused(q, copy_first=q is model) if fuse else q
        phases = {"quantize": time.perf_counter() - start}
        err = kernel_error(q, prompt) if bits else None
        phases["logits check"] = time.perf_counter() - start - phases["quantize"]
        rows.append(measure(name, q, prompt, args, phases))
        if err is not None:
            rows[-1]["logits_rel_err_vs_dequantized"] = err
            print(f"{name}: one-token logits vs the dequantized bf16 model: relative error {err:.2e} "
                  f"({'ok' if err < 5e-2 else 'CHECK FAILED: a kernel computes something else'})", flush=True)
        del q  # (the name only: bf16 systems share ``model``)
        if device == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]
    fused_base = next((r for r in rows if r["system"] == "bf16+fused"), None)
    for r in rows[1:]:
        agree = sum(a == b for a, b in zip(r["ids"], base["ids"])) / len(base["ids"])
        r["speedup_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["token_agreement"] = agree
        if SYSTEMS[r["system"]][2] and fused_base is not None and fused_base is not r:
            r["speedup_vs_bf16_fused"] = r["tokens_per_s"] / fused_base["tokens_per_s"]
        also = f", {r['speedup_vs_bf16_fused']:.2f}x bf16+fused" if "speedup_vs_bf16_fused" in r else ""
        print(f"{r['system']}: {r['tokens_per_s']:.1f} tok/s vs bf16 {base['tokens_per_s']:.1f}: "
              f"{r['speedup_vs_bf16']:.2f}x{also} (greedy agreement {agree:.2f}; random weights, so any flipped "
              f"near-tie diverges: not a check, the logits check above is)", flush=True)
    for r in rows[1:]:
        if SYSTEMS[r["system"]][0] == 4:
            x = r["speedup_vs_bf16"]
            print(f"target INT4 batch-1 decode >= 2.5x bf16, {r['system']}: {x:.2f}x {'PASS' if x >= 2.5 else 'FAIL'}")
    if args.json:  # with the tuner's pick for each GEMV shape it saw, so that runs can be compared shape by shape
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows,
                       "tuned": tuner_picks()}, f, indent=1)
    return 0


def precompile(args) -> None:
    """``--jobs``: this script again in ``args.jobs`` processes (:func:`compile_share`), each compiling its share of
    the configs the tuner will time for the chosen systems; waits for them all. Their own picks are not kept (no
    tuning cache)."""
    import os

    from _jobs import run_shares

    same = ["--systems", ",".join(chosen_systems(args)), "--prompt-len", str(args.prompt_len)]
    same += ["--dry-run"] if args.dry_run else []
    run_shares(__file__, same, args.jobs, env=dict(os.environ, ZSPEED_TUNING_CACHE="0"))


def compile_share(args, device: str) -> int:
    """A ``--jobs`` process: every tuning of a kernel compiles configs ``i, i + N, ...`` of its candidates instead of
    timing them all, and goes on with the first; one layer of the model is enough, its Linears having every shape of
    the full model's, for each chosen system's prefill and one decode step."""
    from _jobs import one_at_a_time, parse_shard, tune_by_compiling_share

    tune_by_compiling_share(parse_shard(args.shard))  # this process only compiles: its picks are the first candidates
    model = build(1, device, tiny=args.dry_run)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device=device)
    for name in chosen_systems(args):
        bits, head, fuse = SYSTEMS[name]
        if not bits:
            continue
        with one_at_a_time("bench-decode"):
            q = quantized(model, bits, head=head)
            q = fused(q, copy_first=False) if fuse else q
        dec = Decoder(q, prompt, args.prompt_len + 2)
        with torch.no_grad():
            dec._step()
    return 0


def tuner_picks() -> list[dict]:
    """Each key the kernel tuner chose a config for in this process ([Note: kernel tuning] in kernels/_word.py):
    the key, and the config's fields that differ from their defaults."""
    from dataclasses import fields

    from zspeed.kernels import _word

    return [{"key": repr(key), "config": {f.name: getattr(c, f.name) for f in fields(c)
                                          if getattr(c, f.name) != f.default}}
            for key, c in _word.tuned().items()]


if __name__ == "__main__":
    sys.exit(main())
