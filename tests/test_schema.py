"""The etcd schema's decoders: everything read back from etcd is validated, rejects are counted."""

from __future__ import annotations

import hashlib
import logging

import msgpack
import pytest

from lmcache_p2p.chunk import ChunkHeader, make_header
from lmcache_p2p.config import AgentConfig
from lmcache_p2p.errors import MalformedRecord
from lmcache_p2p.explain import explain
from lmcache_p2p.ids import NODE_ID_RE, OBJECTS, TIER_CODES, NodeId, TierCode
from lmcache_p2p.index.generation import MAX_REVISION, cap_epoch, epoch_generation, epoch_revision, make_epoch
from lmcache_p2p.index.records import MAX_GENERATION, Generation, Invalidation, decode_generation, decode_invalidation
from lmcache_p2p.index.schema import (
    NodeRecord,
    Rejects,
    Schema,
    Served,
    decode_block_key,
    decode_node_key,
    decode_node_record,
    decode_tier,
    tenant_digest,
)
from lmcache_p2p.invalidation import matches
from lmcache_p2p.keys import ChunkKey, FingerprintDigest

GOOD = {"node_id": "n-1", "addresses": {"tcp": "10.0.0.1:7470"}, "transports": ["tcp"],
        "served": {"ab" * 16: {"model": "m", "tenant": "", "heads": [0, 2, 4], "layout": {"model_id": "m"}}},
        "capacities": {"cpu": 1 << 30}, "wire_version": 1, "started_at": 1.5}
OLD = {**{k: v for k, v in GOOD.items() if k != "served"}, "fingerprints": ["ab" * 16]}  # before ``served``


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
    {"addresses": {"tcp": "127.0.0.1:\u00b2"}},  # a digit to str.isdigit, not to int(): ValueError before
    {"addresses": {"tcp": "no-port"}},
    {"addresses": 7},
    {"addresses": {"tcp": 7470}},
    {"transports": "tcp"},
    {"transports": [1]},
    {"served": ["ab" * 16]},
    {"served": {"not-hex": {}}},
    {"served": {"AB" * 16: {}}},
    {"served": {"ab" * 16: 7}},
    {"served": {"ab" * 16: {"model": 7}}},
    {"served": {"ab" * 16: {"tenant": ["acme"]}}},
    {"served": {"ab" * 16: {"heads": [0, 2]}}},
    {"served": {"ab" * 16: {"heads": [2, 2, 4]}}},
    {"served": {"ab" * 16: {"heads": [0, 2, 1 << 16]}}},
    {"served": {"ab" * 16: {"heads": [0, True, 4]}}},
    {"served": {"ab" * 16: {"heads": "all"}}},
    {"served": {"ab" * 16: {"layout": {"model_id": 1.5}}}},
    {"served": {"ab" * 16: {"layout": {f"f{i}": 1 for i in range(33)}}}},
    {"served": {"ab" * 16: {"layout": [1]}}},
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


@pytest.mark.parametrize("change", [
    {"fingerprints": ["not-hex"]},
    {"fingerprints": "ab" * 16},
    {"models": {"ab" * 16: 7}},
    {"tenants": {"ab" * 16: 7}},
    {"heads": {"ab" * 16: [0, 5, 4]}},
    {"heads": {"ab" * 16: "all"}},
    {"layouts": {"ab" * 16: {"model_id": [1]}}},
    {"layouts": {"ab" * 16: 7}},
])
def test_malformed_fields_of_records_before_served_are_rejected_naming_the_field(change: dict) -> None:
    with pytest.raises(MalformedRecord) as exc:
        decode_node_record(msgpack.packb({**OLD, **change}), decode_node_key(0, b"n-1"))
    assert exc.value.kind == "node record" and next(iter(change)) in str(exc.value)


def test_served_decodes_to_one_map() -> None:
    record = decode_node_record(msgpack.packb(GOOD))
    assert record.served == {"ab" * 16: Served("m", "", (0, 2, 4), {"model_id": "m"})}
    assert record.fingerprints == ("ab" * 16,) and record.heads_of("ab" * 16, 4) == (0, 2)
    assert record.heads_of("cd" * 16, 4) == (0, 4)  # a fingerprint not served: every head (as before)
    every = decode_node_record(msgpack.packb({**GOOD, "served": {"cd" * 16: {"heads": None}, "ab" * 16: {}}}))
    assert every.served == {"cd" * 16: Served(), "ab" * 16: Served()} and every.fingerprints == ("cd" * 16, "ab" * 16)
    assert every.heads_of("ab" * 16, 4) == (0, 4) and every.served["ab" * 16].partial_heads is None
    newer = {**GOOD, "served": {"ab" * 16: {**GOOD["served"]["ab" * 16], "added_by_a_newer_version": 1}}}
    assert decode_node_record(msgpack.packb(newer)) == record
    assert NodeRecord.unpack(record.pack()) == record
    # what a node of the previous release reads during a rolling upgrade: the served list and TP heads
    legacy = msgpack.unpackb(record.pack())
    assert legacy["fingerprints"] == ["ab" * 16] and legacy["heads"] == {"ab" * 16: [0, 2, 4]}


def test_records_before_served_decode_to_the_same_map() -> None:
    """A rolling upgrade: an older node's record (four maps beside ``fingerprints``) reads as ``served``."""
    fp, other = "ab" * 16, "cd" * 16
    old = {**OLD, "fingerprints": [fp, other], "models": {fp: "m", other: "m2", "ef" * 16: "dropped"},
           "tenants": {fp: tenant_digest("acme")}, "heads": {fp: [0, 2, 4]},
           "layouts": {fp: {"model_id": "m", "tenant": tenant_digest("acme")}}}
    record = decode_node_record(msgpack.packb(old), decode_node_key(0, b"n-1"))
    assert record.served == {fp: Served("m", tenant_digest("acme"), (0, 2, 4),
                                        {"model_id": "m", "tenant": tenant_digest("acme")}),
                             other: Served("m2")}  # no heads entry: every head, as before
    assert record.fingerprints == (fp, other) and record.heads_of(other, 4) == (0, 4)
    assert NodeRecord.unpack(record.pack()) == record  # written back as ``served``
    assert decode_node_record(msgpack.packb(OLD)).served == {fp: Served()}


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
    # the object store owns block entries; no node, certificate, handshake or uploader can take its name
    assert decode_block_key(len(prefix), schema.block(fp, key, OBJECTS)) == (key, OBJECTS)
    for bad_owner in (b"@n-1", b"n@1", b"@objectsx"):
        with pytest.raises(MalformedRecord):
            decode_block_key(len(prefix), prefix + key.hex().encode() + b"/" + bad_owner)
    for not_a_node in (OBJECTS.encode(), b"a@b"):
        with pytest.raises(MalformedRecord):
            decode_node_key(0, not_a_node)
    assert not NODE_ID_RE.fullmatch(OBJECTS)
    assert [decode_tier(bytes((t,))) for t in TierCode] == [0, 1, 2, 3]
    for bad_value in (b"", b"\x04", b"\x01\x01"):
        with pytest.raises(MalformedRecord):
            decode_tier(bad_value)
    assert TIER_CODES == {"gpu": 0, "cpu": 1, "disk": 2, "object": 3}


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


# ---- tenant digests: a salt never enters etcd ------------------------------------------------------
def test_node_records_carry_the_tenant_digest_never_the_salt() -> None:
    layout = {"model_id": "m", "kv_dtype": "bfloat16", "tenant_salt": "acme-secret"}
    record = NodeRecord(NodeId("n-1"), {"tcp": "10.0.0.1:7470"}, ("tcp",),
                        served={"ab" * 16: Served("m", tenant_digest("acme-secret"), layout=layout)})
    packed = record.pack()
    assert b"acme-secret" not in packed
    digest = tenant_digest("acme-secret")
    assert record.served["ab" * 16].layout == {"model_id": "m", "kv_dtype": "bfloat16", "tenant": digest}
    assert NodeRecord.unpack(packed) == record
    no_tenant = Served(layout={"model_id": "m", "tenant_salt": ""})
    assert no_tenant.layout == {"model_id": "m", "tenant": ""}
    # domain-separated: not the bare hash of the salt, and one salt -> one digest
    assert tenant_digest("acme-secret") != hashlib.sha256(b"acme-secret").hexdigest()
    assert len(tenant_digest("x")) == 64 and tenant_digest("x") != tenant_digest("y")


def test_old_records_holding_a_raw_salt_decode_to_its_digest() -> None:
    old = {**OLD, "tenants": {"ab" * 16: "acme"}, "layouts": {"ab" * 16: {"model_id": "m", "tenant_salt": "acme"}}}
    record = decode_node_record(msgpack.packb(old), decode_node_key(0, b"n-1"))
    assert record.served == {"ab" * 16: Served(tenant=tenant_digest("acme"),
                                               layout={"model_id": "m", "tenant": tenant_digest("acme")})}
    assert b"acme" not in record.pack()
    salted = {"ab" * 16: {"tenant": "acme", "layout": {"model_id": "m", "tenant_salt": "acme"}}}
    assert decode_node_record(msgpack.packb({**GOOD, "served": salted})) == record  # in ``served`` too
    inv = decode_invalidation(b"i1", msgpack.packb({"kind": "tenant", "value": "acme", "issued_at": 1.0}), 9,
                              prefix_len=0)
    assert inv == Invalidation("i1", "tenant", tenant_digest("acme"), 1.0, 9)
    assert decode_invalidation(b"i1", inv.pack(), 9, prefix_len=0) == inv
    with pytest.raises(ValueError, match="tenant digest"):
        Invalidation("i2", "tenant", "acme", 0.0)  # what is written is always a digest
    with pytest.raises(MalformedRecord):
        decode_node_record(msgpack.packb({**OLD, "tenants": {"ab" * 16: 7}}))


def test_explain_names_a_tenant_invalidation_by_its_digest() -> None:
    salt, fp_hex = "acme-secret", "cd" * 16
    record = NodeRecord(NodeId("n-1"), {"tcp": "10.0.0.1:7470"}, ("tcp",),
                        served={fp_hex: Served("m", layout={"model_id": "m", "tenant_salt": salt})})
    tokens = list(range(600))
    config = AgentConfig(node_id="n-x")
    verdicts = explain(config, fp_hex, tokens, {record.node_id: record}, {fp_hex: [{}, {}, {}]},
                       [("i1", "tenant", tenant_digest(salt))], check_alive=False)
    assert [v.reason for v in verdicts] == ["invalidated"] * 3
    assert salt not in repr(verdicts)
    other = explain(config, fp_hex, tokens, {record.node_id: record}, {fp_hex: [{}, {}, {}]},
                    [("i1", "tenant", tenant_digest("globex"))], check_alive=False)
    assert [v.reason for v in other] == ["no-owner"] * 3


# ---- generations and epochs --------------------------------------------------------------------------
def test_generation_records() -> None:
    gen = Generation(0xABCDE, 5.0)
    assert decode_generation(gen.pack(), 17) == Generation(0xABCDE, 5.0, 17)
    assert Generation.new(avoid=3).id != 3 and 1 <= Generation.new().id <= MAX_GENERATION
    for bad in (b"garbage", msgpack.packb({"id": 0}), msgpack.packb({"id": 1 << 24}), msgpack.packb({"id": "7"}),
                msgpack.packb({"id": True}), msgpack.packb([1]), msgpack.packb({"created_at": 1.0})):
        with pytest.raises(MalformedRecord) as exc:
            decode_generation(bad, 1)
        assert exc.value.kind == "generation"
    assert Schema("c").generation == b"/lmcache-p2p/v1/c/generation"


def test_epochs_name_their_generation_and_are_capped_at_the_receivers() -> None:
    mine = make_epoch(7, 1000)
    assert (epoch_generation(mine), epoch_revision(mine)) == (7, 1000)
    assert make_epoch(7, 1 << 50) == make_epoch(7, MAX_REVISION)  # saturates, never spills into the generation
    assert cap_epoch(make_epoch(7, 400), mine) == make_epoch(7, 400)  # below ours: kept
    assert cap_epoch(make_epoch(7, 5000), mine) == mine  # a peer ahead of us (or lying): ours
    assert cap_epoch((1 << 64) - 1, mine) == make_epoch(7, 0)  # another generation's: below every barrier of ours
    assert cap_epoch(123, mine) == make_epoch(7, 0)  # written before generations existed (id 0)
    inv = Invalidation("i", "node", "n-1", 0.0, revision=500)
    fp = FingerprintDigest(bytes(16))

    def covered(epoch: int, generation: int = 7) -> bool:
        return matches(inv, make_header(ChunkKey(bytes(16)), fp, b"x", 1, epoch=epoch), None, "n-1", generation)

    assert covered(make_epoch(7, 499)) and not covered(make_epoch(7, 500))
    assert covered(make_epoch(3, 10_000)) and covered(make_epoch(3, MAX_REVISION))  # an older history's chunk
    assert covered(make_epoch(7, 500), generation=0)  # generation being replaced: nothing held is current
