"""Shared pieces of the vLLM integration tests: the tiny model, agent configs, engines."""

from __future__ import annotations

from pathlib import Path

import yaml

from lmcache_p2p.metrics_http import scrape as status_scrape
from lmcache_p2p.testing.synthetic import synthetic_tokens

SECRET = "test-cluster-secret-7f3a9c1e5b2d80461c9e4a7b"


def write_agent_config(path: Path, *, node: str, cluster: str, endpoints: tuple[str, ...],
                       transports: tuple[str, ...] = ("tcp",), lease_ttl_s: int = 10,
                       first_contact_s: float = 1.0, index: str = "watch", **transfer: object) -> Path:
    path.write_text(yaml.safe_dump({
        "node_id": node,
        "cluster": cluster,
        "chunk_size": 256,
        "metrics_port": 0,
        "tiers": {"cpu_capacity": "256MiB"},
        "etcd": {"endpoints": list(endpoints), "lease_ttl_s": lease_ttl_s, "index": index},
        "transfer": {"transports": list(transports), "secret": SECRET, "timeout_s": 5,
                     "first_contact_s": first_contact_s, **transfer},
    }))
    return path


def node_records(cfg_path: Path) -> dict:
    """The node records in etcd, read with the etcd settings of an agent config."""
    from lmcache_p2p.aio import LoopThread
    from lmcache_p2p.config import load_config
    from lmcache_p2p.index.reader import IndexReader

    with LoopThread() as loop:
        reader = IndexReader.open(loop, load_config(cfg_path), b"\0" * 16)
        try:
            return reader.nodes()
        finally:
            reader.close()


def registered_chunks(cfg_path: Path, node: str) -> int:
    """Block entries of ``node`` in etcd (every fingerprint), read with an agent config's etcd settings:
    an engine's chunks are a hit elsewhere once they are there."""
    return registered(cfg_path, node)[0]


def registered(cfg_path: Path, node: str) -> tuple[int, int]:
    """``node``'s block entries in etcd, and the newest one's revision (what a router that saw them passes
    as ``lmcache_p2p_index_revision``)."""
    import asyncio

    from lmcache_p2p.config import load_config
    from lmcache_p2p.index.client import EtcdClient
    from lmcache_p2p.index.schema import Schema

    config = load_config(cfg_path)

    async def count() -> tuple[int, int]:
        async with EtcdClient(config.etcd) as client:
            blocks, _ = await client.get_prefix(Schema(config.cluster).blocks)
        mine = [kv for kv in blocks if kv.key.endswith(b"/" + node.encode())]
        return len(mine), max((kv.mod_revision for kv in mine), default=0)

    return asyncio.run(count())


def prompts(n: int, length: int, seed: int, vocab: int = 4000) -> list[list[int]]:
    # ids 0-2 are the tokenizer's special tokens; keep them out of the prompt body
    return [[t + 3 for t in synthetic_tokens(seed + i, length, vocab)] for i in range(n)]


scrape = status_scrape


def wait_registered(cfg_path: Path, node: str, at_least: int, timeout: float = 20.0) -> int:
    """Wait until ``node`` has at least ``at_least`` block entries in etcd; return the count.

    A test that expects a peer *miss* must first know the chunks are announced: otherwise it
    would pass because of propagation delay, not because the keys differ."""
    import time

    deadline = time.monotonic() + timeout
    while (count := registered_chunks(cfg_path, node)) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return count


def wait_settled(cfg_path: Path, node: str, at_least: int, quiet: float = 2.0, timeout: float = 30.0) -> int:
    """Wait until ``node`` has at least ``at_least`` block entries and the count has not changed for
    ``quiet`` seconds (saves and pulls of earlier requests registered); return it. A test that counts
    what one request adds reads its baseline here: a late registration of an earlier request's chunk
    would otherwise be counted as the new request's."""
    import time

    deadline = time.monotonic() + timeout
    count, since = wait_registered(cfg_path, node, at_least, timeout), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.2)
        if (now := registered_chunks(cfg_path, node)) != count:
            count, since = now, time.monotonic()
    return count


def lora(name: str, lora_id: int, path: Path) -> dict:
    """A request's LoRA adapter, as ``EngineProcess.generate(lora=...)`` takes it."""
    return {"name": name, "id": lora_id, "path": str(path)}


def wait_announced(cfg_path: Path, tokens: list[int], timeout: float = 20.0, chunk: int = 256) -> int:
    """Wait until the chunk ending ``tokens`` (the last, cut short unless they fill it) is announced by some
    node under a fingerprint a node serves; return its entry's etcd revision (what a router that saw it passes
    as ``lmcache_p2p_index_revision``). Raises when it is not announced in ``timeout`` seconds."""
    import asyncio
    import time

    from lmcache_p2p.config import load_config
    from lmcache_p2p.index.client import EtcdClient
    from lmcache_p2p.index.schema import Schema, decode_node_record
    from lmcache_p2p.keys import FingerprintDigest, chunk_keys

    config = load_config(cfg_path)
    schema = Schema(config.cluster)

    async def revision() -> int | None:
        async with EtcdClient(config.etcd) as client:
            nodes, _ = await client.get_prefix(schema.nodes)
            fps = {fp for kv in nodes for fp in decode_node_record(kv.value).served}
            for fp in fps:
                digest = FingerprintDigest(bytes.fromhex(fp))
                key = chunk_keys(digest, tokens, chunk)[-1]
                found, _ = await client.get_prefix(schema.blocks_of(digest) + key.hex().encode() + b"/")
                if found:
                    return min(kv.mod_revision for kv in found)
        return None

    deadline = time.monotonic() + timeout
    while (rev := asyncio.run(revision())) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the chunk ending {len(tokens)} tokens was not announced in {timeout} s")
        time.sleep(0.2)
    return rev


def canary_counts(cfg_path: Path, node: str) -> dict[str, float]:
    """``node``'s canary checks by outcome, scraped from its metrics."""
    url = node_records(cfg_path)[node].metrics_url
    assert url is not None
    metrics = scrape(url)
    return {o: metrics.get(f'lmcache_p2p_canary_checks_total{{outcome="{o}"}}', 0.0)
            for o in ("match", "mismatch", "unconfirmed", "unavailable")}
