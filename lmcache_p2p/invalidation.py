"""Invalidation across the mesh: a standing barrier, applied to what a node holds, pulls and recovers.

An operator (``lmcache-p2p invalidate``) writes one key; every agent follows the prefix with a
:class:`~lmcache_p2p.index.watch.ResumableWatch`::

    invalidate/<id>   msgpack {kind, value, issued_at}   standing until removed (optionally a lease)

    kind          value                 covers a chunk
    fingerprint   hex prefix (>= 8)     whose fingerprint digest starts with it (model upgrade)
    tenant        tenant digest         of a fingerprint salted with a salt of that digest
    node          node id               computed by that node (the origin in its header), wherever
                                        it is held (copies others pulled of it too), or held by it

The barrier is the etcd revision R at which the record was written. Every chunk carries an
*epoch* in its header: the generation of the etcd history and the revision up to which the node
that computed it had applied invalidations (this watch's revision, advanced by progress
notifications; see :mod:`lmcache_p2p.index.generation`). An invalidation covers a matching chunk
iff the chunk's epoch names another generation than the agent's current one, or its revision is
below R; chunks computed after a node has seen the invalidation (a node now serving the new model)
are not covered. A fresh etcd gets a new generation, one restored from a backup is given one by
the first agent that sees its revision go back: chunks of the history before are then ordered
before every invalidation, whatever revision they carry. For as long as the record exists every agent

* drops the covered chunks it holds when it learns of the record (``apply``, off the loop), and
  again for every standing record when the generation changes,
* refuses covered chunks at the CPU pool's admission gate (``covers``): a pull from a lagging
  peer, an engine store stamped before the barrier, a promotion; and caps the epoch of every chunk
  it admits at its own (``stamp``): a peer's epoch is never trusted above this node's view,
* and deletes covered chunks found on disk at start (``recover`` runs after the first sync), and
  those whose revision is above etcd's in this generation (``vet_recovered``: etcd went back).

A node that was stopped or partitioned while the record was written catches up on resume (the
watch resumes from its revision, or resyncs); one restarted from disk, however much later, reads
the standing records before it publishes anything. Removals are counted in
``lmcache_p2p_invalidated_chunks_total{reason}`` (reason: fingerprint, tenant, node, ttl,
generation).

The per-chunk TTL (``tiers.chunk_ttl_s``) is a local sweep every ``min(ttl/4, 5 s)``: a chunk's age
counts from the oldest copy this node has seen of it (CPU ``stored_at``, disk file mtime), so a
chunk written back to disk does not restart its clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from .aio import LoopThread, TaskSet, every
from .chunk import ChunkHeader
from .config import AgentConfig
from .errors import LMCacheP2PError, MalformedRecord
from .ids import NodeId, origin_of
from .index.client import EtcdClient, KeyValue, WatchEvent
from .index.generation import GenerationWatch, cap_epoch, epoch_generation, epoch_revision, make_epoch
from .index.records import INVALIDATION_KINDS, MIN_FP_PREFIX, Invalidation, decode_invalidation
from .index.schema import Rejects, Schema, tenant_digest
from .index.watch import ResumableWatch
from .keys import ChunkKey, Fingerprint, FingerprintDigest

if TYPE_CHECKING:  # the tiers import torch; the invalidate CLI must start fast
    from .tiers import TieredStore

log = logging.getLogger(__name__)

KINDS = INVALIDATION_KINDS
MAX_SWEEP_INTERVAL_S = 5.0
__all__ = ["KINDS", "MIN_FP_PREFIX", "Invalidation", "MeshInvalidation", "issue"]


async def issue(client: EtcdClient, schema: Schema, kind: str, value: str, *, ttl_s: int | None = None,
                clock: Callable[[], float] = time.time) -> tuple[Invalidation, int]:
    """Write one standing invalidation (on a lease of ``ttl_s`` if given); ``(invalidation, revision)``.
    A tenant's ``value`` is its :func:`~lmcache_p2p.index.schema.tenant_digest`."""
    inv = Invalidation(uuid.uuid4().hex[:16], kind, value.lower() if kind == "fingerprint" else value, clock())
    lease_id = (await client.grant(ttl_s))[0] if ttl_s is not None else 0
    revision = await client.put(schema.invalidations + inv.id.encode(), inv.pack(), lease=lease_id)
    return Invalidation(inv.id, inv.kind, inv.value, inv.issued_at, revision), revision


def matches(inv: Invalidation, header: ChunkHeader, tenant: str | None, holder: str, generation: int) -> bool:
    """Whether ``inv`` covers a chunk with ``header`` held by ``holder``; ``tenant``: the digest of its
    fingerprint's salt, if known; ``generation``: the etcd history followed (a chunk of another one is
    ordered before every invalidation). A ``node`` invalidation matches the engine that computed the
    chunk (its header's origin; a TP rank names its engine) wherever the chunk is held, and everything
    that node holds."""
    if epoch_generation(header.epoch) == generation and epoch_revision(header.epoch) >= inv.revision:
        return False
    if inv.kind == "node":
        return inv.value == holder or header.origin == origin_of(inv.value)
    if inv.kind == "fingerprint":
        return header.fingerprint.hex().startswith(inv.value)
    return tenant is not None and tenant == inv.value


class MeshInvalidation:
    """One agent's side: follows ``generation`` and ``invalidate/``, gates chunks, sweeps expired ones,
    on the agent's loop.

    ``fingerprints`` are those this agent serves (digest -> fingerprint): a tenant is matched
    through them; a chunk of an unknown fingerprint (an old disk file) matches by digest only, unless
    it carries its tenant with it (an object's meta: :meth:`covers_tenant`).
    """

    def __init__(self, config: AgentConfig, store: TieredStore, fingerprints: Mapping[FingerprintDigest, Fingerprint],
                 registry: CollectorRegistry, *, wall_clock: Callable[[], float] = time.time,
                 rejects: Rejects | None = None, listeners: Sequence[Callable[[], None]] = ()) -> None:
        self._schema = Schema(config.cluster)
        self._timeout = config.etcd.timeout_s
        self._wait_s = config.etcd.start_wait_s
        self._ttl_s = config.tiers.chunk_ttl_s
        self._store = store
        self._tenants = {d: tenant_digest(f.tenant_salt) for d, f in fingerprints.items() if f.tenant_salt}
        self._node_id = NodeId(config.node_id)
        self._wall = wall_clock
        self.rejects = rejects if rejects is not None else Rejects()
        self.removed = Counter("invalidated_chunks", "Chunks dropped by invalidation or TTL, by reason",
                               ["reason"], namespace="lmcache_p2p", registry=registry)
        self._active: dict[str, Invalidation] = {}  # replaced, never mutated: readers on any thread
        self._applied: set[tuple[str, int]] = set()
        self._born: dict[ChunkKey, float] = {}  # wall time of the oldest copy seen, for the TTL
        self._watch: ResumableWatch | None = None
        self._generation: GenerationWatch | None = None
        self._tasks = TaskSet("invalidation")
        self._loop: LoopThread | None = None
        # Called on the loop when standing invalidations are new to this node (the object tier cleans up).
        self.listeners = tuple(listeners)

    # -- the barrier (any thread) ----------------------------------------------------------------
    @property
    def generation(self) -> int:
        """The etcd history followed (0: not known yet, or being replaced)."""
        return self._generation.id if self._generation is not None else 0

    @property
    def epoch(self) -> int:
        """This node's view: the generation and the revision up to which invalidations are applied
        here (the epoch of chunks computed now)."""
        return make_epoch(self.generation, self._watch.revision if self._watch is not None else 0)

    def active(self) -> list[Invalidation]:
        return list(self._active.values())

    def covers(self, header: ChunkHeader) -> bool:
        """Whether a standing invalidation covers this chunk (it must not be stored or served)."""
        active = self._active
        if not active:
            return False
        tenant, generation = self._tenants.get(header.fingerprint), self.generation
        return any(matches(inv, header, tenant, self._node_id, generation) for inv in active.values())

    def covers_held_by(self, header: ChunkHeader, holder: str) -> bool:
        """Whether a standing invalidation covers a chunk ``holder`` held (an object its uploader wrote)."""
        active = self._active
        if not active:
            return False
        tenant, generation = self._tenants.get(header.fingerprint), self.generation
        return any(matches(inv, header, tenant, holder, generation) for inv in active.values())

    def covers_tenant(self, header: ChunkHeader, tenant: str) -> bool:
        """Whether a standing ``tenant`` invalidation covers a chunk whose fingerprint's tenant is ``tenant``
        (what an object's meta carries: its fingerprint may be one no node here, nor anywhere, serves)."""
        active = self._active
        if not active or not tenant:
            return False
        generation = self.generation
        return any(inv.kind == "tenant" and matches(inv, header, tenant, "", generation) for inv in active.values())

    def stamp(self, header: ChunkHeader) -> ChunkHeader:
        """The header an admitted chunk is held under: its epoch capped at this node's own."""
        epoch = cap_epoch(header.epoch, self.epoch)
        return header if epoch == header.epoch else dataclasses.replace(header, epoch=epoch)

    def vet_recovered(self, headers: list[ChunkHeader]) -> list[ChunkHeader]:
        """Of the chunks recovered from disk at start, those to keep (blocking: deletes files). A chunk
        of this generation stamped above etcd's revision comes from a history etcd lost (restored from
        a backup): it is dropped, and the generation replaced so that other nodes' copies are too."""
        watch, generation = self._watch, self.generation
        if watch is None or not watch.synced.is_set() or generation == 0:
            return headers
        lost = {h.key for h in headers
                if epoch_generation(h.epoch) == generation and epoch_revision(h.epoch) > watch.revision}
        if not lost:
            return headers
        log.warning("%d chunks on disk are stamped above etcd's revision %d: etcd went back; dropped", len(lost),
                    watch.revision)
        self.removed.labels("generation").inc(sum(self._store.remove(k) for k in lost))
        if self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._rewound, max(epoch_revision(h.epoch) for h in headers),
                                                 watch.revision, False)
        return [h for h in headers if h.key not in lost]

    # -- lifecycle (any thread but the loop's) ---------------------------------------------------
    def start(self, loop: LoopThread, client: EtcdClient | None) -> bool:
        """Follow ``generation`` and ``invalidate/`` (when ``client`` is given) and start the TTL sweep.
        Waits up to ``etcd.start_wait_s`` for the standing records; False if etcd did not answer in time."""
        self._loop = loop
        return loop.run(self._start(client), self._wait_s + self._timeout + 5.0)

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            with contextlib.suppress(LMCacheP2PError, RuntimeError):
                loop.run(self._stop(), self._timeout)

    def recheck(self) -> None:
        """On the loop: read the generation and the standing records afresh (after a lease loss: etcd
        may have been replaced under streams that did not notice)."""
        watches = [self._generation.watch if self._generation is not None else None, self._watch]
        for watch in watches:
            if watch is not None:
                self._tasks.spawn(watch.resync(), f"resync-{watch.name}")

    async def set_ttl(self, ttl_s: float | None) -> None:
        """On the loop: change ``tiers.chunk_ttl_s`` while running (the cluster config); the sweep follows."""
        self._ttl_s = ttl_s
        for task in self._tasks.named("chunk-ttl-sweeper"):
            task.cancel()
        if ttl_s is not None:
            self._tasks.spawn(self._sweep_forever(), "chunk-ttl-sweeper")

    async def _start(self, client: EtcdClient | None) -> bool:
        if self._ttl_s is not None:
            self._tasks.spawn(self._sweep_forever(), "chunk-ttl-sweeper")
        if client is None:
            return True
        self._generation = GenerationWatch(client, self._schema, on_change=self._generation_changed,
                                           rejects=self.rejects)
        self._watch = ResumableWatch(client, self._schema.invalidations, load=self._load, apply=self._apply,
                                     name="invalidations", on_rewind=self._rewound)
        self._generation.start()
        self._tasks.spawn(self._follow_invalidations(), "invalidations-start")
        return await self._watch.wait_synced(self._wait_s)

    async def _follow_invalidations(self) -> None:
        """Standing records are applied only once the generation is known."""
        assert self._generation is not None and self._watch is not None
        await self._generation.ready.wait()
        self._watch.start()

    async def _stop(self) -> None:
        if self._generation is not None:
            await self._generation.stop()
        if self._watch is not None:
            await self._watch.stop()
        await self._tasks.cancel_all()

    def _rewound(self, seen: int, now: int, clear: bool = True) -> None:
        """On the loop: etcd's revision went back (this watch's sync, or chunks recovered from disk)."""
        if self._generation is not None:
            self._generation.rewound(seen, now)
        if clear:  # the load that follows applies every standing record again, to every chunk held
            self._applied.clear()

    def _generation_changed(self, old: int, new: int) -> None:
        """On the loop: every standing record applies again, to every chunk held (read afresh)."""
        watch = self._watch
        if watch is not None and watch.synced.is_set():
            log.warning("etcd generation is now %d (was %d): standing invalidations are applied again", new, old)
            self._applied.clear()
            self._tasks.spawn(watch.resync(), "resync-invalidations")

    # -- records (loop callbacks: no blocking) ---------------------------------------------------
    def _decode(self, key: bytes, value: bytes, revision: int) -> Invalidation | None:
        try:
            return decode_invalidation(key, value, revision, prefix_len=len(self._schema.invalidations))
        except MalformedRecord as exc:
            self.rejects.add(exc, key)
            return None

    def _load(self, kvs: list[KeyValue], _revision: int) -> None:
        active = {}
        for kv in kvs:
            inv = self._decode(kv.key, kv.value, kv.mod_revision)
            if inv is not None:
                active[inv.id] = inv
        self._active = active
        self._apply_all(list(active.values()))

    def _apply(self, events: Sequence[WatchEvent]) -> None:
        active = dict(self._active)
        new = []
        for ev in events:
            id_ = ev.key[len(self._schema.invalidations):].decode(errors="replace")
            if ev.deleted:
                active.pop(id_, None)
                continue
            inv = self._decode(ev.key, ev.value, ev.mod_revision)
            if inv is not None:
                active[inv.id] = inv
                new.append(inv)
        self._active = active
        self._apply_all(new)

    def _apply_all(self, invalidations: list[Invalidation]) -> None:
        todo = [inv for inv in invalidations if (inv.id, inv.revision) not in self._applied]
        if todo:
            self._applied.update((inv.id, inv.revision) for inv in todo)
            self._tasks.spawn(asyncio.to_thread(self._apply_many, todo), "invalidation-apply")
            for listener in self.listeners:
                try:
                    listener()
                except Exception:  # a listener's failure is its own
                    log.exception("invalidation listener failed")

    def _apply_many(self, invalidations: list[Invalidation]) -> None:
        for inv in invalidations:
            self.apply(inv)

    def apply(self, inv: Invalidation) -> int:
        """Drop every held chunk ``inv`` covers (blocking: deletes files); returns how many."""
        dropped = 0
        generation = self.generation
        for key in list(self._store.inventory()):
            header = self._store.header(key)
            if header is None:
                continue
            if matches(inv, header, self._tenants.get(header.fingerprint), self._node_id, generation):
                dropped += self._store.remove(key)
        self.removed.labels(inv.kind).inc(dropped)
        log.info("invalidation %s (%s %s, rev %d): dropped %d chunks", inv.id, inv.kind, inv.value, inv.revision,
                 dropped)
        return dropped

    def count_refused(self, header: ChunkHeader) -> None:
        """A chunk refused at the gate counts like one dropped, under the first covering kind."""
        tenant, generation = self._tenants.get(header.fingerprint), self.generation
        for inv in list(self._active.values()):
            if matches(inv, header, tenant, self._node_id, generation):
                self.removed.labels(inv.kind).inc()
                return

    # -- per-chunk TTL -----------------------------------------------------------------------------
    async def _sweep_forever(self) -> None:
        await every(lambda: None if self._ttl_s is None else min(self._ttl_s / 4, MAX_SWEEP_INTERVAL_S),
                    lambda: asyncio.to_thread(self.sweep), "chunk TTL sweep")

    def sweep(self) -> int:
        """Remove chunks older than ``tiers.chunk_ttl_s``; returns how many (blocking)."""
        if self._ttl_s is None:
            return 0
        now = self._wall()
        born = self._birth_times(now)
        expired = [k for k, t in born.items() if now - t >= self._ttl_s]
        removed = sum(self._store.remove(k) for k in expired)
        for k in expired:
            born.pop(k, None)
        self._born = born
        self.removed.labels("ttl").inc(removed)
        if removed:
            log.info("chunk TTL: removed %d chunks older than %.1fs", removed, self._ttl_s)
        return removed

    def _birth_times(self, now: float) -> dict[ChunkKey, float]:
        """Held chunk -> wall time of its oldest copy (remembered across sweeps, so tier moves keep it)."""
        cpu, disk = self._store.cpu, self._store.disk
        cpu_born = {key: now - age for key, age in cpu.ages().items()}
        old = self._born
        born: dict[ChunkKey, float] = {}
        for key, t in cpu_born.items():
            born[key] = min(t, old.get(key, t))
        if disk is None:
            return born
        for key in disk.keys():
            seen = old.get(key)
            if seen is None:
                seen = disk.stored_time(key)
                if seen is None:
                    continue  # removed meanwhile
            born[key] = min(seen, born.get(key, seen))
        return born
