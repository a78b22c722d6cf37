"""The benchmarks' ``--jobs``: every kernel config the tuner will time compiled first by several processes, each its
share, so that a GPU run spends its time on the checks and the timing (``benchmarks/gemv_check.py`` and
``benchmarks/bench_decode.py``; the compiling itself needs a GPU, the sharing is checked here)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tests.benchmark_scripts import load_benchmark
from zspeed.kernels import _word


class OutOfResources(Exception):
    """Stands for Triton's exception of that name (a config the compiler rejects)."""


def test_compile_candidates_launches_each_once_and_skips_only_rejected_ones():
    launched = []

    def launch(c):
        launched.append(c)
        if c == 4:
            raise OutOfResources("shared memory")

    assert sum(_word.compile_candidates(list(range(8))[i::3], launch) for i in range(3)) == 7
    assert sorted(launched) == list(range(8)) and launched[:3] == [0, 3, 6]  # every config once, share by share

    def broken(c):
        raise RuntimeError("a real failure")

    with pytest.raises(RuntimeError, match="a real failure"):
        _word.compile_candidates([0, 1], broken)


def test_gemv_check_starts_one_process_a_share_over_the_same_cases(monkeypatch):
    check = load_benchmark("gemv_check")
    started = []

    class Proc:
        def __init__(self, argv, **kw):
            started.append(argv)

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Proc)
    args = argparse.Namespace(ms=[1, 4], shapes=[(8192, 8192), (4096, 6144)], formats=["w4", "s24w4"],
                              kinds=["dense_fold", "mma_fold"], late_sums=[1, 2], balanced=True, jobs=3)
    check._precompile(args)
    assert [argv[argv.index("--shard") + 1] for argv in started] == ["0/3", "1/3", "2/3"]
    same = started[0][2:started[0].index("--shard")]
    assert same == ["--ms", "1", "4", "--shapes", "8192x8192", "4096x6144", "--formats", "w4", "s24w4",
                    "--kinds", "dense_fold", "mma_fold", "--late-sums", "1", "2", "--balanced"]
    assert all(argv[2:argv.index("--shard")] == same and "--json" not in argv for argv in started)
    for balanced, flag in ((False, ["--no-balanced"]), (None, [])):  # None: the processes take the tuner's default
        started.clear()
        check._precompile(argparse.Namespace(**{**vars(args), "balanced": balanced}))
        assert started[0][2:started[0].index("--shard")] == same[:-1] + flag
    jobs = load_benchmark("_jobs")
    assert jobs.parse_shard("2/3") == (2, 3)
    with pytest.raises(SystemExit, match="want i/N"):
        jobs.parse_shard("3/3")


def test_bench_decode_jobs_run_each_share_on_the_chosen_systems_without_the_tuning_cache(monkeypatch, capsys):
    """``--dry-run --jobs 2`` end to end on the CPU: two processes, each given its share, the systems chosen here and
    the tuning cache off (their picks are only the first candidates), both finishing before the timed run."""
    bench = load_benchmark("bench_decode")
    started = []
    real = subprocess.Popen

    def popen(argv, **kw):
        started.append((argv, kw["env"]))
        return real(argv, **kw)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--dry-run", "--jobs", "2", "--systems", "bf16,zspeed-int4"])
    assert bench.main() == 0
    assert [argv[argv.index("--shard") + 1] for argv, _ in started] == ["0/2", "1/2"]
    assert all("bf16,zspeed-int4" in argv and "--dry-run" in argv and env["ZSPEED_TUNING_CACHE"] == "0"
               for argv, env in started)
    out = capsys.readouterr().out
    assert "compiled in 2 processes" in out and "failed" not in out


def test_a_failed_share_is_counted_and_its_error_printed(tmp_path, capsys):
    """A ``--jobs`` process's output goes to a file; where one fails, its last lines are printed with its share, so
    that the reason is seen (run 213 on an H100: 6 of 8 failed, their output lost in the grep of the run's log)."""
    jobs = load_benchmark("_jobs")
    script = tmp_path / "share.py"
    script.write_text("import sys\n"
                      "i = sys.argv[sys.argv.index('--shard') + 1]\n"
                      "print('compiling share', i)\n"
                      "if i == '1/3': raise SystemExit('CUDA out of memory in share ' + i)\n")
    assert jobs.run_shares(str(script), ["--same"], 3) == 1
    captured = capsys.readouterr()
    assert "compiled in 3 processes" in captured.out and "1 of them failed" in captured.out
    assert "share 1/3 exited with 1" in captured.err and "CUDA out of memory in share 1/3" in captured.err
    assert "compiling share 1/3" in captured.err and "share 0/3" not in captured.err


def test_tuner_check_shares_its_keys_and_sums_up_picks(monkeypatch):
    """``tuner_check.py --jobs 3``: the processes get the same shapes, formats and rows; the summary of a way's picks
    is its best and worst time and how far apart they are."""
    check = load_benchmark("tuner_check")
    jobs = load_benchmark("_jobs")
    started = []

    class Stop(Exception):
        """Raised where the script's GPU part would begin."""

    def stop():
        raise Stop

    monkeypatch.setenv("ZSPEED_TUNING_CACHE", "1")  # the script defaults it to off; the test leaves it as it was
    monkeypatch.setitem(sys.modules, "_jobs", jobs)
    monkeypatch.setattr(jobs, "run_shares", lambda script, same, n, **kw: started.append((script, same, n)))
    monkeypatch.setattr(check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(check.torch.cuda, "get_device_name", stop)
    monkeypatch.setattr(sys, "argv", ["tuner_check.py", "--jobs", "3", "--shapes", "4096x4096", "8192x8192",
                                      "--formats", "w4", "w8", "--ms", "1", "4"])
    with pytest.raises(Stop):
        check.main()
    (script, same, n), = started
    assert n == 3 and script.endswith("tuner_check.py")
    assert same == ["--shapes", "4096x4096", "8192x8192", "--formats", "w4", "w8", "--ms", "1", "4"]
    assert check.spread([10.0, 10.5, 10.0]) == {"best_us": 10.0, "worst_us": 10.5, "worst_over_best": pytest.approx(0.05)}


def test_a_share_process_compiles_its_share_and_goes_on_with_the_first(monkeypatch):
    """``tune_by_compiling_share``: in a ``--jobs`` process each tuning launches configs ``i, i + N, ...`` once (which
    compiles them) and picks the first candidate without timing any."""
    jobs = load_benchmark("_jobs")
    monkeypatch.setattr(_word, "_fastest", _word._fastest)  # restored after the test
    launched = []
    jobs.tune_by_compiling_share((1, 3))
    assert _word._fastest(list(range(8)), launched.append) == 0 and launched == [1, 4, 7]


def test_one_at_a_time_lets_one_holder_in_at_once(tmp_path, monkeypatch):
    """``_jobs.one_at_a_time``: the ``--jobs`` processes quantize one after another (a lock file); a second holder
    waits until the first lets go, and a lock of another name does not wait."""
    import tempfile
    import threading

    jobs = load_benchmark("_jobs")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    inside, order = threading.Event(), []
    release = threading.Event()

    def first():
        with jobs.one_at_a_time("check"):
            order.append("first in")
            inside.set()
            release.wait(10)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    with jobs.one_at_a_time("other"):  # another script's lock
        order.append("other")
    with jobs.quantizing(None, "check"):  # the process that times runs alone: no lock to wait for
        order.append("timing process")

    def second_holder():
        with jobs.quantizing((1, 2), "check"):  # a --jobs process: the same lock
            order.append("second in")

    second = threading.Thread(target=second_holder)
    second.start()
    second.join(0.3)
    assert second.is_alive() and order == ["first in", "other", "timing process"]  # still waiting
    release.set()
    t.join(10)
    second.join(10)
    assert order == ["first in", "other", "timing process", "first out", "second in"]
    assert (tmp_path / "zspeed-check-jobs.lock").exists()
