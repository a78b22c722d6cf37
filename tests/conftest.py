"""Fixtures shared across test files, and the test session's OpenMP setting."""
import os

# Before anything imports torch: idle OpenMP workers sleep instead of spinning. The serving
# tests run a server, its engine thread and clients in one process on (in CI) 2 cores;
# spinning workers starve those threads and slow decoding ~50x. `zserve` sets the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Before anything imports triton: CPU test runs execute every Triton kernel in Triton's interpreter
# (kernels/_runtime.py, [Note: lazy triton]). Set ZSPEED_TEST_GPU=1 to test compiled kernels on a GPU.
if os.environ.get("ZSPEED_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.serve_cases import reference, tiny_dir  # noqa: E402,F401  (the serving tests' tiny model and HF outputs)
