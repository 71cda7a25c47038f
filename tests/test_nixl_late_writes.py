"""No late writes over NIXL: a READ whose await ends before NIXL reported it over keeps its destination
slots out of use until it is over, however the await ended: cancelled (as ``LoopThread.run`` cancels a
pull that outlives ``timeout + 1``) or past the pull's deadline.

A real owner process; UCX runs over TCP (``UCX_TLS=tcp``, both sides), where a one-sided READ needs
the owner's progress, so a READ stays in flight exactly while the owner is stopped (SIGSTOP).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from agent_helpers import stop_process, wait_until

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.errors import PeerTimeout
from lmcache_p2p.keys import FingerprintDigest
from lmcache_p2p.testing.peer_process import OwnerProcess, demo_chunk
from lmcache_p2p.tiers.cpu_pool import CpuPool
from lmcache_p2p.transfer.base import MissReason
from lmcache_p2p.transfer.nixl import NixlTransport
from lmcache_p2p.transfer.nixl_engine import NixlEngine, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl not importable")

SECRET = "late-write-secret-2b7e151628aed2a6abf71588"
FP = FingerprintDigest(b"late-write-fpr16")
SIZE = 4 << 20  # 4 chunks per 16 MiB READ group
N = 12
SPARE = 4


class Side:
    """The requester: a loop, a pool registered with a NIXL agent, a NIXL client."""

    def __init__(self) -> None:
        self.loop = LoopThread("late-writes")
        self.pool = CpuPool(SIZE * (N + SPARE), SIZE)
        self.engine: NixlEngine = self.loop.run(self._engine(), 30)
        self.client = NixlTransport(self.engine, SECRET.encode(), 10.0)

    async def _engine(self) -> NixlEngine:
        return NixlEngine(f"late-writes-{os.getpid()}", self.pool)

    def held(self) -> set[int]:
        """Slots neither free nor holding a chunk: reserved, or held for a READ still in flight."""
        pool = self.pool
        with pool._lock:
            return set(range(pool.num_slots)) - set(pool._free) - {e.slot for e in pool._entries.values()}

    async def stop_owner_when_reading(self, pid: int) -> None:
        """SIGSTOP the owner as soon as the pull has reserved its slots (its first READ is posted then)."""
        while not self.held():
            await asyncio.sleep(0)
        stop_process(pid)  # blocks the loop for a moment: nothing on this side moves meanwhile

    def close(self) -> None:
        async def shutdown() -> None:
            await self.client.close()
            await self.engine.close()

        self.loop.run(shutdown(), 30)
        self.loop.stop()


@pytest.fixture
def side(monkeypatch: pytest.MonkeyPatch) -> Iterator[Side]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by both UCX contexts: this one and the owner's
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    s = Side()
    yield s
    s.close()


@pytest.mark.parametrize("ended_by", ["cancellation", "deadline"])
def test_a_nixl_read_left_in_flight_holds_its_slots_until_it_ends(side: Side, ended_by: str) -> None:
    o = OwnerProcess(SECRET, FP, N, SIZE, seed=51, transports="tcp,nixl", pin_timeout_s=30.0, timeout_s=10.0,
                     node_id="owner-51")
    try:
        peer = o.peer
        keys = [o.key(i) for i in range(N)]
        wired = side.loop.run(side.client.pull(peer, FP, keys[:1], side.pool, time.monotonic() + 10.0), 20)
        assert wired.complete  # wired up
        side.pool.remove(keys[0])

        stopper = side.loop.submit(side.stop_owner_when_reading(o.pid))
        if ended_by == "cancellation":  # what Puller.pull's loop.run(..., timeout + 1) does: cancel the pull
            with pytest.raises(PeerTimeout):
                side.loop.run(side.client.pull(peer, FP, keys, side.pool, time.monotonic() + 30.0), 1.0)
        else:  # the pull's own deadline: the READ overruns it
            result = side.loop.run(side.client.pull(peer, FP, keys, side.pool, time.monotonic() + 1.0), 10.0)
            assert not result.loaded and set(result.missed.values()) == {MissReason.TIMEOUT}
            side.client.health.reset()
        stopper.result(5)
        assert wait_until(lambda: 0 < len(side.held()) <= 4, 5), side.held()  # only the READ in flight
        held = side.held()
        assert side.engine.reads_abandoned == 1

        # Fill the pool with other chunks: none may land in a slot the stopped READ will still write.
        others = [demo_chunk(52, i, SIZE, FP) for i in range(N + SPARE)]
        for header, payload in others:
            assert side.pool.put(header, payload.data)
            pin = side.pool.pin(header.key, 1.0)
            assert pin is not None and pin.slot not in held, f"slot {pin and pin.slot} reused mid-READ"
            side.pool.unpin(pin)
        assert side.held() == held

        os.kill(o.pid, signal.SIGCONT)  # the READ lands, into the slots held for it
        assert wait_until(lambda: side.engine.reads_abandoned == 0 and not side.held(), 10), side.held()
        assert side.engine.late_reads == 1
        out = np.empty(SIZE, np.uint8)
        for header, payload in others:  # no committed chunk was written by the late READ
            if side.pool.read_into(header.key, out.data) is not None:
                np.testing.assert_array_equal(out, payload)

        for key in side.pool.keys():
            side.pool.remove(key)
        again = side.loop.run(side.client.pull(peer, FP, keys, side.pool, time.monotonic() + 20.0), 30)
        assert again.complete  # the engine and the connection still work
        for i, key in enumerate(keys):
            assert side.pool.read_into(key, out.data) is not None
            np.testing.assert_array_equal(out, demo_chunk(51, i, SIZE, FP)[1])
    finally:
        os.kill(o.pid, signal.SIGCONT)
        o.kill()
