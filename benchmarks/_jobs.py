"""The benchmarks' ``--jobs``: a script run again in several processes, each compiling its share of the kernel configs
(``--shard i/N``), before the process that times them finds them in Triton's disk cache."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time

TAIL_LINES = 20  # of a failed process's output, printed


def run_shares(script: str, same: list[str], jobs: int, *, env: dict | None = None) -> int:
    """``script`` with ``same`` and ``--shard i/jobs`` in ``jobs`` processes at once; waits for them all and returns
    how many failed. A process's output goes to a file, not the terminal (eight of them would interleave); a failed
    one's last lines are printed, so that its error is seen (its configs then compile in the caller, at the tuning)."""
    start = time.perf_counter()
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(jobs)]
    procs = [subprocess.Popen([sys.executable, script, *same, "--shard", f"{i}/{jobs}"], env=env, stdout=log,
                              stderr=subprocess.STDOUT) for i, log in enumerate(logs)]
    failed = 0
    for i, (proc, log) in enumerate(zip(procs, logs)):
        code = proc.wait()
        if code != 0:
            failed += 1
            log.seek(0)
            tail = "".join(log.readlines()[-TAIL_LINES:])
            print(f"--jobs: share {i}/{jobs} exited with {code}; its last lines:\n{tail}", file=sys.stderr, flush=True)
        log.close()
    print(f"compiled in {jobs} processes in {time.perf_counter() - start:.0f} s"
          + (f"; {failed} of them failed (their configs compile here)" if failed else ""), flush=True)
    return failed


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard i/N`` as ``(i, N)``; refused unless ``0 <= i < N``."""
    i, n = (int(v) for v in text.split("/"))
    if not 0 <= i < n:
        raise SystemExit(f"--shard {text!r}: want i/N with 0 <= i < N")
    return i, n


def tune_by_compiling_share(shard: tuple[int, int]) -> None:
    """In a ``--jobs`` process: from now on every tuning of a kernel (``_word._fastest``) compiles configs ``i, i + N,
    ...`` of its candidates instead of timing them all, and goes on with the first (this process's picks are not
    kept)."""
    from zspeed.kernels import _word

    i, n = shard

    def share(candidates, launch):
        _word.compile_candidates(candidates[i::n], launch)
        return candidates[0]

    _word._fastest = share


@contextlib.contextmanager
def one_at_a_time(name: str):
    """Held by one ``--jobs`` process at a time (a lock file, ``name`` the script's): quantizing a large matrix takes
    several GB of fp32 temporaries for a moment, and eight processes at that peak at once may not fit an 80 GB GPU
    (bench_decode, run 213 on an H100: 6 of 8 failed; gemv_check, run 218: one of 8 out of memory on the 128,256-row
    head). The holder hands its allocator's blocks back before it lets go (``torch.cuda.empty_cache``); compiling,
    after it, runs in all the processes at once."""
    import fcntl

    import torch

    with open(os.path.join(tempfile.gettempdir(), f"zspeed-{name}-jobs.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            fcntl.flock(fh, fcntl.LOCK_UN)


def quantizing(shard: tuple[int, int] | None, name: str):
    """Around a script's quantizing: :func:`one_at_a_time` in a ``--jobs`` process (``shard`` given), nothing in the
    process that times (it runs alone)."""
    return one_at_a_time(name) if shard is not None else contextlib.nullcontext()
