"""Compile a Triton kernel for Hopper (sm_90) on the CPU, in a subprocess without the interpreter: the kernels'
SASS checks (tests/test_kernels_packed.py, tests/test_kernels_pipelined.py and the other Gluon kernels' tests) read
what ptxas made of them; and which launcher a ``wdot`` config reaches."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# the tail of a compile script, after ``kernel = triton.compile(...)``: the cubin written to ``sys.argv[2]``, its SASS
# as ``code`` ((address, opcode, operands) per instruction) and the PTX as ``ptx``
SASS_OF_KERNEL = r'''
path = sys.argv[2]
open(path, "wb").write(kernel.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
code = re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass, flags=re.M)
ptx = kernel.asm["ptx"]
'''


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


def main_loop(code: list) -> list:
    """The instructions of the loop that holds the MMAs: from the target of the first backward branch after the
    last ``HGMMA`` to that branch."""
    last = max(i for i, (_, op, _) in enumerate(code) if op.startswith("HGMMA"))
    for addr, op, rest in code[last:]:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            return [(a, o, r) for a, o, r in code if int(target.group(1), 16) <= a <= addr]
    raise AssertionError("no loop around the HGMMAs")


def launched_with(monkeypatch, config, launcher: str, *, int8: bool = False) -> dict:
    """The keyword arguments that ``_word.wdot_launcher``'s launch hands ``_pipelined.<launcher>`` for ``config``
    (an INT4 g128 layer of 64 x 256, or with ``int8`` an INT8 one, three bf16 rows); every other Gluon launcher
    fails the test if called."""
    import torch

    from zspeed.compress import quantize_int4
    from zspeed.kernels import _pipelined, _word
    from zspeed.compress import quantize_int8
    from zspeed.kernels._gemm import FMT_W4, FMT_W8

    x = torch.randn(3, 256, dtype=torch.bfloat16)
    if int8:
        q = quantize_int8(torch.randn(64, 256), scale_dtype=torch.bfloat16)
        _, _, launch = _word.wdot_launcher(x, q.qweight.view(torch.int32), q.scales, None, fmt=FMT_W8, group=1, n=64,
                                          k=256)
    else:
        q = quantize_int4(torch.randn(64, 256), group_size=128, scale_dtype=torch.bfloat16)
        _, _, launch = _word.wdot_launcher(x, q.qweight.view(torch.int32), q.scales, q.zeros, fmt=FMT_W4, group=128,
                                          n=64, k=256)
    seen = {}

    def fake(x, words, s, z, **kw):
        seen.update(kw)
        return torch.zeros(x.shape[0], kw["n"], dtype=x.dtype)

    for name in ("run_pipelined", "run_specialized", "run_fragment"):
        monkeypatch.setattr(_pipelined, name, fake if name == launcher else
                            (lambda *a, **k: pytest.fail(f"not {launcher} but another kernel ran")))
    assert launch(config).shape == (3, 64)
    return seen
