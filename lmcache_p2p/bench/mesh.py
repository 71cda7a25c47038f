"""``lmcache-p2p bench mesh``: end-to-end lookup + load of a long prompt through the cache agent.

A private etcd, an owner agent in its own process holding a 32,768-token prompt (128 chunks), and
a requester agent in this process. Measures, per round (median):

    lookup_ms       keys + plan for the whole prompt (dict probes, no network)
    peer_hit_ms     lookup + pull of all 128 chunks from the owner + copy into the caller's buffers
    local_hit_ms    the same prompt again, now held locally
    memcpy_ms       a plain copy of the same bytes (the floor for local_hit_ms)

Then the working set (``--working-set-docs``, 0 to skip): documents of 4 chunks requested in a
seeded uniform order, round-robin over 3 agents whose pools each hold half the documents (their
sum holds 1.5x), paced at ``--working-set-rate`` requests/s; a request loads what the mesh holds
and stores (computes) the rest. ``mesh_hit_rate`` (chunks served from the mesh / chunks requested,
after a warm-up pass) is measured three ways in the same run::

    mesh_hit_rate_single       one agent whose pool is the sum of the three (the goal)
    mesh_hit_rate_no_handoff   3 agents, handoff.budget_bytes_per_s 0 and plain eviction (as before)
    mesh_hit_rate_handoff      3 agents, hand-off and copies-evicted-first on (the defaults)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import yaml
from prometheus_client import CollectorRegistry

from ..agent import CacheAgent
from ..config import load_config
from ..index.etcd_server import EtcdServer
from ..keys import Fingerprint
from ..metrics import AgentMetrics
from ..testing.synthetic import synthetic_payload, synthetic_tokens
from . import plot
from .common import bench_parser, emit, gbps, progress

SECRET = "bench-mesh-secret-7f3a9c1e5b2d80461c9e4a7b"


def _config(path: Path, node: str, endpoints: tuple[str, ...], transport: str, cpu: str | int,
            cluster: str = "bench-mesh", handoff: Mapping[str, object] | None = None) -> Path:
    path.write_text(yaml.safe_dump({
        "node_id": node, "cluster": cluster, "tiers": {"cpu_capacity": cpu},
        "etcd": {"endpoints": list(endpoints)},
        "transfer": {"transports": [transport], "secret": SECRET, "timeout_s": 10},
        **({"handoff": dict(handoff)} if handoff else {}),
    }))
    return path


DOC_TOKENS = 4 * 256
# name -> (agents, each agent's pool as a share of the working set, handoff section)
WORKING_SET_MODES: dict[str, tuple[int, float, dict[str, object]]] = {
    "single": (1, 1.5, {}),
    "no_handoff": (3, 0.5, {"budget_bytes_per_s": 0, "evict_copies_first": False}),
    "handoff": (3, 0.5, {}),
}


def working_set(docs: int, requests: int, rate: float, transport: str, etcd: EtcdServer,
                work: Path) -> dict[str, object]:
    out: dict[str, object] = {"working_set_docs": docs, "working_set_chunks": 4 * docs,
                              "working_set_requests": requests, "working_set_rate": rate}
    order = np.random.default_rng(7).integers(0, docs, requests + docs).tolist()
    for m, (mode, (n, share, handoff)) in enumerate(WORKING_SET_MODES.items()):
        progress("mesh", f"working set {mode} ({m + 1}/{len(WORKING_SET_MODES)}): {n} agents, {requests + docs} "
                         f"requests at {rate:g}/s")
        agents: list[CacheAgent] = []
        try:
            for i in range(n):
                cfg_path = work / f"ws-{mode}-{i}.yaml"
                probe = load_config(_config(cfg_path, f"{mode}-{i}", etcd.endpoints, transport, "1MiB"), env={})
                chunk = probe.layout.chunk_bytes(probe.chunk_size)
                cpu = int(share * 4 * docs) * chunk
                cfg = load_config(_config(cfg_path, f"{mode}-{i}", etcd.endpoints, transport, cpu,
                                          cluster=f"bench-ws-{mode}", handoff=handoff), env={})
                agents.append(CacheAgent(cfg, Fingerprint.of(cfg.layout), chunk,
                                         metrics=AgentMetrics(CollectorRegistry())).start())
            hits, asked = _serve(agents, docs, order, rate)
            out[f"mesh_hit_rate_{mode}"] = round(hits / asked, 3)
            if mode == "handoff":
                reg = [a.metrics.registry for a in agents]
                for event in ("accepted", "received", "dropped"):
                    out[f"handoff_{event}"] = int(sum(r.get_sample_value(
                        "lmcache_p2p_handoff_chunks_total", {"event": event}) or 0 for r in reg))
                out["copies_evicted_first"] = sum(a.tiers.cpu.stats.copies_evicted for a in agents)
        finally:
            for a in agents:
                a.stop()
    single = float(out["mesh_hit_rate_single"])  # type: ignore[arg-type]
    for mode in ("handoff", "no_handoff"):
        out[f"{mode}_vs_single"] = round(float(out[f"mesh_hit_rate_{mode}"]) / single, 3) if single else None  # type: ignore[arg-type]
    return out


def _serve(agents: list[CacheAgent], docs: int, order: list[int], rate: float) -> tuple[int, int]:
    """Requests round-robin over ``agents``; the first ``docs`` requests are the warm-up."""
    hits = asked = 0
    buf = np.zeros(agents[0].chunk_bytes, dtype=np.uint8)
    t_next = time.monotonic()
    for i, doc in enumerate(order):
        agent = agents[i % len(agents)]
        tokens = synthetic_tokens(10_000 + doc, DOC_TOKENS)
        plan = agent.lookup(tokens)
        ok = agent.load(plan, [buf.data] * len(plan.chunks))
        held = next((j for j, loaded in enumerate(ok) if not loaded), len(ok))
        keys, spans = agent.keys_for(tokens)
        if held < len(keys):  # the engine computes the rest and stores it
            layout = agent.config.layout
            payloads = [memoryview(synthetic_payload(k, layout.chunk_bytes(e - s)))
                        for k, (s, e) in zip(keys[held:], spans[held:], strict=True)]
            agent.store_chunks(keys[held:], [e - s for s, e in spans[held:]], payloads).result(timeout=30)
        if i >= docs:
            hits, asked = hits + held, asked + len(keys)
        t_next += 1.0 / rate
        time.sleep(max(0.0, t_next - time.monotonic()))
    return hits, asked


def run(tokens: int, rounds: int, transport: str, work: Path, ws_docs: int = 24, ws_requests: int = 240,
        ws_rate: float = 40.0) -> dict[str, object]:
    with EtcdServer(base_dir=str(work)) as etcd:
        result = _prompt(tokens, rounds, transport, work, etcd)
        if ws_docs:
            result.update(working_set(ws_docs, ws_requests, ws_rate, transport, etcd, work))
        return result


def _prompt(tokens: int, rounds: int, transport: str, work: Path, etcd: EtcdServer) -> dict[str, object]:
    progress("mesh", f"{tokens}-token prompt: starting the owner agent, then {rounds} rounds")
    owner_cfg = _config(work / "owner.yaml", "owner", etcd.endpoints, transport, "512MiB")
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    owner = subprocess.Popen([sys.executable, "-m", "lmcache_p2p.testing.preloaded_agent", "--config", str(owner_cfg),
                              "--preload-seed", "1", "--preload-tokens", str(tokens), "--log-level", "WARNING"],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert owner.stdout is not None
        info = json.loads(owner.stdout.readline())
        cfg = load_config(_config(work / "req.yaml", "requester", etcd.endpoints, transport, "512MiB"), env={})
        agent = CacheAgent.of(cfg, metrics=AgentMetrics(CollectorRegistry())).start()
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
    nbytes = sum(h.length for h in (agent.tiers.header(c.key) for c in plan.chunks) if h is not None)
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
    parser = bench_parser("mesh", __doc__, keeps=None)
    parser.add_argument("--tokens", type=int, default=128 * 256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "nixl"])
    parser.add_argument("--working-set-docs", type=int, default=24, help="documents of 4 chunks (0: skip)")
    parser.add_argument("--working-set-requests", type=int, default=240)
    parser.add_argument("--working-set-rate", type=float, default=40.0, help="requests per second")
    plot.add_argument(parser)
    args = parser.parse_args(argv)
    if args.plot:
        plot.require()
    with tempfile.TemporaryDirectory(prefix="lmcache-p2p-bench-mesh-") as tmp:
        result = run(args.tokens, args.rounds, args.transport, Path(tmp), args.working_set_docs,
                     args.working_set_requests, args.working_set_rate)
    emit(result, args.json, "bench mesh (median per round; 128-chunk prompt by default)")
    if args.working_set_docs:
        plot.write("mesh", result, args.plot, [(plot.hit_rate_vs_ideal, "hit-rate", "working set's hit rate")])
    return 0
