"""The INT4 GEMV on ``wgmma`` ([Note: INT4 GEMV on wgmma] in kernels/_stripe_wgmma_kernels.py), a Gluon kernel for
Hopper that the CPU interpreter cannot run. Here: its inline asm, run by the PTX emulator against ``(code - zero) *
scale`` rounded once to bf16; that ``x``'s column order in shared memory follows the codes' order in the fragments;
when the ``wdot`` path offers it; that bad arguments are refused; and that it compiles for sm_90 into what it exists
for (the codes' layout converts to the ``wgmma`` operand without moving data, which the compiler asserts; ``8 QI``
``wgmma`` and ``2 QI`` 16-byte loads a chunk, nothing spilled). Its values are checked on the GPU against the
reference, every config on NaN-filled output (``benchmarks/gemv_check.py --ms 16 --kinds wdot wgmma``;
benchmarks/RESULTS.md, kernels session 33)."""
from __future__ import annotations

import pytest
import torch

from tests.gemv_kernels import Picked, compile_gemv_kernel, loop_around, record_offers
from tests.ptx_emulator import emulate, pair, unpair
from zspeed.kernels import _stripe_wgmma, _word

_kernels = pytest.importorskip("zspeed.kernels._stripe_wgmma_kernels", reason="this triton has no Gluon")


def test_asm_dequantizes_a_word_into_its_four_code_pairs_rounded_once():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (32, 8), dtype=torch.int32)  # lane, nibble
    zero = torch.randint(0, 16, (32,), dtype=torch.int32)
    scale = (torch.rand(32) * 0.1 + 0.001).to(torch.bfloat16)
    words = sum(codes[:, i] << (4 * i) for i in range(8))
    asm, io = _kernels.stripe_wgmma_asm()
    assert io.count("=r") == 4 and io.count("r") == 4 + 24
    nz = pair(-(128.0 + zero).float(), -(128.0 + zero).float())
    sc = pair(scale, scale)
    operands = [[0] * 4 + [int(words[lane])] * 8 + [int(nz[lane])] * 8 + [int(sc[lane])] * 8 for lane in range(32)]
    out = emulate(asm, operands)
    want = ((codes - zero[:, None]).float() * scale.float()[:, None]).to(torch.bfloat16).float()  # the reference
    for lane in range(32):
        for p in range(4):  # pair p: nibbles p (low half) and p + 4
            assert unpair(int(out[lane][p]) & 0xFFFFFFFF) == (want[lane, p].item(), want[lane, p + 4].item())


@pytest.mark.parametrize("qi", [1, 2])
def test_x_in_shared_memory_follows_the_codes_in_the_fragments(qi):
    """The kernel's two permutations as plain tensors: the codes as the asm leaves them, ``(rows, stripe, t, u, i2,
    i1, i0)`` (code ``2 i2 + i1 + 4 i0`` of word ``4t + u``), permuted by ``CODE_ORDER``, times ``x`` loaded in its
    own order ``(rows, stripe, t, u, i0, i2, i1)`` and permuted by ``X_ORDER``, is the dequantized product."""
    torch.manual_seed(qi)
    rows, k = 16, 128 * qi
    w = torch.randn(rows, k)
    x = torch.randn(16, k)
    code = torch.tensor([[[0, 4], [1, 5]], [[2, 6], [3, 7]]])  # (i2, i1, i0) -> code 2 i2 + i1 + 4 i0
    col = (128 * torch.arange(qi)[:, None, None, None, None, None] + 8 * (4 * torch.arange(4)[:, None, None, None, None]
           + torch.arange(4)[:, None, None, None]) + code)  # (stripe, t, u, i2, i1, i0)
    a = w[:, col].permute(*_kernels.CODE_ORDER.value).reshape(rows, k)
    b = x.reshape(16, qi, 4, 4, 2, 2, 2).permute(*_kernels.X_ORDER.value).reshape(16, k)
    torch.testing.assert_close(a @ b.T, w @ x.T, rtol=1e-5, atol=1e-4)


def test_fits_9_to_16_bf16_rows_bf16_scales_and_groups_of_128_columns(monkeypatch):
    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    words = torch.zeros(64, 32, dtype=torch.int32)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    z = torch.zeros(64, 2, dtype=torch.uint8)
    fits = _stripe_wgmma.stripe_wgmma_fits
    assert not fits(x, words, s, z, group=128)  # the CPU: no Hopper GPU to run it
    monkeypatch.setattr(_stripe_wgmma, "stripe_wgmma_possible", lambda device: True)
    assert fits(x, words, s, z, group=128) and fits(x[:9], words, s, None, group=128)
    assert fits(x, words, s[:, :1], z[:, :1], group=256)
    assert not fits(x[:8], words, s, z, group=128)  # 1-8 rows: the GEMV on mma.sync
    assert not fits(torch.zeros(17, 256, dtype=torch.bfloat16), words, s, z, group=128)
    assert not fits(x.half(), words, s, z, group=128)
    assert not fits(x, words, s.float(), z, group=128)  # the weight is rounded once, in bf16
    assert not fits(x, words, torch.ones(64, 4, dtype=torch.bfloat16), z, group=64)  # a stripe is one group
    assert not fits(torch.zeros(16, 192, dtype=torch.bfloat16), words[:, :24], s, z, group=128)  # whole stripes
    assert not fits(x, torch.zeros(64, 33, dtype=torch.int32)[:, 1:], s, z, group=128)  # 16-byte rows
    assert not fits(x, words, s, z.to(torch.int32), group=128)


def test_candidates_fill_the_gpu_in_whole_chunks_within_shared_memory_and_the_workspace(monkeypatch):
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for n, k in ((8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096), (96, 384)):
        got = _word.stripe_wgmma_candidates(16, n, k, gpu)
        assert got, (n, k)
        for c in got:
            q = c.block_w // 16
            assert c.wgmma_chunk == 2 and q % c.wgmma_chunk == 0 and c.block_n == 16 * c.warps
            assert 16 * 128 * q * 2 <= _stripe_wgmma.MAX_X_BYTES and c.split_k == -(-(k // 128) // q)
            assert c.split_k <= _word.STRIPE_WGMMA_MAX_SPLIT
            assert c.split_k == 1 or 16 * c.split_k * n <= _word.STATIONARY_WORKSPACE
            programs = c.split_k * -(-n // (c.block_n * c.row_blocks))
            assert 132 <= programs <= 16 * 132 or c.row_blocks == 1  # a wave and at most 16, or the most there are
    # the fastest configs of kernels session 33 are among them
    found = {(c.warps, c.block_w // 16, c.row_blocks) for c in _word.stripe_wgmma_candidates(16, 28672, 8192, gpu)}
    assert (8, 8, 8) in found


@pytest.fixture
def offered(monkeypatch) -> list:
    """The candidate lists that ``_word.run_wdot`` hands its tuner, on a stand-in H100 where the kernel runs."""
    return record_offers(monkeypatch, _stripe_wgmma, "stripe_wgmma_possible")


def test_wdot_tunes_it_beside_its_tiled_kernels_at_9_to_16_rows_only(offered):
    words = torch.zeros(64, 32, dtype=torch.int32)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    for m in (8, 9, 16, 17):
        with pytest.raises(Picked):
            _word.run_wdot(torch.zeros(m, 256, dtype=torch.bfloat16), words, s, None, None, fmt=_word.FMT_W4,
                           group=128, n=64, k=256)
    with pytest.raises(Picked):  # INT8: the tiled kernels alone
        _word.run_wdot(torch.zeros(16, 256, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.int32),
                       torch.ones(64, dtype=torch.bfloat16), None, None, fmt=_word.FMT_W8, group=0, n=64, k=256)
    eight, nine, sixteen, seventeen, int8 = ([c.wgmma_chunk > 0 for c in got] for got in offered)
    assert not any(eight) and not any(seventeen) and not any(int8)
    assert any(nine) and not all(nine) and any(sixteen) and not all(sixteen)
    assert [c for c in offered[2] if c.wgmma_chunk] == _word.stripe_wgmma_candidates(16, 64, 256, torch.device("cpu"))


def test_bad_arguments_are_refused_before_launch():
    x = torch.zeros(12, 256, dtype=torch.bfloat16)
    words = torch.zeros(64, 32, dtype=torch.int32)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    run = _stripe_wgmma.run_stripe_wgmma_w4
    with pytest.raises(ValueError, match="chunk_stripes"):
        run(x, words, s, None, n=64, group=128, chunk_stripes=4, chunks=1, row_blocks=1, warps=4, workspace=None)
    with pytest.raises(ValueError, match="warps 4 or 8"):
        run(x, words, s, None, n=64, group=128, chunk_stripes=2, chunks=1, row_blocks=1, warps=2, workspace=None)
    with pytest.raises(ValueError, match="shared memory"):
        run(x, words, s, None, n=64, group=128, chunk_stripes=2, chunks=32, row_blocks=1, warps=4, workspace=None)
    with pytest.raises(ValueError, match="at most 16 rows"):
        run(torch.zeros(17, 256, dtype=torch.bfloat16), words, s, None, n=64, group=128, chunk_stripes=2, chunks=1,
            row_blocks=1, warps=4, workspace=None)
    with pytest.raises(ValueError, match="workspace"):  # two slices of K
        run(x, words, s, None, n=64, group=128, chunk_stripes=1, chunks=1, row_blocks=1, warps=4, workspace=None)


@pytest.mark.parametrize("qi,qc,warps,zeros,group,even,partial", [(2, 4, 4, True, 128, True, True),
                                                                  (1, 2, 4, False, 256, False, True),
                                                                  (2, 2, 8, True, 128, True, False)])
def test_compiles_for_hopper_to_the_wgmma_on_the_loaded_codes(tmp_path, qi, qc, warps, zeros, group, even, partial):
    const = dict(QI=qi, QC=qc, num_warps=warps, HAS_ZEROS=zeros, GROUP=group, EVEN_K=even, PARTIAL=partial, FIX_K=4,
                 ROW_BLOCKS=4)
    got = compile_gemv_kernel(tmp_path, "stripe_wgmma_w4_kernel", const)
    loop = loop_around(got, "HGMMA")
    assert sum(op.startswith("HGMMA") for op in loop) == 8 * qi  # a chunk's m64n16k16, then one retire
    assert loop.count("LDG.E.128") == 2 * qi  # the next chunk's words: 16 bytes a stripe of rows g and g + 8
    assert sum(op.startswith("HMUL2.BF16") for op in loop) == 32 * qi  # one rounding a code pair (8 words a stripe)
    # the codes reach the wgmma's operand where they were loaded: no shuffle, no trip through shared memory
    assert not any(op.startswith(("SHFL", "STS", "LDS")) for op in loop)
    assert got["stack"] == 0 and got["local"] == 0 and not any(op.startswith(("LDL", "STL")) for op, _ in got["ops"])
    if qi == 2 and warps == 4:  # four programs an SM (kernels session 33: 128 registers)
        assert got["regs"] <= 128
