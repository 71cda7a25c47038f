"""What the fetch-or-recompute planner (``plan.py``) believes now, as gauges refreshed on each scrape: how many
peers are backed off, the expected time of a chunk's pull from each of the slowest peers (at most
``PER_PEER_SERIES`` series, so a fleet's churn never grows them), and what recomputing a chunk costs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from .estimates import PeerEstimates, PrefillRate
from .metrics import PER_PEER_SERIES, AgentMetrics


class PlannerGauges:
    def __init__(self, metrics: AgentMetrics, estimates: PeerEstimates, prefill: PrefillRate, *, chunk_bytes: int,
                 chunk_size: int, backed_off: Callable[[], int]) -> None:
        self._metrics, self._estimates, self._prefill = metrics, estimates, prefill
        self._chunk_bytes, self._chunk_size = chunk_bytes, chunk_size
        self._backed_off = backed_off  # peers backed off now (the transfer stack's health)
        self._shown: set[str] = set()  # peers with a pull_expected_seconds series now

    def refresh(self) -> None:
        m = self._metrics
        m.peers_backed_off.set(self._backed_off())
        expected = {p: self._estimates.expected_s(p, self._chunk_bytes) for p in self._estimates.snapshot()}
        shown = set(sorted(expected, key=lambda p: expected[p], reverse=True)[:PER_PEER_SERIES])
        for peer in self._shown - shown:  # bounded: the slowest peers only
            with contextlib.suppress(KeyError):
                m.pull_expected.remove(peer)
        for peer in shown:
            m.pull_expected.labels(peer).set(expected[peer])
        self._shown = shown
        m.recompute_chunk.set(self._prefill.recompute_s(self._chunk_size) or 0.0)
