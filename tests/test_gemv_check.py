"""``benchmarks/gemv_check.py --jobs``: every config compiled first by several processes, each its share, so that a GPU
run spends its time on the checks and the timing (the script itself needs a GPU; its sharing is checked here)."""
from __future__ import annotations

import argparse

import pytest

from tests.benchmark_scripts import load_benchmark


def _script():
    return load_benchmark("gemv_check")


class OutOfResources(Exception):
    """Stands for Triton's exception of that name (a config the compiler rejects)."""


def test_each_share_compiles_every_nth_config_and_skips_only_rejected_ones():
    check = _script()
    launched = []

    def launch(c):
        launched.append(c)
        if c == 4:
            raise OutOfResources("shared memory")

    for i in range(3):
        check._compile_share(list(range(8)), launch, i, 3)
    assert sorted(launched) == list(range(8)) and launched[:3] == [0, 3, 6]  # every config once, share by share

    def broken(c):
        raise RuntimeError("a real failure")

    with pytest.raises(RuntimeError, match="a real failure"):
        check._compile_share([0, 1], broken, 0, 2)


def test_jobs_start_one_process_a_share_over_the_same_cases(monkeypatch):
    check = _script()
    started = []

    class Proc:
        def __init__(self, argv):
            started.append(argv)

        def wait(self):
            return 0

    monkeypatch.setattr(check.subprocess, "Popen", Proc)
    args = argparse.Namespace(ms=[1, 4], shapes=[(8192, 8192), (4096, 6144)], formats=["w4", "s24w4"],
                              kinds=["dense_fold", "mma_fold"], late_sums=[1, 2], jobs=3)
    check._precompile(args)
    assert [argv[argv.index("--shard") + 1] for argv in started] == ["0/3", "1/3", "2/3"]
    same = started[0][2:started[0].index("--shard")]
    assert same == ["--ms", "1", "4", "--shapes", "8192x8192", "4096x6144", "--formats", "w4", "s24w4",
                    "--kinds", "dense_fold", "mma_fold", "--late-sums", "1", "2"]
    assert all(argv[2:argv.index("--shard")] == same and "--json" not in argv for argv in started)
    assert check._shard("2/3") == (2, 3)
    with pytest.raises(SystemExit, match="want i/N"):
        check._shard("3/3")
