"""A peer that holds a corrupted copy of a prompt's chunks (for the vLLM fail-closed test).

    python tests/corrupt_peer_proc.py CONFIG.yaml TOKENS.json MODEL_ID DTYPE

Pulls the prompt's chunks from whoever holds them (a real vLLM engine's agent), flips one byte
in the memory of its copy of chunk 1 (its stored checksum now disagrees with its bytes), prints
READY and serves until killed. Its layout matches the tiny model's engines in vLLM on CPU.
"""

from __future__ import annotations

import json
import sys
import time

from prometheus_client import CollectorRegistry

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import load_config
from lmcache_p2p.keys import Fingerprint
from lmcache_p2p.metrics import AgentMetrics


def main(cfg_path: str, tokens_path: str, model_id: str, dtype: str) -> None:
    overrides = {"layout.model_id": model_id, "layout.kv_dtype": dtype}
    config = load_config(cfg_path, env={}, overrides=overrides)
    lay = config.layout
    fp = Fingerprint.of(lay)
    agent = CacheAgent(config, fp, lay.chunk_bytes(config.chunk_size), metrics=AgentMetrics(CollectorRegistry()))
    agent.start()
    tokens = json.loads(open(tokens_path).read())
    plan = agent.lookup(tokens)
    loaded = agent.load(plan, [memoryview(bytearray(agent.chunk_bytes)) for _ in plan.chunks])
    if len(loaded) < 2 or not all(loaded):
        print(f"FAILED to pull: {loaded}", flush=True)
        sys.exit(1)
    pin = agent.tiers.cpu.pin(plan.chunks[1].key, 5.0)
    assert pin is not None
    agent.tiers.cpu.slot_view(pin.slot)[1000] ^= 0xFF
    agent.tiers.cpu.unpin(pin)
    print("READY", len(loaded), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
