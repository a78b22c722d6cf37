"""Streamer: the K-slot window, bytes and order, prefetch, failures, stats, write-back."""
from __future__ import annotations

import os
import time

import pytest
import torch

from zspeed.core.device import DeviceHandle
from zspeed.core.disk_format import prefix_header_size
from zspeed.core.disk_io import file_name
from zspeed.core.store import StoreConfig, TensorStore
from zspeed.core.streamer import Streamer, StreamerConfig, StreamerError, UnitSpec, UnitState

CPU = DeviceHandle.for_device("cpu")
N_UNITS = 6
# (tier, stage_disk_reads): DISK both straight into the slot and through the
# pinned staging buffers (the path CUDA takes).
SOURCES = [("cpu", None), ("disk", False), ("disk", True)]


def random_tensor(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def unit_tensors(i: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes and sizes, none a multiple of the alignment; unit sizes differ."""
    return {
        f"layer{i}.weight": random_tensor((64 + 16 * i, 129), torch.bfloat16, seed=10 * i),
        f"layer{i}.bias": random_tensor((129,), torch.float32, seed=10 * i + 1),
        f"layer{i}.qweight": random_tensor((777 + i,), torch.int8, seed=10 * i + 2),
        f"layer{i}.mask": random_tensor((3, 5), torch.bool, seed=10 * i + 3),
        f"layer{i}.scale": random_tensor((), torch.float16, seed=10 * i + 4),
        f"layer{i}.empty": torch.empty(0, 4, dtype=torch.int64),
    }


@pytest.fixture(params=SOURCES, ids=lambda p: f"{p[0]}-staged={p[1]}")
def model(request, tmp_path):
    """(store, units, originals, stage_disk_reads) with N_UNITS units put into a fresh store."""
    tier, staged = request.param
    store = TensorStore(config=StoreConfig(tier=tier, path=tmp_path / "store"), device=CPU)
    originals, units = {}, []
    for i in range(N_UNITS):
        tensors = unit_tensors(i)
        for key, t in tensors.items():
            store.put(key, t)
        originals.update(tensors)
        units.append(UnitSpec(f"layer{i}", tuple(tensors)))
    yield store, units, originals, staged
    store.close()


def streamer_for(model, **config) -> Streamer:
    store, units, _, staged = model
    config.setdefault("timeout_s", 20.0)
    return Streamer(units=units, store=store, device=CPU,
                    config=StreamerConfig(stage_disk_reads=staged, **config))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def unit_bytes(units, originals) -> list[int]:
    return [sum(originals[k].numel() * originals[k].element_size() for k in u.tensor_keys) for u in units]


# -- window, bytes, order ------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("window", [1, 2, 3])
def test_window_bound_bytes_and_order(model, window):
    _, units, originals, _ = model
    order = [*range(N_UNITS), *reversed(range(N_UNITS))]  # training: forward then backward
    with streamer_for(model, window=window) as streamer:
        visited = []
        for _ in range(2):
            for i, tensors in streamer.run(order):
                visited.append(i)
                assert streamer.resident_count <= window
                assert streamer.state(i) is UnitState.IN_USE
                assert set(tensors) == set(units[i].tensor_keys)
                for key, t in tensors.items():
                    assert same_bits(t, originals[key]), key
        assert visited == order * 2
        assert streamer.max_resident_seen == window  # the window fills, and never overflows
        assert streamer.resident_count <= window


def wait_for_state(streamer: Streamer, i: int, state: UnitState, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while streamer.state(i) is not state and time.monotonic() < deadline:
        time.sleep(0.001)
    assert streamer.state(i) is state, f"unit {i} is {streamer.state(i)}, expected {state}"


@pytest.mark.timeout(60)
def test_prefetch_runs_ahead_of_acquire(model):
    with streamer_for(model, window=3) as streamer:
        streamer.acquire(0)
        wait_for_state(streamer, 2, UnitState.RESIDENT)  # K=3: unit 0 in use plus two ahead
        assert streamer.state(1) is UnitState.RESIDENT and streamer.state(3) is UnitState.EMPTY
        streamer.release(0)  # frees a slot: unit 3 comes in, unit 0 (next used last) goes
        wait_for_state(streamer, 3, UnitState.RESIDENT)
        assert streamer.state(0) is UnitState.EMPTY and streamer.stats.units_loaded == 4
        streamer.acquire(1)  # a prefetched unit: no load of its own
        assert streamer.stats.units_loaded == 4
        streamer.release(1)
        assert streamer.max_resident_seen == 3


@pytest.mark.timeout(60)
def test_no_prefetch_loads_on_demand(model):
    with streamer_for(model, window=2, prefetch=False) as streamer:
        streamer.acquire(0)
        time.sleep(0.05)
        assert streamer.state(1) is UnitState.EMPTY
        streamer.release(0)
        for i, _ in streamer.run(range(N_UNITS)):
            pass
        assert streamer.max_resident_seen <= 2


@pytest.mark.timeout(60)
def test_stats_are_consistent(model):
    store, units, originals, _ = model
    with streamer_for(model, window=2, cyclic=False) as streamer:
        for _ in streamer.run(range(N_UNITS)):
            pass
        stats = streamer.stats
    assert stats.acquires == N_UNITS and stats.units_loaded == N_UNITS
    assert stats.bytes_moved == sum(unit_bytes(units, originals))
    assert stats.stall_seconds >= 0 and stats.transfer_seconds > 0 and stats.achieved_gbps > 0
    if store.tier.value == "disk":
        assert stats.read_seconds > 0


# -- failures ------------------------------------------------------------------------
def corrupt(store: TensorStore, key: str) -> None:
    path = store._tier.root / file_name(key)
    with open(path, "r+b") as f:
        f.seek(prefix_header_size(f.read(4096), str(path)) + 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staged", [False, True])
def test_read_failure_surfaces_in_acquire(tmp_path, staged):
    store = TensorStore(config=StoreConfig(tier="disk", path=tmp_path / "s"), device=CPU)
    units = []
    for i in range(4):
        store.put(f"w{i}", torch.full((5000,), i, dtype=torch.float32))
        units.append(UnitSpec(f"block{i}", (f"w{i}",)))
    corrupt(store, "w2")
    config = StreamerConfig(window=2, timeout_s=10.0, stage_disk_reads=staged)
    with store, Streamer(units=units, store=store, device=CPU, config=config) as streamer:
        for i in (0, 1):
            assert float(streamer.acquire(i)[f"w{i}"][0]) == i
            streamer.release(i)
        with pytest.raises(StreamerError, match="block2") as info:
            streamer.acquire(2)
        assert "checksum" in str(info.value)
        assert streamer.state(2) is UnitState.EMPTY
        assert float(streamer.acquire(3)["w3"][0]) == 3  # the streamer keeps working
        streamer.release(3)
        os.unlink(store._tier.root / file_name("w0"))
        streamer.invalidate()
        with pytest.raises(StreamerError, match="block0"):
            streamer.acquire(0)
        assert streamer.resident_count <= 2


@pytest.mark.timeout(60)
def test_misuse_is_reported(model):
    store, units, _, _ = model
    with streamer_for(model, window=1) as streamer:
        with pytest.raises(StreamerError, match="not in use"):
            streamer.release(0)
        streamer.acquire(0)
        with pytest.raises(StreamerError, match="window"):
            streamer.acquire(1)  # the only slot is in use
        with pytest.raises(StreamerError, match="in use"):
            streamer.invalidate([0])
        streamer.release(0)
        with pytest.raises(IndexError, match="out of range"):
            streamer.acquire(N_UNITS)
    with pytest.raises(KeyError, match="missing.key"):
        Streamer(units=[UnitSpec("bad", ("missing.key",))], store=store, device=CPU)
    with pytest.raises(ValueError, match="window"):
        StreamerConfig(window=0)


# -- changing stored tensors ----------------------------------------------------------
@pytest.mark.timeout(60)
def test_writeback_and_invalidate(model):
    store, units, originals, _ = model
    key = "layer2.bias"
    with streamer_for(model, window=2) as streamer:
        tensors = streamer.acquire(2)
        tensors[key].add_(1.0)
        expected = tensors[key].clone()
        done = streamer.writeback(2)
        streamer.release(2)
        done.result(timeout=20)
        assert same_bits(store.get(key), expected)
        for i, _ in streamer.run(range(N_UNITS)):
            pass
        replacement = torch.full_like(originals["layer4.bias"], 42.0)
        store.put("layer4.bias", replacement)
        streamer.invalidate()
        assert streamer.resident_count == 0
        assert same_bits(streamer.acquire(4)["layer4.bias"], replacement)
        streamer.release(4)


# -- the serving fast path -------------------------------------------------------------
@pytest.mark.timeout(60)
def test_packed_unit_moves_in_one_copy(monkeypatch):
    """A unit the CPU tier packed (put_group) is one copy_ per load, not one per tensor."""
    store = TensorStore(config=StoreConfig(tier="cpu"), device=CPU)
    originals, units = {}, []
    for i in range(N_UNITS):
        tensors = unit_tensors(i)
        store.put_group(list(tensors.items()))
        originals.update(tensors)
        units.append(UnitSpec(f"layer{i}", tuple(tensors)))
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, **kw: copies.append(1) or real_copy(dst, src, **kw))
    with Streamer(units=units, store=store, device=CPU, config=StreamerConfig(window=2, timeout_s=20)) as streamer:
        for i, tensors in streamer.run():
            for key, t in tensors.items():
                assert same_bits(t, originals[key]), key
    assert len(copies) == streamer.stats.units_loaded >= N_UNITS  # after close: no load in flight
    store.close()


def compute_while_loads_land(streamer: Streamer, timeout: float = 10.0) -> None:
    """Stands in for a unit's compute that outlasts its loads: returns once no unit is LOADING, so every load the
    streamer has issued by now has landed (a fixed sleep made this a race with the loader thread on a busy CPU)."""
    deadline = time.monotonic() + timeout
    while any(streamer.state(j) is UnitState.LOADING for j in range(len(streamer))):
        if time.monotonic() > deadline:
            raise AssertionError("a load did not land within the timeout")
        time.sleep(0.001)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cyclic", [True, False])
def test_steady_state_acquires_find_their_unit_loaded(model, cyclic):
    """Decode-like passes where compute outlasts the loads: after the first pass, every acquire finds its unit loaded
    (cyclic prefetch wraps to the next pass's first units); without wrap-around every pass's first unit is loaded on
    demand. Each unit's compute waits for the loads in flight, so the count does not depend on the loader thread's
    timing."""
    with streamer_for(model, window=3, cyclic=cyclic) as streamer:
        for _ in streamer.run():
            compute_while_loads_land(streamer)
        before = streamer.stats
        for _ in range(3):
            for _ in streamer.run():
                compute_while_loads_land(streamer)
        after = streamer.stats
    waited = (after.acquires - before.acquires) - (after.acquires_ready - before.acquires_ready)
    assert after.acquires - before.acquires == 3 * N_UNITS
    assert waited == (0 if cyclic else 3), waited
