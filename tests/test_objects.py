"""The object tier: a real SeaweedFS (``weed mini``), real etcd, real agents.

A chunk that left every node's memory and disk is loaded from the store on a node that never saw it,
byte for byte; a corrupted, forged, oversized or replayed object is rejected and deleted; a bucket
reader finds no plaintext KV; an invalidated chunk's object is never loaded and is cleaned up (a
tenant's also when no running node serves its fingerprint); the store SIGSTOPped or SIGKILLed costs a
load no more than its deadline and never makes a save wait. Agents run in this process with small CPU
pools (8 slots of the tiny layout's 512 KiB chunks), so storing a few prompts evicts the first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_helpers import SECRET, config, wait_until
from prometheus_client import CollectorRegistry
from test_agent_mesh import TOKENS, load_and_check

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.chunk import make_header
from lmcache_p2p.cli import invalidate, status
from lmcache_p2p.config import ObjectsConfig
from lmcache_p2p.errors import ChunkError, ConfigError, MalformedRecord, ObjectMissing, ObjectStoreError
from lmcache_p2p.ids import OBJECTS, TIER_OBJECT, NodeId
from lmcache_p2p.index.client import op_delete
from lmcache_p2p.index.quarantine import QuarantineRecord
from lmcache_p2p.index.records import ObjectMeta, decode_object_meta
from lmcache_p2p.index.schema import Schema, tenant_digest
from lmcache_p2p.invalidation import issue
from lmcache_p2p.keys import ChunkKey, FingerprintDigest
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.objects.format import PREAMBLE_SIZE, max_object_size, object_key, pack_object, unpack_object
from lmcache_p2p.objects.seaweed import SeaweedServer
from lmcache_p2p.objects.store import ObjectStore, credentials
from lmcache_p2p.objects.tier import ObjectTier
from lmcache_p2p.plan import make_plan
from lmcache_p2p.testing.synthetic import preload, synthetic_payload, synthetic_tokens

SMALL = "4MiB"  # 8 chunks


@pytest.fixture(scope="module")
def seaweed() -> Iterator[SeaweedServer]:
    with SeaweedServer() as server:
        yield server


@pytest.fixture
def s3_env(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> SeaweedServer:
    for name, value in seaweed.env.items():
        monkeypatch.setenv(name, value)
    return seaweed


def objects_agent(tmp_path: Path, cluster: str, endpoints: tuple[str, ...], name: str, server: SeaweedServer,
                  *, cpu: str = SMALL, disk: str | None = None, backoff_s: float = 0.2, tenant_salt: str = "",
                  **objects: Any) -> CacheAgent:
    tiers: dict[str, Any] = {"cpu_capacity": cpu}
    if disk is not None:
        tiers.update(disk_path=str(tmp_path / f"{name}-disk"), disk_capacity=disk)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "node_id": name, "cluster": cluster, "tiers": tiers,
        "etcd": {"endpoints": list(endpoints), "lease_ttl_s": 3, "timeout_s": 3.0},
        "transfer": {"transports": ["tcp"], "secret": SECRET, "timeout_s": 3.0, "backoff_s": backoff_s},
        "handoff": {"budget_bytes_per_s": 0},  # nothing handed to peers: eviction drops (or uploads) sole copies
        "metrics_port": 0,
        "objects": {"url": server.url, "bucket": server.bucket, "min_hits": 0, "cleanup_interval_s": 0, **objects},
        **({"layout": {"tenant_salt": tenant_salt}} if tenant_salt else {}),
    }))
    cfg = config(path)
    return CacheAgent.of(cfg, metrics=AgentMetrics(CollectorRegistry())).start()


def keys_of(a: CacheAgent, seed: int) -> list[ChunkKey]:
    return a.keys_for(synthetic_tokens(seed, TOKENS))[0]


def in_store(a: CacheAgent, keys: list[ChunkKey]) -> bool:
    assert a.index is not None
    return all(owners.get(OBJECTS) == TIER_OBJECT for owners in a.index.owners(a.fp, keys))


def ops(a: CacheAgent, op: str, result: str) -> float:
    return a.metrics.registry.get_sample_value("lmcache_p2p_object_ops_total", {"op": op, "result": result}) or 0.0


def evict_into_store(a: CacheAgent, seed: int) -> list[ChunkKey]:
    """Store prompt ``seed``, then two more: ``seed``'s 5 chunks leave the 8-slot pool and go to the store."""
    preload(a, seed, TOKENS)
    preload(a, seed + 100, TOKENS)
    preload(a, seed + 200, TOKENS)
    keys = keys_of(a, seed)
    assert wait_until(lambda: in_store(a, keys), 30), a.index.owners(a.fp, keys) if a.index else None
    assert not any(a.holds(k) for k in keys)
    return keys


def run(a: CacheAgent, coro: Any) -> Any:
    assert a.loop is not None
    return a.loop.run(coro, 30)


def raw_get(a: CacheAgent, name: str) -> bytes:
    """An object's bytes as a bucket reader gets them."""
    assert a.objects is not None
    return run(a, a.objects.store.get(name, time.monotonic() + 5, limit=64 << 20))  # type: ignore[no-any-return]


# -- the format ----------------------------------------------------------------------------------------------
def test_an_object_round_trips_sealed_and_every_forgery_is_refused():
    key, fp = ChunkKey(bytes(range(16))), FingerprintDigest(bytes(16))
    payload = bytes(range(256)) * 8
    header = make_header(key, fp, payload, 256, heads=(0, 2), epoch=7)
    secret, name = b"s3cret", "chunks/c/fp/key"
    sealed = object_key(secret, "")
    body = pack_object(header, payload, NodeId("node-a"), name, sealed)
    assert len(body) <= max_object_size(len(payload))
    got, view, node = unpack_object(body, name, key, fp, sealed)
    assert got == header and bytes(view) == payload and node == "node-a"
    assert payload[100:164] not in body and header.pack()[8:40] not in body  # nothing of the chunk in clear
    with pytest.raises(ChunkError, match="authenticate"):  # the right object moved under another chunk's name
        unpack_object(body, "chunks/c/fp/other", key, fp, sealed)
    flipped = bytearray(body)
    flipped[100] ^= 1
    with pytest.raises(ChunkError, match="authenticate"):
        unpack_object(bytes(flipped), name, key, fp, sealed)
    other_tenant = object_key(secret, tenant_digest("acme"))
    with pytest.raises(ChunkError, match="authenticate"):  # another tenant's key opens nothing
        unpack_object(body, name, key, fp, other_tenant)
    with pytest.raises(ChunkError, match="authenticate"):
        unpack_object(body, name, key, fp, object_key(b"other secret", ""))
    # Someone with write access to the bucket but not the secret: an unsealed object with a matching xxh3.
    forged = pack_object(header, payload, NodeId("x"), name, None)
    with pytest.raises(ChunkError, match="not sealed"):
        unpack_object(forged, name, key, fp, sealed)
    # Format 1 (the chunk in clear, a BLAKE3 MAC) is refused as such, not misread.
    v1 = header.pack() + payload + b"node-a" + bytes([6]) + bytes(32)
    with pytest.raises(ChunkError, match="format 1"):
        unpack_object(v1, name, key, fp, sealed)
    # Without a secret the checksum still catches a flipped bit and a truncation.
    plain = pack_object(header, payload, NodeId("node-a"), name, None)
    assert bytes(unpack_object(plain, name, key, fp, None)[1]) == payload
    bad = bytearray(plain)
    bad[PREAMBLE_SIZE + 80 + 10] ^= 0xFF
    with pytest.raises(ChunkError, match="checksum"):
        unpack_object(bytes(bad), name, key, fp, None)
    with pytest.raises(ChunkError):
        unpack_object(plain[:-40], name, key, fp, None)
    with pytest.raises(ChunkError, match="sealed"):
        unpack_object(body, name, key, fp, None)


def test_object_config_names_the_field_and_credentials_come_from_env_or_file(tmp_path):
    with pytest.raises(ConfigError, match="objects.url"):
        ObjectsConfig(url="s3://bucket")
    with pytest.raises(ConfigError, match="objects.bucket"):
        ObjectsConfig(bucket="Bad_Bucket")
    with pytest.raises(ConfigError, match="objects.max_inflight"):
        ObjectsConfig(max_inflight=0)
    assert credentials({"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}) == {
        "access_key_id": "a", "secret_access_key": "b"}
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = x\naws_secret_access_key = y\n"
                     "[other]\naws_access_key_id = p\naws_secret_access_key = q\naws_session_token = t\n")
    assert credentials({"AWS_SHARED_CREDENTIALS_FILE": str(creds)}) == {"access_key_id": "x", "secret_access_key": "y"}
    assert credentials({"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_PROFILE": "other"}) == {
        "access_key_id": "p", "secret_access_key": "q", "token": "t"}
    assert credentials({"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}) == {}
    store = ObjectStore(ObjectsConfig(url="http://127.0.0.1:1"), env={"AWS_ACCESS_KEY_ID": "AKIDSECRETLOOKING",
                                                                      "AWS_SECRET_ACCESS_KEY": "never-printed"})
    assert "never-printed" not in repr(store) and "AKID" not in repr(store)


def test_malformed_object_records_are_refused():
    schema = Schema("c")
    fp, key = FingerprintDigest(bytes(16)), ChunkKey(bytes(range(16)))
    meta = ObjectMeta(fp, key, 100, 1.5, NodeId("n"), 7, 256, (0, 2), tenant=tenant_digest("acme"))
    etcd_key = schema.object_meta(fp, key)
    assert decode_object_meta(etcd_key, meta.pack(), prefix_len=len(schema.objects)) == meta
    for bad_key, value in ((etcd_key[:-1], meta.pack()), (etcd_key, b"\x01"), (etcd_key, b"\x80"),
                           (etcd_key, ObjectMeta(fp, key, 1, 1.0, NodeId("n/../x"), 0, 1, (0, 1)).pack()),
                           (etcd_key, dataclasses.replace(meta, tenant="acme").pack())):  # a salt, not a digest
        with pytest.raises(MalformedRecord):
            decode_object_meta(bad_key, value, prefix_len=len(schema.objects))


# -- the tier, end to end ----------------------------------------------------------------------------------------
def test_a_chunk_evicted_everywhere_loads_from_the_store_after_every_agent_restarted(etcd, cluster_name, tmp_path,
                                                                                     s3_env):
    """The only node holding a prompt evicts it (its bytes go to the store), every agent stops; a node
    that never saw the prompt plans it from the store and loads it byte-exact."""
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    try:
        keys = evict_into_store(s, 1)
        assert ops(s, "put", "ok") >= 5
    finally:
        s.stop()
    r = objects_agent(tmp_path, cluster_name, etcd.endpoints, "r", s3_env, cpu="64MiB")
    try:
        assert wait_until(lambda: in_store(r, keys), 10)
        plan = r.lookup(synthetic_tokens(1, TOKENS))
        assert [c.source for c in plan.chunks] == [OBJECTS] * 5
        loaded, _ = load_and_check(r, 1)
        assert loaded == [True] * 5
        m = r.metrics.registry
        assert m.get_sample_value("lmcache_p2p_loaded_chunks_total", {"source": "objects"}) == 5
        assert ops(r, "get", "ok") == 5
        # Loaded chunks are this node's now (announced), and the next lookup is local.
        assert wait_until(lambda: all(NodeId("r") in o for o in r.index.owners(r.fp, keys)), 10)
        assert {c.source for c in r.lookup(synthetic_tokens(1, TOKENS)).chunks} == {NodeId("")}
    finally:
        r.stop()


def test_disk_victims_are_uploaded_from_their_file_and_the_file_goes(etcd, cluster_name, tmp_path, s3_env):
    """With a disk tier the last tier is the disk: its victims' files are moved aside, uploaded, deleted."""
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env, disk="4MiB")
    try:
        for seed in (1, 101, 201, 301, 401):
            preload(s, seed, TOKENS)
        assert s.tiers.worker is not None and s.tiers.worker.drain(30)
        keys = keys_of(s, 1)
        assert wait_until(lambda: in_store(s, keys), 30), s.index.owners(s.fp, keys)
        spill = tmp_path / "s-disk" / ".objects-spill"
        assert s.objects is not None and s.objects.offered["file"] >= 5 and s.objects.offered["memory"] == 0
        assert wait_until(lambda: not list(spill.glob("*.chunk")) and s.objects is not None
                          and s.objects.pending == 0, 30)
        report = asyncio.run(status.collect(s.config))
        assert report["objects"]["objects"] >= 5 and report["objects"]["malformed"] == 0
        assert "object store:" in status.render(report)
        row = {n["node_id"]: n for n in report["nodes"]}["s"]
        assert row["objects_pending"] == 0 and row["objects_errors"] == 0
        r = objects_agent(tmp_path, cluster_name, etcd.endpoints, "r", s3_env, cpu="64MiB")
        try:
            assert wait_until(lambda: in_store(r, keys), 10)
            loaded, plan = load_and_check(r, 1)
            assert loaded == [True] * 5 and {c.source for c in plan.chunks} == {OBJECTS}
        finally:
            r.stop()
    finally:
        s.stop()


def test_a_corrupted_object_is_rejected_and_deleted(etcd, cluster_name, tmp_path, s3_env):
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    r = objects_agent(tmp_path, cluster_name, etcd.endpoints, "r", s3_env, cpu="64MiB")
    try:
        keys = evict_into_store(s, 2)
        assert wait_until(lambda: in_store(r, keys), 10)
        assert s.objects is not None
        store, name = s.objects.store, s.objects.name(keys[1])
        body = bytearray(raw_get(s, name))
        body[200] ^= 0x40
        run(s, store.put(name, bytes(body), time.monotonic() + 5))
        loaded, _ = load_and_check(r, 2)
        assert loaded == [True, False, True, True, True]  # chunk 1 refused (the engine recomputes from there)
        assert ops(r, "get", "corrupt") == 1
        assert wait_until(lambda: r.index is not None and OBJECTS not in r.index.owners(r.fp, [keys[1]])[0], 10)
        with pytest.raises(ObjectMissing):
            raw_get(s, name)
        assert not r.holds(keys[1])
    finally:
        r.stop()
        s.stop()


def test_an_invalidated_chunks_object_is_never_loaded_and_is_cleaned_up(etcd, cluster_name, tmp_path, s3_env):
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    r = objects_agent(tmp_path, cluster_name, etcd.endpoints, "r", s3_env, cpu="64MiB")
    try:
        keys = evict_into_store(s, 3)
        other = evict_into_store(s, 4)
        assert wait_until(lambda: in_store(r, keys), 10)
        client = s.index.client  # type: ignore[union-attr]
        run(s, issue(client, Schema(cluster_name), "fingerprint", s.fp.hex()))
        assert wait_until(lambda: r.invalidation.active() and s.invalidation.active(), 10)
        loaded, _ = load_and_check(r, 3)
        assert not any(loaded)
        assert ops(r, "get", "invalidated") == 5  # read in parallel, each refused at the gate
        assert not any(r.holds(k) for k in keys)
        assert s.objects is not None
        assert run(s, s.objects.cleanup()) >= 9  # the rest of both prompts' objects
        names = run(s, s.objects.store.names(f"{s.config.objects.prefix}/{cluster_name}/", time.monotonic() + 5))
        assert not any(k.hex() in n for n in names for k in keys + other)
        assert wait_until(lambda: not any(OBJECTS in o for o in r.index.owners(r.fp, keys + other)), 10)
        assert s.objects.objects == 0
    finally:
        r.stop()
        s.stop()


def test_the_store_stopped_or_killed_costs_a_load_its_deadline_and_never_a_save(etcd, cluster_name, tmp_path,
                                                                              monkeypatch):
    """SIGSTOP: reads hang; the load gives up at its deadline, the store is backed off, the next load
    does not wait at all, and stores (whose evictions queue uploads) return as fast as without a store.
    SIGKILL: reads are refused at once."""
    with SeaweedServer() as own:
        for name, value in own.env.items():
            monkeypatch.setenv(name, value)
        s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", own)
        # A backoff long enough that "backed off" can be observed on a busy machine.
        r = objects_agent(tmp_path, cluster_name, etcd.endpoints, "r", own, cpu="64MiB", backoff_s=5.0)
        try:
            keys = evict_into_store(s, 5)
            assert wait_until(lambda: in_store(r, keys), 10)
            own.pause()
            try:
                plan = r.lookup(synthetic_tokens(5, TOKENS))
                assert plan.chunks and plan.chunks[0].source == OBJECTS
                t0 = time.monotonic()
                bufs = [memoryview(bytearray(r.chunk_bytes)) for _ in plan.chunks]
                loaded = r.load(plan, bufs, timeout=1.0)
                waited = time.monotonic() - t0
                assert not any(loaded)
                # its deadline, plus the loop's own slack (2.77 s once beside a CPU hog and the suite's other
                # lane), well short of the store's own 10 s timeout
                assert waited < 1.0 + 3.0, waited
                assert ops(r, "get", "error") >= 1
                assert r.objects is not None  # one backoff step for the whole load, by the peers' rule
                assert r.objects.health.failures(r.objects.address) == 1
                # Backed off: the planner leaves the store out, nothing waits.
                assert not r.lookup(synthetic_tokens(5, TOKENS)).chunks
                # Saves never wait on the store: evictions only queue their uploads.
                t0 = time.monotonic()
                for seed in (6, 106, 206):
                    preload(s, seed, TOKENS)
                assert time.monotonic() - t0 < 10.0
                assert s.objects is not None and s.objects.pending > 0
            finally:
                own.resume()
            own.kill()
            assert wait_until(lambda: r.objects is not None and r.objects.usable(), 10)
            plan = r.lookup(synthetic_tokens(5, TOKENS))
            assert plan.chunks and plan.chunks[0].source == OBJECTS
            t0 = time.monotonic()
            loaded = r.load(plan, [memoryview(bytearray(r.chunk_bytes)) for _ in plan.chunks], timeout=2.0)
            assert not any(loaded) and time.monotonic() - t0 < 2.0 + 1.5
        finally:
            r.stop()
            s.stop()


def test_saves_beyond_the_spill_budget_are_dropped_and_counted(etcd, cluster_name, tmp_path, s3_env):
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env, spill_bytes="600KiB",
                      budget_bytes_per_s="512KiB")
    try:
        for seed in (7, 107, 207, 307):
            preload(s, seed, TOKENS)
        dropped = s.metrics.registry.get_sample_value("lmcache_p2p_object_uploads_dropped_total",
                                                      {"reason": "spill_full"})
        assert dropped and dropped >= 1
        assert wait_until(lambda: s.objects is not None and s.objects.pending == 0, 30)
    finally:
        s.stop()


def test_a_chunk_a_peer_fails_to_send_comes_from_the_store(etcd, cluster_name, tmp_path, s3_env):
    """A peer listed first (faster tier) that is gone by the time of the pull: the store, an alternative,
    serves the chunk within the same load."""
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    r = objects_agent(tmp_path, cluster_name, etcd.endpoints, "r", s3_env, cpu="64MiB")
    try:
        keys = evict_into_store(s, 8)
        assert wait_until(lambda: in_store(r, keys), 10)
        # A peer "g" claims every chunk from CPU: its record points at a closed port.
        assert r.index is not None and r.loop is not None
        plan = r.lookup(synthetic_tokens(8, TOKENS))
        assert all(c.source == OBJECTS for c in plan.chunks)
        ghost = NodeId("s")  # s is alive and serves nothing of this prompt: its pulls miss
        detour = dataclasses.replace(plan, chunks=tuple(dataclasses.replace(c, source=ghost, alternatives=(OBJECTS,))
                                                        for c in plan.chunks))
        bufs = [memoryview(bytearray(r.chunk_bytes)) for _ in plan.chunks]
        assert r.load(detour, bufs, timeout=5.0) == [True] * 5
        for chunk, buf in zip(plan.chunks, bufs, strict=True):
            expected = synthetic_payload(chunk.key, r.config.layout.chunk_bytes(chunk.end - chunk.start))
            assert bytes(buf[: len(expected)]) == expected
    finally:
        r.stop()
        s.stop()


def test_weed_serves_s3_only_when_ready_and_refuses_unsigned_requests():
    """The fixture's readiness is a signed request; an unsigned one is refused (credentials are enforced)."""
    with SeaweedServer() as server:
        anonymous = ObjectStore(server.objects_config(timeout_s=2.0), env={"AWS_ACCESS_KEY_ID": "nobody",
                                                                           "AWS_SECRET_ACCESS_KEY": "wrong"})
        with pytest.raises(ObjectStoreError, match="403|PermissionDenied"):
            asyncio.run(anonymous.put("x", b"1", time.monotonic() + 3))
        signed = ObjectStore(server.objects_config(timeout_s=2.0), env=server.env)
        asyncio.run(signed.put("x", b"1", time.monotonic() + 3))
        assert asyncio.run(signed.get("x", time.monotonic() + 3, limit=1)) == b"1"
        assert os.path.isdir(server.dir)


def test_chunks_invalidated_while_their_uploads_wait_never_reach_the_store(etcd, cluster_name, tmp_path, s3_env):
    """Uploads held back by the byte budget; the fingerprint is invalidated meanwhile: none is stored."""
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env, budget_bytes_per_s="256KiB",
                      cleanup_interval_s=60)
    try:
        for seed in (9, 109, 209):
            preload(s, seed, TOKENS)
        assert s.objects is not None and s.objects.pending >= 3
        run(s, issue(s.index.client, Schema(cluster_name), "fingerprint", s.fp.hex()))  # type: ignore[union-attr]
        assert wait_until(lambda: s.objects is not None and s.objects.pending == 0, 60)
        dropped = s.metrics.registry.get_sample_value("lmcache_p2p_object_uploads_dropped_total",
                                                      {"reason": "invalidated"})
        assert dropped and dropped >= 3
        # (one upload may have left before the invalidation: the cleanup it triggers deletes that one)
        assert wait_until(lambda: not run(s, s.objects.store.names(f"{s.config.objects.prefix}/{cluster_name}/",
                                                                     time.monotonic() + 5)), 30)
    finally:
        s.stop()


def test_a_quarantined_uploaders_objects_are_not_loaded(etcd, cluster_name, tmp_path, s3_env):
    """The canary quarantined the node that computed (and uploaded) a chunk: its object is deleted, never
    loaded (judged by the origin in the object's chunk header)."""
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    try:
        keys = evict_into_store(s, 10)
    finally:
        s.stop()
    r = objects_agent(tmp_path, cluster_name, etcd.endpoints, "r", s3_env, cpu="64MiB")
    try:
        assert wait_until(lambda: in_store(r, keys), 10)
        r.quarantine_owner(QuarantineRecord(NodeId("s"), by="test", key=keys[0].hex(), distance=1.0))
        assert wait_until(lambda: r.quarantine is not None and r.quarantine.blocked(NodeId("s")), 10)
        loaded, _ = load_and_check(r, 10)
        assert not any(loaded) and ops(r, "get", "invalidated") == 5
        assert wait_until(lambda: not any(OBJECTS in o for o in r.index.owners(r.fp, keys)), 10)
    finally:
        r.stop()


def test_the_planner_takes_the_store_only_where_no_peer_holds_the_chunk():
    """Pulls in flight are never counted for the store: by load alone it would get every other chunk of a
    prompt one peer holds. It is last among the alternatives, and the source where no peer has the chunk."""
    keys = [ChunkKey(bytes([i]) * 16) for i in range(4)]
    spans = [(256 * i, 256 * (i + 1)) for i in range(4)]
    peer = NodeId("a")
    held = [{peer: 1, OBJECTS: TIER_OBJECT}] * 3 + [{OBJECTS: TIER_OBJECT}]
    plan = make_plan(keys, spans, local=lambda _k: False, owners=lambda _ks: held, usable=lambda _n: True,
                     inflight={}, num_tokens=1024)
    assert [c.source for c in plan.chunks] == [peer, peer, peer, OBJECTS]
    assert all(c.alternatives == (OBJECTS,) for c in plan.chunks[:3])


# -- the store is not trusted ----------------------------------------------------------------------------------
def test_a_bucket_reader_finds_no_plaintext_of_the_kv(etcd, cluster_name, tmp_path, s3_env):
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    try:
        keys = evict_into_store(s, 13)
        assert s.objects is not None and s.objects.seal_key is not None
        _, spans = s.keys_for(synthetic_tokens(13, TOKENS))
        for key, (start, end) in zip(keys, spans, strict=True):
            body = raw_get(s, s.objects.name(key))
            payload = synthetic_payload(key, s.config.layout.chunk_bytes(end - start))
            assert len(body) > len(payload)
            for at in (0, len(payload) // 2, len(payload) - 64):  # distinctive runs of the chunk's KV
                assert payload[at:at + 64] not in body
            assert key not in body and s.fp not in body  # nor its header
    finally:
        s.stop()


def test_an_object_larger_than_any_chunk_is_refused_without_reading_it(etcd, cluster_name, tmp_path, s3_env):
    """A bucket writer puts a few MB over the bound under a chunk's name: the load's GET is ranged to the
    bound, the object's size (from the response) refuses it before its body is read, and it is deleted."""
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    r = objects_agent(tmp_path, cluster_name, etcd.endpoints, "r", s3_env, cpu="64MiB")
    try:
        keys = evict_into_store(s, 14)
        assert wait_until(lambda: in_store(r, keys), 10) and s.objects is not None and r.objects is not None
        bound = max_object_size(r.tiers.cpu.slot_bytes)
        name = s.objects.name(keys[2])
        run(s, s.objects.store.put(name, os.urandom(bound + (4 << 20)), time.monotonic() + 10))
        read_before = r.objects.store.bytes_read
        loaded, _ = load_and_check(r, 14)
        assert loaded == [True, True, False, True, True]
        assert ops(r, "get", "oversize") == 1
        # Four objects read, each at most the bound; none of the oversized one's bytes.
        assert r.objects.store.bytes_read - read_before <= 4 * bound
        assert r.objects.health.failures(r.objects.address) == 0  # the object's fault, not the store's
        assert wait_until(lambda: r.index is not None and OBJECTS not in r.index.owners(r.fp, [keys[2]])[0], 10)
        with pytest.raises(ObjectMissing):
            raw_get(s, name)
    finally:
        r.stop()
        s.stop()


def test_an_older_object_put_back_after_an_invalidation_lapsed_is_refused(etcd, cluster_name, tmp_path, s3_env):
    """A chunk uploaded at epoch E1; a fingerprint invalidation deletes it and lapses; the chunk is computed
    and uploaded again at E2 > E1 (its meta says E2). A bucket writer puts the E1 object back under the
    name (it authenticates: it once was that chunk): the load refuses it as a replay and deletes it."""
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    try:
        keys = evict_into_store(s, 15)
        assert s.objects is not None and s.index is not None
        name = s.objects.name(keys[0])
        old = raw_get(s, name)
        client, schema = s.index.client, Schema(cluster_name)  # type: ignore[attr-defined]
        inv, _ = run(s, issue(client, schema, "fingerprint", s.fp.hex()))
        assert wait_until(lambda: s.invalidation.active(), 10)
        assert run(s, s.objects.cleanup()) >= 5
        run(s, client.txn([], [op_delete(schema.invalidations + inv.id.encode())]))  # lapsed (as a --ttl lease ends)
        assert wait_until(lambda: not s.invalidation.active(), 10)
        assert wait_until(lambda: not in_store(s, keys[:1]), 10)
        keys_again = evict_into_store(s, 15)  # computed again, now after the barrier: uploaded again
        assert keys_again == keys
        metas = {m.key: m for m in run(s, metas_of(s))}
        first_epoch = unpack_epoch(s, old, keys[0])
        assert metas[keys[0]].epoch > first_epoch
        run(s, s.objects.store.put(name, old, time.monotonic() + 5))  # the replay
    finally:
        s.stop()
    r = objects_agent(tmp_path, cluster_name, etcd.endpoints, "r", s3_env, cpu="64MiB")
    try:
        assert wait_until(lambda: in_store(r, keys), 10)
        loaded, _ = load_and_check(r, 15)
        assert loaded == [False, True, True, True, True]
        assert ops(r, "get", "replayed") == 1 and ops(r, "get", "ok") == 4
        assert wait_until(lambda: r.index is not None and OBJECTS not in r.index.owners(r.fp, [keys[0]])[0], 10)
    finally:
        r.stop()


async def metas_of(a: CacheAgent) -> list[ObjectMeta]:
    assert a.index is not None
    schema = Schema(a.config.cluster)
    kvs, _ = await a.index.client.get_prefix(schema.objects)  # type: ignore[attr-defined]
    return [decode_object_meta(kv.key, kv.value, prefix_len=len(schema.objects)) for kv in kvs]


def unpack_epoch(a: CacheAgent, body: bytes, key: ChunkKey) -> int:
    assert a.objects is not None
    return unpack_object(body, a.objects.name(key), key, a.fp, a.objects.seal_key)[0].epoch


def test_invalidate_tenant_finds_the_objects_of_a_fingerprint_no_running_node_serves(etcd, cluster_name, tmp_path,
                                                                                     s3_env, capsys):
    """Tenant "acme"'s node uploaded its chunks and is gone: no node record names its fingerprint. The CLI
    counts its objects by the tenant their metas carry, and a cleanup matching tenants through the metas
    (``covers_tenant``, the invalidation's) deletes them; another tenant's objects stay."""
    t = objects_agent(tmp_path, cluster_name, etcd.endpoints, "t", s3_env, tenant_salt="acme")
    try:
        acme = evict_into_store(t, 16)
        assert t.objects is not None and t.objects.tenant == tenant_digest("acme")
    finally:
        t.stop()
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    try:
        mine = evict_into_store(s, 17)
        assert s.fp != t.fp and s.objects is not None and s.index is not None
        metas = run(s, metas_of(s))
        assert {m.tenant for m in metas if m.fp == t.fp} == {tenant_digest("acme")}
        assert invalidate.main(["--etcd", ",".join(etcd.endpoints), "--cluster", cluster_name, "--tenant", "acme"]) == 0
        out = capsys.readouterr().out
        acme_objects = sum(m.fp == t.fp for m in metas)
        assert acme_objects >= 5 and f"{acme_objects} objects in the object store" in out
        assert wait_until(lambda: s.invalidation.active(), 10)
        # The tier given the tenant hook (as the agent wires it): every node with the tier cleans up.
        cleaner = ObjectTier(s.config, s.objects.store, fp=s.fp, node_id=s.node_id,
                             metrics=AgentMetrics(CollectorRegistry()), keep=lambda _h: False,
                             covers=lambda _h, _n: False, covers_tenant=s.invalidation.covers_tenant,
                             ttl_s=lambda: None)

        async def clean() -> int:
            cleaner.start(s.index.client)  # type: ignore[union-attr]
            try:
                return await cleaner.cleanup()
            finally:
                await cleaner.stop()

        assert run(s, clean()) == acme_objects
        names = run(s, s.objects.store.names(f"{s.config.objects.prefix}/{cluster_name}/", time.monotonic() + 5))
        assert not any(k.hex() in n for n in names for k in acme)
        assert all(any(k.hex() in n for n in names) for k in mine)
        assert not any(m.fp == t.fp for m in run(s, metas_of(s)))
    finally:
        s.stop()


def test_a_chunk_another_node_is_uploading_is_not_uploaded_twice(etcd, cluster_name, tmp_path, s3_env):
    """Two nodes uploading one chunk would leave one's object beside the other's meta (refused as a replay,
    deleted: lost). An upload claims the object name in etcd first: the chunks another node claimed are
    dropped here (counted ``uploading_elsewhere``) and never PUT; the rest go up and their claims go with
    the announce; a claim of a node that died lapses with its lease."""
    s = objects_agent(tmp_path, cluster_name, etcd.endpoints, "s", s3_env)
    try:
        assert s.objects is not None and s.index is not None
        tier = s.objects
        client = tier.client
        assert client is not None
        claimed = keys_of(s, 1)[:2]
        lease, _ = run(s, client.grant(2))  # "t", mid-upload, dies: its lease lapses after 2 s
        for key in claimed:
            run(s, client.put(tier.schema.upload_claim(s.fp, key), b"t", lease))
        preload(s, 1, TOKENS)
        preload(s, 101, TOKENS)
        preload(s, 201, TOKENS)
        rest = keys_of(s, 1)[2:]
        assert wait_until(lambda: in_store(s, rest), 30)
        dropped = s.metrics.registry.get_sample_value("lmcache_p2p_object_uploads_dropped_total",
                                                      {"reason": "uploading_elsewhere"})
        assert dropped == 2
        assert not any(owners.get(OBJECTS) for owners in s.index.owners(s.fp, claimed))
        # no claim of this node's stays: each goes with the announce that follows its PUT (which a loaded host
        # may not have sent yet when the object is already in the store); the other node's lapse with its lease
        others = {tier.schema.upload_claim(s.fp, k) for k in claimed}
        # the other node's claims are never this node's to drop
        assert others <= {kv.key for kv in run(s, client.get_prefix(tier.schema.uploads))[0]}
        assert wait_until(lambda: {kv.key for kv in run(s, client.get_prefix(tier.schema.uploads))[0]} <= others, 10)
        assert wait_until(lambda: not run(s, client.get_prefix(tier.schema.uploads))[0], 10)  # the dead claims lapsed
        preload(s, 1, TOKENS)  # computed again, evicted again: now uploaded
        preload(s, 301, TOKENS)
        preload(s, 401, TOKENS)
        assert wait_until(lambda: in_store(s, claimed), 30)
        # announced: no claim left (other evicted chunks' uploads may still be under way: their claims go with them)
        assert wait_until(lambda: not run(s, client.get_prefix(tier.schema.uploads))[0], 30)
    finally:
        s.stop()
