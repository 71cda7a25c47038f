"""The NIXL engine's agent thread, against a real owner process over real NIXL/UCX (same host: ``cma``).

Every agent call after creation runs on the engine's own thread; with ``cma`` posting a READ is the copy, so
the loop is free while it runs. A pull of several pin batches stages each batch while the one before it is
read, and commits each group as it is checked.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.errors import TransferError
from lmcache_p2p.keys import FingerprintDigest
from lmcache_p2p.testing.peer_process import OwnerProcess, demo_chunk
from lmcache_p2p.tiers.cpu_pool import CpuPool
from lmcache_p2p.transfer.nixl import FIRST_PIN_BATCH, NixlTransport
from lmcache_p2p.transfer.nixl_engine import NixlEngine, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl not importable")

os.environ.setdefault("UCX_NET_DEVICES", "lo")

SECRET = "engine-test-secret-9c1e5b2d80461c9e4a7b"
FP = FingerprintDigest(b"engine-test-fp16")
SIZE = 1 << 20
N = FIRST_PIN_BATCH + 24  # two pin batches, two READ groups each


class Side:
    """A requester: a loop thread, a pool registered with its NIXL engine, a NIXL client (and one with the MAC)."""

    def __init__(self) -> None:
        self.loop = LoopThread("engine-test")
        self.pool = CpuPool(SIZE * (N + 4), SIZE)
        self.engine: NixlEngine = self.loop.run(self._engine(), 30)
        self.plain = NixlTransport(self.engine, SECRET.encode(), 10.0)
        self.mac = NixlTransport(self.engine, SECRET.encode(), 10.0, payload_mac=True)
        self.posted_on: set[str] = set()  # the threads READs were posted from
        agent = self.engine._agent
        post = agent.transfer

        def recording(handle: Any) -> Any:
            self.posted_on.add(threading.current_thread().name)
            return post(handle)

        agent.transfer = recording

    async def _engine(self) -> NixlEngine:
        return NixlEngine(f"engine-test-{os.getpid()}", self.pool)

    def clear(self) -> None:
        for key in self.pool.keys():
            self.pool.remove(key)

    def close(self) -> None:
        async def shutdown() -> None:
            await self.plain.close()
            await self.mac.close()
            await self.engine.close()

        self.loop.run(shutdown(), 30)
        self.loop.stop()


@pytest.fixture(scope="module")
def side() -> Iterator[Side]:
    s = Side()
    yield s
    s.close()


def assert_exact(pool: CpuPool, seed: int, n: int) -> None:
    out = np.empty(SIZE, np.uint8)
    for i in range(n):
        header, payload = demo_chunk(seed, i, SIZE, FP)
        assert pool.read_into(header.key, out.data) is not None, f"chunk {i} not in the pool"
        np.testing.assert_array_equal(out, payload)


@pytest.mark.parametrize("mac", [False, True])
def test_a_pull_of_several_batches_is_byte_exact_and_read_on_the_agent_thread(side: Side, mac: bool) -> None:
    with OwnerProcess(SECRET, FP, N, SIZE, seed=71, transports="tcp,nixl", payload_mac=mac,
                      node_id="owner-71") as owner:
        side.clear()
        side.posted_on.clear()
        client = side.mac if mac else side.plain
        keys = [owner.key(i) for i in range(N)]
        ticks = 0

        async def pull_while_ticking() -> Any:
            nonlocal ticks
            pulling = asyncio.ensure_future(client.pull(owner.peer, FP, keys, side.pool, time.monotonic() + 20.0))
            while not pulling.done():
                ticks += 1
                await asyncio.sleep(0)
            return pulling.result()

        result = side.loop.run(pull_while_ticking(), 30)
        assert result.complete and len(result.loaded) == N, result.missed
        assert_exact(side.pool, 71, N)
        assert side.posted_on and all(name.startswith("nixl-agent") for name in side.posted_on), side.posted_on
        assert ticks > 0
        assert owner.command({"cmd": "pinned"})["pinned"] == 0  # both leases released


def test_a_read_that_cannot_be_prepared_fails_and_leaves_the_engine_working(side: Side) -> None:
    with OwnerProcess(SECRET, FP, 4, SIZE, seed=72, transports="tcp,nixl", node_id="owner-72") as owner:
        side.clear()
        slots = [side.pool.reserve() for _ in range(2)]
        try:
            with pytest.raises(TransferError, match="NIXL READ"):
                side.loop.run(side.engine.read("no-such-agent", [side.pool.slot_address(r.slot) for r in slots],
                                               [0, SIZE], [SIZE, SIZE], time.monotonic() + 5.0), 10)
        finally:
            for r in slots:
                side.pool.release(r)
        assert side.engine.reads_abandoned == 0
        keys = [owner.key(i) for i in range(4)]
        result = side.loop.run(side.plain.pull(owner.peer, FP, keys, side.pool, time.monotonic() + 10.0), 20)
        assert result.complete
        assert_exact(side.pool, 72, 4)


def test_a_closed_engine_refuses_reads_and_a_pull_through_it_misses() -> None:
    loop = LoopThread("closed-engine")
    pool = CpuPool(SIZE * 4, SIZE)
    try:
        engine: NixlEngine = loop.run(_make_engine(pool), 30)
        client = NixlTransport(engine, SECRET.encode(), 5.0)
        with OwnerProcess(SECRET, FP, 2, SIZE, seed=73, transports="tcp,nixl", node_id="owner-73") as owner:
            keys = [owner.key(i) for i in range(2)]
            assert loop.run(client.pull(owner.peer, FP, keys, pool, time.monotonic() + 10.0), 20).complete
            for key in keys:
                pool.remove(key)
            loop.run(engine.close(), 10)
            with pytest.raises(TransferError, match="closed"):
                loop.run(engine.read("anyone", [pool.base_address], [0], [SIZE], time.monotonic() + 5.0), 10)
            result = loop.run(client.pull(owner.peer, FP, keys, pool, time.monotonic() + 5.0), 10)
            assert not result.loaded and set(result.missed) == set(keys)
            assert pool.free_slots == pool.num_slots  # nothing reserved was kept
            loop.run(client.close(), 10)
    finally:
        loop.stop()


async def _make_engine(pool: CpuPool) -> NixlEngine:
    return NixlEngine(f"closed-engine-{os.getpid()}", pool)
