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
