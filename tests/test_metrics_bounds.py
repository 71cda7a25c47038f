"""Per-peer Prometheus series are bounded (issue 41): in a fleet of 1,000 nodes one series per peer per
node would be 10^6. Past ``PER_PEER_SERIES`` peers, errors count under ``peer="other"`` and only the
slowest peers' pull estimates are exposed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.aio import LoopThread
from lmcache_p2p.config import load_config
from lmcache_p2p.estimates import PeerEstimates
from lmcache_p2p.ids import NodeId
from lmcache_p2p.keys import ChunkKey, Fingerprint, FingerprintDigest
from lmcache_p2p.metrics import OTHER_PEERS, PER_PEER_SERIES, AgentMetrics
from lmcache_p2p.tiers.cpu_pool import CpuPool
from lmcache_p2p.transfer.health import PeerHealth
from lmcache_p2p.transfer.pull import Puller


def series(registry: CollectorRegistry, name: str) -> dict[str, float]:
    return {s.labels["peer"]: s.value for m in registry.collect() for s in m.samples if s.name == name}


def test_peer_errors_past_the_bound_count_as_other() -> None:
    registry = CollectorRegistry()
    with LoopThread("test-bounds") as loop:
        puller = Puller(NodeId("me"), FingerprintDigest(b"\x01" * 16), CpuPool(4096, 4096), {}, [], PeerHealth(1.0),
                        dict, AgentMetrics(registry), PeerEstimates(), loop)
        for i in range(PER_PEER_SERIES + 8):
            puller._peer_error(NodeId(f"n{i}"))
        puller._peer_error(NodeId("n0"))  # a peer with a series keeps it
    errors = series(registry, "lmcache_p2p_peer_errors_total")
    assert len(errors) == PER_PEER_SERIES + 1 and errors[OTHER_PEERS] == 8 and errors["n0"] == 2


def test_only_the_slowest_peers_pull_estimates_are_exposed() -> None:
    config = load_config(env={}, overrides={"node_id": "me"})
    registry = CollectorRegistry()
    agent = CacheAgent(config, Fingerprint.of(config.layout), 4096, metrics=AgentMetrics(registry),
                       secret=b"s" * 32)
    try:
        for i in range(PER_PEER_SERIES + 20):  # peer i: a chunk in (i + 1) ms
            for _ in range(3):
                agent.peer_estimates.observe(f"n{i}", 4096, (i + 1) / 1000)
        agent.planner_gauges.refresh()
        shown = series(registry, "lmcache_p2p_pull_expected_seconds")
        assert len(shown) == PER_PEER_SERIES and "n0" not in shown and f"n{PER_PEER_SERIES + 19}" in shown
        agent.peer_estimates.observe("n0", 4096, 5.0)  # n0 turned slow: shown now, the fastest shown goes
        agent.planner_gauges.refresh()
        assert "n0" in series(registry, "lmcache_p2p_pull_expected_seconds")
        assert len(series(registry, "lmcache_p2p_pull_expected_seconds")) == PER_PEER_SERIES
    finally:
        agent.stop()


def test_evictions_are_a_counter_that_only_grows() -> None:
    config = load_config(env={}, overrides={"node_id": "me", "tiers.cpu_capacity": 2 * 4096})
    registry = CollectorRegistry()
    agent = CacheAgent(config, Fingerprint.of(config.layout), 4096, metrics=AgentMetrics(registry), secret=b"s" * 32)
    try:
        def evictions() -> float:
            return registry.get_sample_value("lmcache_p2p_evictions_total", {"tier": "cpu"}) or 0.0

        for i in range(5):  # two slots: three evictions
            agent.tiers.put(ChunkKey(bytes([i]) * 16), agent.fp, memoryview(bytes(4096)), 256, heads=agent.heads)
        assert evictions() == 3
        assert evictions() == 3  # a second scrape counts nothing twice
        agent.tiers.put(ChunkKey(b"\x09" * 16), agent.fp, memoryview(bytes(4096)), 256, heads=agent.heads)
        assert evictions() == 4
    finally:
        agent.stop()
