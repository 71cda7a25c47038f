"""What leaves the CPU pool for the engine is a copy verified where it landed (``stage``, ``read_into``):
pool slots are registered memory a peer may write at any time, so bytes checked in a slot and read
from it later are not bytes anyone checked."""

from __future__ import annotations

import threading

import numpy as np
import torch

from lmcache_p2p.chunk import make_header
from lmcache_p2p.keys import ChunkKey, FingerprintDigest
from lmcache_p2p.tiers.cpu_pool import CpuPool

FP = FingerprintDigest(b"\x02" * 16)
SLOT = 8192


def stored(pool: CpuPool, i: int, n: int = SLOT) -> tuple[ChunkKey, bytes]:
    key = ChunkKey(i.to_bytes(16, "little"))
    data = np.random.default_rng(i).bytes(n)
    assert pool.put(make_header(key, FP, data, 256), memoryview(data))
    return key, data


def test_stage_returns_a_private_copy_that_later_writes_to_the_slot_do_not_reach() -> None:
    pool = CpuPool(4 * SLOT, SLOT)
    key, data = stored(pool, 1, SLOT - 100)  # a partial chunk: the copy is its length, not the slot's
    pin = pool.pin(key, 5.0)
    assert pin is not None
    staged = pool.stage(pin)
    assert staged is not None and bytes(staged.numpy()) == data
    start, end = pool.base_address, pool.base_address + pool.capacity_bytes
    assert not start <= staged.data_ptr() < end  # not in the registered buffer: no peer can write it
    pool.slot_view(pin.slot, pin.header.length)[10] ^= 0xFF  # a WRITE into the pool after the check
    assert bytes(staged.numpy()) == data  # the engine scatters what was verified
    pool.unpin(pin)


def test_a_slot_changed_before_stage_is_not_handed_out_and_is_dropped() -> None:
    pool = CpuPool(4 * SLOT, SLOT)
    key, _ = stored(pool, 2)
    other, other_data = stored(pool, 3)
    pin = pool.pin(key, 5.0)
    assert pin is not None
    pool.slot_view(pin.slot, pin.header.length)[SLOT // 2] ^= 0x01
    assert pool.stage(pin) is None
    assert not pool.contains(key) and pool.stats.corrupt_dropped == 1
    pool.unpin(pin)
    assert pool.free_slots == pool.num_slots - 1  # its slot is back once the last pin went
    pin = pool.pin(other, 5.0)
    assert pin is not None
    staged = pool.stage(pin)
    assert staged is not None and bytes(staged.numpy()) == other_data
    pool.unpin(pin)


def test_read_into_verifies_its_copy() -> None:
    pool = CpuPool(4 * SLOT, SLOT)
    key, data = stored(pool, 4)
    out = bytearray(SLOT)
    assert pool.read_into(key, memoryview(out)) is not None and bytes(out) == data
    pin = pool.pin(key, 5.0)
    assert pin is not None
    pool.slot_view(pin.slot, pin.header.length)[0] ^= 0x01
    pool.unpin(pin)
    assert pool.read_into(key, memoryview(out)) is None
    assert not pool.contains(key) and pool.stats.corrupt_dropped == 1 and pool.stats.hits == 1


def test_each_thread_stages_into_its_own_buffer() -> None:
    pool = CpuPool(4 * SLOT, SLOT)
    keys = [stored(pool, i)[0] for i in (5, 6)]
    ptrs: dict[str, int] = {}
    both = threading.Barrier(2, timeout=10)  # both buffers alive at once

    def stage(name: str, key: ChunkKey) -> None:
        pin = pool.pin(key, 5.0)
        assert pin is not None
        staged = pool.stage(pin)
        assert isinstance(staged, torch.Tensor)
        ptrs[name] = staged.data_ptr()
        pool.unpin(pin)
        both.wait()

    threads = [threading.Thread(target=stage, args=(f"t{i}", k)) for i, k in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ptrs.values())) == 2
