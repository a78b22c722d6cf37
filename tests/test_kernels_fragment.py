"""The INT4 GEMM for Hopper that dequantizes into the ``wgmma``'s register operand ([Note: fragment wdot] in
kernels/_fragment_kernels.py), a Gluon kernel that the CPU interpreter cannot run. Here: when the tuner offers it,
how a config reaches it, bad arguments, and that it compiles for sm_90 into the schedule it exists for: the MMA loop
takes the weights from registers (no shared-memory store of dequantized weights, one 16-byte load per word row),
retires each ``wgmma`` before the next tile's fragments take its registers, has no spills, and every mbarrier arrive
follows its warp group's own barrier. Its values are checked on the GPU: ``benchmarks/fragment_check.py`` (bit for
bit against the warp-specialized kernel) and ``benchmarks/wdot_tiles.py --fragment`` (against the reference,
outputs on NaN-filled memory): benchmarks/RESULTS.md, kernels runs 84-86."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.sm90_compile import SASS_OF_KERNEL, launched_with, main_loop, run_compile_script
from zspeed.kernels import _pipelined, _word
from zspeed.kernels._gemm import FMT_W4, FMT_W8
from zspeed.kernels._runtime import m_bucket


def test_offered_for_packed_int4_from_two_rows(monkeypatch):
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(_pipelined, "pipelined_possible", lambda device, *, group, k: True)
    monkeypatch.setattr(_pipelined, "specialized_possible", lambda device, *, group, k: True)
    for m in (1, 2, 5, 16, 33, 64, 65, 128, 256, 700):
        got = [c for c in _word.full_depth_candidates(FMT_W4, m, 8192, 1024, 128, gpu, packed=1) if c.fragment]
        if m == 1:  # one row is the GEMV's
            assert not got
            continue
        if m_bucket(m) < 128:  # one block of x as small as the rows allow, eight x and word buffers
            bm = max(8, m_bucket(m))
            assert {c.block_m for c in got} == {bm} and not any(c.pair or c.tail for c in got)
            stages = {(*_word.FRAGMENT_SMALL_STAGES, 1)}
            if bm <= 16:  # also slots of two tiles ([Note: slots of two tiles])
                stages |= {(*_word.FRAGMENT_SMALL_SLOTS, 2)}
            # each with two and four MMA warp groups ([Note: four warp groups at small M])
            assert {(c.stages, c.prefetch, c.sub, c.block_n) for c in got} == {
                (*st, bn) for st in stages for bn in (128, 256)}
            assert all(c.overlap and c.warps == c.block_n // 16 for c in got)
            # 64 tiles of 128 weight rows fill half the SMs: also split in two; 32 of 256 a quarter: also in four
            assert sorted((c.block_n, c.split_k) for c in got) == sorted(
                [(128, 1), (128, 2), (256, 1), (256, 4)] * len(stages))
            # weight rows that are not whole blocks of 256 too (the last block masked)
            odd = [c for c in _word.full_depth_candidates(FMT_W4, m, 8192 + 128, 1024, 128, gpu, packed=1)
                   if c.fragment]
            assert {c.block_n for c in odd} == {128, 256}
            continue
        assert {c.block_m for c in got} == ({128} if m_bucket(m) == 128 else {128, 256})
        assert all(c.pipelined and c.block_n == 128 and c.warps == 8 and c.block_w == 8 and c.prefetch == 8
                   and c.fixup == (c.split_k > 1) and not c.specialized for c in got)
    # 8192 weight rows at 256 rows: 64 programs of 256 x 128 fill half the SMs, so also split in two; from 256
    # rows each config also with paired tiles, below only unpaired
    got = [c for c in _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, 1) if c.fragment]
    assert sorted((c.block_m, c.split_k, c.pair, c.overlap) for c in got) == sorted(
        (bm, sp, pair, not pair) for bm, sp in ((128, 1), (256, 1), (256, 2)) for pair in (False, True))
    at_128 = [c for c in _word.full_depth_candidates(FMT_W4, 128, 8192, 1024, 128, gpu, 1) if c.fragment]
    assert at_128 and all(c.overlap and not c.pair for c in at_128)
    assert any(c.fragment for c in _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, 2))  # fp16
    # INT8 with bf16 / fp16 x too ([Note: INT8 fragments]): the same tiles (K counted in INT4 words), no warp-
    # specialized ones; not with fp32 x
    got8 = [c for c in _word.full_depth_candidates(FMT_W8, 256, 8192, 2048, 0, gpu, half_x=True) if c.fragment]
    assert sorted((c.block_m, c.split_k, c.pair) for c in got8) == sorted((c.block_m, c.split_k, c.pair) for c in got)
    assert not any(c.specialized for c in _word.full_depth_candidates(FMT_W8, 256, 8192, 2048, 0, gpu, half_x=True))
    assert not any(c.fragment for c in _word.full_depth_candidates(FMT_W8, 256, 8192, 2048, 0, gpu, half_x=False))
    small8 = [c for c in _word.full_depth_candidates(FMT_W8, 16, 8192, 2048, 0, gpu, half_x=True) if c.fragment]
    assert {(c.block_m, c.block_n, c.sub) for c in small8} == {(16, 128, 1), (16, 256, 1), (16, 128, 2), (16, 256, 2)}
    assert not any(c.fragment for c in _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, 0))
    monkeypatch.setattr(_pipelined, "specialized_possible", lambda device, *, group, k: False)  # no warp_specialize
    got = _word.full_depth_candidates(FMT_W4, 256, 8192, 1024, 128, gpu, packed=1)
    assert got and not any(c.fragment for c in got)


def test_a_fragment_config_launches_the_fragment_kernel(monkeypatch):
    c = _word.WordConfig(256, 128, 8, 1, 8, 5, 7, full_depth=True, order=3, pipelined=True, fragment=True)
    seen = launched_with(monkeypatch, c, "run_fragment")
    assert seen == dict(group=128, n=64, k=256, block_m=256, stages=5, q_stages=7, split_k=1, whole=0,
                        pair=False, overlap=False, sub=1, warp_groups=2, workspace=None, int8=False)
    seen = launched_with(monkeypatch, _word.replace(c, overlap=True, sub=2), "run_fragment")
    assert (seen["overlap"], seen["sub"]) == (True, 2)
    seen = launched_with(monkeypatch, _word.replace(c, block_m=16, block_n=256, warps=16, overlap=True), "run_fragment")
    assert (seen["block_m"], seen["warp_groups"]) == (16, 4)  # [Note: four warp groups at small M]
    seen = launched_with(monkeypatch, _word.replace(c, pair=True), "run_fragment")
    assert (seen["pair"], seen["overlap"]) == (True, False)
    seen = launched_with(monkeypatch, _word.replace(c, overlap=True), "run_fragment")
    assert (seen["pair"], seen["overlap"]) == (False, True)
    assert not seen["int8"]
    seen = launched_with(monkeypatch, _word.replace(c, overlap=True), "run_fragment", int8=True)
    assert (seen["int8"], seen["k"], seen["block_m"]) == (True, 256, 256)  # [Note: INT8 fragments]


def test_a_short_last_wave_is_split_and_the_whole_waves_are_not(monkeypatch):
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    monkeypatch.setattr(_pipelined, "pipelined_possible", lambda device, *, group, k: True)
    monkeypatch.setattr(_pipelined, "specialized_possible", lambda device, *, group, k: True)
    gpu = torch.device("cuda", 0)

    def tails(m, n, k):
        return [c for c in _word.full_depth_candidates(FMT_W4, m, n, k // 8, 128, gpu, packed=1) if c.tail]

    # 8192 x 28672 at 512 rows: 448 tiles of 256 x 128 = 3 waves + 52 tiles, which 104 half-tile programs replace
    c, paired = tails(512, 28672, 8192)
    assert (c.fragment, c.block_m, c.split_k, c.fixup, c.pair, c.overlap) == (True, 256, 2, True, False, True)
    assert paired == _word.replace(c, pair=True, overlap=False)
    assert _word.fragment_whole(c, 512, 28672, 132) == 396
    assert _word.fragment_whole(c, 450, 28672, 132) == 396  # same tiles at any row count of the 512 bucket
    # 256-row blocks: 152 tiles, 20 left over in 6 slices each; 128-row blocks: 304, 40 left over in 3 slices each
    assert [(c.block_m, c.split_k) for c in tails(256, 152 * 128, 8192)] == [(128, 3), (256, 6)] * 2
    assert _word._tail_split(152, 8192 // 64, 132) == 6
    assert _word._tail_split(152, 40, 132) == 5  # a shallow K: slices of at least 8 tiles
    assert _word._tail_split(140, 1024, 132) == 8  # 8 tiles left: at most 8 slices
    # one wave or less (the uniform split covers it), whole waves, or a last wave more than half full: no tail split
    assert not tails(512, 8192, 8192)  # 128 tiles
    assert not tails(1024, 28672, 8192)  # 896 tiles: 6 waves + 104
    assert not tails(512, 264 * 128 // 2, 8192)  # 264 tiles: two whole waves
    # partials past the workspace: not offered
    monkeypatch.setattr(_word, "STATIONARY_WORKSPACE", 52 * 2 * 128 * 256 - 1)
    assert not tails(512, 28672, 8192)


def test_a_tail_config_launches_with_its_whole_tiles(monkeypatch):
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    c = _word.WordConfig(128, 128, 8, 2, 8, 4, 8, full_depth=True, order=3, pipelined=True, fixup=True,
                         fragment=True, tail=True)
    # one tile, less than a wave: it is split like every tile of a uniform split
    seen = launched_with(monkeypatch, c, "run_fragment")
    assert (seen["whole"], seen["split_k"]) == (0, 2) and seen["workspace"] is not None
    monkeypatch.setattr(_word, "_sm_count", lambda index: 1)  # one SM: the tile makes a whole wave and runs whole
    seen = launched_with(monkeypatch, c, "run_fragment")
    assert seen["whole"] == 1


def test_pair_and_overlap_together_are_refused():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pick one"):
        _pipelined.run_fragment(x, torch.zeros(64, 16, dtype=torch.int32), torch.zeros(64, 1, dtype=torch.bfloat16),
                                None, group=128, n=64, k=128, block_m=128, stages=4, q_stages=8, pair=True,
                                overlap=True)


def test_slots_of_two_tiles_and_buffer_counts_that_would_hang_are_refused():
    x = torch.zeros(4, 192, dtype=torch.bfloat16)
    w, s = torch.zeros(64, 24, dtype=torch.int32), torch.zeros(64, 2, dtype=torch.bfloat16)
    args = dict(group=64, n=64, k=192, block_m=16)
    # the loader keeps the words q_stages - stages slots ahead of x: fewer word than x buffers never issue the last
    with pytest.raises(ValueError, match="stages=4 x buffers exceed q_stages=3 word buffers"):
        _pipelined.run_fragment(x, w, s, None, stages=4, q_stages=3, overlap=True, **args)
    for bad in (dict(sub=3, overlap=True), dict(sub=2), dict(sub=2, pair=True),  # slots of two: overlapped only
                dict(sub=2, overlap=True)):  # K = 192 is three 64-column tiles, no whole slots of two
        with pytest.raises(ValueError, match="slots of two tiles"):
            _pipelined.run_fragment(x, w, s, None, stages=3, q_stages=3, **bad, **args)
    for bad in (dict(warp_groups=3), dict(warp_groups=4, block_m=128), dict(warp_groups=4, pair=True)):
        with pytest.raises(ValueError, match="four warp groups at small M"):
            _pipelined.run_fragment(x, w, s, None, stages=3, q_stages=3, **{**args, **bad})


def test_bad_splits_and_a_small_workspace_are_refused_before_launch():
    x = torch.zeros(512, 128, dtype=torch.bfloat16)
    w, s = torch.zeros(1024, 16, dtype=torch.int32), torch.zeros(1024, 1, dtype=torch.bfloat16)
    args = dict(group=128, n=1024, k=128, block_m=256, stages=4, q_stages=8)  # 8 x 2 = 16 tiles
    ws = (torch.zeros(4 * 2 * 128 * 256), torch.zeros(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="whole within 0..16"):
        _pipelined.run_fragment(x, w, s, None, split_k=2, whole=17, workspace=ws, **args)
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        _pipelined.run_fragment(x, w, s, None, split_k=0, **args)
    with pytest.raises(ValueError, match="5 split tiles x 2 slices need 327680 partial sums.*split fewer tiles"):
        _pipelined.run_fragment(x, w, s, None, split_k=2, whole=11, workspace=ws, **args)
    with pytest.raises(ValueError, match="32 counters"):
        _pipelined.run_fragment(x, w, s, None, split_k=2, whole=12, workspace=(ws[0], ws[1][:31]), **args)


def test_split_k_without_a_workspace_is_refused_before_launch():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs the fix-up workspace"):
        _pipelined.run_fragment(x, torch.zeros(64, 16, dtype=torch.int32), torch.zeros(64, 1, dtype=torch.bfloat16),
                                None, group=128, n=64, k=128, block_m=128, stages=4, q_stages=8, split_k=2)


_COMPILE = r'''
import json, os, re, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

opts = json.loads(sys.argv[1])
from zspeed.kernels import _fragment_kernels as P
bm, half = opts["BM"], opts["HALF"]
dt, tdt = (gl.float16, torch.float16) if half else (gl.bfloat16, torch.bfloat16)
m, n, k = 256, 8192, 8192
x = torch.empty(m, k, dtype=tdt)
int8 = opts.get("INT8", False)
wpt = 16 if int8 else 8  # words a tile row
w = torch.empty(n, k * wpt // 64, dtype=torch.int32)
args = dict(x_desc=TensorDescriptor(x, [m, k], [k, 1], [bm, 64], gl.NVMMASharedLayout.get_default_for([bm, 64], dt)),
            w_desc=TensorDescriptor(w, list(w.shape), [w.shape[1], 1], [64 * opts.get("NWG", 2), wpt],
                                    gl.NVMMASharedLayout.get_default_for([64 * opts.get("NWG", 2), wpt], gl.int32)),
            s_ptr=torch.empty(1, dtype=tdt), z_ptr=torch.empty(1, dtype=torch.uint8),
            out_ptr=torch.empty(1, dtype=tdt), part_ptr=torch.empty(1, dtype=torch.float32),
            count_ptr=torch.empty(1, dtype=torch.int32), M=m, N=n, K=k, WHOLE=100, SPLIT_K=2, stride_sn=64,
            stride_om=n)
sig = {name: mangle_type(v) for name, v in args.items()}
const = dict(GROUP=64 if int8 else 128, HAS_ZEROS=not int8, BLOCK_M=bm, XSTAGES=opts.get("XS", 4), QSTAGES=opts.get("QS", 8),
             MMA_REGS=opts.get("REGS", 232), num_warps=4, PAIR=opts["PAIR"], OVERLAP=opts.get("OVERLAP", False),
             SUB=opts.get("SUB", 1), NWG=opts.get("NWG", 2))
sig.update({name: "constexpr" for name in const})
kernel = triton.compile(GluonASTSource(P.w4_fragment_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4})
''' + SASS_OF_KERNEL + r'''fixup = ptx[ptx.find("atom.global.gpu.acq_rel"):]
arrives = [re.findall(r"(?:bar|barrier)\.sync\s+[^;]*;", ptx[:i])[-1]
           for i in [mm.start() for mm in re.finditer(r"mbarrier\.arrive\.shared::cta\.b64", ptx)]]
print(json.dumps({"code": [[int(a, 16), op, rest.strip()] for a, op, rest in code], "shared": kernel.metadata.shared,
                  "fixup": {"loads": fixup.count("ld.global.cg"), "stores": fixup.count("st.global")},
                  "arrives": arrives}))
'''


@pytest.mark.parametrize("bm,half", [(256, False), (128, False), (256, True), (8, False)])
def test_compiles_for_hopper_with_the_weights_in_registers(tmp_path, bm, half):
    if not _pipelined._gluon_ok():
        pytest.skip("this triton has no Gluon for Hopper")
    cubin = tmp_path / f"fragment_{bm}_{half}.cubin"
    got = run_compile_script(_COMPILE, [json.dumps(dict(BM=bm, HALF=half, PAIR=False)), str(cubin)], tmp_path)
    code = got["code"]
    assert not [op for _, op, _ in code if op.startswith(("STL", "LDL"))]  # no spills in any partition
    assert any(op.startswith("USETMAXREG") for _, op, _ in code)
    loop = main_loop(code)
    ops = [op for _, op, _ in loop]
    mmas = [rest for _, op, rest in loop if op.startswith("HGMMA")]
    assert len(mmas) == 4  # 64 columns a tile: four k16 steps
    assert all(re.search(r"\sR\d+, R\d+, gdesc", rest) for rest in mmas)  # A from registers, B from shared memory
    assert [rest for _, op, rest in loop if op.startswith("WARPGROUP.DEPBAR")] == ["gsb0, 0x0"]  # retired in turn
    assert not any(op.startswith("STS") for op in ops)  # dequantized weights never go to shared memory
    assert [op for op in ops if op.startswith("LDS")] == ["LDS.128"] * 4  # a thread's two rows of 8 words
    # a tile is 16 pairs a thread: one mul each (and one sub each; the scales' update may add an HADD2)
    assert sum(op.startswith("HMUL2") for op in ops) == 16 and sum(op.startswith("HADD2") for op in ops) >= 16
    # two arrives (words, x) in each MMA warp group's partition, each after that warp group's own barrier
    ids = [re.fullmatch(r"bar\.sync\s+(\d+),\s*128;", a) for a in got["arrives"]]
    assert len(ids) == 4 and all(ids) and len({i.group(1) for i in ids}) == 2
    assert got["shared"] <= 232448
    assert got["fixup"]["loads"] > 0 and got["fixup"]["stores"] > 0


@pytest.mark.parametrize("bm,half,nwg", [(256, False, 2), (16, False, 4), (64, True, 2)])
def test_int8_words_compile_to_exact_pairs_in_the_wgmma_registers(tmp_path, bm, half, nwg):
    """[Note: INT8 fragments]: INT8 words go into the ``wgmma``'s A registers too: 16 pairs a thread a tile, each
    an xor, a ``prmt`` and an exact fp16 subtract (fp16), or two ``prmt``, two fp32 subtracts and one packing
    ``cvt`` (bf16); a thread's 8 words of each of its two rows; no scale multiply in the loop and no spills in it
    (with 256-row blocks the epilogue's scale multiply spills a few registers once a tile, after the loop)."""
    if not _pipelined._gluon_ok():
        pytest.skip("this triton has no Gluon for Hopper")
    opts = dict(BM=bm, HALF=half, PAIR=False, OVERLAP=True, INT8=True, NWG=nwg, REGS=232 if nwg == 2 else 104)
    got = run_compile_script(_COMPILE, [json.dumps(opts), str(tmp_path / "i8.cubin")], tmp_path)
    code = got["code"]
    if bm <= 64:
        assert not [op for _, op, _ in code if op.startswith(("STL", "LDL"))]
    loop = _loop_with_mmas(code, 4)  # a tile's four k16 steps (main_loop may find the fix-up's loop)
    ops = [op for _, op, _ in loop]
    assert not [op for op in ops if op.startswith(("STL", "LDL"))]
    mmas = [rest for _, op, rest in loop if op.startswith("HGMMA")]
    assert all(re.search(r"\sR\d+, R\d+, gdesc", rest) for rest in mmas)  # A from registers
    assert not any(op.startswith("STS") for op in ops)
    assert sum(op.startswith("LDS") for op in ops) == 16  # 8 words of each of two rows
    assert not any(op.startswith("HMUL2") for op in ops)  # the scale is applied to the sums
    if half:
        assert sum(op.startswith("HADD2") for op in ops) == 16 and sum(op.startswith("PRMT") for op in ops) == 16
    else:
        assert sum(op.startswith("F2FP") for op in ops) == 16 and sum(op.startswith("FADD") for op in ops) == 32
    assert got["shared"] <= 232448


def test_an_unsplit_launch_passes_no_constant_split(monkeypatch):
    """Triton makes an integer argument of 1 a constant, and Triton 3.6's Gluon then fails to lower this kernel
    (kernels run 94): an unsplit launch runs every tile whole with SPLIT_K 2, unused."""
    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.update(grid=grid, whole=args[10], split=args[11])
            return launch

    monkeypatch.setattr(_pipelined, "_fragment_kernels", lambda: type("K", (), {"w4_fragment_kernel": Kernel()}))
    monkeypatch.setattr(_pipelined, "_operands", lambda x, words, **kw: (None, None, torch.zeros(x.shape[0], kw["n"]),
                                                                           None))
    x = torch.zeros(300, 128, dtype=torch.bfloat16)
    w, s = torch.zeros(1000, 16, dtype=torch.int32), torch.zeros(1000, 1, dtype=torch.bfloat16)
    args = dict(group=128, n=1000, k=128, block_m=128, stages=4, q_stages=8)  # 8 x 3 = 24 tiles
    _pipelined.run_fragment(x, w, s, None, **args)
    assert seen == dict(grid=(24, ), whole=24, split=2)
    ws = (torch.zeros(8 * 3 * 128 * 128), torch.zeros(48, dtype=torch.int32))
    _pipelined.run_fragment(x, w, s, None, split_k=3, whole=16, workspace=ws, **args)
    assert seen == dict(grid=(16 + 8 * 3, ), whole=16, split=3)


def test_paired_tiles_compile_to_eight_mmas_and_one_retire_a_round(tmp_path):
    """[Note: paired tiles]: the paired loop holds both tiles' eight ``HGMMA`` (A from two sets of registers) with
    one retire after them, then four arrives after the warp group's barriers; an odd tile count's last tile has a
    loop of its own; no spills."""
    if not _pipelined._gluon_ok():
        pytest.skip("this triton has no Gluon for Hopper")
    got = run_compile_script(_COMPILE, [json.dumps(dict(BM=256, HALF=False, PAIR=True)), str(tmp_path / "p.cubin")],
                             tmp_path)
    code = got["code"]
    assert not [op for _, op, _ in code if op.startswith(("STL", "LDL"))]
    loops = []  # (first, last) address of each backward branch's loop
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    bodies = sorted(([(op, rest) for a, op, rest in code if lo <= a <= hi] for lo, hi in loops), key=len)
    counts = [sum(op.startswith("HGMMA") for op, _ in b) for b in bodies]
    assert 4 in counts and 8 in counts  # the innermost loops: an odd tile's, the paired rounds (outer loops hold more)
    paired = bodies[counts.index(8)]
    mmas = [rest for op, rest in paired if op.startswith("HGMMA")]
    a_regs = {re.search(r"\sR\d+, (R\d+), gdesc", r).group(1) for r in mmas}
    assert len(a_regs) == 8  # eight distinct A fragments: neither tile's registers reused while in flight
    assert [rest for op, rest in paired if op.startswith("WARPGROUP.DEPBAR")] == ["gsb0, 0x0"]
    assert sum("gsb0" in r for r in mmas) >= 1
    ops = [op for op, _ in paired]
    last_mma = max(i for i, op in enumerate(ops) if op.startswith("HGMMA"))
    assert sum(op.startswith("SYNCS.ARRIVE") for op in ops[last_mma:]) == 4


@pytest.mark.parametrize("bm", [256, 128])
def test_overlapped_fragments_leave_the_in_flight_registers_alone(tmp_path, bm):
    """[Note: overlapped fragments]: between the loop's four ``HGMMA`` and their retire come the next tile's word
    loads (its ring wait and four ``LDS.128``), and nothing there writes a register the in-flight ``HGMMA`` read their
    A from (the hazard of kernels run 84); the fragments' multiplies come after the retire."""
    if not _pipelined._gluon_ok():
        pytest.skip("this triton has no Gluon for Hopper")
    got = run_compile_script(_COMPILE, [json.dumps(dict(BM=bm, HALF=False, PAIR=False, OVERLAP=True)),
                                        str(tmp_path / "o.cubin")], tmp_path)
    code = got["code"]
    assert not [op for _, op, _ in code if op.startswith(("STL", "LDL"))]
    hgmma = [i for i, (_, op, _) in enumerate(code) if op.startswith("HGMMA")][:4]  # the loop's, first in the code
    depbar = next(i for i in range(hgmma[-1], len(code)) if code[i][1].startswith("WARPGROUP.DEPBAR"))
    assert code[depbar][2].strip() == "gsb0, 0x0"
    window = code[hgmma[0]:depbar]
    assert [op for _, op, _ in window if op.startswith("LDS")] == ["LDS.128"] * 4  # the next tile's words
    assert any(op.startswith("SYNCS.PHASECHK") for _, op, _ in window)  # its ring wait
    after = code[depbar:depbar + 200]
    assert sum(op.startswith("HMUL2") for _, op, _ in after) == 16  # its 16 pairs, once the registers are free
    issued: set[int] = set()  # A registers of the HGMMAs issued so far in the window
    for _, op, rest in window:
        if op.startswith("HGMMA"):
            base = int(re.search(r"\sR\d+, R(\d+), gdesc", rest).group(1))
            issued |= {base, base + 1, base + 2, base + 3}
            continue
        m = re.match(r"\s*R(\d+)\b", rest)
        if m and not op.startswith(("ST", "SYNCS", "BAR", "RED", "ATOM", "BRA")):
            assert int(m.group(1)) not in issued, f"{op}{rest} writes an in-flight HGMMA's A register"
    assert len(issued) == 16


@pytest.mark.parametrize("nwg", [2, 4])
def test_slots_of_two_tiles_halve_the_ring_traffic_and_keep_the_registers_apart(tmp_path, nwg):
    """[Note: slots of two tiles]: the loop holds two tiles (eight ``HGMMA``, two retires) with one wait for each
    ring (words, ``x``) and one arrive for each, no spills, and no write to an in-flight ``HGMMA``'s A registers
    before its retire; it is shorter than two rounds of the one-tile loop. Also with four MMA warp groups at 104
    registers a thread ([Note: four warp groups at small M])."""
    if not _pipelined._gluon_ok():
        pytest.skip("this triton has no Gluon for Hopper")
    loops = {}
    for sub in (1, 2):
        opts = dict(BM=16, HALF=False, PAIR=False, OVERLAP=True, SUB=sub, XS=3 if sub == 2 else 8,
                    QS=3 if sub == 2 else 8, NWG=nwg, REGS=232 if nwg == 2 else 104)
        got = run_compile_script(_COMPILE, [json.dumps(opts), str(tmp_path / f"s{sub}.cubin")], tmp_path)
        code = got["code"]
        assert not [op for _, op, _ in code if op.startswith(("STL", "LDL"))]
        loops[sub] = _loop_with_mmas(code, 4 * sub)
    loop = loops[2]
    ops = [op for _, op, _ in loop]
    assert sum(op.startswith("WARPGROUP.DEPBAR") for op in ops) == 2
    assert sum(op.startswith("SYNCS.PHASECHK") for op in ops) == 2  # one wait a ring
    assert sum(op.startswith("SYNCS.ARRIVE") for op in ops) == 2  # one release a ring
    assert [op for op in ops if op.startswith("LDS")] == ["LDS.128"] * 8
    assert len(loop) < 2 * len(loops[1])
    issued: set[int] = set()
    for _, op, rest in loop:
        if op.startswith("HGMMA"):
            base = int(re.search(r"\sR\d+, R(\d+), gdesc", rest).group(1))
            issued |= {base, base + 1, base + 2, base + 3}
        elif op.startswith("WARPGROUP.DEPBAR"):
            issued = set()
        else:
            m = re.match(r"\s*R(\d+)\b", rest)
            if m and not op.startswith(("ST", "SYNCS", "BAR", "RED", "ATOM", "BRA")):
                assert int(m.group(1)) not in issued, f"{op}{rest} writes an in-flight HGMMA's A register"


def _loop_with_mmas(code: list, mmas: int) -> list:
    """The shortest loop (a backward branch and its target) that holds ``mmas`` ``HGMMA``."""
    loops = []
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [(a, o, r) for a, o, r in code if int(target.group(1), 16) <= a <= addr]
            if sum(o.startswith("HGMMA") for _, o, _ in body) == mmas:
                loops.append(body)
    assert loops, f"no loop with {mmas} HGMMA"
    return min(loops, key=len)
