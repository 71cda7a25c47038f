"""``lmcache-p2p bench objects``: the object tier against the raw S3 client, and a vLLM hit from the store.

One run, one S3 server (a private SeaweedFS on loopback unless ``--url``; credentials from the usual
AWS environment variables then), one etcd:

    store phase (an in-process agent, chunks of the tiny layout, ``--inflight`` requests at once; ``--rounds``
    rounds in which raw and ours alternate on fresh keys, the best round of each reported)
      raw_put_mbps / raw_get_mbps     obstore PUT / GET of the same payloads, nothing else
      tier_upload_mbps                our uploads: pack + encrypt (AES-256-GCM) + PUT + the etcd announce,
                                      queued from eviction offers, until the last is confirmed
      tier_load_mbps                  our loads: the metas' epochs (etcd) + a bounded GET + decrypt and
                                      verify (AEAD tag, checksum, epoch) + into the CPU pool
      *_vs_raw                        ours / raw (1.0: the tier costs nothing over the client)
      raw_get_one_ms / tier_load_one_ms   one chunk, p50

    vLLM phase (tiny model, eager mode, every engine in its own process; ``--no-vllm`` skips it)
      ttft_cold_ms         vLLM without any connector
      ttft_miss_ms         engine A (connector, object tier, a CPU pool of one prompt): it computes
                           the prompts; each next prompt evicts the last, whose chunks go to the store
      ttft_object_hit_ms   engine B, started after A stopped (nothing of the prompts on any node):
                           every chunk comes from the store
      object_hit_speedup_vs_cold, object_hit_outputs_match_miss (greedy outputs equal A's)
      ttft_store_hung_ms   (embedded server only) B asks for a document only the store holds while the
                           store is SIGSTOPped: the load waits until its budget's deadline and B
                           recomputes; store_hung_vs_miss compares it with B's own miss (ttft_miss_b_ms);
                           ttft_store_backed_off_ms: the next such documents, the store backed off
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from ..agent import CacheAgent
from ..config import load_config
from ..ids import OBJECTS, TIER_OBJECT
from ..index.etcd_server import EtcdServer
from ..keys import ChunkKey
from ..metrics import AgentMetrics
from ..objects.format import max_object_size
from ..objects.seaweed import SeaweedServer
from ..objects.store import ObjectStore
from ..plan import PlannedChunk
from ..testing.synthetic import synthetic_payload
from .common import bench_parser, emit, progress, ratio, run_in_workdir
from .vllm import add_engine_arguments, bench_prompts, cold_ttft_ms, median_ms, started

SECRET = "bench-objects-secret-7f3a9c1e5b2d80461c9e4a7b"


def _agent_yaml(path: Path, node: str, endpoints: tuple[str, ...], url: str, bucket: str, *, cpu: str,
                inflight: int, prefix: str) -> Path:
    path.write_text(yaml.safe_dump({
        "node_id": node, "cluster": "bench-objects", "metrics_port": 0, "tiers": {"cpu_capacity": cpu},
        "etcd": {"endpoints": list(endpoints)},
        "transfer": {"transports": ["tcp"], "secret": SECRET},
        "handoff": {"budget_bytes_per_s": 0},
        "objects": {"url": url, "bucket": bucket, "prefix": prefix, "min_hits": 0, "max_inflight": inflight,
                    "budget_bytes_per_s": "10GB", "spill_bytes": "4GiB", "cleanup_interval_s": 0},
    }))
    return path


def _store_phase(args: argparse.Namespace, work: Path, etcd: EtcdServer, url: str, bucket: str) -> dict[str, Any]:
    cfg = load_config(_agent_yaml(work / "store.yaml", "bench-store", etcd.endpoints, url, bucket, cpu="4GiB",
                                  inflight=args.inflight, prefix=f"bench-{os.getpid()}-{int(time.time())}"), env={})
    agent = CacheAgent.of(cfg, metrics=AgentMetrics(CollectorRegistry())).start()
    try:
        assert agent.objects is not None
        tier = agent.objects
        raw = ObjectStore(cfg.objects)
        raw_prefix = f"{cfg.objects.prefix}-raw"
        need = (0, agent.fingerprint.num_kv_heads)
        limit = max_object_size(agent.chunk_bytes)
        out: dict[str, Any] = {"chunks": args.chunks, "chunk_bytes": agent.chunk_bytes, "inflight": args.inflight,
                               "rounds": args.rounds}
        best: dict[str, float] = {}

        def keep(name: str, mbps: float) -> None:
            best[name] = max(best.get(name, 0.0), round(mbps, 1))

        for _round in range(args.rounds):  # alternating, fresh keys each round; the best round of each counts
            keys = [ChunkKey(os.urandom(16)) for _ in range(args.chunks)]
            payloads = [synthetic_payload(k, agent.chunk_bytes) for k in keys]
            total = sum(len(p) for p in payloads)

            async def raw_all(put: bool, keys: list[ChunkKey] = keys, payloads: list[bytes] = payloads) -> float:
                gate = asyncio.Semaphore(args.inflight)

                async def one(i: int) -> None:
                    async with gate:
                        name, deadline = f"{raw_prefix}/{keys[i].hex()}", time.monotonic() + 60
                        await (raw.put(name, payloads[i], deadline) if put else raw.get(name, deadline, limit=limit))

                t0 = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(len(keys))))
                return time.perf_counter() - t0

            keep("raw_put_mbps", total / asyncio.run(raw_all(True)) / 1e6)
            # Ours, upload: every chunk offered as a victim leaving the last tier, until the last is announced.
            headers = [agent.tiers.put(k, agent.fp, memoryview(p), cfg.chunk_size, heads=agent.heads)
                       for k, p in zip(keys, payloads, strict=True)]
            t0 = time.perf_counter()
            for header, payload in zip(headers, payloads, strict=True):
                assert header is not None and tier.offer(header, memoryview(payload))
            index = agent.index
            assert index is not None
            while tier.pending or not all(o.get(OBJECTS) == TIER_OBJECT for o in index.owners(agent.fp, keys)):
                time.sleep(0.002)
            keep("tier_upload_mbps", total / (time.perf_counter() - t0) / 1e6)
            keep("raw_get_mbps", total / asyncio.run(raw_all(False)) / 1e6)
            # Ours, load: the agent's own path for chunks planned from the store (GET, verify, into the pool).
            planned = [PlannedChunk(i, k, 0, cfg.chunk_size, OBJECTS, heads=need) for i, k in enumerate(keys)]
            for k in keys:
                agent.tiers.remove(k)
            t0 = time.perf_counter()
            agent.loader.pull(planned, time.monotonic() + 120)
            keep("tier_load_mbps", total / (time.perf_counter() - t0) / 1e6)
            out["tier_loaded"] = sum(agent.holds(k) for k in keys)
            ones_raw, ones_tier = [], []
            for i, chunk in enumerate(planned[:16]):
                t0 = time.perf_counter()
                asyncio.run(raw.get(f"{raw_prefix}/{keys[i].hex()}", time.monotonic() + 60, limit=limit))
                ones_raw.append(time.perf_counter() - t0)
                agent.tiers.remove(chunk.key)
                t0 = time.perf_counter()
                agent.loader.pull([chunk], time.monotonic() + 60)
                ones_tier.append(time.perf_counter() - t0)
            for name, ones in (("raw_get_one_ms", ones_raw), ("tier_load_one_ms", ones_tier)):
                median = round(1e3 * statistics.median(ones), 2)
                out[name] = min(out.get(name, median), median)
        out.update(best)
        out["tier_upload_errors"] = int(agent.metrics.registry.get_sample_value(
            "lmcache_p2p_object_ops_total", {"op": "put", "result": "error"}) or 0)
        out["tier_upload_vs_raw_put"] = ratio(out["tier_upload_mbps"], out["raw_put_mbps"])
        out["tier_load_vs_raw_get"] = ratio(out["tier_load_mbps"], out["raw_get_mbps"])
        return out
    finally:
        agent.stop()


def _vllm_phase(args: argparse.Namespace, work: Path, etcd: EtcdServer, url: str, bucket: str,
                server: SeaweedServer | None) -> dict[str, Any]:
    from ..testing.engine_client import EngineProcess
    from ..testing.tiny_model import create_tiny_model

    model = Path(args.model) if args.model else create_tiny_model(work / "tiny-llama")
    prompts = bench_prompts(args.prompts, args.tokens, seed=31000)
    warm = bench_prompts(3, args.tokens, seed=39000)
    chunk_mib = 0.5 * -(-args.tokens // 256)  # the tiny layout: 512 KiB per 256-token chunk
    prefix = f"vllm-{os.getpid()}-{int(time.time())}"
    cfg_a = _agent_yaml(work / "a.yaml", "bench-a", etcd.endpoints, url, bucket, cpu=f"{int(chunk_mib)}MiB",
                        inflight=args.inflight, prefix=prefix)
    cfg_b = _agent_yaml(work / "b.yaml", "bench-b", etcd.endpoints, url, bucket, cpu="512MiB",
                        inflight=args.inflight, prefix=prefix)
    out: dict[str, Any] = {"engine_mode": "eager", "prompts": args.prompts, "prompt_tokens": args.tokens}
    engines: list[EngineProcess] = []
    try:
        out["ttft_cold_ms"] = cold_ttft_ms(engines, model, work, args.dtype, warm[0], prompts)
        a = started(engines, model, cfg_a, "bench-a", work / "a.log", args.dtype, warm[1])
        miss = a.ttft(prompts)
        out["ttft_miss_ms"] = median_ms(miss)
        hung_docs = bench_prompts(3, args.tokens, seed=33000)
        a.ttft(hung_docs)  # in the store too: read while the store is SIGSTOPped (below)
        a.ttft([warm[2]])  # evicts the last prompt too
        load = load_config(cfg_b, env={})
        store = ObjectStore(load.objects)
        want = (len(prompts) + len(hung_docs)) * -(-args.tokens // 256)

        async def stored() -> int:
            return len(await store.names(f"{prefix}/", time.monotonic() + 30))

        deadline = time.monotonic() + 120
        while asyncio.run(stored()) < want and time.monotonic() < deadline:
            time.sleep(0.2)
        out["objects_uploaded"] = asyncio.run(stored())
        a.stop()  # nothing of the prompts is left on any node
        b = EngineProcess(model, cfg_b, name="bench-b", log_path=work / "b.log", dtype=args.dtype)
        engines.append(b)
        b.wait_ready()
        b.ttft([bench_prompts(1, args.tokens, seed=38000)[0]])
        hit = b.ttft(prompts)
        out["ttft_object_hit_ms"] = median_ms(hit)
        out["object_hit_cached_tokens"] = [r["num_cached_tokens"] for r in hit]
        out["object_hit_outputs_match_miss"] = [r["tokens"] for r in hit] == [r["tokens"] for r in miss]
        if server is not None:
            out.update(_hung_store(b, server, hung_docs, bench_prompts(1, args.tokens, seed=37000)[0]))
    finally:
        for engine in engines:
            with contextlib.suppress(Exception):
                engine.stop()
    out["object_hit_speedup_vs_cold"] = round(out["ttft_cold_ms"] / out["ttft_object_hit_ms"], 2)
    return out


def _hung_store(b: Any, server: SeaweedServer, hung_docs: list[list[int]], fresh: list[int]) -> dict[str, Any]:
    """Engine B asks for documents only the store holds while the store is SIGSTOPped (its connections
    open, no answer): the first load waits until its budget's deadline, then B recomputes; the store is
    then backed off and the next ones are recomputed at once. Against B's own miss (a document nobody
    holds)."""
    out: dict[str, Any] = {}
    out["ttft_miss_b_ms"] = median_ms(b.ttft([fresh]))
    server.pause()
    try:
        hung = b.ttft(hung_docs)
    finally:
        server.resume()
    out["ttft_store_hung_ms"] = round(1000 * hung[0]["ttft_s"], 2)
    out["ttft_store_backed_off_ms"] = median_ms(hung[1:])
    out["store_hung_cached_tokens"] = [r["num_cached_tokens"] for r in hung]
    out["store_hung_vs_miss"] = round(out["ttft_store_hung_ms"] / out["ttft_miss_b_ms"], 3)
    return out


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(EtcdServer(base_dir=str(work)))
        server: SeaweedServer | None = None
        if args.url:
            url, bucket = args.url, args.bucket
        else:
            server = stack.enter_context(SeaweedServer(bucket=args.bucket, base_dir=str(work / "weed")))
            os.environ.update(server.env)  # the agents (here and in the engines) read the usual variables
            url, bucket = server.url, server.bucket
        out: dict[str, Any] = {"server": "SeaweedFS (weed mini, loopback)" if not args.url else url}
        progress("objects", "store phase: raw puts and gets against the tier's")
        out.update(_store_phase(args, work, etcd, url, bucket))
        if not args.no_vllm:
            progress("objects", "vLLM phase: engines loading from the object store")
            out.update(_vllm_phase(args, work, etcd, url, bucket, server))
        return out


def main(argv: list[str]) -> int:
    parser = bench_parser("objects", __doc__)
    parser.add_argument("--chunks", type=int, default=64, help="chunks moved in the store phase")
    parser.add_argument("--inflight", type=int, default=8, help="requests in flight, raw and ours")
    parser.add_argument("--rounds", type=int, default=3, help="store-phase rounds (raw and ours alternate)")
    parser.add_argument("--url", help="an S3 endpoint (default: a private SeaweedFS started here)")
    parser.add_argument("--bucket", default="lmcache-p2p-bench")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    add_engine_arguments(parser, dtype="bfloat16", transport=False,
                         model="model directory (default: a tiny test model created in the work dir)")
    parser.add_argument("--no-vllm", action="store_true", help="the store phase only")
    args = parser.parse_args(argv)
    result = run_in_workdir(run, args, "lmcache-p2p-bench-objects-")
    emit(result, args.json, "bench objects (object tier vs the raw client; vLLM eager: a hit from the store vs cold)")
    return 0
