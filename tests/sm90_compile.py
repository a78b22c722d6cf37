"""Compile a Triton kernel for Hopper (sm_90) on the CPU, in a subprocess without the interpreter: the kernels'
SASS checks (tests/test_kernels_packed.py, tests/test_kernels_pipelined.py) read what ptxas made of them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_compile_script(script: str, args: list[str], tmp_path: Path) -> dict:
    """Run ``script`` (which compiles and prints one JSON line last) with ``args``; its JSON. Skips where this
    triton wheel has no CUDA toolchain (ptxas, cuobjdump) to compile with."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "cuobjdump").exists():
        pytest.skip(f"this triton wheel has no CUDA toolchain in {bin_dir}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
