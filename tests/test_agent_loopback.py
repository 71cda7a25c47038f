"""Whole agents over the shipped fakes: the in-memory index and the loopback transport.

Each agent here is a real :class:`CacheAgent` (tiers, invalidation, hand-offs, the load path the
engine takes: plan, budget, pull, pinned verified slots) whose index and transfers come from its
constructor (``index_factory``, ``transfers``). Fast, and never instead of the integration tests
(``test_agent_mesh.py``: real etcd, agent processes, sockets).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import wait_until
from prometheus_client import CollectorRegistry

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.config import AgentConfig, TierConfig, TransferConfig
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.plan import LOCAL
from lmcache_p2p.testing.loopback import LoopbackNet, LoopbackStack
from lmcache_p2p.testing.memory_index import MemoryIndex, MemoryMesh
from lmcache_p2p.testing.synthetic import synthetic_payload, synthetic_tokens

TOKENS = 4 * 256 + 100  # 4 full chunks and a partial tail


@pytest.fixture
def fleet() -> Iterator[dict[str, object]]:
    """``make(name)`` starts an agent on one shared in-memory index and loopback net."""
    mesh, net, agents = MemoryMesh(), LoopbackNet(), []

    def make(name: str, cpu: int = 64 << 20, disk: Path | None = None, **transfer: Any) -> CacheAgent:
        # backoff long enough that a backed-off owner is still backed off when a test looks, however loaded
        tiers = TierConfig(cpu_capacity=cpu, disk_path=str(disk) if disk else None)
        config = AgentConfig(node_id=name, tiers=tiers, transfer=TransferConfig(backoff_s=60.0, **transfer))
        agent = CacheAgent.of(config, index_factory=lambda _loop, record: MemoryIndex(mesh, record),
                              transfers=LoopbackStack.factory(net), metrics=AgentMetrics(CollectorRegistry()))
        agents.append(agent.start())
        return agent

    yield {"make": make, "net": net, "mesh": mesh}
    for agent in agents:
        agent.stop(flush_to_disk=False)


def store(agent: CacheAgent, seed: int) -> list[int]:
    tokens = synthetic_tokens(seed, TOKENS)
    keys, spans = agent.keys_for(tokens)
    layout = agent.config.layout
    payloads = [memoryview(synthetic_payload(k, layout.chunk_bytes(e - s)))
                for k, (s, e) in zip(keys, spans, strict=True)]
    assert agent.store(tokens, payloads).result(10) == len(keys)
    return tokens


def load(agent: CacheAgent, tokens: list[int]) -> tuple[list[bool], list[str]]:
    """Load through ``CacheAgent.load`` (the engine's path, then a copy): which chunks landed, from where;
    every byte delivered must be the owner's."""
    plan = agent.lookup(tokens)
    bufs = [bytearray(agent.chunk_bytes) for _ in plan.chunks]
    loaded = agent.load(plan, [memoryview(b) for b in bufs])
    layout = agent.config.layout
    for ok, chunk, buf in zip(loaded, plan.chunks, bufs, strict=True):
        if ok:
            expected = synthetic_payload(chunk.key, layout.chunk_bytes(chunk.end - chunk.start))
            assert buf[: len(expected)] == expected, "wrong bytes delivered"
    return loaded, [c.source for c in plan.chunks]


def test_a_peer_hit_lands_verified_and_is_then_local(fleet) -> None:
    a, b = fleet["make"]("a"), fleet["make"]("b")
    tokens = store(a, 1)
    loaded, sources = load(b, tokens)
    assert loaded == [True] * 5 and sources == ["a"] * 5
    assert b.metrics.loaded_chunks.labels("peer")._value.get() == 5
    loaded, sources = load(b, tokens)  # pulled chunks are held (and announced) by b now
    assert loaded == [True] * 5 and sources == [LOCAL] * 5


def test_corrupt_bytes_are_dropped_never_delivered(fleet) -> None:
    a, b = fleet["make"]("a"), fleet["make"]("b")
    tokens = store(a, 2)
    fleet["net"].owner(a.transfer_stack.address).fault = "corrupt"  # one byte flipped on the way
    loaded, _ = load(b, tokens)
    assert loaded == [False] * 5
    assert not any(b.holds(k) for k in b.keys_for(tokens)[0])
    assert b.metrics.checksum_failures._value.get() == 5


def test_a_dead_owner_is_missed_then_backed_off_and_the_alternative_serves(fleet) -> None:
    a, b, c = fleet["make"]("a"), fleet["make"]("b"), fleet["make"]("c")
    tokens = store(a, 3)
    store(b, 3)  # a second owner of the same chunks
    fleet["net"].owner(a.transfer_stack.address).fault = "dead"
    plan = c.lookup(tokens)
    assert {ch.source for ch in plan.chunks} == {"a", "b"}  # the planner spreads chunks over both owners
    loaded, _ = load(c, tokens)
    assert loaded == [True] * 5  # a's share was retried on b
    for key in c.keys_for(tokens)[0]:
        c.tiers.remove(key)
    assert {ch.source for ch in c.lookup(tokens).chunks} == {"b"}  # a failed: backed off, not planned


def test_a_load_past_its_deadline_asks_no_peer_and_blames_none(fleet) -> None:
    """A load that waited past its deadline (queued behind others) recomputes without asking: a pull
    started that late would only time out and back a healthy owner off."""
    a, b = fleet["make"]("a"), fleet["make"]("b")
    tokens = store(a, 8)
    transport = b.transfer_stack.transports["loopback"]
    assert b.loader.load_pinned(b.lookup(tokens), time.monotonic() - 0.001) == [None] * 5
    assert transport.pulls == [] and b.metrics.load_failures.labels("deadline")._value.get() == 5
    assert b.metrics.load_failures.labels("missing")._value.get() == 0  # each chunk counted once
    assert load(b, tokens)[0] == [True] * 5  # a was not backed off


def test_a_load_with_less_time_left_than_its_pulls_need_asks_no_peer(fleet) -> None:
    """A load dequeued late: its pulls, measured at ~0.2 s, would overrun the 20 ms left. None is started
    (counted ``deadline``), and the owner is not backed off for a timeout it never had."""
    a, b = fleet["make"]("a"), fleet["make"]("b")
    fleet["net"].owner(a.transfer_stack.address).delay_s = 0.2
    assert load(b, store(a, 9))[0] == [True] * 5  # b measures a: slow but working
    transport = b.transfer_stack.transports["loopback"]
    pulls = len(transport.pulls)
    tokens = store(a, 10)
    assert b.loader.load_pinned(b.lookup(tokens), time.monotonic() + 0.02) == [None] * 5
    assert len(transport.pulls) == pulls and b.metrics.load_failures.labels("deadline")._value.get() == 5
    assert load(b, tokens)[0] == [True] * 5  # a was not backed off


def test_a_load_past_its_deadline_reads_no_disk_and_promotes_in_the_background(fleet, tmp_path) -> None:
    """Chunks on this node's own disk, a load whose deadline has passed: nothing is read on the load's
    thread (the engine recomputes now), the chunks are promoted by the tier worker for the next request."""
    probe = fleet["make"]("probe")
    chunk = probe.chunk_bytes
    a = fleet["make"]("a", cpu=5 * chunk, disk=tmp_path / "disk")
    first = store(a, 12)
    store(a, 13)  # evicts the first prompt's chunks to disk
    keys = a.keys_for(first)[0]
    assert a.tiers.worker is not None and a.tiers.worker.drain(30)
    assert not any(a.tiers.cpu.contains(k) for k in keys) and all(a.tiers.disk.contains(k) for k in keys)
    assert a.loader.load_pinned(a.lookup(first), time.monotonic() - 0.001) == [None] * 5
    assert wait_until(lambda: all(a.tiers.cpu.contains(k) for k in keys), 30)  # promoted in the background
    assert load(a, first)[0] == [True] * 5


def test_a_known_fast_peer_is_not_abandoned_without_a_prefill_rate(fleet) -> None:
    """No engine here (no prefill rate): nothing is known to be faster than waiting, so a measured
    peer's pull gets the whole allowance, not three times its last time."""
    a, b = fleet["make"]("a"), fleet["make"]("b")
    assert load(b, store(a, 4))[0] == [True] * 5  # b measures a
    tokens = store(a, 5)
    fleet["net"].owner(a.transfer_stack.address).delay_s = 0.2  # far slower than measured
    assert load(b, tokens)[0] == [True] * 5


def test_with_a_prefill_rate_a_pull_slower_than_recompute_is_declined(fleet) -> None:
    a, b = fleet["make"]("a"), fleet["make"]("b")
    load(b, store(a, 6))  # b measures a
    for _ in range(20):
        b.prefill.observe(10_000_000, 1.0)  # an engine that recomputes 10M tokens/s: no pull beats it
    tokens = store(a, 7)
    assert b.loader.load_pinned(b.lookup(tokens), time.monotonic() + b.config.transfer.timeout_s) == [None] * 5
    assert b.metrics.load_failures.labels("recompute_faster")._value.get() == 5
    decisions = b.metrics.fetch_decisions
    assert decisions.labels("recompute_faster")._value.get() == 5
    assert decisions.labels("pull")._value.get() == 5  # the first load's: each decision counted with its kind
    ratio = b.metrics.estimate_ratio.labels("pull")
    assert ratio._sum.get() > 0  # the pulls made were held against what the budget expected


def test_told_not_to_recompute_when_faster_every_pull_is_made(fleet) -> None:
    """``transfer.recompute_when_faster`` false: the same engine pulls them all (engine time saved)."""
    a, b = fleet["make"]("a"), fleet["make"]("b", recompute_when_faster=False)
    load(b, store(a, 6))
    for _ in range(20):
        b.prefill.observe(10_000_000, 1.0)
    assert load(b, store(a, 7)) == ([True] * 5, ["a"] * 5)
    assert b.metrics.load_failures.labels("recompute_faster")._value.get() == 0
