"""The in-memory BlockIndex fake and the schema helpers."""

from __future__ import annotations

import os

from conftest import make_keys

from lmcache_p2p.ids import TIER_CPU, TIER_GPU, NodeId
from lmcache_p2p.index.protocol import BlockIndex
from lmcache_p2p.index.schema import NodeRecord, Schema, decode_block_key
from lmcache_p2p.keys import ChunkKey, FingerprintDigest
from lmcache_p2p.testing.memory_index import MemoryIndex, MemoryMesh


def _record(node: str) -> NodeRecord:
    return NodeRecord(NodeId(node), {"tcp": "10.0.0.1:7470"}, ("tcp", "nixl"))


def test_memory_index_shares_a_mesh() -> None:
    mesh = MemoryMesh()
    a: BlockIndex = MemoryIndex(mesh, _record("a"))
    b: BlockIndex = MemoryIndex(mesh, _record("b"))
    fp = FingerprintDigest(os.urandom(16))
    keys = make_keys(10)
    a.add_many(fp, keys[:6], TIER_CPU)
    b.add_many(fp, keys[:3], TIER_GPU)
    assert b.lookup(fp, keys[:1]) == [frozenset({"a", "b"})]
    assert b.longest_prefix(fp, keys) == 6
    a.remove_many(fp, keys[:1])
    assert a.longest_prefix(fp, keys) == 6 and a.lookup(fp, keys[:1]) == [frozenset({"b"})]
    assert a.longest_prefix(FingerprintDigest(bytes(16)), keys) == 0
    mesh.expire(NodeId("a"))
    assert set(b.nodes()) == {"b"} and b.longest_prefix(fp, keys) == 3
    b.close()
    assert b.nodes() == {} and b.lookup(fp, keys[:1]) == [frozenset()]


def test_node_record_round_trip_tolerates_new_fields() -> None:
    rec = _record("node-1")
    assert NodeRecord.unpack(rec.pack()) == rec
    import msgpack
    raw = msgpack.unpackb(rec.pack())
    raw["added_in_v2"] = 1
    assert NodeRecord.unpack(msgpack.packb(raw)) == rec


def test_block_key_layout() -> None:
    schema = Schema("prod")
    fp, key = FingerprintDigest(bytes(range(16))), ChunkKey(bytes(range(16, 32)))
    k = schema.block(fp, key, NodeId("n-1"))
    assert k == b"/lmcache-p2p/v1/prod/blocks/" + fp.hex().encode() + b"/" + key.hex().encode() + b"/n-1"
    assert k.startswith(schema.blocks_of(fp))
    assert decode_block_key(len(schema.blocks_of(fp)), k) == (key, "n-1")
