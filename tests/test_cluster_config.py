"""Cluster config: schema validation, get/set/watch against a real etcd, and the CLI."""

from __future__ import annotations

import asyncio
import json
import queue

import pytest

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.coordinator.cli import main as config_cli
from lmcache_p2p.coordinator.cluster_config import ClusterConfig, parse_assignments
from lmcache_p2p.coordinator.store import ConfigStore, ConfigWatcher
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.etcd_server import EtcdServer


@pytest.mark.parametrize(("assignment", "field"), [
    ("chunk_size=100", "chunk_size"), ("chunk_size=abc", "chunk_size"), ("eviction=random", "eviction"),
    ("auth_mode=plain", "auth_mode"), ("lease_ttl_s=1", "lease_ttl_s"), ("cpu_capacity=-5", "cpu_capacity"),
    ("chunk_ttl_s=0", "chunk_ttl_s"), ("no_such_field=1", "no_such_field"), ("chunk_size", "chunk_size"),
])
def test_invalid_values_name_the_field(assignment: str, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        ClusterConfig().with_updates(parse_assignments([assignment]))
    assert exc.value.field == field


def test_parsing_and_round_trip() -> None:
    cfg = ClusterConfig().with_updates({"chunk_size": "512", "cpu_capacity": "4GiB", "chunk_ttl_s": "none",
                                        "eviction": "lfu", "publish_coalesce_ms": "1.5"})
    assert (cfg.chunk_size, cfg.cpu_capacity, cfg.chunk_ttl_s, cfg.eviction) == (512, 4 << 30, None, "lfu")
    assert ClusterConfig.unpack(cfg.pack()) == cfg


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
    assert config_cli([*base, "set", "chunk_size=768", "auth_mode=none"]) == 0
    capsys.readouterr()
    assert config_cli([*base, "get", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["chunk_size"] == 768 and got["auth_mode"] == "none"
    assert config_cli([*base, "set", "eviction=fifo"]) == 2
    assert "eviction" in capsys.readouterr().err
    assert config_cli([*base, "watch", "--count", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["chunk_size"] == 768


def test_cli_without_etcd_starts_a_private_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_cli(["get", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.strip()) == ClusterConfig().to_dict()
    assert "private etcd" in out.err
