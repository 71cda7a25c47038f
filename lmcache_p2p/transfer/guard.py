"""The guard around every transport's pull: nothing to do, a backed-off or held peer, failures mapped to misses
and to the peer's health, and an answer still arriving at its load's deadline finished in the background.

:class:`GuardedTransport` is the base of the TCP, NIXL and object-store transports (each writes its own
``_pull``); :func:`guarded_pull` is the rule itself (the in-memory transport of ``testing/loopback.py`` uses it
too); a transport raises :class:`Overdue` from its ``_pull`` for an answer that is late but alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from ..aio import remaining
from ..errors import PeerTimeout, SharedConnectionAborted, TransferError
from ..ids import PeerAddress
from ..keys import ChunkKey, FingerprintDigest
from ..tiers.cpu_pool import CpuPool
from .base import MissReason, PullResult, Want, wants_of
from .connection import Connection
from .health import PeerHealth


class Overdue(Exception):
    """Raised inside a pull whose answer is still arriving at its load's deadline: the rest may arrive
    until ``hung_at`` (absolute); then the pull gives up (``give_up``: its requests' remaining frames are
    read and dropped), and the connection is closed if no byte came on it for ``liveness_s``."""

    def __init__(self, conn: Connection, futures: list[asyncio.Future[Any]], give_up: Callable[[], None],
                 allowance_s: float, hung_at: float, liveness_s: float, why: str,
                 reason: MissReason = MissReason.LATE) -> None:
        super().__init__(why)
        self.conn, self.futures, self.give_up = conn, futures, give_up
        self.allowance_s, self.hung_at, self.liveness_s = allowance_s, hung_at, liveness_s
        self.reason = reason  # LATE: still arriving at its deadline; UNANSWERED, STALLED: silent (see MissReason)


async def guarded_pull(
    health: PeerHealth, peer: PeerAddress, keys: Sequence[Want],
    run: Callable[[PullResult], Coroutine[Any, Any, None]],
) -> PullResult:
    """Run ``run(result)`` unless there is nothing to do or the peer is backed off or held; map its
    failures to misses and the peer's health. Never raises TransferError.

    A pull still arriving at its load's deadline (``Overdue``) returns what is in, the rest missed
    ``LATE``, and the rest goes on arriving in the background (``PullResult.late``). Meanwhile the peer
    is held (``PeerHealth.hold``: no new pulls once a grace as long as the pull's allowance has passed
    with no byte from it). If everything arrives, the peer is released, healthy; if not by its liveness
    deadline, the pull gives up on its own requests and the peer is backed off, as for a timeout. Other
    pulls on the connection go on: it is closed (and they fail ``ABORTED``) only if no byte at all came
    on it for the liveness period."""
    result = PullResult(peer)
    if not keys:
        return result
    if not health.available(peer):
        result.miss_rest(keys, MissReason.BACKOFF)
        return result
    try:
        await asyncio.ensure_future(run(result))
    except Overdue as overdue:
        early = result.snapshot()
        early.miss_rest(keys, overdue.reason)
        conn = overdue.conn
        early.progress_at = lambda: conn.last_progress
        token = health.hold(peer, overdue.allowance_s, early.progress_at)
        early.late = asyncio.ensure_future(_finish_late(health, peer, keys, result, overdue, token))
        return early
    except SharedConnectionAborted:
        result.miss_rest(keys, MissReason.ABORTED)
    except PeerTimeout as exc:
        result.miss_rest(keys, MissReason.TIMEOUT)
        health.record_failure(peer, exc)
    except TransferError as exc:
        result.miss_rest(keys, MissReason.PEER_ERROR)
        health.record_failure(peer, exc)
    else:
        health.record_success(peer)
    return result


class GuardedTransport:
    """What every transport's ``pull`` does around its own ``_pull``: the wants, then :func:`guarded_pull`
    (nothing to do, a backed-off peer, failures mapped to misses and to the peer's health)."""

    health: PeerHealth

    async def pull(
        self, peer: PeerAddress, fingerprint: FingerprintDigest, keys: Sequence[ChunkKey | Want], dst: CpuPool,
        deadline: float, silence_s: float | None = None,
    ) -> PullResult:
        self._accepts(dst)
        wants = wants_of(keys)
        return await guarded_pull(self.health, peer, wants, lambda result: self._pull(
            peer, fingerprint, wants, dst, result, deadline, silence_s))

    def _accepts(self, dst: CpuPool) -> None:
        """Raise ``ValueError`` for a pool this transport cannot fill."""

    async def _pull(self, peer: PeerAddress, fp: FingerprintDigest, keys: Sequence[Want], dst: CpuPool,
                    result: PullResult, deadline: float, silence_s: float | None) -> None:
        raise NotImplementedError


async def _finish_late(health: PeerHealth, peer: PeerAddress, keys: Sequence[Want], result: PullResult,
                       overdue: Overdue, token: int) -> PullResult:
    """The rest of an overdue pull: wait for it until the peer's liveness deadline, then settle its health."""
    try:
        _, pending = await asyncio.wait(overdue.futures, timeout=remaining(overdue.hung_at))
        if pending and overdue.conn.closed:  # another pull's overrun closed it and charged the peer
            result.miss_rest(keys, MissReason.ABORTED)
            return result
        if pending:
            _give_up(overdue, peer)
            result.miss_rest(keys, MissReason.TIMEOUT)
            health.record_failure(peer, PeerTimeout(f"{peer}: {overdue} and was not all in by its liveness deadline"))
            return result
        errors = [e for f in overdue.futures if (e := f.exception()) is not None]
        own = [e for e in errors if not isinstance(e, SharedConnectionAborted)]
        if own:
            result.miss_rest(keys, MissReason.PEER_ERROR)
            health.record_failure(peer, own[0])
        elif errors:  # closed by another pull's overrun, which charged the peer
            result.miss_rest(keys, MissReason.ABORTED)
        else:
            health.record_success(peer)
        return result
    finally:
        health.release(peer, token)


def _give_up(overdue: Overdue, peer: PeerAddress) -> None:
    """Stop waiting for an overdue pull. Either way nothing more lands in its slots: its requests are
    abandoned (the rest of their frames is read into scratch and dropped) or the connection is closed."""
    if overdue.conn.last_progress <= overdue.hung_at - overdue.liveness_s:
        # No byte at all for the liveness period: the peer is hung; every pull sharing it fails with it.
        overdue.conn.abort(SharedConnectionAborted(f"{peer}: no byte on this connection for "
                                                   f"{overdue.liveness_s:.1f}s"))
    else:  # the connection is alive (this answer or others' still arriving): only this pull gives up
        overdue.give_up()
