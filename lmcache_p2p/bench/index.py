"""``lmcache-p2p bench index [--json] [--chunks N]``: the etcd block index at scale.

Starts a private single-member etcd **with fsync** (the default; ``--unsafe-no-fsync`` exists
for quick runs but its numbers are not the headline), then:

* one node publishes N chunks through the publisher (batched txns under its lease):
  ``publish_chunks_per_s`` from the first ``add`` to etcd confirming the last;
* ``etcd_bytes_per_chunk``: growth of the backend's in-use size (``Maintenance.Status``) / N;
  ``etcd_rss_bytes_per_chunk``: growth of the etcd process's RSS / N (index, caches, WAL buffers);
* a second client syncs a mirror; ``lookup_us_per_chunk`` is ``lookup()`` over 128-chunk
  prompts, averaged over many; ``longest_prefix_us_per_chunk`` likewise;
* ``mirror_bytes_per_chunk``: the mirror's block map by ``sys.getsizeof`` (dict, keys,
  interned owner sets) / N;
* ``lease_revoke_to_mirror_empty_s``: the publisher closes its session (revoke) until the other
  mirror holds no chunk.

Then the control plane under faults, with a node holding ``--fault-chunks`` (10k) chunks, lease TTL 3 s:

* ``republish_chunks_per_s``: its lease is revoked behind its back (what an expiry looks like);
  from the node's new lease to every entry back in etcd. ``lease_loss_detected_s``: from the revoke
  to the new lease;
* ``recovery_s_after_etcd_restart``: etcd is SIGKILLed, stays down past the TTL, and restarts on
  the same data dir; from etcd healthy again until the node's lease is confirmed and its node record
  and every block entry are in etcd (read straight from etcd).

The last line of output is one JSON object; without ``--json`` a table precedes it.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

import psutil

from ..aio import LoopThread
from ..config import AgentConfig, EtcdConfig
from ..errors import LMCacheP2PError
from ..ids import TIER_CPU, NodeId
from ..index.client import EtcdClient
from ..index.etcd_index import EtcdBlockIndex
from ..index.etcd_server import EtcdServer
from ..index.schema import NodeRecord, Schema
from ..keys import ChunkKey, FingerprintDigest
from .common import bench_parser, progress

GOALS = {"publish_chunks_per_s": (">=", 20_000.0), "lookup_us_per_chunk": ("<=", 5.0),
         "etcd_bytes_per_chunk": ("<=", 200.0)}
PROMPT_CHUNKS = 128
QUOTA_BYTES = 8 << 30  # etcd's largest recommended --quota-backend-bytes


def _open(loop: LoopThread, endpoints: tuple[str, ...], node: str) -> EtcdBlockIndex:
    config = AgentConfig(node_id=node, cluster="bench",
                         etcd=EtcdConfig(endpoints=endpoints, timeout_s=10.0, start_wait_s=30.0))
    record = NodeRecord(NodeId(node), {"tcp": "127.0.0.1:7470"}, ("tcp",))
    return EtcdBlockIndex.open(loop, config, record)


def _db_in_use(loop: LoopThread, endpoints: tuple[str, ...]) -> int:
    async def status() -> int:
        async with EtcdClient(EtcdConfig(endpoints=endpoints)) as client:
            return (await client.status())[1]
    return loop.run(status(), 10.0)


def run(chunks: int, unsafe_no_fsync: bool, fault_chunks: int = 10_000) -> dict[str, Any]:
    fp = FingerprintDigest(os.urandom(16))
    keys = [ChunkKey(os.urandom(16)) for _ in range(chunks)]
    out: dict[str, Any] = {"chunks": chunks, "fsync": not unsafe_no_fsync, "etcd_members": 1}
    with EtcdServer(unsafe_no_fsync=unsafe_no_fsync) as server, LoopThread() as loop:
        eps = server.endpoints
        writer = _open(loop, eps, "bench-writer")
        reader = _open(loop, eps, "bench-reader")
        before = _db_in_use(loop, eps)
        etcd_proc = psutil.Process(server.pid)
        rss_before = etcd_proc.memory_info().rss
        progress("index", f"publishing {chunks} chunks")
        t0 = time.perf_counter()
        writer.add_many(fp, keys, TIER_CPU)
        writer.flush(timeout=300.0)
        elapsed = time.perf_counter() - t0
        out["publish_chunks_per_s"] = chunks / elapsed
        out["publish_txns"] = writer.publisher.txns_total
        out["etcd_bytes_per_chunk"] = (_db_in_use(loop, eps) - before) / chunks
        out["etcd_rss_bytes_per_chunk"] = (etcd_proc.memory_info().rss - rss_before) / chunks

        progress("index", "a reader's mirror follows them; lookups")
        t0 = time.perf_counter()
        mirror = reader.follow(fp)
        out["mirror_sync_s"] = time.perf_counter() - t0
        if len(mirror) != chunks:
            raise RuntimeError(f"mirror holds {len(mirror)} chunks, expected {chunks}")
        out["mirror_bytes_per_chunk"] = mirror.memory_bytes() / chunks
        out["mirror_bytes_method"] = "sys.getsizeof(dict + keys + interned owner sets)"
        out.update(_lookups(reader, fp, keys))

        progress("index", "the writer's lease revoked: until the mirror is empty")
        t0 = time.perf_counter()
        writer.close()
        if not mirror.wait_for(lambda m: len(m) == 0, timeout=60.0):
            raise RuntimeError("mirror did not empty after the lease was revoked")
        out["lease_revoke_to_mirror_empty_s"] = time.perf_counter() - t0
        reader.close()
        progress("index", f"faults: {fault_chunks} chunks through a lost lease")
        out.update(_faults(loop, server, fault_chunks))
    per = out["etcd_bytes_per_chunk"]
    out["scale_chunks_per_cluster_at_8GiB_quota"] = int(QUOTA_BYTES / per) if per > 0 else None
    out["goals_met"] = all(_met(out[k], op, v) for k, (op, v) in GOALS.items())
    return out


FAULT_TTL_S = 3


def _count_node(loop: LoopThread, endpoints: tuple[str, ...], node: str) -> tuple[bool, int]:
    """(node record present, block entries of ``node``) straight from etcd; (False, -1) if it does not answer."""
    async def read() -> tuple[bool, int]:
        schema = Schema("bench")
        async with EtcdClient(EtcdConfig(endpoints=endpoints, timeout_s=2.0)) as client:
            record, _ = await client.get(schema.node(NodeId(node)))
            blocks, _ = await client.get_prefix(schema.blocks)
        suffix = b"/" + node.encode()
        return record is not None, sum(1 for kv in blocks if kv.key.endswith(suffix))
    try:
        return loop.run(read(), 30.0)
    except LMCacheP2PError:
        return False, -1


def _wait(predicate: Callable[[], bool], timeout: float, what: str,
          state: Callable[[], object] | None = None) -> float:
    """Seconds until ``predicate()``; on a timeout the error says what ``state()`` saw last."""
    t0 = time.perf_counter()
    while not predicate():
        if time.perf_counter() - t0 > timeout:
            try:
                seen = f"; last seen: {state()}" if state is not None else ""
            except Exception as exc:  # the report must not replace the timeout it explains
                seen = f"; reading the state failed: {exc!r}"
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}{seen}")
        time.sleep(0.02)
    return time.perf_counter() - t0


def _faults(loop: LoopThread, server: EtcdServer, n: int) -> dict[str, Any]:
    eps = server.endpoints
    config = AgentConfig(node_id="bench-node", cluster="bench",
                         etcd=EtcdConfig(endpoints=eps, timeout_s=5.0, lease_ttl_s=FAULT_TTL_S))
    node = EtcdBlockIndex.open(loop, config, NodeRecord(NodeId("bench-node"), {"tcp": "127.0.0.1:7470"}, ("tcp",)))
    out: dict[str, Any] = {"fault_chunks": n, "fault_lease_ttl_s": FAULT_TTL_S}
    try:
        node.add_many(FingerprintDigest(os.urandom(16)), [ChunkKey(os.urandom(16)) for _ in range(n)], TIER_CPU)
        node.flush(timeout=120.0)
        everything = (True, n)

        def state() -> dict[str, object]:  # what a timeout reports: the node's own view and etcd's
            return {"stats": node.stats(), "faults": node.faults(), "leases_taken": node.leases_taken,
                    "in_etcd (record, entries)": _count_node(loop, eps, "bench-node")}

        async def revoke(lease: int) -> None:
            async with EtcdClient(EtcdConfig(endpoints=eps)) as client:
                await client.revoke(lease)
        taken = node.leases_taken
        t0 = time.perf_counter()
        loop.run(revoke(node.session.lease_id), 10.0)
        out["lease_loss_detected_s"] = _wait(lambda: node.leases_taken > taken, 30.0, "a new lease", state)
        t1 = time.perf_counter()
        _wait(lambda: _count_node(loop, eps, "bench-node") == everything, 120.0, "the republish", state)
        out["republish_chunks_per_s"] = n / (time.perf_counter() - t1)
        out["lease_revoke_to_all_back_s"] = time.perf_counter() - t0

        server.kill_member(0)
        time.sleep(FAULT_TTL_S * 1.5)  # past the TTL: the node can no longer confirm its lease
        server.restart_member(0)
        t0 = time.perf_counter()
        _wait(lambda: node.stats()["lease_up"] == 1.0 and _count_node(loop, eps, "bench-node") == everything,
              120.0, "the node back after the etcd restart", state)
        out["recovery_s_after_etcd_restart"] = time.perf_counter() - t0
        out["lease_losses"] = node.lease_losses
    finally:
        node.close()
    return out


def _lookups(index: EtcdBlockIndex, fp: FingerprintDigest, keys: list[ChunkKey]) -> dict[str, float]:
    rng = random.Random(0)
    prompts = []
    for _ in range(2000):
        start = rng.randrange(0, max(1, len(keys) - PROMPT_CHUNKS))
        prompts.append(keys[start:start + PROMPT_CHUNKS])
    total = sum(len(p) for p in prompts)
    t0 = time.perf_counter()
    for p in prompts:
        index.lookup(fp, p)
    lookup = (time.perf_counter() - t0) / total * 1e6
    t0 = time.perf_counter()
    for p in prompts:
        index.longest_prefix(fp, p)
    prefix = (time.perf_counter() - t0) / total * 1e6
    return {"lookup_us_per_chunk": lookup, "longest_prefix_us_per_chunk": prefix}


def _met(value: float, op: str, goal: float) -> bool:
    return value >= goal if op == ">=" else value <= goal


def main(argv: list[str]) -> int:
    parser = bench_parser("index", __doc__.split("\n")[0], keeps=None)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--fault-chunks", type=int, default=10_000, help="chunks of the node under etcd faults")
    parser.add_argument("--unsafe-no-fsync", action="store_true", help="not for headline numbers")
    args = parser.parse_args(argv)
    result = run(args.chunks, args.unsafe_no_fsync, args.fault_chunks)
    if not args.json:
        for name, value in result.items():
            goal = GOALS.get(name)
            mark = "" if goal is None else f"   goal {goal[0]} {goal[1]:g}: {'ok' if _met(value, *goal) else 'MISSED'}"
            shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
            print(f"{name:<40} {shown:>16}{mark}")
    print(json.dumps(result, sort_keys=True))
    return 0
