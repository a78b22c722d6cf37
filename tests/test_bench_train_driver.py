"""benchmarks/bench_train.py's driver on the CPU: what it launches for several GPU counts, and the scaling it prints
(torchrun stood in for: no GPU here)."""
import json
import subprocess

import pytest

from tests.benchmark_scripts import load_benchmark

PARAMS = 1_100_048_384


def _row(system, gpus, tokens, peak):
    return dict(system=system, gpus=gpus, tokens_per_s_per_gpu=tokens, peak_gib=peak, mfu=0.3, params=PARAMS,
                first_loss=10.78, last_loss=10.79)


def test_driver_only_flags_stay_out_of_each_systems_command():
    bench = load_benchmark("bench_train")
    argv = ["--driver", "--nproc", "1", "2", "4", "--systems", "zspeed-z3,plain", "--seq", "128", "--json", "x.json",
            "--timeout=30", "--layers", "2"]
    assert bench._strip_driver_values(argv) == ["--seq", "128", "--layers", "2"]
    assert bench._strip_driver_values(["--nproc=2", "--steps", "3"]) == ["--steps", "3"]


def test_scaling_against_the_fewest_gpus_and_plain():
    """Efficiency over the system's own run at its fewest GPUs, the ratio to plain on one GPU, and the peak less the
    sharded 12 bytes a parameter (session 36's runs 272-273: zspeed ZeRO-3's rest is 17.75 GiB at 1, 2 and 4)."""
    bench = load_benchmark("bench_train")
    rows = [_row("zspeed-z3", 4, 45654, 20.826), _row("plain", 1, 44537, 35.442), _row("zspeed-z3", 2, 45357, 23.899),
            _row("zspeed-z3", 1, 46356, 30.045), _row("fsdp2", 2, 40602, 24.226), _row("fsdp2", 4, 38805, 21.196),
            dict(system="deepspeed-z3", gpus=4, error="timed out")]
    got = {(r["system"], r["gpus"]): r for r in bench.scaling(rows)}
    assert set(got) == {("zspeed-z3", 4), ("plain", 1), ("zspeed-z3", 2), ("zspeed-z3", 1), ("fsdp2", 2), ("fsdp2", 4)}
    assert got[("zspeed-z3", 1)]["efficiency"] is None and got[("fsdp2", 2)]["efficiency"] is None
    assert got[("zspeed-z3", 4)]["efficiency"] == pytest.approx(45654 / 46356)
    assert got[("fsdp2", 4)]["efficiency"] == pytest.approx(38805 / 40602)  # its fewest: 2 GPUs
    assert got[("zspeed-z3", 4)]["vs_plain"] == pytest.approx(45654 / 44537)
    assert got[("plain", 1)]["vs_plain"] is None
    rest = [got[("zspeed-z3", n)]["peak_less_state_gib"] for n in (1, 2, 4)]
    assert rest == pytest.approx([17.751, 17.752, 17.753], abs=1e-3)
    assert bench.scaling([_row("fsdp2", 4, 1.0, 30.0)])[0]["vs_plain"] is None  # no plain run: no ratio


def test_driver_runs_each_system_at_each_count_and_plain_once(monkeypatch, capsys, tmp_path):
    bench = load_benchmark("bench_train")
    launched = []

    def fake_run(cmd, **kwargs):
        nproc = int(next(a for a in cmd if a.startswith("--nproc-per-node=")).split("=")[1])
        system = cmd[cmd.index("--system") + 1]
        port = int(cmd[cmd.index("--master-port") + 1])
        launched.append((system, nproc, port, cmd[cmd.index("--system") + 2:]))
        if system == "deepspeed-z3" and nproc == 2:
            return subprocess.CompletedProcess(cmd, 1, "", "NCCL error")
        row = _row(system, nproc, 40000.0 + nproc, 10.0 + 12 * PARAMS / nproc / 2**30)
        return subprocess.CompletedProcess(cmd, 0, "noise\nRESULT " + json.dumps(row) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "gpus_here", lambda: 8)
    out = tmp_path / "rows.json"
    monkeypatch.setattr("sys.argv", ["bench_train.py", "--driver", "--nproc", "4", "1", "2", "--systems",
                                     "zspeed-z3,plain,deepspeed-z3", "--seq", "64", "--json", str(out)])
    bench.main()
    assert [(s, n) for s, n, _, _ in launched] == [("zspeed-z3", 1), ("plain", 1), ("deepspeed-z3", 1),
                                                    ("zspeed-z3", 2), ("deepspeed-z3", 2),
                                                    ("zspeed-z3", 4), ("deepspeed-z3", 4)]
    assert len({port for _, _, port, _ in launched}) == len(launched)
    assert all(rest == ["--seq", "64"] for _, _, _, rest in launched)
    rows = json.loads(out.read_text())
    assert {"system": "deepspeed-z3", "gpus": 2} == {k: rows[4][k] for k in ("system", "gpus")} and "error" in rows[4]
    text = capsys.readouterr().out
    assert "deepspeed-z3              2 failed" in text
    assert "scaling:" in text
    # every run's rest is the 10.0 GiB the stand-in put above the sharded state; efficiency at 4 GPUs is 40004/40001
    assert text.count(" 10.000 GiB") == 6
    assert f"{40004 / 40001:.3f}" in text


def test_driver_skips_counts_above_the_gpus_here(monkeypatch, capsys):
    bench = load_benchmark("bench_train")
    launched = []

    def fake_run(cmd, **kwargs):
        launched.append(int(next(a for a in cmd if a.startswith("--nproc-per-node=")).split("=")[1]))
        row = _row("fsdp2", launched[-1], 40000.0, 30.0)
        return subprocess.CompletedProcess(cmd, 0, "RESULT " + json.dumps(row) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "gpus_here", lambda: 2)
    monkeypatch.setattr("sys.argv", ["bench_train.py", "--driver", "--nproc", "1", "2", "4", "8", "--systems", "fsdp2"])
    bench.main()
    assert launched == [1, 2]
    assert "skipping 4, 8 GPUs: this machine has 2" in capsys.readouterr().out
    monkeypatch.setattr(bench, "gpus_here", lambda: 0)
    with pytest.raises(SystemExit, match="no --nproc count fits the 0 GPUs here"):
        bench.main()
