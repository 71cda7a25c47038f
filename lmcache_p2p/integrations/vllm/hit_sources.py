"""Where an offered hit's tokens are held, as vLLM's ``CacheHitSource`` names them (its per-source prompt token
counters, ``vllm:prompt_tokens_by_source``): ``host`` or ``disk`` (this engine's own agents: its node id, or its
ranks' ``<id>-r<k>``), else ``p2p`` (peers, the object store). Counted when the hit is offered; vLLM asks once
it granted it (``P2PScheduler.hit_sources``).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

from ...ids import TIER_DISK, NodeId
from ...keys import ChunkKey
from ...segments import BlendPlan


def where(owners: Mapping[NodeId, int], node: str, key: ChunkKey, saved: Container[ChunkKey]) -> str:
    """Where a chunk held by ``owners`` (node -> tier) is, seen from ``node``; ``saved``: asked of this node's
    worker, held there while the mirror can't say."""
    tiers = [t for n, t in owners.items() if n == node or n.startswith(node + "-r")]
    if tiers:
        return "disk" if min(tiers) >= TIER_DISK else "host"
    return "host" if key in saved else "p2p"


def hit_sources(keys: list[ChunkKey], chunk: int, start: int, exact: int, n: int, blend: BlendPlan | None,
                where_of: Callable[[ChunkKey], str]) -> dict[str, int]:
    """The ``n`` hit tokens from ``start`` by where they are held: the exact part chunk by chunk (up to
    ``exact``), a blend's segment tokens by where most of its held segment chunks are."""
    out: dict[str, int] = {}
    for i in range(start // chunk, -(-exact // chunk)):
        if i < len(keys):
            tokens = min((i + 1) * chunk, exact) - max(i * chunk, start)
            if tokens > 0:
                found = where_of(keys[i])
                out[found] = out.get(found, 0) + tokens
    rest = n - sum(out.values())
    if rest > 0:
        held = [where_of(ChunkKey(k)) for seg in (blend.segments if blend else []) if not seg.fresh for k in seg.keys]
        found = max(set(held), key=held.count) if held else "p2p"
        out[found] = out.get(found, 0) + rest
    return out


def granted(offered: dict[str, int], num_external_tokens: int) -> dict[str, int]:
    """The sources of the ``num_external_tokens`` vLLM granted, from those ``offered`` (vLLM granting another
    count than was offered: the largest source absorbs the difference)."""
    sources = dict(offered)
    total = sum(sources.values())
    if not sources or num_external_tokens <= 0:
        return {"p2p": num_external_tokens} if num_external_tokens > 0 else {}
    if total != num_external_tokens:
        largest = max(sources, key=lambda s: sources[s])
        sources[largest] += num_external_tokens - total
        sources = {s: v for s, v in sources.items() if v > 0}
        if sum(sources.values()) != num_external_tokens:
            return {"p2p": num_external_tokens}
    return sources
