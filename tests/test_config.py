import pytest

from lmcache_p2p.config import AgentConfig, cluster_secret, load_config, parse_size
from lmcache_p2p.errors import ConfigError


def test_precedence_file_env_overrides(tmp_path):
    f = tmp_path / "agent.yaml"
    f.write_text("chunk_size: 512\ncluster: from-file\ntiers:\n  cpu_capacity: 2GiB\n  eviction: lfu\n")
    cfg = load_config(f, env={"LMCACHE_P2P_CLUSTER": "from-env"}, overrides={"tiers.eviction": "s3fifo"})
    assert cfg.chunk_size == 512
    assert cfg.cluster == "from-env"
    assert cfg.tiers.cpu_capacity == 2 << 30
    assert cfg.tiers.eviction == "s3fifo"


def test_toml_and_env_lists(tmp_path):
    f = tmp_path / "agent.toml"
    f.write_text('node_id = "n1"\n[transfer]\ntransports = ["tcp", "nixl"]\nport = 7470\n')
    cfg = load_config(f, env={"LMCACHE_P2P_ETCD_ENDPOINTS": "http://a:2379, b:2380"})
    assert cfg.node_id == "n1" and cfg.transfer.transports == ("tcp", "nixl") and cfg.transfer.port == 7470
    assert cfg.etcd.endpoints == ("http://a:2379", "b:2380")


def test_every_section_and_top_level_field_reads_the_environment():
    cfg = load_config(env={"LMCACHE_P2P_HANDOFF_MIN_HITS": "3", "LMCACHE_P2P_LOG_LEVEL": "DEBUG",
                           "LMCACHE_P2P_LAYOUT_NUM_LAYERS": "4", "LMCACHE_P2P_TIERS_EVICTION": "lfu"})
    assert (cfg.handoff.min_hits, cfg.log_level, cfg.layout.num_layers, cfg.tiers.eviction) == (3, "DEBUG", 4, "lfu")
    assert set(cfg.set_by_node) == {"handoff.min_hits", "log_level", "layout.num_layers", "tiers.eviction"}
    assert load_config(env={"LMCACHE_P2P_LOG_LEVEL": "debug"}).log_level == "DEBUG"  # as engines were told to set it
    off = {"LMCACHE_P2P_TRANSFER_RECOMPUTE_WHEN_FASTER": "false"}
    assert load_config(env=off).transfer.recompute_when_faster is False
    assert load_config(env={}, overrides={"transfer.recompute_when_faster": 0}).transfer.recompute_when_faster is False


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 << 20), ("20GB", 20 * 10**9), ("4G", 4 << 30), (1024, 1024), ("1.5KiB", 1536), ("7", 7),
])
def test_sizes(text, expected):
    assert parse_size(text, "f") == expected


@pytest.mark.parametrize("dotted,value", [
    ("chunk_size", 100), ("chunk_size", "abc"), ("node_id", "bad id!"), ("cluster", ""),
    ("metrics_port", 70000), ("tiers.cpu_capacity", "lots"), ("tiers.cpu_capacity", -1),
    ("tiers.disk_capacity", "1 parsec"), ("tiers.eviction", "fifo"), ("tiers.pin_timeout_s", 0),
    ("tiers.chunk_ttl_s", -5), ("tiers.chunk_ttl_s", 0.01), ("etcd.endpoints", ["not a url"]), ("etcd.lease_ttl_s", 1),
    ("etcd.timeout_s", 0), ("transfer.transports", ["carrier-pigeon"]), ("transfer.transports", []),
    ("transfer.port", 99999), ("transfer.timeout_s", -1), ("transfer.max_frame_bytes", 10),
    ("transfer.backoff_s", -1), ("tiers.nonsense", 1), ("nonsense", 1), ("tiers", 5),
    ("transfer.secret", "short"), ("transfer.secret", "REPLACE-ME-with-openssl-rand-hex-32"),
    ("transfer.secret", "a" * 40), ("etcd.start_wait_s", -1), ("log_level", "LOUD"), ("handoff.min_hits", -1),
    ("transfer.recompute_when_faster", 3), ("transfer.recompute_when_faster", "maybe"), ("blend.enabled", [1]),
    ("blend.lead_in", "sheet"), ("blend.selection", "random"),
])
def test_each_invalid_field_is_named(dotted, value):
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={dotted: value})
    assert isinstance(info.value, ValueError)
    assert info.value.field == dotted


def test_user_without_password_is_refused():
    with pytest.raises(ConfigError, match="etcd.password"):
        load_config(env={}, overrides={"etcd.user": "root"})


def test_unknown_file_type(tmp_path):
    f = tmp_path / "agent.ini"
    f.write_text("x")
    with pytest.raises(ConfigError, match="config"):
        load_config(f, env={})


def test_defaults_are_valid():
    assert AgentConfig().chunk_size == 256


def test_secret_from_the_environment_is_checked_too():
    cfg = load_config(None, env={})
    good = "3c9f0e1a7b52d84c6e0f9a1b2c3d4e5f"
    assert cluster_secret(cfg, env={"LMCACHE_P2P_SECRET": good}) == good.encode()
    with pytest.raises(ConfigError, match="LMCACHE_P2P_SECRET"):
        cluster_secret(cfg, env={"LMCACHE_P2P_SECRET": "changeme"})
    assert cluster_secret(cfg, env={}) is None


def test_a_password_over_plain_http_is_refused_unless_allowed():
    base = {"etcd.endpoints": "http://etcd:2379", "etcd.user": "u", "etcd.password": "p"}
    with pytest.raises(ConfigError, match="etcd.password"):
        load_config(env={}, overrides=base)
    assert load_config(env={}, overrides={**base, "etcd.allow_plaintext_password": "true"}).etcd.user == "u"
    assert load_config(env={}, overrides={**base, "etcd.endpoints": "https://etcd:2379"}).etcd.user == "u"
