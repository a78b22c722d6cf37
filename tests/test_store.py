"""TensorStore: round trips on every tier, corruption, crashes, full disks, bad paths."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from zspeed.core.device import DeviceHandle
from zspeed.core.disk_format import prefix_header_size
from zspeed.core.disk_io import file_name
from zspeed.core.pinned_pool import PinnedBufferPool
from zspeed.core.store import StoreConfig, StoreCorruptionError, StoreError, TensorStore

CPU = DeviceHandle.for_device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.bool, torch.int64]
SHAPES = [(), (0,), (3, 0), (1,), (7, 13), (4096,), (1025, 3), (5, 1, 4099)]
# DISK twice: as configured ("auto" probes O_DIRECT) and forced buffered.
TIER_PARAMS = [("device", {}), ("cpu", {}), ("disk", {}), ("disk", {"direct_io": False})]


def random_tensor(shape, dtype, seed=0) -> torch.Tensor:
    """Random bit patterns (NaNs, denormals and all) so equality is checked bit for bit."""
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def make_store(tier: str, tmp_path, **kw) -> TensorStore:
    return TensorStore(config=StoreConfig(tier=tier, path=tmp_path / "store", **kw), device=CPU)


def payload_offset(path) -> int:
    with open(path, "rb") as f:
        return prefix_header_size(f.read(4096), str(path))


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout)


# -- round trips -------------------------------------------------------------------
@pytest.mark.parametrize("tier,extra", TIER_PARAMS, ids=lambda p: str(p))
def test_round_trip_bit_exact(tier, extra, tmp_path):
    with make_store(tier, tmp_path, **extra) as store:
        originals = {}
        for d, dtype in enumerate(DTYPES):
            for s, shape in enumerate(SHAPES):
                key = f"t/{dtype}/{shape}"  # '/' and spaces must survive the file naming
                originals[key] = random_tensor(shape, dtype, seed=d * 100 + s)
                store.put(key, originals[key])
        for key, original in originals.items():
            assert same_bits(store.get(key), original), key
            meta = store.meta(key)
            assert meta.shape == tuple(original.shape) and meta.dtype == original.dtype
        assert store.nbytes() == sum(t.numel() * t.element_size() for t in originals.values())
        assert sorted(store.keys()) == sorted(originals)


@pytest.mark.parametrize("tier,extra", TIER_PARAMS, ids=lambda p: str(p))
def test_put_group_packs_memory_tiers(tier, extra, tmp_path):
    """[Note: packed groups]: one aligned buffer in the order given; a later put moves a key out."""
    with make_store(tier, tmp_path, **extra) as store:
        group = [(f"g/{i}", random_tensor(shape, dtype, seed=i))
                 for i, (shape, dtype) in enumerate(zip(SHAPES, DTYPES + [torch.float32]))]
        store.put_group(group)
        for key, original in group:
            assert same_bits(store.get(key), original), key
        if tier == "disk":
            assert store.packed_buffer("g/0") is None
            return
        flat = store.packed_buffer("g/0")
        end = 0
        for key, original in group:
            offset = -(-end // 4096) * 4096  # each tensor at the next multiple of the store's alignment
            end = offset + original.numel() * original.element_size()
            assert store.packed_buffer(key) is flat
            if original.numel():  # an empty tensor has no address to check
                assert store.peek(key).data_ptr() - flat.data_ptr() == offset, key
        store.put("g/1", group[1][1])
        assert store.packed_buffer("g/1") is None and same_bits(store.get("g/1"), group[1][1])


def test_disk_records_io_mode(tmp_path):
    with make_store("disk", tmp_path) as auto, make_store("disk", tmp_path, direct_io=False) as buffered:
        assert auto.io_mode in ("direct", "buffered")
        assert buffered.io_mode == "buffered"


@pytest.mark.parametrize("tier,extra", TIER_PARAMS, ids=lambda p: str(p))
def test_async_put_get_and_ordering(tier, extra, tmp_path):
    with make_store(tier, tmp_path, **extra) as store:
        tensors = {f"k{i}": random_tensor((1000 + 37 * i,), torch.bfloat16, seed=i) for i in range(16)}
        puts = [store.put_async(k, t) for k, t in tensors.items()]
        gets = {k: store.get_async(k) for k in tensors}  # each waits for its own key's put
        assert all(p.result().nbytes > 0 for p in puts)
        for k, f in gets.items():
            assert same_bits(f.result(), tensors[k])
        versions = [torch.full((5000,), i, dtype=torch.int32) for i in range(8)]
        for v in versions:
            store.put_async("same", v)
        assert torch.equal(store.get_async("same").result(), versions[-1])


@pytest.mark.parametrize("tier,extra", TIER_PARAMS, ids=lambda p: str(p))
def test_get_fills_out_in_place(tier, extra, tmp_path):
    with make_store(tier, tmp_path, chunk_bytes=8192, **extra) as store:
        original = random_tensor((3, 5001), torch.float16, seed=3)  # several chunks, unaligned tail
        store.put("w", original)
        aligned = torch.empty(3, 5001, dtype=torch.float16)
        unaligned = torch.empty(3 * 5001 + 1, dtype=torch.float16)[1:].view(3, 5001)  # off by 2 bytes
        pinned_like = CPU.pinned_empty((3, 5001), dtype=torch.float16)
        for out in (aligned, unaligned, pinned_like):
            assert store.get("w", out=out) is out
            assert same_bits(out, original)
        assert same_bits(store.get_async("w", out=torch.empty_like(original)).result(), original)
        with pytest.raises(ValueError, match="'w'"):
            store.get("w", out=torch.empty(3, 5000, dtype=torch.float16))


def test_keys_contains_delete_and_missing_key(tmp_path):
    with make_store("disk", tmp_path) as store:
        for i in range(7):
            store.put(f"layer{i}", torch.ones(3) * i)
        assert "layer3" in store and "nope" not in store and len(store) == 7
        store.delete("layer3")
        assert "layer3" not in store
        with pytest.raises(KeyError) as info:
            store.get("layer3")
        assert "layer3" in str(info.value) and "layer0" in str(info.value) and "more" in str(info.value)
        with pytest.raises(KeyError, match="ghost"):
            store.meta("ghost")
        with pytest.raises(KeyError, match="ghost"):
            store.delete("ghost")


def test_disk_store_reopens_existing_directory(tmp_path):
    long_key = "model/" + "x" * 400  # longer than a file name may be
    originals = {"a": random_tensor((10, 10), torch.bfloat16), long_key: random_tensor((3,), torch.int64)}
    with make_store("disk", tmp_path) as store:
        for k, t in originals.items():
            store.put(k, t)
    with make_store("disk", tmp_path) as again:
        assert sorted(again.keys()) == sorted(originals)
        for k, t in originals.items():
            assert same_bits(again.get(k), t)
            assert again.meta(k).checksum is not None


def test_closed_store_refuses_work(tmp_path):
    store = make_store("cpu", tmp_path)
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.put("a", torch.ones(1))


# -- corruption --------------------------------------------------------------------
def test_flipped_payload_byte_is_detected(tmp_path):
    with make_store("disk", tmp_path) as store:
        store.put("w", random_tensor((10000,), torch.float32))
        path = store._tier.root / file_name("w")
        with open(path, "r+b") as f:
            f.seek(payload_offset(path) + 1234)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(StoreCorruptionError) as info:
            store.get("w")
        assert str(path) in str(info.value) and "checksum" in str(info.value)


def test_flipped_byte_passes_unchecked_without_verification(tmp_path):
    with make_store("disk", tmp_path, verify_checksums=False) as store:
        original = torch.zeros(10000)
        store.put("w", original)
        path = store._tier.root / file_name("w")
        with open(path, "r+b") as f:
            f.seek(payload_offset(path) + 8)
            f.write(b"\x01")
        assert not torch.equal(store.get("w"), original)


def test_damaged_header_is_detected(tmp_path):
    with make_store("disk", tmp_path) as store:
        store.put("w", torch.ones(100))
        path = store._tier.root / file_name("w")
        with open(path, "r+b") as f:
            f.write(b"garbage!")
        with pytest.raises(StoreCorruptionError, match="magic") as info:
            store.get("w")
        assert str(path) in str(info.value)


def test_truncated_file_is_detected(tmp_path):
    with make_store("disk", tmp_path) as store:
        store.put("w", random_tensor((50000,), torch.int8))
        path = store._tier.root / file_name("w")
        os.truncate(path, payload_offset(path) + 20000)
        with pytest.raises(StoreCorruptionError, match="truncated") as info:
            store.get("w")
        assert str(path) in str(info.value)


# -- crashes, full disks, bad paths ------------------------------------------------
KILL_CHILD = """
    import sys, torch
    from zspeed.core.device import DeviceHandle
    from zspeed.core.store import StoreConfig, TensorStore
    store = TensorStore(config=StoreConfig(tier="disk", path=sys.argv[1]), device=DeviceHandle.for_device("cpu"))
    i = 0
    while True:
        store.put("k", torch.full((8 << 20,), i, dtype=torch.int32))
        if i == 0:
            print("ready", flush=True)
        i += 1
"""


def wait_for_temp_file(root, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.endswith(".tmp") for p in root.iterdir()):
            return True
        time.sleep(0.001)
    return False


def test_killed_writer_leaves_previous_version(tmp_path):
    root = tmp_path / "store"
    for extra_delay in (0.0, 0.005, 0.02):
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILL_CHILD), str(root)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            # Kill while a put is in flight (its temp file exists), not between puts.
            assert wait_for_temp_file(root, timeout=20), "the child never started a second put"
            time.sleep(extra_delay)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        with TensorStore(config=StoreConfig(tier="disk", path=root), device=CPU) as store:
            value = store.get("k")  # checksum verified: a torn file would raise
            assert value.shape == (8 << 20,) and bool((value == value[0]).all())
            assert not any(p.name.endswith(".tmp") for p in root.iterdir()), "stale temp file not removed"


FULL_DISK_CHILD = """
    import json, resource, signal, sys, torch
    from zspeed.core.device import DeviceHandle
    from zspeed.core.store import StoreConfig, StoreError, TensorStore
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() fails with EFBIG instead of killing us
    store = TensorStore(config=StoreConfig(tier="disk", path=sys.argv[1], direct_io=sys.argv[2] == "direct"),
                        device=DeviceHandle.for_device("cpu"))
    store.put("a", torch.full((1000,), 7, dtype=torch.int16))
    store.put("big", torch.full((1000,), 1, dtype=torch.int16))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        store.put("big", torch.full((1 << 20,), 2, dtype=torch.int16))
        error = None
    except StoreError as e:
        error = str(e)
    print(json.dumps({"error": error, "a": store.get("a").tolist()[:3], "big": store.get("big").tolist()[:3],
                      "big_len": store.get("big").numel()}))
"""


@pytest.mark.parametrize("mode", ["auto", "buffered"])
def test_full_disk_keeps_previous_versions(tmp_path, mode):
    root = tmp_path / "store"
    done = run_child(FULL_DISK_CHILD, str(root), "direct" if mode == "auto" else "buffered")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is not None, "the oversized put did not fail"
    assert "'big'" in result["error"] and str(root) in result["error"] and "no space" in result["error"]
    assert result["a"] == [7, 7, 7] and result["big"] == [1, 1, 1] and result["big_len"] == 1000
    assert not any(p.name.endswith(".tmp") for p in root.iterdir())


def test_unusable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="StoreConfig.path") as info:
        TensorStore(config=StoreConfig(tier="disk", path=blocker / "store"), device=CPU)
    assert str(blocker / "store") in str(info.value)
    with pytest.raises(StoreError, match="not a directory"):
        TensorStore(config=StoreConfig(tier="disk", path=blocker), device=CPU)


@pytest.mark.parametrize("field,value,match", [
    ("path", None, "StoreConfig.path"),
    ("io_threads", 0, "io_threads"),
    ("direct_io", "yes", "direct_io"),
    ("alignment", 1000, "alignment"),
    ("chunk_bytes", 5000, "chunk_bytes"),
    ("tier", "tape", "tier"),
])
def test_config_errors_name_the_field(field, value, match):
    kwargs = {"tier": "disk", "path": "/tmp/x", field: value}
    with pytest.raises(ValueError, match=match):
        StoreConfig(**kwargs)


# -- pinned buffer pool ----------------------------------------------------------
def test_pinned_pool_reuses_and_bounds():
    pool = PinnedBufferPool(device=CPU, max_bytes=256 << 10, alignment=4096, min_class=64 << 10)
    first = pool.acquire(10_000)
    assert first.tensor.numel() == 10_000 and first.tensor.data_ptr() % 4096 == 0
    address = first.capacity.data_ptr()
    first.release()
    with pool.acquire(60_000) as again:
        assert again.capacity.data_ptr() == address  # same 64 KiB class: reused, not reallocated
    held = [pool.acquire(64 << 10) for _ in range(4)]
    assert pool.allocated_bytes == 256 << 10
    with pytest.raises(TimeoutError):
        pool.acquire(1, timeout=0.05)
    for b in held:
        b.release()
    with pool.acquire(128 << 10) as big:  # drops free 64 KiB buffers to fit
        assert big.capacity.numel() == 128 << 10 and pool.allocated_bytes <= 256 << 10
    with pytest.raises(ValueError, match="max_bytes"):
        pool.acquire(1 << 20)
