import os
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_p2p.chunk import make_header
from lmcache_p2p.errors import CapacityError, TierError
from lmcache_p2p.tiers import LFU, LRU, S3FIFO, CpuPool, DiskTier, TieredStore, make_policy

FP = b"f" * 16
SLOT = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def chunk(i: int, size: int = SLOT):
    payload = os.urandom(size)
    return make_header(key(i), FP, payload, 256), memoryview(payload)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lru_order():
    p = LRU()
    for k in "abc":
        p.insert(k)
    p.access("a")
    assert [p.evict(lambda k: True) for _ in range(3)] == ["b", "c", "a"]
    assert p.evict(lambda k: True) is None


def test_lfu_order_and_ties():
    p = LFU()
    for k in "abcd":
        p.insert(k)
    for _ in range(3):
        p.access("a")
    p.access("c")
    assert [p.evict(lambda k: True) for _ in range(4)] == ["b", "d", "c", "a"]


def test_s3fifo_one_hit_wonders_leave_first_and_ghosts_return_to_main():
    p = S3FIFO()
    for i in range(20):
        p.insert(i)
    for i in range(10):
        p.access(i)  # 0..9 are re-used, 10..19 are one-hit wonders
    victims = [p.evict(lambda k: True) for _ in range(9)]
    assert victims == list(range(10, 19))  # re-used keys moved to main; one-hit wonders went first
    p.insert(10)  # a ghost comes back: straight into main
    assert p._where[10] == "m"


@pytest.mark.parametrize("name", ["lru", "lfu", "s3fifo"])
def test_policies_respect_veto(name):
    p = make_policy(name)
    for i in range(5):
        p.insert(i)
    assert p.evict(lambda k: k == 3) == 3
    assert p.evict(lambda k: False) is None
    assert len(p) == 4


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["lru", "lfu", "s3fifo"]), st.lists(st.integers(0, 30), min_size=1, max_size=120))
def test_cpu_capacity_never_exceeded(policy, ops):
    pool = CpuPool(5 * SLOT, SLOT, policy=make_policy(policy))
    for i in ops:
        if pool.contains(key(i)):
            assert pool.read_into(key(i), memoryview(bytearray(SLOT))) is not None
            continue
        pool.put(*chunk(i, 100 + i))
        assert len(pool) <= pool.num_slots
        assert pool.used_bytes <= pool.capacity_bytes


def test_pinned_chunks_survive_until_their_deadline():
    clock = FakeClock()
    pool = CpuPool(2 * SLOT, SLOT, clock=clock)
    pool.put(*chunk(0))
    pool.put(*chunk(1))
    pin = pool.pin(key(0), timeout_s=5)
    assert pin is not None
    pool.pin(key(1), timeout_s=5)
    with pytest.raises(CapacityError):
        pool.put(*chunk(2))
    clock.now += 6  # both pins expire by themselves
    pool.put(*chunk(2))
    assert pool.contains(key(2)) and pool.pinned_count() == 0


def test_removed_pinned_chunk_keeps_its_bytes_until_unpinned():
    pool = CpuPool(1 * SLOT, SLOT)
    header, payload = chunk(0)
    pool.put(header, payload)
    pin = pool.pin(key(0), 30)
    assert pool.remove(key(0))
    with pytest.raises(CapacityError):  # the only slot is still being read
        pool.put(*chunk(1))
    assert bytes(pool.slot_view(pin.slot, header.length)) == bytes(payload)
    pool.unpin(pin)
    pool.put(*chunk(1))


def test_oversized_chunk_refused():
    pool = CpuPool(2 * SLOT, SLOT)
    with pytest.raises(TierError):
        pool.put(*chunk(0, SLOT + 1))


def test_write_back_then_promotion_round_trips(tmp_path):
    events: list[tuple[bytes, str | None]] = []
    cpu = CpuPool(2 * SLOT, SLOT)
    disk = DiskTier(tmp_path, 100 * SLOT)
    store = TieredStore(cpu, disk, listener=lambda k, t: events.append((k, t)))
    originals = {}
    assert store.worker is not None
    for i in range(6):
        payload = os.urandom(SLOT - i)
        originals[i] = payload
        store.put(key(i), FP, memoryview(payload), 256)
        assert store.worker.drain(10.0)  # steady state: the worker keeps up with the stores
    assert len(cpu) == 2 and len(disk) == 4  # the four victims, written back by the tier worker
    assert (key(0), "disk") in events and store.writeback_dropped == 0
    dst = memoryview(bytearray(SLOT))
    for i in range(6):
        header = store.read_into(key(i), dst)
        assert header is not None and bytes(dst[: header.length]) == originals[i]
    assert store.where(key(5)) == "cpu"  # promoted by the last read
    assert store.cpu.stats.evictions >= 4


def test_store_without_disk_reports_dropped_chunks():
    events = []
    store = TieredStore(CpuPool(SLOT, SLOT), None, listener=lambda k, t: events.append((k, t)))
    store.put(key(0), FP, memoryview(os.urandom(10)), 1)
    store.put(key(1), FP, memoryview(os.urandom(10)), 1)
    assert events == [(key(0), "cpu"), (key(0), None), (key(1), "cpu")]


class _SlowDisk(DiskTier):
    """A disk whose writes take long and record which thread made them."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.writers: set[str] = set()

    def put(self, header, payload):  # type: ignore[no-untyped-def]
        self.writers.add(threading.current_thread().name)
        time.sleep(0.2)
        return super().put(header, payload)


def test_no_disk_io_on_the_storing_thread_or_under_the_pool_lock(tmp_path):
    """A full pool with a slow disk: stores and reservations never wait on a disk write."""
    cpu = CpuPool(2 * SLOT, SLOT)
    disk = _SlowDisk(tmp_path, 100 * SLOT)
    store = TieredStore(cpu, disk)
    for i in range(8):  # 8 stores into 2 slots: six evictions while the disk is busy
        store.put(key(i), FP, memoryview(os.urandom(SLOT)), 256)
        cpu.release(cpu.reserve())  # what the forward pass does before a gather
    assert store.worker is not None and store.worker.pending > 0  # the stores did not wait for the disk
    victims = [key(i) for i in range(8) if not cpu.contains(key(i))]
    assert all(store.where(k) == "disk" for k in victims)  # staged: readable while on its way to disk
    dst = memoryview(bytearray(SLOT))
    assert store.read_into(victims[-1], dst) is not None
    assert store.worker.drain(10.0)
    assert disk.writers == {"lmcache-p2p-tiers"}  # only the tier worker ever wrote
    assert all(disk.header(k) is not None for k in victims) and store.writeback_dropped == 0
    store.close()
