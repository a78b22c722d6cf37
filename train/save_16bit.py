"""``engine.save_16bit_model``: DeepSpeed's one-file export of the whole model's 16-bit weights.

Written as safetensors (never pickle), by rank 0, atomically (temporary file, fsync, rename), after a
collective gather of every rank's shards. At stage 3, as in DeepSpeed, only when
``zero_optimization.stage3_gather_16bit_weights_on_model_save`` is true: otherwise nothing is written, a
warning names the key, and the call returns False.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from safetensors.torch import save_file

log = logging.getLogger("zspeed.train")


def save_16bit_model(engine, save_dir: str | os.PathLike, save_filename: str = "model.safetensors") -> bool:
    """Gather the compute-dtype weights and write ``save_dir/save_filename``; collective. True if written."""
    if not save_filename.endswith(".safetensors"):
        raise ValueError(f"save_16bit_model writes safetensors, not pickle: name the file '*.safetensors' "
                         f"(got {save_filename!r}; DeepSpeed's default 'pytorch_model.bin' is a pickle)")
    z = engine.config.zero_optimization
    if z.stage == 3 and not z.stage3_gather_16bit_weights_on_model_save:
        log.warning("save_16bit_model: nothing written; at ZeRO stage 3 set "
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save to true to gather the weights "
                    "(or use save_checkpoint, which needs no gather)")
        return False
    state = engine.full_state_dict(master=False, device="cpu")
    if engine.topo.is_main:
        _write_atomically(_unshared(state), Path(save_dir) / save_filename)
    engine.topo.barrier()
    return True


def _unshared(state: dict) -> dict:
    """safetensors refuses tensors that share memory (tied weights): give each key its own copy."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v.contiguous()
        seen.add(ptr)
    return out


def _write_atomically(tensors: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt", "writer": "zspeed save_16bit_model"})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
