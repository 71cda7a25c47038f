"""Cluster control plane: the etcd-backed cluster config, installed as ``lmcache_p2p.coordinator``."""

from .cluster_config import ClusterConfig
from .store import ConfigStore, ConfigWatcher

__all__ = ["ClusterConfig", "ConfigStore", "ConfigWatcher"]
