"""Cluster control plane, installed as ``lmcache_p2p.coordinator``: the etcd-backed cluster config.

    cluster_config.py   the schema: fields, validation naming the field, retired fields
    store.py            read, compare-and-swap update and watch it in etcd (``lmcache-p2p config``)
    apply.py            what it does to a node: precedence under the node's own settings, the fields
                        applied while running and those that wait for a restart
"""

from .cluster_config import ClusterConfig
from .store import ConfigStore, ConfigWatcher

__all__ = ["ClusterConfig", "ConfigStore", "ConfigWatcher"]
