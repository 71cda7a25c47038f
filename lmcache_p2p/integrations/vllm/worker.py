"""Worker side (one per GPU / TP rank): the embedded cache agent and the engine's paged KV.

The worker composes one part per concern, each the only owner of its state:

    exact_loads.py    ExactLoads: a hit's chunks into the request's blocks (plan -> the agent's Loader ->
                      a private verified copy -> scatter)
    segment_loads.py  SegmentLoads: declared segments blended into the request's blocks (gather, place)
    saves.py          Saves: new chunks (and declared segments) gathered from the blocks into CPU slots
    canary_checks.py  CanaryChecks: a canary request's computed chunks against every owner's copy
    _Completions      (here) what the load threads hand back to vLLM: blocks to recompute, requests done

    start_load_kv:  sync loads (every chunk this engine's own): inline, on the forward thread
                    async loads: on the load threads (pulls until the deadline the scheduler side set),
                    reported through get_finished
                    a chunk that fails and every later one are reported by block id (no later than the
                    request's get_finished), so vLLM recomputes them (fail closed); a sync load fails
                    after vLLM planned this very step over it, so the forward pass computes over the
                    unloaded blocks: that step saves none of the request's chunks from the first failed
                    one on (their KV is wrong until vLLM recomputes them)
    wait_for_save:  the step's saves (synchronous gathers: the blocks may be reused after the step); a
                    finished request's tail is reported through get_finished once gathered (vLLM held
                    its blocks until then, whether or not it could be saved); a canary save is checked
    reset_cache:    (vLLM's reset after a weight update) every chunk dropped; the weights' digest taken
                    again (``identity.loaded_weights_digest``) on a thread of its own (seconds for a large
                    model on CPU: never on the forward pass), nothing loaded or saved meanwhile. Changed:
                    the agent is stopped (its lease revoked: its chunks leave the index; its server
                    closed) and nothing is loaded or saved until a restart derives the new weights'
                    fingerprint. Every load planned or in flight meanwhile is reported failed
                    (recomputed); the scheduler hears the outcome through WorkerState.

Why one file of this size: ``P2PWorker`` is the worker side's composition root: vLLM's worker-side hooks in the
order vLLM calls them, each handing to ExactLoads, SegmentLoads, Saves or CanaryChecks; what stays is the
bookkeeping they share across a step (loads in flight, completions, errors, cache resets and the weight check).
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import threading
import time
from typing import Any

import torch

from ... import cputime
from ...agent import CacheAgent
from ...aio import unpin_thread
from ...canary import Canary, MeshCopies
from ...config import AgentConfig, cluster_secret
from ...estimates import MIN_PREFILL_TOKENS
from ...identity import loaded_weights_digest
from ...kernels.layout import physical_view
from ...kernels.paged import PagedKV
from ...keys import Fingerprint, HeadRange, is_head_major
from ...transfers import BlendTransfer, ChunkTransfer, blocks_from
from ..kv_order import layout_order, observed_order, orders_agree
from .blend import Blender, blend_refusal, find_runner
from .canary_checks import CanaryChecks
from .exact_loads import ExactLoads
from .metadata import LMCacheP2PMetadata, WorkerState
from .saves import Saves
from .segment_loads import SegmentLoads
from .staged_loads import LoadParts

log = logging.getLogger(__name__)
IDLE_STEP_WAIT_S = 0.005  # see get_finished


class _Completions:
    """What loads hand back to vLLM, under one lock: blocks to recompute, requests whose asynchronous load
    is done, pulled blends waiting for the forward thread to place them. A request's failed blocks are
    handed over before its id."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.running = 0  # asynchronous loads submitted and not reported
        self.errors: set[int] = set()
        self.done: set[str] = set()
        # pulled blends (what loaded, blocks to recompute, whether anything is left to blend, the gathered KV)
        self.to_place: list[tuple[BlendTransfer, set[int], bool, list[Any]]] = []

    def started(self) -> None:
        with self.lock:
            self.running += 1

    def failed(self, blocks: set[int]) -> None:
        with self.lock:
            self.errors.update(blocks)

    def finished(self, req_id: str, failed: set[int]) -> None:
        with self.lock:
            self.errors.update(failed)
            self.done.add(req_id)
            self.running -= 1
            self.lock.notify_all()

    def gathered(self, t: BlendTransfer, failed: set[int], left: bool, kv: list[Any]) -> None:
        with self.lock:
            self.to_place.append((t, failed, left, kv))
            self.lock.notify_all()

    def take_to_place(self) -> list[tuple[BlendTransfer, set[int], bool, list[Any]]]:
        with self.lock:
            ready, self.to_place = self.to_place, []
        return ready

    def take_done(self, idle_step: bool) -> set[str]:
        with self.lock:
            if idle_step and self.running and not self.done:
                # vLLM steps without work while requests wait for their KV: a tight loop that, on a
                # small CPU host, starves the very threads moving the bytes. Wait a little for a load
                # to finish instead (never in a step with work to do).
                self.lock.wait(IDLE_STEP_WAIT_S)
            done, self.done = self.done, set()
        return done

    def take_errors(self) -> set[int]:
        with self.lock:
            errors, self.errors = self.errors, set()
        return errors


def _digest_later(model: Any) -> concurrent.futures.Future[bytes]:
    """:func:`loaded_weights_digest` of ``model``, read on a thread of its own."""
    future: concurrent.futures.Future[bytes] = concurrent.futures.Future()

    def read() -> None:
        try:
            future.set_result(loaded_weights_digest(model))
        except Exception as exc:  # told when compared: the node then stops sharing
            future.set_exception(exc)

    threading.Thread(target=read, name="lmcache-p2p-weights", daemon=True).start()
    return future


class P2PWorker:
    def __init__(self, config: AgentConfig, fingerprint: Fingerprint, block_size: int,
                 heads: HeadRange | None = None) -> None:
        self._config = config
        self._fingerprint = fingerprint
        self._heads = heads if heads is not None else (0, fingerprint.num_kv_heads)
        self._blocks_per_chunk = config.chunk_size // block_size
        self._block_size = block_size
        self.agent: CacheAgent | None = None
        self.blend_refusal: str | None = "blend.enabled is false"  # told to the scheduler (WorkerCapability)
        # The parts, once the engine's KV cache is known (attach)
        self.exact: ExactLoads | None = None
        self.segments: SegmentLoads | None = None
        self.saves: Saves | None = None
        self.canary: CanaryChecks | None = None
        # Asynchronous loads run on their own threads, so a hung peer never stalls the forward pass, and
        # several at once (``transfer.load_threads``), so one slow owner never holds the loads queued
        # behind it; each touches only its request's blocks.
        self._loader = concurrent.futures.ThreadPoolExecutor(config.transfer.load_threads,
                                                             thread_name_prefix="lmcache-p2p-load",
                                                             initializer=cputime.initializer("load", unpin_thread))
        self._completions = _Completions()
        self._tails_saved: set[str] = set()  # finished requests whose tails were gathered: their blocks can go
        self._unloaded: dict[str, set[int]] = {}  # this step's sync loads that failed: request -> blocks not loaded
        self._step_started: float | None = None
        self._idle_step = False
        self._step_tokens = 0
        # The weights as loaded (their digest) and how many cache resets were checked against them; why
        # this node stopped sharing (None: it shares)
        self._model: Any = None
        self._weights: concurrent.futures.Future[bytes] | None = None
        self._checking: concurrent.futures.Future[bytes] | None = None  # the digest after a reset, being read
        self._pending_resets = 0  # resets whose check is under way
        self.resets = 0
        self.stopped_sharing: str | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = list(kv_caches.values())
        kv_layout = self._config.layout.kv_layout
        observed, named = observed_order(layers[0]), layout_order(kv_layout)
        if not orders_agree(observed, named, layers[0].shape[1]):  # the fingerprint would name other bytes
            # Refused, not fatal: the engine serves as if the connector were not there
            self._stop_sharing(f"the KV cache tensors are laid out {observed} (read from their strides) but the "
                               f"layout fingerprint names {named} ({kv_layout})")
            return
        views = [physical_view(t) for t in layers]  # memory order: what the gather kernels read
        # Head-major layouts: chunks are stored by KV head, so engines sharded differently share them.
        split = self._heads[1] - self._heads[0] if is_head_major(kv_layout) else 1
        kv = PagedKV([v for v, _ in views], block_dim=views[0][1], heads=split)
        blender = self._find_blender(kv_caches, kv) if self._config.blend.enabled else None
        runner = find_runner()
        if runner is not None:
            self._model = runner.model
            # Read beside the engine's start (torch releases the GIL; ~20 s for 16 GB of weights on 2 CPU
            # cores, fast on a GPU); a reset waits for it. Weights updated while it reads them give a digest
            # no later read matches: the node stops sharing, the safe side.
            self._weights = _digest_later(self._model)
        else:
            log.warning("lmcache-p2p: vLLM's model runner was not found: a weight update in place cannot be told "
                        "from a cache reset here (restart the engine after updating its weights)")
        chunk_bytes = kv.payload_nbytes(self._blocks_per_chunk)
        agent = CacheAgent(self._config, self._fingerprint, chunk_bytes, secret=cluster_secret(self._config),
                           heads=self._heads).start()
        self.attach(agent, kv, blender)
        # Everything alive now (model, KV cache, engine state) is long-lived: keep it out of the
        # collector, whose full passes over it stalled the agent's loop for 20-80 ms (measured).
        # LMCACHE_P2P_GC_FREEZE=0 turns this off.
        if os.environ.get("LMCACHE_P2P_GC_FREEZE", "1") != "0":
            gc.freeze()
        log.info("lmcache-p2p worker: %d layers, chunk %d bytes, agent %s", len(kv_caches), chunk_bytes,
                 agent.node_id)

    def attach(self, agent: CacheAgent, kv: PagedKV | None, blender: Blender | None) -> None:
        """Build the parts over a started ``agent`` and the engine's paged KV (``kv`` None: no engine, as in
        tests of the blend bookkeeping; nothing is then loaded into or saved from blocks)."""
        self.agent = agent
        parts = LoadParts(loader=lambda: agent.loader, metrics=agent.metrics, prefill=agent.prefill,
                          timeout_s=self._config.transfer.timeout_s)
        self.exact = ExactLoads(parts, kv, self._config.layout.num_layers)
        self.saves = Saves(agent.intake, kv, blender)
        self.segments = SegmentLoads(parts, self.exact, self.saves, blender, self._block_size)
        if kv is not None:
            canary, metrics = self._config.canary, agent.metrics
            assert agent.puller is not None and agent.loop is not None  # started
            mesh = MeshCopies(node_id=agent.node_id, heads=agent.heads, fp=agent.fp,
                              tiers=agent.tiers, puller=agent.puller, loop=agent.loop,
                              pin_timeout_s=self._config.tiers.pin_timeout_s, index=lambda: agent.index,
                              usable=lambda record: agent.loader.usable(record), store=agent.store_chunks,
                              quarantine=agent.quarantine_owner)
            self.canary = CanaryChecks(Canary(mesh, self._config.layout.kv_dtype, tolerance=canary.tolerance,
                                              max_owners=canary.max_owners, timeout_s=canary.timeout_s,
                                              count=lambda outcome: metrics.canary_checks.labels(outcome).inc()),
                                       kv, self._config.chunk_size)

    def _find_blender(self, kv_caches: dict[str, torch.Tensor], kv: PagedKV) -> Blender | None:
        """Segment reuse (``blend.py``) where this engine allows it; else declared segments are reused
        as prefixes only, said once here."""
        runner = find_runner()
        try:
            if runner is None:
                raise ValueError("vLLM's model runner was not found above register_kv_caches")
            refusal = blend_refusal(runner.vllm_config)
            if refusal is not None:
                raise ValueError(refusal)
            blender = Blender(runner, kv_caches)
        except Exception as exc:  # never into vLLM: segments are then reused as prefixes only
            log.warning("lmcache-p2p: declared segments are reused as prefixes only: %s", exc)
            self.blend_refusal = str(exc) or type(exc).__name__
            return None
        payload = blender.token_nbytes() * self._config.chunk_size
        if payload > kv.payload_nbytes(self._blocks_per_chunk):
            log.warning("lmcache-p2p: a segment chunk (%d bytes) does not fit a slot; segments are not reused", payload)
            self.blend_refusal = f"a segment chunk ({payload} bytes) does not fit a slot"
            return None
        log.info("lmcache-p2p: segments reused at any position (K/V in the %s order, rotary dim %d)",
                 blender.key_layout, blender.spec.rotary_dim)
        self.blend_refusal = None
        return blender

    # -- steps: the engine's prefill rate, for the planner ---------------------------------------------
    def step_started(self, meta: LMCacheP2PMetadata) -> None:
        self._step_started, self._step_tokens = time.perf_counter(), meta.num_scheduled_tokens
        self._idle_step = meta.num_scheduled_tokens == 0 and not meta.loads and not meta.saves
        if self.agent is not None:
            for reason, n in meta.uncacheable.items():
                self.agent.metrics.uncacheable_requests.labels(reason).inc(n)
            for param, n in meta.refused.items():
                self.agent.metrics.request_params_refused.labels(param).inc(n)
            for reason, n in meta.missed.items():
                self.agent.metrics.count_misses(reason, n)
            for reason, n in meta.skipped.items():
                self.agent.metrics.admission_skipped.labels(reason).inc(n)
            if meta.blend_refused:
                self.agent.metrics.blend_requests.labels("refused").inc(meta.blend_refused)
            if meta.reset_cache:
                self._drop_all()
        if meta.reset_cache:
            self._check_weights()

    def _drop_all(self) -> None:
        """vLLM reset its caches: drop every chunk this rank's agent holds, in every tier (each is unannounced)."""
        agent = self.agent
        assert agent is not None
        dropped = sum(1 for key in list(agent.tiers.inventory()) if agent.tiers.remove(key))
        log.info("lmcache-p2p: cache reset: %d chunks of agent %s dropped", dropped, agent.node_id)

    def _check_weights(self) -> None:
        """After a cache reset: the weights' digest read again, off the forward pass (:meth:`_weights_checked`
        compares it once read; nothing is loaded or saved meanwhile)."""
        if self._model is None or self.stopped_sharing is not None:
            self.resets += 1
            return
        if self._checking is None:  # a reset during a check: the check under way reads the weights as they are
            self._checking = _digest_later(self._model)
        self._pending_resets += 1

    def _weights_checked(self) -> bool:
        """True when no check is under way (any that finished is settled here: the node stops sharing if the
        weights changed)."""
        checking = self._checking
        if checking is None:
            return True
        if not checking.done() or (self._weights is not None and not self._weights.done()):
            return False
        self._checking = None
        self.resets, self._pending_resets = self.resets + self._pending_resets, 0
        try:
            now = checking.result()
            at_start = self._weights.result() if self._weights is not None else None
        except Exception as exc:  # never into vLLM; unknown weights are not shared
            log.error("lmcache-p2p: the weights' digest failed: %r", exc)
            now, at_start = repr(exc).encode(), None
        if now == at_start:
            log.info("lmcache-p2p: cache reset with the weights unchanged: the node keeps sharing")
            return True
        before = at_start.hex() if at_start is not None else "?"
        self._stop_sharing(f"the model's weights changed in place (digest {before} -> {now.hex()}) under a "
                           "fingerprint named for the weights loaded at start")
        return True

    def _stop_sharing(self, why: str) -> None:
        """Nothing more is loaded, saved or served by this rank: its agent (if started) is stopped (lease
        revoked, server closed); loads planned from now on are reported failed, and the scheduler told."""
        self.stopped_sharing = why
        log.error("lmcache-p2p: %s: this node stops sharing KV (nothing of it is announced, nothing is loaded from "
                  "peers or the object store) until the engine is restarted", why)
        agent = self.agent
        self.exact = self.segments = self.saves = None
        if self.canary is not None:
            self.canary.shutdown()
            self.canary = None
        self.agent = None
        if agent is not None:  # off the forward pass (its lease revoked: an etcd round trip, or its timeout)
            threading.Thread(target=agent.stop, name="lmcache-p2p-stop", daemon=True).start()

    def step_finished(self) -> None:
        self._unloaded.clear()
        if self._step_started is not None and self.agent is not None:
            seconds, prefill = time.perf_counter() - self._step_started, self.agent.prefill
            predicted = prefill.recompute_s(self._step_tokens) if self._step_tokens >= MIN_PREFILL_TOKENS else None
            if predicted:  # what the planner would have expected of this step, against what it took
                self.agent.metrics.estimate_ratio.labels("recompute").observe(seconds / predicted)
            prefill.observe(self._step_tokens, seconds)
        self._step_started = None

    # -- load ------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: LMCacheP2PMetadata) -> None:
        self._place_pulled()
        segments, exact = self.segments, self.exact
        if self.stopped_sharing is not None or not self._weights_checked():
            self._fail_all(meta)  # nothing loaded while the weights are in question
            return
        if segments is None or exact is None:
            return
        for blend in meta.blends:
            if blend.sync:
                _, failed, _ = segments.blend(blend, remote=False)
                if failed:
                    self._unloaded[blend.req_id] = failed
                self._completions.failed(failed)
            else:
                self._completions.started()
                self._loader.submit(self._blend_async, blend, time.monotonic())
        for transfer in meta.loads:
            if transfer.sync:
                failed = exact.load(transfer, remote=False)
                if failed:
                    self._unloaded[transfer.req_id] = failed
                self._completions.failed(failed)
            else:
                self._completions.started()
                self._loader.submit(self._load_async, transfer, time.monotonic())

    def _fail_all(self, meta: LMCacheP2PMetadata) -> None:
        """Every load of this step reported failed: the engine computes them (after this node stopped sharing)."""
        transfers: list[BlendTransfer | ChunkTransfer] = [*meta.blends, *meta.loads]
        for t in transfers:
            if isinstance(t, BlendTransfer):
                failed = t.blocks(self._block_size) | (blocks_from(t.exact, 0) if t.exact is not None else set())
            else:
                failed = blocks_from(t, 0)
            if t.sync:
                self._unloaded[t.req_id] = failed
                self._completions.failed(failed)
            else:
                self._completions.started()
                self._completions.finished(t.req_id, failed)

    def _queued(self, submitted: float) -> None:
        if self.agent is not None:
            self.agent.metrics.load_queue_seconds.observe(time.monotonic() - submitted)

    def _load_async(self, t: ChunkTransfer, submitted: float) -> None:
        self._queued(submitted)
        try:
            assert self.exact is not None
            failed = self.exact.load(t, remote=True)
            if self.stopped_sharing is not None or self._checking is not None:  # weights in question meanwhile
                failed = blocks_from(t, 0)
        except Exception:  # a cache problem must never become a serving problem: recompute it all
            log.exception("request %s: asynchronous load failed; recomputing", t.req_id)
            failed = blocks_from(t, 0)
        self._completions.finished(t.req_id, failed)

    def _blend_async(self, t: BlendTransfer, submitted: float) -> None:
        """The load thread's part of a pulled blend; placing it waits for the forward thread."""
        self._queued(submitted)
        try:
            assert self.segments is not None
            loaded, failed, gathered = self.segments.blend(t, remote=True, place=False)
            left = loaded.end > loaded.exact_end and not failed >= loaded.blocks(self._block_size)
            if self.stopped_sharing is not None or self._checking is not None:  # weights in question meanwhile
                raise RuntimeError("this node stopped sharing, or checks its weights")
        except Exception:  # never leave the request waiting: the engine computes it
            log.exception("request %s: blend failed on the load thread", t.req_id)
            loaded, left, gathered = t, False, []
            failed = t.blocks(self._block_size) | (blocks_from(t.exact, 0) if t.exact is not None else set())
        self._completions.gathered(loaded, failed, left, gathered)

    def _place_pulled(self) -> None:
        """Place the pulled blends whose bytes arrived (forward thread), then report them."""
        for t, failed, left, gathered in self._completions.take_to_place():
            if left:
                try:
                    assert self.segments is not None
                    self.segments.place(t, gathered)
                    self.segments.count(t, partial=bool(failed))
                except Exception as exc:  # the engine computes it
                    log.warning("request %s: placing its blend failed (%s); recomputed by the engine", t.req_id, exc)
                    if self.agent is not None:
                        self.agent.metrics.blend_requests.labels("failed").inc()
                    failed = failed | t.blocks(self._block_size)
            self._completions.finished(t.req_id, failed)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Finished requests whose tails were gathered, and requests whose asynchronous load finished
        (loaded, or failed blocks already reported)."""
        done = self._completions.take_done(self._idle_step)
        sent, self._tails_saved = self._tails_saved, set()
        return sent, done

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._completions.take_errors()

    def state(self) -> WorkerState:
        """For the scheduler, after this step: the peers this rank's pulls do not ask now, the cache resets it
        checked the weights at, and why it stopped sharing (None: it shares)."""
        self._weights_checked()
        return WorkerState(self.agent.unavailable_peers() if self.agent is not None else frozenset(),
                           resets=self.resets, stopped_sharing=self.stopped_sharing)

    # -- save ---------------------------------------------------------------------------------------
    def wait_for_save(self, meta: LMCacheP2PMetadata) -> None:
        # nothing saved or held against peers' copies while the weights are in question (KV of new weights
        # under the old fingerprint; a canary would blame the peers)
        checked = self._weights_checked()
        saves, canary = (self.saves, self.canary) if checked else (None, None)
        for segments in meta.segment_saves:
            try:
                if segments.req_id in self._unloaded:
                    log.info("request %s: its load failed this step; its segments are not saved", segments.req_id)
                elif saves is not None:
                    saves.save_segments(segments)
            except Exception:  # a cache problem must never become a serving problem
                log.exception("request %s: saving its segments failed", segments.req_id)
        for transfer in meta.saves:
            try:
                if transfer.canary and canary is not None:
                    canary.check_later(transfer)
                if saves is not None:
                    saves.save(transfer, self._unloaded.get(transfer.req_id, set()))
            except Exception:  # a cache problem must never become a serving problem
                log.exception("request %s: saving its chunks failed", transfer.req_id)
            finally:
                if transfer.finished:
                    self._tails_saved.add(transfer.req_id)

    def shutdown(self) -> None:
        if self.canary is not None:
            self.canary.shutdown()
        self._loader.shutdown(wait=True, cancel_futures=True)
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
