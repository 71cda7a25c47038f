"""lmcache-p2p: a peer-to-peer KV-cache mesh for LLM inference."""

__version__ = "0.1.0"
