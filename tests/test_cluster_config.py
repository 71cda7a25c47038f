"""Cluster config: schema validation, get/set/watch against a real etcd, and the CLI."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
from pathlib import Path

import msgpack
import pytest
import yaml

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.cli.config import main as config_cli
from lmcache_p2p.config import EtcdConfig, load_config
from lmcache_p2p.coordinator.apply import read_at_start
from lmcache_p2p.coordinator.cluster_config import ClusterConfig, parse_assignments
from lmcache_p2p.coordinator.store import ConfigStore, ConfigWatcher
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.etcd_server import EtcdServer
from lmcache_p2p.tiers.eviction import LFU, LRU


@pytest.mark.parametrize(("assignment", "field"), [
    ("chunk_size=100", "chunk_size"), ("chunk_size=abc", "chunk_size"), ("eviction=random", "eviction"),
    ("auth_mode=none", "auth_mode"), ("replicate_after=-1", "replicate_after"), ("lease_ttl_s=1", "lease_ttl_s"),
    ("cpu_capacity=-5", "cpu_capacity"),
    ("chunk_ttl_s=0", "chunk_ttl_s"), ("no_such_field=1", "no_such_field"), ("chunk_size", "chunk_size"),
    ("log_level=LOUD", "log_level"), ("peer_backoff_s=-1", "peer_backoff_s"),
])
def test_invalid_values_name_the_field(assignment: str, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        ClusterConfig().with_updates(parse_assignments([assignment]))
    assert exc.value.field == field


def test_cluster_defaults_agree_with_the_agents_defaults() -> None:
    """`config set` stores every field, defaults included: a default that differed from the agent's would
    silently change every node that does not set the field itself."""
    from lmcache_p2p.config import AgentConfig
    from lmcache_p2p.coordinator.apply import FIELDS, field_value

    cluster, agent = ClusterConfig(), AgentConfig()
    for field, (dotted, _) in FIELDS.items():
        assert getattr(cluster, field) == field_value(agent, dotted), field


def test_parsing_and_round_trip() -> None:
    cfg = ClusterConfig().with_updates({"chunk_size": "512", "cpu_capacity": "4GiB", "chunk_ttl_s": "none",
                                        "eviction": "lfu", "handoff_budget_bytes_per_s": "8MiB"})
    assert (cfg.chunk_size, cfg.cpu_capacity, cfg.chunk_ttl_s, cfg.eviction) == (512, 4 << 30, None, "lfu")
    assert cfg.handoff_budget_bytes_per_s == 8 << 20
    assert ClusterConfig.unpack(cfg.pack()) == cfg
    # a config stored by an earlier version, with fields no agent ever read: still readable
    old = msgpack.packb({**cfg.to_dict(), "auth_mode": "hmac", "publish_coalesce_ms": 3.0}, use_bin_type=True)
    assert ClusterConfig.unpack(old) == cfg


@pytest.fixture
def client(loop: LoopThread, etcd: EtcdServer):  # type: ignore[no-untyped-def]
    c = EtcdClient(EtcdConfig(endpoints=etcd.endpoints))
    loop.run(c.connect(), 5.0)
    yield c
    loop.run(c.close(), 5.0)


def test_set_get_watch_round_trip(loop: LoopThread, client: EtcdClient, cluster_name: str) -> None:
    store = ConfigStore(client, cluster_name)
    seen: queue.Queue[ClusterConfig] = queue.Queue()
    watcher = ConfigWatcher(client, cluster_name, seen.put)
    assert loop.run(watcher.start(), 5.0) == ClusterConfig()
    assert seen.get(timeout=5) == ClusterConfig()

    new = loop.run(store.update({"chunk_size": "512"}), 5.0)
    assert new.chunk_size == 512
    assert loop.run(store.get(), 5.0)[0] == new
    assert seen.get(timeout=5) == new

    with pytest.raises(ConfigError):
        loop.run(store.update({"chunk_size": "100", "eviction": "lfu"}), 5.0)
    assert loop.run(store.get(), 5.0)[0] == new  # untouched, no half-applied change
    assert seen.empty()

    loop.run(client.put(store.key, b"\x81\xaachunk_size\x0b"), 5.0)  # invalid, behind the tools' back
    loop.run(asyncio.sleep(0.3), 5.0)
    assert seen.empty() and watcher.current == new  # ignored; the last valid config stays
    loop.run(watcher.stop(), 5.0)


def test_concurrent_updates_both_land(loop: LoopThread, client: EtcdClient, cluster_name: str) -> None:
    store = ConfigStore(client, cluster_name)

    async def both() -> None:
        await asyncio.gather(*(store.update({field: value}) for field, value in
                               [("eviction", "lfu"), ("chunk_size", "1024"), ("lease_ttl_s", "20")]))
    loop.run(both(), 10.0)
    cfg, _ = loop.run(store.get(), 5.0)
    assert (cfg.eviction, cfg.chunk_size, cfg.lease_ttl_s) == ("lfu", 1024, 20)


def test_cli_get_set(etcd: EtcdServer, cluster_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--etcd", etcd.endpoint, "--cluster", cluster_name]
    assert config_cli([*base, "set", "chunk_size=768", "replicate_after=0"]) == 0
    capsys.readouterr()
    assert config_cli([*base, "get", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["chunk_size"] == 768 and got["replicate_after"] == 0
    assert config_cli([*base, "get"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.strip().splitlines()}
    assert rows["chunk_size"] == ["768", "at", "restart"] and rows["chunk_ttl_s"] == ["none", "live"]
    assert rows["version"] == ["1"]
    assert config_cli([*base, "set", "eviction=fifo"]) == 2
    assert "eviction" in capsys.readouterr().err
    assert config_cli([*base, "watch", "--count", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["chunk_size"] == 768


def test_cli_without_etcd_starts_a_private_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_cli(["get", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.strip()) == ClusterConfig().to_dict()
    assert "private etcd" in out.err


# --------------------------------------------------------------------------- the cluster config in effect

def _agent_config(tmp_path: Path, etcd: EtcdServer, cluster: str, name: str, **tiers: object) -> Path:
    from agent_helpers import agent_yaml

    path = agent_yaml(tmp_path / f"{name}.yaml", node=name, cluster=cluster, endpoints=etcd.endpoints)
    if tiers:
        data = yaml.safe_load(path.read_text())
        data["tiers"].update(tiers)
        path.write_text(yaml.safe_dump(data))
    return path


def test_the_cluster_config_applies_under_the_nodes_own_settings(loop: LoopThread, client: EtcdClient,
                                                                 etcd: EtcdServer, cluster_name: str,
                                                                 tmp_path: Path) -> None:
    loop.run(ConfigStore(client, cluster_name).update({"chunk_ttl_s": "30", "eviction": "lfu",
                                                       "replicate_after": "7"}), 5.0)
    plain = load_config(_agent_config(tmp_path, etcd, cluster_name, "p"), env={})
    own = load_config(_agent_config(tmp_path, etcd, cluster_name, "o", eviction="s3fifo"), env={})
    assert "tiers.eviction" in own.set_by_node and "tiers.eviction" not in plain.set_by_node
    got, revision = read_at_start(plain)
    assert revision > 0
    assert (got.tiers.chunk_ttl_s, got.tiers.eviction, got.handoff.replicate_after) == (30.0, "lfu", 7)
    assert got.chunk_size == plain.chunk_size  # not in the stored record: the node's (default) value stays
    got, _ = read_at_start(own)
    assert (got.tiers.chunk_ttl_s, got.tiers.eviction) == (30.0, "s3fifo")  # the node's file wins
    env = read_at_start(load_config(_agent_config(tmp_path, etcd, cluster_name, "e"),
                                    env={"LMCACHE_P2P_TIERS_CHUNK_TTL_S": "9"}))[0]
    assert env.tiers.chunk_ttl_s == 9.0  # and so does its environment


def test_config_set_changes_what_a_running_agent_does(etcd: EtcdServer, cluster_name: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from agent_helpers import wait_until
    from prometheus_client import CollectorRegistry

    from lmcache_p2p.agent import CacheAgent
    from lmcache_p2p.cli.status import collect
    from lmcache_p2p.metrics import AgentMetrics
    from lmcache_p2p.testing.synthetic import preload

    path = _agent_config(tmp_path, etcd, cluster_name, "a")
    data = yaml.safe_load(path.read_text())
    del data["transfer"]["backoff_s"]  # left to the cluster config
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path, env={})
    agent = CacheAgent.of(cfg, metrics=AgentMetrics(CollectorRegistry())).start()
    base = ["--etcd", etcd.endpoint, "--cluster", cluster_name]
    try:
        from lmcache_p2p.coordinator.apply import FIELDS

        # every field the cluster config applies live has its setter (or is read at every use), and only those
        assert set(agent.live_setters()) == {dotted for dotted, live in FIELDS.values() if live}
        assert preload(agent, 1, 1024) == 4
        assert agent.config.tiers.chunk_ttl_s is None and agent.config.handoff.budget_bytes_per_s > 0
        assert config_cli([*base, "set", "chunk_ttl_s=1", "handoff_budget_bytes_per_s=0", "chunk_size=512"]) == 0
        assert wait_until(lambda: agent.config.tiers.chunk_ttl_s == 1.0, 10)
        assert agent.config.handoff.budget_bytes_per_s == 0  # live fields applied...
        assert agent.config.chunk_size == 256  # ...the chunk size waits for a restart (engines must agree)
        assert wait_until(lambda: not agent.tiers.cpu.keys(), 10)  # the new TTL expired the chunks
        revision = agent.live.revision
        assert revision > 0
        report = asyncio.run(collect(agent.config))
        assert [n["config_revision"] for n in report["nodes"]] == [revision]
        # where the node does not run the cluster's value, and why: in its record and in `status`
        assert agent.live.deviations == {"chunk_size": "restart", "tiers.cpu_capacity": "node",
                                           "etcd.lease_ttl_s": "node"}  # the last two: set in its file
        assert wait_until(lambda: asyncio.run(collect(agent.config))["nodes"][0]["config_deviations"]
                          == agent.live.deviations, 10)
        report = asyncio.run(collect(agent.config))
        assert report["healthy"] and report["notes"] == [
            "config-restart: a applies chunk_size of the cluster config at its next start",
            "config-own: a keeps its own etcd.lease_ttl_s, tiers.cpu_capacity (set in its file, environment or "
            "overrides)"]
        assert config_cli([*base, "set", "chunk_ttl_s=none"]) == 0
        assert wait_until(lambda: agent.config.tiers.chunk_ttl_s is None and agent.live.revision > revision, 10)
        # eviction policy, peer backoff and log level: live too
        assert preload(agent, 2, 768) == 3
        pool = agent.tiers.cpu
        assert isinstance(pool.policy, LRU) and pool.policy.coldest(3) == pool.keys()
        stack = agent.transfer_stack
        assert stack is not None and stack.health.base_s == 2.0
        assert config_cli([*base, "set", "eviction=lfu", "peer_backoff_s=7", "log_level=DEBUG"]) == 0
        assert wait_until(lambda: isinstance(pool.policy, LFU), 10)
        assert len(pool.policy) == 3 and sorted(pool.policy.coldest(3)) == sorted(pool.keys())  # nothing lost
        assert stack.health.base_s == 7.0 and logging.getLogger("lmcache_p2p").level == logging.DEBUG
        assert config_cli([*base, "set", "log_level=none"]) == 0
        assert wait_until(lambda: logging.getLogger("lmcache_p2p").level == logging.NOTSET, 10)
    finally:
        agent.stop()
        logging.getLogger("lmcache_p2p").setLevel(logging.NOTSET)


def test_bench_config_runs_and_every_agent_ends_on_one_revision() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lmcache_p2p", "bench", "config", "--agents", "2", "--rounds", "3",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["agents_on_one_revision"] is True and result["rounds"] == 3
    assert result["apply_ms_p50"] > 0 and result["watch_ms_p50"] > 0
