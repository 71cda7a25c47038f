"""Hit plans: which leading chunks of a prompt can be had, and from whom.

    prompt:  | c0 local | c1 local | c2 peer B | c3 peer C | c4 nobody | c5 ...
    plan:    [c0, c1, c2, c3]          hit = end of c3; everything after is recomputed

A plan covers the longest run of *leading* chunks that are available, because a chunk's KV is
only usable when every earlier token's KV is present. A prompt's partial tail chunk can only be
the last chunk of a plan. Owner choice per chunk: the local store first, then the peer with the
fewest pulls in flight (counting those this plan already gives it), faster tier first.

Chunks are head-major (``chunk.py``), and a node holds the KV heads its engine has (all of them,
or a tensor-parallel rank's range). A chunk is available when this node's heads ``need`` are
covered: by one peer holding them all (it sends just that range), else by pieces from several
peers (the ranks of a TP engine, each sending its part)::

    need [0, 4):   peer A holds [0, 4)             -> one pull of [0, 4) from A
    need [2, 4):   peer A holds [0, 4)             -> one pull of [2, 4) from A (a byte range)
    need [0, 4):   B-r0 holds [0, 2), B-r1 [2, 4)  -> pieces [0, 2) from B-r0 and [2, 4) from B-r1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from .ids import TIER_OBJECT, NodeId, engine_of
from .keys import ChunkKey, HeadRange, piece_key

if TYPE_CHECKING:
    from .index.schema import NodeRecord

SLOW_TIER = TIER_OBJECT  # owners in this tier or slower are chosen only when no faster one holds the chunk
LOCAL = NodeId("")
"""The source of a chunk held by the local store."""


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """Heads ``heads`` of a chunk, pulled from ``source`` (else from one of ``alternatives``)."""

    source: NodeId
    heads: HeadRange
    alternatives: tuple[NodeId, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedChunk:
    index: int
    key: ChunkKey
    start: int
    end: int
    source: NodeId  # LOCAL or the chosen peer (the first piece's, when assembled from pieces)
    alternatives: tuple[NodeId, ...] = ()  # other peers holding it, tried if the source fails
    heads: HeadRange = (0, 1)  # the heads this node needs (and pulls from ``source``)
    pieces: tuple[Piece, ...] = ()  # set when no one peer holds all of ``heads``
    # folded into its pieces' pool keys: a canary's copy of one owner lands under its own key, so a pull of
    # another owner's copy that lands late never passes for this one
    nonce: bytes = b""

    def parts(self) -> tuple[Piece, ...]:
        """What to pull: the pieces, or the whole range from the source."""
        return self.pieces or (Piece(self.source, self.heads, self.alternatives),)

    def piece_key(self, heads: HeadRange) -> ChunkKey:
        """Where its piece of ``heads`` lands in the pool until the chunk is assembled."""
        return piece_key(self.key, heads, self.nonce)


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


def miss_reason(owners: Mapping[NodeId, int], nodes: Mapping[NodeId, NodeRecord], *, me: NodeId, fp_hex: str,
                model_id: str, blocked: Callable[[NodeId], bool], remembered: bool) -> str:
    """Why a chunk that is not planned is missed (``miss_tokens_total``'s reasons; dict probes only):
    ``owners`` announce it (``me`` not among them), ``nodes`` are the records in the mirror, ``blocked``
    says whether the canary quarantined a node, ``remembered``: this engine saved the chunk before.
    ``lookup --explain`` says more of one prompt (an invalidation, an owner that does not answer)."""
    others = [n for n in owners if n != me]
    if others:
        return "quarantined" if all(blocked(n) for n in others) else "owner_unusable"
    if remembered:
        return "evicted"
    peers = [r for n, r in nodes.items() if n != me]
    if peers and not any(fp_hex in r.fingerprints for r in peers) and any(
            s.model == model_id for r in peers for s in r.served.values()):
        return "other_identity"
    return "no_owner"


def make_plan(
    keys: Sequence[ChunkKey],
    spans: Sequence[tuple[int, int]],
    *,
    local: Callable[[ChunkKey], bool],
    owners: Callable[[Sequence[ChunkKey]], Sequence[Mapping[NodeId, int]]],
    usable: Callable[[NodeId], bool],
    inflight: Mapping[NodeId, int],
    num_tokens: int,
    need: HeadRange = (0, 1),
    heads_of: Callable[[NodeId], HeadRange] | None = None,
) -> HitPlan:
    """Plan the longest run of available leading chunks.

    ``owners(keys)`` gives, per key, the peers holding it with their tier byte (lower is
    faster); ``usable(peer)`` is False for peers backed off after errors or unknown;
    ``heads_of(peer)`` the KV heads it holds (default: all of ``need``).
    """
    remote = owners(keys)
    load = dict(inflight)
    chunks: list[PlannedChunk] = []
    for i, (key, (start, end)) in enumerate(zip(keys, spans, strict=True)):
        if local(key):
            chunks.append(PlannedChunk(i, key, start, end, LOCAL, heads=need))
            continue
        held = {n: (heads_of(n) if heads_of is not None else need, tier)
                for n, tier in remote[i].items() if usable(n)}
        # The object store (tier byte 3 and above: no pulls in flight are ever counted for it) only when
        # no peer holds the chunk; peers by load, then tier.
        whole = sorted((tier >= SLOW_TIER, load.get(n, 0), tier, n) for n, (h, tier) in held.items()
                       if h[0] <= need[0] and need[1] <= h[1])
        if whole:
            best = whole[0][3]
            load[best] = load.get(best, 0) + 1
            chunks.append(PlannedChunk(i, key, start, end, best, tuple(c[3] for c in whole[1:]), heads=need))
            continue
        pieces = _cover(need, held, load)
        if pieces is None:
            break
        chunks.append(PlannedChunk(i, key, start, end, pieces[0].source, heads=need, pieces=pieces))
    return HitPlan(num_tokens, tuple(chunks))


def _cover(need: HeadRange, held: Mapping[NodeId, tuple[HeadRange, int]],
           load: dict[NodeId, int]) -> tuple[Piece, ...] | None:
    """``need`` from pieces of several peers' ranges (greedy: at each head, the peer reaching
    furthest, then one of the first piece's engine, then the least loaded); None when some head is
    held by no usable peer. (Pieces computed by different engines are never assembled: pull.py.)"""
    pieces: list[Piece] = []
    pos = need[0]
    while pos < need[1]:
        engine = engine_of(pieces[0].source) if pieces else None
        at = [(-min(h[1], need[1]), engine is not None and engine_of(n) != engine, load.get(n, 0), tier, n)
              for n, (h, tier) in held.items() if h[0] <= pos < h[1]]
        if not at:
            return None
        at.sort()
        end, best = -at[0][0], at[0][-1]
        same = tuple(c[-1] for c in at[1:] if -c[0] == end)  # others holding this very piece
        load[best] = load.get(best, 0) + 1
        pieces.append(Piece(best, (pos, end), same))
        pos = end
    return tuple(pieces)


DEADLINE_FACTOR = 3.0  # a pull may take this many times its expected time before it is abandoned
DEADLINE_SLACK_S = 0.005  # ... and at least this much more than expected (scheduling noise)
DEVIATION_FACTOR = 4.0  # ... and this many of the peer's deviations (estimates.py) more than expected
FIRST_CONTACT_S = 1.0  # a pull from a peer never measured gets at least this (it connects and handshakes too)
# A load waits on a measured owner that acknowledges nothing (stopped, unreachable) for at most a 40th of
# what recomputing its chunks costs, never less than the owner's own round trips allow (at least 10 ms: see
# ``transfer.client.silence_allowed``): a hung owner costs the engine about a miss (the rest is vLLM's
# round for the failed load, a step or two). An owner that is merely busy acknowledges sooner (10-17 ms
# beside a CPU hog, where recomputes take longer too); one that does not costs one recompute, and what it
# sends later still lands in the pool. A peer never measured is not cut short so (see ``fetch_budget``).
SILENCE_SHARE = 40.0


@dataclasses.dataclass(frozen=True, slots=True)
class FetchBudget:
    """A plan cut to the pulls that beat recomputing, and the deadline those pulls get."""

    plan: HitPlan
    deadline_s: float
    expected_s: float  # expected time of the pulls kept (0 when all local)
    recompute_s: float | None  # engine time for the tokens pulled (None: prefill rate unknown)
    late: int = 0  # chunks declined only because their pulls were not expected to finish in ``left_s``
    # The estimates at the first chunk declined as slower than recomputing (what the choice was made by)
    declined_at: tuple[float, float] | None = None  # (expected pull s, recompute s)
    # How long an owner may acknowledge nothing before the pulls give up on it (None: only the transport's
    # own rule, a third of the allowance: see ``transfer.client.silence_allowed``)
    silence_s: float | None = None


def fetch_budget(
    plan: HitPlan,
    *,
    chunk_bytes: Callable[[PlannedChunk], int],
    expected_s: Callable[[NodeId, int], float],
    recompute_s: Callable[[int], float | None],
    max_s: float,
    known: Callable[[NodeId], bool] = lambda _peer: True,
    deviation_s: Callable[[NodeId], float] = lambda _peer: 0.0,
    left_s: float | None = None,
    first_contact_s: float = FIRST_CONTACT_S,
) -> FetchBudget:
    """Keep the longest prefix of ``plan`` whose pulls are expected to finish before the engine
    could recompute the tokens they carry; give them a deadline from that expectation.

    Pulls from different peers run in parallel, one peer's chunks one after another::

        chunks:   c0 local | c1 peer A | c2 peer B | c3 peer A | c4 peer A
        expected: 0          A: 1 chunk  max(A1, B1)  A: 2 chunks  A: 3 chunks
        recompute of the pulled tokens (c1..ck) at this engine's measured prefill rate
        keep c0..ck for the largest k with expected <= recompute

    Without a prefill rate (an agent outside an engine, or an engine before its first step) every
    pull is kept and gets ``max_s``: nothing is known to be faster than waiting for it. A pull from
    a peer never measured (``known`` false: its first pull also pays for the connection and
    handshake, and a guess is no basis for a tight deadline) gets the recompute time but at least
    ``first_contact_s`` (``transfer.first_contact_s``): a hung peer costs at most that once, then it
    is backed off and measured peers get deadlines from their estimates. Its silence is not cut to a
    share of the recompute time either (``silence_s`` None): one ack seen late on a first contact (a TP
    rank of a loaded 2-core host not scheduled for a while) would otherwise turn a whole peer hit into a
    recompute, and a hung peer costs at most a third of ``first_contact_s`` once.

    A measured peer that acknowledges nothing is given up on after ``SILENCE_SHARE``-th of the recompute
    time (``silence_s``; at least its own ack timeout).

    A measured peer's pulls get ``DEADLINE_FACTOR`` times their expected time, at least
    ``DEADLINE_SLACK_S`` and ``DEVIATION_FACTOR`` of the peer's deviation (``deviation_s``: how far its
    pulls land from their expectation) beyond it, and never more than the recompute time (nor
    ``max_s``): past that, waiting costs more than recomputing would have.

    ``left_s``: the time left before the load's own deadline (it may have queued behind other loads).
    A pull not expected to finish in it is not started (the engine would recompute the chunks anyway,
    and the peer would be held while an answer nobody waits for arrives); those chunks are counted
    apart (``late``).
    """
    per_peer: dict[NodeId, int] = {}
    first_remote: int | None = None
    keep, kept_expected, kept_recompute = 0, 0.0, None
    worth = 0  # the cut without left_s
    declined_at: tuple[float, float] | None = None
    for i, chunk in enumerate(plan.chunks):
        if chunk.source == LOCAL:
            if first_remote is None:
                keep = worth = i + 1
            continue
        if first_remote is None:
            first_remote = chunk.start
        width = chunk.heads[1] - chunk.heads[0]
        for part in chunk.parts():  # pieces in parallel from their peers, each a share of the bytes
            share = chunk_bytes(chunk) * (part.heads[1] - part.heads[0]) // width
            per_peer[part.source] = per_peer.get(part.source, 0) + share
        expected = max(expected_s(peer, nbytes) for peer, nbytes in per_peer.items())
        recompute = recompute_s(chunk.end - first_remote)
        if recompute is None or expected <= recompute:
            worth = i + 1
            if left_s is None or expected <= left_s:
                keep, kept_expected, kept_recompute = i + 1, expected, recompute
        elif declined_at is None:
            declined_at = (expected, recompute)
    if first_remote is not None:
        # Local chunks after the last pull worth making are only usable if that pull is kept.
        keep, worth = _with_local_tail(plan, keep), _with_local_tail(plan, worth)
    late = max(0, worth - keep)
    if worth == len(plan.chunks):
        declined_at = None  # a later chunk beat recomputing after all: nothing was declined as slower
    kept = HitPlan(plan.num_tokens, plan.chunks[:keep])
    sources = {p.source for c in kept.chunks if c.source != LOCAL for p in c.parts()}
    if sources and kept_recompute is None:  # nothing known to be faster: the pulls get the whole allowance
        return FetchBudget(kept, max_s, kept_expected, kept_recompute, late, declined_at)
    if kept_recompute is not None and not all(known(source) for source in sources):
        return FetchBudget(kept, min(max_s, max(kept_recompute, first_contact_s)), kept_expected, kept_recompute,
                           late, declined_at)
    spread = DEVIATION_FACTOR * max(deviation_s(source) for source in sources) if sources else 0.0
    deadline = min(max_s, max(DEADLINE_FACTOR * kept_expected, kept_expected + max(DEADLINE_SLACK_S, spread)))
    silence_s = None
    if kept_recompute is not None:
        deadline = min(deadline, max(kept_recompute, kept_expected))
        silence_s = kept_recompute / SILENCE_SHARE
    return FetchBudget(kept, deadline, kept_expected, kept_recompute, late, declined_at, silence_s)


def _with_local_tail(plan: HitPlan, keep: int) -> int:
    while keep < len(plan.chunks) and plan.chunks[keep].source == LOCAL:
        keep += 1
    return keep
