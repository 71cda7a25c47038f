"""Per-peer backoff: a peer that erred is not asked again until its backoff has passed.

A peer whose answer is overdue (a pull ran past its load's deadline and is still arriving) is held
after a grace period as long as that load's allowance, while no byte has come from it for that long:
not asked by new pulls until that answer arrives (the peer was only slow: available again, its
estimate now knows how slow) or its liveness deadline passes (hung: backed off). So a hung peer costs
the loads of about one deadline, and a healthy peer that is slow, still sending, is not shut out.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Collection

from ..backoff import doubling, jittered
from ..ids import PeerAddress

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _State:
    failures: int = 0
    until: float = 0.0


class PeerHealth:
    """Exponential backoff per peer: ``base_s * 2**(failures-1)``, at most ``max_s``, with equal jitter
    (:func:`~lmcache_p2p.backoff.jittered`: uniform in half to all of it, so requesters that saw a peer
    fail together do not all come back at once). ``rng``: uniform in [0, 1)."""

    def __init__(self, base_s: float, max_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 rng: Callable[[], float] = random.random) -> None:
        doubling(base_s, max_s, 1)  # raises for bounds out of order
        self._base = base_s
        self._max = max_s
        self._clock = clock
        self._rng = rng
        self._peers: dict[PeerAddress, _State] = {}
        # overdue answers: token -> (when the hold starts, its grace, when the peer's bytes last came)
        self._held: dict[PeerAddress, dict[int, tuple[float, float, Callable[[], float] | None]]] = {}
        self._hold_ids = 0

    @property
    def base_s(self) -> float:
        return self._base

    def set_base(self, base_s: float) -> None:
        """A new first backoff (the cluster config changed it); the longest becomes at least as long.
        Peers backed off now keep their deadline."""
        if base_s < 0:
            raise ValueError(f"need base_s >= 0, got {base_s}")
        self._base, self._max = base_s, max(self._max, base_s)

    def available(self, peer: PeerAddress) -> bool:
        holds = self._held.get(peer)
        if holds and any(self._holding(h) for h in list(holds.values())):
            return False
        state = self._peers.get(peer)
        return state is None or self._clock() >= state.until

    def _holding(self, hold: tuple[float, float, Callable[[], float] | None]) -> bool:
        starts, grace_s, progress_at = hold
        now = self._clock()
        return now >= starts and (progress_at is None or now - progress_at() > grace_s)

    def hold(self, peer: PeerAddress, grace_s: float = 0.0, progress_at: Callable[[], float] | None = None) -> int:
        """An answer of ``peer``'s is overdue: no new pulls from ``grace_s`` on, while no byte has come
        from it for ``grace_s`` (``progress_at``: when bytes last came; a peer still sending is slow, not
        hung), until :meth:`release` of the token returned."""
        self._hold_ids += 1
        self._held.setdefault(peer, {})[self._hold_ids] = (self._clock() + grace_s, grace_s, progress_at)
        return self._hold_ids

    def release(self, peer: PeerAddress, token: int) -> None:
        holds = self._held.get(peer)
        if holds is not None:
            holds.pop(token, None)
            if not holds:
                del self._held[peer]

    def failures(self, peer: PeerAddress) -> int:
        state = self._peers.get(peer)
        return 0 if state is None else state.failures

    def reset(self) -> None:
        self._peers.clear()

    def forget_except(self, live: Collection[PeerAddress]) -> None:
        for peer in [p for p in self._peers if p not in live]:
            del self._peers[peer]

    def __len__(self) -> int:
        return len(self._peers)

    def unavailable(self) -> frozenset[str]:
        """The node ids of the peers not asked now, held or backed off (any thread: reads copies)."""
        now = self._clock()
        held = {p.node_id for p, holds in dict(self._held).items()
                if any(self._holding(h) for h in list(holds.values()))}
        return frozenset(held | {p.node_id for p, state in dict(self._peers).items() if now < state.until})

    def backed_off(self) -> int:
        """Peers not available now (any thread: reads a copy)."""
        now = self._clock()
        return sum(1 for state in dict(self._peers).values() if now < state.until)

    def record_success(self, peer: PeerAddress) -> None:
        self._peers.pop(peer, None)

    def record_failure(self, peer: PeerAddress, why: object) -> None:
        state = self._peers.setdefault(peer, _State())
        state.failures += 1
        delay = jittered(doubling(self._base, self._max, state.failures), self._rng)
        state.until = self._clock() + delay
        log.warning("peer %s failed (%s); backing off %.1fs (failure %d)", peer, why, delay, state.failures)
