"""What the kernels need to know about the Triton runtime.

[Note: lazy triton] Nothing here imports triton. ``@triton.jit`` (including
triton's own ``tl`` helpers) decides at decoration time whether it builds an
interpreted CPU kernel or a compiled GPU one, from ``TRITON_INTERPRET``. So
triton is imported only when a kernel is first launched (``_gemm.kernels()``),
and a test module can set ``TRITON_INTERPRET=1`` after ``zspeed.kernels`` (and
``zspeed.compress``) were imported. Under the interpreter each kernel gets one
small fixed config, so nothing is autotuned on the CPU.
"""
from __future__ import annotations

import importlib.util
import os

HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def optional_kernels(name: str):
    """The kernel module ``zspeed.kernels.<name>``, or ``None`` where this Triton cannot build it: the Gluon kernel
    modules import the language pieces they use (Gluon, Hopper's ``wgmma``) when they are imported."""
    try:
        return importlib.import_module(f".{name}", __package__)
    except ImportError:
        return None


def compiled_gpu(device, *, capability: tuple[int, int], exact: bool = False) -> bool:
    """Whether kernels run compiled (not interpreted) on ``device``, a CUDA GPU of compute capability ``capability``
    or later (``exact``: that one only)."""
    import torch

    if interpreting() or device.type != "cuda" or not torch.cuda.is_available():
        return False
    have = torch.cuda.get_device_capability(device)
    return have == capability if exact else have >= capability


def x_words_aligned(x) -> bool:
    """Whether every row of ``x`` (a 2-D tensor) starts at a multiple of 16 bytes, as the GEMVs' 16-byte reads of
    ``x`` a word at a time need ([Note: x a word at a time] in ``_dense_mma_kernels``); otherwise they gather it."""
    return x.data_ptr() % 16 == 0 and (x.shape[0] == 1 or x.stride(0) * x.element_size() % 16 == 0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def m_bucket(m: int) -> int:
    """Autotuning key for the number of rows: the next power of two (so tuning
    happens once per bucket, not once per batch size)."""
    return 1 << max(0, (m - 1).bit_length())


def bench_fn(fn, quantiles):
    """Short autotuning benchmark: enough to rank configs, cheap enough to tune
    dozens of shapes in a benchmark run."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def graph_time_ms(fn, *, reps: int = 20, flush_mib: int = 128, trials: int = 5) -> float:
    """GPU milliseconds of one ``fn()`` call with a cold L2, host launch cost excluded.

    [Note: timing small kernels] A weight-only matmul at batch 1 runs for 10-100 µs,
    less than the host needs to launch a Triton kernel through Python, so timing
    eager calls measures the host. Decoding runs in CUDA graphs, so that is how
    kernels are timed: ``reps`` pairs of (L2 flush, ``fn``) captured in one graph,
    minus a graph of the flushes alone, per call. ``fn`` runs once before capture
    (compilation, tuning)."""
    import torch

    cache = torch.empty(flush_mib << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()

    def capture(body):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph

    def both():
        for _ in range(reps):
            cache.zero_()
            fn()

    def flush():
        for _ in range(reps):
            cache.zero_()

    def replay_ms(graph) -> float:
        graph.replay()
        times = []
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[trials // 2]

    g_both, g_flush = capture(both), capture(flush)
    return max(replay_ms(g_both) - replay_ms(g_flush), 0.0) / reps
