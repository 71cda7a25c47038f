"""A watch taken by a member behind the revision already seen: a member still applying (retried), or an etcd
that really went back (resynced, and the rewind counted).

A follower of a 3-member cluster creates a watch at the revision *it* has applied, which can be a few
revisions behind what the watcher read elsewhere; an etcd restored from a backup is behind for good. Only a
linearizable read tells them apart, and only the second may cost a range read of the whole prefix (at 1,000
nodes, every chunk entry of the cluster). Real etcd here; the lagging member's answer is the one thing a
test cannot make on demand, so that creation answer is injected once, and the linearizable read that
decides is etcd's own.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.errors import WatchBehind
from lmcache_p2p.index.client import EtcdClient, KeyValue, WatchBatch, WatchEvent
from lmcache_p2p.index.etcd_server import EtcdServer
from lmcache_p2p.index.watch import ResumableWatch


class Seen:
    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.rewinds: list[tuple[int, int]] = []

    def load(self, kvs: list[KeyValue], _revision: int) -> None:
        self.keys = {kv.key for kv in kvs}

    def apply(self, events: Sequence[WatchEvent]) -> None:
        for ev in events:
            (self.keys.discard if ev.deleted else self.keys.add)(ev.key)

    def rewound(self, seen: int, now: int) -> None:
        self.rewinds.append((seen, now))


def watched(client: EtcdClient, prefix: bytes) -> tuple[Seen, ResumableWatch]:
    seen = Seen()
    return seen, ResumableWatch(client, prefix, load=seen.load, apply=seen.apply, name="t", on_rewind=seen.rewound)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_member_still_applying_gets_a_new_watch_not_a_resync() -> None:
    prefix = b"behind/" + os.urandom(4).hex().encode() + b"/"

    async def main(etcd: EtcdServer) -> None:
        async with EtcdClient(EtcdConfig(endpoints=etcd.endpoints)) as client:
            seen, watch = watched(client, prefix)
            real_watch = client.watch
            lagging = {"left": 0}

            async def watch_with_one_lagging_member(p: bytes, start: int, **kw: float) -> AsyncIterator[WatchBatch]:
                if lagging["left"] > 0:  # what a follower two revisions behind answers to the creation
                    await client.get(p)  # while etcd is down this fails as the watch itself would
                    lagging["left"] -= 1
                    raise WatchBehind(f"Watch: this member is at revision {start - 3}, behind {start - 1}", start - 3)
                async for batch in real_watch(p, start, **kw):
                    yield batch

            client.watch = watch_with_one_lagging_member  # type: ignore[method-assign]
            watch.start()
            try:
                assert await watch.wait_synced(30)
                await client.put(prefix + b"a", b"1")
                await until(lambda: prefix + b"a" in seen.keys, "the first event")
                lagging["left"] = 1
                etcd.kill_member(0)  # the stream breaks; the next watch is taken by "a member behind"
                etcd.restart_member(0)
                await client.put(prefix + b"b", b"2")  # most likely before the retried watch: resumed, not lost
                await until(lambda: lagging["left"] == 0 and watch.connected, "the watch after the lagging member")
                await until(lambda: prefix + b"b" in seen.keys, "the event written around the lagging member")
                await client.put(prefix + b"c", b"3")
                await until(lambda: prefix + b"c" in seen.keys, "an event after the lagging member")
                assert watch.lagging_members == 1
                assert watch.resyncs == 1 and watch.rewinds == 0 and seen.rewinds == []  # the first sync only
            finally:
                await watch.stop()

    with EtcdServer(unsafe_no_fsync=True) as etcd:  # its own: the tests kill and restart it
        asyncio.run(main(etcd))


def test_an_etcd_that_really_went_back_is_resynced_and_the_rewind_counted() -> None:
    prefix = b"behind/" + os.urandom(4).hex().encode() + b"/"

    async def main(etcd: EtcdServer) -> None:
        async with EtcdClient(EtcdConfig(endpoints=etcd.endpoints)) as client:
            seen, watch = watched(client, prefix)
            watch.start()
            try:
                assert await watch.wait_synced(30)
                await client.put(prefix + b"a", b"1")
                await until(lambda: prefix + b"a" in seen.keys, "the first event")
                ahead = watch.revision + 1000  # seen from an etcd that is then replaced by an older copy
                watch.revision = ahead
                etcd.kill_member(0)  # the stream breaks; etcd's own answer to the new watch is "behind"
                etcd.restart_member(0)
                await until(lambda: watch.resyncs == 2, "the resync")
                assert watch.rewinds == 1 and seen.rewinds and seen.rewinds[0][0] == ahead
                assert watch.lagging_members == 0 and watch.revision < ahead
                await client.put(prefix + b"b", b"2")
                await until(lambda: prefix + b"b" in seen.keys, "an event after the resync")
            finally:
                await watch.stop()

    with EtcdServer(unsafe_no_fsync=True) as etcd:  # its own: the tests kill and restart it
        asyncio.run(main(etcd))
