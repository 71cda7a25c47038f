"""One TP rank's cache agent in a process of its own: it stores its heads of prompt SEED.

    python tests/tp_rank_proc.py CONFIG TP_SIZE TP_RANK SEED

The rank's KV is ``tp_kv.full_cache(SEED)`` cut to its heads, the prompt's blocks at
``tp_kv.block_ids(SEED)``. Prints one JSON line when its chunks are stored; stops on SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from tp_kv import TOKENS, block_ids, full_cache, shard, store_prompt

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import cluster_secret, load_config, rank_config
from lmcache_p2p.keys import Fingerprint, head_range


def main(argv: list[str]) -> int:
    path, tp_size, rank, seed = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    config = rank_config(load_config(path, env={}), rank, tp_size)
    layout = config.layout
    heads = head_range(layout.num_kv_heads, tp_size, rank)
    layers = shard(full_cache(layout, seed), heads)
    chunk_bytes = layout.chunk_bytes(config.chunk_size) * (heads[1] - heads[0]) // layout.num_kv_heads
    agent = CacheAgent(config, Fingerprint.of(layout, tp_size, rank), chunk_bytes, secret=cluster_secret(config),
                       heads=heads).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stored = store_prompt(agent, layers, seed, block_ids(seed, -(-TOKENS // layout.block_size)))
        agent.index.flush(30.0)  # type: ignore[union-attr]
        print(json.dumps({"ready": True, "node_id": agent.node_id, "stored": stored, "heads": heads}), flush=True)
        stop.wait()
    finally:
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
