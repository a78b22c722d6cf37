"""The packed INT4 dequantization of the full-depth wdot ([Note: packed INT4 dequantization] in
kernels/_wmma_kernels.py): inline PTX, which the CPU interpreter cannot run. Here: when it is chosen, and that
both variants (bf16, fp16) compile for Hopper (sm_90) through ptxas, which checks the PTX, into packed
half-precision arithmetic with no fp32 conversions left in the dequantization. Its values are checked on the GPU
(benchmarks/RESULTS.md, kernels run 33: bit for bit the reference on one-hot rows)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zspeed.kernels import _word
from zspeed.kernels._gemm import FMT_W4, FMT_W8

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def test_scales_ahead_is_offered_for_packed_int4_from_64_rows(monkeypatch):
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for m in (4, 16, 64, 256):
        plain = _word.wdot_candidates(FMT_W4, m, 8192, 1024, 128, gpu)
        packed = _word.wdot_candidates(FMT_W4, m, 8192, 1024, 128, gpu, packed=1)
        assert not any(c.scales_ahead for c in plain)
        ahead = [c for c in packed if c.scales_ahead]
        if m < 64:
            assert packed == plain
        else:  # every full-depth config once more, loading its scales a tile ahead
            assert [dataclasses.replace(c, scales_ahead=False) for c in ahead] == [c for c in plain if c.full_depth]
            assert len(packed) == len(plain) + len(ahead)


def test_packed_only_for_int4_with_scales_in_the_activation_dtype_on_the_gpu(monkeypatch):
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.delenv("ZSPEED_PACKED_DEQUANT", raising=False)
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", 128) == 1
    assert _word.packed_dequant(FMT_W4, F16, F16, "cuda", 128) == 2
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", 256) == 1  # 128-column tiles inside each group
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", 192) == 1  # 64-column tiles, inside each group
    for group in (32, 64):  # tiles spanning groups: the fp32 path (kernels run 41)
        assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", group) == 0
    assert _word.packed_dequant(FMT_W4, BF16, F16, "cuda", 128) == 0  # the product would round twice
    assert _word.packed_dequant(FMT_W4, F32, F32, "cuda", 128) == 0
    assert _word.packed_dequant(FMT_W8, BF16, BF16, "cuda", 128) == 0
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cpu", 128) == 0
    monkeypatch.setenv("ZSPEED_PACKED_DEQUANT", "0")
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", 128) == 0
    monkeypatch.delenv("ZSPEED_PACKED_DEQUANT")
    monkeypatch.setattr(_word, "interpreting", lambda: True)
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", 128) == 0


_COMPILE = r'''
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zspeed.kernels import _wmma_kernels as K

dtype = {"1": "bf16", "2": "fp16", "0": "bf16"}[sys.argv[1]]
ahead = sys.argv[3] == "1"
sig = {"x_ptr": "*" + dtype, "w_ptr": "*i32", "s_ptr": "*" + dtype, "z_ptr": "*u8", "out_ptr": "*" + dtype,
       "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KW": "i32", "SPLIT_K": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32"}
const = dict(FMT=1, GROUP=128, HAS_ZEROS=True, ATOMIC=False, FIXUP=False, DOT_F32=False, CPW=8, BLOCK_M=16,
             BLOCK_N=64, BLOCK_W=16, EVEN_W=True, ORDER=3, SWAP=True, PACKED=int(sys.argv[1]), SCALES_AHEAD=ahead)
sig.update({name: "constexpr" for name in const})
kernel = triton.compile(ASTSource(K.wmma_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4, "num_stages": 4})
path = sys.argv[2]
open(path, "wb").write(kernel.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, flags=re.M)
print(json.dumps({"ptx_packed": "mul.rn.bf16x2" in kernel.asm["ptx"] or "mul.rn.f16x2" in kernel.asm["ptx"],
                  "ops": {op: ops.count(op) for op in set(ops)}}))
'''


def _sass_ops(packed: int, tmp_path: Path, ahead: bool = False) -> dict:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "cuobjdump").exists():
        pytest.skip(f"this triton wheel has no CUDA toolchain in {bin_dir}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(packed), str(tmp_path / f"k{packed}.cubin"),
                           str(int(ahead))],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("packed, ahead", [(1, False), (2, False), (1, True)])
def test_packed_variants_compile_for_hopper_into_half2_arithmetic(packed, ahead, tmp_path):
    got, base = _sass_ops(packed, tmp_path, ahead), _sass_ops(0, tmp_path)
    ops = got["ops"]
    assert got["ptx_packed"] and not base["ptx_packed"]
    assert ops.get("HMUL2", 0) >= 32 and ops.get("HADD2", 0) >= 32  # 8 fields x 2 words x (BN x BW) / threads
    assert ops.get("FMUL", 0) == 0 and base["ops"].get("FMUL", 0) >= 64  # no fp32 scaling left
    assert ops.get("F2FP", 0) < base["ops"].get("F2FP", 0)  # no fp32 -> 16-bit packing of the tile
    assert sum(ops.values()) < 0.9 * sum(base["ops"].values())
