"""Paged-KV gather/scatter kernels (CPU and CUDA/Triton), installed as ``lmcache_p2p.kernels``."""
