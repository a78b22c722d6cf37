"""``zcompress``: quantize, sparsify, inspect and evaluate models from the shell.

    zcompress quantize --model DIR --bits 4 --group-size 128 --method gptq --calib FILE --out DIR
    zcompress quantize --model DIR --method nf4 --blocksize 64 --out DIR
    zcompress sparsify --model DIR --pattern 2:4 --method wanda --calib FILE --out DIR
    zcompress inspect DIR
    zcompress eval --model DIR --data FILE
    zcompress export --model DIR --out DIR [--format gptq|gptq_v2]

``--model`` takes a Hugging Face folder, a ``.gguf`` file, a folder written by
zcompress, or ``tiny`` (a built-in random tiny Llama for demos).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .config import GPTQConfig, MagnitudeConfig, NF4Config, RTNConfig, WandaConfig
from .data import read_text, windows
from .storage import (META_FILE, CompressedFormatError, check_new_folder, compressed_modules, new_folder,
                      read_metadata, save_compressed)
from .tiny import TINY_NAME

QUANT_METHODS = {"rtn": RTNConfig, "gptq": GPTQConfig, "nf4": NF4Config}
SPARSE_METHODS = {"magnitude": MagnitudeConfig, "wanda": WandaConfig}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF folder, .gguf file, zcompress folder, or 'tiny'")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--calib", help="calibration text (.txt, .json, .jsonl); needed by gptq and wanda")
    p.add_argument("--calib-samples", type=int, default=32, help="calibration windows (default 32)")
    p.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration window (default 256)")
    p.add_argument("--group-size", type=int, default=None, help="INT4 group size: 32, 64 or 128 (default 128)")
    p.add_argument("--symmetric", action="store_true", help="symmetric INT4 (no zero points)")
    p.add_argument("--pad-groups", action="store_true", help="allow a short last group when in_features "
                   "is not a multiple of the group size")
    p.add_argument("--scale-dtype", default="auto", choices=("auto", "float16", "bfloat16"),
                   help="dtype of stored scales (default auto: bfloat16 for INT4 of a bfloat16 model, where the GPU "
                        "kernels' fastest path needs it; float16 otherwise)")
    p.add_argument("--exclude", nargs="*", default=None, help="fnmatch patterns of Linears to leave alone "
                   "(default: lm_head)")
    p.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zcompress", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="weight-only INT8/INT4/NF4 quantization")
    q.add_argument("--bits", type=int, choices=(4, 8), default=4)
    q.add_argument("--method", default="rtn", help=f"one of {sorted(QUANT_METHODS)}")
    q.add_argument("--act-order", action="store_true", help="gptq: sweep columns by decreasing Hessian diagonal")
    q.add_argument("--damp", type=float, default=None, help="gptq: diagonal damping fraction (default 0.01)")
    q.add_argument("--true-sequential", action="store_true",
                   help="gptq: calibrate each Linear on its block's already-quantized earlier Linears")
    q.add_argument("--fp-targets", action="store_true",
                   help="gptq: fit each Linear to the full-precision model's outputs (twice the block runs)")
    q.add_argument("--blocksize", type=int, default=None, help="nf4: weights per absmax block (default 64)")
    q.add_argument("--compute-dtype", default=None, help="nf4: matmul dtype (default: the input's)")
    _common(q)
    s = sub.add_parser("sparsify", help="N:M pruning, stored compressed")
    s.add_argument("--pattern", default="2:4", help="N:M, e.g. 2:4 (default)")
    s.add_argument("--method", default="magnitude", help=f"one of {sorted(SPARSE_METHODS)}")
    s.add_argument("--int4", action="store_true", help="also quantize the kept values to INT4")
    _common(s)
    i = sub.add_parser("inspect", help="per-module formats, sizes and errors of a compressed folder")
    i.add_argument("dir")
    e = sub.add_parser("eval", help="perplexity before vs after compression")
    e.add_argument("--model", required=True, help="a zcompress folder (its source is the 'before'), or any model")
    e.add_argument("--data", required=True, help="text file (.txt, .json, .jsonl)")
    e.add_argument("--baseline", help="the uncompressed model (default: the source recorded at compression)")
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--max-windows", type=int, default=16)
    e.add_argument("--no-progress", action="store_true")
    x = sub.add_parser("export", help="write an INT4 zcompress folder in the GPTQ layout other tools load")
    x.add_argument("--model", required=True, help="a zcompress folder of 4-bit (rtn or gptq) weights")
    x.add_argument("--out", required=True, help="the new Hugging Face GPTQ folder (must not exist)")
    x.add_argument("--format", default="gptq", choices=("gptq", "gptq_v2"),
                   help="gptq (default; zero points stored minus one, as AutoGPTQ and transformers read them) "
                        "or gptq_v2 (zero points as they are: GPTQModel)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_counts(args)
        return {"quantize": cmd_compress, "sparsify": cmd_compress, "inspect": cmd_inspect,
                "eval": cmd_eval, "export": cmd_export}[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError, CompressedFormatError, TypeError) as e:
        print(f"zcompress {args.command}: error: {e}", file=sys.stderr)
        return 2


_MIN_COUNTS = {"calib_samples": 1, "calib_seq_len": 2, "max_windows": 1, "seq_len": 2}


def _check_counts(args: argparse.Namespace) -> None:
    for name, least in _MIN_COUNTS.items():
        value = getattr(args, name, None)
        if value is not None and value < least:
            why = " (a window needs a token and one to predict)" if least == 2 else ""
            raise ValueError(f"--{name.replace('_', '-')} {value} is invalid: use at least {least}{why}")


def _refuse(args: argparse.Namespace, flags: tuple[str, ...], why: str) -> None:
    """Refuse options that were given but would be ignored."""
    given = [f for f in flags if getattr(args, f[2:].replace("-", "_"), None) not in (None, False)]
    if given:
        raise ValueError(f"{' '.join(given)} {'does' if len(given) == 1 else 'do'} not apply {why}; drop "
                         f"{'it' if len(given) == 1 else 'them'}")


def _config(args: argparse.Namespace):
    exclude = {} if args.exclude is None else {"exclude": tuple(args.exclude)}
    if args.command == "quantize":
        cls = _pick(QUANT_METHODS, args.method, "quantize")
        if cls is not GPTQConfig:
            _refuse(args, ("--act-order", "--true-sequential", "--fp-targets", "--damp"),
                    f"to --method {args.method} (gptq only)")
        if cls is not NF4Config:
            _refuse(args, ("--blocksize", "--compute-dtype"), f"to --method {args.method} (nf4 only)")
        if cls is NF4Config:
            return _nf4_config(args, exclude)
        if args.bits == 8:
            _refuse(args, ("--group-size", "--symmetric", "--pad-groups"),
                    "to --bits 8 (INT8 is symmetric, one scale per output channel)")
        group = {} if args.bits == 8 else {"group_size": _given(args.group_size, 128), "symmetric": args.symmetric}
        gptq = {"act_order": args.act_order, "damp": _given(args.damp, 0.01), "true_sequential": args.true_sequential,
                "fp_targets": args.fp_targets} if cls is GPTQConfig else {}
        return cls(bits=args.bits, pad_groups=args.pad_groups, scale_dtype=args.scale_dtype, **group, **gptq,
                   **exclude)
    cls = _pick(SPARSE_METHODS, args.method, "sparsify")
    n, m = _pattern(args.pattern)
    if not args.int4:
        _refuse(args, ("--group-size", "--symmetric", "--pad-groups"), "without --int4 (INT4 only)")
    return cls(n=n, m=m, quant_bits=4 if args.int4 else None, group_size=_given(args.group_size, 128),
               symmetric=args.symmetric, pad_groups=args.pad_groups, scale_dtype=args.scale_dtype, **exclude)


def _nf4_config(args: argparse.Namespace, exclude: dict) -> NF4Config:
    if args.bits != 4:
        raise ValueError(f"--method nf4 is 4-bit: drop --bits {args.bits}")
    if args.group_size is not None or args.symmetric or args.pad_groups or args.scale_dtype != "auto":
        raise ValueError("--group-size/--symmetric/--pad-groups/--scale-dtype are INT4 options; nf4 takes "
                         "--blocksize")
    return NF4Config(blocksize=_given(args.blocksize, 64), compute_dtype=args.compute_dtype, **exclude)


def _given(value, default):
    """A flag's value, or its default where it was not given (0 is a value: the config refuses it)."""
    return default if value is None else value


def _pick(methods: dict, name: str, command: str) -> type:
    if name not in methods:
        raise ValueError(f"unknown method {name!r} for {command}; valid: {', '.join(sorted(methods))}")
    return methods[name]


def _pattern(text: str) -> tuple[int, int]:
    try:
        n, m = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--pattern {text!r} is not N:M (e.g. 2:4)") from None
    return n, m


def _windows(args: argparse.Namespace, tokens, *, source: str, seq_flag: str, count_flag: str) -> list:
    """The token windows of ``source``; an error when there is not one, a warning when fewer than asked."""
    seq_len, count = getattr(args, seq_flag[2:].replace("-", "_")), getattr(args, count_flag[2:].replace("-", "_"))
    if tokens.numel() < seq_len:
        raise ValueError(f"{source} holds {tokens.numel()} tokens, fewer than one window of {seq_flag} {seq_len}: "
                         f"give more text or a smaller {seq_flag}")
    wins = windows(tokens, seq_len=seq_len, count=count)
    if len(wins) < count:
        print(f"zcompress {args.command}: warning: {source} holds only {len(wins)} windows of {seq_len} tokens, "
              f"fewer than {count_flag} {count}; using {len(wins)}", file=sys.stderr)
    return wins


def _source(spec: str) -> str:
    """The model as the metadata records it: an absolute path, so eval finds it from any directory."""
    return spec if spec == TINY_NAME else str(Path(spec).resolve())


def cmd_compress(args: argparse.Namespace) -> int:
    from .hf import is_compressed, load_model, tokenize
    from .transform import quantize_model, sparsify_model

    config = _config(args)
    needs_calib = isinstance(config, (GPTQConfig, WandaConfig))
    if needs_calib and not args.calib:
        raise ValueError(f"--method {args.method} needs calibration text: pass --calib FILE")
    check_new_folder(args.out)
    if args.model != TINY_NAME and is_compressed(args.model):
        raise ValueError(f"--model {args.model} is already compressed ({META_FILE}); {args.command} the original "
                         "model")
    model, tokenizer = load_model(args.model)
    calib, extra = None, {"source": _source(args.model)}
    if needs_calib:
        tokens = tokenize(read_text(args.calib, max_chars=args.calib_samples * args.calib_seq_len * 8), tokenizer)
        calib = _windows(args, tokens, source=args.calib, seq_flag="--calib-seq-len", count_flag="--calib-samples")
        extra.update(calib_windows=len(calib), calib_seq_len=args.calib_seq_len)
    start = time.perf_counter()
    transform = quantize_model if args.command == "quantize" else sparsify_model
    transform(model, config, calib=calib, progress=not args.no_progress)
    with new_folder(args.out) as tmp:  # written whole or not at all
        save_compressed(model, tmp, config=config, extra=extra)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    print(f"{config.method}: {len(compressed_modules(model))} modules compressed in "
          f"{time.perf_counter() - start:.1f}s → {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .export_gptq import export_gptq

    out = export_gptq(args.model, args.out, checkpoint_format=args.format)
    print(f"export: {args.model} -> {out} ({args.format})")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import format_table, module_rows

    meta = read_metadata(args.dir)
    print(format_table(module_rows(args.dir, meta)))
    return 0


def _recorded_baseline(model: str) -> str | None:
    """The source model recorded at compression time; an error that says so when it is gone."""
    source = read_metadata(model).get("extra", {}).get("source")
    if source and source != TINY_NAME and not Path(source).exists():
        raise FileNotFoundError(f"baseline {source!r} not found: it is the source model recorded at compression time "
                                f"in {Path(model) / META_FILE}; pass --baseline DIR to compare with it elsewhere")
    return source


def _check_vocab(model, tokens, name: str, flag: str, model_vocab: int | None = None) -> None:
    from .hf import vocab_size

    vocab = vocab_size(model)
    if vocab is None:
        return
    if model_vocab is not None and vocab != model_vocab:
        raise ValueError(f"{flag} {name} has a vocabulary of {vocab} tokens but --model has {model_vocab}: a "
                         f"different model; give {flag} the model that --model was compressed from")
    top = int(tokens.max())
    if top >= vocab:
        raise ValueError(f"{flag} {name}: the tokenizer gives token id {top} but the model's embedding has {vocab} "
                         "rows; its tokenizer files do not belong to this model")


def cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import perplexity
    from .hf import is_compressed, load_model, tokenize, vocab_size

    model, tokenizer = load_model(args.model)
    baseline = args.baseline
    if baseline is None and is_compressed(args.model):
        baseline = _recorded_baseline(args.model)
    text = read_text(args.data, max_chars=args.seq_len * args.max_windows * 8)
    tokens = tokenize(text, tokenizer)
    _check_vocab(model, tokens, args.model, "--model")
    _windows(args, tokens, source=args.data, seq_flag="--seq-len", count_flag="--max-windows")
    ppl = dict(seq_len=args.seq_len, max_windows=args.max_windows, progress=not args.no_progress)
    rows = []
    if baseline:
        base, _ = load_model(baseline, flag="--baseline")
        _check_vocab(base, tokens, baseline, "--baseline", vocab_size(model))
        rows.append(("before", baseline, perplexity(base, tokens, **ppl)))
        del base
    rows.append(("after" if baseline else "model", args.model, perplexity(model, tokens, **ppl)))
    for label, name, ppl in rows:
        print(f"{label:7s} {ppl:10.3f}  {name}")
    if len(rows) == 2:
        print(f"change  {100 * (rows[1][2] / rows[0][2] - 1):+9.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
