"""The x-stationary GEMV compiled for Hopper on the CPU: its slice of ``x`` read a word at a time ([Note: x-stationary
GEMV] in kernels/_stationary_kernels.py). Its results are checked under the interpreter in
tests/test_kernels_triton.py."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.sm90_compile import SASS_OF_KERNEL, run_compile_script

# argv: the constexprs and num_warps (JSON), the cubin's path. Prints the global loads and barriers in SASS order.
_COMPILE = r'''
import json, os, re, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from zspeed.kernels import _stationary_kernels

opts = json.loads(sys.argv[1])
warps = opts.pop("num_warps")
fn = _stationary_kernels.stationary_gemv_kernel
values = dict(x_ptr=torch.empty(1, dtype=torch.bfloat16), w_ptr=torch.empty(1, dtype=torch.int32),
              s_ptr=torch.empty(1, dtype=torch.bfloat16), z_ptr=torch.empty(1, dtype=torch.uint8),
              part_ptr=torch.empty(1, dtype=torch.float32), count_ptr=torch.empty(1, dtype=torch.int32),
              out_ptr=torch.empty(1, dtype=torch.bfloat16), M=1, N=8192, KW=2048, SPLIT=1, stride_xm=8192,
              stride_wn=2048, stride_sn=64, stride_om=8192)
names = [a for a in fn.arg_names if a not in opts]
sig = {a: mangle_type(values[a]) for a in names}
sig.update({a: "constexpr" for a in opts})
# pointers and strides as the JIT specializes them at a real launch (multiples of 16)
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in names
         if a.endswith("_ptr") or a.startswith("stride") or a in ("N", "KW")}
kernel = triton.compile(ASTSource(fn, sig, opts, attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps})
''' + SASS_OF_KERNEL + r'''
print(json.dumps([op for _, op, _ in code if op.startswith(("LDG", "BAR"))]))  # (in program order)
'''


@pytest.mark.parametrize("fmt,g,wg,block_n,warps,x_bytes", [(0, 1, 2048, 4, 16, 8), (0, 1, 1024, 2, 4, 8),
                                                            (1, 8, 16, 32, 4, 16)])
def test_x_is_read_a_word_at_a_time(tmp_path, fmt, g, wg, block_n, warps, x_bytes):
    """INT8 (``fmt`` 0: a word is 4 columns, 8 bytes of ``x``) and INT4 (1: 8 columns, 16 bytes): a thread reads its
    words' columns of ``x`` in one load a word, not a 2-byte gather a column; the 2-byte loads left are the
    scales'."""
    opts = dict(FMT=fmt, HAS_ZEROS=fmt == 1, G=g, WG=wg, BLOCK_N=block_n, ROW_BLOCKS=8, PARTIAL=False, EVEN=True,
                FIX_K=4, DEPTH=1, num_warps=warps)
    ops = run_compile_script(_COMPILE, [json.dumps(opts), str(tmp_path / "stationary.cubin")], tmp_path)
    loads = Counter(ops)
    words_a_thread = g * wg // (32 * warps)
    wide = "LDG.E.64" if x_bytes == 8 else "LDG.E.128"
    assert loads[wide] >= words_a_thread  # x (+ for INT4 the weight words: 16 bytes each too)
    # 2-byte gathers would take one a column: 4 or 8 a word (the scales' few 2-byte loads stay under that)
    assert loads["LDG.E.U16"] < words_a_thread * (x_bytes // 2), loads


@pytest.mark.parametrize("wg,block_n,warps", [(2048, 4, 16), (1024, 2, 4)])
def test_first_block_is_in_flight_before_x_is_summed(tmp_path, wg, block_n, warps):
    """INT8: the first block's words (16-byte loads; ``x``'s are 8 bytes) are loaded before the first barrier, which
    the slice of ``x`` needs for its sum, so the two latencies overlap."""
    opts = dict(FMT=0, HAS_ZEROS=False, G=1, WG=wg, BLOCK_N=block_n, ROW_BLOCKS=8, PARTIAL=False, EVEN=True, FIX_K=4,
                DEPTH=1, num_warps=warps)
    ops = run_compile_script(_COMPILE, [json.dumps(opts), str(tmp_path / "stationary.cubin")], tmp_path)
    assert ops.index("LDG.E.128") < next(i for i, op in enumerate(ops) if op.startswith("BAR")), ops
