"""vLLM integration: ``kv_connector: LMCacheP2PConnector``,
``kv_connector_module_path: lmcache_p2p.integrations.vllm``."""

from .connector import LMCacheP2PConnector

__all__ = ["LMCacheP2PConnector"]
