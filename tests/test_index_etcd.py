"""Session, publisher and mirror against a real single-member etcd."""

from __future__ import annotations

import time

from conftest import IndexFactory, make_keys

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.ids import TIER_CPU, TIER_DISK, NodeId
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.etcd_index import EtcdBlockIndex
from lmcache_p2p.index.etcd_server import EtcdServer
from lmcache_p2p.index.mirror import Mirror
from lmcache_p2p.index.schema import decode_block_key
from lmcache_p2p.keys import ChunkKey, FingerprintDigest


def fresh_read(loop: LoopThread, index: EtcdBlockIndex, fp: FingerprintDigest) -> dict[ChunkKey, dict[NodeId, int]]:
    """The block entries of ``fp`` straight from etcd, shaped like ``Mirror.snapshot()``."""
    prefix = index.schema.blocks_of(fp)
    kvs, _ = loop.run(index.client.get_prefix(prefix), 10.0)
    out: dict[ChunkKey, dict[NodeId, int]] = {}
    for kv in kvs:
        key, node = decode_block_key(len(prefix), kv.key)
        out.setdefault(key, {})[node] = kv.value[0]
    return out


def test_publish_lookup_and_longest_prefix(open_index: IndexFactory, fp: FingerprintDigest) -> None:
    a = open_index("a")
    b = open_index("b", (fp,))
    keys = make_keys(300)
    a.add_many(fp, keys[:200], TIER_CPU)
    b.add_many(fp, keys[:50], TIER_DISK)
    a.flush(10.0)
    b.flush(10.0)
    m = b.mirror(fp)
    # b's own 50 entries and both node records reach its mirror through the watch too: wait for
    # everything asserted below, not only a's 200 entries
    assert m.wait_for(lambda m: sum(len(o) for o in m.snapshot().values()) == 250 and set(m.nodes()) == {"a", "b"},
                      10.0)
    owners = b.lookup(fp, keys[:3] + keys[100:101] + keys[250:251])
    assert owners == [frozenset({"a", "b"})] * 3 + [frozenset({"a"}), frozenset()]
    assert m.owners(keys[0]) == {"a": TIER_CPU, "b": TIER_DISK}
    assert b.longest_prefix(fp, keys) == 200
    assert b.longest_prefix(fp, keys[250:] + keys[:10]) == 0
    assert set(b.nodes()) == {"a", "b"}
    assert b.nodes()[NodeId("a")].addresses == {"tcp": "127.0.0.1:7470"}


def test_remove_and_coalescing(open_index: IndexFactory, fp: FingerprintDigest, loop: LoopThread) -> None:
    a = open_index("a", (fp,))
    keys = make_keys(1000)
    a.add_many(fp, keys, TIER_CPU)
    a.remove_many(fp, keys[:10])  # usually before any flush: then these never reach etcd
    a.flush(10.0)
    # 990 puts in 8 txns of <= 128 ops, not one per chunk; on a busy host the 3 ms coalescing window can
    # close between the two calls (seen in a suite run): 1,000 puts in 8 txns, then the 10 deletes in one.
    assert a.publisher.txns_total <= 9
    assert a.publisher.pending == 0 and a.publisher.lag_s == 0.0
    a.remove_many(fp, keys[10:20])
    a.add(fp, keys[20], TIER_DISK)
    a.flush(10.0)
    m = a.mirror(fp)
    assert m.wait_for(lambda m: len(m) == 980 and m.owners(keys[20]) == {"a": TIER_DISK}, 10.0)
    assert fresh_read(loop, a, fp) == m.snapshot()


def test_close_removes_entries_at_once(open_index: IndexFactory, fp: FingerprintDigest) -> None:
    a = open_index("a")
    b = open_index("b", (fp,))
    a.add_many(fp, make_keys(500), TIER_CPU)
    a.flush(10.0)
    m = b.mirror(fp)
    assert m.wait_for(lambda m: len(m) == 500, 10.0)
    t0 = time.monotonic()
    a.close()
    assert m.wait_for(lambda m: len(m) == 0 and "a" not in m.nodes(), 2.0)
    assert time.monotonic() - t0 < 2.0  # revoke, not TTL expiry


def test_orphaned_session_expires_after_ttl(open_index: IndexFactory, fp: FingerprintDigest,
                                            loop: LoopThread) -> None:
    a = open_index("a", ttl=2)
    b = open_index("b", (fp,))
    a.add_many(fp, make_keys(20), TIER_CPU)
    a.flush(10.0)
    m = b.mirror(fp)
    assert m.wait_for(lambda m: len(m) == 20, 10.0)
    lease = a.session.lease_id
    loop.run(a.session.orphan(), 5.0)
    left = loop.run(a.client.lease.time_to_live(lease, timeout=5.0), 10.0)
    assert left.TTL > 0 and len(m) == 20  # orphan() does not revoke: the lease runs out by itself...
    assert m.wait_for(lambda m: len(m) == 0, 2 + 2.0)  # ...and takes the entries with it


def test_two_fingerprints_never_mix(open_index: IndexFactory, fp: FingerprintDigest) -> None:
    other = FingerprintDigest(bytes(16))
    a = open_index("a", (fp, other))
    keys = make_keys(30)
    a.add_many(fp, keys[:20], TIER_CPU)
    a.add_many(other, keys[10:], TIER_CPU)
    a.flush(10.0)
    assert a.mirror(fp).wait_for(lambda m: len(m) == 20, 10.0)
    assert a.mirror(other).wait_for(lambda m: len(m) == 20, 10.0)
    assert a.longest_prefix(fp, keys) == 20
    assert a.lookup(fp, keys[20:]) == [frozenset()] * 10
    assert a.lookup(other, keys[:10]) == [frozenset()] * 10
    assert set(a.mirror(fp).snapshot()) == set(keys[:20])


def test_lost_lease_reregisters_everything(open_index: IndexFactory, fp: FingerprintDigest,
                                           loop: LoopThread) -> None:
    a = open_index("a", (fp,), ttl=3)
    keys = make_keys(200)
    a.add_many(fp, keys, TIER_CPU)
    a.flush(10.0)
    m = a.mirror(fp)
    assert m.wait_for(lambda m: len(m) == 200, 10.0)
    old = a.session.lease_id
    loop.run(a.client.revoke(old), 5.0)  # as if etcd expired it during a partition
    assert m.wait_for(lambda m: a.session.lease_id != old and len(m) == 200 and "a" in m.nodes(), 10.0)
    assert a.session.lost is False
    a.flush(10.0)
    assert fresh_read(loop, a, fp) == m.snapshot()


def test_watch_compaction_forces_resync(open_index: IndexFactory, fp: FingerprintDigest, loop: LoopThread) -> None:
    a = open_index("a", (fp,))
    keys = make_keys(400)
    a.add_many(fp, keys[:300], TIER_CPU)
    a.flush(10.0)
    m = a.mirror(fp)
    assert m.wait_for(lambda m: len(m) == 300, 10.0)
    loop.run(m.stop(), 5.0)  # the watch is gone; changes go on without it
    a.remove_many(fp, keys[:100])
    a.add_many(fp, keys[300:], TIER_DISK)
    a.flush(10.0)

    async def compact() -> None:
        _, _, rev = await a.client.status()
        await a.client.compact(rev)
    loop.run(compact(), 10.0)
    loop.run(m.start(10.0), 15.0)  # resumes from an old revision: compacted -> resync
    assert m.wait_for(lambda m: m.resyncs == 2 and len(m) == 300, 10.0)
    assert m.snapshot() == fresh_read(loop, a, fp)
    assert a.longest_prefix(fp, keys[100:]) == 300


def test_mirror_of_plain_client(etcd: EtcdServer, open_index: IndexFactory, fp: FingerprintDigest,
                                loop: LoopThread) -> None:
    """A scheduler-side reader: a Mirror on its own client, no session."""
    a = open_index("a")
    a.add_many(fp, make_keys(10), TIER_CPU)
    a.flush(10.0)

    async def follow() -> tuple[EtcdClient, Mirror]:
        client = EtcdClient(a.client.config)
        await client.connect()
        mirror = Mirror(client, a.schema, fp)
        await mirror.start(5.0)
        return client, mirror
    client, mirror = loop.run(follow(), 10.0)
    try:
        assert len(mirror) == 10 and set(mirror.nodes()) == {"a"}
    finally:
        loop.run(mirror.stop(), 5.0)
        loop.run(client.close(), 5.0)
