"""Which requests are canaries (scheduler side): computed by the engine in full, their chunks then held
against every owner's copy by the worker (``canary.py``).

A request is a canary when its client asks (``kv_transfer_params: {"lmcache_p2p_canary": true}``), within
``canary.requested_per_minute`` per engine (a token bucket with a burst of a sixth of that, at least one:
an ask beyond it is served as any request, and counted as a refused parameter), or when it has a hit and
is drawn at ``canary.rate``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from ...backoff import TokenBucket
from ...config import CanaryConfig


class CanarySampling:
    def __init__(self, config: CanaryConfig, *, rng: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = config.rate
        self._random = rng if rng is not None else random.Random().random
        per_s = config.requested_per_minute / 60.0
        self._asked = TokenBucket(per_s, max(1.0, config.requested_per_minute / 6.0) if per_s > 0 else 0.0,
                                  clock=clock)

    def sampled(self, asked: bool, hit: int) -> tuple[bool, bool]:
        """Whether a request is a canary, and whether its ask was refused (over the asks' budget): asked
        within the budget, or drawn at ``canary.rate`` among requests with a hit."""
        refused = asked and not self._asked.take()
        if asked and not refused:
            return True, False
        return hit > 0 and self._rate > 0 and self._random() < self._rate, refused
