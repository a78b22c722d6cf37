"""engine.save_16bit_model: DeepSpeed's one-file 16-bit export, as safetensors, gathered from every rank."""
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.dist_utils import run_distributed
from tests.engine_cases import Case, loss_of, micro_batch, make_model
from zspeed.train.config import load_config
from zspeed.train.engine import ZeroEngine


def _engine(topo, stage: int, gather_flag: bool) -> ZeroEngine:
    cfg = Case(kind="llama", stage=stage, precision="bf16").ds_config(topo.world_size)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather_flag
    engine = ZeroEngine(module=make_model("llama", 0), config=load_config(cfg, world_size=topo.world_size),
                        topo=topo)
    engine.backward(loss_of("llama", engine, micro_batch("llama", 0, topo.rank)))
    engine.step()
    return engine


def _save_cases(topo, root: str):
    results = []
    for stage, flag in ((2, False), (3, True), (3, False)):
        engine = _engine(topo, stage, flag)
        out = Path(root) / f"stage{stage}-{flag}"
        written = engine.save_16bit_model(str(out))
        expect = engine.full_state_dict()
        if written and topo.rank == 0:
            saved = load_file(str(out / "model.safetensors"))
            assert saved.keys() == expect.keys()
            for k, v in expect.items():
                assert saved[k].dtype == v.dtype and torch.equal(saved[k], v), k
            assert all(v.dtype == torch.bfloat16 for v in saved.values())
        results.append((stage, flag, written, (out / "model.safetensors").exists()))
    return results


def test_save_16bit_model_gathers_every_shard():
    with tempfile.TemporaryDirectory() as root:
        for rank_results in run_distributed(_save_cases, 2, root):
            assert rank_results == [(2, False, True, True), (3, True, True, True), (3, False, False, False)]


def test_save_16bit_model_refuses_pickle_names(tmp_path):
    from zspeed.train.save_16bit import save_16bit_model
    with pytest.raises(ValueError, match="safetensors, not pickle"):
        save_16bit_model(object(), tmp_path, "pytorch_model.bin")
