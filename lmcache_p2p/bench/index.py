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

The last line of output is one JSON object; without ``--json`` a table precedes it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import psutil

from ..aio import LoopThread
from ..config import AgentConfig, EtcdConfig
from ..index.client import EtcdClient
from ..index.etcd_index import EtcdBlockIndex
from ..index.etcd_server import EtcdServer
from ..index.schema import TIER_CPU, NodeId, NodeRecord
from ..keys import ChunkKey, FingerprintDigest

GOALS = {"publish_chunks_per_s": (">=", 20_000.0), "lookup_us_per_chunk": ("<=", 5.0),
         "etcd_bytes_per_chunk": ("<=", 200.0)}
PROMPT_CHUNKS = 128
QUOTA_BYTES = 8 << 30  # etcd's largest recommended --quota-backend-bytes


def _open(loop: LoopThread, endpoints: tuple[str, ...], node: str) -> EtcdBlockIndex:
    config = AgentConfig(node_id=node, cluster="bench", etcd=EtcdConfig(endpoints=endpoints, timeout_s=10.0))
    record = NodeRecord(NodeId(node), {"tcp": "127.0.0.1:7470"}, ("tcp",))
    return EtcdBlockIndex.open(loop, config, record)


def _db_in_use(loop: LoopThread, endpoints: tuple[str, ...]) -> int:
    async def status() -> int:
        async with EtcdClient(EtcdConfig(endpoints=endpoints)) as client:
            return (await client.status())[1]
    return loop.run(status(), 10.0)


def run(chunks: int, unsafe_no_fsync: bool) -> dict[str, Any]:
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
        t0 = time.perf_counter()
        writer.add_many(fp, keys, TIER_CPU)
        writer.flush(timeout=300.0)
        elapsed = time.perf_counter() - t0
        out["publish_chunks_per_s"] = chunks / elapsed
        out["publish_txns"] = writer.publisher.txns_total
        out["etcd_bytes_per_chunk"] = (_db_in_use(loop, eps) - before) / chunks
        out["etcd_rss_bytes_per_chunk"] = (etcd_proc.memory_info().rss - rss_before) / chunks

        t0 = time.perf_counter()
        mirror = reader.follow(fp)
        out["mirror_sync_s"] = time.perf_counter() - t0
        if len(mirror) != chunks:
            raise RuntimeError(f"mirror holds {len(mirror)} chunks, expected {chunks}")
        out["mirror_bytes_per_chunk"] = mirror.memory_bytes() / chunks
        out["mirror_bytes_method"] = "sys.getsizeof(dict + keys + interned owner sets)"
        out.update(_lookups(reader, fp, keys))

        t0 = time.perf_counter()
        writer.close()
        if not mirror.wait_for(lambda m: len(m) == 0, timeout=60.0):
            raise RuntimeError("mirror did not empty after the lease was revoked")
        out["lease_revoke_to_mirror_empty_s"] = time.perf_counter() - t0
        reader.close()
    per = out["etcd_bytes_per_chunk"]
    out["scale_chunks_per_cluster_at_8GiB_quota"] = int(QUOTA_BYTES / per) if per > 0 else None
    out["goals_met"] = all(_met(out[k], op, v) for k, (op, v) in GOALS.items())
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
    parser = argparse.ArgumentParser(prog="lmcache-p2p bench index", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--unsafe-no-fsync", action="store_true", help="not for headline numbers")
    args = parser.parse_args(argv)
    result = run(args.chunks, args.unsafe_no_fsync)
    if not args.json:
        for name, value in result.items():
            goal = GOALS.get(name)
            mark = "" if goal is None else f"   goal {goal[0]} {goal[1]:g}: {'ok' if _met(value, *goal) else 'MISSED'}"
            shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
            print(f"{name:<40} {shown:>16}{mark}")
    print(json.dumps(result, sort_keys=True))
    return 0
