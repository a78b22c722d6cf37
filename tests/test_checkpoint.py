"""Engine checkpoints: round trip per stage, resharding 2 -> 1 and 2 -> 3 ranks across stages, atomicity
under SIGKILL, corrupted shards, another model refused, export to transformers.

A global batch is 6 micro-batches (2 ranks × 3 accumulation, 1 × 6, 3 × 2), so every world size sees the
same data per optimizer step (tests/engine_cases.py: rank r takes micro-batch k·world + r at micro-step k).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.engine_cases import Case, loss_of, make_model, micro_batch
from zspeed.core.comm import ReduceOp, all_reduce
from zspeed.core.topology import Topology
from zspeed.train import checkpoint_format
from zspeed.train.checkpoint_format import CheckpointCorruptError, CheckpointFormatError, read_latest
from zspeed.train.config import load_config
from zspeed.train.engine import ZeroEngine

GLOBAL_MICRO = 6
BEFORE, AFTER = 2, 3  # steps before the save, steps compared after it


def make_engine(topo, stage: int, *, kind: str = "llama", precision: str = "fp32", offload: dict | None = None,
                seed: int = 0) -> ZeroEngine:
    case = Case(kind=kind, stage=stage, precision=precision, gas=GLOBAL_MICRO // topo.world_size, lr=5e-3)
    cfg = case.ds_config(topo.world_size)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-3,
                                                       "warmup_num_steps": 4}}
    if offload:
        cfg["zero_optimization"].update(offload)
    config = load_config(cfg, world_size=topo.world_size)
    return ZeroEngine(module=make_model(kind, seed), config=config, topo=topo)


def train(engine, topo, steps: int, kind: str = "llama") -> list[float]:
    """``steps`` optimizer steps from ``engine.global_steps``; the global mean loss of each."""
    gas = engine.config.gradient_accumulation_steps
    losses = []
    for _ in range(steps):
        total = torch.zeros(1)
        for k in range(gas):
            loss = loss_of(kind, engine, micro_batch(kind, engine.global_steps, k * topo.world_size + topo.rank))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        losses.append(all_reduce(total, topo=topo, op=ReduceOp.AVG).item() / gas)
    return losses


def _save_at_two(topo, root: str) -> dict:
    """Per stage: train, save, train on (the reference); reload at the same world and stage (round trip)."""
    out = {}
    for stage in range(4):
        engine = make_engine(topo, stage)
        train(engine, topo, BEFORE)
        path = engine.save_checkpoint(f"{root}/s{stage}", client_state={"data": {"epoch": 0, "position": 12}})
        lr = engine.get_lr()
        ref = train(engine, topo, AFTER)
        again = make_engine(topo, stage, seed=1)  # other initial weights: everything must come from the file
        folder, client = again.load_checkpoint(f"{root}/s{stage}")
        assert folder == path and client == {"data": {"epoch": 0, "position": 12}}
        assert again.global_steps == BEFORE and again.get_lr() == lr
        out[stage] = {"ref": ref, "round_trip": train(again, topo, AFTER)}
        # Loaded over a step left half done (every micro-batch's backward, the boundary's step never taken):
        # none of its gradients may count after the load.
        gas = engine.config.gradient_accumulation_steps
        for k in range(gas):
            engine.backward(loss_of("llama", engine, micro_batch("llama", engine.global_steps,
                                                                  k * topo.world_size + topo.rank)))
            if k < gas - 1:
                engine.step()
        engine.load_checkpoint(f"{root}/s{stage}")
        out[stage]["over_partial_step"] = train(engine, topo, AFTER)
    return out


def _resume_elsewhere(topo, root: str, stages: dict) -> dict:
    """Load each stage's checkpoint at this world size and another stage; train on."""
    out = {}
    for saved, stage in stages.items():
        engine = make_engine(topo, stage, seed=2)
        engine.load_checkpoint(f"{root}/s{saved}")
        out[saved] = train(engine, topo, AFTER)
    return out


def test_round_trip_and_reshard_across_world_sizes_and_stages(tmp_path):
    saved = run_distributed(_save_at_two, 2, str(tmp_path))[0]
    for stage, r in saved.items():
        assert r["round_trip"] == pytest.approx(r["ref"], rel=1e-6), f"stage {stage} round trip"
        assert r["over_partial_step"] == pytest.approx(r["ref"], rel=1e-6), f"stage {stage} loaded mid-step"
    one = run_distributed(_resume_elsewhere, 1, str(tmp_path), {0: 3, 1: 0, 2: 1, 3: 2})[0]
    three = run_distributed(_resume_elsewhere, 3, str(tmp_path), {0: 2, 1: 3, 2: 0, 3: 1})[0]
    for stage, r in saved.items():
        assert one[stage] == pytest.approx(r["ref"], rel=1e-5), f"saved at stage {stage}, resumed at 1 rank"
        assert three[stage] == pytest.approx(r["ref"], rel=1e-5), f"saved at stage {stage}, resumed at 3 ranks"


# -- atomicity, corruption, another model ---------------------------------------------------------

def _save_then_die(root: str) -> None:
    torch.set_num_threads(1)
    engine = make_engine(Topology.single(), 2, kind="mlp")
    train(engine, Topology.single(), 1, kind="mlp")
    engine.save_checkpoint(root)  # global_step1, complete

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)  # the rank file is written; the rename never happens
    checkpoint_format.commit_dir = killed
    import zspeed.train.checkpoint as ckpt
    ckpt.commit_dir = killed
    train(engine, Topology.single(), 1, kind="mlp")
    engine.save_checkpoint(root)


def test_sigkill_mid_save_leaves_the_previous_checkpoint(tmp_path):
    proc = mp.get_context("spawn").Process(target=_save_then_die, args=(str(tmp_path),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    assert read_latest(tmp_path) == "global_step1" and (tmp_path / "global_step2.tmp").is_dir()
    engine = make_engine(Topology.single(), 2, kind="mlp")
    folder, _ = engine.load_checkpoint(str(tmp_path))
    assert folder.endswith("global_step1") and engine.global_steps == 1
    engine.save_checkpoint(str(tmp_path), tag="global_step2")  # a stale staging folder is replaced
    assert read_latest(tmp_path) == "global_step2" and not (tmp_path / "global_step2.tmp").exists()


def _resave_then_die(root: str, exchange: bool) -> None:
    """Save global_step1, then save the same tag again and die where the old folder is out of the way: after the
    atomic exchange (``exchange``), or between the two renames of the fallback."""
    torch.set_num_threads(1)
    engine = make_engine(Topology.single(), 2, kind="mlp")
    train(engine, Topology.single(), 1, kind="mlp")
    engine.save_checkpoint(root)
    replace = os.replace
    if exchange:
        swap = checkpoint_format._exchange

        def killed_after_swap(a, b):
            assert swap(a, b)
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint_format._exchange = killed_after_swap
    else:
        checkpoint_format._exchange = lambda a, b: False

        def killed_between(src, dst):
            if ".old-" in str(dst):  # the old folder moved aside; the new one is never renamed in
                replace(src, dst)
                os.kill(os.getpid(), signal.SIGKILL)
            replace(src, dst)
        checkpoint_format.os.replace = killed_between
    engine.save_checkpoint(root, tag="global_step1")


@pytest.mark.parametrize("exchange", [True, False])
def test_sigkill_while_saving_a_tag_again_leaves_a_loadable_tag(tmp_path, exchange):
    """Saving over an existing tag: with the atomic exchange the tag is always whole (the new one); without it a kill
    between the two renames leaves the tag missing, and the next reader moves the old folder back."""
    proc = mp.get_context("spawn").Process(target=_resave_then_die, args=(str(tmp_path), exchange))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    assert (tmp_path / "global_step1").is_dir() == exchange  # (the fallback left it moved aside)
    assert read_latest(tmp_path) == "global_step1" and (tmp_path / "global_step1").is_dir()
    assert not list(tmp_path.glob(".global_step1.old-*"))
    engine = make_engine(Topology.single(), 2, kind="mlp")
    folder, _ = engine.load_checkpoint(str(tmp_path))
    assert folder.endswith("global_step1") and engine.global_steps == 1


def test_a_moved_aside_tag_another_rank_moved_back_first_is_no_error(tmp_path, monkeypatch):
    (tmp_path / ".global_step3.old-123").mkdir()
    checkpoint_format.update_latest(tmp_path, "global_step3")

    def lost_the_race(src, dst):
        raise FileNotFoundError(src)
    monkeypatch.setattr(checkpoint_format.os, "replace", lost_the_race)
    assert read_latest(tmp_path) == "global_step3"


def test_saving_a_tag_again_replaces_it_whole(tmp_path):
    staging = checkpoint_format.staging_dir(tmp_path, "t")
    for text in ("old", "new"):
        staging.mkdir()
        (staging / "f").write_text(text)
        checkpoint_format.commit_dir(staging, tmp_path / "t")
    assert (tmp_path / "t" / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_corrupted_shard_and_other_model_are_refused(tmp_path):
    topo = Topology.single()
    engine = make_engine(topo, 1, kind="mlp")
    train(engine, topo, 1, kind="mlp")
    folder = Path(engine.save_checkpoint(str(tmp_path / "c")))
    data = bytearray((folder / "rank00000.safetensors").read_bytes())
    data[-50] ^= 0x10
    (folder / "rank00000.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"rank00000\.safetensors is corrupted: CRC-32"):
        make_engine(topo, 1, kind="mlp").load_checkpoint(str(tmp_path / "c"))
    llama = make_engine(topo, 1, kind="llama")
    with pytest.raises(CheckpointFormatError, match=r"is not of the engine's model: tensor 'model\.embed_tokens"):
        llama.load_checkpoint(str(tmp_path / "c"))
    with pytest.warns(UserWarning, match="no checkpoint to load"):
        assert make_engine(topo, 1).load_checkpoint(str(tmp_path / "none")) == (None, None)


def test_export_of_an_engine_checkpoint_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from zspeed.train.export import export_checkpoint
    topo = Topology.single()
    engine = make_engine(topo, 3, precision="bf16")
    train(engine, topo, 2)
    folder = Path(engine.save_checkpoint(str(tmp_path / "c")))  # config.json is saved beside the shards
    export_checkpoint(folder, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    ids = micro_batch("llama", 9, 0)["input_ids"]
    with torch.no_grad():
        want = engine(input_ids=ids).logits.float()  # the engine computes in bf16 from the same masters
        got = model.to(torch.bfloat16)(input_ids=ids).logits.float()
    assert torch.allclose(got, want, atol=2e-2), (got - want).abs().max()
