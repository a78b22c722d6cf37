"""The 2:4 GEMV and GEMM on sparse tensor cores ([Note: 2:4 GEMV on sparse tensor cores] in
kernels/_sparse_mma_kernels.py, [Note: 2:4 GEMM on sparse tensor cores] in kernels/_sparse_gemm_kernels.py), Gluon
kernels around inline ``mma.sp`` that the CPU interpreter cannot run. Here: when they are offered and chosen, that
bad arguments are refused, and that they compile for sm_90 into what they exist for: one sparse MMA per 32-column
tile (and group of 8 rows of x), the two selectors of a shared metadata register, weight words read in 8-byte pairs
(16-byte vectors in stripes), x read from shared memory in whole fragments, nothing spilled. Their values are checked
on the GPU, bit for bit on integer data (``benchmarks/sparse_mma_check.py``) and against the reference at full size (``benchmarks/gemv_check.py
--formats s24 s24w4 --kinds mma mma_stripe mma_fold``; benchmarks/RESULTS.md, kernels runs 66-69, 141-142, 172-174
and 176-182)."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.gemv_kernels import Picked, compile_gemv_kernel, loop_around, record_launch_kwarg, record_offers
from zspeed.kernels import KernelPolicy, _sparse_mma, _word


def test_candidates_split_k_into_even_tiles_that_fit_the_workspace(monkeypatch):
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for m, n, k in ((1, 8192, 8192), (4, 28672, 8192), (8, 8192, 28672), (1, 100, 96), (1, 100, 384)):
        got = _word.sparse_mma_candidates(m, n, k, gpu)
        assert got and all(c.sparse_mma and c.row_blocks & (c.row_blocks - 1) == 0 for c in got)
        for c in got:
            tiles = c.block_w // 8
            assert tiles % 2 == 0 and c.block_n == 16 * c.warps and c.prefetch in (0, 1, 2)
            assert tiles & (tiles - 1) == 0  # a power of two of tiles: the layouts' pairs and stripes
            assert c.split_k == -(-(k // 32) // tiles)
            assert c.split_k == 1 or m * c.split_k * n <= _word.STATIONARY_WORKSPACE
    # a wave of programs where the shape allows one
    assert all(c.split_k * -(-8192 // (c.block_n * c.row_blocks)) >= 132
               for c in _word.sparse_mma_candidates(1, 8192, 8192, gpu))
    # 8 rows x 56 or more slices x 28672 outputs would overrun the workspace: nothing is offered (other kernels run);
    # one row fits
    assert not _word.sparse_mma_candidates(8, 28672, 28672, gpu)
    assert _word.sparse_mma_candidates(1, 28672, 28672, gpu)


def test_fits_bf16_x_of_1_to_8_rows_and_aligned_operands(monkeypatch):
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    words = torch.zeros(64, 64, dtype=torch.int32)
    meta = torch.zeros(64, 32, dtype=torch.uint8)
    assert not _sparse_mma.sparse_mma_fits(x, words, meta)  # the CPU: no GPU to run it
    monkeypatch.setattr(_sparse_mma, "sparse_mma_possible", lambda device: True)
    assert _sparse_mma.sparse_mma_fits(x, words, meta)
    assert _sparse_mma.sparse_mma_fits(x[:1], words, meta)
    assert _sparse_mma.sparse_mma_fits(torch.zeros(8, 256, dtype=torch.bfloat16), words, meta)
    assert not _sparse_mma.sparse_mma_fits(torch.zeros(9, 256, dtype=torch.bfloat16), words, meta)  # the MMA's N is 8
    assert not _sparse_mma.sparse_mma_fits(x.half(), words, meta)
    assert not _sparse_mma.sparse_mma_fits(x, words, None)
    assert not _sparse_mma.sparse_mma_fits(torch.zeros(4, 240, dtype=torch.bfloat16), words[:, :60], meta[:, :30])
    assert not _sparse_mma.sparse_mma_fits(x, words, torch.zeros(64, 33, dtype=torch.uint8)[:, 1:])  # 1 byte in


def test_stripes_fit_whole_stripes_of_aligned_operands(monkeypatch):
    """[Note: 2:4 stripes]: what the tile-wise kernel takes, with K a multiple of the stripe and the rows of values and
    positions aligned for the vector loads (16-byte values a lane, the stripe's positions of a row)."""
    monkeypatch.setattr(_sparse_mma, "sparse_mma_possible", lambda device: True)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    words = torch.zeros(64, 64, dtype=torch.int32)
    meta = torch.zeros(64, 32, dtype=torch.uint8)
    assert all(_sparse_mma.sparse_mma_stripe_fits(x, words, meta, stripe) for stripe in (2, 4))
    x192 = torch.zeros(1, 192, dtype=torch.bfloat16)  # 6 tiles: stripes of 2, not of 4
    assert _sparse_mma.sparse_mma_stripe_fits(x192, words[:, :48], meta[:, :24], 2)
    assert not _sparse_mma.sparse_mma_stripe_fits(x192, words[:, :48], meta[:, :24], 4)
    odd = torch.zeros(64, 66, dtype=torch.int32)[:, :64]  # rows 264 bytes apart: not 16-byte aligned
    assert _sparse_mma.sparse_mma_fits(x, odd, meta) and not _sparse_mma.sparse_mma_stripe_fits(x, odd, meta, 4)
    shifted = torch.zeros(64, 36, dtype=torch.uint8)[:, 4:]  # positions 4 bytes in: fine tile-wise, not as vectors
    assert _sparse_mma.sparse_mma_fits(x, words, shifted)
    assert not _sparse_mma.sparse_mma_stripe_fits(x, words, shifted, 4)
    assert not _sparse_mma.sparse_mma_stripe_fits(x, words, None, 4)


def test_stripe_candidates_hold_whole_stripes_and_one_block_ahead_at_most(monkeypatch):
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for m, n, k in ((1, 8192, 8192), (4, 28672, 8192), (8, 8192, 28672), (1, 100, 384)):
        got = _word.sparse_mma_stripe_candidates(m, n, k, gpu)
        assert got and all(c.sparse_mma and c.stripe in (2, 4) and c.prefetch in (0, 1) for c in got)
        assert all((c.block_w // 8) % c.stripe == 0 for c in got)
        assert {c.stripe for c in got} == {2, 4}
        plain = _word.sparse_mma_candidates(m, n, k, gpu)
        assert not set(got) & set(plain) and all(c.stripe == 0 for c in plain)


def test_folded_rows_fit_1_to_4_rows_whole_mmas_and_aligned_operands(monkeypatch):
    """[Note: 2:4 folded rows]: what the tile-wise kernel takes, with at most 4 rows of x (two of the MMA's 8 columns
    a row), K a multiple of 64 (one MMA) and the rows of values and positions aligned for a lane's 16-byte quad and an
    MMA's 8 bytes of positions."""
    monkeypatch.setattr(_sparse_mma, "sparse_mma_possible", lambda device: True)
    words = torch.zeros(64, 64, dtype=torch.int32)
    meta = torch.zeros(64, 32, dtype=torch.uint8)
    for m in (1, 4):
        assert _sparse_mma.sparse_mma_fold_fits(torch.zeros(m, 256, dtype=torch.bfloat16), words, meta)
    x5 = torch.zeros(5, 256, dtype=torch.bfloat16)
    assert _sparse_mma.sparse_mma_fits(x5, words, meta) and not _sparse_mma.sparse_mma_fold_fits(x5, words, meta)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    x192, x224 = torch.zeros(1, 192, dtype=torch.bfloat16), torch.zeros(1, 224, dtype=torch.bfloat16)
    assert _sparse_mma.sparse_mma_fold_fits(x192, words[:, :48], meta[:, :24])  # 3 MMAs
    assert _sparse_mma.sparse_mma_fits(x224, words[:, :56], meta[:, :28])  # 7 tiles: half an MMA left over
    assert not _sparse_mma.sparse_mma_fold_fits(x224, words[:, :56], meta[:, :28])
    odd = torch.zeros(64, 66, dtype=torch.int32)[:, :64]  # rows 264 bytes apart: quads not 16-byte aligned
    assert _sparse_mma.sparse_mma_fits(x, odd, meta) and not _sparse_mma.sparse_mma_fold_fits(x, odd, meta)
    shifted = torch.zeros(64, 36, dtype=torch.uint8)[:, 4:]  # positions 4 bytes in: not 8-byte loads
    assert _sparse_mma.sparse_mma_fits(x, words, shifted) and not _sparse_mma.sparse_mma_fold_fits(x, words, shifted)
    assert not _sparse_mma.sparse_mma_fold_fits(x, words, None)


def test_folded_row_candidates_take_blocks_of_8_rows_a_warp_and_whole_pairs_of_mmas(monkeypatch):
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for m, n, k in ((1, 8192, 8192), (4, 28672, 8192), (1, 8192, 28672), (1, 100, 384), (2, 64, 128)):
        got = _word.sparse_mma_fold_candidates(m, n, k, gpu)
        assert got and all(c.sparse_mma and c.fold and not c.stripe for c in got)
        for c in got:
            tiles = c.block_w // 8
            assert tiles >= 4 and tiles & (tiles - 1) == 0 and c.block_n == 8 * c.warps and c.prefetch in (0, 1, 2)
            assert c.split_k == -(-(k // 32) // tiles)
            assert c.split_k == 1 or m * c.split_k * n <= _word.STATIONARY_WORKSPACE
        assert not set(got) & set(_word.sparse_mma_candidates(m, n, k, gpu) + _word.sparse_mma_stripe_candidates(
            m, n, k, gpu))
    # a wave of programs where the shape allows one; the sweep's pick (32 tiles, 4 warps, one block ahead) offered
    big = _word.sparse_mma_fold_candidates(1, 8192, 8192, gpu)
    assert all(c.split_k * -(-8192 // (c.block_n * c.row_blocks)) >= 132 for c in big)
    assert any(c.block_w == 256 and c.warps == 4 and c.prefetch == 1 for c in big)


def test_folded_rows_refuse_bad_arguments():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    words, meta = torch.zeros(64, 64, dtype=torch.int32), torch.zeros(64, 32, dtype=torch.uint8)
    kw = dict(n=64, row_blocks=1, warps=4, workspace=None)
    with pytest.raises(ValueError, match="depth must be 0, 1 or 2"):
        _sparse_mma.run_sparse_mma_fold(x, words, meta, tiles_per_slice=8, depth=3, **kw)
    with pytest.raises(ValueError, match="at least 4"):
        _sparse_mma.run_sparse_mma_fold(x, words, meta, tiles_per_slice=2, **kw)
    with pytest.raises(ValueError, match="at most 4 rows of x"):
        _sparse_mma.run_sparse_mma_fold(torch.zeros(5, 256, dtype=torch.bfloat16), words, meta, tiles_per_slice=8,
                                        **kw)
    with pytest.raises(ValueError, match="power of two"):
        _sparse_mma.run_sparse_mma_fold(x, words, meta, tiles_per_slice=12, **kw)


def test_fits_2_4_int4_with_groups_of_64_columns_and_int16_metadata(monkeypatch):
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    codes = torch.zeros(64, 16, dtype=torch.int32)  # (N, K / 4) bytes as int32 words
    meta = torch.zeros(64, 16, dtype=torch.int16)  # (N, K / 8) bytes as int16, as the gemv path views them
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    assert not _sparse_mma.sparse_mma_w4_fits(x, codes, meta, s, None, group=128)  # the CPU
    monkeypatch.setattr(_sparse_mma, "sparse_mma_possible", lambda device: True)
    assert _sparse_mma.sparse_mma_w4_fits(x, codes, meta, s, None, group=128)
    assert _sparse_mma.sparse_mma_w4_fits(x, codes, meta, s, torch.zeros(64, 2, dtype=torch.uint8), group=128)
    assert not _sparse_mma.sparse_mma_w4_fits(x, codes, meta, s, torch.zeros(64, 2), group=128)  # zeros not uint8
    assert not _sparse_mma.sparse_mma_w4_fits(x, codes, meta, s, None, group=32)  # a pair of tiles spans groups
    assert not _sparse_mma.sparse_mma_w4_fits(x, codes, meta.view(torch.uint8), s, None, group=128)
    assert not _sparse_mma.sparse_mma_w4_fits(torch.zeros(9, 256, dtype=torch.bfloat16), codes, meta, s, None,
                                              group=128)
    # stripes of 4 tiles for groups of 128 columns: K a multiple of 128, rows of codes in 8-byte and of positions
    # in 16-byte steps; groups of 64 take stripes of 2
    x192, codes192, meta192 = torch.zeros(4, 192, dtype=torch.bfloat16), codes[:, :12], meta[:, :12]
    assert not _sparse_mma.sparse_mma_w4_fits(x192, codes192, meta192, s, None, group=128)
    assert _sparse_mma.sparse_mma_w4_fits(x192, codes192, meta192, s, None, group=64)
    assert not _sparse_mma.sparse_mma_w4_fits(x, torch.zeros(64, 17, dtype=torch.int32)[:, 1:], meta, s, None,
                                              group=128)  # 4 bytes in: no 8-byte loads
    assert not _sparse_mma.sparse_mma_w4_fits(x, codes, torch.zeros(64, 20, dtype=torch.int16)[:, :16], s, None,
                                              group=128)  # rows of positions 40 bytes apart
    assert _sparse_mma.w4_stripe(128) == _sparse_mma.w4_stripe(256) == 4 and _sparse_mma.w4_stripe(64) == 2


def test_2_4_int4_with_folded_rows_fits_groups_of_128_columns_and_1_to_4_rows(monkeypatch):
    monkeypatch.setattr(_sparse_mma, "sparse_mma_possible", lambda device: True)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    codes = torch.zeros(64, 16, dtype=torch.int32)
    meta = torch.zeros(64, 16, dtype=torch.int16)
    s, s64 = torch.ones(64, 2, dtype=torch.bfloat16), torch.ones(64, 4, dtype=torch.bfloat16)
    assert _sparse_mma.sparse_mma_w4_fold_fits(x, codes, meta, s, None, group=128)
    assert _sparse_mma.sparse_mma_w4_fold_fits(x[:1], codes, meta, s, torch.zeros(64, 2, dtype=torch.uint8), group=128)
    x5 = torch.zeros(5, 256, dtype=torch.bfloat16)
    assert _sparse_mma.sparse_mma_w4_fits(x5, codes, meta, s, None, group=128)
    assert not _sparse_mma.sparse_mma_w4_fold_fits(x5, codes, meta, s, None, group=128)
    assert _sparse_mma.sparse_mma_w4_fits(x, codes, meta, s64, None, group=64)  # stripes of 2 tiles
    assert not _sparse_mma.sparse_mma_w4_fold_fits(x, codes, meta, s64, None, group=64)  # a pair spans two groups
    x192 = torch.zeros(1, 192, dtype=torch.bfloat16)  # 1.5 pairs
    assert not _sparse_mma.sparse_mma_w4_fold_fits(x192, codes[:, :12], meta[:, :12], s64[:, :3], None, group=64)
    with pytest.raises(ValueError, match="at most 4 rows of x"):
        _sparse_mma.run_sparse_mma_w4_fold(x5, codes, meta, s, None, n=64, group=128, tiles_per_slice=8,
                                           row_blocks=1, warps=4, workspace=None)
    with pytest.raises(ValueError, match="groups of a multiple of 128"):
        _sparse_mma.run_sparse_mma_w4_fold(x, codes, meta, s64, None, n=64, group=64, tiles_per_slice=8,
                                           row_blocks=1, warps=4, workspace=None)
    with pytest.raises(ValueError, match="depth must be 0 or 1"):
        _sparse_mma.run_sparse_mma_w4_fold(x, codes, meta, s, None, n=64, group=128, tiles_per_slice=8,
                                           row_blocks=1, warps=4, depth=2, workspace=None)
    with pytest.raises(ValueError, match="a warp along K"):
        _sparse_mma.run_sparse_mma_w4_fold(x, codes, meta, s, None, n=64, group=128, tiles_per_slice=8,
                                           row_blocks=1, warps=4, k_warps=4, workspace=None)
    with pytest.raises(ValueError, match="late_sums 0, 1 or 2"):
        _sparse_mma.run_sparse_mma_w4_fold(x, codes, meta, s, None, n=64, group=128, tiles_per_slice=8,
                                           row_blocks=1, warps=4, k_warps=2, late_sums=3, workspace=None)
    got = _word.sparse_mma_w4_fold_candidates(1, 8192, 8192, torch.device("cuda", 0))
    assert got and all(c.fold and c.block_n == 8 * c.warps // c.k_warps and c.block_w // 8 >= 4 * c.k_warps
                       for c in got)
    assert any(c.k_warps > 1 and c.split_k == 1 for c in got)  # a program over all of K ([Note: fold warps along K])
    along_k = [c for c in got if c.k_warps > 1 and not c.late_sums]  # each also with the warps' sums added late,
    # by default from shared memory; from registers too where asked for
    assert along_k and [c for c in got if c.late_sums] == [replace(c, late_sums=1) for c in along_k]
    both = _word.sparse_mma_w4_fold_candidates(1, 8192, 8192, torch.device("cuda", 0), late=(1, 2))
    assert both == got + [replace(c, late_sums=2) for c in along_k]


def test_2_4_int4_slices_must_hold_whole_stripes():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    codes, meta = torch.zeros(64, 16, dtype=torch.int32), torch.zeros(64, 16, dtype=torch.int16)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of the stripe"):
        _sparse_mma.run_sparse_mma_w4(x, codes, meta, s, None, n=64, group=128, tiles_per_slice=2, row_blocks=1,
                                      warps=4, workspace=None)
    with pytest.raises(ValueError, match="depth must be 0 or 1"):
        _sparse_mma.run_sparse_mma_w4(x, codes, meta, s, None, n=64, group=128, tiles_per_slice=8, row_blocks=1,
                                      warps=4, depth=2, workspace=None)


def test_policy_keeps_2_4_on_gemv_up_to_64_rows_only_where_it_runs():
    policy = KernelPolicy()
    for m in (2, 4, 8):
        assert policy.path("sparse24", m, sparse_mma=True) == "gemv"
        assert policy.path("sparse24_w4a16", m, sparse_mma=True) == "gemv"
        assert policy.path("sparse24", m, sparse_mma=False) == "splitk"
        assert policy.path("w4a16", m, sparse_mma=True) == "wdot"  # other formats: unchanged
    for m in (9, 16, 32, 64):  # the 2:4 GEMM
        assert policy.path("sparse24", m, sparse_mma=True) == "gemv"
        assert policy.path("sparse24_w4a16", m, sparse_mma=True) == "gemv"
    assert policy.path("sparse24", 65, sparse_mma=True) == "tiled"  # the GEMM's cost grows with the rows
    assert policy.path("sparse24_w4a16", 128, sparse_mma=True) == "dense"
    assert policy.path("sparse24", 4, words=False, sparse_mma=True) == "splitk"
    assert KernelPolicy(sparse_gemv_max_m=1, sparse_gemm_max_m=1).path("sparse24", 4, sparse_mma=True) == "splitk"
    assert KernelPolicy(sparse_gemm_max_m=8).path("sparse24", 9, sparse_mma=True) == "splitk"


@pytest.fixture
def offered(monkeypatch) -> list:
    """The candidate lists that ``_word.run_gemv`` hands its tuner, on a stand-in H100 where the sparse tensor-core
    kernels run."""
    return record_offers(monkeypatch, _sparse_mma, "sparse_mma_possible")


def test_gemv_tunes_plain_2_4_on_sparse_tensor_cores_alone_and_2_4_int4_beside_the_others(offered):
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    meta = torch.zeros(64, 32, dtype=torch.uint8)
    values = torch.zeros(64, 128, dtype=torch.bfloat16)
    words, m = _word.word_view(_word.FMT_S24, values, meta, 256)
    with pytest.raises(Picked):
        _word.run_gemv(x, words, values, None, m, fmt=_word.FMT_S24, group=1, n=64, k=256)
    assert offered[-1] and all(c.sparse_mma for c in offered[-1])
    # every layout: folded rows won at 1-4 rows (kernels runs 176-178), the tile-wise kernel at 8 rows on 8192x8192
    assert {c.stripe for c in offered[-1]} == {0, 2, 4} and {c.fold for c in offered[-1]} == {False, True}
    x5 = torch.zeros(5, 256, dtype=torch.bfloat16)  # folded rows take at most 4 rows of x
    with pytest.raises(Picked):
        _word.run_gemv(x5, words, values, None, m, fmt=_word.FMT_S24, group=1, n=64, k=256)
    assert offered[-1] and not any(c.fold for c in offered[-1])
    codes = torch.zeros(64, 64, dtype=torch.uint8)
    words, m = _word.word_view(_word.FMT_S24W4, codes, meta, 256)
    scales = torch.ones(64, 2, dtype=torch.bfloat16)
    with pytest.raises(Picked):
        _word.run_gemv(x, words, scales, None, m, fmt=_word.FMT_S24W4, group=128, n=64, k=256)
    kinds = {c.sparse_mma for c in offered[-1]}
    assert kinds == {True, False}  # at one row the x-stationary kernel won (kernels run 77): it stays a candidate
    mma = [c for c in offered[-1] if c.sparse_mma and not c.fold]
    assert mma == _word.sparse_mma_w4_candidates(1, 64, 256, 128, x.device)  # at most one block ahead, whole stripes
    assert all(c.prefetch in (0, 1) and (c.block_w // 8) % 4 == 0 for c in mma) and {c.prefetch for c in mma} == {0, 1}
    # folded rows too (kernels run 182: ahead at 1 and 4 rows on every shape)
    assert [c for c in offered[-1] if c.fold] == _word.sparse_mma_w4_fold_candidates(1, 64, 256, x.device)
    with pytest.raises(Picked):  # groups of 64 columns: a pair of MMAs would span two groups
        _word.run_gemv(x, words, torch.ones(64, 4, dtype=torch.bfloat16), None, m, fmt=_word.FMT_S24W4, group=64,
                       n=64, k=256)
    assert any(c.sparse_mma for c in offered[-1]) and not any(c.fold for c in offered[-1])


def test_gemm_candidates_cover_the_rows_in_groups_of_8_and_fit_the_workspace(monkeypatch):
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for m, n, k in ((9, 8192, 8192), (16, 28672, 8192), (32, 8192, 28672), (64, 8192, 8192), (130, 1000, 1056)):
        got = _word.sparse_gemm_candidates(m, n, k, gpu)
        groups = min(8, 1 << (-(-m // 8) - 1).bit_length())
        assert got and all(c.sparse_mma and c.block_m == 8 * groups and c.block_n in (16 * c.warps, 32 * c.warps)
                           for c in got)
        assert len(set(got)) == len(got)
        for c in got:
            tiles, blocks = c.block_w // 8, c.block_n // (16 * c.warps)
            assert (tiles, c.warps, c.prefetch, blocks) in _word.SPARSE_GEMM_TILES[max(2, groups)] and tiles % 2 == 0
            assert c.split_k == 1 or m * c.split_k * n <= _word.STATIONARY_WORKSPACE
            assert -(-m // c.block_m) * -(-n // c.block_n) <= _word.WORKSPACE_COUNTERS
    # the slice counts start at the first that gives a wave of programs
    got = _word.sparse_gemm_candidates(16, 8192, 8192, gpu)
    assert min(c.split_k * -(-8192 // c.block_n) for c in got) >= 132


def test_gemm_fits_any_rows_with_the_gemv_operands(monkeypatch):
    words = torch.zeros(64, 64, dtype=torch.int32)
    meta = torch.zeros(64, 32, dtype=torch.uint8)
    x = torch.zeros(40, 256, dtype=torch.bfloat16)
    assert not _sparse_mma.sparse_gemm_fits(x, words, meta)  # the CPU
    monkeypatch.setattr(_sparse_mma, "sparse_mma_possible", lambda device: True)
    assert _sparse_mma.sparse_gemm_fits(x, words, meta) and _sparse_mma.sparse_gemm_fits(x[:9], words, meta)
    assert not _sparse_mma.sparse_gemm_fits(x.half(), words, meta)
    assert not _sparse_mma.sparse_gemm_fits(x, words, None)
    codes = torch.zeros(64, 16, dtype=torch.int32)
    meta16 = torch.zeros(64, 16, dtype=torch.int16)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    assert _sparse_mma.sparse_gemm_fits(x, codes, meta16, w4=True, s=s, group=128)
    assert not _sparse_mma.sparse_gemm_fits(x, codes, meta16, w4=True, s=None, group=128)  # no scales
    assert not _sparse_mma.sparse_gemm_fits(x, codes, meta16, w4=True, s=s.half(), group=128)  # weights made in bf16
    assert not _sparse_mma.sparse_gemm_fits(x, codes, meta16, w4=True, s=s, group=32)


def test_gemv_path_tunes_the_2_4_gemm_alone_from_9_rows(offered):
    meta = torch.zeros(64, 32, dtype=torch.uint8)
    values = torch.zeros(64, 128, dtype=torch.bfloat16)
    words, m = _word.word_view(_word.FMT_S24, values, meta, 256)
    for rows in (9, 24):
        with pytest.raises(Picked):
            _word.run_gemv(torch.zeros(rows, 256, dtype=torch.bfloat16), words, values, None, m, fmt=_word.FMT_S24,
                           group=1, n=64, k=256)
        assert offered[-1] and all(c.sparse_mma and c.block_m >= 16 for c in offered[-1])
    codes = torch.zeros(64, 64, dtype=torch.uint8)
    words, m = _word.word_view(_word.FMT_S24W4, codes, meta, 256)
    with pytest.raises(Picked):
        _word.run_gemv(torch.zeros(12, 256, dtype=torch.bfloat16), words, torch.ones(64, 2, dtype=torch.bfloat16),
                       None, m, fmt=_word.FMT_S24W4, group=128, n=64, k=256)
    assert offered[-1] and all(c.sparse_mma and c.block_m == 16 for c in offered[-1])
    # 2:4 + INT4 in groups of 128 columns: chunks of whole stripes of 4 tiles ([Note: INT4 stripes])
    assert all((c.block_w // 8) % 4 == 0 for c in offered[-1])
    assert offered[-1] == _word.sparse_gemm_candidates(12, 64, 256, torch.device("cpu"), 4)


def test_bad_gemm_arguments_are_refused_before_launch():
    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    words = torch.zeros(64, 64, dtype=torch.int32)
    meta = torch.zeros(64, 32, dtype=torch.uint8)
    ws = (torch.zeros(16 * 2 * 64), torch.zeros(8, dtype=torch.int32))
    args = dict(n=64, tiles_per_chunk=2, groups=2, split=1, warps=4, workspace=None)
    with pytest.raises(ValueError, match="even"):
        _sparse_mma.run_sparse_gemm(x, words, meta, **{**args, "tiles_per_chunk": 3})
    with pytest.raises(ValueError, match="groups"):
        _sparse_mma.run_sparse_gemm(x, words, meta, **{**args, "groups": 3})
    with pytest.raises(ValueError, match="blocks"):
        _sparse_mma.run_sparse_gemm(x, words, meta, **args, blocks=4)
    with pytest.raises(ValueError, match="depth"):
        _sparse_mma.run_sparse_gemm(x, words, meta, **args, depth=2)
    with pytest.raises(ValueError, match="workspace"):
        _sparse_mma.run_sparse_gemm(x, words, meta, **{**args, "split": 2})
    with pytest.raises(ValueError, match="do not fit"):  # 16 rows x 4 slices x 64 partials: twice the buffer
        _sparse_mma.run_sparse_gemm(x, words, meta, **{**args, "split": 4, "workspace": ws})
    codes, meta16, s = torch.zeros(64, 16, dtype=torch.int32), torch.zeros(64, 16, dtype=torch.int16), \
        torch.ones(64, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of the stripe"):  # groups of 128 columns: stripes of 4 tiles
        _sparse_mma.run_sparse_gemm_w4(x, codes, meta16, s, None, group=128, **args)


def test_bad_arguments_are_refused_before_launch():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    words = torch.zeros(64, 64, dtype=torch.int32)
    meta = torch.zeros(64, 32, dtype=torch.uint8)
    for tiles in (3, 6):  # the layouts hold a power of two of pairs of tiles
        with pytest.raises(ValueError, match="power of two from 2"):
            _sparse_mma.run_sparse_mma(x, words, meta, n=64, tiles_per_slice=tiles, row_blocks=1, warps=4,
                                       workspace=None)
    with pytest.raises(ValueError, match="power of two"):
        _sparse_mma.run_sparse_mma(x, words, meta, n=64, tiles_per_slice=8, row_blocks=3, warps=4, workspace=None)
    with pytest.raises(ValueError, match="workspace"):
        _sparse_mma.run_sparse_mma(x, words, meta, n=64, tiles_per_slice=2, row_blocks=1, warps=4, workspace=None)
    for stripe, tiles, depth in ((3, 4, 0), (4, 4, 2), (4, 2, 0), (2, 6, 0)):
        with pytest.raises(ValueError, match="stripe"):
            _sparse_mma.run_sparse_mma_stripe(x, words, meta, n=64, stripe=stripe, tiles_per_slice=tiles,
                                              row_blocks=1, warps=4, depth=depth, workspace=None)
    with pytest.raises(ValueError, match="workspace"):
        _sparse_mma.run_sparse_mma_stripe(x, words, meta, n=64, stripe=2, tiles_per_slice=4, row_blocks=1, warps=4,
                                          workspace=None)


def _compiled(tmp_path: Path, kernel: str, **const) -> dict:
    if _sparse_mma._kernels() is None:
        pytest.skip("this triton has no Gluon")
    const = {"PARTIAL": True, "FIX_K": 4, **({} if kernel == "sparse_gemm_kernel" else {"ROW_BLOCKS": 4}), **const}
    return compile_gemv_kernel(tmp_path, kernel, const)


def _one_sparse_mma_per_tile(got: dict, kt: int) -> None:
    mmas = [rest for op, rest in got["ops"] if op.startswith("HMMA.SP.16832.F32.BF16")]
    assert len(mmas) == kt  # one row block per loop iteration: one mma.sp per 32-column tile
    selectors = [re.search(r"(0x[01])\s*$", rest.strip()).group(1) for rest in mmas]
    assert selectors.count("0x0") == selectors.count("0x1") == kt // 2  # a metadata register serves two tiles
    assert got["stack"] == 0 and got["local"] == 0 and got["regs"] <= 255
    assert not any(op.startswith(("LDL", "STL")) for op, _ in got["ops"])


def test_2_4_int4_stripes_read_x_16_bytes_a_tile_where_its_rows_allow(monkeypatch):
    """[Note: INT4 stripes]: the 2:4 + INT4 stripe GEMV asks for 16-byte reads of ``x`` where every row of it starts
    at a multiple of 16 bytes, and gathers it otherwise (rows 520 bytes apart, or a start 2 bytes on)."""
    asked = record_launch_kwarg(monkeypatch, _sparse_mma, "XVEC", ("sparse_mma_w4_kernel",), ("w4_stripe_asm",))
    codes, meta = torch.zeros(64, 32, dtype=torch.int32), torch.zeros(64, 16, dtype=torch.int16)
    s = torch.ones(64, 2, dtype=torch.bfloat16)
    rows, odd = torch.zeros(4, 264, dtype=torch.bfloat16), torch.zeros(3, 260, dtype=torch.bfloat16)
    for x in (rows[:1, :256], rows[:, :256], rows[:3, 8:], rows[:, 2:258], odd[:1, :256], odd[:, :256]):
        _sparse_mma.run_sparse_mma_w4(x, codes, meta, s, None, n=64, group=128, tiles_per_slice=8, row_blocks=1,
                                      warps=4, workspace=None)
    assert asked == [True, True, True, False, True, False]


@pytest.mark.parametrize("kt,warps,zeros,group,depth,even,xvec", [
    (16, 4, True, 128, 0, True, True), (8, 8, False, 256, 1, True, True), (8, 4, True, 64, 1, False, True),
    (16, 4, True, 128, 0, True, False), (8, 4, True, 64, 1, False, False)])
def test_2_4_int4_compiles_for_hopper_to_one_sparse_mma_per_tile(tmp_path, kt, warps, zeros, group, depth, even,
                                                                  xvec):
    stripe = _sparse_mma.w4_stripe(group)
    got = _compiled(tmp_path, "sparse_mma_w4_kernel", GROUP=group, HAS_ZEROS=zeros, KT=kt, STRIPE=stripe,
                    DEPTH=depth, EVEN_K=even, num_warps=warps, XVEC=xvec)
    _one_sparse_mma_per_tile(got, kt)
    # each kept pair becomes code - zero exactly: one bf16 subtraction (fma by 1) per A register, 4 per tile
    assert sum(op.startswith(("HADD2.BF16", "HFMA2.BF16")) for op, _ in got["ops"]) == 4 * kt
    # [Note: INT4 stripes]: one load a stripe and row of the weights, for codes and positions alike, for each block
    # loaded (one ahead: the first before the loop, the rest in it); the x slice once, in 16-byte loads, two a tile
    # (XVEC: both of a lane's runs whole, _stripe_b), or 4-byte loads, four a tile
    ops = [op for op, _ in got["ops"]]
    stripes = kt // stripe * (depth + 1)
    x16, x4 = (2 * kt, 0) if xvec else (0, 4 * kt)
    if stripe == 4:  # codes 8 bytes, positions 16 (and a whole slice's scales of a row may be 8 bytes too)
        assert ops.count("LDG.E.64") >= 2 * stripes and ops.count("LDG.E.128") == 2 * stripes + x16
        assert x4 <= ops.count("LDG.E") <= x4 + 2  # (+ a slice's zero points of rows g and g + 8)
    else:  # codes 4 bytes (beside x's), positions 8
        assert ops.count("LDG.E.64") == 2 * stripes and ops.count("LDG.E") == x4 + 2 * stripes
        assert ops.count("LDG.E.128") == x16
    if even and group == 32 * stripe:  # a stripe a group, whole slices: a slice's scales and zero points of a row in
        # one load each
        assert not any(op in ("LDG.E.U16", "LDG.E.U8") for op in ops)
    if depth:  # the next block's loads come before this block's MMAs in the loop
        loop = got["ops"][[op for op, _ in got["ops"]].index("HMMA.SP.16832.F32.BF16") - 1::-1]
        assert any(op in ("LDG.E.64", "LDG.E.128") for op, _ in loop[:200])


@pytest.mark.parametrize("kt,warps,depth", [(16, 4, 0), (8, 8, 1), (8, 4, 2)])
def test_compiles_for_hopper_to_one_sparse_mma_per_tile(tmp_path, kt, warps, depth):
    got = _compiled(tmp_path, "sparse_mma_kernel", KT=kt, DEPTH=depth, num_warps=warps)
    _one_sparse_mma_per_tile(got, kt)
    loads = [op for op, _ in got["ops"] if op.startswith("LDG")]
    # the value words: two 8-byte loads per tile (rows g and g + 8) for each block loaded (prologue + loop)
    assert loads.count("LDG.E.64") == 2 * kt * (depth + 1)


@pytest.mark.parametrize("kt,warps,depth,stripe,even", [(16, 4, 0, 4, True), (8, 8, 1, 4, False), (8, 4, 1, 2, True)])
def test_stripes_compile_for_hopper_to_one_sparse_mma_per_tile_and_vector_loads(tmp_path, kt, warps, depth, stripe,
                                                                                even):
    """[Note: 2:4 stripes]: a lane's values of a stripe and row in 16-byte loads (two for a stripe of 4 tiles, one for
    2), the stripe's positions of a row in one load (16 or 8 bytes), for each block loaded (one ahead: the first
    before the loop); nothing else of the weights, and x in 4-byte loads once, 4 a tile."""
    got = _compiled(tmp_path, "sparse_mma_stripe_kernel", KT=kt, STRIPE=stripe, DEPTH=depth, EVEN_K=even,
                    num_warps=warps)
    _one_sparse_mma_per_tile(got, kt)
    ops = [op for op, _ in got["ops"]]
    stripes = kt // stripe * (depth + 1)
    if stripe == 4:
        assert ops.count("LDG.E.128") == 6 * stripes and "LDG.E.64" not in ops
    else:
        assert ops.count("LDG.E.128") == 2 * stripes and ops.count("LDG.E.64") == 2 * stripes
    assert ops.count("LDG.E") == 4 * kt
    # fewer registers than the tile-wise kernel's 240 at 16 tiles: three programs of 4 warps an SM instead of two
    assert got["regs"] <= 168


@pytest.mark.parametrize("kt,warps,depth,even", [(32, 4, 1, True), (16, 8, 0, False), (16, 4, 2, True)])
def test_folded_rows_compile_for_hopper_to_mmas_on_their_loads(tmp_path, kt, warps, depth, even):
    """[Note: 2:4 folded rows]: one ``mma.sp`` per 64 columns, the selectors of a pair sharing a metadata register;
    an MMA's values one 16-byte load, its positions one 8-byte load, for each block loaded (the ones ahead before the
    loop); x in 4-byte loads once, 4 an MMA; the pair's unused sums (-0.0) never added; nothing spilled. With no block
    ahead each MMA's ``A`` operand is the register quad its load wrote (blocks carried ahead are copied between
    iterations)."""
    got = _compiled(tmp_path, "sparse_mma_fold_kernel", KP=kt // 4, DEPTH=depth, EVEN_K=even, num_warps=warps)
    _one_sparse_mma_per_tile(got, kt // 2)
    ops = [op for op, _ in got["ops"]]
    assert ops.count("LDG.E.128") == kt // 2 * (depth + 1) and ops.count("LDG.E.64") == kt // 4 * (depth + 1)
    assert ops.count("LDG.E") == 4 * (kt // 2)
    loaded = {rest.split(",")[0].strip() for op, rest in got["ops"] if op == "LDG.E.128"}
    a_operands = {rest.split(",")[1].strip() for op, rest in got["ops"] if op.startswith("HMMA.SP")}
    if depth == 0:  # (the (16, 8, 0) case)
        assert a_operands <= loaded
    assert not any(op == "FADD" and "-RZ" in rest for op, rest in got["ops"])


@pytest.mark.parametrize("kt,warps,wk,zeros,group,depth,even,late", [
    (16, 4, 1, True, 128, 1, True, 0), (32, 2, 1, False, 256, 1, False, 0),
    (16, 8, 1, True, 128, 0, True, 0), (16, 16, 16, True, 128, 1, True, 0),
    (32, 8, 8, False, 128, 1, False, 0), (16, 16, 16, True, 128, 1, True, 1),
    (32, 8, 8, False, 128, 1, False, 2), (32, 4, 4, True, 256, 1, True, 1), (16, 16, 16, True, 128, 1, False, 2)])
def test_2_4_int4_folded_rows_compile_for_hopper(tmp_path, kt, warps, wk, zeros, group, depth, even, late):
    """[Note: 2:4 folded rows] for 2:4 + INT4: one ``mma.sp`` per 64 columns, a pair's selectors sharing a metadata
    register; each ``A`` register ``code - zero`` by one bf16 subtraction; a lane's codes of a pair one 8-byte load
    and the pair's positions one 16-byte load, for each block loaded; the unused sums never added; nothing spilled.
    With ``wk`` warps along ``K`` (``kt`` tiles each, [Note: fold warps along K] in ``_dense_mma_kernels``) the same
    a warp, in the registers a program's warps can have on one SM; with ``late`` (the warps' sums of every block added
    across them after the last block) fewer barriers in the loop than the sums a block at a time take."""
    got = _compiled(tmp_path, "sparse_mma_w4_fold_kernel", KP=kt // 4, WK=wk, DEPTH=depth, EVEN_K=even, GROUP=group,
                    HAS_ZEROS=zeros, LATE=late, num_warps=warps)
    assert got["regs"] * 32 * warps <= 65536
    _one_sparse_mma_per_tile(got, kt // 2)
    ops = [op for op, _ in got["ops"]]
    assert sum(op.startswith(("HADD2.BF16", "HFMA2.BF16")) for op in ops) == 4 * (kt // 2)
    pairs = kt // 4 * (depth + 1)
    assert ops.count("LDG.E.128") == pairs and ops.count("LDG.E.64") >= pairs
    assert not any(op == "FADD" and "-RZ" in rest for op, rest in got["ops"])
    if wk > 1:  # in the loop over the blocks: the reduction's barriers; one, before the store of the block's sums
        # to shared memory; none, the sums held in registers
        assert loop_around(got, "HMMA.SP").count("BAR.SYNC.DEFER_BLOCKING") == {0: 4, 1: 1, 2: 0}[late]


@pytest.mark.parametrize("w4,kt,groups,warps,depth,blocks", [(False, 4, 8, 4, 1, 1), (False, 8, 4, 4, 1, 1),
                                                              (True, 4, 8, 4, 1, 1), (True, 8, 2, 4, 0, 1),
                                                              (False, 4, 8, 4, 1, 2), (True, 4, 8, 4, 1, 2)])
def test_gemm_compiles_for_hopper_to_one_sparse_mma_per_tile_and_group(tmp_path, w4, kt, groups, warps, depth, blocks):
    """Chunks that ``_word.SPARSE_GEMM_TILES`` offers at 64, 32 and 16 rows: every group of 8 rows of x takes one
    ``mma.sp`` per tile of the chunk and block of 16 weight rows, chained through the accumulator (no FADD in the
    loop), its ``B`` registers read from shared memory in 16-byte loads once for all of a warp's blocks; 2:4 + INT4
    dequantizes each code byte once per chunk, not once per group (one bf16 subtraction and one multiply per ``A``
    register); nothing spills."""
    from zspeed.kernels._sparse_gemm_kernels import chain_asm, stripe_meta_asm

    chain, chain_io = chain_asm(kt, blocks)
    stripe = 4 if w4 else 1  # 2:4 + INT4 in stripes of 4 tiles (groups of 128 columns)
    meta, meta_io = stripe_meta_asm(stripe) if w4 else ("", "")
    const = dict(KT=kt, NT=groups, MT=blocks, num_warps=warps, DEPTH=depth, W4=w4, GROUP=128, HAS_ZEROS=True,
                 CHAIN=chain, CHAIN_IO=chain_io, STRIPE=stripe, META=meta, META_IO=meta_io)
    got = _compiled(tmp_path, "sparse_gemm_kernel", **const)
    mmas = [rest for op, rest in got["ops"] if op.startswith("HMMA.SP.16832.F32.BF16")]
    assert len(mmas) == groups * kt * blocks
    selectors = [re.search(r"(0x[01])\s*$", rest.strip()).group(1) for rest in mmas]
    assert selectors.count("0x0") == selectors.count("0x1") == groups * kt * blocks // 2
    ops = [op for op, _ in got["ops"]]
    assert ops.count("LDS.128") == groups * kt
    bf16 = sum(op.startswith(("HFMA2.BF16", "HADD2.BF16", "HMUL2.BF16")) for op in ops)
    # two per A register, in the prologue's chunk and the loop's next
    assert bf16 == (2 * 2 * 4 * kt * blocks if w4 else 0)
    assert got["stack"] == 0 and got["local"] == 0 and got["regs"] <= 255
    assert not any(op.startswith(("LDL", "STL")) for op in ops)
    if w4:  # [Note: INT4 stripes]: a pair's codes of a row in one 4-byte load, no 2-byte loads but the pair's scale,
        # for the prologue's chunk and the loop's next
        per_chunk = 2 * (kt // 2) * blocks  # rows g and g + 8 of each pair of each block
        assert ops.count("LDG.E.U16") == 2 * per_chunk and ops.count("LDG.E") == 2 * per_chunk
