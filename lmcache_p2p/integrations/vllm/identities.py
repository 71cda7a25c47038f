"""What each request's KV is keyed by, on the scheduler side: the key chain's root and its multimodal items.

Keys cover the request's identity, not only its tokens (``keys.RequestIdentity``): its LoRA adapter (name and
weights digest), its ``cache_salt`` and its multimodal items at their positions, so a chunk is shared only
with requests whose KV it is. A request whose KV can't be keyed (prompt embeddings; an adapter whose files
this process can't read; a multimodal item without a content hash) is neither loaded nor saved, and counted
(``uncacheable_requests_total{reason}``, through the worker: this side has no registry).
"""

from __future__ import annotations

import logging
from typing import Any

from ...identity import adapter_stamp
from ...keys import FingerprintDigest, MultiModalItem, request_root
from ..engine_identity import file_adapter, request_identity

log = logging.getLogger(__name__)
ADAPTERS_MAX = 4096  # adapter identities remembered (vLLM serves far fewer at once)
Identity = tuple[FingerprintDigest, tuple[MultiModalItem, ...]]  # the key chain's root, the multimodal items


class Identities:
    def __init__(self, fp: FingerprintDigest) -> None:
        self._fp = fp
        # per adapter: its identity as first seen (None once its files changed) and its files' stamp then
        self._adapters: dict[tuple[int, str, str], tuple[str | None, tuple[tuple[str, int, int], ...] | None]] = {}
        self._uncacheable: dict[str, int] = {}  # requests neither loaded nor saved, by reason; sent to the worker

    def of(self, request: Any) -> Identity | None:
        """``request``'s key-chain root and multimodal items; None (and counted) when its KV can't be keyed.
        Read once per request (the scheduler keeps it)."""
        try:
            reason, found = request_identity(request, self._adapter)
        except Exception:  # never into vLLM's scheduler: a request we can't key is computed, not cached
            log.exception("request %s: its identity could not be read; not cached", request.request_id)
            reason, found = "unknown_adapter", None
        if found is None:
            self._uncacheable[reason] = self._uncacheable.get(reason, 0) + 1
            log.debug("request %s: not cached (%s)", request.request_id, reason)
            return None
        return request_root(self._fp, found), found.mm_items

    def take_uncacheable(self) -> dict[str, int]:
        """Requests found uncacheable since the last step, by reason."""
        out, self._uncacheable = self._uncacheable, {}
        return out

    def _adapter(self, lora: Any) -> str | None:
        """An adapter's identity, read from its files the first time this process sees its id. Files changed
        in place afterwards (their sizes or times: a stat each, per request) make it unknown from then on:
        vLLM may compute with the version it loaded or, once it evicted the adapter, with the new files, and
        this side cannot tell which, so its requests are neither loaded nor saved (``unknown_adapter``) until
        the adapter is served under another id or the engine restarts."""
        slot = (int(lora.lora_int_id), str(lora.lora_name), str(lora.lora_path or ""))
        known = self._adapters.get(slot)
        if known is None:
            if len(self._adapters) >= ADAPTERS_MAX:
                self._adapters.pop(next(iter(self._adapters)))
            known = self._adapters[slot] = (file_adapter(lora), adapter_stamp(slot[2]))
        identity, stamp = known
        if identity is not None and adapter_stamp(slot[2]) != stamp:
            log.warning("lmcache-p2p: LoRA adapter %s (id %d) changed in place at %s: its requests are not cached "
                        "until it is served under another id or the engine restarts", slot[1], slot[0], slot[2])
            identity = None
            self._adapters[slot] = (None, stamp)
        return identity
