"""Every Triton kernel, run by Triton's CPU interpreter, equals its plain-PyTorch reference.

TRITON_INTERPRET must be set before triton is first imported (triton's own
``tl`` helpers are built at import); zspeed imports triton lazily for that
reason (kernels/_runtime.py, [Note: lazy triton]). If some earlier test module
already imported triton in compiled mode, the in-process tests cannot run the
interpreter, so they are skipped and ``test_kernels_in_subprocess`` runs this
same file in a fresh interpreter instead.
"""
import dataclasses
import os
import subprocess
import sys

# tests/conftest.py sets TRITON_INTERPRET before anything imports triton; if triton was imported in
# compiled mode anyway (e.g. ZSPEED_TEST_GPU=1), the interpreter tests rerun in a fresh process.
_TRITON_WAS_IMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from zspeed.compress.formats import quantize_int4, quantize_int8  # noqa: E402
from zspeed.compress.nm import compress_nm, prune_nm  # noqa: E402
from zspeed.kernels import (sparse24_matmul, sparse24_ref, sparse24_w4a16_matmul, sparse24_w4a16_ref,  # noqa: E402
                            w4a16_matmul, w4a16_ref, w8a16_matmul, w8a16_ref)

IN_PROCESS = not _TRITON_WAS_IMPORTED or os.environ.get("ZSPEED_KERNEL_SUBPROCESS") == "1"
needs_interp = pytest.mark.skipif(not IN_PROCESS, reason="triton was imported before TRITON_INTERPRET was set; "
                                  "test_kernels_in_subprocess runs these tests in a fresh process")
import triton  # noqa: E402,F401  (a declared dependency: the [kernels] extra)
import triton.language as tl  # noqa: E402

from zspeed.kernels import _word_kernels  # noqa: E402  (imports triton, already imported above)

# (M, N, K): odd M, N not a multiple of the 32-wide tiles, K both aligned and not.
SHAPES = [(1, 48, 64), (3, 160, 96), (17, 72, 256)]
PATHS = ["gemv", "wdot", "splitk", "tiled", "dense"]
SPARSE_PATHS = ["gemv", "splitk", "tiled", "dense"]  # wdot is INT8/INT4 only
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = ref.float().abs().max().clamp(min=1.0)
    err = ((out.float() - ref.float()).abs().max() / scale).item()
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


def _inputs(m, n, k, dtype, seed=0, path=None):
    """``(x, w)``; for the ``gemv`` path at most 5 rows of ``x``. Its interpreted kernel runs a program per row
    (the CPU's only candidate, ``block_m`` 1), so 17 rows tested nothing 5 do not, at a second each; the other paths
    keep 17 (a partial second block of 16)."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g)
    return (x[:5] if path == "gemv" else x), w


@needs_interp
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w8a16_matches_reference(m, n, k, path):
    dtype = [torch.float32, torch.bfloat16, torch.float16][m % 3]
    x, w = _inputs(m, n, k, dtype, path=path)
    q = quantize_int8(w)
    _close(w8a16_matmul(x, q.qweight, q.scales, path=path), w8a16_ref(x, q.qweight, q.scales), dtype)


@needs_interp
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,n,k,group,sym", [(1, 48, 64, 32, False), (3, 160, 128, 64, True),
                                             (17, 72, 256, 128, False), (3, 48, 96, 64, False)])
def test_w4a16_matches_reference(m, n, k, group, sym, path):
    dtype = [torch.float32, torch.bfloat16, torch.float16][m % 3]
    x, w = _inputs(m, n, k, dtype, seed=1, path=path)
    q = quantize_int4(w, group_size=group, symmetric=sym, pad_groups=True)  # K=96, G=64: a short last group
    ref = w4a16_ref(x, q.qweight, q.scales, q.zeros, group)
    _close(w4a16_matmul(x, q.qweight, q.scales, q.zeros, group, path=path), ref, dtype)


@needs_interp
@pytest.mark.parametrize("path", SPARSE_PATHS)
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (3, 160, 72), (17, 72, 256)])
def test_sparse24_matches_reference(m, n, k, path):
    dtype = [torch.float32, torch.bfloat16, torch.float16][m % 3]
    x, w = _inputs(m, n, k, dtype, seed=2, path=path)
    s = compress_nm(prune_nm(w, w.abs(), n=2, m=4))
    values = s.values.to(torch.bfloat16 if path == "gemv" else dtype)  # the word kernel reads bf16 values
    _close(sparse24_matmul(x, values, s.meta, path=path), sparse24_ref(x, values, s.meta), dtype)


@needs_interp
@pytest.mark.parametrize("path", SPARSE_PATHS)
@pytest.mark.parametrize("m,n,k,group,sym", [(1, 48, 64, 32, False), (3, 160, 128, 64, True),
                                             (17, 72, 256, 128, False), (2, 40, 80, 16, True)])
def test_sparse24_int4_matches_reference(m, n, k, group, sym, path):
    dtype = [torch.float32, torch.bfloat16, torch.float16][m % 3]
    x, w = _inputs(m, n, k, dtype, seed=3, path=path)
    s = compress_nm(prune_nm(w, w.abs(), n=2, m=4))
    q = quantize_int4(s.values, group_size=group // 2, symmetric=sym)  # groups over kept values
    ref = sparse24_w4a16_ref(x, q.qweight, s.meta, q.scales, q.zeros, group)
    _close(sparse24_w4a16_matmul(x, q.qweight, s.meta, q.scales, q.zeros, group, path=path), ref, dtype)


@needs_interp
def test_references_agree_with_the_formats():
    """The kernels' references compute x @ W^T for the W that zspeed.compress dequantizes."""
    x, w = _inputs(5, 40, 128, torch.float32, seed=4)
    q4 = quantize_int4(w, group_size=32)
    torch.testing.assert_close(w4a16_ref(x, q4.qweight, q4.scales, q4.zeros, 32), x @ q4.dequantize().t())
    q8 = quantize_int8(w)
    torch.testing.assert_close(w8a16_ref(x, q8.qweight, q8.scales), x @ q8.dequantize().t())
    s = compress_nm(prune_nm(w, w.abs()))
    torch.testing.assert_close(sparse24_ref(x, s.values, s.meta), x @ s.dequantize().t())


@needs_interp
def test_bad_shapes_are_rejected():
    x, w = _inputs(2, 48, 64, torch.float32)
    q = quantize_int8(w)
    with pytest.raises(ValueError, match=r"x must be \(M, 64\)"):
        w8a16_matmul(x[:, :32], q.qweight, q.scales)
    with pytest.raises(ValueError, match="unknown path"):
        w8a16_matmul(x, q.qweight, q.scales, path="fastest")


def _nan_after(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values at the start of a buffer whose tail is NaN: a kernel reading past ``t`` sees NaN."""
    buf = torch.full((t.numel() + 4096,), float("nan"), dtype=t.dtype)
    buf[: t.numel()] = t.flatten()
    return buf[: t.numel()].view(t.shape)


@needs_interp
@pytest.mark.parametrize("path", SPARSE_PATHS)
def test_partial_tiles_read_no_scale_past_the_weight(path):
    """K not a multiple of any tile, several groups per tile: columns past K must not read scales
    (a NaN there would poison the output even though the code and x are zero)."""
    x, w = _inputs(2, 40, 80, torch.float32, seed=6)
    q = quantize_int4(w, group_size=16, symmetric=True, scale_dtype=torch.float32)
    scales = _nan_after(q.scales)
    out = w4a16_matmul(x, q.qweight, scales, None, 16, path=path)
    _close(out, w4a16_ref(x, q.qweight, q.scales, None, 16), torch.float32)
    s = compress_nm(prune_nm(w, w.abs(), n=2, m=4))
    v = quantize_int4(s.values, group_size=8, symmetric=True, scale_dtype=torch.float32)
    out = sparse24_w4a16_matmul(x, v.qweight, s.meta, _nan_after(v.scales), None, 16, path=path)
    _close(out, sparse24_w4a16_ref(x, v.qweight, s.meta, v.scales, None, 16), torch.float32)


@needs_interp
def test_word_paths_refuse_what_they_cannot_read():
    """gemv/wdot name the shape or format they cannot take; the policy routes those elsewhere."""
    from zspeed.kernels import kernel_policy

    x, w = _inputs(2, 40, 64, torch.float32)
    s = compress_nm(prune_nm(w, w.abs(), n=2, m=4))
    with pytest.raises(ValueError, match="wdot path has no kernel"):
        sparse24_matmul(x, s.values.to(torch.bfloat16), s.meta, path="wdot")
    with pytest.raises(ValueError, match="bf16 values for 2:4"):
        sparse24_matmul(x, s.values, s.meta, path="gemv")  # fp32 kept values: not word-readable
    policy = kernel_policy()
    assert policy.path("w4a16", 1) == "gemv" and policy.path("w4a16", 64) == "wdot"
    assert policy.path("w4a16", 4096) == "dense" and policy.path("sparse24", 16) == "splitk"
    assert policy.path("w4a16", 256) == "wdot" and policy.path("w8a16", 512) == "dense"
    assert policy.path("w4a16", 1, words=False) == "splitk" and policy.path("w8a16", 100, words=False) == "tiled"
    assert policy.path("sparse24", 4096, semi=True) == "semi" and policy.path("sparse24", 4096) == "dense"
    with pytest.raises(ValueError, match="semi path needs CUDA"):
        sparse24_matmul(x, s.values.to(torch.bfloat16), s.meta, path="semi")
    torch.testing.assert_close(sparse24_matmul(x, s.values, s.meta), sparse24_ref(x, s.values, s.meta))


@needs_interp
def test_gemv_splits_k_and_matches_without_splitting(monkeypatch):
    """The split-K variant (fp32 atomics, cast after), every prefetch depth and both x layouts give the reference."""
    from zspeed.kernels import _word

    x, w = _inputs(1, 24, 512, torch.bfloat16, seed=5)
    q = quantize_int4(w, group_size=128)
    outs = []
    for split, prefetch, x2d, xnat in ((1, 1, False, False), (4, 2, True, False), (2, 0, False, False),
                                       (1, 1, True, True)):
        cfg = _word.WordConfig(1, 16, 4, split, 1, prefetch=prefetch, x2d=x2d, xnat=xnat)
        monkeypatch.setattr(_word, "gemv_candidates", lambda *a, cfg=cfg: [cfg])
        _word._BEST.clear()
        outs.append(w4a16_matmul(x, q.qweight, q.scales, q.zeros, 128, path="gemv"))
    _word._BEST.clear()
    ref = w4a16_ref(x, q.qweight, q.scales, q.zeros, 128)
    for out in outs:
        _close(out, ref, torch.bfloat16)


@needs_interp
@pytest.mark.parametrize("fmt,m,n,k,group,sym,dtype", [
    ("w4", 1, 37, 256, 32, False, torch.float32), ("w4", 3, 26, 384, 64, True, torch.bfloat16),
    ("w4", 2, 32, 512, 128, False, torch.float16), ("w4", 1, 40, 128, 128, True, torch.bfloat16),
    ("w8", 1, 45, 320, 0, True, torch.bfloat16), ("w8", 3, 24, 64, 0, True, torch.float32)])
def test_stationary_gemv_matches_reference(fmt, m, n, k, group, sym, dtype):
    """[Note: x-stationary GEMV]: odd N (a partial run of rows), K slices with a partial last one (320 = 2.5 slices
    of 128 INT8 columns) or one slice (no partials), zero points or not; run twice, because the last program of
    each run of rows must leave its counter at zero for the next launch."""
    from zspeed.kernels import _word

    x, w = _inputs(m, n, k, dtype, seed=7)
    if fmt == "w4":
        q = quantize_int4(w, group_size=group, symmetric=sym)
        words, s, z, f = q.qweight.view(torch.int32), q.scales, q.zeros, _word.FMT_W4
        ref = w4a16_ref(x, q.qweight, q.scales, q.zeros, group)
    else:
        q = quantize_int8(w)
        words, s, z, f = q.qweight.view(torch.int32), q.scales, None, _word.FMT_W8
        ref = w8a16_ref(x, q.qweight, q.scales)
    (cfg,) = _word.stationary_candidates(f, m, n, words.shape[1], group, x.device)
    assert (cfg.split_k > 1) == (k > 128), cfg
    deep = dataclasses.replace(cfg, prefetch=2, row_blocks=4)  # two blocks in flight, runs of 16 rows
    tma = dataclasses.replace(cfg, tma=True, stages=3, row_blocks=4)  # [Note: TMA weight stream]
    wg = group // 8 if fmt == "w4" else cfg.block_w  # the launcher's words per group (INT8: per slice)
    if fmt == "w4":  # the TMA kernel runs (a Triton without host tensor descriptors runs the register kernel)
        assert _word._tma_words(words, wg) == _word.tma_available()
    shifted = torch.empty(words.numel() + 1, dtype=torch.int32)[1:].view(words.shape)  # 4-byte aligned only:
    shifted.copy_(words)  # TMA cannot read it, so the same tile runs through the register kernel
    assert not _word._tma_words(shifted, wg)
    for c, ws in ((cfg, words), (cfg, words), (deep, words), (tma, words), (tma, words), (tma, shifted)):
        out = _word.run_stationary(x, ws, s, z, c, fmt=f, group=group, n=n)
        _close(out, ref, dtype)
    if cfg.split_k > 1:
        assert not _word._WORKSPACE[x.device][1].any(), "every counter back at zero"
    scales = (2.0 ** 8, 2.0 ** -8) if dtype == torch.float16 else (2.0 ** 30, 2.0 ** -40)  # what fp16 can hold
    for scale in scales:  # inside the range of [Note: subnormal codes]: the relative error does not grow
        xs = (x.float() * scale).to(dtype)
        ref_s = (w4a16_ref(xs, q.qweight, q.scales, q.zeros, group) if fmt == "w4" else
                 w8a16_ref(xs, q.qweight, q.scales)).float()
        out_s = _word.run_stationary(xs, words, s, z, cfg, fmt=f, group=group, n=n).float()
        assert ((out_s - ref_s).abs().max() / ref_s.abs().max()).item() <= TOL[dtype], scale


@needs_interp
@pytest.mark.parametrize("m,n,k,dtype", [(1, 37, 512, torch.float32), (2, 24, 640, torch.bfloat16)])
def test_stationary_int8_deep_slices_match_reference(m, n, k, dtype):
    """INT8's deep slices (``_word.W8_DEEP_TILES``): one slice over all of K (exactly: 512 columns = 128 words; or
    past its end: 640 columns = 160 words in a slice of 256, masked), two slices with a partial second one (640
    columns), one weight row a block; run twice (the counters must be back at zero)."""
    from zspeed.kernels import _word

    x, w = _inputs(m, n, k, dtype, seed=11)
    q = quantize_int8(w)
    words = q.qweight.view(torch.int32)
    ref = w8a16_ref(x, q.qweight, q.scales)
    kw = words.shape[1]
    for bw, bn in ((1 << (kw - 1).bit_length(), 1), (256, 2), (128, 1)):  # (a slice is a power of two words)
        cfg = _word.WordConfig(1, bn, bw, -(-kw // bw), 2, row_blocks=4)
        for _ in range(2):
            _close(_word.run_stationary(x, words, q.scales, None, cfg, fmt=_word.FMT_W8, group=0, n=n), ref, dtype)
        if cfg.split_k > 1:
            assert not _word._WORKSPACE[x.device][1].any(), "every counter back at zero"


@needs_interp
@pytest.mark.parametrize("m,n,k,dtype", [(1, 37, 512, torch.float32), (3, 24, 256, torch.bfloat16),
                                         (2, 40, 384, torch.float16), (1, 45, 96, torch.bfloat16)])
def test_stationary_sparse24_matches_reference(m, n, k, dtype):
    """The plain 2:4 x-stationary kernel ([Note: x-stationary GEMV]): each kept bf16 value picks its column of x by
    its position, read from int32 metadata words of 8 blocks; several slices with a partial last one (96 columns:
    1.5 slices of 64), or one slice; run twice (the counters must be back at zero)."""
    from zspeed.kernels import _word

    x, w = _inputs(m, n, k, dtype, seed=13)
    sp = compress_nm(prune_nm(w, w.abs(), n=2, m=4))
    values = sp.values.to(torch.bfloat16)
    ref = sparse24_ref(x, values, sp.meta)
    words, meta = _word.word_view(_word.FMT_S24, values, sp.meta, k)
    (cfg,) = _word.stationary_candidates(_word.FMT_S24, m, n, words.shape[1], 1, x.device)
    assert cfg.split_k > 1
    one = dataclasses.replace(cfg, split_k=1, block_w=1 << (words.shape[1] - 1).bit_length())
    for c in (cfg, cfg, one):
        out = _word.run_stationary(x, words, None, None, c, fmt=_word.FMT_S24, group=1, n=n, meta=meta)
        _close(out, ref, dtype)
    assert not _word._WORKSPACE[x.device][1].any(), "every counter back at zero"
    # K not a multiple of 32 (the metadata is read 4 bytes at a time): no x-stationary config, gemv still right
    x, w = _inputs(m, n, 48, dtype, seed=14)
    sp = compress_nm(prune_nm(w, w.abs(), n=2, m=4))
    words, _ = _word.word_view(_word.FMT_S24, sp.values.to(torch.bfloat16), sp.meta, 48)
    assert _word.stationary_candidates(_word.FMT_S24, m, n, words.shape[1], 1, x.device) == []
    assert _word.meta_words(sp.meta) is None
    _close(sparse24_matmul(x, sp.values.to(torch.bfloat16), sp.meta, path="gemv"),
           sparse24_ref(x, sp.values.to(torch.bfloat16), sp.meta), dtype)


@needs_interp
@pytest.mark.parametrize("m,n,k,group,sym,dtype", [(1, 37, 512, 64, False, torch.float32),
                                                   (3, 24, 256, 128, True, torch.bfloat16),
                                                   (2, 40, 384, 32, False, torch.float16)])
def test_stationary_sparse24_int4_matches_reference(m, n, k, group, sym, dtype):
    """The 2:4 + INT4 x-stationary kernel ([Note: x-stationary GEMV]): each kept value picks its column of x by
    its position; several slices (partials summed in one launch) or one; zero points or symmetric."""
    from zspeed.kernels import _word

    x, w = _inputs(m, n, k, dtype, seed=11)
    sp = compress_nm(prune_nm(w, w.abs(), n=2, m=4))
    q = quantize_int4(sp.values, group_size=group // 2, symmetric=sym)  # groups over kept values
    ref = sparse24_w4a16_ref(x, q.qweight, sp.meta, q.scales, q.zeros, group)
    words, meta = _word.word_view(_word.FMT_S24W4, q.qweight, sp.meta, k)
    (cfg,) = _word.stationary_candidates(_word.FMT_S24W4, m, n, words.shape[1], group, x.device)
    for c in (cfg, cfg, dataclasses.replace(cfg, split_k=1, block_w=words.shape[1])) if k <= 256 else (cfg, cfg):
        out = _word.run_stationary(x, words, q.scales, q.zeros, c, fmt=_word.FMT_S24W4, group=group, n=n, meta=meta)
        _close(out, ref, dtype)


def _word_case(fmt, m, n, k, group, sym, dtype, seed):
    """``(x, words, scales, zeros, format, reference)`` for the word kernels' launchers."""
    from zspeed.kernels import _word

    x, w = _inputs(m, n, k, dtype, seed=seed)
    if fmt == "w4":
        q = quantize_int4(w, group_size=group, symmetric=sym, pad_groups=True)
        return x, q.qweight.view(torch.int32), q.scales, q.zeros, _word.FMT_W4, w4a16_ref(x, q.qweight, q.scales,
                                                                                           q.zeros, group)
    q = quantize_int8(w)
    return x, q.qweight.view(torch.int32), q.scales, None, _word.FMT_W8, w8a16_ref(x, q.qweight, q.scales)


def _run_wdot_with(monkeypatch, cfg, x, words, s, z, f, group, n):
    from zspeed.kernels import _word

    monkeypatch.setattr(_word, "wdot_candidates", lambda *a: [cfg])
    _word._BEST.clear()
    try:
        return _word.run_wdot(x, words, s, z, None, fmt=f, group=group, n=n, k=x.shape[1])
    finally:
        _word._BEST.clear()


@needs_interp
@pytest.mark.parametrize("fmt,m,n,k,group,sym,dtype", [
    ("w4", 17, 40, 320, 128, False, torch.bfloat16), ("w4", 5, 72, 512, 128, True, torch.float32),
    ("w4", 5, 40, 192, 64, False, torch.float16), ("w4", 17, 24, 256, 32, True, torch.bfloat16),
    ("w8", 17, 40, 320, 0, True, torch.bfloat16), ("w8", 5, 72, 256, 0, True, torch.float32)])
def test_full_depth_wdot_matches_reference(monkeypatch, fmt, m, n, k, group, sym, dtype):
    """[Note: full-depth wdot]: every column order of the tile (natural; planes gathered from x; planes from the
    plane-major copy), both orientations ([Note: swap-AB]), one K slice or three (fp32 atomics); odd M over
    two row blocks, N over a partial block, K words a multiple of the tile (k=512 INT4) or not, tiles inside one
    group (g128) or spanning two or four (g64, g32). Random data: a wrong column or field order is far off."""
    from zspeed.kernels import _word

    x, words, s, z, f, ref = _word_case(fmt, m, n, k, group, sym, dtype, seed=12)
    bw = 16 if fmt == "w4" else 32
    for order in (0, 1, 2, 3):
        for swap in (False, True):
            for split in (1, 3):
                cfg = _word.WordConfig(16, 32, bw, split, 1, full_depth=True, order=order, swap=swap)
                _close(_run_wdot_with(monkeypatch, cfg, x, words, s, z, f, group, n), ref, dtype)


@needs_interp
@pytest.mark.parametrize("fmt,m,n,k,group,sym,dtype", [
    ("w4", 17, 40, 320, 128, False, torch.bfloat16), ("w4", 5, 72, 512, 64, True, torch.float16),
    ("w8", 17, 40, 320, 0, True, torch.bfloat16)])
def test_full_depth_wdot_fixup(monkeypatch, fmt, m, n, k, group, sym, dtype):
    """[Note: split-K fix-up]: K split 2, 3 or 4 ways (the last split short or empty of tiles), each tile's
    partials summed by its last split: the reference, the same bits on a second call (no atomics), both
    orientations, odd M and a partial N block; every tile counter is back at zero afterwards."""
    from zspeed.kernels import _word

    x, words, s, z, f, ref = _word_case(fmt, m, n, k, group, sym, dtype, seed=14)
    bw = 16 if fmt == "w4" else 32
    for swap in (False, True):
        for split in (2, 3, 4):
            cfg = _word.WordConfig(16, 32, bw, split, 1, full_depth=True, order=3, swap=swap, fixup=True)
            got = _run_wdot_with(monkeypatch, cfg, x, words, s, z, f, group, n)
            _close(got, ref, dtype)
            assert torch.equal(got, _run_wdot_with(monkeypatch, cfg, x, words, s, z, f, group, n))
            assert not _word._stationary_workspace(x.device)[1].any()


@needs_interp
@pytest.mark.parametrize("fmt,group,sym", [("w4", 128, False), ("w4", 32, True), ("w8", 0, True)])
def test_full_depth_wdot_dequantizes_bit_for_bit(monkeypatch, fmt, group, sym):
    """[Note: fields masked in place]: with one-hot rows of x each output row is one column of the dequantized
    weight, so the kernel's dequantization must equal the format's ``dequantize`` bit for bit, for every field of a
    word (INT4 fields 0-7, INT8 0-3) and both column orders. In fp16: the interpreter truncates fp32 to bf16 where
    the GPU rounds to nearest, so only fp16 rounds alike on both."""
    from zspeed.kernels import _word

    k, n = 256, 40
    _, w = _inputs(1, n, k, torch.float16, seed=16)
    w[:, :8] *= 64.0  # large codes in the first group as well as small ones
    q = quantize_int4(w, group_size=group, symmetric=sym) if fmt == "w4" else quantize_int8(w)
    words = q.qweight.view(torch.int32)
    f = _word.FMT_W4 if fmt == "w4" else _word.FMT_W8
    x = torch.eye(k, dtype=torch.float16)[:48]  # 48 one-hot rows: columns 0-47 of every word position
    want = q.dequantize(torch.float16)[:, :48].T
    bw = 16 if fmt == "w4" else 32
    for order in (0, 3):
        cfg = _word.WordConfig(16, 32, bw, 1, 1, full_depth=True, order=order)
        got = _run_wdot_with(monkeypatch, cfg, x, words, q.scales, getattr(q, "zeros", None), f, group, n)
        assert torch.equal(got, want), (order, (got.float() - want.float()).abs().max())


@triton.jit
def _group_scale_probe(s_ptr, z_ptr, out_s, out_z, N, K, stride_sn, col0, GROUP: tl.constexpr,
                       HAS_ZEROS: tl.constexpr, CPW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Stores what ``_group_scale`` gives the ``(BN, BW)`` words of the tile at ``col0``."""
    offs_n = tl.arange(0, BLOCK_N)
    s, z = _word_kernels._group_scale(s_ptr, z_ptr, offs_n, offs_n < N, col0, stride_sn, K, CPW, GROUP, BLOCK_W,
                                      HAS_ZEROS)
    o = offs_n[:, None] * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    tl.store(out_s + o, tl.broadcast_to(s, (BLOCK_N, BLOCK_W)))
    tl.store(out_z + o, tl.broadcast_to(z, (BLOCK_N, BLOCK_W)))


@needs_interp
@pytest.mark.parametrize("group", [8, 16, 32, 64, 128])
def test_group_scale_loads_per_group_and_spreads_to_words(group):
    """[Note: group scales] in kernels/_word_kernels.py: in a 128-column tile (16 INT4 words) that spans groups
    (g8-g64) each word gets its own group's scale and zero point, loaded once per group and spread; in one that lies
    in a group (g128), the group's. Rows past N read nothing, nor do groups that start past K (K = 200: the second
    tile is partial; the last row's scales end the buffer, NaN after them)."""
    n, k = 5, 200
    groups = -(-k // group)
    g = torch.Generator().manual_seed(group)
    scales = _nan_after(torch.randn(n, groups, generator=g).to(torch.bfloat16))
    zeros = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    for col0 in (0, 128):
        col = col0 + 8 * torch.arange(16)  # each word's first column
        gw = torch.minimum(col // group, torch.tensor(groups - 1))
        inside = (col // group) * group < k  # the word's group starts before K
        for has_zeros in (True, False):
            out_s = torch.full((8, 16), float("nan"))
            out_z = torch.full((8, 16), float("nan"))
            _group_scale_probe[(1,)](scales, zeros if has_zeros else scales, out_s, out_z, n, k, groups, col0,
                                     GROUP=group, HAS_ZEROS=has_zeros, CPW=8, BLOCK_N=8, BLOCK_W=16)
            want_s = torch.zeros(8, 16)
            want_s[:n] = torch.where(inside, scales.float()[:, gw], 0.0)
            want_z = torch.full((8, 16), 8.0)
            if has_zeros:
                want_z.zero_()
                want_z[:n] = torch.where(inside, zeros.float()[:, gw], 0.0)
            assert torch.equal(out_s, want_s), (col0, out_s, want_s)
            assert torch.equal(out_z, want_z), (col0, out_z, want_z)


@needs_interp
@pytest.mark.parametrize("group,sym", [(32, False), (64, False), (32, True), (64, True), (16, False)])
def test_wdot_tiles_spanning_groups_dequantize_bit_for_bit(monkeypatch, group, sym):
    """The 128-column tiles of both wdot kernels over groups of 16-64 columns, scales loaded per group and spread
    to the words ([Note: group scales]): with one-hot rows of x the output is the format's ``dequantize`` bit for bit
    (fp16, see above), at odd N (37), K = 200 (a partial last tile whose last group is short), every field of the
    first words and the columns around the second tile, in both column orders, both orientations, K split or not."""
    from zspeed.kernels import _word

    k, n = 200, 37
    _, w = _inputs(1, n, k, torch.float16, seed=18 + group)
    w[:, :8] *= 64.0
    q = quantize_int4(w, group_size=group, symmetric=sym, pad_groups=True)
    words = q.qweight.view(torch.int32)
    cols = torch.cat([torch.arange(0, 24), torch.arange(120, 200)])
    x = torch.eye(k, dtype=torch.float16)[cols]
    want = q.dequantize(torch.float16)[:, cols].T
    cfgs = [_word.WordConfig(16, 32, 16, 1, 1, full_depth=True, order=order, swap=swap)
            for order in (0, 3) for swap in (False, True)]
    cfgs += [_word.WordConfig(16, 32, 16, 2, 1, full_depth=True, order=3, fixup=True),
             _word.WordConfig(16, 32, 16, 1, 1)]  # the per-plane kernel
    for cfg in cfgs:
        got = _run_wdot_with(monkeypatch, cfg, x, words, q.scales, q.zeros, _word.FMT_W4, group, n)
        assert torch.equal(got, want), (cfg, (got.float() - want.float()).abs().max())


@needs_interp
def test_workspace_too_small_for_these_rows(monkeypatch):
    """A key covers a bucket of row counts, so a config tuned where its partials fit the workspace can be launched
    with more rows: the x-stationary kernel then gives way to the tile kernel and the fix-up to atomics, with
    correct results and the counters untouched, instead of writing past the workspace."""
    from zspeed.kernels import _word

    monkeypatch.setattr(_word, "_WORKSPACE", {})
    monkeypatch.setattr(_word, "STATIONARY_WORKSPACE", 2 * 3 * 40)  # 2 slices x 40 outputs: 3 rows fit, 4 do not
    x, w = _inputs(4, 40, 256, torch.bfloat16, seed=15)
    q = quantize_int4(w, group_size=128)
    words, s, z = q.qweight.view(torch.int32), q.scales, q.zeros
    ref = w4a16_ref(x, q.qweight, q.scales, q.zeros, 128)
    (cfg,) = _word.stationary_candidates(_word.FMT_W4, 3, 40, words.shape[1], 128, x.device)
    assert cfg.split_k == 2
    _close(_word.run_stationary(x[:3], words, s, z, cfg, fmt=_word.FMT_W4, group=128, n=40), ref[:3], torch.bfloat16)
    assert _word.run_stationary(x, words, s, z, cfg, fmt=_word.FMT_W4, group=128, n=40) is None
    monkeypatch.setattr(_word, "stationary_candidates", lambda *a: [cfg])
    monkeypatch.setattr(_word, "_BEST", {("gemv", _word.FMT_W4, 128, True, 4, 40, 256, torch.bfloat16): cfg})
    _close(_word.run_gemv(x, words, s, z, None, fmt=_word.FMT_W4, group=128, n=40, k=256), ref, torch.bfloat16)
    fix = _word.WordConfig(16, 32, 16, 2, 1, full_depth=True, order=3, fixup=True)
    assert not _word._fixup_fits(4, 40, 2, 16, 32) and _word._fixup_fits(3, 40, 2, 16, 32)
    partials, counters = _word._WORKSPACE[x.device]
    partials.fill_(float("nan"))  # the fix-up would store its partials here first
    _close(_run_wdot_with(monkeypatch, fix, x, words, s, z, _word.FMT_W4, 128, 40), ref, torch.bfloat16)
    assert partials.isnan().all() and not counters.any()


@needs_interp
@pytest.mark.parametrize("fmt,m,n,k,group,sym,dtype", [
    ("w4", 5, 40, 320, 128, False, torch.bfloat16), ("w4", 17, 24, 384, 192, False, torch.float32),
    ("w8", 5, 40, 320, 0, True, torch.float16)])
def test_wdot_kernels_both_run_from_the_candidates(monkeypatch, fmt, m, n, k, group, sym, dtype):
    """The first candidate (the one the interpreter runs) is the full-depth kernel with a tile that fits the
    groups (g192: 64 columns, and no per-plane candidate, whose 128-column tiles would straddle groups); the
    per-plane kernel still gives the reference, split or not."""
    from zspeed.kernels import _word

    x, words, s, z, f, ref = _word_case(fmt, m, n, k, group, sym, dtype, seed=13)
    cands = _word.wdot_candidates(f, m, n, words.shape[1], group, x.device)
    assert cands[0].full_depth and cands[-1].full_depth == (group == 192), cands
    assert cands[0].block_w * _word.CPW[f] == (64 if group == 192 else 128)
    for cfg in (cands[0], cands[-1], dataclasses.replace(cands[-1], split_k=2)):
        _close(_run_wdot_with(monkeypatch, cfg, x, words, s, z, f, group, n), ref, dtype)


@needs_interp
def test_group_sizes_off_the_standard_grid():
    """Groups of 4, 12, 40 and 80 columns (INT4; 2:4 + INT4: 24, 40, 80 original columns), which no tile size
    divides or which split a word: the default policy gives the reference at 1, 3 and 16 rows (word kernels
    where the groups are whole words and a tile fits, the generic paths elsewhere), and so does every generic
    path (a tile narrower than a group but not dividing it spans two groups); the word paths, asked for by
    name, refuse groups they cannot read and name the fix."""
    for g in (4, 12, 40, 80):
        x, w = _inputs(16, 16, 240, torch.float32, seed=g)
        q = quantize_int4(w, group_size=g)
        for m, path in ((1, None), (3, None), (16, None), (3, "splitk"), (3, "tiled"), (3, "dense")):
            ref = w4a16_ref(x[:m], q.qweight, q.scales, q.zeros, g)
            _close(w4a16_matmul(x[:m], q.qweight, q.scales, q.zeros, g, path=path), ref, torch.float32)
    for g in (24, 40, 80):
        x, w = _inputs(3, 16, 240, torch.float32, seed=g)
        sp = compress_nm(prune_nm(w, w.abs(), n=2, m=4))
        q = quantize_int4(sp.values, group_size=g // 2)  # groups over kept values
        for m, path in ((1, None), (3, None), (3, "splitk"), (3, "tiled")):
            ref = sparse24_w4a16_ref(x[:m], q.qweight, sp.meta, q.scales, q.zeros, g)
            _close(sparse24_w4a16_matmul(x[:m], q.qweight, sp.meta, q.scales, q.zeros, g, path=path), ref,
                   torch.float32)
    x, w = _inputs(3, 16, 240, torch.float32)
    for g, path, match in ((4, "wdot", "groups of 4 columns split a word"), (12, "gemv", "multiple of 8"),
                           (40, "wdot", "no tile for groups of 40 columns")):
        q = quantize_int4(w, group_size=g)
        with pytest.raises(ValueError, match=match):
            w4a16_matmul(x, q.qweight, q.scales, q.zeros, g, path=path)


def _run_in_subprocess():
    """Runs this file with the interpreter on when this process cannot (see module docstring)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "ZSPEED_KERNEL_SUBPROCESS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


if not IN_PROCESS:
    test_kernels_in_subprocess = _run_in_subprocess


def test_gluon_kernel_modules_are_optional_and_run_compiled_on_a_gpu_only(monkeypatch):
    """``_runtime.optional_kernels``: a kernel module this Triton cannot import is ``None`` (its launchers then
    decline), one it can is the module. ``_runtime.compiled_gpu``: compiled kernels run on a CUDA GPU of the capability
    asked for (or exactly it), never on the CPU or under the interpreter."""
    import importlib

    from zspeed.kernels import _runtime

    assert _runtime.optional_kernels("_no_such_kernels") is None
    assert _runtime.optional_kernels("_ref") is importlib.import_module("zspeed.kernels._ref")
    assert not _runtime.compiled_gpu(torch.device("cpu"), capability=(8, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_runtime, "interpreting", lambda: False)
    gpu = torch.device("cuda", 0)
    assert _runtime.compiled_gpu(gpu, capability=(8, 0)) and _runtime.compiled_gpu(gpu, capability=(9, 0), exact=True)
    assert not _runtime.compiled_gpu(gpu, capability=(8, 0), exact=True)
    assert not _runtime.compiled_gpu(gpu, capability=(10, 0))
    monkeypatch.setattr(_runtime, "interpreting", lambda: True)
    assert not _runtime.compiled_gpu(gpu, capability=(8, 0))
