"""Cluster control plane: the etcd-backed cluster config, installed as ``lmcache_p2p.coordinator``."""
