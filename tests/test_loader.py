"""The load path on its own (``lmcache_p2p.load.Loader``): built from the parts it uses (tiers, estimates,
metrics; no transports here), never from an agent. Pulls over the loopback transport and the in-memory
index are ``test_agent_loopback.py``'s (through the agent's Loader); over real sockets and processes,
``test_agent_mesh.py``'s."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from lmcache_p2p.config import TierConfig, TransferConfig
from lmcache_p2p.estimates import PeerEstimates, PrefillRate
from lmcache_p2p.ids import NodeId
from lmcache_p2p.keys import ChunkKey, FingerprintDigest
from lmcache_p2p.load import Loader
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.plan import LOCAL, HitPlan, PlannedChunk
from lmcache_p2p.tiers import TieredStore

FP = b"f" * 16
SLOT = 64 << 10
HEADS = (0, 2)


def _loader(tiers: TieredStore, *, prefill: PrefillRate | None = None,
            on_hit: Callable[[ChunkKey], None] = lambda _key: None) -> Loader:
    """A loader over ``tiers`` alone: no index, no transports (remote chunks are misses)."""
    return Loader(tiers=tiers, fp=FingerprintDigest(FP), num_kv_heads=HEADS[1], heads=HEADS, node_id=NodeId("n"),
                  chunk_size=256, chunk_bytes=SLOT, transfer=TransferConfig(), tiers_config=TierConfig(), index=None,
                  puller=None, quarantine=None, objects=None, peer_estimates=PeerEstimates(),
                  prefill=prefill or PrefillRate(), metrics=AgentMetrics(CollectorRegistry()), on_hit=on_hit)


def _parts(refused: set[bytes], *, prefill_tokens_per_s: float | None = None) -> tuple[Loader, TieredStore, list]:
    tiers = TieredStore.from_config(TierConfig(cpu_capacity=16 * SLOT), SLOT,
                                    admit=lambda header: header.key not in refused)
    hits: list[ChunkKey] = []
    loader = _loader(tiers, prefill=PrefillRate(prefill_tokens_per_s), on_hit=hits.append)
    return loader, tiers, hits


def _chunk(i: int, source: str = LOCAL) -> PlannedChunk:
    return PlannedChunk(i, ChunkKey(bytes([i]) * 16), 256 * i, 256 * (i + 1), NodeId(source), heads=HEADS)


def _counts(loader: Loader, name: str) -> dict[str, float]:
    out = {}
    for metric in loader.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == name:
                out[next(iter(sample.labels.values()))] = sample.value
    return out


def test_held_chunks_are_pinned_verified_admitted_and_counted() -> None:
    refused: set[bytes] = set()
    loader, tiers, hits = _parts(refused)
    chunks = [_chunk(i) for i in range(4)]
    for c in chunks:
        assert tiers.put(c.key, FP, memoryview(os.urandom(SLOT)), 256, heads=HEADS) is not None
    # chunk 1 changed in registered memory after it was committed; chunk 2 invalidated since it was stored
    pin = tiers.cpu.pin(chunks[1].key, 5.0)
    assert pin is not None
    tiers.cpu.slot_view(pin.slot, 8)[:] = b"\0" * 8
    tiers.cpu.unpin(pin)
    refused.add(chunks[2].key)
    plan = HitPlan(4 * 256, tuple(chunks))
    pins = loader.load_pinned(plan, time.monotonic() + 5.0)
    assert [p is not None for p in pins] == [True, False, False, True]
    assert hits == [chunks[0].key, chunks[3].key]
    assert not tiers.cpu.contains(chunks[1].key) and not tiers.cpu.contains(chunks[2].key)  # dropped, never served
    assert loader.metrics.checksum_failures._value.get() == 1
    assert _counts(loader, "lmcache_p2p_loaded_chunks_total") == {"local": 2.0}
    for p in pins:
        if p is not None:
            tiers.cpu.unpin(p)


def test_pulls_slower_than_recomputing_or_past_the_deadline_are_declined_and_counted() -> None:
    loader, tiers, _ = _parts(set(), prefill_tokens_per_s=1e6)  # recomputing 256 tokens: 0.26 ms
    loader.peer_estimates.observe("peer", SLOT, 0.5)  # this peer: 0.5 s a chunk
    plan = HitPlan(2 * 256, (_chunk(0, "peer"), _chunk(1, "peer")))
    assert loader.load_pinned(plan, time.monotonic() + 5.0) == [None, None]
    assert _counts(loader, "lmcache_p2p_fetch_decisions_total").get("recompute_faster") == 2.0
    slow, _, _ = _parts(set())  # no prefill rate known: only the deadline can decline
    assert slow.load_pinned(plan, time.monotonic() - 0.001) == [None, None]
    assert _counts(slow, "lmcache_p2p_load_failures_total").get("deadline", 0.0) >= 2.0


def test_without_remote_nothing_is_pulled_or_read_from_disk(tmp_path) -> None:
    tiers = TieredStore.from_config(TierConfig(cpu_capacity=2 * SLOT, disk_path=str(tmp_path)), SLOT)
    loader = _loader(tiers)
    chunks = [_chunk(i) for i in range(4)]
    for c in chunks:  # two CPU slots: the first two are written back to disk
        tiers.put(c.key, FP, memoryview(os.urandom(SLOT)), 256, heads=HEADS)
    on_disk = [c for c in chunks if not tiers.cpu.contains(c.key)]
    assert on_disk
    plan = HitPlan(len(on_disk) * 256, tuple(on_disk))
    assert loader.load_pinned(plan, time.monotonic() + 5.0, remote=False) == [None] * len(on_disk)
    # the promotions that asked for, and the write-backs, done in the background first: beside a CPU hog
    # they still held both slots when the next load wanted one (a miss now, never an exception: load.py)
    assert tiers.worker is None or tiers.worker.drain(10)
    pins = loader.load_pinned(plan, time.monotonic() + 5.0)  # the engine may wait: read from disk
    assert all(p is not None for p in pins)
    for p in pins:
        if p is not None:
            tiers.cpu.unpin(p)
    tiers.close()


def test_a_disk_chunk_with_no_cpu_slot_to_come_into_is_a_miss_not_an_exception(tmp_path) -> None:
    """Both CPU slots pinned (other loads' chunks, peers reading them): a chunk on disk can't be brought in
    for this load. The engine's load gets None for it and goes on (it used to raise CapacityError)."""
    tiers = TieredStore.from_config(TierConfig(cpu_capacity=2 * SLOT, disk_path=str(tmp_path)), SLOT)
    loader = _loader(tiers)
    chunks = [_chunk(i) for i in range(4)]
    for c in chunks:
        tiers.put(c.key, FP, memoryview(os.urandom(SLOT)), 256, heads=HEADS)
    assert tiers.worker is None or tiers.worker.drain(10)
    held = [tiers.cpu.pin(c.key, 1.0) for c in chunks if tiers.cpu.contains(c.key)]
    on_disk = [c for c in chunks if not tiers.cpu.contains(c.key)]
    try:
        assert len(held) == 2 and all(p is not None for p in held) and on_disk
        assert loader.load_pinned(HitPlan(len(on_disk) * 256, tuple(on_disk)), time.monotonic() + 5.0) == \
            [None] * len(on_disk)
    finally:
        for p in held:
            if p is not None:
                tiers.cpu.unpin(p)
        tiers.close()
