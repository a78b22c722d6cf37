"""The warp-specialized INT4 GEMM for Hopper ([Note: warp-specialized wdot] in kernels/_specialized_kernels.py), a
Gluon kernel that the CPU interpreter cannot run. Here: when the tuner offers it, how a config reaches it, bad
arguments, and that it compiles for sm_90 into the schedule it exists for: register reallocation between the
partitions, the MMA warp groups' loop holding only the ``wgmma`` of a tile (both operands in shared memory) with one
left in flight, no spills, and every mbarrier arrive after its partition's own barrier. Its values are checked on
the GPU: ``benchmarks/wdot_tiles.py --specialized`` compares every config with the reference on NaN-filled memory
(benchmarks/RESULTS.md, kernels run 80)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.sm90_compile import SASS_OF_KERNEL, launched_with, main_loop, run_compile_script
from zspeed.kernels import _pipelined, _word
from zspeed.kernels._gemm import FMT_W4, FMT_W8
from zspeed.kernels._runtime import m_bucket


def test_offered_for_packed_int4_from_the_256_row_bucket(monkeypatch):
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(_pipelined, "pipelined_possible", lambda device, *, group, k: True)
    asked = []
    monkeypatch.setattr(_pipelined, "specialized_possible", lambda device, *, group, k: asked.append((group, k)) or True)
    for m in (64, 128, 255, 256, 700, 1023):
        got = [c for c in _word.full_depth_candidates(FMT_W4, m, 8192, 1024, 128, gpu, packed=1) if c.specialized]
        if m_bucket(m) < 256:  # a key covers a bucket of row counts: 129-256 rows are tuned together
            assert m <= 128 and not got
            continue
        assert {(c.block_m, c.block_n) for c in got} == {(256, 128), (256, 64)}
        assert all(c.pipelined and c.warps == c.block_n // 16 and c.specialized == 4 and c.block_w == 2
                   and c.prefetch == 8 and c.fixup == (c.split_k > 1) for c in got)
    assert asked and all(a == (128, 8192) for a in asked)
    # 256 x 128 tiles of 8192 x 8192 at 256 rows fill 64 SMs of 132: also split in two, just under a wave
    splits = {(c.block_n, c.split_k) for c in _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, 1)
              if c.specialized}
    assert splits == {(128, 1), (128, 2), (64, 1)}
    assert any(c.specialized for c in _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, 2))  # fp16
    assert not any(c.specialized for c in _word.full_depth_candidates(FMT_W8, 256, 8192, 2048, 0, gpu, half_x=True))
    assert not any(c.specialized for c in _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, 0))
    monkeypatch.setattr(_pipelined, "specialized_possible", lambda device, *, group, k: False)
    got = _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, packed=1)
    assert got and not any(c.specialized for c in got) and any(c.pipelined for c in got)


def test_possible_needs_the_pipelined_kernel_and_warp_specialize(monkeypatch):
    gpu = torch.device("cuda", 0)
    assert not _pipelined.specialized_possible(torch.device("cpu"), group=128, k=8192)
    monkeypatch.setattr(_pipelined, "pipelined_possible", lambda device, *, group, k: group == 128)
    assert not _pipelined.specialized_possible(gpu, group=32, k=8192)
    from triton.experimental.gluon import language as gl

    assert _pipelined.specialized_possible(gpu, group=128, k=8192) == hasattr(gl, "warp_specialize")
    monkeypatch.delattr(gl, "warp_specialize", raising=False)
    assert not _pipelined.specialized_possible(gpu, group=128, k=8192)


def test_a_specialized_config_launches_the_specialized_kernel(monkeypatch):
    c = _word.WordConfig(256, 64, 3, 1, 4, 5, 7, full_depth=True, order=3, pipelined=True, specialized=8)
    seen = launched_with(monkeypatch, c, "run_specialized")
    assert seen == dict(group=128, n=64, k=256, block_m=256, block_n=64, stages=5, q_stages=7, w_stages=3,
                        dq_warps=8, split_k=1, workspace=None)


def test_bad_arguments_are_refused_before_launch():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    w = torch.zeros(64, 16, dtype=torch.int32)
    s = torch.zeros(64, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dq_warps must be 4 or 8"):
        _pipelined.run_specialized(x, w, s, None, group=128, n=64, k=128, block_m=256, block_n=64, stages=4,
                                   q_stages=8, dq_warps=6)
    with pytest.raises(ValueError, match="needs the fix-up workspace"):
        _pipelined.run_specialized(x, w, s, None, group=128, n=64, k=128, block_m=256, block_n=64, stages=4,
                                   q_stages=8, split_k=2)


_COMPILE = r'''
import json, os, re, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

opts = json.loads(sys.argv[1])
from zspeed.kernels import _specialized_kernels as P
from zspeed.kernels._pipelined import SPECIALIZED_DQ_REGS
bn, bm, dq = opts["BN"], opts["BM"], opts["DQ"]
m, n, k = 256, 8192, 8192
x = torch.empty(m, k, dtype=torch.bfloat16)
w = torch.empty(n, k // 8, dtype=torch.int32)
args = dict(x_desc=TensorDescriptor(x, [m, k], [k, 1], [bm, 64],
                                    gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16)),
            w_desc=TensorDescriptor(w, list(w.shape), [w.shape[1], 1], [bn, 8],
                                    gl.NVMMASharedLayout.get_default_for([bn, 8], gl.int32)),
            s_ptr=torch.empty(1, dtype=torch.bfloat16), z_ptr=torch.empty(1, dtype=torch.uint8),
            out_ptr=torch.empty(1, dtype=torch.bfloat16), part_ptr=torch.empty(1, dtype=torch.float32),
            count_ptr=torch.empty(1, dtype=torch.int32), M=m, N=n, K=k, SPLIT_K=2, stride_sn=64, stride_om=n)
sig = {name: mangle_type(v) for name, v in args.items()}
const = dict(GROUP=128, HAS_ZEROS=True, BLOCK_N=bn, BLOCK_M=bm, XSTAGES=4, QSTAGES=8, WSTAGES=2, DQ_WARPS=dq,
             DQ_REGS=SPECIALIZED_DQ_REGS[dq], W_LAYOUT=gl.NVMMASharedLayout.get_default_for([bn, 64], gl.bfloat16),
             num_warps=bn // 16)
sig.update({name: "constexpr" for name in const})
kernel = triton.compile(GluonASTSource(P.w4_specialized_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": bn // 16})
''' + SASS_OF_KERNEL + r'''fixup = ptx[ptx.find("atom.global.gpu.acq_rel"):]
# each mbarrier arrive (not the TMA's expect) with the barrier instruction before it
arrives = [re.findall(r"(?:bar|barrier)\.sync\s+[^;]*;", ptx[:i])[-1]
           for i in [mm.start() for mm in re.finditer(r"mbarrier\.arrive\.shared::cta\.b64", ptx)]]
print(json.dumps({"code": [[int(a, 16), op, rest.strip()] for a, op, rest in code], "shared": kernel.metadata.shared,
                  "fixup": {"loads": fixup.count("ld.global.cg"), "stores": fixup.count("st.global")},
                  "arrives": arrives, "setmaxnreg": re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", ptx)}))
'''


@pytest.mark.parametrize("bn,bm,dq", [(128, 256, 4), (64, 256, 4), (128, 128, 8)])
def test_compiles_for_hopper_into_specialized_partitions(tmp_path, bn, bm, dq):
    if not _pipelined._gluon_ok():
        pytest.skip("this triton has no Gluon for Hopper")
    cubin = tmp_path / f"specialized_{bn}_{bm}_{dq}.cubin"
    got = run_compile_script(_COMPILE, [json.dumps(dict(BN=bn, BM=bm, DQ=dq)), str(cubin)], tmp_path)
    code = got["code"]
    assert not [op for _, op, _ in code if op.startswith(("STL", "LDL"))]  # no spills in any partition
    assert any(op.startswith("USETMAXREG") for _, op, _ in code)  # registers moved between the partitions
    shares = {int(s.split()[-1]) for s in got["setmaxnreg"]}  # up or down from the launch's even share
    assert _pipelined.SPECIALIZED_DQ_REGS[dq] in shares  # the dequantizing warps' share
    loop = main_loop(code)
    ops = [op for _, op, _ in loop]
    assert sum(op.startswith("HGMMA") for op in ops) == 4  # 64 columns a tile: four k16 steps, operands in shared
    assert all("gdesc" in rest and " R" not in rest.split("gdesc")[0].split(",", 1)[1] for _, op, rest in loop
               if op.startswith("HGMMA"))
    assert [rest for _, op, rest in loop if op.startswith("WARPGROUP.DEPBAR")] == ["gsb0, 0x1"]  # one in flight
    assert not any(op.startswith(("LDS", "STS")) for op in ops)  # the dequantization is the other warps' work
    # an arrive is its partition's first thread's: the partition's warps meet first, at their own barrier
    mma_threads, dq_threads = bn // 16 * 32, dq * 32
    assert len(got["arrives"]) == 2
    assert all(re.fullmatch(rf"bar\.sync\s+\d+,\s*({mma_threads}|{dq_threads});", a) for a in got["arrives"])
    assert got["shared"] <= 232448
    assert got["fixup"]["loads"] > 0 and got["fixup"]["stores"] > 0
