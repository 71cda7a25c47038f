"""Running estimates the fetch-or-recompute planner decides by: each peer's pull latency and
bandwidth, and this engine's own prefill rate.

    expected pull time (peer, n bytes)  = max(latency(peer), n * seconds_per_byte(peer))
    recompute time (t tokens)           = overhead + t * per_token (what a prefill step of t tokens takes)

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
# Each prefill step's weight in the step-cost fit relative to the next one's: the newest weighs most, a
# step 4 back about half (an engine's steps drift with its load and its batches' contexts)
STEP_FORGET = 0.85
# Step sizes whose spread (coefficient of variation) is below this cannot tell a step's fixed cost from its
# cost per token: the steps' moving-average rate is used instead
MIN_STEP_SPREAD = 0.2
MIN_FIT_STEPS = 4  # ... nor can fewer steps than this (a joining engine's first steps: one rate until then)
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
    """What this engine's prefill steps cost: a step of ``t`` scheduled tokens takes ``overhead + t *
    per_token``, fitted by least squares over the prefill steps measured (``observe``), each weighted
    ``STEP_FORGET`` to the power of its age. One rate (``t / tokens_per_s``) charged a step's fixed cost
    (its launch, its decode rows, the sampler) to every token: on an engine that computes little, where
    steps of 2,000 tokens and of 150 alternate, steps took 0.35x-2.39x of what it predicted. Until steps of
    different sizes were seen (``MIN_STEP_SPREAD``), or when noise makes the fit's overhead negative or its
    cost per token not positive, or while fewer than ``MIN_FIT_STEPS`` were measured (two points fit any
    line: a joining engine's first steps), it is one rate, the moving average of the steps' rates (what the
    planner had before). None until measured."""

    def __init__(self, initial_tokens_per_s: float | None = None) -> None:
        self._lock = threading.Lock()
        # the weighted sums of the fit: weight, tokens, seconds, tokens^2, tokens x seconds
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._rate = initial_tokens_per_s  # the single rate, when no line is fitted (tokens/s, an EWMA)
        self._fit: tuple[float, float] | None = (0.0, 1 / initial_tokens_per_s) if initial_tokens_per_s else None
        self.samples = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        with self._lock:
            f = STEP_FORGET
            self._w = f * self._w + 1.0
            self._x = f * self._x + tokens
            self._y = f * self._y + seconds
            self._xx = f * self._xx + tokens * tokens
            self._xy = f * self._xy + tokens * seconds
            rate = tokens / seconds
            self._rate = rate if self._rate is None else _ewma(self._rate, rate, self.samples)
            self.samples += 1
            self._fit = self._solve()

    def _solve(self) -> tuple[float, float]:
        """(overhead s, seconds per token) from the weighted sums."""
        mean_x, mean_y = self._x / self._w, self._y / self._w
        assert self._rate is not None  # observed
        # the rates' moving average, not a least-squares line through the origin: that one is ruled by the
        # largest steps (an engine that ran a huge step fast once would be taken for fast long after)
        one_rate = (0.0, 1 / self._rate)
        var_x = max(self._xx / self._w - mean_x * mean_x, 0.0)
        if self.samples < MIN_FIT_STEPS or var_x < (MIN_STEP_SPREAD * mean_x) ** 2:
            return one_rate
        per_token = (self._xy / self._w - mean_x * mean_y) / var_x
        overhead = mean_y - per_token * mean_x
        if overhead < 0 or per_token <= 0:
            return one_rate
        return overhead, per_token

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens a second computing adds at the margin (None until measured)."""
        fit = self._fit
        return None if fit is None else 1 / fit[1]

    @property
    def overhead_s(self) -> float | None:
        """A prefill step's fixed cost, beside its tokens (None until measured)."""
        fit = self._fit
        return None if fit is None else fit[0]

    def recompute_s(self, tokens: int) -> float | None:
        """What a prefill step of ``tokens`` takes, its fixed cost included: what recomputing them costs a
        request, and what a pull of them is weighed against (a pull spares the tokens, and its asynchronous
        load costs the request a step's round of its own: charging only the tokens' own cost, the planner
        of a joining engine that had measured 2-5 steps declined 10 of 73 pulls as slower than recomputing)."""
        fit = self._fit
        return None if fit is None else fit[0] + tokens * fit[1]


def _ewma(old: float, new: float, samples: int) -> float:
    return new if samples == 0 else (1 - ALPHA) * old + ALPHA * new
