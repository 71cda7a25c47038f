"""The fleet side of ``bench scale`` (``scale.py``): worker processes of simulated agents (each a real
:class:`~lmcache_p2p.index.etcd_index.EtcdBlockIndex`), their churn and probe sightings, and the coordinator's
ends of their pipes; the bare watch streams and the owner lookups of the churn's later phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..aio import LoopThread
from ..config import AgentConfig, EtcdConfig
from ..errors import IndexError_
from ..ids import TIER_CPU, NodeId
from ..index.client import EtcdClient
from ..index.etcd_index import EtcdBlockIndex
from ..index.schema import NodeRecord, Schema
from ..keys import ChunkKey, FingerprintDigest

CLUSTER = "bench-scale"
LOOKUP_KEYS = 8  # chunk keys per lookup (a 2,048-token prompt)
PROBE_WAIT_S = 10.0
TICK_S = 0.1


def probe_key(i: int) -> ChunkKey:
    return ChunkKey(random.Random(f"probe-{i}").randbytes(16))


def open_index(loop: LoopThread, endpoints: tuple[str, ...], node: str, ttl: int) -> EtcdBlockIndex:
    config = AgentConfig(node_id=node, cluster=CLUSTER,
                         etcd=EtcdConfig(endpoints=endpoints, lease_ttl_s=ttl, timeout_s=10.0, start_wait_s=30.0))
    return EtcdBlockIndex.open(loop, config, NodeRecord(NodeId(node), {"tcp": "127.0.0.1:7470"}, ("tcp",)))


def worker(conn: Connection, endpoints: tuple[str, ...], names: list[str], fp: bytes, chunks: int, follow: int,
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
            elif cmd[0] == "events":
                send(("events", sum(m.events_total for m in mirrors)))
            elif cmd[0] == "held":  # what each agent holds (and so wants announced), and its lost leases
                send(("held", {name: len(keys) for name, keys in zip(names, held, strict=True)},
                      sum(a.lease_losses for a in agents)))
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


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (``/proc/<pid>/stat``)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return total / os.sysconf("SC_CLK_TCK")


class Watchers:
    """Bare watch streams on the fingerprint's block prefix that only count what they receive: extra
    deliveries for etcd to make, so its cost per delivery can be told apart from its cost per write."""

    def __init__(self, loop: LoopThread, endpoints: tuple[str, ...], prefix: bytes, n: int) -> None:
        self.events = 0
        self._loop = loop
        self._stop = asyncio.Event()
        # Spread over the members as the agents' clients are (each starts from a different endpoint).
        rotations = [endpoints[i % len(endpoints):] + endpoints[: i % len(endpoints)] for i in range(n)]
        self._tasks = [loop.submit(self._watch(eps, prefix)) for eps in rotations]

    async def _watch(self, endpoints: tuple[str, ...], prefix: bytes) -> None:
        async with EtcdClient(EtcdConfig(endpoints=endpoints)) as client:
            _, revision = await client.get(prefix)  # no such key: the store's revision
            stream = client.watch(prefix, revision + 1)
            with contextlib.suppress(asyncio.CancelledError):
                async for batch in stream:
                    self.events += len(batch.events)

    def close(self) -> None:
        cancel_all(self._tasks)


class Lookups:
    """The alternative to mirroring every chunk event on every node: ask etcd for a prompt's owners when a
    request arrives. ``clients`` connections (spread over the members) issue, at ``rate`` lookups a second
    in all, one read-only serializable txn of ``LOOKUP_KEYS`` chunk-owner prefixes each (half of them probe
    chunks that are held, half random ones that are not), while the agents churn."""

    def __init__(self, loop: LoopThread, endpoints: tuple[str, ...], schema: Schema, fp: FingerprintDigest,
                 rate: float, held: Callable[[], int], clients: int = 4) -> None:
        self.latencies: list[float] = []
        self.found = 0
        self.failed = 0
        self._prefix = schema.blocks_of(fp)
        self._held = held  # how many probe chunks are announced so far
        rotations = [endpoints[i % len(endpoints):] + endpoints[: i % len(endpoints)] for i in range(clients)]
        self._tasks = [loop.submit(self._run(eps, rate / clients, seed)) for seed, eps in enumerate(rotations)]

    async def _run(self, endpoints: tuple[str, ...], rate: float, seed: int) -> None:
        rng = random.Random(seed)
        async with EtcdClient(EtcdConfig(endpoints=endpoints)) as client:
            next_at = time.monotonic()
            while True:
                n = max(1, self._held())
                keys = [probe_key(rng.randrange(n)) for _ in range(LOOKUP_KEYS // 2)]
                keys += [ChunkKey(rng.randbytes(16)) for _ in range(LOOKUP_KEYS - len(keys))]
                t0 = time.monotonic()
                try:
                    owners, _ = await client.get_prefixes([self._prefix + k.hex().encode() + b"/" for k in keys])
                except IndexError_:
                    self.failed += 1
                else:
                    self.latencies.append(time.monotonic() - t0)
                    self.found += sum(1 for o in owners if o)
                next_at = max(next_at + 1.0 / rate, time.monotonic() - 1.0)  # open loop, no burst after a stall
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    def close(self) -> None:
        cancel_all(self._tasks)


def cancel_all(tasks: list[Any]) -> None:
    """Cancel the loop-thread tasks (concurrent futures) of a phase and wait for each to end."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            task.result(10)


class Workers:
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
