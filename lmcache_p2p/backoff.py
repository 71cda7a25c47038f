"""The pacing rules: one backoff for every retry loop, one token bucket for every rate limit.

    backoff = Backoff(0.05, 2.0)
    while True:
        try:
            ...; backoff.reset(); break
        except SomeError:
            await asyncio.sleep(backoff.next())

Each delay is drawn uniformly from ``[d/2, d]`` where ``d`` doubles from ``first_s`` up to ``max_s``
("equal jitter"): never less than half the nominal wait (a dead dependency is not hammered), and
never in lockstep (after an etcd restart a fleet of nodes spreads its retries, and its republishing,
over the whole interval instead of arriving at once).

    bucket = TokenBucket(rate_per_s=5 / 60, burst=1)    # 5 a minute, one at a time
    if bucket.take():                                   # now, or refused
        ...
    await asyncio.sleep(bucket.wait_s(size)); bucket.take(size)   # paced: bytes a second

A :class:`TokenBucket` holds up to ``burst`` tokens (full at start) and gains ``rate_per_s`` a second; its
rate and burst may change live (a config field), the tokens held then capped at the new burst.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable


def jittered(delay_s: float, rng: Callable[[], float] = random.random) -> float:
    """``delay_s`` with equal jitter: uniform in ``[delay_s / 2, delay_s]``."""
    return delay_s * (0.5 + 0.5 * rng())


def doubling(first_s: float, max_s: float, n: int) -> float:
    """The nominal delay before the ``n``-th retry (from 1): ``first_s`` doubled ``n - 1`` times, at most
    ``max_s``. Raises ValueError unless ``0 <= first_s <= max_s``."""
    if first_s < 0 or max_s < first_s:
        raise ValueError(f"need 0 <= first <= max, got {first_s}, {max_s}")
    return min(max_s, first_s * 2.0 ** min(n - 1, 62))  # past max_s long before; 2.0**1024 would overflow


class Backoff:
    def __init__(self, first_s: float, max_s: float, *, rng: Callable[[], float] = random.random) -> None:
        self._nominal = doubling(first_s, max_s, 1)
        self.first_s = first_s
        self.max_s = max_s
        self._rng = rng

    @property
    def nominal_s(self) -> float:
        """The next delay before jitter."""
        return self._nominal

    def next(self) -> float:
        """The delay to wait now; the next one doubles (up to ``max_s``)."""
        delay = jittered(self._nominal, self._rng)
        self._nominal = min(self._nominal * 2, self.max_s)
        return delay

    def reset(self, first_s: float | None = None) -> None:
        """After a success (or to restart from ``first_s``)."""
        self._nominal = self.first_s if first_s is None else first_s


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s < 0 or burst < 0:
            raise ValueError(f"need rate_per_s >= 0 and burst >= 0, got {rate_per_s}, {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    @property
    def tokens(self) -> float:
        """The tokens held now."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        return self._tokens

    def take(self, n: float = 1.0) -> bool:
        """Take ``n`` tokens if held now; False (nothing taken) otherwise."""
        if self.tokens < n:
            return False
        self._tokens -= n
        return True

    def spend(self, n: float) -> None:
        """Take ``n`` tokens whatever is held (what was used after a check of :attr:`tokens`)."""
        self._tokens = self.tokens - n

    def wait_s(self, n: float = 1.0) -> float:
        """Seconds until ``n`` tokens are held (0: now; inf: never, at rate 0 or past the burst)."""
        missing = n - self.tokens
        if missing <= 0:
            return 0.0
        if self.rate_per_s <= 0 or n > self.burst:
            return math.inf
        return missing / self.rate_per_s
