"""``lmcache-p2p bench mesh``: end-to-end lookup + load of a long prompt through the cache agent.

A private etcd, an owner agent in its own process holding a 32,768-token prompt (128 chunks), and
a requester agent in this process. Measures, per round (median):

    lookup_ms       keys + plan for the whole prompt (dict probes, no network)
    peer_hit_ms     lookup + pull of all 128 chunks from the owner + copy into the caller's buffers
    local_hit_ms    the same prompt again, now held locally
    memcpy_ms       a plain copy of the same bytes (the floor for local_hit_ms)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from prometheus_client import CollectorRegistry

from ..agent import CacheAgent
from ..agent_main import fingerprint_of
from ..config import load_config
from ..index.etcd_server import EtcdServer
from ..metrics import AgentMetrics
from ..synthetic import synthetic_tokens
from .common import emit, gbps

SECRET = "bench-mesh-secret-7f3a9c1e5b2d80461c9e4a7b"


def _config(path: Path, node: str, endpoints: tuple[str, ...], transport: str, cpu: str) -> Path:
    path.write_text(yaml.safe_dump({
        "node_id": node, "cluster": "bench-mesh", "tiers": {"cpu_capacity": cpu},
        "etcd": {"endpoints": list(endpoints)},
        "transfer": {"transports": [transport], "secret": SECRET, "timeout_s": 10},
    }))
    return path


def run(tokens: int, rounds: int, transport: str, work: Path) -> dict[str, object]:
    with EtcdServer(base_dir=str(work)) as etcd:
        owner_cfg = _config(work / "owner.yaml", "owner", etcd.endpoints, transport, "512MiB")
        env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
        owner = subprocess.Popen([sys.executable, "-m", "lmcache_p2p", "agent", "--config", str(owner_cfg),
                                  "--preload-seed", "1", "--preload-tokens", str(tokens), "--log-level", "WARNING"],
                                 stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert owner.stdout is not None
            info = json.loads(owner.stdout.readline())
            cfg = load_config(_config(work / "req.yaml", "requester", etcd.endpoints, transport, "512MiB"), env={})
            agent = CacheAgent(cfg, fingerprint_of(cfg.layout), cfg.layout.chunk_bytes(cfg.chunk_size),
                               metrics=AgentMetrics(CollectorRegistry())).start()
            try:
                return _measure(agent, synthetic_tokens(1, tokens), rounds, info["stored"], transport)
            finally:
                agent.stop()
        finally:
            owner.terminate()
            owner.wait(30)
            if owner.stdout is not None:
                owner.stdout.close()


def _measure(agent: CacheAgent, tokens: list[int], rounds: int, chunks: int, transport: str) -> dict[str, object]:
    deadline = time.monotonic() + 10
    while agent.lookup(tokens).hit_tokens < len(tokens) and time.monotonic() < deadline:
        time.sleep(0.05)
    n = len(agent.lookup(tokens).chunks)
    staging = np.zeros(n * agent.chunk_bytes, dtype=np.uint8)
    views = [staging[i * agent.chunk_bytes:(i + 1) * agent.chunk_bytes].data for i in range(n)]
    src = np.ones_like(staging)
    lookup, peer, local, memcpy = [], [], [], []
    for _ in range(rounds):
        for chunk in agent.lookup(tokens).chunks:
            agent.tiers.remove(chunk.key)
        t0 = time.perf_counter()
        plan = agent.lookup(tokens)
        t1 = time.perf_counter()
        ok = agent.load(plan, views)
        t2 = time.perf_counter()
        if not all(ok) or len(ok) != n:
            raise RuntimeError(f"bench: peer load missed {ok.count(False)} of {len(ok)} chunks")
        plan = agent.lookup(tokens)
        ok = agent.load(plan, views)
        t3 = time.perf_counter()
        np.copyto(staging, src)
        t4 = time.perf_counter()
        if not all(ok):
            raise RuntimeError("bench: local load missed")
        lookup.append(t1 - t0)
        peer.append(t2 - t0)
        local.append(t3 - t2)
        memcpy.append(t4 - t3)
    nbytes = sum(h.length for h in (agent.chunk_header(c.key) for c in plan.chunks) if h is not None)
    med = statistics.median
    return {
        "prompt_tokens": len(tokens), "chunks": n, "bytes": nbytes, "transport": transport, "rounds": rounds,
        "lookup_ms": round(1000 * med(lookup), 3),
        "peer_hit_ms": round(1000 * med(peer), 2), "peer_hit_gbps": gbps(nbytes, med(peer)),
        "local_hit_ms": round(1000 * med(local), 2), "local_hit_gbps": gbps(nbytes, med(local)),
        "memcpy_ms": round(1000 * med(memcpy), 2), "local_hit_vs_memcpy": round(med(memcpy) / med(local), 3),
        "owner_stored_chunks": chunks,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p bench mesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128 * 256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "nixl"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lmcache-p2p-bench-mesh-") as tmp:
        result = run(args.tokens, args.rounds, args.transport, Path(tmp))
    emit(result, args.json, "bench mesh (median per round; 128-chunk prompt by default)")
    return 0
