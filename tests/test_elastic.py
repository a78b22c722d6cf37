"""Elastic restart under torchrun's agent (gloo, CPU): a worker dies mid-run, the job restarts from the
latest checkpoint by itself (same data order, same global batch) and ends with the uninterrupted run's loss."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_cases import synthetic_corpus
from zspeed.train.run_log import read_log

WORKER = Path(__file__).with_name("elastic_worker.py")
ARGS = ["--model", "tiny-llama", "--seq-len", "32", "--micro-batch", "2", "--global-batch", "8",
        "--max-steps", "6", "--lr", "3e-3", "--save-every", "2", "--eval-every", "3", "--eval-fraction", "0.1",
        "--no-export"]


def torchrun(data: Path, out: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(WORKER.parent.parent), **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1:1", "--nproc-per-node=2",
           "--max-restarts=1", str(WORKER), *ARGS, "--data", str(data), "--out", str(out)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_worker_killed_mid_run_restarts_and_matches(tmp_path):
    data = synthetic_corpus(tmp_path / "d.jsonl", n=120)
    whole = torchrun(data, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    marker = tmp_path / "killed"
    hurt = torchrun(data, tmp_path / "hurt", ZSPEED_TEST_KILL_AT_STEP="5", ZSPEED_TEST_KILL_MARKER=str(marker))
    assert hurt.returncode == 0, hurt.stderr[-3000:]
    assert marker.is_file()  # the fault did happen
    log = read_log(tmp_path / "hurt" / "log.jsonl")
    resumed = [r for r in log if r["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == 4 and resumed[0]["cursor"] == {"epoch": 0, "position": 32}
    want = read_log(tmp_path / "whole" / "log.jsonl")
    for event, key in (("train", "loss"), ("eval", "eval_loss")):
        got_last = [r for r in log if r["event"] == event][-1]
        want_last = [r for r in want if r["event"] == event][-1]
        assert got_last["step"] == want_last["step"] == 6
        assert got_last[key] == pytest.approx(want_last[key], rel=1e-5)
