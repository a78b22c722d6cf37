"""The word kernels' tuner: it keeps the fastest candidate, remembers it on disk, and survives bad cache files."""
import json

import pytest
import torch

from zspeed.kernels import _word
from zspeed.kernels.tuning_cache import FORMAT_VERSION, TuningCache

KEY = ("gemv", 1, 128, True, 1, 8192, 8192, torch.bfloat16)
A = _word.WordConfig(1, 16, 64, 1, 4)
B = _word.WordConfig(1, 32, 128, 2, 8, prefetch=2)
C = _word.WordConfig(1, 8, 64, 1, 4)


def test_cache_round_trip_across_instances(tmp_path):
    path = tmp_path / "gpu.json"
    TuningCache(path).put(KEY, B)
    assert TuningCache(path).get(KEY) == B
    assert TuningCache(path).get(("gemv", 0)) is None
    assert json.loads(path.read_text())["version"] == FORMAT_VERSION
    assert not list(tmp_path.glob("*.tmp"))  # the temporary file was renamed, not left behind


def test_full_depth_configs_round_trip(tmp_path):
    """The full-depth wdot fields ([Note: full-depth wdot]) come back as they went in, and an entry written
    before they existed is ignored (re-tuned), not misread."""
    path = tmp_path / "gpu.json"
    key = ("wdot", 1, 128, True, 16, 8192, 8192, torch.bfloat16)
    cfg = _word.WordConfig(16, 128, 16, 4, 4, 4, full_depth=True, order=1, swap=True)
    TuningCache(path).put(key, cfg)
    assert TuningCache(path).get(key) == cfg
    data = json.loads(path.read_text())
    for name in ("full_depth", "order", "swap"):
        del data["entries"]["|".join(map(str, key))][name]
    path.write_text(json.dumps(data))
    assert TuningCache(path).get(key) is None


@pytest.mark.parametrize("fmt", [_word.FMT_W4, _word.FMT_W8])
def test_wdot_candidates_on_an_h100(monkeypatch, fmt):
    """Both kernels are timed at every row count, a modest number of configs per key, full-depth row blocks
    that match the bucket (swap-AB only up to 64 rows), and split-K only where the programs fill the GPU less than
    four times over, summed by a fix-up where the partials fit the workspace."""
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for m in (1, 4, 16, 17, 64, 128, 256, 4096):
        for n, k in ((8192, 8192), (28672, 8192), (8192, 28672)):
            kw = k // _word.CPW[fmt]
            cands = _word.wdot_candidates(fmt, m, n, kw, 128, gpu)
            full = [c for c in cands if c.full_depth]
            assert full and len(full) < len(cands) <= 28, (m, n, k, len(cands))
            assert len(set(cands)) == len(cands)
            mb = 1 << max(0, (m - 1).bit_length())
            for c in full:
                assert c.block_m <= max(16, mb) and c.order == 3
                assert c.block_w * _word.CPW[fmt] in (64, 128)  # [Note: tile depth]: FULL_TILES' columns
                assert not c.swap or c.block_m <= 64
                if c.split_k > 1:
                    assert -(-m // c.block_m) * -(-n // c.block_n) < 4 * 132
                    # [Note: split-K fix-up] wherever the partials fit the workspace
                    assert c.fixup == (m * c.split_k * n <= _word.STATIONARY_WORKSPACE), c
                else:
                    assert not c.fixup


def test_stationary_tma_candidates_on_an_h100(monkeypatch, tmp_path):
    """INT4 gets TMA configs ([Note: TMA weight stream]) beside the register ones, each a whole number of groups
    per slice with at least one program per SM; INT8 and plain 2:4 get none; a TMA config survives the tuning cache
    and an entry written before the field existed is re-tuned."""
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for n, k in ((8192, 8192), (28672, 8192), (8192, 28672), (4096, 14336)):
        w4 = _word.stationary_candidates(_word.FMT_W4, 1, n, k // 8, 128, gpu)
        tma = [c for c in w4 if c.tma]
        assert bool(tma) == _word.tma_available() and len(tma) < len(w4), (n, k)
        for c in tma:
            assert c.block_w % 16 == 0 and c.stages in _word.TMA_STAGES and c.prefetch == 1
            assert c.split_k * -(-n // (c.block_n * c.row_blocks)) >= 132
        for fmt, group in ((_word.FMT_W8, 0), (_word.FMT_S24, 1)):
            assert not any(c.tma for c in _word.stationary_candidates(fmt, 1, n, k // 4, group, gpu))
    path = tmp_path / "gpu.json"
    cfg = _word.WordConfig(1, 64, 64, 16, 4, 3, row_blocks=8, tma=True)
    TuningCache(path).put(KEY, cfg)
    assert TuningCache(path).get(KEY) == cfg
    data = json.loads(path.read_text())
    del data["entries"]["|".join(map(str, KEY))]["tma"]
    path.write_text(json.dumps(data))
    assert TuningCache(path).get(KEY) is None


def test_int8_deep_slice_candidates_on_an_h100(monkeypatch):
    """INT8 at one row also gets deep slices (``_word.W8_DEEP_TILES``): all of K in one slice where it is at most
    2048 words, else slices of 1024 or 2048 words, each with at least a wave of programs and 8-16 words a thread;
    INT4 and 2:4 keep slices of at most 8 groups or units."""
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for n, k in ((8192, 8192), (8192, 28672), (28672, 8192), (4096, 4096)):
        kw = k // 4
        w8 = _word.stationary_candidates(_word.FMT_W8, 1, n, kw, 0, gpu)
        deep = [c for c in w8 if c.block_w >= 1024]
        assert deep and len(deep) < len(w8), (n, k)
        assert any(c.split_k == 1 for c in deep) == (kw <= 2048), (n, k)
        for c in deep:
            assert c.block_w < 2 * kw and c.split_k == -(-kw // c.block_w) and c.prefetch == 1
            assert c.split_k * -(-n // (c.block_n * c.row_blocks)) >= 132
            assert c.block_n * c.block_w // (32 * c.warps) in (8, 16)
        for fmt, kwf, group in ((_word.FMT_W4, k // 8, 128), (_word.FMT_S24, k // 4, 1)):
            assert all(c.block_w <= 128 for c in _word.stationary_candidates(fmt, 1, n, kwf, group, gpu) if not c.tma)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 999, "entries": {}}),
                                     json.dumps({"version": FORMAT_VERSION, "entries": {"|".join(map(str, KEY)):
                                                                                       {"block_n": 1, "bogus": 2}}})])
def test_unreadable_or_foreign_cache_is_ignored_then_replaced(tmp_path, content):
    path = tmp_path / "gpu.json"
    path.write_text(content)
    cache = TuningCache(path)
    assert cache.get(KEY) is None
    cache.put(KEY, A)
    assert TuningCache(path).get(KEY) == A


def test_disabled_cache_is_memory_only(monkeypatch):
    monkeypatch.setenv("ZSPEED_TUNING_CACHE", "0")
    cache = TuningCache.default()
    assert cache.path is None
    cache.put(KEY, A)
    assert cache.get(KEY) == A


def test_pick_times_once_keeps_the_fastest_and_reuses_the_cache(tmp_path, monkeypatch):
    cache = TuningCache(tmp_path / "gpu.json")
    monkeypatch.setattr(_word, "_tuning_cache", lambda: cache)
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_BEST", {})
    monkeypatch.setattr(_word, "FINALISTS", 0)  # the first pass alone: the finalists have tests of their own
    times = {A: 2.0, B: 1.0, C: 3.0}
    calls = []

    def fake_time(fn, **kw):
        return fn()

    monkeypatch.setattr(_word, "graph_time_ms", fake_time)
    launch = lambda c: calls.append(c) or times[c]  # noqa: E731
    assert _word._pick(KEY, [A, B], launch) == B
    assert calls == [A, B] and TuningCache(cache.path).get(_word.cache_key(KEY, [A, B])) == B
    # a new process: nothing in memory, the disk answers without timing
    monkeypatch.setattr(_word, "_BEST", {})
    calls.clear()
    assert _word._pick(KEY, [A, B], launch) == B and calls == []
    # a cached choice that is no longer a candidate (another version's tile list) is re-tuned
    monkeypatch.setattr(_word, "_BEST", {})
    calls.clear()
    assert _word._pick(KEY, [A, C], launch) == A and calls == [A, C]
    assert TuningCache(cache.path).get(_word.cache_key(KEY, [A, C])) == A
    # and so is one made among fewer candidates, though it is still one of them (a kernel joined the list)
    monkeypatch.setattr(_word, "_BEST", {})
    calls.clear()
    assert _word._pick(KEY, [A, B, C], launch) == B and calls == [A, B, C]


D = _word.WordConfig(1, 64, 64, 1, 4)


def _noisy_timer(monkeypatch, draws: dict):
    """A stand-in for ``graph_time_ms``: each call of a config returns its next draw; records the calls' reps."""
    calls = []

    def fake_time(fn, *, reps=20, trials=5, **kw):
        c = fn()
        calls.append((c, reps))
        return draws[c].pop(0)

    monkeypatch.setattr(_word, "graph_time_ms", fake_time)
    return calls


def test_finalists_overturn_a_lucky_first_pass(monkeypatch):
    """[Note: finalists] A's first-pass time was a lucky draw; timed again in rounds, B is faster. C is within the
    margin too and re-timed; D, 40 % over the first pass's best, is not timed again and stays last."""
    draws = {A: [1.00, 1.20, 1.21, 1.19], B: [1.05, 1.10, 1.09, 1.11], C: [1.10, 1.30, 1.31, 1.29], D: [1.40]}
    calls = _noisy_timer(monkeypatch, draws)
    ranked = _word.time_candidates([A, B, C, D], lambda c: c, finalists=5)
    assert [i for _, i in ranked] == [1, 0, 2, 3]
    assert ranked[0][0] == pytest.approx(1.10) and ranked[-1][0] == pytest.approx(1.40)
    retimed = calls[4:]
    assert len(retimed) == 3 * _word.FINALIST_ROUNDS and {c for c, _ in retimed} == {A, B, C}
    assert all(reps == 20 for _, reps in retimed) and all(reps == 10 for _, reps in calls[:4])
    # the rounds alternate their order: a drift of the clocks does not always fall on the same config
    assert [c for c, _ in retimed[:3]] == [A, B, C] and [c for c, _ in retimed[3:6]] == [C, B, A]
    assert all(not ts for ts in draws.values())


def test_finalists_bounded_and_skipped_when_alone(monkeypatch):
    # finalists=2: only the first pass's two fastest are timed again, even with C inside the margin
    draws = {A: [1.00, 1.2, 1.2, 1.2], B: [1.01, 1.1, 1.1, 1.1], C: [1.02]}
    calls = _noisy_timer(monkeypatch, draws)
    assert [i for _, i in _word.time_candidates([A, B, C], lambda c: c, finalists=2)] == [1, 0, 2]
    assert {c for c, _ in calls[3:]} == {A, B}
    # one config alone within the margin (a lucky draw, kernels run 218): the first pass's fastest FINALISTS_LEAST
    # are timed again all the same, and the second overturns it
    draws = {A: [0.5, 1.0, 1.0, 1.0], B: [0.95, 0.9, 0.9, 0.9], C: [0.96, 0.95, 0.95, 0.95], D: [2.0]}
    calls = _noisy_timer(monkeypatch, draws)
    assert [i for _, i in _word.time_candidates([A, B, C, D], lambda c: c)] == [1, 2, 0, 3]
    assert {c for c, _ in calls[4:]} == {A, B, C} and _word.FINALISTS_LEAST == 3
    # one config alone: nothing is timed again
    draws = {A: [1.0]}
    calls = _noisy_timer(monkeypatch, draws)
    assert _word.time_candidates([A], lambda c: c) == [(1.0, 0)] and len(calls) == 1
    # finalists=0 is the first pass alone; the module default is read at the call
    draws = {A: [1.0], B: [1.01]}
    calls = _noisy_timer(monkeypatch, draws)
    monkeypatch.setattr(_word, "FINALISTS", 0)
    assert _word.time_candidates([A, B], lambda c: c) == [(1.0, 0), (1.01, 1)] and len(calls) == 2


def test_pick_keeps_the_finalists_winner(tmp_path, monkeypatch):
    cache = TuningCache(tmp_path / "gpu.json")
    monkeypatch.setattr(_word, "_tuning_cache", lambda: cache)
    monkeypatch.setattr(_word, "interpreting", lambda: False)
    monkeypatch.setattr(_word, "_BEST", {})
    _noisy_timer(monkeypatch, {A: [1.00, 1.2, 1.2, 1.2], B: [1.05, 1.1, 1.1, 1.1]})
    assert _word._pick(KEY, [A, B], lambda c: c) == B and TuningCache(cache.path).get(_word.cache_key(KEY, [A, B])) == B


def test_semi_structured_form_is_cached_per_tensor_and_version(monkeypatch):
    """kernels/semi.py builds torch's 2:4 form once per weight, again after an in-place change, and lets go of
    it when the weight is gone (the conversion itself needs CUDA, so it is stubbed here)."""
    import gc

    from zspeed.compress.nm import compress_nm, prune_nm
    from zspeed.kernels import semi

    built = []
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", lambda dense: built.append(dense) or dense)
    monkeypatch.setattr(semi, "_CACHE", {})
    w = torch.randn(8, 32)
    nm = compress_nm(prune_nm(w, w.abs()))
    values = nm.values.to(torch.bfloat16)
    first = semi.semi_weight(values, nm.meta)
    assert semi.semi_weight(values, nm.meta) is first and len(built) == 1
    torch.testing.assert_close(first, nm.dequantize(torch.bfloat16))
    values.mul_(2)
    assert len(built) == 1 and semi.semi_weight(values, nm.meta) is not first and len(built) == 2
    del values
    gc.collect()
    assert semi._CACHE == {}


def test_slices_workspace_is_none_for_one_slice_and_refused_where_missing_or_too_small(monkeypatch):
    """The GEMV kernels' shared check of their split-K fix-up workspace: with no workspace yet (a capture before the
    first eager call) or one too small for the rows, the GEMV declines (``None``) and its caller runs another."""
    x = torch.zeros(16, 256)
    one, split = (_word.WordConfig(1, 64, 32, k, 4, row_blocks=1, wgmma_chunk=2) for k in (1, 2))
    ws = (torch.zeros(16), torch.zeros(4, dtype=torch.int32))
    monkeypatch.setattr(_word, "_stationary_workspace", lambda device: ws)
    assert _word._slices_workspace(x, one, 64, 1) == (True, None)
    assert _word._slices_workspace(x, split, 64, 1) == (True, ws)
    assert _word._slices_workspace(x, split, _word.STATIONARY_WORKSPACE, 1) == (False, None)  # partials too many
    assert _word._slices_workspace(x, split, 64, _word.WORKSPACE_COUNTERS + 1) == (False, None)
    monkeypatch.setattr(_word, "_stationary_workspace", lambda device: None)
    assert _word._slices_workspace(x, split, 64, 1) == (False, None)
    assert _word.run_stripe_wgmma(x, None, None, None, split, n=64, group=128) is None  # declined before launch
