"""Tensor parallelism at the agent level: engines sharded differently share chunks, byte-exact per head.

Real etcd, real sockets; owners are rank processes (``tp_rank_proc.py``) holding their heads of a
deterministic paged KV cache; loaders are in-process agents, one per rank, that scatter what they
load into zeroed caches of their own shape. Every loaded block must equal, head by head, what the
owning engine computed. (Real vLLM on CPU with a TP=2 engine beside a TP=1 one: tests/test_vllm_tp.py.)
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from pathlib import Path

import pytest
import torch
from agent_helpers import AgentProcess, agent_yaml, config, wait_until
from prometheus_client import CollectorRegistry
from tp_kv import NUM_BLOCKS, TOKENS, block_ids, chunk_blocks, full_cache

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.aio import LoopThread
from lmcache_p2p.cli import status
from lmcache_p2p.config import rank_config
from lmcache_p2p.ids import origin_of
from lmcache_p2p.index.reader import IndexReader
from lmcache_p2p.kernels.paged import PagedKV
from lmcache_p2p.keys import Fingerprint, chunk_keys, head_range
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.plan import LOCAL
from lmcache_p2p.testing.synthetic import synthetic_tokens
from lmcache_p2p.transfer.nixl_engine import nixl_available

HEADS = 4
LAYOUT = {"num_kv_heads": HEADS}
RANK_PROC = str(pathlib.Path(__file__).with_name("tp_rank_proc.py"))
NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")


def owners(tmp_path: Path, cluster: str, endpoints: tuple[str, ...], tp: int, seed: int,
           transports: tuple[str, ...], ranks: range | None = None) -> list[AgentProcess]:
    cfg = agent_yaml(tmp_path / f"owner-tp{tp}.yaml", node=f"owner-tp{tp}", cluster=cluster, endpoints=endpoints,
                     layout=LAYOUT, transports=transports)
    return [AgentProcess(cfg, log=tmp_path / f"owner-tp{tp}-r{r}.log",
                         argv=[RANK_PROC, str(cfg), str(tp), str(r), str(seed)]).wait_ready()
            for r in (ranks if ranks is not None else range(tp))]


def loader(tmp_path: Path, cluster: str, endpoints: tuple[str, ...], tp: int, rank: int,
           transports: tuple[str, ...]) -> CacheAgent:
    cfg = rank_config(config(agent_yaml(tmp_path / f"loader-tp{tp}.yaml", node=f"loader-tp{tp}", cluster=cluster,
                                        endpoints=endpoints, layout=LAYOUT, transports=transports)), rank, tp)
    heads = head_range(HEADS, tp, rank)
    chunk_bytes = cfg.layout.chunk_bytes(cfg.chunk_size) * (heads[1] - heads[0]) // HEADS
    return CacheAgent(cfg, Fingerprint.of(cfg.layout, tp, rank), chunk_bytes, heads=heads,
                      metrics=AgentMetrics(CollectorRegistry())).start()


def load_and_check(agent: CacheAgent, seed: int, loader_seed: int) -> list[tuple[str, ...]]:
    """Load prompt ``seed`` into a zeroed cache of this rank's shape, at this engine's own block ids;
    every head of every block must equal the owning engine's. Returns each chunk's sources."""
    layout, (h0, h1) = agent.config.layout, agent.heads
    tokens = synthetic_tokens(seed, TOKENS)
    n_chunks = len(chunk_keys(agent.fp, tokens, agent.config.chunk_size))
    # 30 s: beside a CPU hog and the suite's other lane, four owner processes publishing took over 15 s once
    assert wait_until(lambda: len(agent.lookup(tokens).chunks) == n_chunks, 30), "index never showed every chunk"
    plan = agent.lookup(tokens)
    mine = [torch.zeros(NUM_BLOCKS, h1 - h0, layout.block_size, 2 * layout.head_size, dtype=torch.bfloat16)
            for _ in range(layout.num_layers)]
    kv = PagedKV(mine, heads=h1 - h0)
    n_blocks = -(-TOKENS // layout.block_size)
    dst_ids, src_ids = block_ids(loader_seed, n_blocks), block_ids(seed, n_blocks)
    pins = agent.loader.load_pinned(plan, time.monotonic() + 10.0)
    try:
        for pin, chunk, blocks in zip(pins, plan.chunks, chunk_blocks(layout, agent.config.chunk_size, dst_ids, TOKENS),
                                      strict=True):
            assert pin is not None and pin.header.heads == (h0, h1)
            # whichever ranks it came from, the chunk names the engine that computed it
            assert pin.header.origin == origin_of(chunk.parts()[0].source)
            staged = agent.tiers.cpu.stage(pin)  # what the worker scatters: a verified private copy
            assert staged is not None and staged.numel() == kv.payload_nbytes(len(blocks))
            kv.scatter(staged, torch.tensor(blocks, dtype=torch.int64))
    finally:
        for pin in pins:
            if pin is not None:
                agent.tiers.cpu.unpin(pin)
    source = full_cache(layout, seed)
    for got, want in zip(mine, source, strict=True):
        for h in range(h0, h1):
            assert torch.equal(got[dst_ids, h - h0], want[src_ids, h]), f"head {h} differs"
    return [tuple(p.source for p in c.parts()) for c in plan.chunks]


@pytest.mark.parametrize(("owner_tp", "loader_tp", "transport"), [
    (1, 2, "tcp"),  # each rank pulls its half of every chunk from one owner: a byte range
    (2, 1, "tcp"),  # the TP=1 engine assembles every chunk from both ranks of the TP=2 engine
    (4, 2, "tcp"),  # each rank assembles its two heads from two owner ranks
    (2, 4, "tcp"),  # each rank pulls one head of the owner rank that holds it
    pytest.param(1, 2, "nixl", marks=NIXL),
    pytest.param(2, 1, "nixl", marks=NIXL),
])
def test_engines_sharded_differently_share_chunks(etcd, cluster_name, tmp_path, owner_tp, loader_tp, transport):
    transports = (transport,)
    procs = owners(tmp_path, cluster_name, etcd.endpoints, owner_tp, 11, transports)
    loaders = [loader(tmp_path, cluster_name, etcd.endpoints, loader_tp, r, transports) for r in range(loader_tp)]
    try:
        for agent in loaders:
            sources = load_and_check(agent, 11, 23)
            assert len(sources) == 5 and LOCAL not in {s for parts in sources for s in parts}
            per_chunk = max(1, owner_tp // loader_tp)  # owners whose heads make up this rank's range
            assert all(len(parts) == per_chunk for parts in sources), sources
            assembled = agent.metrics.assembled_chunks._value.get()
            assert assembled == (5 if per_chunk > 1 else 0)
            # loaded once, the chunks are this rank's own: a second load is all local
            assert all(c.source == LOCAL for c in agent.lookup(synthetic_tokens(11, TOKENS)).chunks)
    finally:
        for agent in loaders:
            agent.stop()
        for p in procs:
            p.stop()


def test_a_chunk_is_a_hit_only_when_every_head_is_held(etcd, cluster_name, tmp_path):
    """One rank of a TP=2 engine up: the scheduler's view and a TP=1 engine see no hit (half the heads
    of a chunk are useless), and ``status`` flags the engine; the other rank joins: a full hit,
    assembled from both, and ``status`` lists the two ranks under their engine."""
    procs = owners(tmp_path, cluster_name, etcd.endpoints, 2, 11, ("tcp",), ranks=range(1))
    agent = loader(tmp_path, cluster_name, etcd.endpoints, 1, 0, ("tcp",))
    loop = LoopThread("reader")
    reader = IndexReader.open(loop, agent.config, agent.fp)
    keys = chunk_keys(agent.fp, synthetic_tokens(11, TOKENS), agent.config.chunk_size)
    try:
        assert wait_until(lambda: len(reader.mirror.owners(keys[0])) == 1, 10)
        assert reader.longest_prefix(keys) == 0
        flags = asyncio.run(status.collect(agent.config))["flags"]
        assert any(f.startswith("incomplete-engine: owner-tp2 ") and "0-2 of 4" in f for f in flags), flags
        assert agent.lookup(synthetic_tokens(11, TOKENS)).chunks == ()
        procs += owners(tmp_path, cluster_name, etcd.endpoints, 2, 11, ("tcp",), ranks=range(1, 2))
        assert wait_until(lambda: reader.longest_prefix(keys) == len(keys), 10)
        sources = load_and_check(agent, 11, 5)
        assert all(len(parts) == 2 for parts in sources)
        report = asyncio.run(status.collect(agent.config))
        ranks = {n["node_id"]: (n["engine"], n["heads"]) for n in report["nodes"]}
        assert ranks["owner-tp2-r0"] == ("owner-tp2", "0-2/4") and ranks["owner-tp2-r1"] == ("owner-tp2", "2-4/4")
        assert ranks["loader-tp1"] == ("loader-tp1", "")
        assert not [f for f in report["flags"] if f.startswith("incomplete-engine")], report["flags"]
        procs.pop().stop()  # rank 1 leaves: its engine is flagged
        assert wait_until(lambda: any(f.startswith("incomplete-engine: owner-tp2 ")
                                      for f in asyncio.run(status.collect(agent.config))["flags"]), 10)
    finally:
        reader.close()
        loop.stop()
        agent.stop()
        for p in procs:
            p.stop()
