"""``etcd.index: lookup`` against a real etcd: owners read when asked (one txn), reused ``lookup_cache_s``,
read again past a scheduler's revision, a miss (never an error or a hang) when etcd is slow or gone."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import agent_config, make_keys, node_record

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.ids import TIER_CPU, TIER_DISK
from lmcache_p2p.index.etcd_index import EtcdBlockIndex
from lmcache_p2p.index.etcd_server import EtcdServer
from lmcache_p2p.index.lookup import LookupMirror
from lmcache_p2p.index.reader import IndexReader
from lmcache_p2p.keys import FingerprintDigest

Factory = Callable[..., EtcdBlockIndex]


@pytest.fixture
def open_lookup(loop: LoopThread, etcd: EtcdServer, cluster_name: str) -> Iterator[Factory]:
    """``open_lookup(node, fingerprints, index="lookup", cache_s=0.3, endpoints=None, timeout_s=5.0)``; closed at
    teardown. ``timeout_s`` is ``etcd.lookup_timeout_s``: a read slower than it is a miss, so tests that check
    what a read returns give it a busy machine's time (the default, 0.25 s, is for serving)."""
    opened: list[EtcdBlockIndex] = []

    def factory(node: str, fingerprints: tuple[FingerprintDigest, ...] = (), index: str = "lookup",
                cache_s: float = 0.3, endpoints: tuple[str, ...] | None = None,
                timeout_s: float = 5.0) -> EtcdBlockIndex:
        # a lease of 10 s: the tests here read entries across sleeps of 2 s, and a 3 s lease whose keep-alive
        # was starved on a busy host lapsed in one (every entry gone: 0 where 2 were held)
        base = agent_config(node, cluster_name, endpoints or etcd.endpoints, ttl=10)
        config = dataclasses.replace(base, etcd=dataclasses.replace(base.etcd, index=index, lookup_cache_s=cache_s,
                                                                    lookup_timeout_s=timeout_s, start_wait_s=5.0))
        idx = EtcdBlockIndex.open(loop, config, node_record(node), fingerprints)
        opened.append(idx)
        return idx

    yield factory
    for idx in opened:
        idx.close()


def test_owners_are_read_when_asked_and_only_what_was_asked_is_kept(open_lookup: Factory,
                                                                      fp: FingerprintDigest) -> None:
    a = open_lookup("a", (fp,), index="watch")
    b = open_lookup("b", (fp,))
    keys = make_keys(40)
    a.add_many(fp, keys[:20], TIER_CPU)
    b.add_many(fp, keys[:5], TIER_DISK)
    a.flush(10.0)
    b.flush(10.0)
    m = b.mirror(fp)
    assert isinstance(m, LookupMirror) and len(m) == 0  # nothing asked yet: nothing held in memory
    assert b.owners(fp, keys[:2] + keys[30:31]) == [{"a": TIER_CPU, "b": TIER_DISK}] * 2 + [{}]
    assert b.longest_prefix(fp, keys) == 20
    assert b.lookup(fp, keys[10:11]) == [frozenset({"a"})]
    assert len(m) == 20 and m.lookups_total == 2  # the second call read only the keys not yet asked
    assert m.wait_for(lambda w: set(w.nodes()) == {"a", "b"}, 10.0)  # node records are still followed by a watch
    # The watch mode on the same entries agrees.
    assert a.mirror(fp).wait_for(lambda w: len(w) == 20, 10.0)
    assert a.owners(fp, keys[:2]) == b.owners(fp, keys[:2])


def test_answers_are_reused_for_the_cache_time_then_read_again(open_lookup: Factory, fp: FingerprintDigest) -> None:
    a = open_lookup("a")
    b = open_lookup("b", (fp,), cache_s=2.0)  # long enough for a flush on a busy machine to fit in it
    keys = make_keys(4)
    a.add_many(fp, keys, TIER_CPU)
    a.flush(10.0)
    assert b.longest_prefix(fp, keys) == 4
    a.remove_many(fp, keys[2:])
    a.flush(10.0)
    assert b.longest_prefix(fp, keys) == 4  # within the cache time: the answer read before
    time.sleep(2.1)
    assert b.longest_prefix(fp, keys) == 2  # read again: a withdrew two
    a.close()  # its lease revoked: every entry gone at once
    time.sleep(2.1)
    assert b.owners(fp, keys) == [{}] * 4


def test_a_planner_past_the_last_read_gets_a_fresh_read(open_lookup: Factory, loop: LoopThread,
                                                        fp: FingerprintDigest) -> None:
    """A scheduler offered a hit at revision R; the worker's cached answer predates R: it reads again
    (linearizable), whatever the cache time."""
    a = open_lookup("a")
    b = open_lookup("b", (fp,), cache_s=60.0)
    keys = make_keys(3)
    assert b.owners(fp, keys) == [{}] * 3  # asked before a announced: cached as nobody's
    a.add_many(fp, keys, TIER_CPU)
    a.flush(10.0)
    _, revision = loop.run(a.client.get(b"/"), 10.0)
    assert b.owners(fp, keys) == [{}] * 3  # still the cached answer
    m = b.mirror(fp)
    b.owners(fp, make_keys(2))  # a later read of other keys: this mirror's latest read is past `revision`
    assert m.blocks_revision >= revision and b.owners(fp, keys) == [{}] * 3
    m.prefetch(keys, revision)  # these keys were read below it: read again
    assert m.blocks_revision >= revision and b.owners(fp, keys) == [{"a": TIER_CPU}] * 3


def test_a_scheduler_side_reader_looks_up_too(open_lookup: Factory, loop: LoopThread, etcd: EtcdServer,
                                              cluster_name: str, fp: FingerprintDigest) -> None:
    a = open_lookup("a")
    keys = make_keys(6)
    a.add_many(fp, keys[:4], TIER_CPU)
    a.flush(10.0)
    base = agent_config("sched", cluster_name, etcd.endpoints)
    config = dataclasses.replace(base, etcd=dataclasses.replace(base.etcd, index="lookup", lookup_timeout_s=5.0))
    reader = IndexReader.open(loop, config, fp)
    try:
        assert isinstance(reader.mirror, LookupMirror)
        assert reader.longest_prefix(keys) == 4
        assert reader.longest_prefix(keys, also_held=set(keys[4:5])) == 5
        assert reader.owners(keys[3:5]) == [{"a": TIER_CPU}, {}]
    finally:
        reader.close()


def test_on_the_loop_thread_a_lookup_answers_from_memory_without_blocking(open_lookup: Factory, loop: LoopThread,
                                                                         fp: FingerprintDigest) -> None:
    a = open_lookup("a")
    b = open_lookup("b", (fp,))
    keys = make_keys(2)
    a.add_many(fp, keys, TIER_CPU)
    a.flush(10.0)
    m = b.mirror(fp)

    async def on_loop() -> int:
        m.prefetch(keys)  # would deadlock if it blocked on the loop it runs on
        return m.longest_prefix(keys)

    assert loop.run(on_loop(), 5.0) == 0  # never asked: a miss
    assert b.longest_prefix(fp, keys) == 2  # from another thread: read


def test_etcd_gone_means_misses_within_the_lookup_timeout_then_no_waiting(open_lookup: Factory, loop: LoopThread,
                                                          fp: FingerprintDigest, cluster_name: str) -> None:
    """A private etcd that is then killed: a lookup costs at most its timeout and answers nobody."""
    with EtcdServer(unsafe_no_fsync=True) as own:
        a = open_lookup("a", endpoints=own.endpoints)
        b = open_lookup("b", (fp,), endpoints=own.endpoints, cache_s=0.0, timeout_s=0.25)
        keys = make_keys(3)
        a.add_many(fp, keys, TIER_CPU)
        a.flush(10.0)
        assert b.longest_prefix(fp, keys) == 3
        own.kill_member(0)
        m = b.mirror(fp)
        assert isinstance(m, LookupMirror)
        failures = m.lookup_failures
        t0 = time.monotonic()
        held = b.longest_prefix(fp, make_keys(3))  # never asked before: nothing to fall back on
        assert time.monotonic() - t0 < 0.25 + 1.0  # etcd.lookup_timeout_s, with room for a busy host
        assert held == 0 and m.lookup_failures == failures + 1
        # Right after a failure, lookups answer from what is known instead of waiting again (a scheduler
        # asks for every waiting request on every step).
        t0 = time.monotonic()
        assert b.longest_prefix(fp, make_keys(3)) == 0 and m.lookup_failures == failures + 1
        assert time.monotonic() - t0 < 0.2
