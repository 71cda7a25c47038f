"""Hit plans: which leading chunks of a prompt can be had, and from whom.

    prompt:  | c0 local | c1 local | c2 peer B | c3 peer C | c4 nobody | c5 ...
    plan:    [c0, c1, c2, c3]          hit = end of c3; everything after is recomputed

A plan covers the longest run of *leading* chunks that are available, because a chunk's KV is
only usable when every earlier token's KV is present. A prompt's partial tail chunk can only be
the last chunk of a plan. Owner choice per chunk: the local store first, then the peer with the
fewest pulls in flight (counting those this plan already gives it), faster tier first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from .index.schema import NodeId
from .keys import ChunkKey

LOCAL = NodeId("")
"""The source of a chunk held by the local store."""


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedChunk:
    index: int
    key: ChunkKey
    start: int
    end: int
    source: NodeId  # LOCAL or the chosen peer
    alternatives: tuple[NodeId, ...] = ()  # other peers holding it, tried if the source fails


@dataclasses.dataclass(frozen=True, slots=True)
class HitPlan:
    num_tokens: int
    chunks: tuple[PlannedChunk, ...]

    @property
    def hit_tokens(self) -> int:
        return self.chunks[-1].end if self.chunks else 0

    @property
    def peers(self) -> set[NodeId]:
        return {c.source for c in self.chunks if c.source != LOCAL}

    def by_source(self) -> dict[NodeId, list[PlannedChunk]]:
        out: dict[NodeId, list[PlannedChunk]] = {}
        for c in self.chunks:
            out.setdefault(c.source, []).append(c)
        return out


def make_plan(
    keys: Sequence[ChunkKey],
    spans: Sequence[tuple[int, int]],
    *,
    local: Callable[[ChunkKey], bool],
    owners: Callable[[Sequence[ChunkKey]], Sequence[Mapping[NodeId, int]]],
    usable: Callable[[NodeId], bool],
    inflight: Mapping[NodeId, int],
    num_tokens: int,
) -> HitPlan:
    """Plan the longest run of available leading chunks.

    ``owners(keys)`` gives, per key, the peers holding it with their tier byte (lower is
    faster); ``usable(peer)`` is False for peers backed off after errors or unknown.
    """
    remote = owners(keys)
    load = dict(inflight)
    chunks: list[PlannedChunk] = []
    for i, (key, (start, end)) in enumerate(zip(keys, spans, strict=True)):
        if local(key):
            chunks.append(PlannedChunk(i, key, start, end, LOCAL))
            continue
        candidates = [(load.get(n, 0), tier, n) for n, tier in remote[i].items() if usable(n)]
        if not candidates:
            break
        candidates.sort()
        best = candidates[0][2]
        load[best] = load.get(best, 0) + 1
        chunks.append(PlannedChunk(i, key, start, end, best, tuple(c[2] for c in candidates[1:])))
    return HitPlan(num_tokens, tuple(chunks))


DEADLINE_FACTOR = 3.0  # a pull may take this many times its expected time before it is abandoned
DEADLINE_SLACK_S = 0.005  # ... and at least this much more than expected (scheduling noise)
FIRST_CONTACT_S = 1.0  # a pull from a peer never measured gets at least this (it connects and handshakes too)


@dataclasses.dataclass(frozen=True, slots=True)
class FetchBudget:
    """A plan cut to the pulls that beat recomputing, and the deadline those pulls get."""

    plan: HitPlan
    deadline_s: float
    expected_s: float  # expected time of the pulls kept (0 when all local)
    recompute_s: float | None  # engine time for the tokens pulled (None: prefill rate unknown)


def fetch_budget(
    plan: HitPlan,
    *,
    chunk_bytes: Callable[[PlannedChunk], int],
    expected_s: Callable[[NodeId, int], float],
    recompute_s: Callable[[int], float | None],
    max_s: float,
    known: Callable[[NodeId], bool] = lambda _peer: True,
) -> FetchBudget:
    """Keep the longest prefix of ``plan`` whose pulls are expected to finish before the engine
    could recompute the tokens they carry; give them a deadline from that expectation.

    Pulls from different peers run in parallel, one peer's chunks one after another::

        chunks:   c0 local | c1 peer A | c2 peer B | c3 peer A | c4 peer A
        expected: 0          A: 1 chunk  max(A1, B1)  A: 2 chunks  A: 3 chunks
        recompute of the pulled tokens (c1..ck) at this engine's measured prefill rate
        keep c0..ck for the largest k with expected <= recompute

    Without a prefill rate yet, every pull is kept. A pull from a peer never measured (``known``
    false: its first pull also pays for the connection and handshake, and a guess is no basis for
    a tight deadline) gets the recompute time but at least ``FIRST_CONTACT_S`` (``max_s`` without a
    prefill rate): a hung peer costs at most that once, then it is backed off and measured peers
    get deadlines from their estimates.
    """
    per_peer: dict[NodeId, int] = {}
    first_remote: int | None = None
    keep, kept_expected, kept_recompute = 0, 0.0, None
    for i, chunk in enumerate(plan.chunks):
        if chunk.source == LOCAL:
            if first_remote is None:
                keep = i + 1
            continue
        if first_remote is None:
            first_remote = chunk.start
        per_peer[chunk.source] = per_peer.get(chunk.source, 0) + chunk_bytes(chunk)
        expected = max(expected_s(peer, nbytes) for peer, nbytes in per_peer.items())
        recompute = recompute_s(chunk.end - first_remote)
        if recompute is None or expected <= recompute:
            keep, kept_expected, kept_recompute = i + 1, expected, recompute
    if first_remote is not None:
        # Local chunks after the last pull worth making are only usable if that pull is kept.
        while keep < len(plan.chunks) and plan.chunks[keep].source == LOCAL:
            keep += 1
    deadline = min(max_s, max(DEADLINE_FACTOR * kept_expected, kept_expected + DEADLINE_SLACK_S))
    if not all(known(c.source) for c in plan.chunks[:keep] if c.source != LOCAL):
        floor = max_s if kept_recompute is None else min(max_s, max(kept_recompute, FIRST_CONTACT_S))
        return FetchBudget(HitPlan(plan.num_tokens, plan.chunks[:keep]), floor, kept_expected, kept_recompute)
    if kept_recompute is not None:
        deadline = min(deadline, max(kept_recompute, kept_expected))
    return FetchBudget(HitPlan(plan.num_tokens, plan.chunks[:keep]), deadline, kept_expected, kept_recompute)
