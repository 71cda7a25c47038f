"""The mesh end to end without an engine: real etcd, real agent processes, real sockets."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import msgpack
import pytest
from agent_helpers import SECRET, AgentProcess, agent_yaml, config, wait_until
from prometheus_client import CollectorRegistry
from vllm_helpers import scrape

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.aio import LoopThread
from lmcache_p2p.certs import make_certs
from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.errors import HandshakeError
from lmcache_p2p.index.client import EtcdClient, KeyValue
from lmcache_p2p.index.lookup import LookupMirror
from lmcache_p2p.index.schema import Schema, decode_node_record
from lmcache_p2p.keys import Fingerprint
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.plan import LOCAL, HitPlan
from lmcache_p2p.testing.synthetic import synthetic_payload, synthetic_tokens
from lmcache_p2p.transfer.client import ConnectionPool
from lmcache_p2p.transfer.nixl_engine import nixl_available
from lmcache_p2p.transfer.stack import TransferStack

TOKENS = 1024 + 100  # 4 full chunks and a partial tail


def requester(tmp_path: Path, cluster: str, endpoints: tuple[str, ...], name: str = "c",
              transfer: dict[str, str] | None = None, handoff: dict[str, int] | None = None,
              etcd_extra: dict[str, object] | None = None) -> CacheAgent:
    cfg = config(agent_yaml(tmp_path / f"{name}.yaml", node=name, cluster=cluster, endpoints=endpoints,
                            transfer=transfer, handoff=handoff, etcd_extra=etcd_extra))
    metrics = AgentMetrics(CollectorRegistry())
    return CacheAgent.of(cfg, metrics=metrics).start()


def load_and_check(agent: CacheAgent, seed: int, num_tokens: int = TOKENS) -> tuple[list[bool], HitPlan]:
    """Load the synthetic prompt ``seed`` through the agent; every chunk loaded must be byte-exact."""
    tokens = synthetic_tokens(seed, num_tokens)
    plan = agent.lookup(tokens)
    bufs = [bytearray(agent.chunk_bytes) for _ in plan.chunks]
    loaded = agent.load(plan, [memoryview(b) for b in bufs])
    layout = agent.config.layout
    for ok, chunk, buf in zip(loaded, plan.chunks, bufs, strict=True):
        if ok:
            expected = synthetic_payload(chunk.key, layout.chunk_bytes(chunk.end - chunk.start))
            assert buf[: len(expected)] == expected, "wrong bytes delivered"
    return loaded, plan


def test_pull_from_peer_then_owner_dies(etcd, cluster_name, tmp_path):
    a = AgentProcess(agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints),
                     seeds=(1,), tokens=TOKENS, log=tmp_path / "a.log").wait_ready()
    b = AgentProcess(agent_yaml(tmp_path / "b.yaml", node="b", cluster=cluster_name, endpoints=etcd.endpoints),
                     log=tmp_path / "b.log").wait_ready()
    c = requester(tmp_path, cluster_name, etcd.endpoints)
    try:
        assert wait_until(lambda: c.lookup(synthetic_tokens(1, TOKENS)).hit_tokens == TOKENS, 10)
        plan = c.lookup(synthetic_tokens(1, TOKENS))
        assert {ch.source for ch in plan.chunks} == {"a"} and len(plan.chunks) == 5
        loaded, _ = load_and_check(c, 1)
        assert loaded == [True] * 5
        m = c.metrics.registry
        assert m.get_sample_value("lmcache_p2p_loaded_chunks_total", {"source": "peer"}) == 5
        assert m.get_sample_value("lmcache_p2p_pull_chunks_total", {"transport": "tcp", "outcome": "loaded"}) == 5
        # A second lookup is a local hit now: the pulled chunks live in C's pool.
        assert {ch.source for ch in c.lookup(synthetic_tokens(1, TOKENS)).chunks} == {LOCAL}

        for key in c.keys_for(synthetic_tokens(1, TOKENS))[0]:
            c.tiers.remove(key)
        plan = c.lookup(synthetic_tokens(1, TOKENS))
        a.kill(signal.SIGKILL)
        t0 = time.monotonic()
        bufs = [memoryview(bytearray(c.chunk_bytes)) for _ in plan.chunks]
        assert c.load(plan, bufs) == [False] * 5  # misses, never wrong bytes
        assert time.monotonic() - t0 < c.config.transfer.timeout_s + 2
        # After A's lease (3 s) expires, its node and chunks leave every mirror; nobody offers them.
        assert wait_until(lambda: "a" not in c.index.nodes(), 3 + 5)
        # the index's doing, not A's backoff: no owner is left for any chunk
        assert c.index.owners(c.fp, c.keys_for(synthetic_tokens(1, TOKENS))[0]) == [{}] * 5
        assert c.lookup(synthetic_tokens(1, TOKENS)).chunks == ()
        assert "b" in c.index.nodes()
    finally:
        c.stop()
        a.stop()
        b.stop()


def test_a_lookup_mode_mesh_pulls_from_peers_whose_chunks_it_never_mirrored(etcd, cluster_name, tmp_path):
    """``etcd.index: lookup`` on both sides: the requester reads a prompt's owners when it plans, pulls them
    byte-exact, keeps only what it asked, and sees a dead owner's chunks go with its lease."""
    lookup = {"index": "lookup", "lookup_cache_s": 0.2}
    a = AgentProcess(agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints,
                                etcd_extra=lookup), seeds=(1,), tokens=TOKENS, log=tmp_path / "a.log").wait_ready()
    c = requester(tmp_path, cluster_name, etcd.endpoints, etcd_extra=lookup)
    try:
        mirror = c.index.mirror(c.fp)
        assert isinstance(mirror, LookupMirror)
        assert wait_until(lambda: c.lookup(synthetic_tokens(1, TOKENS)).hit_tokens == TOKENS, 10)
        loaded, plan = load_and_check(c, 1)
        assert loaded == [True] * 5 and {ch.source for ch in plan.chunks} == {"a"}
        assert len(mirror) == 5  # the prompt's chunks: nothing else of the fleet's index is held here
        keys = c.keys_for(synthetic_tokens(2, TOKENS))[0]
        assert c.index.owners(c.fp, keys) == [{}] * 5  # a prompt nobody computed
        a.kill(signal.SIGKILL)
        keys = c.keys_for(synthetic_tokens(1, TOKENS))[0]
        assert wait_until(lambda: all("c" in o for o in c.index.owners(c.fp, keys)), 5)  # c announced its pulls
        assert wait_until(lambda: all("a" not in o for o in c.index.owners(c.fp, keys)), 3 + 5)  # a's lease ran out
    finally:
        c.stop()
        a.stop()


def test_restarted_agent_republishes_and_serves_its_disk(etcd, cluster_name, tmp_path):
    cfg = agent_yaml(tmp_path / "d.yaml", node="d", cluster=cluster_name, endpoints=etcd.endpoints,
                     disk=tmp_path / "disk")
    d = AgentProcess(cfg, seeds=(2,), tokens=TOKENS, log=tmp_path / "d1.log").wait_ready()
    assert d.info["stored"] == 5
    assert d.stop() == 0  # SIGTERM: CPU chunks written back to disk, lease revoked
    assert len(list((tmp_path / "disk").glob("*.chunk"))) == 5
    c = requester(tmp_path, cluster_name, etcd.endpoints)
    try:
        assert c.lookup(synthetic_tokens(2, TOKENS)).chunks == ()  # revoked at once
        d = AgentProcess(cfg, log=tmp_path / "d2.log").wait_ready()
        assert d.info["held"] == 5
        assert wait_until(lambda: c.lookup(synthetic_tokens(2, TOKENS)).hit_tokens == TOKENS, 10)
        loaded, _ = load_and_check(c, 2)
        assert loaded == [True] * 5
    finally:
        c.stop()
        d.stop()


def test_concurrent_requesters_against_two_owners(etcd, cluster_name, tmp_path):
    threads_n, rounds = 8, 12
    seeds_a = tuple(range(100, 100 + threads_n))
    seeds_b = tuple(range(200, 200 + threads_n))
    no_replicas = {"replicate_after": 0}  # every round must pull from the owners (the requester drops its copies)
    owners = [
        AgentProcess(agent_yaml(tmp_path / "oa.yaml", node="oa", cluster=cluster_name, endpoints=etcd.endpoints,
                                cpu="128MiB", handoff=no_replicas), seeds=seeds_a, tokens=TOKENS,
                     log=tmp_path / "oa.log"),
        AgentProcess(agent_yaml(tmp_path / "ob.yaml", node="ob", cluster=cluster_name, endpoints=etcd.endpoints,
                                cpu="128MiB", handoff=no_replicas), seeds=seeds_b, tokens=TOKENS,
                     log=tmp_path / "ob.log"),
    ]
    for o in owners:
        o.wait_ready()
    c = requester(tmp_path, cluster_name, etcd.endpoints, handoff=no_replicas)
    errors: list[BaseException] = []
    pulled = [0] * threads_n

    def worker(i: int) -> None:
        try:
            for r in range(rounds):
                seed = (seeds_a, seeds_b)[r % 2][i]
                loaded, plan = load_and_check(c, seed)
                assert loaded == [True] * 5, loaded
                pulled[i] += sum(1 for ch in plan.chunks if ch.source != LOCAL)
                for ch in plan.chunks:
                    c.tiers.remove(ch.key)  # so the next round pulls again
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    try:
        assert wait_until(lambda: all(c.lookup(synthetic_tokens(s, TOKENS)).hit_tokens == TOKENS
                                      for s in seeds_a + seeds_b), 15)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        assert sum(pulled) == threads_n * rounds * 5
        reg = c.metrics.registry
        assert reg.get_sample_value("lmcache_p2p_checksum_failures_total") == 0
        assert reg.get_sample_value("lmcache_p2p_loaded_chunks_total", {"source": "peer"}) == sum(pulled)
        nodes = c.index.nodes()
        for name in ("oa", "ob"):
            metrics = scrape(nodes[name].metrics_url)
            assert metrics["lmcache_p2p_pins"] == 0
            assert metrics["lmcache_p2p_served_chunks_total"] >= threads_n * rounds * 5 / 2
    finally:
        c.stop()
        for o in owners:
            o.stop()


def test_a_chunk_changed_in_memory_after_commit_never_reaches_the_engine(etcd, cluster_name, tmp_path):
    """Registered memory can be written after a chunk is committed (a peer's NIXL WRITE into the pool,
    a stray write): the slot is re-verified when it is handed to the engine, and dropped."""
    c = requester(tmp_path, cluster_name, etcd.endpoints)
    try:
        tokens = synthetic_tokens(3, TOKENS)
        keys, spans = c.keys_for(tokens)
        c.store(tokens, [memoryview(synthetic_payload(k, c.config.layout.chunk_bytes(e - s)))
                         for k, (s, e) in zip(keys, spans, strict=True)]).result(10)
        pin = c.tiers.cpu.pin(keys[2], 5.0)
        assert pin is not None
        c.tiers.cpu.slot_view(pin.slot, pin.header.length)[100] ^= 0x5A  # what a WRITE into the pool does
        c.tiers.cpu.unpin(pin)
        pins = c.loader.load_pinned(c.lookup(tokens), time.monotonic() + c.config.transfer.timeout_s, remote=False)
        assert [p is not None for p in pins] == [True, True, False, True, True]
        for p in pins:
            if p is not None:
                c.tiers.cpu.unpin(p)
        assert c.tiers.where(keys[2]) is None  # dropped, not served to anyone
        assert c.metrics.registry.get_sample_value("lmcache_p2p_checksum_failures_total") == 1
    finally:
        c.stop()


def test_etcd_readers_get_no_nixl_access_material(etcd, cluster_name, tmp_path):
    """Everything an etcd reader sees holds no NIXL agent metadata (what a peer needs to READ or WRITE
    a pool); an authenticated peer gets it in the handshake, a peer without the secret gets nothing."""
    if not nixl_available():
        pytest.skip("nixl not importable")
    path = agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints,
                      transports=("tcp", "nixl"))
    a = AgentProcess(path, seeds=(1,), tokens=TOKENS, log=tmp_path / "a.log").wait_ready()
    loop = LoopThread("nixl-md")
    try:
        async def everything() -> list[KeyValue]:
            async with EtcdClient(EtcdConfig(endpoints=etcd.endpoints)) as client:
                return (await client.get_prefix(Schema(cluster_name).root))[0]

        kvs = asyncio.run(everything())
        record = next(decode_node_record(kv.value) for kv in kvs if kv.key.endswith(b"/nodes/a"))
        assert "nixl" in record.transports and "nixl_metadata" not in msgpack.unpackb(
            next(kv.value for kv in kvs if kv.key.endswith(b"/nodes/a")))
        peer, fp = record.peer(), Fingerprint.of(config(path).layout).digest
        assert peer is not None and peer.node_id == "a"

        good = ConnectionPool(SECRET.encode(), 3.0, 1 << 20, want_nixl=True)
        conn = loop.run(good.get(peer, fp, 3.0), 10)
        assert conn.nixl is not None
        md = conn.nixl["md"]
        assert len(md) > 64 and not any(md[i:i + 32] in kv.value for kv in kvs for i in range(0, len(md) - 32, 32))
        loop.run(good.close(), 10)

        bad = ConnectionPool(b"not-the-cluster-secret-0123456789abcdef", 3.0, 1 << 20, want_nixl=True)
        with pytest.raises(HandshakeError):
            loop.run(bad.get(peer, fp, 3.0), 10)
        loop.run(bad.close(), 10)
    finally:
        loop.stop()
        a.stop()


def test_per_peer_state_is_bounded_by_the_live_nodes(etcd, cluster_name, tmp_path):
    """Connections, backoff state and peer metric labels of a node that left the mesh are dropped."""
    a = AgentProcess(agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints),
                     seeds=(1,), tokens=TOKENS, log=tmp_path / "a.log").wait_ready()
    c = requester(tmp_path, cluster_name, etcd.endpoints)
    try:
        assert wait_until(lambda: c.lookup(synthetic_tokens(1, TOKENS)).hit_tokens == TOKENS, 10)
        assert load_and_check(c, 1)[0] == [True] * 5
        stack = c._stack  # the state under test
        assert stack is not None and len(stack.transports["tcp"]._pool) == 1
        for key in c.keys_for(synthetic_tokens(1, TOKENS))[0]:
            c.tiers.remove(key)
        plan = c.lookup(synthetic_tokens(1, TOKENS))
        a.kill(signal.SIGKILL)
        assert c.load(plan, [memoryview(bytearray(c.chunk_bytes)) for _ in plan.chunks]) == [False] * 5
        errors = c.metrics.registry.get_sample_value
        assert errors("lmcache_p2p_peer_errors_total", {"peer": "a"}) >= 1 and len(stack.health) == 1
        # a's lease (3 s) expires, a leaves the index; the next pass (every TTL) forgets it
        assert wait_until(lambda: "a" not in c.index.nodes(), 8)
        assert wait_until(lambda: len(stack.transports["tcp"]._pool) == 0 and len(stack.health) == 0, 8)
        assert errors("lmcache_p2p_peer_errors_total", {"peer": "a"}) is None
    finally:
        c.stop()
        a.stop()


def test_a_tls_mesh_pulls_over_tls_and_skips_plain_peers(etcd, cluster_name, tmp_path):
    made = make_certs(tmp_path / "pki", ["a", "c"])

    def tls(name: str) -> dict[str, str]:
        return {"tls_ca_cert": str(tmp_path / "pki" / "ca.crt"), "tls_cert": str(made[name][0]),
                "tls_key": str(made[name][1])}

    a = AgentProcess(agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints,
                                transfer=tls("a")), seeds=(1,), tokens=TOKENS, log=tmp_path / "a.log").wait_ready()
    b = AgentProcess(agent_yaml(tmp_path / "b.yaml", node="b", cluster=cluster_name, endpoints=etcd.endpoints),
                     seeds=(2,), tokens=TOKENS, log=tmp_path / "b.log").wait_ready()
    c = requester(tmp_path, cluster_name, etcd.endpoints, transfer=tls("c"))
    try:
        assert wait_until(lambda: c.lookup(synthetic_tokens(1, TOKENS)).hit_tokens == TOKENS, 10)
        assert wait_until(lambda: "b" in c.index.nodes(), 10) and c.index.nodes()["b"].tls is False
        assert c.index.nodes()["a"].tls is True
        loaded, plan = load_and_check(c, 1)
        assert loaded == [True] * 5 and {ch.source for ch in plan.chunks} == {"a"}
        # b holds prompt 2 but speaks plain TCP: never offered to a TLS node, so no wasted connects
        assert c.index.owners(c.fp, c.keys_for(synthetic_tokens(2, TOKENS))[0])[0] != {}
        assert c.lookup(synthetic_tokens(2, TOKENS)).chunks == ()
    finally:
        c.stop()
        a.stop()
        b.stop()


def test_with_per_node_certificates_an_owner_whose_certificate_names_no_node_is_refused(etcd, cluster_name,
                                                                                        tmp_path):
    """A mesh of per-node certificates (``lmcache-p2p certs DIR NODE=node:NODE``): requester c, whose
    own certificate names it, requires names by default. Owner m holds the secret and a certificate of
    the same CA that names no node (a shared one, or any other the CA issued): c refuses it as m, before
    the HMAC handshake, counts it as a peer error of m's and recomputes; a's named certificate serves."""
    made = make_certs(tmp_path / "pki", ["a=node:a", "c=node:c", "unnamed"])

    def tls(name: str) -> dict[str, str]:
        return {"tls_ca_cert": str(tmp_path / "pki" / "ca.crt"), "tls_cert": str(made[name][0]),
                "tls_key": str(made[name][1])}

    a = AgentProcess(agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints,
                                transfer=tls("a")), seeds=(1,), tokens=TOKENS, log=tmp_path / "a.log").wait_ready()
    m = AgentProcess(agent_yaml(tmp_path / "m.yaml", node="m", cluster=cluster_name, endpoints=etcd.endpoints,
                                transfer=tls("unnamed")), seeds=(2,), tokens=TOKENS,
                     log=tmp_path / "m.log").wait_ready()
    c = requester(tmp_path, cluster_name, etcd.endpoints, transfer=tls("c"))
    try:
        stack = c.transfer_stack
        assert isinstance(stack, TransferStack) and stack.control.require_node_name  # unset: on (c's names c)
        assert wait_until(lambda: c.lookup(synthetic_tokens(1, TOKENS)).hit_tokens == TOKENS, 10)
        assert wait_until(lambda: c.lookup(synthetic_tokens(2, TOKENS)).hit_tokens == TOKENS, 10)
        loaded, plan = load_and_check(c, 1)
        assert loaded == [True] * 5 and {ch.source for ch in plan.chunks} == {"a"}
        loaded, plan = load_and_check(c, 2)
        assert {ch.source for ch in plan.chunks} == {"m"} and not any(loaded)
        assert (c.metrics.registry.get_sample_value("lmcache_p2p_peer_errors_total", {"peer": "m"}) or 0) >= 1
        assert stack.health.failures(c.index.nodes()["m"].peer()) >= 1  # backed off
    finally:
        c.stop()
        a.stop()
        m.stop()
