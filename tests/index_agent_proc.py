"""A minimal agent process for the SIGKILL test: register N chunks, print READY, sleep.

    python tests/index_agent_proc.py ENDPOINT CLUSTER NODE FP_HEX N TTL
Chunk keys are xxh3_128 of the node name and the index, so the test can recompute them.
"""

from __future__ import annotations

import sys
import time

import xxhash

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.config import AgentConfig, EtcdConfig
from lmcache_p2p.ids import TIER_CPU, NodeId
from lmcache_p2p.index.etcd_index import EtcdBlockIndex
from lmcache_p2p.index.schema import NodeRecord
from lmcache_p2p.keys import ChunkKey, FingerprintDigest


def keys_for(node: str, n: int) -> list[ChunkKey]:
    return [ChunkKey(xxhash.xxh3_128_digest(f"{node}/{i}".encode())) for i in range(n)]


def main(argv: list[str]) -> None:
    endpoint, cluster, node, fp_hex, n, ttl = argv
    config = AgentConfig(node_id=node, cluster=cluster,
                         etcd=EtcdConfig(endpoints=(endpoint,), lease_ttl_s=int(ttl)))
    loop = LoopThread()
    index = EtcdBlockIndex.open(loop, config, NodeRecord(NodeId(node), {"tcp": "127.0.0.1:1"}, ("tcp",)))
    fp = FingerprintDigest(bytes.fromhex(fp_hex))
    index.add_many(fp, keys_for(node, int(n)), TIER_CPU)
    index.flush(30.0)
    print("READY", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1:])
