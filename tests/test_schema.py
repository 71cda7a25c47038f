"""The etcd schema's decoders: everything read back from etcd is validated, rejects are counted."""

from __future__ import annotations

import logging

import msgpack
import pytest

from lmcache_p2p.chunk import ChunkHeader, make_header
from lmcache_p2p.errors import MalformedRecord
from lmcache_p2p.index.schema import (
    Invalidation,
    NodeRecord,
    Rejects,
    Schema,
    TierCode,
    decode_block_key,
    decode_invalidation,
    decode_node_key,
    decode_node_record,
    decode_tier,
)
from lmcache_p2p.keys import ChunkKey, FingerprintDigest
from lmcache_p2p.tiers.base import TIER_CODES

GOOD = {"node_id": "n-1", "addresses": {"tcp": "10.0.0.1:7470"}, "transports": ["tcp"],
        "fingerprints": ["ab" * 16], "capacities": {"cpu": 1 << 30}, "wire_version": 1, "started_at": 1.5}


def test_a_good_record_round_trips() -> None:
    record = decode_node_record(msgpack.packb(GOOD), decode_node_key(0, b"n-1"))
    assert record.addresses == {"tcp": "10.0.0.1:7470"} and record.transports == ("tcp",)
    assert NodeRecord.unpack(record.pack()) == record
    assert decode_node_record(msgpack.packb({**GOOD, "added_by_a_newer_version": [1, 2]})) == record
    deviating = decode_node_record(msgpack.packb({**GOOD, "config_deviations": {"chunk_size": "restart"}}))
    assert deviating.config_deviations == {"chunk_size": "restart"} and NodeRecord.unpack(deviating.pack()) == deviating


@pytest.mark.parametrize("change", [
    {"addresses": {"tcp": "127.0.0.1:99999"}},  # port out of range: OverflowError in connect() before
    {"addresses": {"tcp": "127.0.0.1:0"}},
    {"addresses": {"tcp": "no-port"}},
    {"addresses": 7},
    {"addresses": {"tcp": 7470}},
    {"transports": "tcp"},
    {"transports": [1]},
    {"fingerprints": ["not-hex"]},
    {"capacities": {"cpu": -1}},
    {"capacities": {"cpu": True}},
    {"wire_version": "1"},
    {"wire_version": True},
    {"started_at": float("nan")},
    {"metrics_url": 5},
    {"node_id": 5},
    {"node_id": "other"},  # does not match its key
    {"node_id": "bad/id"},
    {"config_deviations": {"chunk_size": "maybe"}},
    {"config_deviations": {"chunk_size": 1}},
    {"config_deviations": {f"f{i}": "node" for i in range(65)}},
    {"role": "router"},
])
def test_malformed_fields_are_rejected_naming_the_field(change: dict) -> None:
    with pytest.raises(MalformedRecord) as exc:
        decode_node_record(msgpack.packb({**GOOD, **change}), decode_node_key(0, b"n-1"))
    assert exc.value.kind == "node record"
    assert next(iter(change)) in str(exc.value)


@pytest.mark.parametrize("data", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"addresses": {}}),
                                  msgpack.packb({1: 2}), b"x" * (70 << 10)])
def test_garbage_values_are_rejected(data: bytes) -> None:
    with pytest.raises(MalformedRecord):
        decode_node_record(data)


def test_keys_and_tier_bytes() -> None:
    schema = Schema("c")
    fp, key = FingerprintDigest(bytes(16)), ChunkKey(bytes(range(16)))
    prefix = schema.blocks_of(fp)
    assert decode_block_key(len(prefix), schema.block(fp, key, "n-1")) == (key, "n-1")  # type: ignore[arg-type]
    for bad in (prefix + b"not-hex/n-1", prefix + b"AB" * 16 + b"/n-1", prefix + b"ab" * 16 + b"n-1",
                prefix + b"ab" * 16 + b"/\xff\xfe", prefix + b"ab" * 16 + b"/"):
        with pytest.raises(MalformedRecord):
            decode_block_key(len(prefix), bad)
    with pytest.raises(MalformedRecord):
        decode_node_key(0, b"\xff\xfe")
    assert [decode_tier(bytes((t,))) for t in TierCode] == [0, 1, 2]
    for bad_value in (b"", b"\x03", b"\x01\x01"):
        with pytest.raises(MalformedRecord):
            decode_tier(bad_value)
    assert TIER_CODES == {"gpu": 0, "cpu": 1, "disk": 2}


def test_invalidation_records() -> None:
    inv = Invalidation("i1", "fingerprint", "ab" * 8, 5.0)
    assert decode_invalidation(b"x/i1", inv.pack(), 42, prefix_len=2) == Invalidation("i1", "fingerprint", "ab" * 8,
                                                                                     5.0, 42)
    for bad in (b"garbage", msgpack.packb({"kind": "everything", "value": "x"}), msgpack.packb({"kind": "node"}),
                msgpack.packb({"kind": "fingerprint", "value": "abc"}), msgpack.packb([1])):
        with pytest.raises(MalformedRecord):
            decode_invalidation(b"i2", bad, 1, prefix_len=0)


def test_rejects_count_every_time_and_log_each_key_once(caplog: pytest.LogCaptureFixture) -> None:
    rejects = Rejects()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            rejects.add(MalformedRecord("node key", "bad"), b"k1")
        rejects.add(MalformedRecord("block key", "bad"), b"k2")
    assert rejects.counts == {"node key": 3, "block key": 1} and rejects.total() == 4
    assert len([r for r in caplog.records if "skipping" in r.getMessage()]) == 2


def test_chunk_header_carries_the_epoch() -> None:
    header = make_header(ChunkKey(bytes(16)), FingerprintDigest(bytes(16)), b"payload", 7, epoch=123456789012)
    assert ChunkHeader.unpack(header.pack()) == header and header.epoch == 123456789012
