"""One rule for "usable owner": the scheduler side counts a chunk as held only by owners its
worker could pull from (``peers.compatible``), so a rolling upgrade (another wire version), a
mixed-TLS cluster or an owner without a common transport never turns into an offered hit whose
load then fails. Real etcd, real index sessions, the scheduler's reader."""

from __future__ import annotations

import dataclasses
import functools

from conftest import agent_config, make_keys, node_record

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.ids import WIRE_VERSION
from lmcache_p2p.index.reader import IndexReader
from lmcache_p2p.keys import FingerprintDigest
from lmcache_p2p.peers import compatible

OWNERS = {
    "same": {},
    "old-wire": {"wire_version": WIRE_VERSION - 1},
    "tls": {"tls": True},
    "nixl-only": {"transports": ("nixl",), "addresses": {"nixl": "127.0.0.1:7471"}},
    "no-address": {"addresses": {}},
}


def test_compatible_is_the_rule_both_sides_apply() -> None:
    usable = functools.partial(compatible, tls=False, transports=("tcp",))
    for node, change in OWNERS.items():
        record = dataclasses.replace(node_record(node), **change)  # type: ignore[arg-type]
        assert usable(record) == (node == "same"), node
    assert not usable(None)
    assert compatible(dataclasses.replace(node_record("t"), tls=True), tls=True, transports=("tcp",))
    assert compatible(dataclasses.replace(node_record("n"), **OWNERS["nixl-only"]),  # type: ignore[arg-type]
                      tls=False, transports=("nixl", "tcp"))
    address = node_record("x").peer()
    assert address is not None and (address.host, address.port, address.node_id) == ("127.0.0.1", 7470, "x")


def test_the_scheduler_counts_no_chunk_of_an_owner_its_worker_cannot_pull(open_index, etcd, cluster_name,
                                                                          loop: LoopThread,
                                                                          fp: FingerprintDigest) -> None:
    keys = {node: make_keys(4) for node in OWNERS}
    for node, change in OWNERS.items():
        index = open_index(node, (fp,))
        index.set_record(dataclasses.replace(node_record(node), **change))  # type: ignore[arg-type]
        index.add_many(fp, keys[node], 1)
        index.flush(5.0)
    reader = IndexReader.open(loop, agent_config("scheduler", cluster_name, etcd.endpoints), fp)
    try:
        assert reader.mirror.wait_for(lambda m: len(m) == 4 * len(OWNERS) and len(m.nodes()) == len(OWNERS)
                                      and m.nodes()["old-wire"].wire_version == WIRE_VERSION - 1
                                      and m.nodes()["tls"].tls and not m.nodes()["no-address"].addresses, 10.0)
        usable = functools.partial(compatible, tls=False, transports=("tcp",))
        for node in OWNERS:
            assert reader.longest_prefix(keys[node]) == 4  # held, by the index's count
            assert reader.longest_prefix(keys[node], usable=usable) == (4 if node == "same" else 0), node
        # A chunk held by a usable owner and an unusable one counts; the run ends at the first chunk
        # only unusable owners hold.
        assert reader.longest_prefix(keys["same"][:2] + keys["tls"][:1], usable=usable) == 2
    finally:
        reader.close()
