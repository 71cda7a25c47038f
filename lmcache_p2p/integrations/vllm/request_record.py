"""One record per request on the scheduler side, from its first lookup until vLLM says it finished.

Everything this side learns of a request is read once and kept here (its identity, parameters, declared
segments, prompt keys), what it was offered and how (hit, tail, blend, sources), and, once vLLM allocated
its blocks, what of it is saved (``save_planning.py``): its keys grow from the last one saved, never keyed
again from the start.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...keys import ChunkKey
from ...request_params import RequestParams
from ...segments import BlendPlan, SegmentChunks
from .identities import Identity

UNREAD: Any = object()  # a field of RequestRecord not read from the request yet


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """Everything this side knows of one request, from its first lookup until vLLM says it finished: one
    record, dropped whole (``request_finished``)."""

    identity: Identity | None = UNREAD  # None: its KV can't be keyed
    params: RequestParams | None = None  # its kv_transfer_params, once read
    segments: list[SegmentChunks] | None = UNREAD  # its declared segments, keyed (None: none usable)
    local_hit: int = 0  # tokens vLLM's own prefix cache supplied when the hit was offered
    load_async: bool | None = None  # how the hit was announced to vLLM (None: no hit offered)
    loaded: bool = False  # it got a load: never offered a hit twice (until its prompt is computed)
    canary: bool = False  # computed to check the mesh's copies against
    refused: frozenset[str] = frozenset()  # its kv_transfer_params not honoured (counted once each)
    tail: tuple[int, int, ChunkKey] | None = None  # its hit ends in a cut chunk: (chunk, tokens, key)
    blend: BlendPlan | None = None  # its hit offered as a blend, until its blocks are allocated
    blended: bool = False  # its KV is blended, until it finishes: never saved
    salted_from: int | None = None  # its vLLM block hashes from this block on were made its own
    keys: list[ChunkKey] | None = None  # its prompt's chunk keys, keyed once
    # From its allocation until it finishes (computing): what is saved of it. Its prompt is saved once
    # complete, then every chunk its generated tokens fill (so the next turn of a conversation, on any
    # node, finds its history).
    computing: bool = False
    request: Any = None  # vLLM's Request: all_token_ids grows as tokens are generated
    prompt: list[int] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    save_segments: list[SegmentChunks] | None = None  # declared segments, saved with the prompt
    prompt_saved: bool = False
    full_chunks_saved: int = 0  # leading full chunks of prompt + output already saved
    last_generated: ChunkKey | None = None  # the key of the last full chunk saved past the prompt's full ones
    sources: dict[str, int] = dataclasses.field(default_factory=dict)  # the hit's tokens by where they are held
    sighted: bool = False  # its prompt's keys were counted (tiers.save_after_sightings): once, even if preempted
    missed: bool = False  # the tokens the cache could not give it were counted (miss_tokens_total): once
