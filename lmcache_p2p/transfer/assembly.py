"""A chunk assembled from pieces: head ranges of one chunk pulled from several owners (the ranks of a
tensor-parallel engine) are concatenated into one slot under the chunk's key, and each piece is checked
again in the copy (``Puller.assemble`` pins the pieces and commits the result).

Pieces fit together only when they hold the same tokens at the same bytes per head, within one slot, and
were computed by one engine (one origin: a chunk of several would name nobody, and the canary and
``invalidate --node`` would have nobody to hold to it)."""

from __future__ import annotations

import logging

from ..chunk import ChunkHeader, make_header, verify
from ..errors import ChunkError
from ..keys import FingerprintDigest
from ..metrics import AgentMetrics
from ..plan import PlannedChunk
from ..tiers.cpu_pool import CpuPool, Pin

log = logging.getLogger(__name__)


def fit(chunk: PlannedChunk, pieces: list[Pin], slot_bytes: int, metrics: AgentMetrics) -> bool:
    """Whether ``pieces`` make one chunk (logged, and counted when of several engines, where not)."""
    per_head = {p.header.length // (p.header.heads[1] - p.header.heads[0]) for p in pieces}
    total = sum(p.header.length for p in pieces)
    if len(per_head) != 1 or len({p.header.num_tokens for p in pieces}) != 1 or total > slot_bytes:
        log.warning("pieces of chunk %s do not fit together; recomputed", chunk.key.hex()[:16])
        return False
    if len({p.header.origin for p in pieces}) != 1:
        log.warning("pieces of chunk %s were computed by different engines; recomputed", chunk.key.hex()[:16])
        metrics.mixed_origin_chunks.inc()
        return False
    return True


def fill(pool: CpuPool, fp: FingerprintDigest, chunk: PlannedChunk, pieces: list[Pin], view: memoryview,
         metrics: AgentMetrics) -> ChunkHeader | None:
    """Copy ``pieces`` into ``view`` and return the chunk's header, or None if a piece's copy does not match
    that piece's checksum (changed in memory since it was committed; counted).

    The new checksum is computed over the copy *before* the copy is checked against the pieces' own: a byte
    changed before that check fails it, and one changed after it (the reservation is registered memory too)
    no longer matches the new checksum, which every later reader checks. Either way no changed byte is
    vouched for."""
    starts, offset = [], 0
    for piece in pieces:
        n = piece.header.length
        view[offset : offset + n] = pool.slot_view(piece.slot, n)
        starts.append(offset)
        offset += n
    try:
        header = make_header(chunk.key, fp, view[:offset], pieces[0].header.num_tokens,
                             min(p.header.epoch for p in pieces), heads=chunk.heads, origin=pieces[0].header.origin)
    except ChunkError as exc:
        log.warning("pieces of chunk %s do not make a chunk (%s); recomputed", chunk.key.hex()[:16], exc)
        return None
    bad = 0
    for piece, start in zip(pieces, starts, strict=True):
        try:
            verify(piece.header, view[start : start + piece.header.length])
        except ChunkError as exc:
            bad += 1
            log.error("piece %s of chunk %s changed in memory after it was committed; dropped: %s",
                      piece.header.heads, chunk.key.hex()[:16], exc)
    metrics.checksum_failures.inc(bad)
    return None if bad else header
