"""``lmcache-p2p bench scale``: the control plane with many agents on a real 3-member etcd.

``--processes`` worker processes each run ``--agents`` simulated agents. Every simulated agent is a real
:class:`~lmcache_p2p.index.etcd_index.EtcdBlockIndex` (its own lease and keep-alive, its publisher, its node
record); ``--mirrors`` of each process's agents also follow the fingerprint's mirror (one mirror per agent
would measure this machine's memory, not the design: the others are sampled). Then:

1. **join**: every agent announces ``--chunks`` chunks; ``publish_chunks_per_s`` over the fleet.
2. **churn** for ``--seconds``: each agent adds new chunks and withdraws its oldest at ``--churn`` chunk
   events per second (the steady state of a node whose pool is full). Measured: etcd's write rate
   (revisions/s, from ``Maintenance.Status``), its DB growth; every 0.5 s the coordinator announces a probe
   chunk and each mirror notes when it sees it: **watch fan-out** latency p50/p99 (from etcd's commit, as the
   coordinator's flush returns, to each mirror; one monotonic clock on this host).
3. ``mirror_bytes_per_chunk`` (``Mirror.memory_bytes``), ``new_node_sync_s``: a fresh client follows the
   fingerprint until its mirror holds every chunk.
4. **death**: one worker process is SIGKILLed; ``death_seen_s``: until the coordinator's mirror holds none of
   its agents' chunks (their leases, ``--ttl`` s, run out).
5. **compaction**: etcd compacted to its current revision: the DB's size in use before and after.

The result extrapolates each per-node or per-chunk cost to ``--target-nodes`` x ``--target-chunks`` and says
which limit is reached first (README, "The control plane at scale").
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..aio import LoopThread
from ..config import AgentConfig, EtcdConfig
from ..ids import TIER_CPU, NodeId
from ..index.client import EtcdClient
from ..index.etcd_index import EtcdBlockIndex
from ..index.etcd_server import EtcdCluster
from ..index.schema import NodeRecord
from ..keys import ChunkKey, FingerprintDigest
from .common import emit, run_in_workdir

CLUSTER = "bench-scale"
PROBE_EVERY_S = 0.5
PROBE_WAIT_S = 10.0
TICK_S = 0.1
ETCD_WRITES_PER_S = 10_000  # sustained fsync'd writes of one etcd cluster on good SSDs (etcd's own guidance)
QUOTA_BYTES = 8 << 30


def probe_key(i: int) -> ChunkKey:
    return ChunkKey(random.Random(f"probe-{i}").randbytes(16))


def open_index(loop: LoopThread, endpoints: tuple[str, ...], node: str, ttl: int) -> EtcdBlockIndex:
    config = AgentConfig(node_id=node, cluster=CLUSTER,
                         etcd=EtcdConfig(endpoints=endpoints, lease_ttl_s=ttl, timeout_s=10.0, start_wait_s=30.0))
    return EtcdBlockIndex.open(loop, config, NodeRecord(NodeId(node), {"tcp": "127.0.0.1:7470"}, ("tcp",)))


def _worker(conn: Connection, endpoints: tuple[str, ...], names: list[str], fp: bytes, chunks: int, follow: int,
            ttl: int, seed: int) -> None:
    """One process of simulated agents; answers the coordinator's commands over ``conn``."""
    digest = FingerprintDigest(fp)
    rng = random.Random(seed)
    send_lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(msg)

    with LoopThread("scale-worker") as loop:
        agents = [open_index(loop, endpoints, name, ttl) for name in names]
        mirrors = [a.follow(digest) for a in agents[:follow]]
        held = [deque(ChunkKey(rng.randbytes(16)) for _ in range(chunks)) for _ in agents]
        t0 = time.monotonic()
        for agent, keys in zip(agents, held, strict=True):
            agent.add_many(digest, keys, TIER_CPU)
        for agent in agents:
            agent.flush(timeout=600.0)
        send(("ready", time.monotonic() - t0))
        stop = threading.Event()
        poller = threading.Thread(target=_poll_probes, args=(mirrors, send, stop), daemon=True)
        poller.start()
        while True:
            cmd = conn.recv()
            if cmd[0] == "churn":
                events = _churn(agents, held, digest, rng, seconds=cmd[1], rate=cmd[2])
                send(("churned", events))
            elif cmd[0] == "mirrors":
                send(("mirrors", [(len(m), m.memory_bytes()) for m in mirrors]))
            elif cmd[0] == "stop":
                stop.set()
                for agent in agents:
                    agent.close()
                send(("stopped",))
                return


def _churn(agents: list[EtcdBlockIndex], held: list[deque[ChunkKey]], fp: FingerprintDigest, rng: random.Random,
           seconds: float, rate: float) -> int:
    """Each agent adds and withdraws chunks, ``rate`` events a second in all, for ``seconds``."""
    per_tick, carry, events = rate * TICK_S / 2, 0.0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tick = time.monotonic()
        carry += per_tick
        n, carry = int(carry), carry - int(carry)
        for agent, keys in zip(agents, held, strict=True):
            new = [ChunkKey(rng.randbytes(16)) for _ in range(n)]
            old = [keys.popleft() for _ in range(min(n, len(keys)))]
            keys.extend(new)
            agent.add_many(fp, new, TIER_CPU)
            agent.remove_many(fp, old)
            events += len(new) + len(old)
        time.sleep(max(0.0, TICK_S - (time.monotonic() - tick)))
    for agent in agents:
        agent.flush(timeout=120.0)
    return events


def _poll_probes(mirrors: list[Any], send: Any, stop: threading.Event) -> None:
    """Probe i is announced after probe i-1 was seen everywhere or given up: note when each mirror sees it."""
    i = 0
    while not stop.is_set():
        key, seen = probe_key(i), [0.0] * len(mirrors)
        give_up = None
        while not stop.is_set() and not all(seen):
            now = time.monotonic()
            for j, m in enumerate(mirrors):
                if not seen[j] and key in m:
                    seen[j] = now
            if any(seen) and give_up is None:
                give_up = now + PROBE_WAIT_S
            if give_up is not None and now > give_up:
                break
            time.sleep(0.001)
        if mirrors and any(seen):
            send(("seen", i, seen))
        i += 1


def _status(loop: LoopThread, endpoints: tuple[str, ...]) -> tuple[int, int, int]:
    async def status() -> tuple[int, int, int]:
        async with EtcdClient(EtcdConfig(endpoints=endpoints)) as client:
            return await client.status()
    return loop.run(status(), 30.0)


def _compact(loop: LoopThread, endpoints: tuple[str, ...], revision: int) -> None:
    async def compact() -> None:
        async with EtcdClient(EtcdConfig(endpoints=endpoints)) as client:
            await client.compact(revision)
    loop.run(compact(), 120.0)


class _Workers:
    """The coordinator's ends of the workers' pipes: replies kept per worker, probe sightings turned into
    latencies from each probe's commit as they arrive."""

    def __init__(self, pipes: list[Connection]) -> None:
        self.pipes = pipes
        self.pending: list[deque[tuple[Any, ...]]] = [deque() for _ in pipes]
        self.committed: dict[int, float] = {}
        self.latencies: list[float] = []

    def _route(self, i: int, msg: tuple[Any, ...]) -> None:
        if msg[0] == "seen":
            at = self.committed.get(msg[1])
            if at is not None:
                self.latencies += [max(0.0, t - at) for t in msg[2] if t]
        else:
            self.pending[i].append(msg)

    def drain(self) -> None:
        for i, conn in enumerate(self.pipes):
            with contextlib.suppress(OSError, EOFError):
                while conn.poll():
                    self._route(i, conn.recv())

    def send(self, msg: tuple[Any, ...], which: range | None = None) -> None:
        for i in which if which is not None else range(len(self.pipes)):
            self.pipes[i].send(msg)

    def expect(self, i: int, kind: str, timeout: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            for msg in list(self.pending[i]):
                if msg[0] == kind:
                    self.pending[i].remove(msg)
                    return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind!r} from worker {i} within {timeout:.0f}s")
            if self.pipes[i].poll(min(1.0, left)):
                self._route(i, self.pipes[i].recv())


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    fp = os.urandom(16)
    nodes = args.processes * args.agents
    out: dict[str, Any] = {"nodes": nodes, "processes": args.processes, "mirrors": args.processes * args.mirrors,
                           "chunks_per_node": args.chunks, "churn_events_per_node_s": args.churn,
                           "lease_ttl_s": args.ttl, "etcd_members": 3, "fsync": True}
    ctx = mp.get_context("spawn")
    with EtcdCluster(3, base_dir=str(work)) as etcd, LoopThread("scale-coordinator") as loop:
        eps = etcd.endpoints
        pipes, procs = [], []
        for p in range(args.processes):
            ours, theirs = ctx.Pipe()
            names = [f"sim-{p}-{i}" for i in range(args.agents)]
            proc = ctx.Process(target=_worker, args=(theirs, eps, names, fp, args.chunks, args.mirrors, args.ttl, p),
                               daemon=True)
            proc.start()
            pipes.append(ours)
            procs.append(proc)
        try:
            out.update(_measure(args, loop, eps, FingerprintDigest(fp), _Workers(pipes), procs, nodes))
        finally:
            for proc in procs:
                proc.kill()
    out.update(extrapolate(out, args.target_nodes, args.target_chunks))
    return out


def _measure(args: argparse.Namespace, loop: LoopThread, eps: tuple[str, ...], fp: FingerprintDigest,
             workers: _Workers, procs: list[Any], nodes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    every = range(len(procs))
    t0 = time.monotonic()
    ready = [workers.expect(i, "ready", 1800)[1] for i in every]
    out["join_s"] = round(time.monotonic() - t0, 2)
    out["publish_chunks_per_s"] = round(nodes * args.chunks / max(ready), 1)
    size0, _, rev0 = _status(loop, eps)
    probe = open_index(loop, eps, "scale-probe", args.ttl)
    workers.send(("churn", args.seconds, args.churn))
    t_churn = time.monotonic()
    probes = _probes(probe, fp, workers, args.seconds)
    churned = [workers.expect(i, "churned", args.seconds + 600)[1] for i in every]
    elapsed = time.monotonic() - t_churn
    time.sleep(1.0)
    workers.drain()
    size1, used1, rev1 = _status(loop, eps)
    lat = workers.latencies
    out.update({
        "etcd_writes_per_s": round((rev1 - rev0) / elapsed, 1),
        "etcd_writes_per_node_s": round((rev1 - rev0) / elapsed / nodes, 3),
        "churn_events_per_s": round(sum(churned) / elapsed, 1),
        "etcd_db_bytes": size1, "etcd_db_in_use_bytes": used1,
        "etcd_db_growth_bytes_per_event": round((size1 - size0) / max(1, sum(churned)), 1),
        "probes": probes, "probe_sightings": len(lat),
        "fanout_p50_ms": round(1e3 * statistics.median(lat), 2) if lat else None,
        "fanout_p99_ms": round(1e3 * _pct(lat, 0.99), 2) if lat else None,
    })
    counts: list[tuple[int, int]] = []
    workers.send(("mirrors",))
    for i in every:
        counts += workers.expect(i, "mirrors", 120)[1]
    held = sum(n for n, _ in counts)
    out["mirror_bytes_per_chunk"] = round(sum(b for _, b in counts) / held, 1) if held else None
    total = nodes * args.chunks + probes  # churn keeps each agent's count
    t0 = time.monotonic()
    fresh = open_index(loop, eps, "scale-newcomer", args.ttl)
    mirror = fresh.follow(fp)
    mirror.wait_for(lambda m: len(m) >= total, 600)
    out["new_node_sync_s"] = round(time.monotonic() - t0, 3)
    out["new_node_mirror_chunks"] = len(mirror)
    t0 = time.monotonic()
    procs[0].kill()  # its agents' leases run out: their chunks must leave every mirror
    left = total - args.agents * args.chunks
    gone = mirror.wait_for(lambda m: len(m) <= left, args.ttl * 3 + 60)
    out["death_seen_s"] = round(time.monotonic() - t0, 2) if gone else None
    _, used2, rev2 = _status(loop, eps)
    _compact(loop, eps, rev2)
    time.sleep(1.0)
    _, used3, _ = _status(loop, eps)
    out["etcd_in_use_before_compaction"], out["etcd_in_use_after_compaction"] = used2, used3
    out["etcd_bytes_per_chunk"] = round(used3 / max(1, len(mirror)), 1)
    fresh.close()
    probe.close()
    with contextlib.suppress(OSError, EOFError, TimeoutError):
        workers.send(("stop",), range(1, len(procs)))
        for i in range(1, len(procs)):
            workers.expect(i, "stopped", 120)
    return out


def _probes(probe: EtcdBlockIndex, fp: FingerprintDigest, workers: _Workers, seconds: float) -> int:
    """Announce a probe chunk every PROBE_EVERY_S while the workers churn; returns how many."""
    start, i = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        probe.add(fp, probe_key(i), TIER_CPU)
        probe.flush(timeout=30.0)
        workers.committed[i] = time.monotonic()
        i += 1
        workers.drain()
        time.sleep(PROBE_EVERY_S)
    return i


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def extrapolate(m: dict[str, Any], nodes: int, chunks: int) -> dict[str, Any]:
    """Each measured cost at ``nodes`` nodes holding ``chunks`` chunks in all, and the first limit reached."""
    per_node_writes = m["etcd_writes_per_node_s"]
    writes = per_node_writes * nodes
    fanout = writes * nodes  # every write is delivered to every node's mirror
    db = m["etcd_bytes_per_chunk"] * chunks
    mirror = (m["mirror_bytes_per_chunk"] or 0) * chunks
    sync_s = m["new_node_sync_s"] * chunks / max(1, m["new_node_mirror_chunks"])
    limits = {"etcd write rate": writes / ETCD_WRITES_PER_S, "etcd quota (8 GiB)": db / QUOTA_BYTES}
    first = max(limits, key=lambda k: limits[k])
    return {"at": {"nodes": nodes, "chunks": chunks, "etcd_writes_per_s": round(writes),
                   "watch_deliveries_per_s": round(fanout), "etcd_db_bytes": round(db),
                   "mirror_bytes_per_node": round(mirror), "new_node_sync_s": round(sync_s, 1),
                   "share_of_limit": {k: round(v, 3) for k, v in limits.items()}, "first_limit": first}}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lmcache-p2p bench scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--agents", type=int, default=50, help="simulated agents per process")
    p.add_argument("--mirrors", type=int, default=2, help="agents per process that also follow the mirror")
    p.add_argument("--chunks", type=int, default=1000, help="chunks each agent announces at join")
    p.add_argument("--churn", type=float, default=20.0, help="chunk events (adds + withdrawals) per agent per s")
    p.add_argument("--seconds", type=float, default=30.0, help="churn phase length")
    p.add_argument("--ttl", type=int, default=5, help="lease TTL of the simulated agents")
    p.add_argument("--target-nodes", type=int, default=1000)
    p.add_argument("--target-chunks", type=int, default=1_000_000)
    p.add_argument("--workdir", help="keep etcd's data and logs here (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = run_in_workdir(run, args, "lmcache-p2p-bench-scale-")
    emit(result, args.json, "bench scale (3-member etcd, simulated agents; extrapolation under 'at')")
    return 0
