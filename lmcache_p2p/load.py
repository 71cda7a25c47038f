"""Loading a hit plan: the one path from a prompt to verified chunks, for the engine and the agent's API.

    keys ──plan────▶ the longest run of leading chunks held here or by a usable owner in the index mirror
    plan ──budget──▶ the leading chunks whose pulls beat recomputing (remote loads only)
         ──pull────▶ peers' chunks into the CPU pool, verified on arrival, until the deadline
         ──pin─────▶ one pinned, re-verified CPU slot per chunk (None: not to be had; the caller
                     recomputes it and everything after it)

:class:`Loader` owns the whole path, built by the agent once its parts are up (tiers, index, transports,
the object tier, the quarantine, estimates, metrics) and given them, never the agent: the worker connector
(``integrations/vllm/worker.py``) scatters its pins into the engine's blocks, :meth:`CacheAgent.load`
copies them out; both go through :meth:`Loader.load_pinned`. The object store is one more owner to the
planner and the puller (``@objects``, behind its own transport, ``objects/transport.py``): planned like a slow
peer (its measured latency and bandwidth in the same estimates), retried and backed off by the same rules,
and read for a chunk a peer failed to send while time is left.

One deadline: absolute, on ``time.monotonic()`` (one clock for every process of a host, so the
scheduler side sets it when it offers the hit and its workers keep it). The budget may only bring
it closer (a pull expected to take 5 ms gets ~15 ms from when the pulls start, not the request's
whole allowance); it then goes unchanged to :meth:`Puller.pull` and the transports. Nothing converts it back and forth.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .aio import remaining
from .chunk import verify
from .config import TierConfig, TransferConfig
from .errors import ChunkError, TierError
from .estimates import PeerEstimates, PrefillRate
from .ids import OBJECTS, NodeId
from .index.protocol import BlockIndex
from .index.quarantine import Quarantine
from .index.schema import NodeRecord
from .keys import ChunkKey, FingerprintDigest, HeadRange, chunk_keys, chunk_spans, tokens_to_array
from .metrics import AgentMetrics
from .plan import LOCAL, FetchBudget, HitPlan, PlannedChunk, fetch_budget, make_plan, miss_reason
from .tiers import Pin, TieredStore
from .transfer.pull import Puller

if TYPE_CHECKING:
    from .objects.tier import ObjectTier

log = logging.getLogger(__name__)


def keys_of(fp: FingerprintDigest, token_ids: Sequence[int] | np.ndarray,
            chunk_size: int) -> tuple[list[ChunkKey], list[tuple[int, int]]]:
    """A prompt's chunk keys and their token spans."""
    arr = tokens_to_array(token_ids)
    return chunk_keys(fp, arr, chunk_size), chunk_spans(len(arr), chunk_size)


def local_plan(tiers: TieredStore, heads: HeadRange, keys: Sequence[ChunkKey], spans: Sequence[tuple[int, int]],
               num_tokens: int) -> HitPlan:
    """The plan of a node that has no mesh (not started, or stopping): what its own tiers hold."""
    return make_plan(keys, spans, local=lambda k: tiers.holds(k, heads), owners=lambda ks: [{} for _ in ks],
                     usable=lambda _n: False, inflight={}, num_tokens=num_tokens, need=heads)


class Loader:
    """Plan -> budget -> pull (peers, the object store) -> pin -> re-verify, for one agent's tiers.

    ``on_hit``: told each chunk handed over (the hand-off's hit counts); ``dropped``: whether this node
    held a chunk lately (a miss of it is an eviction); ``model_id``: the model this node serves.
    ``puller`` is None where the agent has no transports: remote chunks are then misses. ``index`` is
    the mesh index (its mirror is read by dict probes); ``quarantine`` the owners the canary found
    wrong (never planned); ``objects`` the object tier, planned as the owner ``@objects`` while its
    own backoff allows."""

    def __init__(self, *, tiers: TieredStore, fp: FingerprintDigest, num_kv_heads: int, heads: HeadRange,
                 node_id: NodeId, chunk_size: int, chunk_bytes: int, transfer: TransferConfig,
                 tiers_config: TierConfig, index: BlockIndex | None, puller: Puller | None,
                 quarantine: Quarantine | None, objects: ObjectTier | None, peer_estimates: PeerEstimates,
                 prefill: PrefillRate, metrics: AgentMetrics, on_hit: Callable[[ChunkKey], None],
                 model_id: str = "", dropped: Callable[[ChunkKey], bool] = lambda _key: False) -> None:
        self.tiers = tiers
        self.fp = fp
        self.num_kv_heads = num_kv_heads
        self.heads = heads
        self.node_id = node_id
        self.chunk_size = chunk_size
        self.chunk_bytes = chunk_bytes
        self.transfer = transfer
        self.pin_timeout_s = tiers_config.pin_timeout_s
        self.index = index
        self.puller = puller
        self.quarantine = quarantine
        self.objects = objects
        self.peer_estimates = peer_estimates
        self.prefill = prefill
        self.metrics = metrics
        self._on_hit = on_hit
        self.model_id = model_id
        self._dropped = dropped

    # -- plan -----------------------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int] | np.ndarray) -> HitPlan:
        """The plan of a prompt, counted: its planned tokens as hits by source and tier, the rest as
        misses under the reason of the first chunk not planned (``miss_tokens_total``)."""
        keys, spans = keys_of(self.fp, token_ids, self.chunk_size)
        plan = self.plan(keys, spans, sum(e - s for s, e in spans))
        self.metrics.lookups.inc()
        self.count_hits(plan.chunks)
        if len(plan.chunks) < len(keys):
            self.metrics.count_misses(self.miss_reason(keys[len(plan.chunks)]), plan.num_tokens - plan.hit_tokens)
        return plan

    def count_hits(self, chunks: Sequence[PlannedChunk]) -> None:
        """Tokens the engine got from the cache, by source and tier (``hit_tokens_total``)."""
        hits: dict[tuple[str, str], int] = {}
        for c in chunks:
            if c.source == LOCAL:
                label = ("local", self.tiers.where(c.key) or "cpu")
            else:
                label = ("objects", "object") if c.source == OBJECTS else ("peer", "peer")
            hits[label] = hits.get(label, 0) + c.end - c.start
        for (source, tier), n in hits.items():
            self.metrics.count_hits(source, tier, n)

    def miss_reason(self, key: ChunkKey) -> str:
        """Why ``key`` was not planned (:func:`~lmcache_p2p.plan.miss_reason`; dict probes only)."""
        index, quarantine = self.index, self.quarantine
        owners = index.owners(self.fp, [key], ask=False)[0] if index is not None else {}
        return miss_reason(owners, index.nodes() if index is not None else {}, me=self.node_id, fp_hex=self.fp.hex(),
                           model_id=self.model_id, blocked=quarantine.blocked if quarantine is not None
                           else lambda _n: False, remembered=self._dropped(key))

    def plan(self, keys: Sequence[ChunkKey], spans: Sequence[tuple[int, int]], num_tokens: int) -> HitPlan:
        """The longest run of leading chunks this node holds or a usable owner announces (dict probes
        of the mirror only; in ``etcd.index: lookup`` mode the index reads what it must)."""
        index = self.index
        nodes = index.nodes() if index is not None else {}

        def owners(ks: Sequence[ChunkKey]) -> list[dict[NodeId, int]]:
            if index is None:
                return [{} for _ in ks]
            return [{n: t for n, t in found.items() if n != self.node_id} for found in index.owners(self.fp, ks)]

        fp_hex, all_heads = self.fp.hex(), self.num_kv_heads

        def heads_of(node: NodeId) -> HeadRange:
            record = nodes.get(node)
            return record.heads_of(fp_hex, all_heads) if record is not None else (0, all_heads)

        verdicts: dict[NodeId, bool] = {}

        def usable(node: NodeId) -> bool:
            verdict = verdicts.get(node)
            if verdict is None:
                if node == OBJECTS:  # the object store: no node record, its own backoff
                    verdict = verdicts[node] = self.objects is not None and self.objects.usable()
                else:
                    verdict = verdicts[node] = self.usable(nodes.get(node))
            return verdict

        inflight = self.puller.inflight() if self.puller is not None else {}
        return make_plan(keys, spans, local=self.holds, owners=owners, usable=usable, inflight=inflight,
                         num_tokens=num_tokens, need=self.heads, heads_of=heads_of)

    def usable(self, record: NodeRecord | None) -> bool:
        """A peer we can pull from now (see :meth:`Puller.usable`) and not quarantined."""
        quarantine = self.quarantine
        return (self.puller is not None and self.puller.usable(record) and record is not None
                and not (quarantine is not None and quarantine.blocked(record.node_id)))

    def wait_for_index(self, keys: Sequence[ChunkKey], revision: int, deadline: float) -> bool:
        """Wait (until ``deadline``, on ``time.monotonic()``) until this node's mirror has seen what a
        scheduler side saw at ``revision`` (it offered a hit from there), or holds an owner with a node
        record for every key: a TP rank's mirror may lag its scheduler's by an event. True when it has."""
        m = self.index.mirror(self.fp) if self.index is not None and revision > 0 else None
        if m is None:
            return True
        if not m.connected:  # etcd unreachable: neither mirror moves; plan with what is here
            return False
        m.prefetch(keys, revision)  # etcd.index lookup: read them as of that revision or later

        def caught_up(m: Any) -> bool:
            if m.revision >= revision:
                return True
            nodes = m.nodes()
            return all(any(n in nodes or n == OBJECTS for n in m.owners(k)) for k in keys)

        return bool(m.wait_for(caught_up, remaining(deadline)))

    # -- budget ---------------------------------------------------------------------------------------
    def budget(self, plan: HitPlan, left_s: float | None = None) -> FetchBudget:
        """Cut ``plan`` to the pulls expected to beat recomputing and to finish in ``left_s`` (see
        :func:`~lmcache_p2p.plan.fetch_budget`)."""
        return fetch_budget(plan, chunk_bytes=lambda c: self.chunk_bytes,
                            expected_s=self.peer_estimates.expected_s,
                            recompute_s=self.prefill.recompute_s if self.transfer.recompute_when_faster
                            else lambda _tokens: None,
                            max_s=self.transfer.timeout_s, known=self.peer_estimates.known,
                            deviation_s=self.peer_estimates.deviation_s, left_s=left_s,
                            first_contact_s=self.transfer.first_contact_s)

    def budgeted(self, plan: HitPlan, deadline: float, label: str = "") -> FetchBudget:
        """The budget: ``plan`` cut to the pulls expected to beat recomputing and to finish before
        ``deadline`` (the load may have queued behind others), with the kept pulls' own allowance
        (``deadline_s``, from when they start). Each decision is counted (``fetch_decisions_total``: pull,
        recompute_faster, deadline; the declined ones in ``load_failures_total`` too)."""
        budget = self.budget(plan, left_s=remaining(deadline))
        declined = len(plan.chunks) - len(budget.plan.chunks)
        metrics = self.metrics
        pulled = sum(1 for c in budget.plan.chunks if c.source != LOCAL)
        if pulled:
            metrics.fetch_decisions.labels("pull").inc(pulled)
        if budget.late:
            metrics.fetch_decisions.labels("deadline").inc(budget.late)
            metrics.load_failures.labels("deadline").inc(budget.late)
        if declined > budget.late:
            metrics.fetch_decisions.labels("recompute_faster").inc(declined - budget.late)
            metrics.load_failures.labels("recompute_faster").inc(declined - budget.late)
        if declined:
            metrics.count_misses("declined", sum(c.end - c.start for c in plan.chunks[len(budget.plan.chunks):]))
        if declined:
            why = ""
            if budget.declined_at is not None:
                pull_s, recompute_s = budget.declined_at
                why = (f"; the first declined as slower than recomputing: pull expected {1e3 * pull_s:.1f} ms, "
                       f"recompute {1e3 * recompute_s:.1f} ms")
            log.info("%spulling %d of %d chunks, recomputing the rest (%d not expected in the %.1f ms left%s)",
                     label, len(budget.plan.chunks), len(plan.chunks), budget.late, 1e3 * remaining(deadline), why)
        log.debug("%sbudget: %d chunks, expected %.1f ms, recompute %s, allowance %.1f ms of %.1f ms left", label,
                  len(budget.plan.chunks), 1e3 * budget.expected_s,
                  "unknown" if budget.recompute_s is None else f"{1e3 * budget.recompute_s:.1f} ms",
                  1e3 * budget.deadline_s, 1e3 * remaining(deadline))
        return budget

    # -- the path ---------------------------------------------------------------------------------------
    def load_pinned(self, plan: HitPlan, deadline: float, *, remote: bool = True, label: str = "") -> list[Pin | None]:
        """One pin (or None) per chunk of ``plan``; the caller unpins every pin it got.

        ``remote``: budget the plan, pull what peers hold until ``deadline``, read what the disk tier
        holds until ``deadline``. Without it, or past the deadline, nothing is pulled and no disk is read
        (the caller is the engine's forward thread, or the engine has waited long enough): only what the
        CPU pool holds now is pinned, and disk chunks are promoted in the background for the next request.
        Chunks the budget declined are None.
        """
        kept, late, load_deadline = plan, set(), deadline
        if remote:
            budget = self.budgeted(plan, deadline, label)
            kept = budget.plan
            pulls = [c for c in kept.chunks if c.source != LOCAL and not self.holds(c.key)]
            if pulls and remaining(load_deadline) <= 0:
                # Queued past its deadline (behind other loads, or its mirror's wait): asking a peer now
                # would only hold it while an answer nobody waits for arrives. The engine recomputes.
                late = {c.key for c in pulls}
                self.metrics.load_failures.labels("deadline").inc(len(late))
                self.metrics.count_misses("declined", sum(c.end - c.start for c in pulls))
                log.info("%sdeadline passed before %d pulls started; recomputed", label, len(late))
            elif pulls:
                started = time.monotonic()
                # The pulls' allowance counts from when they start (a starved thread between the budget and
                # here once spent a 45 ms allowance before asking anyone: the hit became a recompute).
                deadline = min(load_deadline, started + budget.deadline_s)
                # An answer still arriving at the deadline is worth waiting for while it keeps coming, as
                # long as the engine could not have computed the tokens sooner (nor past the load's deadline).
                patience = load_deadline if budget.recompute_s is None else min(load_deadline,
                                                                                started + budget.recompute_s)
                # An owner that acknowledges nothing is given up on once that costs more than a small
                # share of recomputing (a hung owner costs the engine about a miss, never its allowance).
                self.pull(pulls, deadline, patience if patience > deadline else None, budget.silence_s)
                if budget.expected_s > 0 and len(pulls) == sum(1 for c in kept.chunks if c.source != LOCAL):
                    self.metrics.estimate_ratio.labels("pull").observe(
                        (time.monotonic() - started) / budget.expected_s)
        pins = [None if chunk.key in late else self.pin_chunk(chunk, remote=remote and remaining(load_deadline) > 0)
                for chunk in kept.chunks]
        return pins + [None] * (len(plan.chunks) - len(kept.chunks))

    def load(self, plan: HitPlan, dsts: Sequence[memoryview], deadline: float) -> list[bool]:
        """Fill ``dsts[i]`` with chunk ``plan.chunks[i]``; which were loaded (verified): the engine's
        path (:meth:`load_pinned`), then a verified copy out of each pinned slot."""
        if len(dsts) != len(plan.chunks):
            raise ValueError(f"need one destination per planned chunk: {len(dsts)} != {len(plan.chunks)}")
        cpu = self.tiers.cpu
        loaded = []
        for pin, dst in zip(self.load_pinned(plan, deadline), dsts, strict=True):
            if pin is None:
                loaded.append(False)
                continue
            try:
                ok = cpu.copy_verified(pin, dst)  # changed in memory since it was pinned: dropped
            finally:
                cpu.unpin(pin)
            if not ok:
                self.metrics.checksum_failures.inc()
            loaded.append(ok)
        return loaded

    def holds(self, key: ChunkKey) -> bool:
        """This node holds the chunk, in some tier, with the heads its engine needs."""
        return self.tiers.holds(key, self.heads)

    def pull(self, chunks: Sequence[PlannedChunk], deadline: float, patience: float | None = None,
             silence_s: float | None = None) -> None:
        """Pull ``chunks`` into the CPU pool by ``deadline`` (a peer's answer still arriving then, until
        ``patience``; an owner silent for ``silence_s`` given up on: see :meth:`Puller.pull`): from peers
        and the object store alike (the store is one more owner behind its own transport), each missed
        chunk retried on its alternatives while time is left."""
        if self.puller is not None:
            self.puller.pull(chunks, deadline, patience, silence_s)

    def _promoted(self, key: ChunkKey) -> bool:
        """A disk chunk brought into the CPU pool now; False when it can't be (no slot free of pins and
        reservations, a disk fault): a miss for this load, never its exception."""
        try:
            return self.tiers.ensure_in_cpu(key)
        except (TierError, OSError) as exc:
            log.info("chunk %s not brought in from disk for this load: %s", key.hex()[:16], exc)
            return False

    def pin_chunk(self, chunk: PlannedChunk, *, remote: bool) -> Pin | None:
        """A pin on ``chunk``'s CPU slot, verified and admitted; None if it can't be had. With
        ``remote=False`` nothing is read from disk (a disk chunk is promoted in the background)."""
        tiers = self.tiers
        pin = tiers.cpu.pin(chunk.key, self.pin_timeout_s)
        if pin is None and not remote:
            tiers.promote_later(chunk.key)  # no disk I/O on the caller's (the engine's) thread
        elif pin is None and self._promoted(chunk.key):
            pin = tiers.cpu.pin(chunk.key, self.pin_timeout_s)
        if pin is not None and pin.header.heads != self.heads:  # another rank layout's, left on disk
            tiers.cpu.unpin(pin)
            pin = None
        if pin is not None and not (tiers.admits(pin.header) and self._intact(pin)):
            tiers.cpu.unpin(pin)  # covered by an invalidation since it was stored, or changed in memory
            tiers.remove(chunk.key)
            pin = None
        if pin is not None:
            self._on_hit(chunk.key)
            source = "local" if chunk.source == LOCAL else "objects" if chunk.source == OBJECTS else "peer"
            self.metrics.loaded_chunks.labels(source).inc()
        else:
            self.metrics.load_failures.labels("missing").inc()
            self.metrics.count_misses("load_failed", chunk.end - chunk.start)
        return pin

    def _intact(self, pin: Pin) -> bool:
        """Re-verify a slot before the engine reads it: registered memory can be changed after commit
        (a NIXL WRITE by a peer, a stray write); changed bytes never reach the engine."""
        try:
            verify(pin.header, self.tiers.cpu.slot_view(pin.slot, pin.header.length))
            return True
        except ChunkError as exc:
            log.error("chunk %s changed in memory after it was committed; dropped: %s", pin.key.hex()[:16], exc)
            self.metrics.checksum_failures.inc()
            return False


class StoppedLoader:
    """The load path of an agent not started, or stopping: what its own tiers hold is planned, nothing is
    loaded (every load a miss) and nothing counted. The agent holds one until :class:`Loader` is up and again
    from the moment it stops, so a load that comes across a stop needs no check of its own."""

    def __init__(self, tiers: TieredStore, fp: FingerprintDigest, heads: HeadRange, chunk_size: int) -> None:
        self.tiers, self.fp, self.heads, self.chunk_size = tiers, fp, heads, chunk_size

    def lookup(self, token_ids: Sequence[int] | np.ndarray) -> HitPlan:
        keys, spans = keys_of(self.fp, token_ids, self.chunk_size)
        return self.plan(keys, spans, sum(e - s for s, e in spans))

    def plan(self, keys: Sequence[ChunkKey], spans: Sequence[tuple[int, int]], num_tokens: int) -> HitPlan:
        return local_plan(self.tiers, self.heads, keys, spans, num_tokens)

    def count_hits(self, chunks: Sequence[PlannedChunk]) -> None:
        pass

    def usable(self, record: NodeRecord | None) -> bool:
        return False

    def wait_for_index(self, keys: Sequence[ChunkKey], revision: int, deadline: float) -> bool:
        return False

    def budget(self, plan: HitPlan, left_s: float | None = None) -> FetchBudget:
        raise RuntimeError("the agent is not started: nothing can be loaded")

    def load_pinned(self, plan: HitPlan, deadline: float, *, remote: bool = True, label: str = "") -> list[Pin | None]:
        return [None] * len(plan.chunks)

    def load(self, plan: HitPlan, dsts: Sequence[memoryview], deadline: float) -> list[bool]:
        if len(dsts) != len(plan.chunks):
            raise ValueError(f"need one destination per planned chunk: {len(dsts)} != {len(plan.chunks)}")
        return [False] * len(plan.chunks)

    def pull(self, chunks: Sequence[PlannedChunk], deadline: float, patience: float | None = None,
             silence_s: float | None = None) -> None:
        pass
