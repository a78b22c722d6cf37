"""Why INT4 g128 loses so much on SmolLM2: its weights are already Q4_1 (4-bit, blocks of 32, float minimum).

    python benchmarks/int4_grid_check.py          # CPU, about 3 minutes

Fake-quantizes every Linear but ``lm_head`` on two INT4 grids and prints perplexity on the evaluation text of
bench_quality.py (12 windows of 512 tokens of the Wikipedia paragraphs):

* ``int``: zspeed's INT4 format: per-group scale and an *integer* zero point, the range widened to include 0;
* ``float``: per-group scale and a *float* minimum (w = code x scale + min), Q4_1's own grid.

At group 32 the float grid reproduces the Q4_1 blocks exactly, so the model is unchanged; the integer grid cannot.
"""
from __future__ import annotations

import copy

import torch

from zspeed.compress.assets import smollm2_gguf, wikipedia_json
from zspeed.compress.data import read_text
from zspeed.compress.evaluate import perplexity
from zspeed.compress.hf import load_model, tokenize


def fake_int4(w: torch.Tensor, group: int, grid: str) -> torch.Tensor:
    n, k = w.shape
    pad = (-k) % group
    x = torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, group).float()  # (N, groups, G)
    if grid == "float":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        y = ((x - lo) / scale).round().clamp(0, 15) * scale + lo
    else:
        lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        zero = (-lo / scale).round()
        y = ((x / scale + zero).round().clamp(0, 15) - zero) * scale
    return y.reshape(n, -1)[:, :k].to(w.dtype)


def main() -> None:
    base, tokenizer = load_model(str(smollm2_gguf()))
    ids = tokenize(read_text(wikipedia_json())[:12 * 512 * 8], tokenizer)
    print(f"fp32 (Q4_1 expanded)  ppl {perplexity(base, ids, seq_len=512):.4f}", flush=True)
    for group in (32, 128):
        for grid in ("int", "float"):
            model = copy.deepcopy(base)
            with torch.no_grad():
                for name, module in model.named_modules():
                    if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                        module.weight.copy_(fake_int4(module.weight, group, grid))
            print(f"g{group} {grid:5s} grid       ppl {perplexity(model, ids, seq_len=512):.4f}", flush=True)


if __name__ == "__main__":
    main()
