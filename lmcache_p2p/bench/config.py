"""``lmcache-p2p bench config [--agents N] [--rounds R] [--json]``: how fast ``config set`` reaches running agents.

A private etcd (fsync on) and N cache agents in this process (each with its own loop, lease, mirror and
cluster-config watch, as in ``lmcache-p2p agent``). Each round changes the cluster config once, as
``lmcache-p2p config set`` does (``ConfigStore.update``: a read, then a compare-and-swap txn), with a new
``chunk_ttl_s``, and waits until every agent runs it (its config holds the value and its record the
revision):

* ``apply_ms_p50`` / ``apply_ms_p99``: from the update call until the last agent applied it;
* baseline ``watch_ms_p50`` / ``watch_ms_p99``: the same etcd, a bare watch on one key: from a put
  call until the event arrives;
* ``apply_vs_watch``: the ratio of the p50s: what the CAS read, decoding, validating, merging under
  each node's own settings and applying (the TTL sweeper restarts) cost on top of etcd's own watch.

The last line of output is one JSON object; without ``--json`` a table precedes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from ..agent import CacheAgent
from ..aio import LoopThread
from ..config import AgentConfig, EtcdConfig, TierConfig
from ..coordinator.store import ConfigStore
from ..index.client import EtcdClient
from ..index.etcd_server import EtcdServer
from .common import bench_parser, emit, progress, ratio


def _agent(endpoints: tuple[str, ...], i: int) -> CacheAgent:
    config = AgentConfig(node_id=f"bench-config-{i}", cluster="bench-config",
                         etcd=EtcdConfig(endpoints=endpoints, start_wait_s=10.0),
                         tiers=TierConfig(cpu_capacity=4 << 20), set_by_node=("tiers.cpu_capacity",))
    return CacheAgent.of(config, secret=os.urandom(32), role="cache").start()


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return round(statistics.median(ordered), 3), round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3)


def measure_apply(loop: LoopThread, client: EtcdClient, agents: list[CacheAgent], rounds: int) -> list[float]:
    store = ConfigStore(client, "bench-config")
    out = []
    for r in range(rounds):
        ttl = 3600.0 + r
        t0 = time.perf_counter()
        loop.run(store.update({"chunk_ttl_s": str(ttl)}), 10.0)
        deadline = t0 + 10.0
        while not all(a.config.tiers.chunk_ttl_s == ttl for a in agents):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"round {r}: not every agent applied chunk_ttl_s={ttl} within 10 s")
            time.sleep(0.0002)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def measure_watch(loop: LoopThread, client: EtcdClient, rounds: int) -> list[float]:
    key = b"/lmcache-p2p-bench/watch-baseline"

    async def run() -> list[float]:
        start = await client.put(key, b"0") + 1
        stream = client.watch(key, start)
        out = []
        for r in range(rounds):
            value = str(r + 1).encode()
            t0 = time.perf_counter()
            await client.put(key, value)
            async for batch in stream:
                if any(e.key == key and e.value == value for e in batch.events):
                    break
            out.append(1e3 * (time.perf_counter() - t0))
        await stream.aclose()  # type: ignore[attr-defined]
        return out

    return loop.run(run(), 60.0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with EtcdServer() as etcd, LoopThread("bench-config") as loop:
        client = EtcdClient(EtcdConfig(endpoints=etcd.endpoints, timeout_s=10.0))
        loop.run(client.connect(), 10.0)
        agents: list[CacheAgent] = []
        try:
            progress("config", f"starting {args.agents} agents")
            agents = [_agent(etcd.endpoints, i) for i in range(args.agents)]
            measure_apply(loop, client, agents, 3)  # warm-up: connections, first decode
            progress("config", f"{args.rounds} config changes until every agent applied each")
            apply_ms = measure_apply(loop, client, agents, args.rounds)
            progress("config", f"baseline: {args.rounds} puts through a bare watch")
            watch_ms = measure_watch(loop, client, args.rounds)
            revisions = {a.live.revision for a in agents}
        finally:
            for agent in agents:
                agent.stop()
            loop.run(client.close(), 10.0)
    apply_p50, apply_p99 = _percentiles(apply_ms)
    watch_p50, watch_p99 = _percentiles(watch_ms)
    return {"agents": args.agents, "rounds": args.rounds, "apply_ms_p50": apply_p50, "apply_ms_p99": apply_p99,
            "watch_ms_p50": watch_p50, "watch_ms_p99": watch_p99, "apply_vs_watch": ratio(apply_p50, watch_p50),
            "agents_on_one_revision": len(revisions) == 1}


def main(argv: list[str]) -> int:
    parser = bench_parser("config", __doc__, keeps=None)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args(argv)
    if args.agents < 1 or args.rounds < 1:
        parser.error("--agents and --rounds must be >= 1")
    emit(run(args), args.json, "cluster config: lmcache-p2p config set -> applied in every running agent")
    return 0
