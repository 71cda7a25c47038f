"""The guards a first-hour user trips: sizes in Kubernetes' units, LMCACHE_P2P_CONFIG for every process,
a wildcard listen host without an advertise host, /metrics bound where peers can't reach it, vLLM's
flat extra-config keys, a missing cluster secret."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.cli.common import tool_config
from lmcache_p2p.config import (
    AgentConfig,
    TransferConfig,
    advertised_hosts,
    detect_host,
    extra_config_overrides,
    is_loopback,
    load_config,
    parse_size,
    require_secret,
)
from lmcache_p2p.errors import ConfigError
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.testing.memory_index import MemoryIndex, MemoryMesh

SECRET = "guards-test-secret-5d1e9a7c3b2f48e6a0c4"


# -- sizes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("32Gi", 32 << 30), ("512Mi", 512 << 20), ("4Ki", 4096), ("1Ti", 1 << 40),
    ("4G", 4 << 30), ("4GiB", 4 << 30), ("20GB", 20 * 10**9), ("1048576", 1 << 20), ("1.5gi", 3 << 29),
])
def test_sizes_accept_kubernetes_binary_units_beside_the_others(text, expected):
    assert parse_size(text, "tiers.cpu_capacity") == expected


@pytest.mark.parametrize("text", ["32Gb/s", "4 gigs", "12parsecs", "-1Gi", "Gi"])
def test_a_bad_unit_is_refused_naming_the_field_and_what_g_means(text):
    with pytest.raises(ConfigError, match=r"tiers\.cpu_capacity: not a size.*32Gi.*G, Gi and GiB are 2\^30"):
        parse_size(text, "tiers.cpu_capacity")


def test_a_config_file_takes_32gi(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"tiers": {"cpu_capacity": "32Gi", "disk_capacity": "100Gi"}}))
    config = load_config(path, env={})
    assert (config.tiers.cpu_capacity, config.tiers.disk_capacity) == (32 << 30, 100 << 30)


# -- LMCACHE_P2P_CONFIG ------------------------------------------------------------------------------

def test_load_config_reads_the_file_named_by_the_environment(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"cluster": "from-env-file", "chunk_size": 512}))
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"cluster": "explicit"}))
    assert load_config(env={"LMCACHE_P2P_CONFIG": str(path)}).cluster == "from-env-file"
    assert load_config(other, env={"LMCACHE_P2P_CONFIG": str(path)}).cluster == "explicit"  # --config wins
    assert load_config(env={}).cluster == "default"


def test_every_tool_honours_lmcache_p2p_config_without_config(tmp_path, monkeypatch):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"cluster": "env-cluster", "etcd": {"endpoints": ["http://10.9.9.9:2379"]}}))
    monkeypatch.setenv("LMCACHE_P2P_CONFIG", str(path))
    config = tool_config(argparse.Namespace(config=None, etcd=None, cluster=None), "test")
    assert config.cluster == "env-cluster" and config.etcd.endpoints == ("http://10.9.9.9:2379",)


# -- advertise host --------------------------------------------------------------------------------

def with_transfer(**transfer: object) -> AgentConfig:
    return AgentConfig(transfer=TransferConfig(**transfer), metrics_port=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_a_wildcard_listen_host_without_advertise_host_and_no_address_is_refused(wildcard):
    with pytest.raises(ConfigError) as info:
        advertised_hosts(with_transfer(listen_host=wildcard), detect=lambda: None)
    message = str(info.value)
    assert "transfer.listen_host" in message and "transfer.advertise_host" in message
    assert "set transfer.advertise_host" in message  # the fix


def test_a_wildcard_listen_host_advertises_the_detected_address():
    hosts = advertised_hosts(with_transfer(listen_host="0.0.0.0"), detect=lambda: "10.1.2.3")
    assert (hosts.transfer, hosts.detected) == ("10.1.2.3", True)
    configured = advertised_hosts(with_transfer(listen_host="0.0.0.0", advertise_host="10.4.4.4"),
                                  detect=lambda: pytest.fail("detection with an advertise host set"))
    assert (configured.transfer, configured.detected) == ("10.4.4.4", False)


def test_a_wildcard_advertise_host_is_refused():
    with pytest.raises(ConfigError, match="transfer.advertise_host"):
        advertised_hosts(with_transfer(listen_host="0.0.0.0", advertise_host="0.0.0.0"), detect=lambda: "10.1.2.3")


def test_detection_finds_no_loopback_address():
    found = detect_host()
    assert found is None or not is_loopback(found)


def test_the_metrics_url_follows_where_the_metrics_server_binds():
    base = with_transfer(listen_host="0.0.0.0", advertise_host="10.4.4.4")
    wildcard = advertised_hosts(AgentConfig(transfer=base.transfer, metrics_port=0, metrics_host="0.0.0.0"))
    assert (wildcard.metrics, wildcard.warnings) == ("10.4.4.4", ())
    specific = advertised_hosts(AgentConfig(transfer=base.transfer, metrics_port=0, metrics_host="10.5.5.5"))
    assert (specific.metrics, specific.warnings) == ("10.5.5.5", ())
    local = advertised_hosts(AgentConfig(transfer=base.transfer, metrics_port=0))  # metrics_host's default
    assert local.metrics == "127.0.0.1"
    assert len(local.warnings) == 1 and "metrics_host" in local.warnings[0] and "10.4.4.4" in local.warnings[0]
    alone = advertised_hosts(AgentConfig(metrics_port=0))  # all on loopback: one machine, nothing to say
    assert (alone.transfer, alone.metrics, alone.warnings) == ("127.0.0.1", "127.0.0.1", ())


def agent(config: AgentConfig) -> CacheAgent:
    return CacheAgent.of(config, secret=SECRET.encode(),
                         index_factory=lambda _loop, record: MemoryIndex(MemoryMesh(), record),
                         metrics=AgentMetrics(CollectorRegistry()))


def test_an_agent_warns_when_its_metrics_are_loopback_while_it_advertises_elsewhere(caplog):
    config = AgentConfig(node_id="guard-a", metrics_port=0,
                         transfer=TransferConfig(listen_host="127.0.0.1", advertise_host="192.0.2.10"))
    a = agent(config)
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.agent"):
        a.start()
    try:
        record = a.node_record()
        assert record.metrics_url == f"http://127.0.0.1:{a.metrics_port}/metrics"  # where it binds, not 192.0.2.10
        assert record.addresses["tcp"].startswith("192.0.2.10:")
        warned = [r.getMessage() for r in caplog.records if "metrics_host" in r.getMessage()]
        assert len(warned) == 1 and "192.0.2.10" in warned[0]
    finally:
        a.stop()


def test_an_agent_listening_everywhere_advertises_an_address_peers_can_dial():
    config = AgentConfig(node_id="guard-b", metrics_port=0, metrics_host="0.0.0.0",
                         transfer=TransferConfig(listen_host="0.0.0.0"))
    a = agent(config)
    detected = detect_host()
    if detected is None:  # nothing routes outward here: the agent refuses to start, naming the fix
        with pytest.raises(ConfigError, match="transfer.advertise_host"):
            a.start()
        return
    a.start()
    try:
        record = a.node_record()
        assert record.addresses["tcp"].rsplit(":", 1)[0] == detected
        assert record.metrics_url == f"http://{detected}:{a.metrics_port}/metrics"
    finally:
        a.stop()


# -- vLLM's kv_connector_extra_config -------------------------------------------------------------

def test_flat_dotted_extra_config_keys_work_like_overrides():
    path, overrides = extra_config_overrides({"config": "/etc/agent.yaml", "transfer.listen_host": "0.0.0.0",
                                              "overrides": {"tiers.cpu_capacity": "4Gi", "chunk_size": 512},
                                              "chunk_size": 256, "keep_fail_policy": True})
    assert path == "/etc/agent.yaml"
    assert overrides == {"transfer.listen_host": "0.0.0.0", "tiers.cpu_capacity": "4Gi", "chunk_size": 256}
    config = load_config(None, env={}, overrides=overrides)
    assert (config.transfer.listen_host, config.tiers.cpu_capacity, config.chunk_size) == ("0.0.0.0", 4 << 30, 256)
    assert extra_config_overrides({}) == (None, {})


@pytest.mark.parametrize("key", ["transfer.listen_hots", "listen_host", "nosuch.field", "set_by_node", "tiers"])
def test_an_unknown_extra_config_key_is_refused_by_name(key):
    with pytest.raises(ConfigError, match=rf"kv_connector_extra_config\.{key}: unknown key"):
        extra_config_overrides({key: "x"})


# -- the cluster secret ----------------------------------------------------------------------------

def test_a_missing_secret_says_how_to_set_it():
    with pytest.raises(ConfigError) as info:
        require_secret(AgentConfig(), env={})
    assert "LMCACHE_P2P_SECRET" in str(info.value) and "openssl rand -hex 32" in str(info.value)
    assert require_secret(AgentConfig(), env={"LMCACHE_P2P_SECRET": SECRET}) == SECRET.encode()


def test_the_agent_command_without_a_secret_exits_2_naming_it(tmp_path: Path):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"node_id": "no-secret"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    r = subprocess.run([sys.executable, "-m", "lmcache_p2p", "agent", "--config", str(path)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2 and "LMCACHE_P2P_SECRET" in r.stderr, r.stderr
