"""Engine checkpoints: ``save_checkpoint`` / ``load_checkpoint`` with DeepSpeed's semantics, in zspeed's format.

The files are those of ``[Note: sharded state layout]`` (per-rank safetensors
plus ``zspeed_state.json``) written as ``[Note: atomic checkpoints]`` says, both
in :mod:`zspeed.train.checkpoint_format`. The engine methods of the same names
delegate here.

[Note: resharding by tensor name]
A checkpoint is read tensor by tensor, never group by group, so it loads at
any world size and any stage. A rank that keeps range ``[a, b)`` of a flat
group's full layout (its chunk from stage 1 on; the whole group at stage 0 and
for frozen parameters) walks the group's tensors; for each element range of a
tensor that falls in ``[a, b)`` it finds, in the metadata, the saved pieces
that overlap it and reads just those elements from their rank files
(``safe_open(...).get_slice``: memory-mapped, nothing else touched). Each rank
file's CRC-32 is checked the first time the rank opens it. Padding stays zero.
After the masters are loaded the compute parameters are republished, so the
next forward sees the checkpoint's values.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .checkpoint_format import (
    CheckpointFormatError,
    GroupLayout,
    ShardedStateMeta,
    TensorLayout,
    array_key,
    check_matches_model,
    commit_dir,
    group_layout,
    read_latest,
    read_meta,
    staging_dir,
    update_latest,
    verify_files,
    write_meta,
    write_rank_file,
)
from .checkpoint_state import (
    MASTER,
    PARAM,
    jsonable,
    local_arrays,
    optimizer_hyperparams,
    optimizer_scalars,
    parameter_shapes,
    restore_hyperparams,
    restore_rng,
    rng_state,
    set_local_arrays,
    tied_aliases,
)
from .export import ShardReader
from .param_group_state import FlatParamGroup

__all__ = ["save_checkpoint", "load_checkpoint", "default_tag"]

_STATE = "__state__"
_READ_CHUNK = 64 << 20


def default_tag(engine) -> str:
    return f"global_step{engine.global_steps}"


def named_groups(engine) -> Iterator[tuple[str, FlatParamGroup]]:
    """Every flat group with its checkpoint name ``u<unit>.<k>`` (unique within one engine)."""
    for u in engine.units:
        for k, g in enumerate(u.groups):
            yield f"u{u.index}.{k}", g


# -- saving ---------------------------------------------------------------------------------------

def save_checkpoint(engine, save_dir: str | os.PathLike, *, tag: str | None = None,
                    client_state: dict[str, Any] | None = None, save_latest: bool = True) -> Path:
    """Write this rank's shard and (rank 0) the metadata; collective. Returns the tag folder."""
    topo = engine.topo
    tag = tag or default_tag(engine)
    root = Path(save_dir)
    staging = staging_dir(root, tag)
    state = _engine_state(engine, client_state or {})
    if topo.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():  # left by a save that was killed
            shutil.rmtree(staging)
        staging.mkdir()
    topo.barrier()
    tensors, layouts = {}, []
    for name, g in named_groups(engine):
        arrays = _arrays_for_save(engine, g)
        tensors.update({array_key(name, a): t for a, t in arrays.items()})
        layouts.append(group_layout(name, g.group, arrays={a: t.dtype for a, t in arrays.items()}))
    rng_tensors, rng_plain = rng_state(topo.device)
    tensors.update({f"{_STATE}/{k}": v for k, v in rng_tensors.items()})
    record = write_rank_file(staging, topo.rank, tensors)
    gathered = _all_gather_objects(topo, (record, rng_plain))
    if topo.is_main:
        state["rng"] = [plain for _, plain in gathered]
        meta = ShardedStateMeta(world_size=topo.world_size, groups=tuple(layouts),
                                files=tuple(rec for rec, _ in gathered), aliases=tied_aliases(engine.module),
                                state=state)
        write_meta(staging, meta)
        _write_model_config(engine.module, staging)
        commit_dir(staging, root / tag)
        if save_latest:
            update_latest(root, tag)
    topo.barrier()
    return root / tag


def _write_model_config(module: torch.nn.Module, folder: Path) -> None:
    """A Hugging Face model's ``config.json`` beside the shards, so export needs nothing else."""
    config = getattr(module, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(folder)


def _arrays_for_save(engine, g: FlatParamGroup) -> dict[str, torch.Tensor]:
    if engine.offload is not None and g.trainable:
        return engine.offload.arrays(g)
    return local_arrays(g, engine.optimizer)


def _engine_state(engine, client_state: dict[str, Any]) -> dict[str, Any]:
    cfg = engine.config
    return {
        "global_steps": engine.global_steps, "stage": cfg.zero_stage, "precision": cfg.precision.value,
        "world_size": engine.topo.world_size, "train_batch_size": cfg.train_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "lr_scheduler": jsonable(engine.lr_scheduler.state_dict(), "the lr scheduler's state_dict()")
        if engine.lr_scheduler is not None else None,
        "optimizer": {"param_groups": jsonable(optimizer_hyperparams(engine.optimizer), "optimizer hyperparameters"),
                      "scalars": optimizer_scalars(engine.optimizer)},
        "client_state": jsonable(client_state, "client_state"),
    }


def _all_gather_objects(topo, obj: Any) -> list[Any]:
    if not topo.is_distributed:
        return [obj]
    out: list[Any] = [None] * topo.world_size
    dist.all_gather_object(out, obj, group=topo.dp_group)
    return out


# -- loading --------------------------------------------------------------------------------------

def load_checkpoint(engine, load_dir: str | os.PathLike, *, tag: str | None = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
    """Restore the engine from ``load_dir/tag`` (default: the ``latest`` tag); collective.

    Returns ``(folder, client_state)``, or ``(None, None)`` when ``load_dir`` has no ``latest`` file.

    Raises:
        CheckpointFormatError: bad metadata, or a checkpoint of another model (names the first
            mismatching tensor).
        CheckpointCorruptError: a rank file that fails its size or CRC-32 check (named).
    """
    root = Path(load_dir)
    tag = tag or read_latest(root)
    if tag is None:
        warnings.warn(f"no checkpoint to load: {root / 'latest'} does not exist", stacklevel=3)
        return None, None
    folder = root / tag
    meta = read_meta(folder)
    check_matches_model(meta, parameter_shapes(engine.module), where=f"checkpoint {folder}",
                        model="the engine's model")
    with_optimizer = load_optimizer_states and not load_module_only
    with _Pieces(folder, meta) as pieces:
        for _, g in named_groups(engine):
            if g.trainable:  # a checkpoint is taken between steps: no gradient of a backward before the load counts
                g.zero_grads()
            _load_group(engine, g, pieces, with_optimizer)
        _restore_rng(engine, pieces, meta)
    if engine.param_offload is not None:
        engine.param_offload.after_update()
    _restore_engine_state(engine, meta.state, with_optimizer=with_optimizer,
                          with_scheduler=load_lr_scheduler_states and not load_module_only)
    engine.topo.barrier()
    return str(folder), meta.state.get("client_state", {})


def _load_group(engine, g: FlatParamGroup, pieces: "_Pieces", with_optimizer: bool) -> None:
    a, b = _kept_range(engine, g)
    if not g.trainable:
        values = pieces.range(g, (PARAM, MASTER), a, b, g.dtype)
        if g.full is not None and g.full.untyped_storage().size():
            g.full.copy_(values)
        if g.shard is not None:
            g.shard.copy_(values[g.lo:g.hi])
        if g.source is not None:
            g.source.write(g, values[g.lo:g.hi])
        return
    arrays = {MASTER: pieces.range(g, (MASTER, PARAM), a, b, torch.float32)}
    if with_optimizer:
        for name in pieces.state_arrays(g):
            arrays[name] = pieces.range(g, (name,), a, b, torch.float32)
    scalars = pieces.meta.state.get("optimizer", {}).get("scalars", {}) if with_optimizer else {}
    if engine.offload is not None:
        engine.offload.load_arrays(g, arrays, scalars)
    else:
        set_local_arrays(g, engine.optimizer, arrays, scalars)
        g.publish()


def _kept_range(engine, g: FlatParamGroup) -> tuple[int, int]:
    """The range of the group's full layout this rank keeps (see [Note: resharding by tensor name])."""
    if g.trainable and engine.policy.shard_optimizer:
        return g.lo, g.hi
    return 0, g.group.full_numel


def _restore_rng(engine, pieces: "_Pieces", meta: ShardedStateMeta) -> None:
    rank = engine.topo.rank
    if rank >= meta.world_size:
        return  # more ranks than were saved: the new ranks keep their seeds
    tensors = pieces.state_tensors(rank)
    plain = meta.state.get("rng", [{}] * meta.world_size)[rank]
    restore_rng(engine.topo.device, tensors, plain)


def _restore_engine_state(engine, state: dict[str, Any], *, with_optimizer: bool, with_scheduler: bool) -> None:
    engine.global_steps = int(state.get("global_steps", 0))
    engine.micro_steps = engine.global_steps * engine.config.gradient_accumulation_steps
    if with_optimizer:
        opt = state.get("optimizer", {})
        if "param_groups" in opt:
            restore_hyperparams(engine.optimizer, opt["param_groups"])
        if engine.scaler is not None and state.get("loss_scaler") is not None:
            engine.scaler.load_state_dict(state["loss_scaler"])
    if with_scheduler and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])


class _Pieces:
    """Reads element ranges of saved tensors, by name, from the rank files that hold them."""

    def __init__(self, folder: Path, meta: ShardedStateMeta):
        self.folder, self.meta = folder, meta
        self.where: dict[str, tuple[GroupLayout, TensorLayout]] = {
            t.name: (grp, t) for grp in meta.groups for t in grp.tensors}
        self._stack = contextlib.ExitStack()
        self._reader = self._stack.enter_context(ShardReader(folder, meta, chunk_bytes=_READ_CHUNK))
        self._verified: set[int] = set()

    def __enter__(self) -> "_Pieces":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _verify(self, rank: int) -> None:
        if rank not in self._verified:
            verify_files(self.folder, self.meta, ranks=[rank])
            self._verified.add(rank)

    def state_arrays(self, g: FlatParamGroup) -> list[str]:
        """Optimizer-state arrays saved for the group's tensors (empty before the first step)."""
        names: set[str] = set()
        for slot in g.group.slots:
            grp, _ = self.where[slot.name]
            names.update(a for a in grp.arrays if a not in (MASTER, PARAM))
        return sorted(names)

    def range(self, g: FlatParamGroup, arrays: tuple[str, ...], a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[a, b)`` of the group's full layout, from the first of ``arrays`` each tensor has."""
        out = torch.zeros(b - a, dtype=dtype)
        for slot in g.group.slots:
            s0, s1 = max(a, slot.offset), min(b, slot.offset + slot.numel)
            if s0 < s1:
                self._copy_tensor(out[s0 - a:s1 - a], slot.name, arrays, s0 - slot.offset, s1 - slot.offset)
        return out

    def _copy_tensor(self, out: torch.Tensor, name: str, arrays: tuple[str, ...], t0: int, t1: int) -> None:
        grp, layout = self.where[name]
        array = next((x for x in arrays if x in grp.arrays), None)
        if array is None:
            raise CheckpointFormatError(f"{self.folder}: tensor {name!r} has no {' or '.join(arrays)} array "
                                        f"(group {grp.name!r} holds {sorted(grp.arrays)})")
        key = array_key(grp.name, array)
        for p in layout.pieces:
            x0, x1 = max(t0, p.tensor_start), min(t1, p.tensor_start + p.numel)
            if x0 >= x1:
                continue
            self._verify(p.rank)
            start = p.shard_start + x0 - p.tensor_start
            src = self._reader.read(p.rank, key, grp.holders[p.rank], start, start + x1 - x0)
            out[x0 - t0:x1 - t0].copy_(src)

    def state_tensors(self, rank: int) -> dict[str, torch.Tensor]:
        """This rank's ``__state__/...`` tensors (RNG states) from its saved file."""
        from safetensors import safe_open

        self._verify(rank)
        path = self.folder / self.meta.file_of(rank).name
        with safe_open(str(path), framework="pt") as f:
            return {k.split("/", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(_STATE + "/")}
