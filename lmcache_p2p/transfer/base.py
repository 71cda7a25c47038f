"""The narrow ``Transport`` seam and the values that cross it.

A pull never raises for a peer's failure: every requested key comes back either *loaded*
(verified, committed into the destination pool) or *missed* with a reason, and the engine
recomputes misses. Only programming errors raise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from ..chunk import ChunkHeader
from ..ids import PeerAddress
from ..keys import ChunkKey, FingerprintDigest, HeadRange
from ..tiers.cpu_pool import CpuPool


@dataclasses.dataclass(frozen=True, slots=True)
class Want:
    """One chunk to pull: ``heads`` a range of its KV heads (the owner sends just those bytes;
    None: whatever it holds); ``store_as`` the pool key the bytes are committed under (a piece of
    a chunk assembled from several owners; None: ``key``)."""

    key: ChunkKey
    heads: HeadRange | None = None
    store_as: ChunkKey | None = None


def wants_of(keys: Sequence[ChunkKey | Want]) -> list[Want]:
    return [k if isinstance(k, Want) else Want(k) for k in keys]


class MissReason(enum.StrEnum):
    ABSENT = "absent"  # the owner does not hold the chunk (evicted since the index said so)
    CHECKSUM = "checksum"  # bytes arrived but did not match the header: never committed
    MAC = "mac"  # bytes or header changed on the way (the session's payload MAC did not match): dropped
    INVALIDATED = "invalidated"  # arrived intact, but a standing invalidation covers it: dropped
    TIMEOUT = "timeout"  # the pull ran past its deadline (the peer is hung or gone: backed off)
    LATE = "late"  # not in by the load's deadline, still arriving: the engine recomputes it, the pool keeps it
    # the owner sent nothing (no ack of the get, no byte) for about a round trip: not serving now (stopped,
    # its host dropping packets); the engine recomputes at once, whatever arrives later the pool keeps
    UNANSWERED = "unanswered"
    # the owner's answer stopped mid-way (acknowledged, some bytes, then none for as long as a silent owner
    # is allowed: stopped or cut off while sending); recomputed at once like UNANSWERED, the rest kept if it comes
    STALLED = "stalled"
    ABORTED = "aborted"  # cut short with its shared connection: no byte came on it for the liveness period
    PEER_ERROR = "peer_error"  # connection refused/lost, handshake or protocol failure
    BACKOFF = "backoff"  # the peer erred recently; not asked
    CAPACITY = "capacity"  # no free slot in the destination pool
    # the load's deadline had passed when its pull was to start (the agent's loop, starved, reached it late):
    # nothing asked, the engine computes it (counted with transport "none": no transport was chosen)
    EXPIRED = "expired"


# An owner not serving now (stopped, cut off): its load recomputes at once, not at its deadline.
SILENT = frozenset({MissReason.UNANSWERED, MissReason.STALLED})


@dataclasses.dataclass(slots=True)
class PullResult:
    peer: PeerAddress
    loaded: dict[ChunkKey, ChunkHeader] = dataclasses.field(default_factory=dict)
    missed: dict[ChunkKey, MissReason] = dataclasses.field(default_factory=dict)
    # Seconds of the pull spent getting a connection (connect and handshake on first use, or waiting
    # for another pull's): a one-off cost, kept out of the peer's estimates (``estimates.py``).
    setup_s: float = 0.0
    # Set when keys missed ``LATE``: the rest of the pull, still running, resolves to its whole result
    # (``complete`` once every key arrived; ``TIMEOUT`` for the rest if the peer never answered).
    late: asyncio.Future[PullResult] | None = None
    progress_at: Callable[[], float] | None = None  # with ``late``: when bytes last arrived from the peer

    def snapshot(self) -> PullResult:
        """What has arrived and missed so far (the pull may still be filling this one in)."""
        return PullResult(self.peer, dict(self.loaded), dict(self.missed), self.setup_s)

    def miss_rest(self, keys: Sequence[ChunkKey | Want], reason: MissReason) -> None:
        """Mark every key that is neither loaded nor missed yet as missed with ``reason``."""
        for key in (w.key for w in wants_of(keys)):
            if key not in self.loaded and key not in self.missed:
                self.missed[key] = reason

    @property
    def complete(self) -> bool:
        return not self.missed


class Transport(Protocol):
    """Client side of one transport. Implementations: ``TcpTransport``, ``NixlTransport``."""

    name: str

    async def pull(
        self,
        peer: PeerAddress,
        fingerprint: FingerprintDigest,
        keys: Sequence[ChunkKey | Want],
        dst: CpuPool,
        deadline: float,
        silence_s: float | None = None,
    ) -> PullResult:
        """Pull ``keys`` into ``dst``; ``deadline`` is absolute (``time.monotonic()``): what has not
        landed by then is missed, ``TIMEOUT`` (the peer is backed off) or, where the transport lets a
        slow answer finish, ``LATE`` (see ``PullResult.late``). ``silence_s``: an owner that acknowledges
        requests and stays silent longer than this (never less than its round trips allow) is taken for
        not serving, ``UNANSWERED`` (see ``client.silence_allowed``; None: a third of the allowance)."""

    def forget_except(self, live: Collection[PeerAddress]) -> None:
        """Drop every per-peer state (connections, remote registrations) of peers not in ``live``."""

    async def close(self) -> None: ...
