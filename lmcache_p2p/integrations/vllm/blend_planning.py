"""Blend planning on the scheduler side: whether a request's declared segments are blended, and how.

A request that declares segments (``kv_transfer_params``: ``lmcache_p2p_segments``) and asks to be blended (or
any request under ``blend.by_default``) is offered a hit past its exact prefix: its cached segments at their
new positions, part of their tokens recomputed (``segments.plan_blend``). Only when this engine can: its
config (``blend.enabled``), then every worker's word (their runner, rotary class, key-layout self-test:
``WorkerCapability``); an engine set to blend that can't counts each request it refused once. What one blend
may run through the model is bounded by ``blend.max_recompute_tokens`` within vLLM's step budget; over it,
the request is served prefix-only.

vLLM's prefix cache registers a request's blocks under its block hashes: a blended request's blocks from
its exact prefix on hold blended KV, so their hashes are made its own (``salt``) and no later request takes
them as an exact hit.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

import xxhash

from ...config import AgentConfig
from ...keys import FingerprintDigest, MultiModalItem
from ...request_params import RequestParams
from ...segments import BlendPlan, SegmentChunks, plan_blend, segment_chunks

log = logging.getLogger(__name__)


class BlendPlanning:
    def __init__(self, config: AgentConfig, block_size: int, *, blend_refusal: str | None,
                 token_budget: int | None) -> None:
        self._config = config.blend
        self._chunk, self._block = config.chunk_size, block_size
        self._num_layers = config.layout.num_layers
        # Segments (segments.py): blending needs this engine to place keys exactly (blend.py);
        # vLLM's prefix cache never hands blended blocks on as exact hits (salt).
        self._config_refusal = blend_refusal if config.blend.enabled else "blend.enabled is false"
        # ... and the worker's own word (its runner, rotary class, key-layout self-test): prefix only until
        # every worker has said it can (WorkerCapability, handed over by vLLM before the first step)
        self._worker_refusal: str | None = "the worker has not said it can blend"
        # what one blend may run through the model: the operator's bound, within vLLM's step budget
        self._limit = min(config.blend.max_recompute_tokens, token_budget or config.blend.max_recompute_tokens)
        self._told: set[str] = set()  # reasons for not blending already logged
        self.refused = 0  # blends asked of this engine since the last step that it can't do

    @property
    def refusal(self) -> str | None:
        """Why this engine can't blend now (None: it can): its config, then its workers' word."""
        return self._config_refusal or self._worker_refusal

    def take_refused(self) -> int:
        """The blends refused since the last step (for the worker's ``blend_refused_total``)."""
        refused, self.refused = self.refused, 0
        return refused

    def workers_told(self, refusals: dict[int, str | None]) -> None:
        """Every worker's blend capability (rank -> None, or why it can't); blends are planned only when all can."""
        told = {rank: why for rank, why in refusals.items() if why is not None}
        if not refusals:
            self._worker_refusal = "no worker said it can blend"
        elif told:
            rank, why = min(told.items())
            self._worker_refusal = f"worker rank {rank}: {why}"
        else:
            self._worker_refusal = None
        if self._config_refusal is None:
            log.info("lmcache-p2p: blending %s", "possible (every worker said it can)" if self._worker_refusal is None
                     else f"refused: {self._worker_refusal}")

    def declared(self, request: Any, params: RequestParams, prompt: list[int],
                 identity: tuple[FingerprintDigest, tuple[MultiModalItem, ...]]) -> list[SegmentChunks] | None:
        """The segments ``request`` declares, keyed (None: none, malformed, multimodal, or under a LoRA
        adapter, which the recompute would not apply)."""
        spans = params.segments  # malformed: refused, prefix reuse only
        if spans is None or identity[1] or getattr(request, "lora_request", None) is not None:
            return None
        return segment_chunks(identity[0], prompt, list(spans), self._chunk, self._config.lead_in)

    def plan(self, req_id: str, params: RequestParams, segments: list[SegmentChunks] | None, prompt_len: int,
             exact_end: int, held: Callable[[list[bytes]], bool]) -> tuple[BlendPlan | None, bool]:
        """The blend that extends the exact hit (ending at ``exact_end``) over the request's cached
        ``segments`` (``held``: whether every key of a segment's is held, by owners this engine would ask),
        or None (no segments declared, none held past it, or this engine can't blend); and whether it was
        refused by an engine set to blend that can't (to be counted once per request)."""
        if not segments or not params.wants_blend(self._config.by_default):
            return None, False  # its segments are saved and reused as prefixes; it did not ask to be blended
        refusal = self.refusal
        if refusal is not None:
            if refusal not in self._told:
                self._told.add(refusal)
                log.warning("lmcache-p2p: declared segments are reused as prefixes only: %s", refusal)
            return None, self._config.enabled
        fraction = params.fraction if params.fraction is not None else self._config.recompute_fraction
        selection = params.selection if params.selection is not None else self._config.selection
        plan = plan_blend(segments, exact_end, prompt_len, held, fraction, selection, self._num_layers,
                          self._config.lead_in)
        if plan is not None and plan.cost_tokens > self._limit:
            log.info("request %s: its blend would run %d tokens through the model (recompute %d, fresh segments %d, "
                     "selection pass %d), over blend.max_recompute_tokens or the step's budget (%d): served "
                     "prefix-only", req_id, plan.cost_tokens, plan.recomputed_tokens, plan.fresh_tokens,
                     plan.probe_tokens, self._limit)
            return None, False
        return plan, False

    def salt(self, request: Any, salted_from: int | None, exact_end: int) -> int | None:
        """Make the vLLM block hashes of a blended request's blocks from ``exact_end`` on its own: with
        vLLM's prefix cache on, its blocks are registered under them, and under the prompt's true
        hashes a later request would take blended KV as an exact prefix hit. Later hashes chain from
        these (vLLM's hasher extends the list), so every block from there on is this request's alone.
        Offered again (a failed allocation, a preemption) with a shorter exact prefix, the blocks
        between the new and the old start (``salted_from``) are salted too: they now hold blended KV as
        well. Returns the first block salted now (``salted_from`` when none)."""
        hashes = getattr(request, "block_hashes", None)
        if not isinstance(hashes, list):
            return salted_from
        first = exact_end // self._block
        end = len(hashes) if salted_from is None else min(salted_from, len(hashes))
        if first >= end:
            return salted_from
        nonce = secrets.token_bytes(16)
        for i in range(first, end):
            hashes[i] = type(hashes[i])(xxhash.xxh3_128_digest(bytes(hashes[i]) + nonce))
        return first
