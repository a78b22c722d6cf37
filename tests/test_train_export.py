"""Sharded-state format and streaming export to a Hugging Face folder.

A tiny Llama's parameters are laid out bucket-major with core's FlatPartition
across 2 and 3 fake ranks (small buckets, so tensors straddle ranks), each
rank's shard is written in the checkpoint format, and the consolidated folder
must load in transformers with identical logits.
"""
from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import pytest
import torch

from tests.train_cases import VOCAB, save_sharded, tiny_llama
from zspeed.core.partition import FlatPartition
from zspeed.train import export as export_mod
from zspeed.train.checkpoint_format import (
    META_FILE,
    CheckpointCorruptError,
    CheckpointFormatError,
    ShardedStateMeta,
    array_key,
    atomic_output_dir,
    check_matches_model,
    commit_dir,
    group_layout,
    read_latest,
    read_meta,
    staging_dir,
    write_meta,
    write_rank_file,
)
from zspeed.train.export import SAFETENSORS_INDEX, ExportConfig, export_checkpoint, export_state_dict
from zspeed.train.tokenizer import ByteTokenizer

def logits(model, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), use_safetensors=True, local_files_only=True).eval()


@pytest.mark.parametrize("world", [2, 3])
def test_consolidated_folder_loads_with_identical_logits(tmp_path, world):
    model = tiny_llama()
    ckpt = save_sharded(model, tmp_path / "ckpt", world=world)
    meta = read_meta(ckpt)
    straddling = [t.name for g in meta.groups for t in g.tensors if len({p.rank for p in t.pieces}) > 1]
    assert len(meta.groups[0].buckets) > 3 and straddling  # bucket-major, tensors split across ranks
    assert read_latest(tmp_path / "ckpt") == "global_step7" and meta.state == {"global_steps": 7}
    report = export_checkpoint(ckpt, tmp_path / "hf", config=ExportConfig(max_shard_bytes=150_000))
    assert len(report.files) > 1 and (tmp_path / "hf" / SAFETENSORS_INDEX).is_file()
    index = json.loads((tmp_path / "hf" / SAFETENSORS_INDEX).read_text())
    assert set(index["weight_map"]) == {n for n, _ in model.named_parameters()}
    assert all(os.path.getsize(tmp_path / "hf" / f) <= 150_000 + 4096 for f in report.files)
    loaded = load_hf(tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(model))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # re-tied
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok("abc", add_special_tokens=False)["input_ids"] == [97, 98, 99]


def test_export_picks_master_and_converts_dtype(tmp_path):
    model = tiny_llama(seed=3, tie=False)
    bf16 = tiny_llama(seed=3, tie=False).to(torch.bfloat16)
    # the compute copy is bf16, the master fp32: export prefers the master
    ckpt = save_sharded(model, tmp_path / "ckpt", world=2, arrays=(("param", torch.bfloat16), ("master", None)))
    export_checkpoint(ckpt, tmp_path / "fp32")
    assert torch.equal(logits(load_hf(tmp_path / "fp32")), logits(model))
    export_checkpoint(ckpt, tmp_path / "bf16", config=ExportConfig(dtype=torch.bfloat16))
    loaded = load_hf(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    for (name, a), b in zip(loaded.state_dict().items(), bf16.state_dict().values()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    export_checkpoint(ckpt, tmp_path / "param", config=ExportConfig(arrays=("param",)))
    assert (tmp_path / "param" / "model.safetensors").is_file()  # one file under the default size
    with pytest.raises(CheckpointFormatError, match=r"none of \['exp_avg'\] asked for export"):
        export_checkpoint(ckpt, tmp_path / "none", config=ExportConfig(arrays=("exp_avg",)))
    assert not (tmp_path / "none").exists()


def test_corrupted_or_truncated_shard_is_refused_by_name(tmp_path):
    ckpt = save_sharded(tiny_llama(), tmp_path / "ckpt", world=3)
    victim = ckpt / "rank00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x40  # one flipped bit in the payload
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"rank00001\.safetensors is corrupted: CRC-32"):
        export_checkpoint(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    victim.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointCorruptError, match=r"rank00001\.safetensors has \d+ bytes"):
        export_checkpoint(ckpt, tmp_path / "hf")
    victim.unlink()
    with pytest.raises(CheckpointCorruptError, match=r"rank00001\.safetensors is missing"):
        export_checkpoint(ckpt, tmp_path / "hf")


def test_host_memory_is_bounded_by_the_read_chunk(tmp_path, monkeypatch):
    """Instrument every slice read from a shard: at most one is alive at a time, each within the chunk."""
    model = tiny_llama()
    ckpt = save_sharded(model, tmp_path / "ckpt", world=2, bucket_bytes=float("inf"))  # one bucket per dtype
    live: weakref.WeakSet = weakref.WeakSet()
    seen = {"max_alive": 0, "max_bytes": 0, "reads": 0}
    original = export_mod._ShardReader.read

    def tracked(self, *args):
        seen["max_alive"] = max(seen["max_alive"], len(live))  # slices still alive from earlier reads
        out = original(self, *args)
        live.add(out)
        seen["max_bytes"] = max(seen["max_bytes"], out.numel() * out.element_size())
        seen["reads"] += 1
        return out

    monkeypatch.setattr(export_mod._ShardReader, "read", tracked)
    chunk = 8 << 10
    report = export_checkpoint(ckpt, tmp_path / "hf", config=ExportConfig(read_chunk_bytes=chunk))
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    assert seen["max_alive"] == 0  # each slice is written and freed before the next read
    assert seen["max_bytes"] <= chunk == report.largest_read_bytes and largest > 4 * chunk
    assert seen["reads"] >= model_bytes // chunk
    assert torch.equal(logits(load_hf(tmp_path / "hf")), logits(model))
    # default chunk: no read exceeds the largest tensor, though each rank's array holds the whole model's half
    report = export_checkpoint(ckpt, tmp_path / "hf2")
    assert report.largest_read_bytes <= largest < model_bytes // 2


def test_export_state_dict_writes_tied_weights_once(tmp_path):
    model = tiny_llama(seed=5)
    state = model.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # as engine.full_state_dict returns it
    report = export_state_dict(state, tmp_path / "hf", hf_config=model.config.to_dict(), tokenizer=ByteTokenizer(),
                               config=ExportConfig(max_shard_bytes=100_000))
    assert report.tensors == len(state) - 1
    assert torch.equal(logits(load_hf(tmp_path / "hf")), logits(model))
    with pytest.raises(FileExistsError, match="already exists"):
        export_state_dict(state, tmp_path / "hf", hf_config=model.config.to_dict())
    export_state_dict(state, tmp_path / "hf", hf_config=model.config.to_dict(),
                      config=ExportConfig(overwrite=True))
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not (tmp_path / "hf" / SAFETENSORS_INDEX).exists()


def test_metadata_is_checked(tmp_path):
    ckpt = save_sharded(tiny_llama(), tmp_path / "ckpt", world=2)
    raw = json.loads((ckpt / META_FILE).read_text())
    raw["groups"][0]["tensors"][1]["pieces"][0][3] -= 1  # a hole in a tensor
    (ckpt / META_FILE).write_text(json.dumps(raw))
    with pytest.raises(CheckpointFormatError, match=r"zspeed_state\.json: tensor 'model\..*': pieces (leave|cover)"):
        read_meta(ckpt)
    raw["format"] = "deepspeed"
    (ckpt / META_FILE).write_text(json.dumps(raw))
    with pytest.raises(CheckpointFormatError, match="format is 'deepspeed'"):
        read_meta(ckpt)
    (ckpt / META_FILE).write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="not valid JSON"):
        read_meta(ckpt)
    with pytest.raises(CheckpointFormatError, match="is not a zspeed checkpoint"):
        read_meta(tmp_path)


def test_atomic_output_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_output_dir(target) as tmp:
            (tmp / "partial.safetensors").write_bytes(b"x")
            raise RuntimeError("boom")
    assert not target.exists() and not any(tmp_path.iterdir())
    with atomic_output_dir(target) as tmp:
        (tmp / "a").write_text("1")
    assert (target / "a").read_text() == "1"
    with atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_replicated_array_on_one_rank(tmp_path):
    """A tensor kept whole by rank 0 (stage 0 masters, buffers) is a world-1 group held by rank 0."""
    model = tiny_llama(seed=2, tie=False)
    names, params = zip(*[(n, p.detach()) for n, p in model.named_parameters()])
    group = FlatPartition.build(params, world_size=1, names=names).groups[torch.float32]
    staging = staging_dir(tmp_path, "t")
    staging.mkdir()
    layout = group_layout("all", group, arrays={"master": torch.float32}, ranks=[0])
    files = (write_rank_file(staging, 0, {array_key("all", "master"): group.flatten(list(params))}),
             write_rank_file(staging, 1, {}))
    write_meta(staging, ShardedStateMeta(world_size=2, groups=(layout,), files=files))
    ckpt = commit_dir(staging, tmp_path / "t")
    export_checkpoint(ckpt, tmp_path / "hf", hf_config=model.config.to_dict())
    assert torch.equal(logits(load_hf(tmp_path / "hf")), logits(model))


def test_checkpoint_of_another_model_names_the_first_mismatching_tensor(tmp_path):
    model = tiny_llama()
    meta = read_meta(save_sharded(model, tmp_path / "ckpt", world=2))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    check_matches_model(meta, shapes)  # tied lm_head.weight is found through the alias
    other = dict(shapes, **{"model.layers.1.mlp.up_proj.weight": (200, 64)})
    with pytest.raises(CheckpointFormatError, match=r"first mismatching tensor is 'model\.layers\.1\.mlp\.up_proj"
                                                    r"\.weight', shape \[160, 64\] in the checkpoint but \[200, 64\]"):
        check_matches_model(meta, other)
    with pytest.raises(CheckpointFormatError, match=r"tensor 'extra\.weight' \(shape \[2\]\) is not in it"):
        check_matches_model(meta, dict(shapes, **{"extra.weight": (2,)}))
    fewer = {n: s for n, s in shapes.items() if not n.startswith("model.layers.2.")}
    with pytest.raises(CheckpointFormatError, match=r"holds tensor 'model\.layers\.2\..*which the model does not"):
        check_matches_model(meta, fewer)
