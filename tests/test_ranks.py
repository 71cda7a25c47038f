"""Tensor-parallel ranks of one engine on one host: one agent per rank, each with its own node id,
disk directory and share of the tiers (real etcd, real agents with disk tiers)."""

from __future__ import annotations

from pathlib import Path

from agent_helpers import agent_yaml, config, wait_until
from prometheus_client import CollectorRegistry

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import rank_config
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.testing.synthetic import preload

TOKENS = 1024 + 100


def agent(cfg) -> CacheAgent:  # type: ignore[no-untyped-def]
    return CacheAgent.of(cfg, metrics=AgentMetrics(CollectorRegistry())).start()


def test_two_ranks_of_one_engine_keep_apart(etcd, cluster_name, tmp_path: Path):
    base = config(agent_yaml(tmp_path / "pod.yaml", node="pod-7", cluster=cluster_name, endpoints=etcd.endpoints,
                             disk=tmp_path / "disk", cpu="64MiB"))
    assert rank_config(base, 0, 1) is base  # TP 1: unchanged
    cfgs = [rank_config(base, r, 2) for r in range(2)]
    assert [c.node_id for c in cfgs] == ["pod-7-r0", "pod-7-r1"]
    assert [c.tiers.disk_path for c in cfgs] == [str(tmp_path / "disk" / "r0"), str(tmp_path / "disk" / "r1")]
    assert all(c.tiers.cpu_capacity == base.tiers.cpu_capacity // 2 for c in cfgs)
    ranks = [agent(c) for c in cfgs]
    try:
        assert preload(ranks[0], 1, TOKENS) == 5 and preload(ranks[1], 2, TOKENS) == 5
        assert wait_until(lambda: {"pod-7-r0", "pod-7-r1"} <= set(ranks[0].index.nodes()), 10)  # type: ignore[union-attr]
        for a in ranks:
            a.stop()  # each writes its chunks back to its own disk directory
        files0 = sorted((tmp_path / "disk" / "r0").glob("*.chunk"))
        assert len(files0) == 5 and len(list((tmp_path / "disk" / "r1").glob("*.chunk"))) == 5
        ranks[1] = agent(cfgs[1])  # restarts and rescans (and cleans) its own directory only
        assert len(ranks[1].tiers.inventory()) == 5
        assert sorted((tmp_path / "disk" / "r0").glob("*.chunk")) == files0  # rank 0's files untouched
        ranks[0] = agent(cfgs[0])
        assert len(ranks[0].tiers.inventory()) == 5
        assert wait_until(lambda: {"pod-7-r0", "pod-7-r1"} <= set(ranks[1].index.nodes()), 10)  # type: ignore[union-attr]
    finally:
        for a in ranks:
            a.stop()
