"""Export a zcompress INT4 folder in the GPTQ checkpoint layout that other tools read.

``zcompress export --model DIR --out OUT [--format gptq|gptq_v2]`` writes a Hugging Face model folder
(``config.json`` with a ``quantization_config``, ``quantize_config.json``, ``model.safetensors``, the
tokenizer files when the source has them) whose quantized linears are stored as GPTQ loaders expect
(AutoGPTQ, GPTQModel, transformers' GPTQ integration); see [Note: the GPTQ layout].

[Note: the GPTQ layout]
zspeed keeps an INT4 linear of ``N`` outputs and ``K`` inputs as ``qweight`` uint8 ``(N, K/2)`` (two
codes per byte along the input, even column in the low nibble), ``scales`` ``(N, K/G)`` and, for the
asymmetric grid, integer ``zeros`` uint8 ``(N, K/G)`` (symmetric: an implicit zero of 8); the weight is
``(code - zero) × scale``. GPTQ stores the transpose, eight 4-bit fields per int32:

* ``qweight`` int32 ``(K/8, N)``: input rows ``8i .. 8i+7`` of column ``n``, row ``8i+j`` at bits ``4j``;
* ``qzeros`` int32 ``(K/G, N/8)``: the zero points of columns ``8i .. 8i+7`` of group ``g``, column
  ``8i+j`` at bits ``4j``; in the original ``gptq`` format stored **minus one** (its kernels add the one
  back), so a zero point of 0 cannot be written there (``gptq_v2`` stores them as they are);
* ``scales`` float16 ``(K/G, N)``; ``g_idx`` int32 ``(K,)`` = ``k // G`` (groups are contiguous input
  ranges in zspeed, GPTQ's ``desc_act = false``); ``bias`` float16 ``(N,)``.

So ``w[n, k] = scales[g_idx[k], n] × (q[k, n] - z[g_idx[k], n])``, with ``z`` the stored zero (+1 for
``gptq``). The test reads the files back with an unpacker written from this description and compares
the weights with zspeed's own dequantization. What GPTQ cannot hold is refused with the module's name:
INT8, NF4 and sparse modules, groups that do not divide ``K`` (zspeed's padded groups), ``K`` or ``N``
not multiples of 8, group sizes or grids that differ between modules (one ``quantization_config``).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from .modules import QuantLinear
from .packing import unpack_bits
from .storage import compressed_modules, load_compressed, new_folder, read_metadata

__all__ = ["GPTQ_FORMATS", "GPTQExportError", "export_gptq", "gptq_tensors"]

GPTQ_FORMATS = ("gptq", "gptq_v2")
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens", "chat_template",
                   "generation_config")


class GPTQExportError(ValueError):
    """A zcompress folder that the GPTQ layout cannot hold (the message names the module and why)."""


def _pack8(fields: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit fields along ``dim`` into one int32 (field ``j`` at bits ``4j``), two's complement."""
    f = fields.to(torch.int64).movedim(dim, -1)
    f = f.reshape(*f.shape[:-1], f.shape[-1] // 8, 8)
    word = (f << (torch.arange(8, dtype=torch.int64) * 4)).sum(-1)  # fields do not overlap
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def gptq_tensors(module: QuantLinear, *, name: str, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """One INT4 linear's GPTQ tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``, ``bias``)."""
    if checkpoint_format not in GPTQ_FORMATS:
        raise GPTQExportError(f"unknown GPTQ checkpoint format {checkpoint_format!r}; use one of {GPTQ_FORMATS}")
    if not isinstance(module, QuantLinear) or module.bits != 4:
        raise GPTQExportError(f"{name}: GPTQ holds 4-bit group-wise weights; this module is "
                              f"{_describe(module)}. Quantize with --bits 4 (rtn or gptq), or export another way")
    n, k, g = module.out_features, module.in_features, module.group_size
    if k % g:
        raise GPTQExportError(f"{name}: group size {g} does not divide the {k} inputs (a padded last group); "
                              "GPTQ's groups are whole. Quantize with a group size that divides every input width")
    if k % 8 or n % 8:
        raise GPTQExportError(f"{name}: GPTQ packs eight 4-bit fields per int32 along both dimensions; "
                              f"{n} outputs x {k} inputs are not both multiples of 8")
    codes = unpack_bits(module.qweight, 4)[:, :k]  # (N, K)
    zeros = (torch.full((n, k // g), 8, dtype=torch.int32) if module.zeros is None
             else module.zeros.to(torch.int32))
    stored = zeros - 1 if checkpoint_format == "gptq" else zeros
    if (stored < 0).any():
        bad = int((stored < 0).sum())
        raise GPTQExportError(f"{name}: {bad} group(s) have zero point 0, which the original 'gptq' format "
                              "stores as zero - 1 and cannot hold; export with --format gptq_v2 (zero points "
                              "as they are), or quantize with a symmetric grid")
    out = {"qweight": _pack8(codes.t(), 0), "qzeros": _pack8(stored.t(), 1),
           "scales": module.scales.t().to(torch.float16).contiguous(),
           "g_idx": (torch.arange(k, dtype=torch.int32) // g).contiguous()}
    if module.bias is not None:
        out["bias"] = module.bias.detach().to(torch.float16).contiguous()
    return out


def _describe(module: nn.Module) -> str:
    if isinstance(module, QuantLinear):
        return f"INT{module.bits}"
    return type(module).__name__


def export_gptq(src: str | os.PathLike, out: str | os.PathLike, *, checkpoint_format: str = "gptq") -> Path:
    """Write the GPTQ folder of the zcompress folder ``src`` to ``out`` (see the module docstring).

    The folder appears whole or not at all: it is written beside ``out`` and renamed into place."""
    src, out = Path(src), Path(out)
    meta = read_metadata(src)
    if not meta.get("hf_config"):
        raise GPTQExportError(f"{src}: no Hugging Face config recorded; the GPTQ folder is a Hugging Face model "
                              "folder, so compress a Hugging Face model")
    if out.exists():
        raise GPTQExportError(f"{out} exists; choose a new output folder (nothing is overwritten)")
    model = load_compressed(src)
    modules = compressed_modules(model)
    if not modules:
        raise GPTQExportError(f"{src}: no compressed modules to export")
    tensors: dict[str, torch.Tensor] = {}
    grids = set()
    for name, m in modules.items():
        for key, t in gptq_tensors(m, name=name, checkpoint_format=checkpoint_format).items():
            tensors[f"{name}.{key}"] = t
        grids.add((m.group_size, m.zeros is None))
    if len(grids) > 1:
        raise GPTQExportError(f"the modules use different group sizes or grids {sorted(grids)}; one GPTQ "
                              "quantization_config describes them all, so quantize them alike")
    (group_size, symmetric), = grids
    quantized = {f"{name}.{b}" for name in modules for b in ("qweight", "scales", "zeros", "bias")}
    tied = set(meta.get("tied", {}))
    for key, value in model.state_dict().items():
        if key not in quantized and key not in tied:
            tensors[key] = value.detach().contiguous()
    sequential = bool((meta.get("method") or {}).get("true_sequential", False))  # what was run (rtn: False)
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": symmetric,
             "true_sequential": sequential, "checkpoint_format": checkpoint_format,
             "modules_in_block_to_quantize": None}
    config = dict(meta["hf_config"], quantization_config=quant)
    with new_folder(out) as tmp:
        from safetensors.torch import save_file
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "quantize_config.json").write_text(json.dumps({k: v for k, v in quant.items()
                                                              if k != "modules_in_block_to_quantize"}, indent=2))
        for f in src.iterdir():  # the tokenizer (and chat template), when zcompress saved one
            if f.is_file() and f.name.startswith(TOKENIZER_FILES):
                shutil.copy2(f, tmp / f.name)
    return out
