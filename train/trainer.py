"""The ``ztrain`` training loop, over the engine's public API.

:func:`train` takes a checked :class:`TrainPlan` (see :mod:`zspeed.train.cli`)
and this process's topology, and runs: pack the data, build the model, wrap
it with ``zspeed.initialize``, then for every optimizer step feed this rank's
micro-batches (``engine(input_ids=..., labels=...)``, ``engine.backward``,
``engine.step``), evaluate the held-out rows every ``eval_every`` steps, save
a checkpoint every ``save_every`` steps, and at the end export a Hugging Face
folder and plot the losses. Only rank 0 writes the log, the plot and the
export; every rank takes part in the collectives.
"""
from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..core.comm import ReduceOp, all_reduce
from ..core.memory import format_bytes
from ..core.topology import Topology
from .cli_config import FlagValues, auto_context
from .config import load_config, resize_for_world_size
from .data import IGNORE_INDEX, DataConfig, DataCursor, Document, GlobalOrderSampler, PackedDataset, build_splits, \
    collate
from .lora import ADAPTER_DIR, LoraSpec, apply_lora, merged_state_dict
from .models import ModelSource, build_model
from .run_log import RunLog, plot_losses
from .tokenizer import TextTokenizer, tokenizer_summary

__all__ = ["TrainPlan", "train", "evaluate", "CHECKPOINT_DIR", "EXPORT_DIR"]

CHECKPOINT_DIR = "checkpoints"
EXPORT_DIR = "model"
LOG_FILE = "log.jsonl"
PLOT_FILE = "loss.png"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainPlan:
    """Everything a run needs, checked by the CLI before any work."""

    model: ModelSource
    tokenizer: TextTokenizer
    documents: tuple[Document, ...]
    config: dict[str, Any]  # the DeepSpeed dict; "auto" values resolved in :func:`train`
    flags: FlagValues
    hidden_size: int | None
    seq_len: int
    seed: int
    eval_fraction: float
    epochs: int | None
    max_steps: int | None
    eval_every: int | None
    save_every: int | None
    resume: bool
    out: Path
    export: bool = True
    lora: LoraSpec | None = None  # train adapters only (see zspeed.train.lora)
    chunked_loss: bool = True  # the loss chunk by chunk, without the full logits (zspeed.train.chunked_loss)
    lean_activations: bool = True  # norms and gated MLPs recompute, same gradients (zspeed.train.lean_activations)


def train(plan: TrainPlan, topo: Topology) -> dict[str, Any]:
    """Run the plan on this rank; returns a summary (rank 0's values)."""
    torch.manual_seed(plan.seed)
    log = RunLog(plan.out / LOG_FILE, enabled=topo.is_main)
    splits = build_splits(plan.documents, plan.tokenizer,
                          DataConfig(seq_len=plan.seq_len, seed=plan.seed, eval_fraction=plan.eval_fraction))
    cfg, total_steps = _resolve_config(plan, topo.world_size, len(splits.train))
    model = build_model(plan.model, plan.tokenizer, seed=plan.seed)
    hf_config = json.loads(model.config.to_json_string())
    chunked = plan.chunked_loss and _chunk_loss(model)
    lean = _lean(model) if plan.lean_activations else None
    if plan.lora is not None:  # before initialize: the engine keeps the frozen base in non-trainable groups
        model = apply_lora(model, plan.lora, seed=plan.seed)

    import zspeed  # lazily: the engine and its dependencies load only when training starts

    engine, _, _, _ = zspeed.initialize(model=model, config=cfg, topology=topo)
    cursor = _maybe_resume(engine, plan, log)
    sampler = GlobalOrderSampler(len(splits.train), global_batch=cfg.train_batch_size,
                                 micro_batch=cfg.train_micro_batch_size_per_gpu, rank=topo.rank,
                                 world_size=topo.world_size, seed=plan.seed, cursor=cursor)
    log.write("start", model=plan.model.name, world_size=topo.world_size, stage=cfg.zero_stage,
              precision=cfg.precision.value, offload_optimizer=cfg.zero_optimization.offload_optimizer.device.value,
              offload_param=cfg.zero_optimization.offload_param.device.value, train_batch_size=cfg.train_batch_size,
              micro_batch=cfg.train_micro_batch_size_per_gpu, gradient_accumulation=cfg.gradient_accumulation_steps,
              total_steps=total_steps, start_step=engine.global_steps, data=splits.stats,
              tokenizer=tokenizer_summary(plan.tokenizer), seed=plan.seed,
              lora=plan.lora.to_dict() if plan.lora is not None else None, chunked_loss=chunked,
              lean_activations=lean)
    loop = _Loop(plan=plan, topo=topo, engine=engine, splits=splits, log=log, total_steps=total_steps)
    summary = loop.run(sampler, cursor)
    if plan.export:
        _export(engine, plan, topo, hf_config, log)
    if topo.is_main:
        plot_losses(plan.out / LOG_FILE, plan.out / PLOT_FILE, title=f"ztrain {plan.model.name}")
    log.write("end", **summary)
    return summary


def _chunk_loss(model) -> bool:
    """The training loss without the full logits where the model allows it (evaluation reads the logits)."""
    from .chunked_loss import chunk_lm_loss

    try:
        chunk_lm_loss(model)
    except ValueError as err:
        warnings.warn(f"ztrain: training with the model's own loss (full logits): {err}", stacklevel=2)
        return False
    return True


def _lean(model) -> dict[str, int]:
    """Fewer saved activations for the same gradients (zspeed.train.lean_activations); what changed, by kind."""
    from .lean_activations import lean_activations

    report = lean_activations(model)
    if report.skipped:
        warnings.warn(f"ztrain: {report}", stacklevel=2)
    return {"norms": len(report.norms), "mlps": len(report.mlps)}


def _resolve_config(plan: TrainPlan, world: int, train_rows: int):
    """The config with the run's step counts filled in; and the total number of optimizer steps."""
    first = load_config(plan.config, world_size=world,
                        auto_context=auto_context(plan.flags, hidden_size=plan.hidden_size, total_steps=1,
                                                  warmup_steps=1))
    batch = _resumed_global_batch(plan) or first.train_batch_size
    per_epoch = train_rows // batch
    total = plan.max_steps if plan.max_steps is not None else per_epoch * (plan.epochs or 1)
    if total < 1:
        raise ValueError(f"the training split has {train_rows} rows, fewer than one global batch of "
                         f"{batch}; add data or lower the global batch or --seq-len")
    ctx = auto_context(plan.flags, hidden_size=plan.hidden_size, total_steps=total, warmup_steps=max(2, total // 20))
    cfg = load_config(plan.config, world_size=world, auto_context=ctx)
    if batch != cfg.train_batch_size:  # resumed at another world size: same global batch, other accumulation
        cfg = resize_for_world_size(cfg, world, train_batch_size=batch)
    return cfg, total


def _resumed_global_batch(plan: TrainPlan) -> int | None:
    """The global batch of the checkpoint being resumed, unless the flags or the config file set one.

    An elastic restart may come back with another number of workers; the default global batch
    (micro-batch × ranks) would then change, and with it the data order and the optimizer steps.
    """
    if not plan.resume or plan.flags.global_batch is not None or \
            plan.config.get("train_batch_size", "auto") != "auto":
        return None
    from .checkpoint_format import read_latest, read_meta

    root = plan.out / CHECKPOINT_DIR
    tag = read_latest(root)
    return int(read_meta(root / tag).state.get("train_batch_size", 0)) or None if tag else None


def _maybe_resume(engine, plan: TrainPlan, log: RunLog) -> DataCursor:
    if not plan.resume:
        return DataCursor()
    # The schedule is this run's (its total may differ from the saved run's), positioned at the saved step.
    path, client = engine.load_checkpoint(str(plan.out / CHECKPOINT_DIR), load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"--resume: no checkpoint could be loaded from {plan.out / CHECKPOINT_DIR}")
    if engine.lr_scheduler is not None and engine.global_steps:
        engine.lr_scheduler.load_state_dict({"last_batch_iteration": engine.global_steps - 1})
    state = (client or {}).get("ztrain", {})
    if state.get("seed", plan.seed) != plan.seed:
        raise ValueError(f"--resume: the checkpoint was trained with --seed {state['seed']}, not {plan.seed}; "
                         "the data order would change")
    saved_batch = state.get("train_batch_size", engine.config.train_batch_size)
    if saved_batch != engine.config.train_batch_size:
        raise ValueError(f"--resume: the checkpoint was trained with a global batch of {saved_batch} rows, this "
                         f"run has {engine.config.train_batch_size}; pass --global-batch {saved_batch} so the data "
                         "order and the optimizer steps continue unchanged")
    cursor = DataCursor.from_dict(state.get("data_cursor", {"epoch": 0, "position": 0}))
    log.write("resume", checkpoint=str(path), step=engine.global_steps, cursor=cursor.to_dict())
    return cursor


@dataclass
class _Loop:
    plan: TrainPlan
    topo: Topology
    engine: Any
    splits: Any
    log: RunLog
    total_steps: int

    def run(self, sampler: GlobalOrderSampler, cursor: DataCursor) -> dict[str, Any]:
        from tqdm import tqdm

        engine, plan = self.engine, self.plan
        remaining = self.total_steps - engine.global_steps
        tokens_per_step = sampler.global_batch * plan.seq_len
        bar = tqdm(total=self.total_steps, initial=engine.global_steps, disable=not self.topo.is_main,
                   desc="ztrain", unit="step", dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
        last: dict[str, Any] = {"steps": engine.global_steps}
        if engine.global_steps == 0 and self.splits.eval is not None:
            last["eval_loss"] = self._eval()
        steps = sampler.steps(max_steps=max(0, remaining), cursor=cursor,
                              epochs=None if plan.max_steps is not None else (plan.epochs or 1))
        for step in steps:
            t0 = time.perf_counter()
            loss = self._train_step(step.micro_batches)
            dt = time.perf_counter() - t0
            n = engine.global_steps
            lr = engine.get_lr()[0]
            mem = _peak_memory(self.topo)
            self.log.write("train", step=n, epoch=step.epoch, loss=loss, lr=lr, tokens_per_s=tokens_per_step / dt,
                           memory_bytes=mem, step_s=round(dt, 4))
            bar.set_postfix_str(f"loss {loss:.4f} | lr {lr:.2e} | {tokens_per_step / dt:,.0f} tok/s | "
                                f"mem {format_bytes(mem)}", refresh=False)
            bar.update(1)
            last.update(steps=n, loss=loss)
            if self.splits.eval is not None and n % self.eval_every == 0 and n < self.total_steps:
                last["eval_loss"] = self._eval()
            if plan.save_every and n % plan.save_every == 0:
                self._save(step.cursor_after)
        bar.close()
        if self.splits.eval is not None and last["steps"] > 0:
            last["eval_loss"] = self._eval()
        return last

    @property
    def eval_every(self) -> int:
        return self.plan.eval_every or max(1, self.total_steps // 10)

    def _train_step(self, micro_batches) -> float:
        engine, device = self.engine, self.engine.device
        engine.train()
        losses = []
        for rows in micro_batches:
            batch = collate([self.splits.train[i] for i in rows])
            out = engine(input_ids=batch["input_ids"].to(device), labels=batch["labels"].to(device))
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.detach().float())
        mean = torch.stack(losses).mean().reshape(1)
        return all_reduce(mean, topo=self.topo, op=ReduceOp.AVG).item()

    def _eval(self) -> float:
        loss = evaluate(self.engine, self.splits.eval, self.topo,
                        micro_batch=self.engine.config.train_micro_batch_size_per_gpu)
        self.log.write("eval", step=self.engine.global_steps, eval_loss=loss)
        return loss

    def _save(self, cursor: DataCursor) -> None:
        client = {"ztrain": {"data_cursor": cursor.to_dict(), "seed": self.plan.seed,
                             "train_batch_size": self.engine.config.train_batch_size,
                             "lora": self.plan.lora.to_dict() if self.plan.lora is not None else None}}
        tag = f"global_step{self.engine.global_steps}"
        self.engine.save_checkpoint(str(self.plan.out / CHECKPOINT_DIR), tag=tag, client_state=client)
        self.log.write("checkpoint", step=self.engine.global_steps, tag=tag, cursor=cursor.to_dict())


@torch.no_grad()
def evaluate(engine, rows: PackedDataset, topo: Topology, *, micro_batch: int) -> float:
    """Token-weighted mean loss of ``rows`` over all ranks (rank ``r`` takes rows ``r, r+W, ...``).

    Every rank runs the same number of forwards (stage 3 gathers parameters in
    each one); a rank short of rows repeats row 0 with weight 0.
    """
    engine.eval()
    mine = list(range(topo.rank, len(rows), topo.world_size))
    per_rank = math.ceil(len(rows) / topo.world_size)
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine += [0] * (per_rank - len(mine))
    total = torch.zeros(2, dtype=torch.float64)  # (sum of token losses, tokens)
    for lo in range(0, per_rank, micro_batch):
        batch = collate([rows[i] for i in mine[lo:lo + micro_batch]])
        w = torch.tensor(weights[lo:lo + micro_batch], dtype=torch.float64)
        logits = engine(input_ids=batch["input_ids"].to(engine.device)).logits.float().cpu()  # (B, T, V)
        labels = batch["labels"][:, 1:]  # (B, T-1): position t predicts token t+1
        tok = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                              ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape).double()
        counted = (labels != IGNORE_INDEX).double() * w[:, None]
        total += torch.stack([(tok * counted).sum(), counted.sum()])
    engine.train()
    total = all_reduce(total.to(engine.device), topo=topo, op=ReduceOp.SUM).cpu()
    return (total[0] / total[1].clamp(min=1)).item()


def _export(engine, plan: TrainPlan, topo: Topology, hf_config: dict[str, Any], log: RunLog) -> None:
    from .export import ExportConfig, export_state_dict

    state = engine.full_state_dict(master=True)  # a collective: every rank takes part
    if topo.is_main:
        if plan.lora is not None:
            base = build_model(plan.model, plan.tokenizer, seed=plan.seed)  # values replaced by the engine's
            state = merged_state_dict(state, base, plan.lora, adapter_dir=plan.out / ADAPTER_DIR)
        report = export_state_dict(state, plan.out / EXPORT_DIR, hf_config=hf_config, tokenizer=plan.tokenizer,
                                   config=ExportConfig(overwrite=True))
        log.write("export", folder=str(report.folder), files=list(report.files), bytes=report.total_bytes)
    topo.barrier()


def _peak_memory(topo: Topology) -> int:
    if topo.device.is_cuda:
        return topo.device.max_memory_allocated()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
