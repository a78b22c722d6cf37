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
    times = {A: 2.0, B: 1.0, C: 3.0}
    calls = []

    def fake_time(fn, **kw):
        return fn()

    monkeypatch.setattr(_word, "graph_time_ms", fake_time)
    launch = lambda c: calls.append(c) or times[c]  # noqa: E731
    assert _word._pick(KEY, [A, B], launch) == B
    assert calls == [A, B] and TuningCache(cache.path).get(KEY) == B
    # a new process: nothing in memory, the disk answers without timing
    monkeypatch.setattr(_word, "_BEST", {})
    calls.clear()
    assert _word._pick(KEY, [A, B], launch) == B and calls == []
    # a cached choice that is no longer a candidate (another version's tile list) is re-tuned
    monkeypatch.setattr(_word, "_BEST", {})
    calls.clear()
    assert _word._pick(KEY, [A, C], launch) == A and calls == [A, C]
    assert TuningCache(cache.path).get(KEY) == A


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
