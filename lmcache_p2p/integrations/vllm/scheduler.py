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

Keys cover the request's identity, not only its tokens (its adapter, ``cache_salt``, multimodal items:
``identities.py``); a request whose KV can't be keyed is neither loaded nor saved, and counted.

A canary request (a fraction ``canary.rate`` of those with a hit, or one whose
``kv_transfer_params`` say ``{"lmcache_p2p_canary": true}``) is offered no hit: the engine computes
it, and its worker compares what it computed with every owner's copy (``canary.py``).

A client (a router) that saw a prompt's chunks announced at etcd revision R (the entries'
``mod_revision``) can say so (``kv_transfer_params: {"lmcache_p2p_index_revision": R}``): while this
side's mirror has not followed the block entries to R and does not offer the whole prompt, the
request is not scheduled yet (vLLM asks again next step), for at most ``FRESHNESS_WAIT_S``; then it
is planned with what the mirror holds (``integrations/freshness.py``). Without it, a request arriving right
after the chunks reached etcd may find the mirror an event behind and be computed.

The rooms around this one: what is known of each request, in one record (``request_record.py``); what
of it is saved each step (``save_planning.py``) and which computed chunks a save keeps, with the keys
remembered as saved while the mirror does not follow etcd (``admission.py``); which requests are canaries
(``canary_sampling.py``); whether and how declared segments are blended (``blend_planning.py``); where a
hit's tokens are held, for vLLM's counters (``hit_sources.py``).

Why one file of this size: ``P2PScheduler`` is vLLM's scheduler-side hooks in the order vLLM calls them, each
handing to the rooms named above; what stays is the bookkeeping they share across steps (the requests' records, the
step's loads, the reset and the counters shipped to the workers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from ...aio import LoopThread
from ...config import AgentConfig
from ...ids import NodeId
from ...index.reader import IndexReader
from ...index.schema import NodeRecord
from ...keys import (
    ChunkKey,
    Fingerprint,
    FingerprintDigest,
    MultiModalItem,
    chunk_keys,
    partial_chunk_keys,
)
from ...peers import compatible
from ...plan import miss_reason
from ...request_params import CANARY_PARAM, REVISION_PARAM, RequestParams
from ...segments import BlendPlan, SegmentChunks, canonical_in_context, reads_question
from ...transfers import BlendTransfer, ChunkTransfer, chunk_transfer
from ..freshness import Freshness
from .admission import Admission
from .blend_planning import BlendPlanning
from .canary_sampling import CanarySampling
from .hit_sources import granted, hit_sources, where
from .identities import Identities, Identity
from .metadata import LMCacheP2PMetadata
from .request_record import UNREAD, RequestRecord
from .save_planning import SavePlanning

log = logging.getLogger(__name__)
RESET_CHECK_WAIT_S = 2.0  # a request held at most this long after a cache reset for the workers' weight check
BLEND_REFUSED = "blend"  # in a request's ``refused``: its blend was refused by this engine (counted once)


class P2PScheduler:
    def __init__(self, config: AgentConfig, fingerprint: Fingerprint, block_size: int, *,
                 blend_refusal: str | None = "not checked", token_budget: int | None = None,
                 index: IndexReader | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``index``: the view of the index it plans by (default: one it opens on etcd, on a loop of its own,
        and closes at shutdown; one given is the caller's to close); ``clock``: ``time.monotonic`` or a
        test's."""
        self._config = config
        self._fp = fingerprint.digest
        self._chunk = config.chunk_size
        self._block = block_size
        self._clock = clock
        self._loop: LoopThread | None = None
        if index is None:
            self._loop = LoopThread("lmcache-p2p-scheduler", role="scheduler")
            try:
                index = IndexReader.open(self._loop, config, self._fp)
            except Exception:
                self._loop.stop()
                raise
        self._index = index
        self._requests: dict[str, RequestRecord] = {}  # every request vLLM asked about and has not finished
        self._loads: list[ChunkTransfer] = []  # decided this step; handed to the worker in the next meta
        self._admission = Admission(config.chunk_size, save_after_sightings=config.tiers.save_after_sightings,
                                    min_save_tokens=config.tiers.min_save_tokens)
        self._saved = self._admission.saved  # asked of our worker (an LRU): held, while the mirror can't say
        self._saves = SavePlanning(config.chunk_size, block_size, self._admission)
        self._identities = Identities(self._fp)
        self._tls, self._transports = config.transfer.tls, config.transfer.transports
        self._canaries = CanarySampling(config.canary, clock=clock)
        self._refused: dict[str, int] = {}  # request parameters not honoured since the last step, by name
        self._missed: dict[str, int] = {}  # prompt tokens the cache could not give since the last step, by reason
        self._node_id, self._model_id = NodeId(config.node_id), fingerprint.model_id
        self._reset = False  # vLLM reset its caches: the workers drop their chunks at the next step
        self._resets = 0  # cache resets asked of the workers; hits are offered once they checked them all
        self._workers_reset = 0  # ... the resets every worker has checked the weights at (WorkerState)
        self._stopped_sharing: str | None = None  # a worker's weights changed in place: no hit, ever
        self._reset_at = 0.0  # when the last reset was asked (the clock)
        self._freshness = Freshness(clock=clock)  # requests waiting for the mirror to reach the revision they name
        self._finished: list[ChunkTransfer] = []  # tails of finished requests, for the next step's worker
        self._blending = BlendPlanning(config, block_size, blend_refusal=blend_refusal, token_budget=token_budget)
        self._blend_loads: list[BlendTransfer] = []  # decided this step; handed to the worker in the next meta
        self._unavailable: frozenset[str] = frozenset()  # peers the workers' pulls do not ask now (WorkerState)

    def _record(self, request: Any) -> RequestRecord:
        found = self._requests.get(request.request_id)
        if found is None:
            found = self._requests[request.request_id] = RequestRecord()
        return found

    def _usable(self, record: NodeRecord) -> bool:
        """An owner this engine's worker can pull from (the same rule its plan applies), and would ask now:
        one its pulls hold (an answer overdue: hung or slow) or back off is no hit (its load would fail at
        once, and the failed load cost the request a round of vLLM's steps on top of computing it)."""
        return (compatible(record, tls=self._tls, transports=self._transports)
                and not self._index.quarantine.blocked(record.node_id) and record.node_id not in self._unavailable)

    def _canary(self, request: Any, record: RequestRecord, hit: int, num_computed_tokens: int) -> bool:
        """Whether ``request`` is computed as a canary (asked for, or sampled among hits). Only when
        the engine computes every token itself: blocks from vLLM's own prefix cache may hold KV
        loaded from the mesh, which would make the reference the very bytes under test; and never
        for multimodal requests, whose item hashes a client can name (``multi_modal_uuids``)."""
        identity = record.identity
        if num_computed_tokens > 0 or (identity is not None and identity is not UNREAD and identity[1]):
            return False
        canary, refused = self._canaries.sampled(self._params(request, record).canary, hit)
        if refused:  # served as any other request
            self._refuse(record, request.request_id, CANARY_PARAM, "over canary.requested_per_minute")
        record.canary = record.canary or canary
        return canary

    def _params(self, request: Any, record: RequestRecord) -> RequestParams:
        """``request``'s ``kv_transfer_params``, read once; each malformed one refused (logged, counted)."""
        if record.params is None:
            record.params = RequestParams.parse(getattr(request, "kv_transfer_params", None),
                                                len(request.prompt_token_ids or ()))
            for name, why in record.params.malformed:
                self._refuse(record, request.request_id, name, why)
        return record.params

    def _refuse(self, record: RequestRecord, req_id: str, param: str, why: str) -> None:
        """A request parameter is not honoured: counted (``request_params_refused_total``) once per request."""
        if param in record.refused:
            return
        record.refused |= {param}
        self._refused[param] = self._refused.get(param, 0) + 1
        log.info("request %s: %s not honoured (%s)", req_id, param, why)

    def _identity(self, request: Any, record: RequestRecord) -> Identity | None:
        """The key chain's root and multimodal items of ``request`` (``identities.py``), read once per request;
        None when its KV can't be keyed."""
        if record.identity is UNREAD:
            record.identity = self._identities.of(request)
        return record.identity

    def _keys(self, tokens: list[int], root: FingerprintDigest, mm_items: tuple[MultiModalItem, ...]) -> list[ChunkKey]:
        return chunk_keys(root, tokens, self._chunk, mm_items=mm_items)

    def _prompt_keys(self, record: RequestRecord, prompt: list[int],
                     identity: Identity) -> list[ChunkKey]:
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
            return (None, False) if self._clock() - self._reset_at < RESET_CHECK_WAIT_S else (0, False)
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
        record.sources = hit_sources(keys, self._chunk, num_computed_tokens, exact, n, blend, self._where)
        if blend is not None:
            record.blend = blend
            # before vLLM allocates (a sync hit is cached there)
            record.salted_from = self._blending.salt(request, record.salted_from, blend.exact_end)
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
        return where(self._index.mirror.owners(key), self._config.node_id, key, self._saved)

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The external hit of ``request`` by where it was held when offered (``host``, ``disk``, ``p2p``),
        summing to ``num_external_tokens``."""
        record = self._requests.get(request.request_id)
        return granted(record.sources if record is not None else {}, num_external_tokens)

    def _declared(self, request: Any, record: RequestRecord, prompt: list[int], identity: Identity
                  ) -> list[SegmentChunks] | None:
        """The segments ``request`` declares, keyed, read once per request (``BlendPlanning.declared``)."""
        if record.segments is UNREAD:
            record.segments = self._blending.declared(request, self._params(request, record), prompt, identity)
        return record.segments

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
        self._blending.workers_told(refusals)

    def _blend(self, request: Any, record: RequestRecord, prompt: list[int], identity: Identity,
               exact_end: int) -> BlendPlan | None:
        """The blend that extends the exact hit (ending at ``exact_end``) over the request's cached
        segments, or None (``BlendPlanning.plan``); a blend refused by this engine counted once."""
        segments = self._declared(request, record, prompt, identity)
        if not segments:
            return None
        saved = () if self._index.connected else self._saved

        def held(keys: list[bytes]) -> bool:
            chunk_keys = [ChunkKey(k) for k in keys]
            return self._index.longest_prefix(chunk_keys, saved, self._usable) == len(chunk_keys)

        plan, refused = self._blending.plan(request.request_id, self._params(request, record), segments, len(prompt),
                                            exact_end, held)
        if refused and BLEND_REFUSED not in record.refused:
            record.refused |= {BLEND_REFUSED}  # asked of an engine set to blend that can't: counted once
            self._blending.refused += 1
        return plan

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
        if blend is None and not record.blended and self._blending.refusal is None:
            declared = self._declared(request, record, prompt, identity)  # those computed canonically: saved
            record.save_segments = canonical_in_context(declared or [], prompt, self._config.blend.lead_in) or None
        if num_external_tokens > 0:
            start = local_hit
            end = start + num_external_tokens
            block_ids = list(blocks.get_block_ids()[0])
            load_async, record.load_async = record.load_async, None
            sync = load_async is False
            revision = self._index.mirror.revision  # the worker plans once its mirror saw as much
            deadline = self._clock() + self._config.transfer.timeout_s  # one deadline, to the transport
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
                    question=prompt[blend.end:] if reads_question(blend.selection) else [], lead_in=blend.lead_in))
                self._admission.remember_saved(ChunkKey(k) for seg in blend.segments if seg.fresh for k in seg.keys)
                record.blended = True
            else:
                load = self._exact_load(request.request_id, record, prompt, keys, block_ids, start, end)
                load.sync, load.index_revision, load.deadline = sync, revision, deadline
                self._loads.append(load)
            record.loaded = True
        record.computing = True

    def _exact_load(self, req_id: str, record: RequestRecord, prompt: list[int], keys: list[ChunkKey],
                    block_ids: list[int], start: int, end: int) -> ChunkTransfer:
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
        meta.uncacheable = self._identities.take_uncacheable()
        meta.refused, self._refused = self._refused, {}
        meta.blend_refused = self._blending.take_refused()
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
            done = computed.get(req_id)
            if record.computing and record.keys is not None and done is not None:
                self._saves.after_step(req_id, record, done, meta)
        return meta

    def _computing(self, req_id: str) -> RequestRecord | None:
        record = self._requests.get(req_id)
        return record if record is not None and record.computing else None

    def request_finished(self, request: Any, block_ids: list[int] | None = None) -> bool:
        """Forget ``request``; True when its tail is to be saved: vLLM then keeps its blocks (``block_ids``,
        what vLLM holds for it) until the worker reports the request as sent (``get_finished``)."""
        record = self._requests.pop(request.request_id, None)  # a load already decided still runs: vLLM
        # holds the request's blocks until the worker reports it finished
        self._freshness.forget(request.request_id)
        try:
            tail = self._saves.finished_tail(record, block_ids) if record is not None and record.computing else None
        except Exception:  # never into vLLM's scheduler: the tail is simply not saved
            log.exception("request %s: its tail could not be planned; not saved", request.request_id)
            tail = None
        if tail is not None:
            self._finished.append(tail)
        return tail is not None

    def reset_cache(self) -> bool:
        """vLLM resets its caches (``reset_prefix_cache``, e.g. after a weight update): this engine's workers
        drop every chunk their agents hold (unannounced from the index) at the next step, and nothing this
        side remembers as saved counts as held any more. No hit is offered until every worker has compared
        its weights with those loaded at start (``WorkerState.resets``); if they changed, none again."""
        self._reset = True
        self._resets += 1
        self._reset_at = self._clock()
        self._saved.clear()
        log.info("lmcache-p2p: cache reset requested: this node's chunks are dropped at the next step")
        return True

    def shutdown(self) -> None:
        if self._loop is not None:  # the index it opened itself
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
