"""A peer that stamps its chunks with epochs it never had (a buggy or hostile node holding the secret).

    python tests/lying_peer_proc.py CONFIG.yaml TOKENS SEED:EPOCH [SEED:EPOCH ...]

EPOCH is an integer, or ``top`` for the highest epoch of this node's own generation (generation id
<< 40 | 2^40-1). The agent's own epoch cap is switched off (as in a version without it), so it holds
and serves every chunk of synthetic prompt SEED under EPOCH; the payload bytes are the true ones.
Prints one JSON line (node id, metrics port, its generation) and serves until killed.
"""

from __future__ import annotations

import json
import sys
import threading

from prometheus_client import CollectorRegistry

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.chunk import ChunkHeader
from lmcache_p2p.config import cluster_secret, load_config
from lmcache_p2p.index.generation import MAX_REVISION, make_epoch
from lmcache_p2p.keys import Fingerprint
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.testing.synthetic import synthetic_payload, synthetic_tokens


class LyingAgent(CacheAgent):
    def _stamp(self, header: ChunkHeader) -> ChunkHeader:
        return header  # holds (and serves) chunks under whatever epoch they claim


def main(cfg_path: str, num_tokens: str, *stamps: str) -> None:
    config = load_config(cfg_path, env={})
    agent = LyingAgent(config, Fingerprint.of(config.layout), config.layout.chunk_bytes(config.chunk_size),
                       metrics=AgentMetrics(CollectorRegistry()), secret=cluster_secret(config))
    agent.start()
    for item in stamps:
        seed, epoch_text = item.split(":")
        epoch = make_epoch(agent.invalidation.generation, MAX_REVISION) if epoch_text == "top" else int(epoch_text)
        keys, spans = agent.keys_for(synthetic_tokens(int(seed), int(num_tokens)))
        for key, (s, e) in zip(keys, spans, strict=True):
            payload = memoryview(synthetic_payload(key, config.layout.chunk_bytes(e - s)))
            assert agent.tiers.put(key, agent.fp, payload, e - s, epoch, agent.heads) is not None
    print(json.dumps({"ready": True, "node_id": agent.node_id, "metrics_port": agent.metrics_port,
                      "generation": agent.invalidation.generation, "held": len(agent.tiers.inventory())}),
          flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(*sys.argv[1:])
