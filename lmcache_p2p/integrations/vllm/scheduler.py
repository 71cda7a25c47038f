"""Scheduler side (EngineCore process): how much of a prompt the mesh can supply.

The hit is the longest run of leading chunks held anywhere (this node's agent or any peer),
read from a watch-fed mirror of the index: a dict probe per chunk, no network. It ends where
the last available chunk ends, minus one token when that is the prompt's end (vLLM must
compute the last token itself). It is not rounded down to blocks or chunks: a 2,048-token
prompt fully held hits 2,047 tokens.

A hit whose chunks this engine's own worker saved is loaded synchronously (pinned local slots,
scattered before the forward pass: cheaper than a scheduler round trip). Any other hit is loaded
asynchronously (``(n, True)``): the request waits in WAITING_FOR_REMOTE_KVS while the worker pulls
with a deadline, and other requests keep running; the worker reports it through ``get_finished``.

Generated tokens are saved too: every chunk a request's output fills is stored as it fills (keys
chained on the prompt's), and when the request finishes, the rest of what it computed (the tail: a
chunk cut where its KV ends, one token before its last) is saved from blocks vLLM holds for it until
the worker has copied them (``request_finished`` delays their freeing; the worker reports the
request as sent). A prompt whose leading full chunks are held then also probes the next chunk cut
shorter, every length down to one token (a dict probe each): the next turn of a conversation, on
any node, loads the whole history and computes only the new message.

Keys cover the request's identity, not only its tokens (``keys.RequestIdentity``): its LoRA
adapter (name and weights digest), its ``cache_salt`` and its multimodal items at their positions,
so a chunk is shared only with requests whose KV it is. A request whose KV can't be keyed
(prompt embeddings; an adapter whose files this process can't read; a multimodal item without a
content hash) is neither loaded nor saved, and counted (``uncacheable_requests_total{reason}``).

A canary request (a fraction ``canary.rate`` of those with a hit, or one whose
``kv_transfer_params`` say ``{"lmcache_p2p_canary": true}``) is offered no hit: the engine computes
it, and its worker compares what it computed with every owner's copy (``canary.py``).

A client (a router) that saw a prompt's chunks announced at etcd revision R (the entries'
``mod_revision``) can say so (``kv_transfer_params: {"lmcache_p2p_index_revision": R}``): while this
side's mirror has not followed the block entries to R and does not offer the whole prompt, the
request is not scheduled yet (vLLM asks again next step), for at most ``FRESHNESS_WAIT_S``; then it
is planned with what the mirror holds (``integrations/freshness.py``). Without it, a request arriving right
after the chunks reached etcd may find the mirror an event behind and be computed.

Which computed chunks a save keeps, and the keys remembered as saved while the mirror does not follow
etcd: ``admission.py``. Which requests are canaries: ``canary_sampling.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Iterable
from typing import Any

import xxhash

from ...aio import LoopThread
from ...blocks import ChunkTransfer, chunk_transfer
from ...config import AgentConfig
from ...identity import adapter_stamp
from ...ids import TIER_DISK, NodeId
from ...index.reader import IndexReader
from ...index.schema import NodeRecord
from ...keys import (
    ChunkKey,
    Fingerprint,
    FingerprintDigest,
    MultiModalItem,
    chunk_keys,
    chunk_keys_from,
    partial_chunk_keys,
    request_root,
)
from ...peers import compatible
from ...plan import miss_reason
from ...request_params import CANARY_PARAM, REVISION_PARAM, RequestParams
from ...segments import BlendPlan, BlendTransfer, SegmentChunks, SegmentSave, plan_blend, segment_chunks
from ..engine_identity import file_adapter, request_identity
from ..freshness import Freshness
from .admission import Admission
from .canary_sampling import CanarySampling
from .metadata import LMCacheP2PMetadata

log = logging.getLogger(__name__)
ADAPTERS_MAX = 4096  # adapter identities remembered (vLLM serves far fewer at once)
RESET_CHECK_WAIT_S = 2.0  # a request held at most this long after a cache reset for the workers' weight check
BLEND_REFUSED = "blend"  # in a request's ``refused``: its blend was refused by this engine (counted once)


_UNREAD: Any = object()  # a field of _Request not read from the request yet


@dataclasses.dataclass(slots=True)
class _Request:
    """Everything this side knows of one request, from its first lookup until vLLM says it finished: one
    record, dropped whole (``request_finished``)."""

    identity: tuple[FingerprintDigest, tuple[MultiModalItem, ...]] | None = _UNREAD  # None: its KV can't be keyed
    params: RequestParams | None = None  # its kv_transfer_params, once read
    segments: list[SegmentChunks] | None = _UNREAD  # its declared segments, keyed (None: none usable)
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


class P2PScheduler:
    def __init__(self, config: AgentConfig, fingerprint: Fingerprint, block_size: int, *,
                 blend_refusal: str | None = "not checked", token_budget: int | None = None) -> None:
        self._config = config
        self._fp = fingerprint.digest
        self._chunk = config.chunk_size
        self._block = block_size
        self._loop = LoopThread("lmcache-p2p-scheduler", role="scheduler")
        try:
            self._index = IndexReader.open(self._loop, config, self._fp)
        except Exception:
            self._loop.stop()
            raise
        self._requests: dict[str, _Request] = {}  # every request vLLM asked about and has not finished
        self._loads: list[ChunkTransfer] = []  # decided this step; handed to the worker in the next meta
        self._admission = Admission(config.chunk_size, save_after_sightings=config.tiers.save_after_sightings,
                                    min_save_tokens=config.tiers.min_save_tokens)
        self._saved = self._admission.saved  # asked of our worker (an LRU): held, while the mirror can't say
        self._uncacheable: dict[str, int] = {}  # requests neither loaded nor saved, by reason; sent to the worker
        self._tls, self._transports = config.transfer.tls, config.transfer.transports
        # per adapter: its identity as first seen (None once its files changed) and its files' stamp then
        self._adapters: dict[tuple[int, str, str], tuple[str | None, tuple[tuple[str, int, int], ...] | None]] = {}
        self._canaries = CanarySampling(config.canary)
        self._refused: dict[str, int] = {}  # request parameters not honoured since the last step, by name
        self._blend_refused = 0  # blends asked of this engine since the last step that it can't do
        self._missed: dict[str, int] = {}  # prompt tokens the cache could not give since the last step, by reason
        self._node_id, self._model_id = NodeId(config.node_id), fingerprint.model_id
        self._reset = False  # vLLM reset its caches: the workers drop their chunks at the next step
        self._resets = 0  # cache resets asked of the workers; hits are offered once they checked them all
        self._workers_reset = 0  # ... the resets every worker has checked the weights at (WorkerState)
        self._stopped_sharing: str | None = None  # a worker's weights changed in place: no hit, ever
        self._reset_at = 0.0  # when the last reset was asked (time.monotonic())
        self._freshness = Freshness()  # requests waiting for the mirror to reach the revision they name
        self._finished: list[ChunkTransfer] = []  # tails of finished requests, for the next step's worker
        # Segments (segments.py): blending needs this engine to place keys exactly (blend.py);
        # vLLM's prefix cache never hands blended blocks on as exact hits (_salt).
        self._config_refusal = blend_refusal if config.blend.enabled else "blend.enabled is false"
        # ... and the worker's own word (its runner, rotary class, key-layout self-test): prefix only until
        # every worker has said it can (WorkerCapability, handed over by vLLM before the first step)
        self._worker_refusal: str | None = "the worker has not said it can blend"
        self._blend_fraction = config.blend.recompute_fraction
        self._blend_selection = config.blend.selection
        # what one blend may run through the model: the operator's bound, within vLLM's step budget
        self._blend_limit = min(config.blend.max_recompute_tokens, token_budget or config.blend.max_recompute_tokens)
        self._blend_loads: list[BlendTransfer] = []  # decided this step; handed to the worker in the next meta
        self._told: set[str] = set()  # reasons for not blending already logged
        self._unavailable: frozenset[str] = frozenset()  # peers the workers' pulls do not ask now (WorkerState)

    def _record(self, request: Any) -> _Request:
        found = self._requests.get(request.request_id)
        if found is None:
            found = self._requests[request.request_id] = _Request()
        return found

    def _usable(self, record: NodeRecord) -> bool:
        """An owner this engine's worker can pull from (the same rule its plan applies), and would ask now:
        one its pulls hold (an answer overdue: hung or slow) or back off is no hit (its load would fail at
        once, and the failed load cost the request a round of vLLM's steps on top of computing it)."""
        return (compatible(record, tls=self._tls, transports=self._transports)
                and not self._index.quarantine.blocked(record.node_id) and record.node_id not in self._unavailable)

    def _canary(self, request: Any, record: _Request, hit: int, num_computed_tokens: int) -> bool:
        """Whether ``request`` is computed as a canary (asked for, or sampled among hits). Only when
        the engine computes every token itself: blocks from vLLM's own prefix cache may hold KV
        loaded from the mesh, which would make the reference the very bytes under test; and never
        for multimodal requests, whose item hashes a client can name (``multi_modal_uuids``)."""
        identity = record.identity
        if num_computed_tokens > 0 or (identity is not None and identity is not _UNREAD and identity[1]):
            return False
        canary, refused = self._canaries.sampled(self._params(request, record).canary, hit)
        if refused:  # served as any other request
            self._refuse(record, request.request_id, CANARY_PARAM, "over canary.requested_per_minute")
        record.canary = record.canary or canary
        return canary

    def _params(self, request: Any, record: _Request) -> RequestParams:
        """``request``'s ``kv_transfer_params``, read once; each malformed one refused (logged, counted)."""
        if record.params is None:
            record.params = RequestParams.parse(getattr(request, "kv_transfer_params", None),
                                                len(request.prompt_token_ids or ()))
            for name, why in record.params.malformed:
                self._refuse(record, request.request_id, name, why)
        return record.params

    def _refuse(self, record: _Request, req_id: str, param: str, why: str) -> None:
        """A request parameter is not honoured: counted (``request_params_refused_total``) once per request."""
        if param in record.refused:
            return
        record.refused |= {param}
        self._refused[param] = self._refused.get(param, 0) + 1
        log.info("request %s: %s not honoured (%s)", req_id, param, why)

    def _identity(self, request: Any, record: _Request) -> tuple[FingerprintDigest, tuple[MultiModalItem, ...]] | None:
        """The key chain's root and multimodal items of ``request``; None (and counted once per
        request) when its KV can't be keyed."""
        req_id = request.request_id
        if record.identity is not _UNREAD:
            return record.identity
        try:
            reason, found = request_identity(request, self._adapter)
        except Exception:  # never into vLLM's scheduler: a request we can't key is computed, not cached
            log.exception("request %s: its identity could not be read; not cached", req_id)
            reason, found = "unknown_adapter", None
        if found is None:
            self._uncacheable[reason] = self._uncacheable.get(reason, 0) + 1
            log.debug("request %s: not cached (%s)", req_id, reason)
            result = None
        else:
            result = request_root(self._fp, found), found.mm_items
        record.identity = result
        return result

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

    def _keys(self, tokens: list[int], root: FingerprintDigest, mm_items: tuple[MultiModalItem, ...]) -> list[ChunkKey]:
        return chunk_keys(root, tokens, self._chunk, mm_items=mm_items)

    def _prompt_keys(self, record: _Request, prompt: list[int],
                     identity: tuple[FingerprintDigest, tuple[MultiModalItem, ...]]) -> list[ChunkKey]:
        """The prompt's chunk keys: keyed at its first lookup, reused at every later one and at its allocation."""
        if record.keys is None:
            record.keys = self._keys(prompt, *identity)
        return record.keys

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        record = self._record(request)
        if self._stopped_sharing is not None:  # the weights changed in place: chunks anywhere are the old ones'
            return 0, False
        if self._workers_reset < self._resets:
            # Asked again next step, until every worker compared its weights with the start's (the reset goes
            # out with the next step, each reads its weights on a thread of its own, their word comes back
            # with a step's output); no hit past RESET_CHECK_WAIT_S (a large model read on CPU: seconds).
            return (None, False) if time.monotonic() - self._reset_at < RESET_CHECK_WAIT_S else (0, False)
        if not prompt or record.loaded:
            # Asked again after a load for this request, before its prompt was computed: the load failed
            # (vLLM reset the request to recompute it). Offering the same hit again would loop; the engine
            # computes it. (Asked again after its prompt was computed: vLLM preempted it; offered again.)
            return 0, False
        identity = self._identity(request, record)
        if identity is None:
            return 0, False
        keys = self._prompt_keys(record, prompt, identity)
        params = self._params(request, record)
        wanted = params.index_revision
        mirror = self._index.mirror
        if wanted:  # etcd.index lookup: read these keys as of that revision (the watch: nothing to do)
            mirror.prefetch(keys, wanted)
            if mirror.reads_etcd and mirror.blocks_revision < wanted:
                # The read just made (linearizable) found etcd below the revision the request names: no read
                # will reach it soon, and each would cost a scheduler step an etcd round trip.
                self._refuse(record, request.request_id, REVISION_PARAM,
                             f"etcd is at revision {mirror.blocks_revision}, below {wanted}")
                record.params = params = params.without_revision()
        held = self._index.longest_prefix(keys, () if self._index.connected else self._saved, self._usable)
        if held < len(keys) and self._freshness.hold(request.request_id, params, mirror.blocks_revision,
                                                     self._index.connected, held):
            return None, False  # not scheduled this step: the mirror is behind what the request saw
        record.tail = record.blend = None
        tail = self._tail(prompt, keys, held, *identity) if held < len(keys) else None
        exact = min(held * self._chunk + (tail[0] if tail else 0), len(prompt) - 1)
        blend = self._blend(request, record, prompt, identity, max(exact, num_computed_tokens))
        hit = blend.end if blend is not None else exact
        if held < len(keys) and not record.missed:
            record.missed = True
            self._count_miss(keys[held], len(prompt) - 1 - max(hit, num_computed_tokens))
        record.local_hit = num_computed_tokens
        n = max(hit - num_computed_tokens, 0)
        if record.canary or self._canary(request, record, n, num_computed_tokens) or n == 0:
            return 0, False
        if tail is not None:
            record.tail = (held, *tail)
            keys = keys[:held] + [tail[1]]
        needed = keys[num_computed_tokens // self._chunk: -(-exact // self._chunk)]
        if exact <= num_computed_tokens:
            needed = []
        record.sources = self._sources(keys, num_computed_tokens, exact, n, blend)
        if blend is not None:
            record.blend = blend
            self._salt(request, record, blend.exact_end)  # before vLLM allocates (a sync hit is cached there)
            needed += [ChunkKey(k) for seg in blend.segments if not seg.fresh for k in seg.keys]
        load_async = not all(k in self._saved for k in needed)
        if load_async and blend is None and num_computed_tokens > 0 and n < self._chunk:
            # Less than a chunk on top of the engine's own prefix-cache hit (a prompt's tail another
            # engine computed): computed within the step the engine runs anyway, it is there sooner than
            # an asynchronous load brings it (a step's wait at least, behind other loads).
            record.tail = None
            log.debug("request %s: %d tokens on top of %d in vLLM's prefix cache computed, not pulled",
                      request.request_id, n, num_computed_tokens)
            return 0, False
        record.load_async = load_async  # what vLLM was told decides how the worker loads
        return n, load_async

    def _count_miss(self, key: ChunkKey, tokens: int) -> None:
        """``tokens`` of a prompt the cache can't give, from the chunk ``key`` on: counted by why that chunk
        is missed (``plan.miss_reason``), for the worker's ``miss_tokens_total`` (this side has no registry).
        The prompt's last token is left out: vLLM computes it whatever the cache holds."""
        if tokens <= 0:
            return
        mirror = self._index.mirror
        reason = miss_reason(mirror.owners(key), mirror.nodes(), me=self._node_id, fp_hex=self._fp.hex(),
                             model_id=self._model_id, blocked=self._index.quarantine.blocked,
                             remembered=key in self._saved)
        self._missed[reason] = self._missed.get(reason, 0) + tokens

    def _where(self, key: ChunkKey) -> str:
        """Where a chunk of a hit is held, as vLLM's ``CacheHitSource`` names it: ``host`` or ``disk`` (this
        engine's own agents: its node id, or its ranks' ``<id>-r<k>``), else ``p2p`` (peers, the object store)."""
        node = self._config.node_id
        tiers = [t for n, t in self._index.mirror.owners(key).items() if n == node or n.startswith(node + "-r")]
        if tiers:
            return "disk" if min(tiers) >= TIER_DISK else "host"
        return "host" if key in self._saved else "p2p"

    def _sources(self, keys: list[ChunkKey], start: int, exact: int, n: int, blend: BlendPlan | None
                 ) -> dict[str, int]:
        """The ``n`` hit tokens from ``start`` by where they are held: the exact part chunk by chunk (up to
        ``exact``), a blend's segment tokens by where most of its held segment chunks are."""
        out: dict[str, int] = {}
        for i in range(start // self._chunk, -(-exact // self._chunk)):
            if i < len(keys):
                tokens = min((i + 1) * self._chunk, exact) - max(i * self._chunk, start)
                if tokens > 0:
                    where = self._where(keys[i])
                    out[where] = out.get(where, 0) + tokens
        rest = n - sum(out.values())
        if rest > 0:
            held = [self._where(ChunkKey(k)) for seg in (blend.segments if blend else []) if not seg.fresh
                    for k in seg.keys]
            where = max(set(held), key=held.count) if held else "p2p"
            out[where] = out.get(where, 0) + rest
        return out

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The external hit of ``request`` by where it was held when offered (``host``, ``disk``, ``p2p``),
        summing to ``num_external_tokens``."""
        record = self._requests.get(request.request_id)
        sources = dict(record.sources) if record is not None else {}
        total = sum(sources.values())
        if not sources or num_external_tokens <= 0:
            return {"p2p": num_external_tokens} if num_external_tokens > 0 else {}
        if total != num_external_tokens:  # vLLM granted another count than was offered: the largest absorbs it
            largest = max(sources, key=lambda s: sources[s])
            sources[largest] += num_external_tokens - total
            sources = {s: v for s, v in sources.items() if v > 0}
            if sum(sources.values()) != num_external_tokens:
                return {"p2p": num_external_tokens}
        return sources

    def _declared(self, request: Any, record: _Request, prompt: list[int],
                  identity: tuple[FingerprintDigest, tuple[MultiModalItem, ...]]) -> list[SegmentChunks] | None:
        """The segments ``request`` declares, keyed (None: none, malformed, multimodal, or under a LoRA
        adapter, which the recompute would not apply)."""
        if record.segments is _UNREAD:
            found = None
            spans = self._params(request, record).segments  # malformed: refused, prefix reuse only
            if spans is not None and not identity[1] and getattr(request, "lora_request", None) is None:
                found = segment_chunks(identity[0], prompt, list(spans), self._chunk)
            record.segments = found
        return record.segments

    @property
    def _blend_refusal(self) -> str | None:
        """Why this engine can't blend now (None: it can): its config, then its workers' word."""
        return self._config_refusal or self._worker_refusal

    def workers_said(self, state: Any) -> None:
        """The workers' state after a step (``WorkerState``, aggregated over ranks; None: none sent)."""
        unavailable = getattr(state, "unavailable", None)
        if isinstance(unavailable, frozenset) and unavailable != self._unavailable:
            log.debug("lmcache-p2p: peers not asked now: %s", sorted(unavailable) or "none")
            self._unavailable = unavailable
        resets = getattr(state, "resets", None)
        if isinstance(resets, int):
            self._workers_reset = max(self._workers_reset, resets)
        stopped = getattr(state, "stopped_sharing", None)
        if isinstance(stopped, str) and self._stopped_sharing is None:
            self._stopped_sharing = stopped
            log.error("lmcache-p2p: a worker stopped sharing (%s): no hit is offered until the engine restarts",
                      stopped)

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

    def _blend(self, request: Any, record: _Request, prompt: list[int],
               identity: tuple[FingerprintDigest, tuple[MultiModalItem, ...]], exact_end: int) -> BlendPlan | None:
        """The blend that extends the exact hit (ending at ``exact_end``) over the request's cached
        segments, or None (no segments declared, none held past it, or this engine can't blend)."""
        segments = self._declared(request, record, prompt, identity)
        if not segments:
            return None
        params = self._params(request, record)
        if not params.wants_blend(self._config.blend.by_default):
            return None  # its segments are saved and reused as prefixes; it did not ask to be blended
        refusal = self._blend_refusal
        if refusal is not None:
            if refusal not in self._told:
                self._told.add(refusal)
                log.warning("lmcache-p2p: declared segments are reused as prefixes only: %s", refusal)
            if self._config.blend.enabled and BLEND_REFUSED not in record.refused:
                record.refused |= {BLEND_REFUSED}  # asked of an engine set to blend that can't: counted once
                self._blend_refused += 1
            return None
        saved = () if self._index.connected else self._saved

        def held(keys: list[bytes]) -> bool:
            chunk_keys = [ChunkKey(k) for k in keys]
            return self._index.longest_prefix(chunk_keys, saved, self._usable) == len(chunk_keys)

        fraction = params.fraction if params.fraction is not None else self._blend_fraction
        selection = params.selection if params.selection is not None else self._blend_selection
        plan = plan_blend(segments, exact_end, len(prompt), held, fraction, selection, self._config.layout.num_layers)
        if plan is not None and plan.cost_tokens > self._blend_limit:
            log.info("request %s: its blend would run %d tokens through the model (recompute %d, fresh segments %d, "
                     "selection pass %d), over blend.max_recompute_tokens or the step's budget (%d): served "
                     "prefix-only", request.request_id, plan.cost_tokens, plan.recomputed_tokens, plan.fresh_tokens,
                     plan.probe_tokens, self._blend_limit)
            return None
        return plan

    def _salt(self, request: Any, record: _Request, exact_end: int) -> None:
        """Make the vLLM block hashes of a blended request's blocks from ``exact_end`` on its own: with
        vLLM's prefix cache on, its blocks are registered under them, and under the prompt's true
        hashes a later request would take blended KV as an exact prefix hit. Later hashes chain from
        these (vLLM's hasher extends the list), so every block from there on is this request's alone.
        Offered again (a failed allocation, a preemption) with a shorter exact prefix, the blocks
        between the new and the old start are salted too: they now hold blended KV as well."""
        hashes = getattr(request, "block_hashes", None)
        if not isinstance(hashes, list):
            return
        first = exact_end // self._block
        end = len(hashes) if record.salted_from is None else min(record.salted_from, len(hashes))
        if first >= end:
            return
        record.salted_from = first
        nonce = secrets.token_bytes(16)
        for i in range(first, end):
            hashes[i] = type(hashes[i])(xxhash.xxh3_128_digest(bytes(hashes[i]) + nonce))

    def _tail(self, prompt: list[int], keys: list[ChunkKey], held: int, root: FingerprintDigest,
              mm_items: tuple[MultiModalItem, ...]) -> tuple[int, ChunkKey] | None:
        """The longest cut of chunk ``held`` that is held (tokens, key): where an earlier request (a
        conversation's previous turn) stopped inside it. At most ``chunk - 1`` keys, each a dict probe
        of the mirror (``etcd.index: lookup``: all of them read first, in one round trip); only an owner
        the full rule accepts counts."""
        start = held * self._chunk
        longest = min(self._chunk, len(prompt) - 1 - start)  # vLLM computes the prompt's last token itself
        if longest <= 0:
            return None
        parent = bytes(keys[held - 1]) if held else bytes(root)
        saved = () if self._index.connected else self._saved
        mirror = self._index.mirror
        candidates: Iterable[tuple[int, ChunkKey]] = partial_chunk_keys(parent, prompt, start, longest, mm_items)
        if mirror.reads_etcd:  # etcd.index lookup: one read for them all, not one per probe
            candidates = list(candidates)
            mirror.prefetch([key for _, key in candidates])
        for n, key in candidates:
            if key in saved or (mirror.owners(key) and self._index.longest_prefix([key], (), self._usable) == 1):
                return n, key
        return None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        prompt = list(request.prompt_token_ids or [])
        record = self._record(request)
        identity = self._identity(request, record)
        local_hit, record.local_hit = record.local_hit, 0
        if identity is None or not prompt:
            return  # nothing loaded (no hit was offered), nothing saved
        keys = self._prompt_keys(record, prompt, identity)
        # Called again once a pulled load is in place (with no external tokens), or when a preempted request is
        # scheduled again: what is saved of it starts over (a blended request stays so).
        record.request, record.prompt, record.block_ids = request, prompt, []
        record.prompt_saved, record.full_chunks_saved, record.last_generated = False, 0, None
        blend, record.blend = record.blend, None
        record.save_segments = None
        if blend is None and not record.blended and self._blend_refusal is None:
            record.save_segments = self._declared(request, record, prompt, identity)  # saved once computed
        if num_external_tokens > 0:
            start = local_hit
            end = start + num_external_tokens
            block_ids = list(blocks.get_block_ids()[0])
            load_async, record.load_async = record.load_async, None
            sync = load_async is False
            revision = self._index.mirror.revision  # the worker plans once its mirror saw as much
            deadline = time.monotonic() + self._config.transfer.timeout_s  # one deadline, to the transport
            if blend is not None:  # vLLM grants the whole hit or none: end == blend.end
                exact = (self._exact_load(request.request_id, record, prompt, keys, block_ids, start,
                                          blend.exact_end) if blend.exact_end > start else None)
                if exact is not None:
                    exact.sync, exact.index_revision, exact.deadline = sync, revision, deadline
                self._blend_loads.append(BlendTransfer(
                    request.request_id, exact, blend.segments, blend.recompute, prompt[:max(
                        [blend.end] + [seg.start + seg.length for seg in blend.segments if seg.fresh])], block_ids,
                    max(blend.exact_end, start), blend.end, blend.base_end, blend.select, sync=sync,
                    index_revision=revision, deadline=deadline, selection=blend.selection,
                    question=prompt[blend.end:] if blend.selection == "question" else []))
                self._admission.remember_saved(ChunkKey(k) for seg in blend.segments if seg.fresh for k in seg.keys)
                record.blended = True
            else:
                load = self._exact_load(request.request_id, record, prompt, keys, block_ids, start, end)
                load.sync, load.index_revision, load.deadline = sync, revision, deadline
                self._loads.append(load)
            record.loaded = True
        record.computing = True

    def _exact_load(self, req_id: str, record: _Request, prompt: list[int], keys: list[ChunkKey], block_ids: list[int],
                    start: int, end: int) -> ChunkTransfer:
        """The prefix chunks covering ``[start, end)``; a hit ending in a chunk held cut short loads it as a
        chunk of that many tokens."""
        tail, record.tail = record.tail, None
        if tail is None:
            return self._transfer(req_id, prompt, keys, block_ids, start, end)
        held, n, key = tail
        return chunk_transfer(req_id, held * self._chunk + n, keys[:held] + [key], block_ids, start, end,
                              self._chunk, self._block)

    def _transfer(self, req_id: str, prompt: list[int], keys: list[ChunkKey], block_ids: list[int],
                  start: int, end: int) -> ChunkTransfer:
        return chunk_transfer(req_id, len(prompt), keys, block_ids, start, end, self._chunk, self._block)

    def build_connector_meta(self, out: Any) -> LMCacheP2PMetadata:
        meta = LMCacheP2PMetadata(num_scheduled_tokens=int(out.total_num_scheduled_tokens))
        meta.uncacheable, self._uncacheable = self._uncacheable, {}
        meta.refused, self._refused = self._refused, {}
        meta.blend_refused, self._blend_refused = self._blend_refused, 0
        meta.missed, self._missed = self._missed, {}
        meta.skipped = self._admission.take_skipped()
        meta.reset_cache, self._reset = self._reset, False
        # Sync loads belong to requests scheduled in this step; async ones to requests that now wait
        # for their KV (not scheduled): both start on the worker in this step.
        meta.loads, self._loads = self._loads, []
        meta.blends, self._blend_loads = self._blend_loads, []
        meta.saves, self._finished = self._finished, []  # finished requests' tails: vLLM holds their blocks
        for new in out.scheduled_new_reqs:
            record = self._computing(new.req_id)
            if record is not None:
                record.block_ids = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            record = self._computing(req_id)
            new_ids = cached.new_block_ids[i]
            if record is not None and new_ids is not None:
                if req_id in getattr(cached, "resumed_req_ids", ()):
                    record.block_ids = list(new_ids[0])
                else:
                    record.block_ids.extend(new_ids[0])
        computed = _computed_after_step(out)
        for req_id, record in self._requests.items():
            if not record.computing or record.keys is None:
                continue
            done = computed.get(req_id)
            if done is not None and done > len(record.prompt):
                # decoding: its prompt was computed in an earlier step (its load, if any, went through, or vLLM
                # has recomputed what failed); were vLLM to preempt it now, its hit may be offered again when
                # it is rescheduled (its KV freed, its chunks in the mesh)
                record.loaded = False
            if done is None or done < len(record.prompt) or record.blended:
                continue
            if not record.prompt_saved:
                admission = self._admission
                seen = admission.seen(record.keys) if record.sighted else admission.sighted(record.keys)
                record.sighted = True
                save = admission.admitted(self._transfer(req_id, record.prompt, record.keys, record.block_ids, 0,
                                                         len(record.prompt)), seen)
                save.canary = record.canary
                if save.keys:
                    meta.saves.append(save)
                if record.save_segments:  # only the first: computed right after the base (the others are
                    # computed after documents this client chose; a blend computes them fresh)
                    meta.segment_saves.append(SegmentSave(req_id, record.save_segments[:1], list(record.block_ids)))
                    self._admission.remember_saved(ChunkKey(k) for k in record.save_segments[0].keys)
                record.prompt_saved, record.full_chunks_saved = True, len(record.prompt) // self._chunk
            # With asynchronous scheduling the newest sampled token may still be a placeholder: save
            # only chunks whose every token is known (a later step saves the rest).
            full = min(done, len(record.request.all_token_ids)) // self._chunk
            if full > record.full_chunks_saved:
                generated = self._generated(record, record.keys, full)
                if generated.keys:
                    meta.saves.append(generated)
        return meta

    def _computing(self, req_id: str) -> _Request | None:
        record = self._requests.get(req_id)
        return record if record is not None and record.computing else None

    def _generated(self, record: _Request, keys: list[ChunkKey], full: int) -> ChunkTransfer:
        """The full chunks ``[full_chunks_saved, full)`` of prompt + output, chained on the prompt's ``keys``."""
        first, chunk = record.full_chunks_saved, self._chunk
        assert record.identity is not None  # computing: keyed
        root, mm_items = record.identity
        # chained from the chunk before: hashing only the new chunks (not the whole history at each one)
        in_prompt = len(record.prompt) // chunk  # the prompt's full chunks, whose keys are ``keys``
        parent = (root if first == 0 else keys[first - 1] if first <= in_prompt else record.last_generated)
        tokens = record.request.all_token_ids
        if parent is None:  # not known here (never so far): the whole history keyed once more
            new = self._keys(list(tokens[: full * chunk]), root, mm_items)[first:]
        else:
            new = chunk_keys_from(bytes(parent), list(tokens[first * chunk: full * chunk]), chunk, first * chunk,
                                  mm_items)
        per = chunk // self._block
        record.full_chunks_saved, record.last_generated = full, new[-1]
        return self._admission.admitted(ChunkTransfer(record.request.request_id, [bytes(k) for k in new],
                                                      [chunk] * (full - first),
                                                      [record.block_ids[i * per:(i + 1) * per]
                                                       for i in range(first, full)],
                                                      generated=True), self._admission.seen(new))

    def request_finished(self, request: Any, block_ids: list[int] | None = None) -> bool:
        """Forget ``request``; True when its tail is to be saved: vLLM then keeps its blocks (``block_ids``,
        what vLLM holds for it) until the worker reports the request as sent (``get_finished``)."""
        record = self._requests.pop(request.request_id, None)  # a load already decided still runs: vLLM
        # holds the request's blocks until the worker reports it finished
        self._freshness.forget(request.request_id)
        try:
            tail = self._finished_tail(record, block_ids) if record is not None and record.computing else None
        except Exception:  # never into vLLM's scheduler: the tail is simply not saved
            log.exception("request %s: its tail could not be planned; not saved", request.request_id)
            tail = None
        if tail is not None:
            self._finished.append(tail)
        return tail is not None

    def _finished_tail(self, record: _Request, block_ids: list[int] | None) -> ChunkTransfer | None:
        """The chunks a finished request computed that no save covered: from its last saved full chunk
        to where its KV ends (the last token generated never had its KV computed), the last cut short."""
        request = record.request
        tokens = list(request.all_token_ids)
        done = min(int(request.num_computed_tokens), len(tokens) - 1)
        covered = max(len(record.prompt), record.full_chunks_saved * self._chunk)
        if not record.prompt_saved or record.blended or done <= covered:
            return None
        assert record.identity is not None  # computing: keyed
        keys = self._keys(tokens[:done], *record.identity)
        blocks = list(block_ids) if block_ids else record.block_ids
        save = chunk_transfer(request.request_id, done, keys, blocks, record.full_chunks_saved * self._chunk, done,
                              self._chunk, self._block)
        if any(len(b) != -(-n // self._block) for b, n in zip(save.block_ids, save.num_tokens, strict=True)):
            log.warning("request %s: %d blocks known, fewer than its %d computed tokens; its tail is not saved",
                        request.request_id, len(blocks), done)
            return None
        save = self._admission.admitted(save, self._admission.seen([ChunkKey(k) for k in save.keys]))
        if not save.keys:
            return None  # nothing worth saving: vLLM frees its blocks at once
        save.generated, save.finished = True, True
        return save

    def reset_cache(self) -> bool:
        """vLLM resets its caches (``reset_prefix_cache``, e.g. after a weight update): this engine's workers
        drop every chunk their agents hold (unannounced from the index) at the next step, and nothing this
        side remembers as saved counts as held any more. No hit is offered until every worker has compared
        its weights with those loaded at start (``WorkerState.resets``); if they changed, none again."""
        self._reset = True
        self._resets += 1
        self._reset_at = time.monotonic()
        self._saved.clear()
        log.info("lmcache-p2p: cache reset requested: this node's chunks are dropped at the next step")
        return True

    def shutdown(self) -> None:
        self._index.close()
        self._loop.stop()


def _computed_after_step(out: Any) -> dict[str, int]:
    """Tokens of each request scheduled in this step computed once it runs (one pass over the batch)."""
    scheduled = out.num_scheduled_tokens
    computed = {new.req_id: int(new.num_computed_tokens) + int(scheduled[new.req_id])
                for new in out.scheduled_new_reqs if new.req_id in scheduled}
    cached = out.scheduled_cached_reqs
    for req_id, done in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
        if req_id in scheduled and req_id not in computed:
            computed[req_id] = int(done) + int(scheduled[req_id])
    return computed
