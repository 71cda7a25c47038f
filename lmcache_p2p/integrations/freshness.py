"""Read your writes: a request that names an index revision waits, bounded, for the mirror to reach it.

A router that saw a prompt's chunks announced at etcd revision R (the entries' ``mod_revision``)
passes ``kv_transfer_params: {"lmcache_p2p_index_revision": R}``. The scheduler side asks
:meth:`Freshness.hold` before it counts a hit that is not the whole prompt: while its mirror has not
followed the block entries to R, the request is not scheduled yet (vLLM asks again next step), for at
most ``wait_s``; then it is planned with what the mirror holds. No vLLM import: unit-testable anywhere.

Disaggregated prefill: the router sends the decode engine ``{"lmcache_p2p_expect_chunks": N}`` after a
prefill engine answered the prompt. The prefill engine's saves reach etcd a moment later; until the
index shows the prompt's first N chunks held somewhere, the request waits the same way (bounded by
``wait_s``), so the decode engine loads them instead of computing what was just computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..request_params import RequestParams

log = logging.getLogger(__name__)
FRESHNESS_WAIT_S = 2.0  # at most, per request, for the mirror to reach a revision the request names


class Freshness:
    """Which requests wait for the mirror to reach the index revision they name, and since when."""

    def __init__(self, wait_s: float = FRESHNESS_WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.wait_s = wait_s
        self._clock = clock
        self._since: dict[str, float] = {}  # request -> when it was first held back
        self._expired: set[str] = set()  # held back for wait_s already: never again
        self.held = self.gave_up = 0  # requests held back at least once; of those, planned after wait_s

    def hold(self, req_id: str, params: RequestParams, revision: int, following: bool, held: int = 0) -> bool:
        """Whether ``req_id`` waits: its ``params`` name an index revision above ``revision`` (how far the
        mirror has followed the block entries) or expect more leading chunks than the ``held`` ones, the
        mirror is following etcd, and the request has waited less than ``wait_s``."""
        wanted, expected = params.index_revision, params.expect_chunks
        behind = (wanted and revision < wanted) or (expected and held < expected)
        if not behind or not following or req_id in self._expired:
            return False
        now = self._clock()
        if req_id not in self._since:
            self._since[req_id] = now
            self.held += 1
        since = self._since[req_id]
        if now - since < self.wait_s:
            return True
        del self._since[req_id]
        self._expired.add(req_id)
        self.gave_up += 1
        log.info("request %s: the index mirror did not reach revision %d or %d leading chunks in %.1f s (at %d, "
                 "%d chunks); planned with what it holds", req_id, wanted, expected, self.wait_s, revision, held)
        return False

    def forget(self, req_id: str) -> None:
        """``req_id`` finished (or was aborted): nothing of it is kept."""
        self._since.pop(req_id, None)
        self._expired.discard(req_id)

    def __len__(self) -> int:
        return len(self._since) + len(self._expired)
