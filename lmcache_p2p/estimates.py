"""Running estimates the fetch-or-recompute planner decides by: each peer's pull latency and
bandwidth, and this engine's own prefill rate.

    expected pull time (peer, n bytes)  = max(latency(peer), n * seconds_per_byte(peer))
    recompute time (t tokens)           = t / prefill_tokens_per_s

``latency`` is learned from small pulls, ``seconds_per_byte`` from large ones (their whole time,
fixed costs included, so pulls of the usual size predict each other well; but not the time a pull spent
getting its connection: a first contact's connect and handshake are paid once per connection).

Both are exponentially weighted moving averages of what this node measured itself; a peer never
measured starts from deliberately modest priors, so the first pull from it gets a generous but
bounded deadline. A peer measured slower than the priors fades back towards them while nothing new
is measured (half-life ``FADE_HALF_LIFE_S``): a peer measured slower than recomputing is no longer
asked, so without fading one slow pull (a load spike on either host) would keep it out of every
plan for good; once its estimate has faded below the recompute time it is asked again and measured
anew. A peer measured faster than the priors keeps its estimate (fading it towards slower priors
could push it past a fast engine's recompute time, after which it would never be measured again).
Each peer also keeps how far its pulls land from what was expected of them (``deviation_s``: an
exponentially weighted mean of |measured - expected|, as TCP keeps its round-trip variation): a
pull's deadline allows ``DEVIATION_FACTOR`` of it beyond the expectation, so a peer whose answers
come late by a scheduling delay now and then (a busy host) gets the margin it needs, up to the
recompute time, while a steady one keeps a tight deadline. It fades towards zero like a slow estimate.
Thread-safe: pulls are measured on the agent's loop, prefill steps on the engine's thread, plans
are made on the load worker.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

ALPHA = 0.3  # weight of the newest observation
BETA = 0.25  # weight of the newest observation's error in the deviation (TCP's RTTVAR gain)
PRIOR_LATENCY_S = 0.005
PRIOR_SECONDS_PER_BYTE = 1 / 500e6  # loopback TCP measured 3 GB/s here; a peer unknown yet gets less credit
SMALL_PULL_BYTES = 256 << 10  # pulls below this mostly measure latency
MIN_PREFILL_TOKENS = 128  # engine steps with fewer scheduled tokens are decode steps: not a prefill rate
FADE_HALF_LIFE_S = 10.0  # a peer's measured estimate counts half as much after this long without a new one


@dataclasses.dataclass(slots=True)
class _Peer:
    latency_s: float = PRIOR_LATENCY_S
    seconds_per_byte: float = PRIOR_SECONDS_PER_BYTE
    small: int = 0
    large: int = 0
    measured_at: float = 0.0  # clock time of the newest observation
    deviation_s: float = 0.0  # mean |measured - expected| of its pulls (EWMA)


class PeerEstimates:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._clock = clock

    def observe(self, peer: str, nbytes: int, seconds: float) -> None:
        """A pull of ``nbytes`` from ``peer`` that completed in ``seconds``."""
        if seconds <= 0:
            return
        with self._lock:
            p = self._peers.setdefault(peer, _Peer())
            if p.small + p.large:  # how far it landed from what was expected of it (nothing was, before)
                latency, per_byte = self._faded(p)
                error = abs(seconds - max(latency, nbytes * per_byte))
                p.deviation_s = (1 - BETA) * self._faded_deviation(p) + BETA * error
            p.latency_s, p.seconds_per_byte = self._faded(p)  # the new sample blends with what is believed now
            p.measured_at = self._clock()
            if nbytes < SMALL_PULL_BYTES:
                p.latency_s = _ewma(p.latency_s, seconds, p.small)
                p.small += 1
            else:
                p.seconds_per_byte = _ewma(p.seconds_per_byte, seconds / nbytes, p.large)
                p.large += 1

    def known(self, peer: str) -> bool:
        """Whether a pull from ``peer`` has been measured (else :meth:`expected_s` is a prior)."""
        with self._lock:
            p = self._peers.get(peer)
            return p is not None and p.small + p.large > 0

    def expected_s(self, peer: str, nbytes: int) -> float:
        with self._lock:
            latency, per_byte = self._faded(self._peers.get(peer) or _Peer())
            return max(latency, nbytes * per_byte)

    def deviation_s(self, peer: str) -> float:
        """How far ``peer``'s pulls typically land from their expected time (0 until two are measured)."""
        with self._lock:
            p = self._peers.get(peer)
            return 0.0 if p is None else self._faded_deviation(p)

    def _faded_deviation(self, p: _Peer) -> float:
        return p.deviation_s * 0.5 ** (max(self._clock() - p.measured_at, 0.0) / FADE_HALF_LIFE_S)

    def _faded(self, p: _Peer) -> tuple[float, float]:
        """``p``'s latency and seconds per byte; each, when worse than its prior, faded towards it since
        ``p`` was last measured."""
        if p.small + p.large == 0:
            return p.latency_s, p.seconds_per_byte
        weight = 0.5 ** (max(self._clock() - p.measured_at, 0.0) / FADE_HALF_LIFE_S)

        def fade(measured: float, prior: float) -> float:
            return measured if measured <= prior else weight * measured + (1 - weight) * prior

        return fade(p.latency_s, PRIOR_LATENCY_S), fade(p.seconds_per_byte, PRIOR_SECONDS_PER_BYTE)

    def snapshot(self) -> dict[str, tuple[float, float, int]]:
        """peer -> (latency s, bandwidth B/s, samples)."""
        with self._lock:
            return {k: (p.latency_s, 1 / p.seconds_per_byte, p.small + p.large) for k, p in self._peers.items()}


class PrefillRate:
    """Tokens per second this engine computes in prefill-heavy steps (None until measured)."""

    def __init__(self, initial_tokens_per_s: float | None = None) -> None:
        self._lock = threading.Lock()
        self._rate = initial_tokens_per_s
        self.samples = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        with self._lock:
            rate = tokens / seconds
            self._rate = rate if self._rate is None else _ewma(self._rate, rate, self.samples)
            self.samples += 1

    @property
    def tokens_per_s(self) -> float | None:
        return self._rate

    def recompute_s(self, tokens: int) -> float | None:
        rate = self._rate
        return None if rate is None else tokens / rate


def _ewma(old: float, new: float, samples: int) -> float:
    return new if samples == 0 else (1 - ALPHA) * old + ALPHA * new
