"""Worker side (one per GPU / TP rank): the embedded cache agent and the engine's paged KV.

    start_load_kv:  sync loads (every chunk this engine's own): pin local slots -> a private verified
                    copy -> scatter, inline
                    async loads: handed to the load thread, which plans (local tiers, then peers)
                    and loads (``load.py``: the fetch-or-recompute budget, pulls until the deadline
                    the scheduler side set, pinned verified slots), scatters private verified
                    copies and reports the request through get_finished
                    a chunk that fails and every later one are reported by block id (no later
                    than the request's get_finished), so vLLM recomputes them (fail closed); a
                    sync load fails after vLLM planned this very step over it, so the forward
                    pass computes over the unloaded blocks: that step saves none of the
                    request's chunks from the first failed one on (their KV is wrong until
                    vLLM recomputes them)
    wait_for_save:  gather each new chunk from the engine's blocks straight into a reserved CPU
                    slot (synchronous: the blocks may be reused after the step), then checksum,
                    commit and publish in the background; a finished request's tail is reported
                    through get_finished once gathered (vLLM held its blocks until then, whether
                    or not it could be saved); a canary save (``canary.py``) also keeps
                    what the engine computed for each full chunk and, on the canary thread, holds
                    every owner's copy of it against that
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ... import cputime
from ...agent import CacheAgent
from ...aio import unpin_thread
from ...blocks import ChunkTransfer, blocks_from
from ...canary import Canary
from ...config import AgentConfig, cluster_secret
from ...estimates import MIN_PREFILL_TOKENS
from ...kernels.layout import physical_view
from ...kernels.paged import PagedKV
from ...keys import ChunkKey, Fingerprint, HeadRange, is_head_major
from ...plan import LOCAL
from ...segments import BlendTransfer, SegmentChunks, SegmentSave, merge_runs, subtract_runs
from ..kv_order import layout_order, observed_order, orders_agree
from .blend import Blender, blend_refusal, find_runner
from .metadata import LMCacheP2PMetadata

log = logging.getLogger(__name__)
IDLE_STEP_WAIT_S = 0.005  # see get_finished
INDEX_WAIT_S = 0.5  # at most, per load, for this rank's mirror to reach the scheduler's (one event behind)
CANARY_MAX_PENDING = 4  # canary checks waiting for the canary thread (the references are held in memory)
CANARY_MAX_CHUNKS = 16  # full chunks one canary check compares (the reference is copied on the forward thread)


class P2PWorker:
    def __init__(self, config: AgentConfig, fingerprint: Fingerprint, block_size: int,
                 heads: HeadRange | None = None) -> None:
        self._config = config
        self._fingerprint = fingerprint
        self._heads = heads if heads is not None else (0, fingerprint.num_kv_heads)
        self._blocks_per_chunk = config.chunk_size // block_size
        self._block_size = block_size
        self._kv: PagedKV | None = None
        self.agent: CacheAgent | None = None
        # Asynchronous loads run on their own threads, so a hung peer never stalls the forward pass, and
        # several at once (``transfer.load_threads``), so one slow owner never holds the loads queued
        # behind it; each touches only its request's blocks. Results are handed over under the lock: a
        # request's failed blocks before its id.
        self._loader = concurrent.futures.ThreadPoolExecutor(config.transfer.load_threads,
                                                             thread_name_prefix="lmcache-p2p-load",
                                                             initializer=cputime.initializer("load", unpin_thread))
        self._done_lock = threading.Condition()
        self._loads_running = 0
        self._load_errors: set[int] = set()
        self._loads_done: set[str] = set()
        self._tails_saved: set[str] = set()  # finished requests whose tails were gathered: their blocks can go
        self._unloaded: dict[str, set[int]] = {}  # this step's sync loads that failed: request -> blocks not loaded
        self._step_started: float | None = None
        self._idle_step = False
        self._step_tokens = 0
        self._canary: Canary | None = None
        self._checks: list[concurrent.futures.Future[Any]] = []  # canary checks submitted, not yet done
        self._checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-p2p-canary",
                                                              initializer=cputime.initializer("canary", unpin_thread))
        self._blender: Blender | None = None
        # pulled blends (what loaded, blocks to recompute, whether anything is left to blend): the
        # recompute runs on the forward thread
        self._recompute: list[tuple[BlendTransfer, set[int], bool, list[Any]]] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = list(kv_caches.values())
        kv_layout = self._config.layout.kv_layout
        observed, named = observed_order(layers[0]), layout_order(kv_layout)
        if not orders_agree(observed, named, layers[0].shape[1]):  # the fingerprint would name other bytes
            raise ValueError(f"lmcache-p2p: the KV cache tensors are laid out {observed} (read from their strides) "
                             f"but the layout fingerprint names {named} ({kv_layout}): refusing to share them")
        views = [physical_view(t) for t in layers]  # memory order: what the gather kernels read
        # Head-major layouts: chunks are stored by KV head, so engines sharded differently share them.
        split = self._heads[1] - self._heads[0] if is_head_major(kv_layout) else 1
        self._kv = PagedKV([v for v, _ in views], block_dim=views[0][1], heads=split)
        self.blend_refusal: str | None = "blend.enabled is false"  # told to the scheduler (WorkerCapability)
        self._blender = self._find_blender(kv_caches) if self._config.blend.enabled else None
        chunk_bytes = self._kv.payload_nbytes(self._blocks_per_chunk)
        self.agent = CacheAgent(self._config, self._fingerprint, chunk_bytes,
                                secret=cluster_secret(self._config), heads=self._heads).start()
        canary = self._config.canary
        metrics = self.agent.metrics
        self._canary = Canary(self.agent, self._config.layout.kv_dtype, tolerance=canary.tolerance,
                              max_owners=canary.max_owners, timeout_s=canary.timeout_s,
                              count=lambda outcome: metrics.canary_checks.labels(outcome).inc())
        # Everything alive now (model, KV cache, engine state) is long-lived: keep it out of the
        # collector, whose full passes over it stalled the agent's loop for 20-80 ms (measured).
        # LMCACHE_P2P_GC_FREEZE=0 turns this off.
        if os.environ.get("LMCACHE_P2P_GC_FREEZE", "1") != "0":
            gc.freeze()
        log.info("lmcache-p2p worker: %d layers, chunk %d bytes, agent %s", len(kv_caches), chunk_bytes,
                 self.agent.node_id)

    def _find_blender(self, kv_caches: dict[str, torch.Tensor]) -> Blender | None:
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
        assert self._kv is not None
        if payload > self._kv.payload_nbytes(self._blocks_per_chunk):
            log.warning("lmcache-p2p: a segment chunk (%d bytes) does not fit a slot; segments are not reused", payload)
            self.blend_refusal = f"a segment chunk ({payload} bytes) does not fit a slot"
            return None
        log.info("lmcache-p2p: segments reused at any position (keys %s-major, rotary dim %d)", blender.key_layout,
                 blender.spec.rotary_dim)
        self.blend_refusal = None
        return blender

    # -- steps: the engine's prefill rate, for the planner ---------------------------------------------
    def step_started(self, meta: LMCacheP2PMetadata) -> None:
        self._step_started, self._step_tokens = time.perf_counter(), meta.num_scheduled_tokens
        self._idle_step = meta.num_scheduled_tokens == 0 and not meta.loads and not meta.saves
        if self.agent is not None:
            for reason, n in meta.uncacheable.items():
                self.agent.metrics.uncacheable_requests.labels(reason).inc(n)

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
        self._recompute_pulled()
        for blend in meta.blends:
            if blend.sync:
                _, failed, _ = self._blend(blend, remote=False)
                if failed:
                    self._unloaded[blend.req_id] = failed
                with self._done_lock:
                    self._load_errors.update(failed)
            else:
                with self._done_lock:
                    self._loads_running += 1
                self._loader.submit(self._blend_async, blend, time.monotonic())
        for transfer in meta.loads:
            if transfer.sync:
                failed = self._load(transfer, remote=False)
                if failed:
                    self._unloaded[transfer.req_id] = failed
                with self._done_lock:
                    self._load_errors.update(failed)
            else:
                with self._done_lock:
                    self._loads_running += 1
                self._loader.submit(self._load_async, transfer, time.monotonic())

    def _queued(self, submitted: float) -> None:
        if self.agent is not None:
            self.agent.metrics.load_queue_seconds.observe(time.monotonic() - submitted)

    def _load_async(self, t: ChunkTransfer, submitted: float) -> None:
        self._queued(submitted)
        try:
            failed = self._load(t, remote=True)
        except Exception:  # a cache problem must never become a serving problem: recompute it all
            log.exception("request %s: asynchronous load failed; recomputing", t.req_id)
            failed = blocks_from(t, 0)
        with self._done_lock:
            self._load_errors.update(failed)
            self._loads_done.add(t.req_id)
            self._loads_running -= 1
            self._done_lock.notify_all()

    # -- blends (segments.py, blend.py) -------------------------------------------------------------
    # A blend runs in two parts: *gather* (the exact prefix into place, held segment chunks pulled or
    # pinned and decoded: the load thread for a pulled blend) and *place* (the forward thread, which
    # owns the model): fresh segments computed after the base alone and saved, every segment written
    # at its position, the recompute. Nothing of the segment region is written before *place*: a
    # fresh segment's computation uses the region's blocks as scratch.

    def _blend(self, t: BlendTransfer, remote: bool, place: bool = True) -> tuple[BlendTransfer, set[int], list[Any]]:
        """Gather ``t`` (and, ``place``: place it, here on the forward thread). Returns what is to be
        blended (``t`` cut where its segments stopped loading), the blocks vLLM must recompute (from
        the cut on; all of them when anything else fails) and the gathered segment KV (to place)."""
        assert self.agent is not None
        metrics = self.agent.metrics
        # the exact prefix's blocks count as not filled until its load says otherwise: a blend that fails
        # before or inside that load reports them too (vLLM must never run over blocks nobody filled)
        exact_failed: set[int] = blocks_from(t.exact, 0) if t.exact is not None else set()
        failed: set[int] = set()
        try:
            if self._blender is None:
                raise ValueError("this engine can't blend (see the warning at start)")
            if t.exact is not None:
                exact_failed = self._load(t.exact, remote=remote)
                if exact_failed:
                    raise ValueError("its exact prefix did not load")
            cut, gathered = self._gather_segments(t, remote)
            if cut < t.end:  # a chunk not loaded (a dead owner, a corrupt copy, the planner's budget)
                log.info("request %s: segments loaded up to position %d of %d; the engine computes the rest",
                         t.req_id, cut, t.end)
                failed = set(t.block_ids[cut // self._block_size: -(-t.end // self._block_size)])
                t = dataclasses.replace(t, end=cut, recompute=[(s, min(e, cut)) for s, e in t.recompute if s < cut])
                if cut <= t.exact_end:  # not one segment token reused: counted here, nothing left to place
                    metrics.blend_requests.labels("failed").inc()
                    return t, failed, []
            if place:
                self._place(t, gathered)
        except Exception as exc:  # a cache problem must never become a serving problem: the engine computes it
            log.info("request %s: blend failed (%s); %d tokens recomputed by the engine", t.req_id, exc,
                     t.end - t.exact_end)
            metrics.blend_requests.labels("failed").inc()
            # everything it was to fill: from the exact prefix's end (the whole prefix too when its load
            # did not finish) to the end it had before a cut (``failed``: the blocks past the cut)
            return t, t.blocks(self._block_size) | exact_failed | failed, []
        if place:
            self._count_blend(t, partial=bool(failed))
            return t, failed, []
        return t, failed, gathered

    def _count_blend(self, t: BlendTransfer, partial: bool) -> None:
        assert self.agent is not None
        recomputed = sum(e - s for s, e in t.recompute) + t.select
        metrics = self.agent.metrics
        metrics.blend_requests.labels("partial" if partial else "loaded").inc()
        metrics.blend_tokens.labels("recomputed").inc(recomputed)
        metrics.blend_tokens.labels("segment").inc(max(t.end - t.exact_end - recomputed, 0))

    def _gather_segments(self, t: BlendTransfer, remote: bool) -> tuple[int, list[tuple[torch.Tensor, int, int]]]:
        """Pull (or pin locally) the held segment chunks of ``t`` and decode the positions they cover, up
        to the first chunk not loaded. Returns where that is (``t.end``: everything) and the pieces:
        ``(kv, first position, segment start)``."""
        assert self.agent is not None and self._blender is not None
        agent, blender = self.agent, self._blender
        held = [seg for seg in t.segments if not seg.fresh]
        keys, spans, pos = [], [], 0
        for seg in held:
            for k, n in zip(seg.keys, seg.num_tokens, strict=True):
                keys.append(ChunkKey(k))
                spans.append((pos, pos + n))
                pos += n
        deadline = self._deadline(t)
        if remote and keys:
            self._wait_for_index(t, keys, deadline)
        plan = agent.plan(keys, spans, pos)
        if len(plan.chunks) < len(keys):
            log.info("request %s: segment chunk %d of %d has no usable owner in this node's mirror", t.req_id,
                     len(plan.chunks) + 1, len(keys))
        pins = agent.load_pinned(plan, deadline, remote=remote, label=f"request {t.req_id}: ") if plan.chunks else []
        gathered: list[tuple[torch.Tensor, int, int]] = []
        try:
            i = 0
            for seg in held:
                first = 0  # the chunk's first token in its segment
                for n in seg.num_tokens:
                    lo = max(seg.start + first, seg.start + seg.skip)
                    hi = min(seg.start + first + n, seg.end)
                    pin = pins[i] if i < len(pins) else None
                    staged = agent.tiers.cpu.stage(pin) if pin is not None else None
                    if pin is not None and staged is None:
                        agent.metrics.checksum_failures.inc()
                        log.warning("request %s: segment chunk %d changed in memory after it was stored", t.req_id, i)
                    if staged is None:
                        if i < len(plan.chunks):
                            log.info("request %s: segment chunk %d of %d (from %s) not loaded", t.req_id, i + 1,
                                     len(keys), plan.chunks[i].source)
                        return min(lo, t.end), gathered
                    if lo < hi:
                        kv = blender.decode(staged, n)[:, :, lo - seg.start - first: hi - seg.start - first]
                        gathered.append((kv, lo, seg.start))
                    first += n
                    i += 1
            return t.end, gathered
        finally:
            for pin in pins:
                if pin is not None:
                    agent.unpin_chunk(pin)

    def _place(self, t: BlendTransfer, gathered: list[tuple[torch.Tensor, int, int]]) -> None:
        """The forward thread's part: fresh segments, every segment at its position, the recompute."""
        assert self._blender is not None
        blender = self._blender
        runs = list(t.recompute)
        fresh = [seg for seg in t.segments if seg.fresh and seg.start + seg.skip < t.end]
        if fresh:
            base = [(s, min(e, t.base_end)) for s, e in runs if s < t.base_end]
            if base:  # the base in place first (fresh segments attend to it): a prefix, computed exactly
                blender.recompute(t.token_ids, base, t.block_ids)
                runs = subtract_runs(runs, base)
            pieces, unplaced = self._fresh(t, fresh)
            gathered = gathered + pieces
            runs += unplaced
        for kv, at, turn in gathered:
            blender.write(kv, t.block_ids, at, turn)
        if t.select:
            segment_runs = [(seg.start + seg.skip, min(seg.end, t.end)) for seg in t.segments]
            candidates = subtract_runs(segment_runs, runs)
            runs += blender.deviating(t.token_ids, t.block_ids, (t.exact_end, t.end), candidates, t.select)
        blender.recompute(t.token_ids, merge_runs(runs), t.block_ids)

    def _fresh(self, t: BlendTransfer, fresh: list[SegmentChunks]) -> tuple[list[tuple[torch.Tensor, int, int]],
                                                                               list[tuple[int, int]]]:
        """Compute each fresh segment after the base alone, in the blend region's own blocks (scratch:
        the base's KV copied to its start), save it under its keys and return it to be placed; a
        segment the scratch can't hold (or whose last token the request does not give) is recomputed
        in place instead (returned as a run) and not saved."""
        assert self._blender is not None
        blender, bs, base = self._blender, self._block_size, t.base_end
        # blocks wholly inside the region and past the base (which the fresh computations read)
        scratch = t.block_ids[-(-max(t.exact_end, base) // bs): t.end // bs]
        pieces: list[tuple[torch.Tensor, int, int]] = []
        unplaced: list[tuple[int, int]] = []
        copied = False
        for seg in fresh:
            lo, hi = seg.start + seg.skip, min(seg.end, t.end)
            if -(-(base + seg.length) // bs) > len(scratch) or len(t.token_ids) < seg.start + seg.length:
                log.info("request %s: a fresh segment at %d is computed in this context only (no scratch for it); "
                         "not saved", t.req_id, seg.start)
                unplaced.append((lo, hi))
                continue
            if not copied:
                blender.write(blender.read(t.block_ids, 0, base, 0), scratch, 0, 0)
                copied = True
            kv = blender.isolated(t.token_ids[:base] + t.token_ids[seg.start: seg.start + seg.length], base, scratch)
            self._store_segment(t.req_id, seg, _slicer(kv))
            pieces.append((kv[:, :, lo - seg.start: hi - seg.start], lo, seg.start))
        if self.agent is not None and pieces:
            self.agent.metrics.blend_tokens.labels("fresh").inc(sum(kv.shape[2] for kv, _, _ in pieces))
        return pieces, unplaced

    def _blend_async(self, t: BlendTransfer, submitted: float) -> None:
        """The load thread's part of a pulled blend; placing it waits for the forward thread."""
        self._queued(submitted)
        try:
            loaded, failed, gathered = self._blend(t, remote=True, place=False)
            left = loaded.end > loaded.exact_end and not failed >= loaded.blocks(self._block_size)
        except Exception:  # never leave the request waiting: the engine computes it
            log.exception("request %s: blend failed on the load thread", t.req_id)
            loaded, left, gathered = t, False, []
            failed = t.blocks(self._block_size) | (blocks_from(t.exact, 0) if t.exact is not None else set())
        with self._done_lock:
            self._recompute.append((loaded, failed, left, gathered))
            self._done_lock.notify_all()

    def _recompute_pulled(self) -> None:
        """Place the pulled blends whose bytes arrived (forward thread), then report them."""
        with self._done_lock:
            ready, self._recompute = self._recompute, []
        for t, failed, left, gathered in ready:
            if left:
                try:
                    self._place(t, gathered)
                    self._count_blend(t, partial=bool(failed))
                except Exception as exc:  # the engine computes it
                    log.warning("request %s: placing its blend failed (%s); recomputed by the engine", t.req_id, exc)
                    assert self.agent is not None
                    self.agent.metrics.blend_requests.labels("failed").inc()
                    failed = failed | t.blocks(self._block_size)
            with self._done_lock:
                self._load_errors.update(failed)
                self._loads_done.add(t.req_id)
                self._loads_running -= 1

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Finished requests whose tails were gathered, and requests whose asynchronous load finished
        (loaded, or failed blocks already reported)."""
        with self._done_lock:
            if self._idle_step and self._loads_running and not self._loads_done:
                # vLLM steps without work while requests wait for their KV: a tight loop that, on a
                # small CPU host, starves the very threads moving the bytes. Wait a little for a load
                # to finish instead (never in a step with work to do).
                self._done_lock.wait(IDLE_STEP_WAIT_S)
            done, self._loads_done = self._loads_done, set()
        sent, self._tails_saved = self._tails_saved, set()
        return sent, done

    def _load(self, t: ChunkTransfer, remote: bool) -> set[int]:
        """Load ``t``'s chunks into its blocks; returns the blocks that must be recomputed."""
        assert self.agent is not None and self._kv is not None
        agent = self.agent
        t0 = time.perf_counter()
        keys = [ChunkKey(k) for k in t.keys]
        spans, pos = [], 0
        for n in t.num_tokens:
            spans.append((pos, pos + n))
            pos += n
        deadline = self._deadline(t)
        if remote:
            self._wait_for_index(t, keys, deadline)
        plan = agent.plan(keys, spans, pos)
        agent.count_lookup(plan, 0)
        t1 = time.perf_counter()
        pins = agent.load_pinned(plan, deadline, remote=remote, label=f"request {t.req_id}: ") if plan.chunks else []
        t2 = time.perf_counter()
        failed: set[int] = set()
        try:
            for i, blocks in enumerate(t.block_ids):
                pin = pins[i] if i < len(pins) else None
                if pin is not None and pin.header.length != self._kv.payload_nbytes(len(blocks)):
                    log.error("request %s: chunk %d is %d bytes, its %d blocks need %d: layout mismatch", t.req_id,
                              i, pin.header.length, len(blocks), self._kv.payload_nbytes(len(blocks)))
                    pin = None
                if pin is None:
                    failed = blocks_from(t, i)
                    if i >= len(plan.chunks):  # offered by the scheduler side, but no owner this worker may ask
                        agent.metrics.load_failures.labels("no_usable_owner").inc(len(keys) - i)
                    why = ("no usable owner (backed off, awaited for an overdue answer, or gone)"
                           if i >= len(plan.chunks) else "its pull missed or was declined")
                    log.info("request %s: chunk %d of %d not loaded: %s; %d blocks recomputed", t.req_id, i,
                             len(keys), why, len(failed))
                    break
                # Scattered from a private copy verified there: pool slots are registered memory a peer
                # may write to, so bytes checked in a slot are not the bytes the engine would read.
                staged = agent.tiers.cpu.stage(pin)
                if staged is None:
                    agent.metrics.checksum_failures.inc()
                    failed = blocks_from(t, i)
                    log.warning("request %s: chunk %d changed in memory after it was stored; %d blocks recomputed",
                                t.req_id, i, len(failed))
                    break
                self._scatter(staged, blocks, t.skip_blocks if i == 0 else 0)
        finally:
            for pin in pins:
                if pin is not None:
                    agent.unpin_chunk(pin)
        log.debug("request %s: %d chunks (%d from peers) plan %.2f ms, load %.2f ms, scatter %.2f ms", t.req_id,
                  len(keys), len(plan.chunks) - len(plan.by_source().get(LOCAL, [])), 1e3 * (t1 - t0),
                  1e3 * (t2 - t1), 1e3 * (time.perf_counter() - t2))
        return failed

    def _wait_for_index(self, t: ChunkTransfer | BlendTransfer, keys: list[ChunkKey], deadline: float) -> None:
        """Give this rank's mirror (at most ``INDEX_WAIT_S``) to reach the revision its scheduler offered from."""
        assert self.agent is not None
        if not self.agent.wait_for_index(keys, t.index_revision, min(deadline, time.monotonic() + INDEX_WAIT_S)):
            log.info("request %s: this rank's mirror did not reach the scheduler's revision %d in time", t.req_id,
                     t.index_revision)

    def _deadline(self, t: ChunkTransfer | BlendTransfer) -> float:
        """The load's absolute deadline, set by the scheduler side when it offered the hit (one host, one
        monotonic clock); never more than ``transfer.timeout_s`` from now (a rank on another host, whose
        clock differs, or a transfer from an older scheduler without one)."""
        latest = time.monotonic() + self._config.transfer.timeout_s
        return latest if t.deadline <= 0 else min(t.deadline, latest)

    def _scatter(self, staging: torch.Tensor, blocks: list[int], skip: int) -> None:
        assert self._kv is not None
        nbytes = self._kv.payload_nbytes(len(blocks))
        payload = staging[:nbytes]
        if skip:
            # Payload is head-major, then layer-major; drop the first ``skip`` blocks of every head and
            # layer (they belong to vLLM's own prefix cache and may be shared with other requests).
            heads, layers = self._kv.geometry.heads, self._num_layers()
            parts = payload.view(heads, layers, len(blocks), self._kv.payload_nbytes(1) // (layers * heads))
            payload = parts[:, :, skip:, :].contiguous().view(-1)
            blocks = blocks[skip:]
        if blocks:
            self._kv.scatter(payload, torch.tensor(blocks, dtype=torch.int64))

    def _num_layers(self) -> int:
        assert self.agent is not None
        return self.agent.config.layout.num_layers

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._done_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- save ---------------------------------------------------------------------------------------
    def wait_for_save(self, meta: LMCacheP2PMetadata) -> None:
        for segments in meta.segment_saves:
            try:
                self._save_segments(segments)
            except Exception:  # a cache problem must never become a serving problem
                log.exception("request %s: saving its segments failed", segments.req_id)
        for transfer in meta.saves:
            try:
                self._save(transfer)
            except Exception:  # a cache problem must never become a serving problem
                log.exception("request %s: saving its chunks failed", transfer.req_id)
            finally:
                if transfer.finished:
                    self._tails_saved.add(transfer.req_id)

    def _save(self, t: ChunkTransfer) -> None:
        agent, kv = self.agent, self._kv
        assert agent is not None and kv is not None
        if t.canary:
            self._check_later(t)
        if not t.generated:
            computed = [n for k, n in zip(t.keys, t.num_tokens, strict=True) if not agent.holds(ChunkKey(k))]
            agent.metrics.miss_tokens.inc(sum(computed))  # prompt tokens the engine computed: nothing held them
        unloaded = self._unloaded.get(t.req_id, set())
        for key, ntok, blocks in zip(t.keys, t.num_tokens, t.block_ids, strict=True):
            if unloaded.intersection(blocks):
                log.info("request %s: its load failed this step; its chunks from there on are not saved", t.req_id)
                return
            if agent.holds(ChunkKey(key)) or not blocks:
                continue
            nbytes = kv.payload_nbytes(len(blocks))
            try:
                res = agent.reserve_chunk()
            except Exception as exc:  # a full, pinned pool must not fail the forward pass
                log.warning("request %s: no slot to save a chunk: %s", t.req_id, exc)
                return
            try:
                out = torch.frombuffer(res.view, dtype=torch.uint8, count=nbytes)
                kv.gather(torch.tensor(blocks, dtype=torch.int64), out)
            except Exception as exc:  # the slot goes back; the chunk is simply not cached
                agent.release_chunk(res)
                log.warning("request %s: gathering a chunk failed: %s", t.req_id, exc)
                return
            agent.commit_chunk(res, ChunkKey(key), ntok, nbytes)

    def _save_segments(self, t: SegmentSave) -> None:
        """The declared segments a request computed right after its base (``scheduler.py``: its first),
        from its blocks, keys turned to the segment's position 0 (``blend.py``)."""
        blender = self._blender
        if self.agent is None or blender is None:
            return
        if t.req_id in self._unloaded:
            log.info("request %s: its load failed this step; its segments are not saved", t.req_id)
            return
        for seg in t.segments:
            def kv_of(first: int, n: int, seg: SegmentChunks = seg) -> torch.Tensor:
                return blender.read(t.block_ids, seg.start + first, seg.start + first + n, seg.start)
            self._store_segment(t.req_id, seg, kv_of)

    def _store_segment(self, req_id: str, seg: SegmentChunks, kv_of: Callable[[int, int], torch.Tensor]) -> None:
        """Store ``seg``'s chunks not held yet; ``kv_of(first, n)``: the KV of its tokens ``[first, first + n)``."""
        agent = self.agent
        assert agent is not None
        first = 0
        for key, n in zip(seg.keys, seg.num_tokens, strict=True):
            first += n
            if agent.holds(ChunkKey(key)):
                continue
            kv = kv_of(first - n, n)
            nbytes = kv.numel() * kv.element_size()
            try:
                res = agent.reserve_chunk()
            except Exception as exc:  # a full, pinned pool must not fail the forward pass
                log.warning("request %s: no slot to save a segment chunk: %s", req_id, exc)
                return
            try:
                torch.frombuffer(res.view, dtype=torch.uint8, count=nbytes).copy_(kv.contiguous().view(-1)
                                                                                    .view(torch.uint8))
            except Exception:
                agent.release_chunk(res)
                raise
            agent.commit_chunk(res, ChunkKey(key), n, nbytes)

    def _check_later(self, t: ChunkTransfer) -> None:
        """Copy what the engine computed for each full chunk of ``t`` (its blocks are reused after
        this step), then compare every owner's copy with it on the canary thread. At most
        ``CANARY_MAX_PENDING`` checks wait, each of at most ``CANARY_MAX_CHUNKS`` chunks: a flood of
        canary requests is skipped, and a failure here only skips the check."""
        assert self._kv is not None and self._canary is not None
        self._checks = [f for f in self._checks if not f.done()]
        if len(self._checks) >= CANARY_MAX_PENDING:
            log.warning("request %s: %d canary checks are waiting; this one is skipped", t.req_id, len(self._checks))
            return
        chunks: list[tuple[ChunkKey, int, int, bytes]] = []
        start = 0
        try:
            for key, ntok, blocks in zip(t.keys, t.num_tokens, t.block_ids, strict=True):
                if ntok == self._config.chunk_size and blocks and len(chunks) < CANARY_MAX_CHUNKS:
                    out = torch.empty(self._kv.payload_nbytes(len(blocks)), dtype=torch.uint8)
                    self._kv.gather(torch.tensor(blocks, dtype=torch.int64), out)
                    chunks.append((ChunkKey(key), start, start + ntok, out.numpy().tobytes()))
                start += ntok
        except Exception as exc:  # a cache problem must never become a serving problem
            log.warning("request %s: canary gather failed, no check: %s", t.req_id, exc)
            return
        if chunks:
            future = self._checker.submit(self._canary.check, chunks)
            future.add_done_callback(_log_failure)
            self._checks.append(future)

    def shutdown(self) -> None:
        self._checker.shutdown(wait=True, cancel_futures=True)
        self._loader.shutdown(wait=True, cancel_futures=True)
        if self.agent is not None:
            self.agent.stop()
            self.agent = None


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("canary check failed", exc_info=future.exception())


def _slicer(kv: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
    """``kv``'s tokens ``[first, first + n)`` (a segment's KV, to store chunk by chunk)."""
    return lambda first, n: kv[:, :, first:first + n]
