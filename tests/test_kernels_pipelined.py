"""The pipelined INT4 GEMM for Hopper ([Note: pipelined wdot] in kernels/_pipelined_kernels.py), a Gluon kernel that
the CPU interpreter cannot run. Here: when the tuner offers it, and that it compiles for sm_90 into the schedule
it exists for: each tile's ``wgmma`` issued asynchronously, both operands in shared memory, and retired only down
to one in flight, so the next tile's dequantization overlaps it. (Triton 3.6, on the GPU machines, compiles the
full-depth kernel's swapped tiles with a wait for every ``wgmma`` before the next; Triton 3.9, here, no longer
does, so that is not tested.) Its values are checked on the GPU: ``benchmarks/wdot_tiles.py`` compares every config
with the reference, ``benchmarks/packed_check.py`` one-hot rows bit for bit (benchmarks/RESULTS.md, kernels runs
45-59)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.sm90_compile import SASS_OF_KERNEL, main_loop, run_compile_script
from zspeed.kernels import _pipelined, _word
from zspeed.kernels._gemm import FMT_W4, FMT_W8


def test_offered_for_packed_int4_from_128_rows_on_hopper_only(monkeypatch):
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    seen = []
    monkeypatch.setattr(_pipelined, "pipelined_possible", lambda device, *, group, k: seen.append((group, k)) or True)
    for m in (1, 16, 64, 100, 128, 256, 511):
        got = [c for c in _word.full_depth_candidates(FMT_W4, m, 8192, 1024, 128, gpu, packed=1)
               if c.pipelined and not c.fragment]  # (the register-operand kernel's: tests/test_kernels_fragment.py)
        if m <= 64:
            assert not got
            continue
        assert got and all(c.block_m <= max(128, m) and c.warps == c.block_n // 16 and c.fixup == (c.split_k > 1)
                           for c in got)
        assert {c.block_m for c in got} == ({128} if m <= 128 else {128, 256})
    assert seen and all(s == (128, 8192) for s in seen)
    assert any(c.pipelined for c in _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, 2))  # fp16
    int8 = [c for c in _word.full_depth_candidates(FMT_W8, 256, 8192, 2048, 0, gpu, half_x=True)
            if c.pipelined and not c.fragment]
    assert int8 and all(c.block_w == 16 and c.prefetch == 4 for c in int8)  # 64 columns of INT8, 4 word buffers
    for packed, fmt in ((0, FMT_W4), (0, FMT_W8)):  # the fp32 path (scales not in x's dtype), fp32 x: not offered
        assert not any(c.pipelined for c in _word.full_depth_candidates(fmt, 256, 8192, 1024, 128, gpu, packed))
    monkeypatch.setattr(_pipelined, "pipelined_possible", lambda device, *, group, k: False)
    assert not any(c.pipelined for c in _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, packed=1))


def test_possible_only_compiled_on_an_sm90_gpu_with_whole_tiles_per_group(monkeypatch):
    assert not _pipelined.pipelined_possible(torch.device("cpu"), group=128, k=8192)
    monkeypatch.setattr(_pipelined, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_pipelined, "_gluon_ok", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    assert _pipelined.pipelined_possible(gpu, group=128, k=8192)
    assert _pipelined.pipelined_possible(gpu, group=64, k=128)
    assert not _pipelined.pipelined_possible(gpu, group=32, k=8192)  # a 64-column tile would span two groups
    assert not _pipelined.pipelined_possible(gpu, group=128, k=8192 + 32)
    assert not _pipelined.pipelined_possible(gpu, group=64, k=64)  # one tile: nothing to overlap
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not _pipelined.pipelined_possible(gpu, group=128, k=8192)  # wgmma is Hopper's
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_pipelined, "interpreting", lambda: True)
    assert not _pipelined.pipelined_possible(gpu, group=128, k=8192)
    x = torch.zeros(4, 8192, dtype=torch.bfloat16)
    monkeypatch.setattr(_pipelined, "interpreting", lambda: False)
    monkeypatch.setattr(_pipelined, "pipelined_possible", lambda device, *, group, k: True)
    assert _pipelined.pipelined_fits(x, x, group=128, k=8192)
    assert _pipelined.pipelined_fits(x.half(), x.half(), group=128, k=8192)
    assert not _pipelined.pipelined_fits(x, x.half(), group=128, k=8192)  # scales in x's dtype, or rounded twice
    assert not _pipelined.pipelined_fits(x.float(), x.float(), group=128, k=8192)
    assert _pipelined.pipelined_fits(x, x.half(), group=0, k=8192, int8=True)  # INT8: the scale's dtype is free
    assert not _pipelined.pipelined_fits(x.float(), x, group=0, k=8192, int8=True)
    words = torch.zeros(64, 1024 + 4, dtype=torch.int32)
    assert _pipelined.words_readable(words[:, :1024]) and not _pipelined.words_readable(words[:, 1:1025])  # 4 bytes in
    assert not _pipelined.words_readable(torch.zeros(64, 1026, dtype=torch.int32)[:, :1024])  # rows of 4104 bytes


_COMPILE = r'''
import json, os, re, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

opts = json.loads(sys.argv[1])
from zspeed.kernels import _pipelined_kernels as P
bn, bm, xs, int8 = opts["BN"], opts["BM"], opts["XS"], opts.get("INT8", False)
m, n, k, wpt = 256, 8192, 8192, 16 if int8 else 8  # words per 64-column tile row
x = torch.empty(m, k, dtype=torch.bfloat16)
w = torch.empty(n, k * wpt // 64, dtype=torch.int32)
args = dict(x_desc=TensorDescriptor(x, [m, k], [k, 1], [bm, 64],
                                    gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16)),
            w_desc=TensorDescriptor(w, list(w.shape), [w.shape[1], 1], [bn, wpt],
                                    gl.NVMMASharedLayout.get_default_for([bn, wpt], gl.int32)),
            s_ptr=torch.empty(1, dtype=torch.bfloat16), z_ptr=torch.empty(1, dtype=torch.uint8),
            out_ptr=torch.empty(1, dtype=torch.bfloat16), part_ptr=torch.empty(1, dtype=torch.float32),
            count_ptr=torch.empty(1, dtype=torch.int32), M=m, N=n, K=k, SPLIT_K=2, stride_sn=64, stride_om=n)
sig = {name: mangle_type(v) for name, v in args.items()}
const = dict(GROUP=64 if int8 else 128, HAS_ZEROS=not int8, BLOCK_N=bn, BLOCK_M=bm, XSTAGES=xs,
             QSTAGES=4 if int8 else 8, W_LAYOUT=gl.NVMMASharedLayout.get_default_for([bn, 64], gl.bfloat16),
             num_warps=bn // 16, INT8=int8)
sig.update({name: "constexpr" for name in const})
kernel = triton.compile(GluonASTSource(P.w4_pipelined_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": bn // 16})
''' + SASS_OF_KERNEL + r'''fixup = ptx[ptx.find("atom.global.gpu.acq_rel"):]  # what the last split of a tile runs: the partials' sum
print(json.dumps({"code": [[int(a, 16), op, rest.strip()] for a, op, rest in code], "shared": kernel.metadata.shared,
                  "fixup": {"loads": fixup.count("ld.global.cg"), "stores": fixup.count("st.global")}}))
'''


def _sass(tmp_path: Path, **opts) -> dict:
    if not _pipelined._gluon_ok():
        pytest.skip("this triton has no Gluon for Hopper")
    cubin = tmp_path / f"pipelined_{abs(hash(json.dumps(opts, sort_keys=True)))}.cubin"
    return run_compile_script(_COMPILE, [json.dumps(opts), str(cubin)], tmp_path)


@pytest.mark.parametrize("bn,bm,xs,int8", [(64, 128, 4, False), (128, 256, 4, False), (64, 256, 4, False),
                                          (64, 16, 4, False), (64, 256, 4, True), (128, 128, 4, True)])
def test_compiles_for_hopper_with_each_wgmma_overlapping_the_next_tile(tmp_path, bn, bm, xs, int8):
    got = _sass(tmp_path, BN=bn, BM=bm, XS=xs, INT8=int8)
    loop = main_loop(got["code"])
    ops = [op for _, op, _ in loop]
    waits = [rest for _, op, rest in loop if op.startswith("WARPGROUP.DEPBAR")]
    assert sum(op.startswith("HGMMA") for op in ops) == 4  # 64 columns a tile: four k16 steps, operands in shared
    assert all("gdesc" in rest and " R" not in rest.split("gdesc")[0].split(",", 1)[1] for _, op, rest in loop
               if op.startswith("HGMMA"))  # no register operand: A and B both from shared memory
    assert waits == ["gsb0, 0x1"]  # retired down to one in flight, once per tile
    assert sum(op.startswith("BAR.SYNC") for op in ops) <= 8  # the tile's barrier, and the TMA issues'
    assert got["shared"] <= 232448  # an H100's shared memory per block
    # the split-K fix-up reads every split's partial and stores every element of the tile, also with fewer than 32
    # rows of x (a first version stored none there: kernels run 56)
    assert got["fixup"]["loads"] > 0 and got["fixup"]["stores"] > 0


def test_int4_goes_dense_later_where_the_pipelined_kernel_runs(monkeypatch):
    """[Note: crossover] in kernels/dispatch.py: with the pipelined kernel INT4 and INT8 keep the wdot path up to 1023
    rows (INT4 beat dequantize + cuBLAS at 512 rows and tied at 1024, kernels runs 50-51; INT8 beat it at 512, run
    64); other formats, and layers that cannot take it, go dense from 512 rows as before. The launcher asks only
    where the answer can change."""
    from zspeed.kernels import kernel_policy
    from zspeed.kernels.dispatch import KernelPolicy

    policy = kernel_policy()
    assert policy.path("w4a16", 512) == "dense" and policy.path("w4a16", 512, pipelined=True) == "wdot"
    assert policy.path("w4a16", 1023, pipelined=True) == "wdot" and policy.path("w4a16", 1024, pipelined=True) == "dense"
    assert policy.path("w8a16", 512, pipelined=True) == "wdot" and policy.path("w8a16", 512) == "dense"
    assert policy.path("sparse24", 512, pipelined=True) == "dense"
    assert policy.path("w4a16", 512, pipelined=True, wdot=False) == "dense"  # no tile for these groups
    assert KernelPolicy(pipelined_dense_min_m=256).path("w4a16", 300, pipelined=True) == "wdot"  # never earlier
    # INT4 and INT8 with the register-operand kernel keep wdot to 3071 rows (kernels runs 106 and 126: it wins at
    # 2048, loses at 4096)
    assert policy.path("w4a16", 1024, pipelined=True, fragment=True) == "wdot"
    assert policy.path("w4a16", 2048, pipelined=True, fragment=True) == "wdot"
    assert policy.path("w4a16", 3071, pipelined=True, fragment=True) == "wdot"
    assert policy.path("w4a16", 3072, pipelined=True, fragment=True) == "dense"
    assert policy.path("w8a16", 2048, pipelined=True, fragment=True) == "wdot"
    assert policy.path("w8a16", 3072, pipelined=True, fragment=True) == "dense"
    assert policy.path("w8a16", 1024, pipelined=True) == "dense"  # without that kernel, as before
    assert policy.path("w4a16", 1024, fragment=True) == "dense"  # only where the pipelined path runs at all
    asked = []
    monkeypatch.setattr(_pipelined, "pipelined_fits", lambda x, s, *, group, k, int8: asked.append(x.shape[0]) or False)
    from zspeed.compress import quantize_int4
    from zspeed.kernels import w4a16_matmul

    q = quantize_int4(torch.randn(16, 128), group_size=128)
    for m in (2, 600):
        w4a16_matmul(torch.randn(m, 128), q.qweight, q.scales, q.zeros, 128)
    assert asked == [600]
