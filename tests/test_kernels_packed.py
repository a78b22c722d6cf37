"""The packed INT4 dequantization of the full-depth wdot ([Note: packed INT4 dequantization] in
kernels/_wmma_kernels.py): inline PTX, which the CPU interpreter cannot run. Here: when it is chosen, and that
both variants (bf16, fp16) compile for Hopper (sm_90) through ptxas, which checks the PTX, into packed
half-precision arithmetic with no fp32 conversions left in the dequantization. Its values are checked on the GPU
(benchmarks/RESULTS.md, kernels run 33: bit for bit the reference on one-hot rows)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.sm90_compile import run_compile_script
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
    for group in (16, 32, 64):  # 128-column tiles spanning groups, scales loaded per group ([Note: group scales])
        assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", group) == 1
        assert _word.packed_dequant(FMT_W4, F16, F16, "cuda", group) == 2
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", 8) == 0  # a group per word: crashed Triton 3.6 packed
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", 40) == 0  # no full-depth tile (wdot refuses it)
    assert _word.packed_dequant(FMT_W4, BF16, F16, "cuda", 128) == 0  # the product would round twice
    assert _word.packed_dequant(FMT_W4, F32, F32, "cuda", 128) == 0
    assert _word.packed_dequant(FMT_W8, BF16, BF16, "cuda", 128) == 0
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cpu", 128) == 0
    monkeypatch.setenv("ZSPEED_PACKED_DEQUANT", "0")
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", 128) == 0
    monkeypatch.delenv("ZSPEED_PACKED_DEQUANT")
    monkeypatch.setattr(_word, "interpreting", lambda: True)
    assert _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", 128) == 0


@pytest.mark.parametrize("group", [32, 64])
def test_tiles_spanning_groups_get_the_same_candidates_packed(monkeypatch, group):
    """At groups of 32 and 64 columns the tuner times the same 128-column full-depth tiles as at g128 (each spanning
    4 or 2 groups, scales per group, [Note: group scales]), packed where the scales are in x's dtype, with scales a
    tile ahead from 64 rows. Tiles inside one group (32 or 64 columns) are not offered: compiled for sm_90 they cost
    more instructions per 128 columns than one 128-column tile (e.g. 564 against 388 in the g32 16x64 swap-AB tile's
    loop, Triton 3.6)."""
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    monkeypatch.delenv("ZSPEED_PACKED_DEQUANT", raising=False)
    gpu = torch.device("cuda", 0)
    packed = _word.packed_dequant(FMT_W4, BF16, BF16, "cuda", group)
    assert packed == 1
    for m in (4, 16, 64, 256):
        got = _word.wdot_candidates(FMT_W4, m, 4096, 512, group, gpu, packed=packed)
        g128 = _word.wdot_candidates(FMT_W4, m, 4096, 512, 128, gpu, packed=packed)
        full = [c for c in got if c.full_depth]
        assert full == [c for c in g128 if c.full_depth]
        assert all(c.block_w * 8 in (64, 128) and c.order == 3 for c in full)  # 64: FULL_TILES' shallow ones
        assert any(c.block_w * 8 == 64 for c in full) == (m == 64)  # kernels run 44
        assert any(c.scales_ahead for c in full) == (m >= 64)


_COMPILE = r'''
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zspeed.kernels import _wmma_kernels as K

dtype = {"1": "bf16", "2": "fp16", "0": "bf16"}[sys.argv[1]]
ahead = sys.argv[3] == "1"
opts = json.loads(sys.argv[4])  # other tiles, groups; "divisible": the launch's 16-divisible pointers and sizes
sig = {"x_ptr": "*" + dtype, "w_ptr": "*i32", "s_ptr": "*" + dtype, "z_ptr": "*u8", "out_ptr": "*" + dtype,
       "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KW": "i32", "SPLIT_K": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32"}
names = list(sig)
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a not in ("M", "SPLIT_K")}
const = dict(FMT=1, GROUP=opts.get("GROUP", 128), HAS_ZEROS=True, ATOMIC=False, FIXUP=False, DOT_F32=False, CPW=8,
             BLOCK_M=opts.get("BLOCK_M", 16), BLOCK_N=opts.get("BLOCK_N", 64), BLOCK_W=16, EVEN_W=True, ORDER=3,
             SWAP=opts.get("SWAP", True), PACKED=int(sys.argv[1]), SCALES_AHEAD=ahead)
sig.update({name: "constexpr" for name in const})
kernel = triton.compile(ASTSource(K.wmma_kernel, sig, const, attrs if opts.get("divisible") else None),
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": opts.get("num_warps", 4), "num_stages": opts.get("num_stages", 4)})
path = sys.argv[2]
open(path, "wb").write(kernel.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
code = re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*);", sass, flags=re.M)
ops = [op for _, op, _ in code]
loops = [(int(m.group(1), 16), int(a, 16)) for a, op, rest in code if op == "BRA"
         for m in [re.search(r"0x([0-9a-f]+)", rest)] if m and int(m.group(1), 16) < int(a, 16)]
lo, hi = max(loops, key=lambda r: r[1] - r[0]) if loops else (0, -1)  # the main loop: the longest backward branch
loop = [op for a, op, _ in code if lo <= int(a, 16) <= hi]
print(json.dumps({"ptx_packed": "mul.rn.bf16x2" in kernel.asm["ptx"] or "mul.rn.f16x2" in kernel.asm["ptx"],
                  "ops": {op: ops.count(op) for op in set(ops)},
                  "loop_ops": {op: loop.count(op) for op in set(loop)}}))
'''


def _sass_ops(packed: int, tmp_path: Path, ahead: bool = False, **opts) -> dict:
    cubin = tmp_path / f"k{packed}_{abs(hash(json.dumps(opts, sort_keys=True)))}.cubin"
    return run_compile_script(_COMPILE, [str(packed), str(cubin), str(int(ahead)), json.dumps(opts)], tmp_path)


@pytest.mark.parametrize("packed, ahead", [(1, False), (2, False), (1, True)])
def test_packed_variants_compile_for_hopper_into_half2_arithmetic(packed, ahead, tmp_path):
    got, base = _sass_ops(packed, tmp_path, ahead), _sass_ops(0, tmp_path)
    ops = got["ops"]
    assert got["ptx_packed"] and not base["ptx_packed"]
    assert ops.get("HMUL2", 0) >= 32 and ops.get("HADD2", 0) >= 32  # 8 fields x 2 words x (BN x BW) / threads
    assert ops.get("FMUL", 0) == 0 and base["ops"].get("FMUL", 0) >= 64  # no fp32 scaling left
    assert ops.get("F2FP", 0) < base["ops"].get("F2FP", 0)  # no fp32 -> 16-bit packing of the tile
    assert sum(ops.values()) < 0.9 * sum(base["ops"].values())


def test_packed_tiles_spanning_groups_load_scales_per_group(tmp_path):
    """[Note: group scales]: g32, 4 groups per 128-column tile, in the 64 x 128 tile whose packed form crashed Triton
    3.6's compiler while its scales were gathered per word (kernels run 41), compiles for sm_90 into half2
    arithmetic; its main loop loads each group's scale and zero point once (the plain global loads, not cp.async:
    4 groups x what g128 loads for its one group) and costs hardly more instructions than g128's. Gathered per word
    (Triton 3.9): 32 such loads against g128's 2, 753 instructions against 534; per group: 8 and 574."""
    tile = dict(BLOCK_M=64, BLOCK_N=128, SWAP=False, num_warps=4, num_stages=3, divisible=True)
    g32, g128 = _sass_ops(1, tmp_path, GROUP=32, **tile), _sass_ops(1, tmp_path, GROUP=128, **tile)
    assert g32["ptx_packed"] and g32["ops"].get("HMUL2", 0) >= 32 and g32["ops"].get("FMUL", 0) == 0
    loads = lambda r: r["loop_ops"].get("LDG", 0)  # noqa: E731
    assert 0 < loads(g128) and loads(g32) <= 4 * loads(g128), (loads(g32), loads(g128))
    assert sum(g32["loop_ops"].values()) <= 1.2 * sum(g128["loop_ops"].values())
