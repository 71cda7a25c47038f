"""Striping: one request's chunks split across several owners and pulled in parallel."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from ..ids import PeerAddress
from ..keys import ChunkKey, FingerprintDigest
from ..tiers.cpu_pool import CpuPool
from ..transfer.base import PullResult, Transport


def plan_stripes(owners: Mapping[ChunkKey, Sequence[PeerAddress]]) -> dict[PeerAddress, list[ChunkKey]]:
    """Give each chunk to the least-loaded of its owners (ties: first listed), in key order."""
    plan: dict[PeerAddress, list[ChunkKey]] = {}
    for key, peers in owners.items():
        if peers:
            best = min(peers, key=lambda p: len(plan.get(p, ())))
            plan.setdefault(best, []).append(key)
    return plan


async def pull_striped(
    transport: Transport,
    plan: Mapping[PeerAddress, Sequence[ChunkKey]],
    fingerprint: FingerprintDigest,
    dst: CpuPool,
    deadline: float,
) -> dict[PeerAddress, PullResult]:
    """Pull every peer's share at once; each share succeeds or misses on its own."""
    peers = [p for p, keys in plan.items() if keys]
    results = await asyncio.gather(*(transport.pull(p, fingerprint, plan[p], dst, deadline) for p in peers))
    return dict(zip(peers, results, strict=True))


def merge(results: Mapping[PeerAddress, PullResult]) -> tuple[set[ChunkKey], set[ChunkKey]]:
    """(loaded, missed) keys over all stripes."""
    loaded: set[ChunkKey] = set()
    missed: set[ChunkKey] = set()
    for result in results.values():
        loaded.update(result.loaded)
        missed.update(result.missed)
    return loaded, missed - loaded
