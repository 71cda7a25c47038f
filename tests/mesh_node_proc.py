"""A cache agent in its own process (inside a network namespace for the netns tests), driven by
JSON lines on stdin, so a test can make it look up and pull like an engine would.

    python tests/mesh_node_proc.py CONFIG [SEED ...]      (stores the synthetic prompts SEED first)

Commands, one JSON object per line; each answer is one JSON line on stdout::

    {"cmd": "load", "seed": S, "tokens": N, "forget": true}  -> {"sources", "loaded", "exact", "elapsed_s"}
    {"cmd": "store", "seed": S, "tokens": N}                 -> {"stored": n}
    {"cmd": "nodes"}                                         -> {"nodes": [...], "index": {stats}}
    {"cmd": "held", "seed": S, "tokens": N}                  -> {"held": n}   (that prompt's chunks held here)
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import cluster_secret, load_config
from lmcache_p2p.index.etcd_index import EtcdBlockIndex
from lmcache_p2p.testing.synthetic import preload, synthetic_payload, synthetic_tokens

TOKENS = 1024 + 100


def load(agent: CacheAgent, seed: int, tokens: int, forget: bool) -> dict[str, Any]:
    ids = synthetic_tokens(seed, tokens)
    if forget:
        for key in agent.keys_for(ids)[0]:
            agent.tiers.remove(key)
    t0 = time.perf_counter()
    plan = agent.lookup(ids)
    bufs = [bytearray(agent.chunk_bytes) for _ in plan.chunks]
    loaded = agent.load(plan, [memoryview(b) for b in bufs])
    elapsed = time.perf_counter() - t0
    layout = agent.config.layout
    exact = all(buf[: len(want)] == want for ok, chunk, buf in zip(loaded, plan.chunks, bufs, strict=True) if ok
                for want in [synthetic_payload(chunk.key, layout.chunk_bytes(chunk.end - chunk.start))])
    return {"sources": [c.source for c in plan.chunks], "loaded": loaded, "exact": exact, "elapsed_s": elapsed,
            "chunks": len(agent.keys_for(ids)[0])}


def budgeted(agent: CacheAgent, seed: int, tokens: int, prefill_tokens_per_s: float) -> dict[str, Any]:
    """Tell the agent how fast its engine prefills, then load as the connector does: only the pulls
    the budget expects to beat recomputing. ``planned``/``loaded`` count chunks."""
    ids = synthetic_tokens(seed, tokens)
    for key in agent.keys_for(ids)[0]:
        agent.tiers.remove(key)
    for _ in range(20):
        agent.prefill.observe(int(prefill_tokens_per_s), 1.0)
    t0 = time.perf_counter()
    plan = agent.lookup(ids)
    planned = len(agent.loader.budget(plan).plan.chunks)  # what load_pinned's own budget keeps
    pins = agent.loader.load_pinned(plan, time.monotonic() + agent.config.transfer.timeout_s)
    exact = True
    layout = agent.config.layout
    for chunk, pin in zip(plan.chunks, pins, strict=True):
        if pin is not None:
            view = agent.tiers.cpu.slot_view(pin.slot, pin.header.length)
            exact &= bytes(view) == synthetic_payload(chunk.key, layout.chunk_bytes(chunk.end - chunk.start))
            agent.tiers.cpu.unpin(pin)
    return {"planned": planned, "loaded": sum(p is not None for p in pins), "exact": exact,
            "elapsed_s": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    config = load_config(argv[0])
    agent = CacheAgent.of(config, secret=cluster_secret(config)).start()
    try:
        stored = sum(preload(agent, int(seed), TOKENS) for seed in argv[1:])
        print(json.dumps({"ready": True, "stored": stored, "metrics_port": agent.metrics_port}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "load":
                out = load(agent, cmd["seed"], cmd.get("tokens", TOKENS), cmd.get("forget", True))
            elif cmd["cmd"] == "store":
                out = {"stored": preload(agent, cmd["seed"], cmd.get("tokens", TOKENS))}
            elif cmd["cmd"] == "nodes":
                index = agent.index
                out = {"nodes": sorted(index.nodes()) if index is not None else [],
                       "index": index.stats() if isinstance(index, EtcdBlockIndex) else {}}
            elif cmd["cmd"] == "budgeted":  # what the worker does for an asynchronous load: budget, then pull
                out = budgeted(agent, cmd["seed"], cmd.get("tokens", TOKENS), cmd["prefill_tokens_per_s"])
            elif cmd["cmd"] == "held":
                keys = agent.keys_for(synthetic_tokens(cmd["seed"], cmd.get("tokens", TOKENS)))[0]
                out = {"held": sum(1 for k in keys if agent.tiers.where(k) is not None)}
            else:
                out = {"error": f"unknown command {cmd['cmd']!r}"}
            print(json.dumps(out), flush=True)
    finally:
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
