"""The cluster's memory as one cache: hand-off of sole copies, hot-chunk replicas, never on the store path.

Real etcd, real agents: cache-only agents are ``lmcache-p2p agent`` processes (role "cache"), the
sending node is an in-process agent whose pool is small (8 slots of the tiny layout's 512 KiB
chunks). Every chunk loaded is checked byte for byte (``load_and_check``).
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from agent_helpers import AgentProcess, agent_yaml, config, stop_process, wait_until
from prometheus_client import CollectorRegistry
from test_agent_mesh import TOKENS, load_and_check
from vllm_helpers import scrape

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.cli import status
from lmcache_p2p.ids import NodeId
from lmcache_p2p.keys import ChunkKey
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.plan import LOCAL
from lmcache_p2p.testing.synthetic import preload, synthetic_tokens

SMALL = "4MiB"  # 8 chunks


def agent(tmp_path: Path, cluster: str, endpoints: tuple[str, ...], name: str, cpu: str = SMALL,
          **handoff: float) -> CacheAgent:
    cfg = config(agent_yaml(tmp_path / f"{name}.yaml", node=name, cluster=cluster, endpoints=endpoints, cpu=cpu,
                            handoff={"free_below": 0.5, "capacity_interval_s": 0.2, **handoff}))
    return CacheAgent.of(cfg, metrics=AgentMetrics(CollectorRegistry())).start()


def cache_only(tmp_path: Path, cluster: str, endpoints: tuple[str, ...], name: str, **handoff: float) -> AgentProcess:
    cfg = agent_yaml(tmp_path / f"{name}.yaml", node=name, cluster=cluster, endpoints=endpoints, cpu="64MiB",
                     handoff={"capacity_interval_s": 0.2, **handoff})
    return AgentProcess(cfg, log=tmp_path / f"{name}.log").wait_ready()


def keys_of(a: CacheAgent, seed: int) -> list[ChunkKey]:
    return a.keys_for(synthetic_tokens(seed, TOKENS))[0]


def holders(a: CacheAgent, keys: list[ChunkKey]) -> list[set[NodeId]]:
    assert a.index is not None
    return [set(o) for o in a.index.owners(a.fp, keys)]


def counter(a: CacheAgent, event: str) -> float:
    return a.metrics.registry.get_sample_value("lmcache_p2p_handoff_chunks_total", {"event": event}) or 0.0


def test_a_full_pool_hands_its_sole_copies_to_a_cache_only_agent(etcd, cluster_name, tmp_path):
    """The sender's pool fills; the chunks it was asked for, held nowhere else, go to the cache-only
    agent (not to the engine peer with as much room), are evicted here first, and are then served
    from there byte-exact."""
    k = cache_only(tmp_path, cluster_name, etcd.endpoints, "k")
    e = agent(tmp_path, cluster_name, etcd.endpoints, "e", cpu="64MiB")
    s = agent(tmp_path, cluster_name, etcd.endpoints, "s")
    try:
        assert wait_until(lambda: {"k", "e"} <= set(s.index.nodes()) and s.index.nodes()["k"].free, 10)
        preload(s, 1, TOKENS)
        loaded, _ = load_and_check(s, 1)  # hit once: worth keeping
        assert loaded == [True] * 5
        doc1 = keys_of(s, 1)
        assert wait_until(lambda: all("k" in h for h in holders(s, doc1)), 10), holders(s, doc1)
        assert not any("e" in h for h in holders(s, doc1))  # cache-only agents first
        preload(s, 2, TOKENS)  # 10 chunks into 8 slots: the copies now on k go first
        assert all(s.tiers.where(key) is None for key in doc1[:2])
        assert s.tiers.cpu.stats.copies_evicted >= 2
        r = agent(tmp_path, cluster_name, etcd.endpoints, "r", cpu="64MiB")
        try:
            loaded, plan = load_and_check(r, 1)
            assert loaded == [True] * 5
            assert {c.source for c in plan.chunks} <= {NodeId("k"), NodeId("s")}
        finally:
            r.stop()
        assert counter(s, "accepted") >= 5 and counter(s, "dropped") == 0
        received = scrape(s.index.nodes()["k"].metrics_url)
        assert received['lmcache_p2p_handoff_chunks_total{event="received"}'] >= 5
        report = {n["node_id"]: n for n in asyncio.run(status.collect(s.config))["nodes"]}
        assert report["k"]["role"] == "cache" and report["k"]["handoff"]["received"] >= 5
        assert report["s"]["role"] == "engine" and report["s"]["free_bytes"].keys() == {"cpu"}
    finally:
        s.stop()
        e.stop()
        k.stop()


def test_with_no_budget_sole_copies_are_dropped_and_counted(etcd, cluster_name, tmp_path):
    k = cache_only(tmp_path, cluster_name, etcd.endpoints, "k")
    s = agent(tmp_path, cluster_name, etcd.endpoints, "s", budget_bytes_per_s=0)
    try:
        assert wait_until(lambda: "k" in s.index.nodes(), 10)
        preload(s, 1, TOKENS)
        assert load_and_check(s, 1)[0] == [True] * 5
        doc1 = keys_of(s, 1)
        steps = s.handoff.steps
        assert wait_until(lambda: s.handoff.steps >= steps + 4, 10)  # steps with a full pool ran...
        assert counter(s, "offered") == 0  # ...and offered nothing
        preload(s, 2, TOKENS)
        gone = [key for key in doc1 if s.tiers.where(key) is None]
        assert len(gone) >= 2
        assert wait_until(lambda: all(not h for key, h in zip(doc1, holders(s, doc1), strict=True) if key in gone), 5)
        assert counter(s, "dropped") == len(gone)
    finally:
        s.stop()
        k.stop()


def test_a_hot_chunk_gets_a_replica_and_outlives_its_owner(etcd, cluster_name, tmp_path):
    """A requester that keeps no copies pulls the same chunks again and again from one owner; after
    ``replicate_after`` pulls the owner has them copied to the cache-only agent; the owner is killed
    and the chunks are still served, byte-exact."""
    owner = AgentProcess(agent_yaml(tmp_path / "o.yaml", node="o", cluster=cluster_name, endpoints=etcd.endpoints,
                                    cpu="64MiB", ttl=2, handoff={"replicate_after": 3}),
                         seeds=(7,), tokens=TOKENS, log=tmp_path / "o.log").wait_ready()
    k = cache_only(tmp_path, cluster_name, etcd.endpoints, "k")
    r = agent(tmp_path, cluster_name, etcd.endpoints, "r", cpu="64MiB", replicate_after=0)
    doc = keys_of(r, 7)
    try:
        assert wait_until(lambda: len(r.lookup(synthetic_tokens(7, TOKENS)).chunks) == 5, 10)
        for _ in range(3):
            loaded, plan = load_and_check(r, 7)
            assert loaded == [True] * 5 and {c.source for c in plan.chunks} == {"o"}
            for key in doc:
                r.tiers.remove(key)  # keeps no copy: the next load pulls again
        assert wait_until(lambda: all("k" in h for h in holders(r, doc)), 10), holders(r, doc)
        metrics = scrape(r.index.nodes()["o"].metrics_url)
        assert metrics['lmcache_p2p_handoff_chunks_total{event="replicas"}'] == 5
        owner.kill(signal.SIGKILL)
        assert wait_until(lambda: "o" not in r.index.nodes(), 10)  # its lease (2 s) ran out
        loaded, plan = load_and_check(r, 7)
        assert loaded == [True] * 5 and {c.source for c in plan.chunks} == {"k"}
    finally:
        r.stop()
        k.stop()
        owner.stop()


def test_a_stopped_receiver_never_delays_the_senders_stores(etcd, cluster_name, tmp_path):
    """The only peer with room is SIGSTOPped: the offer waits out its timeout on the sender's loop, and
    the sender's stores (the engine's saves) go on as if nothing were offered."""
    k = cache_only(tmp_path, cluster_name, etcd.endpoints, "k")
    s = agent(tmp_path, cluster_name, etcd.endpoints, "s")
    try:
        assert wait_until(lambda: "k" in s.index.nodes() and s.index.nodes()["k"].free, 10)
        stop_process(k.proc.pid)
        preload(s, 1, TOKENS)
        assert load_and_check(s, 1)[0] == [True] * 5
        assert wait_until(lambda: counter(s, "offered") >= 1, 5)  # an offer is now waiting on k
        t0 = time.monotonic()
        for seed in range(2, 6):  # 20 chunks through 8 slots while the offer hangs
            assert preload(s, seed, TOKENS) == 5
        assert time.monotonic() - t0 < s.config.transfer.timeout_s  # stores never waited for the offer
        assert counter(s, "accepted") == 0
        loaded, plan = load_and_check(s, 5)
        assert loaded == [True] * 5 and {c.source for c in plan.chunks} == {LOCAL}
    finally:
        s.stop()
        k.stop()
