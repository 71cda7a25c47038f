"""One backoff rule for every retry loop: exponential, capped, with jitter.

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
"""

from __future__ import annotations

import random
from collections.abc import Callable


def jittered(delay_s: float, rng: Callable[[], float] = random.random) -> float:
    """``delay_s`` with equal jitter: uniform in ``[delay_s / 2, delay_s]``."""
    return delay_s * (0.5 + 0.5 * rng())


class Backoff:
    def __init__(self, first_s: float, max_s: float, *, rng: Callable[[], float] = random.random) -> None:
        if first_s < 0 or max_s < first_s:
            raise ValueError(f"need 0 <= first_s <= max_s, got {first_s}, {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self._rng = rng
        self._nominal = first_s

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
