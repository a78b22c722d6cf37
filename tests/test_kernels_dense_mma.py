"""The INT4 GEMV on tensor cores ([Note: INT4 GEMV on tensor cores] in kernels/_dense_mma_kernels.py), a Gluon kernel
around inline ``mma.sync`` that the CPU interpreter cannot run, and its layout with folded rows ([Note: INT4 GEMV with
folded rows]). Here: each stripe's inline asm, run lane by lane by a small PTX emulator against ``(codes - zero) @
x^T``; when the kernels are offered and chosen; that bad arguments are refused; and that they compile for sm_90 into
what they exist for: 8 MMAs a stripe and block of 8 rows of ``x`` (4 with folded rows), one 16-byte load a stripe
and weight row, a bf16 subtraction a code pair, nothing spilled. Their values are checked on the GPU against the
reference at full size (``benchmarks/gemv_check.py --formats w4 --kinds dense dense_fold``; benchmarks/RESULTS.md,
kernels runs 160-163 and 185-186)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.gemv_kernels import Picked, compile_gemv_kernel, loop_around, record_launch_kwarg, record_offers
from tests.ptx_emulator import bf16_bits, emulate, pair
from zspeed.kernels import KernelPolicy, _dense_mma, _word

_kernels = pytest.importorskip("zspeed.kernels._dense_mma_kernels", reason="this triton has no Gluon")


@pytest.mark.parametrize("nt", [1, 2])
def test_stripe_asm_multiplies_codes_minus_zero_by_x(nt):
    torch.manual_seed(nt)
    codes = torch.randint(0, 16, (16, 128), dtype=torch.int32)
    zero = torch.randint(0, 16, (16,), dtype=torch.int32)
    x = torch.randint(-8, 9, (8 * nt, 128)).float() / 4  # exact in bf16 and in every fp32 sum
    words = sum((codes[:, i::8] << (4 * i)) for i in range(8))  # (16, 16): nibble i of word c is column 8c + i
    asm, io = _kernels.w4_dense_asm(nt)
    assert io.count("=f") == 4 * nt and io.count("r") == 4 * (4 + 4 * nt)
    nz = pair(-(128.0 + zero).float(), -(128.0 + zero).float())  # -(128 + zero) in both halves
    operands = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        ops = [0.0] * (4 * nt)
        ops += [int(words[g, 4 * t + w]) for w in range(4)] + [int(words[g + 8, 4 * t + w]) for w in range(4)]
        for tile in range(nt):  # B of word w, slot j: x[c + j] low, x[c + j + 4] high, c = 8 (4t + w)
            for w in range(4):
                c = 8 * (4 * t + w)
                ops += [int(pair(x[8 * tile + g, c + j], x[8 * tile + g, c + j + 4])) for j in range(4)]
        ops += [int(nz[g])] * 4 + [int(nz[g + 8])] * 4
        operands.append(ops)
    out = emulate(asm, operands)
    want = x @ (codes - zero[:, None]).float().T  # (rows of x, weight rows)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for tile in range(nt):
            got = out[lane][4 * tile:4 * tile + 4]
            rows = (8 * tile + 2 * t, 8 * tile + 2 * t + 1)
            assert got == [want[rows[0], g].item(), want[rows[1], g].item(), want[rows[0], g + 8].item(),
                           want[rows[1], g + 8].item()]


def test_candidates_split_k_into_whole_stripes_that_fit_the_workspace(monkeypatch):
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for m, n, k in ((1, 8192, 8192), (4, 28672, 8192), (8, 8192, 28672), (16, 8192, 8192), (1, 100, 384)):
        got = _word.dense_mma_w4_candidates(m, n, k, gpu)
        assert got and all(c.dense_mma and c.row_blocks & (c.row_blocks - 1) == 0 for c in got)
        for c in got:
            stripes = c.block_w // 16  # a program's
            assert stripes & (stripes - 1) == 0 and stripes % c.k_warps == 0 and c.warps % c.k_warps == 0
            assert c.block_n == 16 * c.warps // c.k_warps and c.prefetch in (0, 1)
            assert c.split_k == -(-(k // 128) // stripes)
            assert c.split_k == 1 or m * c.split_k * n <= _word.STATIONARY_WORKSPACE
        assert {c.k_warps for c in got} >= {1, 2} or k < 512
    # 9-16 rows hold twice the B registers: shallower slices a warp, unless x is in shared memory
    assert max(c.block_w // c.k_warps for c in _word.dense_mma_w4_candidates(16, 8192, 8192, gpu)
               if not c.x_shared) <= 64
    assert max(c.block_w // c.k_warps for c in _word.dense_mma_w4_candidates(8, 8192, 8192, gpu)) == 128
    # a wave of programs where the shape allows one
    assert all(c.split_k * -(-8192 // (c.block_n * c.row_blocks)) >= 132
               for c in _word.dense_mma_w4_candidates(1, 8192, 8192, gpu))


def test_fits_bf16_x_of_1_to_16_rows_groups_of_128_columns_and_aligned_words(monkeypatch):
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    words = torch.zeros(64, 32, dtype=torch.int32)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    z = torch.zeros(64, 2, dtype=torch.uint8)
    assert not _dense_mma.dense_mma_w4_fits(x, words, s, z, group=128)  # the CPU: no GPU to run it
    monkeypatch.setattr(_dense_mma, "dense_mma_possible", lambda device: True)
    assert _dense_mma.dense_mma_w4_fits(x, words, s, z, group=128)
    assert _dense_mma.dense_mma_w4_fits(x[:1], words, s, None, group=128)
    assert _dense_mma.dense_mma_w4_fits(torch.zeros(16, 256, dtype=torch.bfloat16), words, s[:, :1], z[:, :1],
                                        group=256)
    assert not _dense_mma.dense_mma_w4_fits(torch.zeros(17, 256, dtype=torch.bfloat16), words, s, z, group=128)
    assert not _dense_mma.dense_mma_w4_fits(x.half(), words, s, z, group=128)
    assert not _dense_mma.dense_mma_w4_fits(x, words, torch.ones(64, 4), z, group=64)  # a stripe is one group
    assert not _dense_mma.dense_mma_w4_fits(torch.zeros(4, 192, dtype=torch.bfloat16), words[:, :24], s, z,
                                            group=128)  # K not whole stripes
    assert not _dense_mma.dense_mma_w4_fits(x, torch.zeros(64, 33, dtype=torch.int32)[:, 1:], s, z, group=128)
    assert not _dense_mma.dense_mma_w4_fits(x, words, s, z.to(torch.int32), group=128)


def test_policy_keeps_int4_on_gemv_up_to_8_rows_only_where_it_runs():
    policy = KernelPolicy()
    for m in (2, 4, 8):
        assert policy.path("w4a16", m, dense_mma=True) == "gemv"
        assert policy.path("w4a16", m, dense_mma=False) == "wdot"
        assert policy.path("w8a16", m, dense_mma=True) == "wdot"  # INT4 only
        assert policy.path("w4a16", m, words=False, dense_mma=True) == "splitk"
    assert policy.path("w4a16", 9, dense_mma=True) == "wdot"  # 9-16 rows: wdot was faster (kernels run 163)
    assert KernelPolicy(dense_gemv_max_m=1).path("w4a16", 4, dense_mma=True) == "wdot"


@pytest.fixture
def offered(monkeypatch) -> list:
    """The candidate lists that ``_word.run_gemv`` hands its tuner, on a stand-in H100 where the kernel runs."""
    return record_offers(monkeypatch, _dense_mma, "dense_mma_possible")


def test_gemv_tunes_it_beside_the_others_at_one_row_and_alone_at_more(offered):
    words = torch.zeros(64, 32, dtype=torch.int32)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    for m in (1, 4):
        with pytest.raises(Picked):
            _word.run_gemv(torch.zeros(m, 256, dtype=torch.bfloat16), words, s, None, None, fmt=_word.FMT_W4,
                           group=128, n=64, k=256)
    one, four = offered
    assert {c.dense_mma for c in one} == {True, False}  # at one row the TMA kernel won on 28672x8192 (run 161)
    assert [c for c in four if not c.fold] == _word.dense_mma_w4_candidates(4, 64, 256, torch.device("cpu"))
    with pytest.raises(Picked):  # groups of 64 columns: the other kernels alone
        _word.run_gemv(torch.zeros(4, 256, dtype=torch.bfloat16), words, torch.ones(64, 4), None, None,
                       fmt=_word.FMT_W4, group=64, n=64, k=256)
    assert not any(c.dense_mma for c in offered[-1])


def test_folded_stripe_asm_multiplies_codes_minus_zero_by_x():
    """[Note: INT4 GEMV with folded rows]: lane ``4g + t`` holds word ``4t + u`` of weight row ``g`` for MMA ``u``,
    and ``B`` column ``2i + h`` row ``i`` of ``x`` over segment ``h``; slot 0 of lane ``4g + t`` is row ``t`` of ``x``
    times weight row ``g`` over the whole stripe, the other slots ``-0.0``."""
    torch.manual_seed(3)
    codes = torch.randint(0, 16, (8, 128), dtype=torch.int32)
    zero = torch.randint(0, 16, (8,), dtype=torch.int32)
    x = torch.randint(-8, 9, (4, 128)).float() / 4  # exact in bf16 and in every fp32 sum
    words = sum((codes[:, i::8] << (4 * i)) for i in range(8))  # (8, 16): nibble i of word c is column 8c + i
    asm, io = _kernels.w4_dense_fold_asm()
    assert io.count("=f") == 4 and io.count("r") == 16
    nz = pair(-(128.0 + zero).float(), -(128.0 + zero).float())
    operands = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        i, h = g // 2, g % 2
        ops = [0.0] * 4 + [int(words[g, 4 * t + u]) for u in range(4)]
        cols = [8 * (4 * t + u) + h for u in range(4)]  # B register 0: columns c + h and c + h + 4, register 1: + 2
        ops += [int(pair(x[i, c], x[i, c + 4])) for c in cols] + [int(pair(x[i, c + 2], x[i, c + 6])) for c in cols]
        ops += [int(nz[g])] * 4
        operands.append(ops)
    out = emulate(asm, operands)
    want = x @ (codes - zero[:, None]).float().T  # (rows of x, weight rows)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        assert out[lane][0] == want[t, g].item() and out[lane][1:4] == [0.0, 0.0, 0.0]


def test_folded_rows_are_offered_at_1_to_4_rows_and_refuse_bad_arguments(offered):
    words = torch.zeros(64, 32, dtype=torch.int32)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    for m in (1, 4, 5):
        with pytest.raises(Picked):
            _word.run_gemv(torch.zeros(m, 256, dtype=torch.bfloat16), words, s, None, None, fmt=_word.FMT_W4,
                           group=128, n=64, k=256)
    one, four, five = offered
    folded = _word.dense_mma_w4_fold_candidates(4, 64, 256, torch.device("cpu"))
    assert folded and all(c.dense_mma and c.fold and c.block_n == 8 * c.warps // c.k_warps for c in folded)
    along_k = [c for c in folded if c.k_warps > 1]  # [Note: warps along K]: a program covers all of this short K
    assert along_k and all(c.block_w // 16 % c.k_warps == 0 and c.split_k == 1 for c in along_k)
    late = [c for c in folded if c.late_sums]  # each config along K also with the sums added after the last block,
    # by default from shared memory; from registers where asked for
    assert late and all(c.k_warps > 1 and c.late_sums == 1 for c in late) and len(late) * 2 == len(along_k)
    both = _word.dense_mma_w4_fold_candidates(4, 64, 256, torch.device("cpu"), late=(1, 2))
    assert both == folded + [replace(c, late_sums=2) for c in late]
    assert four == _word.dense_mma_w4_candidates(4, 64, 256, torch.device("cpu")) + folded
    assert any(c.fold for c in one) and not any(c.fold for c in five)
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    run = _dense_mma.run_dense_mma_w4_fold
    with pytest.raises(ValueError, match="a power of two"):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=3, row_blocks=1, warps=4, workspace=None)
    # a run of row blocks that is not a power of two ([Note: balanced runs]) only with one slice of K and the sums
    # added a block at a time: the fix-up and the kept sums lay a run out in powers of two
    workspace = (torch.zeros(4096), torch.zeros(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="need one slice of K and the sums added a block at a time"):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=1, row_blocks=3, warps=4, workspace=workspace)
    with pytest.raises(ValueError, match="need one slice of K and the sums added a block at a time"):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=2, row_blocks=3, warps=8, k_warps=2, late_sums=1,
            workspace=None)
    with pytest.raises(ValueError, match="at most 4 rows of x"):
        run(torch.zeros(5, 256, dtype=torch.bfloat16), words, s, None, n=64, group=128, stripes_per_slice=2,
            row_blocks=1, warps=4, workspace=None)
    with pytest.raises(ValueError, match="k_warps a divisor"):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=2, row_blocks=1, warps=8, k_warps=4,
            workspace=None)
    with pytest.raises(ValueError, match="late_sums 0, 1 or 2"):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=2, row_blocks=1, warps=8, k_warps=2, late_sums=3,
            workspace=None)
    with pytest.raises(ValueError, match="workspace"):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=1, row_blocks=1, warps=4, workspace=None)


def test_a_word_of_x_gives_each_parity_its_b_registers():
    """[Note: x a word at a time]: ``X_HALVES_ASM`` with the selector of parity ``p`` turns int32 ``j`` and ``j + 2`` of
    a word of ``x`` (each a pair of bf16) into what the 2-byte gathers build: ``x[2j + p]`` low, ``x[2j + 4 + p]``
    high; ``X_LOW_ASM`` / ``X_HIGH_ASM`` the same with the selector in the instruction (PTX emulator)."""
    from zspeed.kernels._dense_mma_kernels import X_HALVES_ASM, X_HIGH_ASM, X_HIGH_HALVES, X_LOW_ASM, X_LOW_HALVES

    bits = [int(b) for b in bf16_bits(torch.randn(8, generator=torch.Generator().manual_seed(3)))]
    words = [bits[2 * j] | (bits[2 * j + 1] << 16) for j in range(4)]
    for p, sel in enumerate((X_LOW_HALVES.value, X_HIGH_HALVES.value)):
        for j in (0, 1):
            got = emulate(X_HALVES_ASM.value, [[0, words[j], words[j + 2], sel]] * 32)
            assert all(lane[0] == bits[2 * j + p] | (bits[2 * j + 4 + p] << 16) for lane in got), (p, j)
    # the constant selectors of dense_mma_w4_kernel's slots: slot j is x[j] low, x[j + 4] high
    for j in range(4):
        asm = (X_LOW_ASM, X_HIGH_ASM)[j % 2].value
        got = emulate(asm, [[0, words[j // 2], words[j // 2 + 2]]] * 32)
        assert all(lane[0] == bits[j] | (bits[j + 4] << 16) for lane in got), j


@pytest.mark.parametrize("fold", [True, False])
def test_x_is_read_a_word_at_a_time_where_every_row_starts_at_16_bytes(monkeypatch, fold):
    """[Note: x a word at a time]: both GEMV launchers ask for 16-byte reads of ``x`` where each of its rows starts at
    a multiple of 16 bytes (one row: where it starts); rows a stride of 4 values apart, or a start 2 bytes on, keep
    the gathers."""
    asked = record_launch_kwarg(monkeypatch, _dense_mma, "XVEC", ("dense_mma_w4_fold_kernel", "dense_mma_w4_kernel"),
                                ("w4_dense_fold_asm", "w4_dense_asm"))
    run = _dense_mma.run_dense_mma_w4_fold if fold else _dense_mma.run_dense_mma_w4
    words, s = torch.zeros(64, 32, dtype=torch.int32), torch.ones(64, 2, dtype=torch.bfloat16)
    rows = torch.zeros(4, 264, dtype=torch.bfloat16)
    odd = torch.zeros(3, 260, dtype=torch.bfloat16)  # rows 520 bytes apart
    assert rows.data_ptr() % 16 == 0 and odd.data_ptr() % 16 == 0
    for x in (rows[:1, :256], rows[:, :256], rows[:1, 8:], rows[:3, 8:], rows[:1, 1:257], rows[:, 1:257],
              odd[:1, :256], odd[:, :256]):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=2, row_blocks=1, warps=4, workspace=None)
    assert asked == [True, True, True, True, False, False, True, False]


@pytest.mark.parametrize("q,wk,depth,warps,zeros,group,even,partial,late,xvec", [
    (4, 1, 1, 4, True, 128, True, True, 0, True), (8, 1, 0, 4, False, 256, False, True, 0, True),
    (4, 1, 0, 4, True, 128, False, True, 0, True), (4, 8, 1, 8, True, 128, True, False, 0, True),
    (4, 4, 1, 8, False, 256, False, True, 0, True), (4, 16, 1, 16, True, 128, True, False, 1, True),
    (4, 4, 1, 4, True, 128, False, True, 2, True), (2, 16, 1, 16, False, 128, True, False, 2, True),
    (4, 1, 1, 4, True, 128, True, True, 0, False), (4, 16, 1, 16, True, 128, True, False, 1, False)])
def test_folded_rows_compile_for_hopper_to_four_mmas_a_stripe(tmp_path, q, wk, depth, warps, zeros, group, even,
                                                              partial, late, xvec):
    """[Note: INT4 GEMV with folded rows]: 4 MMAs a stripe and block (one weight row of 8 a lane, 32 columns an MMA),
    a bf16 subtraction a code pair, one 16-byte load a stripe of the lane's row for each block loaded; the unused
    sums never added; nothing spilled. A program that covers all of ``K`` (with warps along ``K``, [Note: fold warps
    along K]) has no fix-up: no atomics; with the warps' sums added after the last block (kept in shared memory or in
    registers), fewer barriers in the loop. ``x`` with ``XVEC`` ([Note: x a word at a time]): one 16-byte load a word
    of each stripe, no 2-byte gathers (those left are the scales'); without, four gathers a word."""
    const = dict(Q=q, WK=wk, DEPTH=depth, num_warps=warps, HAS_ZEROS=zeros, GROUP=group, EVEN_K=even,
                 PARTIAL=partial, FIX_K=4, ROW_BLOCKS=4, LATE=late, XVEC=xvec)
    got = compile_gemv_kernel(tmp_path, "dense_mma_w4_fold_kernel", const)
    ops = [op for op, _ in got["ops"]]
    mmas = ops.count("HMMA.16816.F32.BF16")  # a block's stripes, once or twice (ptxas may peel the last iteration),
    # or once a block (the loop unrolled whole)
    assert mmas in (4 * q, 8 * q, 4 * q * const["ROW_BLOCKS"])
    assert sum(op.startswith(("HADD2.BF16", "HFMA2.BF16")) for op in ops) == 4 * mmas
    whole = mmas == 4 * q * const["ROW_BLOCKS"] != 8 * q  # unrolled whole: each block's loads once
    assert ops.count("LDG.E.128") == q * (const["ROW_BLOCKS"] if whole else depth + 1) + (4 * q if xvec else 0)
    assert ops.count("LDG.E.U16") <= 2 * q if xvec else ops.count("LDG.E.U16") >= 16 * q
    assert not any(op == "FADD" and "-RZ" in rest for op, rest in got["ops"])
    assert got["stack"] == 0 and got["local"] == 0 and got["regs"] <= 255
    assert not any(op.startswith(("LDL", "STL")) for op in ops)
    assert any(op.startswith("ATOMG") for op in ops) == partial
    if wk > 1:  # in the loop over the blocks: the reduction's four barriers; one, before the store of the block's
        # sums to shared memory; none, the sums held in registers
        assert loop_around(got, "HMMA").count("BAR.SYNC.DEFER_BLOCKING") == {0: 4, 1: 1, 2: 0}[late]


def test_balanced_runs_spread_the_blocks_evenly_and_are_offered_where_asked_for(monkeypatch):
    """[Note: balanced runs]: for the configs that cover all of K and add their sums a block at a time, runs of
    ``cdiv(blocks, p * SMs)`` row blocks for ``p = 16 // warps`` programs an SM and twice that, where that count is not
    a power of two; offered by default while ``FOLD_BALANCED`` is on."""
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    cpu = torch.device("cpu")
    plain = _word.dense_mma_w4_fold_candidates(1, 6144, 4096, cpu, balanced=False)
    asked = _word.dense_mma_w4_fold_candidates(1, 6144, 4096, cpu, balanced=True)
    extra = asked[len(plain):]
    assert asked[:len(plain)] == plain and extra
    assert not any(c.row_blocks & (c.row_blocks - 1) for c in plain)
    assert all(c.fold and c.split_k == 1 and not c.late_sums and c.row_blocks & (c.row_blocks - 1) for c in extra)
    for c in extra:  # each is a config offered already but for its run, spread over p programs an SM
        assert any(replace(o, row_blocks=c.row_blocks) == c for o in plain)
        p = 16 // c.warps
        assert c.row_blocks in (-(-6144 // c.block_n // (p * 132)), -(-6144 // c.block_n // (2 * p * 132)))
    sixteen = [c for c in extra if c.warps == 16 and c.k_warps == 16]  # 768 blocks of 8 rows: runs of 6 and 3
    assert sorted(c.row_blocks for c in sixteen if c.block_w == 512) == [3, 6]
    monkeypatch.setattr(_word, "FOLD_BALANCED", True)
    assert _word.dense_mma_w4_fold_candidates(1, 6144, 4096, cpu) == asked
    monkeypatch.setattr(_word, "FOLD_BALANCED", False)
    assert _word.dense_mma_w4_fold_candidates(1, 6144, 4096, cpu) == plain
    head = _word.balanced_runs([replace(sixteen[0], row_blocks=32)], 128256, cpu)
    assert [c.row_blocks for c in head] == [122, 61]  # 16,032 blocks over 132 and 264 programs


@pytest.mark.parametrize("rb,wk,warps,depth", [(6, 16, 16, 1), (14, 16, 16, 1), (3, 8, 8, 1), (61, 4, 4, 0)])
def test_balanced_runs_compile_for_hopper(tmp_path, rb, wk, warps, depth):
    """[Note: balanced runs]: a run of row blocks that is not a power of two compiles for sm_90 as the others do: 4
    MMAs a stripe and block, no fix-up (one slice of K), nothing spilled, in the registers of one SM."""
    q = {16: 2, 8: 4, 4: 4}[wk]  # stripes a warp, as DENSE_MMA_FOLD_K_TILES has them
    const = dict(Q=q, WK=wk, DEPTH=depth, num_warps=warps, HAS_ZEROS=True, GROUP=128, EVEN_K=True, PARTIAL=False,
                 FIX_K=1, ROW_BLOCKS=rb, LATE=0)
    got = compile_gemv_kernel(tmp_path, "dense_mma_w4_fold_kernel", const)
    ops = [op for op, _ in got["ops"]]
    assert ops.count("HMMA.16816.F32.BF16") in (4 * q, 8 * q, 4 * q * rb)
    assert not any(op.startswith("ATOMG") for op in ops)
    assert got["stack"] == 0 and got["local"] == 0 and got["regs"] * 32 * warps <= 65536


@pytest.mark.parametrize("tile", _word.DENSE_MMA_FOLD_K_TILES)
def test_folded_rows_with_warps_along_k_fit_their_registers(tmp_path, tile):
    """[Note: fold warps along K]: each tile of the table compiles for sm_90 with nothing spilled, in the registers
    its program's warps can have on one SM (65,536 a thread block)."""
    stripes, warps, wk, depth = tile
    const = dict(Q=stripes // wk, WK=wk, DEPTH=depth, num_warps=warps, HAS_ZEROS=True, GROUP=128, EVEN_K=False,
                 PARTIAL=False, FIX_K=4, ROW_BLOCKS=4, LATE=2 if wk > 4 else 0)
    got = compile_gemv_kernel(tmp_path, "dense_mma_w4_fold_kernel", const)
    assert got["stack"] == 0 and got["local"] == 0 and got["regs"] * 32 * warps <= 65536


def test_bad_arguments_are_refused_before_launch():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    words = torch.zeros(64, 32, dtype=torch.int32)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    run = _dense_mma.run_dense_mma_w4
    with pytest.raises(ValueError, match="powers of two"):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=3, row_blocks=1, warps=4, workspace=None)
    with pytest.raises(ValueError, match="k_warps"):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=2, row_blocks=1, warps=4, k_warps=4,
            workspace=None)
    with pytest.raises(ValueError, match="multiple of 128"):
        run(x, words, torch.ones(64, 4), None, n=64, group=64, stripes_per_slice=2, row_blocks=1, warps=4,
            workspace=None)
    with pytest.raises(ValueError, match="workspace"):
        run(x, words, s, None, n=64, group=128, stripes_per_slice=1, row_blocks=1, warps=4, workspace=None)


@pytest.mark.parametrize("q,wk,nt,depth,warps,zeros,group,even,xs,xvec", [
    (4, 1, 1, 1, 4, True, 128, True, False, True), (2, 2, 2, 0, 4, False, 256, False, False, True),
    (4, 1, 2, 1, 4, True, 128, True, True, True), (4, 1, 1, 1, 4, True, 128, True, False, False)])
def test_compiles_for_hopper_to_eight_mmas_a_stripe_and_one_load_a_stripe_and_row(tmp_path, q, wk, nt, depth, warps,
                                                                                  zeros, group, even, xs, xvec):
    """Each word of ``x`` a lane reads: one 16-byte load with ``XVEC`` ([Note: x a word at a time]), two 8-byte
    loads without (per block of 8 rows of ``x``)."""
    const = dict(Q=q, WK=wk, NT=nt, DEPTH=depth, num_warps=warps, HAS_ZEROS=zeros, GROUP=group, EVEN_K=even,
                 PARTIAL=True, FIX_K=4, ROW_BLOCKS=4, XS=xs, XVEC=xvec)
    got = compile_gemv_kernel(tmp_path, "dense_mma_w4_kernel", const)
    ops = [op for op, _ in got["ops"]]
    assert ops.count("HMMA.16816.F32.BF16") == 8 * q * nt  # one row block per loop iteration
    assert sum(op.startswith(("HADD2.BF16", "HFMA2.BF16")) for op in ops) == 32 * q  # code - zero, a pair each
    # a lane's 16 bytes a stripe of rows g and g + 8, and x's 4 words a stripe (per block of 8 rows of x)
    assert ops.count("LDG.E.128") == 2 * q * (depth + 1) + (4 * q * nt if xvec else 0)
    x_pairs = ops.count("LDG.E.64") - 2 * (depth + 1) * (q == 4)  # (the scales of 4 stripes: 8 bytes a block and row)
    assert x_pairs == (0 if xvec else 8 * q * nt)
    if xs:  # a lane's B registers of a stripe and block of 8 rows of x: four 16-byte loads from shared memory, in
        # the loop; hoisted out of it, they would hold 128 registers across the loop again and break the bound below
        assert ops.count("LDS.128") == 4 * q * nt  # (one warp along K: no reduction through shared memory)
    assert got["stack"] == 0 and got["local"] == 0 and got["regs"] <= (176 if xs else 255)
    assert not any(op.startswith(("LDL", "STL")) for op in ops)


def test_w4a16_layers_of_2_to_8_rows_reach_the_gemv_path_where_it_runs(monkeypatch):
    """``_gemm.launch`` asks the policy with ``dense_mma`` set from :func:`dense_mma_w4_fits`: 2-8 bf16 rows of g128
    INT4 go to ``gemv``; fp16 rows, groups of 64 and 9 rows go to ``wdot``."""
    from zspeed.compress import quantize_int4
    from zspeed.kernels import w4a16_matmul

    monkeypatch.setattr(_dense_mma, "dense_mma_possible", lambda device: True)
    ran = []
    monkeypatch.setattr(_word, "run_gemv", lambda *a, **kw: ran.append("gemv") or a[0].new_zeros(a[0].shape[0], 64))
    monkeypatch.setattr(_word, "run_wdot", lambda *a, **kw: ran.append("wdot") or a[0].new_zeros(a[0].shape[0], 64))
    w = torch.randn(64, 256)
    for m, dtype, group in ((2, torch.bfloat16, 128), (8, torch.bfloat16, 128), (4, torch.float16, 128),
                            (4, torch.bfloat16, 64), (9, torch.bfloat16, 128)):
        q = quantize_int4(w, group_size=group)
        w4a16_matmul(torch.zeros(m, 256, dtype=dtype), q.qweight, q.scales, q.zeros, group)
    assert ran == ["gemv", "gemv", "wdot", "wdot", "wdot"]
