"""The cluster's memory as one cache: eviction hand-off, hot-chunk replication, published free space.

Every agent runs one :class:`Handoff` on its loop::

    sender (every STEP_S)                               receiver (TransferServer "offer")
    ---------------------                               --------------------------------
    last tier nearly full (fewer than free_below of     take the keys it does not hold and has
    its space free)? its coldest chunks that no other   room for (free CPU slots, free disk,
    node holds, hit >= min_hits, not offered lately;    minus offers still arriving), answer at
    plus chunks pulled from us >= replicate_after       once, then pull them from the sender
    times that no other node holds                      over the normal path (authenticated,
        |                                               verified, admission-gated) and publish
        +-- offer --> a peer with room and our heads:
                      cache-only agents first, then the most free space

Once a peer holds a chunk, the sender's pool evicts it before any sole copy
(``CpuPool.evict_first``): copies go first, the last copy in the cluster last. Offers cost the
sender nothing on the engine's threads: the pool is only read (``coldest``), the peer pulls from
the pinned slot like any other pull, and ``budget_bytes_per_s`` caps the bytes offered (0: off,
sole copies are dropped as they are evicted, and counted). Free space goes into the node record at
most every ``capacity_interval_s``, and only when it moved by a chunk or more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from .aio import TaskSet, every
from .backoff import TokenBucket
from .config import AgentConfig, HandoffConfig
from .ids import NodeId
from .index.protocol import BlockIndex
from .index.schema import NodeRecord
from .keys import ChunkKey, FingerprintDigest, HeadRange
from .metrics import AgentMetrics
from .plan import PlannedChunk
from .tiers import TieredStore
from .transfer.pull import Puller
from .transfer.stack import Transfers

log = logging.getLogger(__name__)

STEP_S = 0.25
CANDIDATES = 64  # coldest chunks looked at per step
OFFER_BATCH = 32  # keys per offer
REOFFER_S = 10.0  # a chunk offered (taken or not) is not offered again for this long
ARRIVE_S = 10.0  # an accepted chunk's pull gets this long


class _Mesh(NamedTuple):
    """What hand-offs use of the mesh once it is up (:meth:`Handoff.start`)."""

    puller: Puller | None
    transfers: Transfers
    usable: Callable[[NodeRecord | None], bool]
    record: Callable[[], NodeRecord]


class Handoff:
    """One agent's hand-offs, given its parts (never the agent).

    ``settings``: the agent's config, read at every use (the cluster config changes ``handoff.*``
    live). Until :meth:`start` gives it the mesh (index, puller, transfers), it only counts hits: it
    holds no offer and takes none."""

    def __init__(self, *, settings: Callable[[], AgentConfig], fp: FingerprintDigest, num_kv_heads: int,
                 node_id: NodeId, heads: HeadRange, chunk_bytes: int, tiers: TieredStore,
                 metrics: AgentMetrics) -> None:
        self._settings = settings
        self.fp = fp
        self.num_kv_heads = num_kv_heads
        self.node_id = node_id
        self.heads = heads
        self.chunk_bytes = chunk_bytes
        self.tiers = tiers
        self.metrics = metrics
        self.index: BlockIndex | None = None
        self._mesh: _Mesh | None = None
        self.hits: dict[ChunkKey, int] = {}  # local loads and pulls served, per chunk held
        self.served: dict[ChunkKey, int] = {}  # pulls served while no other node held the chunk
        self._offered: dict[ChunkKey, float] = {}  # key -> when it was last offered
        budget = float(settings().handoff.budget_bytes_per_s)
        self._bucket = TokenBucket(budget, budget)  # bytes offered (handoff.budget_bytes_per_s, live)
        self._arriving = 0  # chunks accepted from peers, pull not finished
        self._published_free: dict[str, int] | None = None
        self._published_at = 0.0
        self._tasks = TaskSet("hand-off")  # receivers' pulls
        self.steps = 0  # sender steps run (observable: "N steps ran and offered nothing")

    def start(self, *, index: BlockIndex, puller: Puller | None, transfers: Transfers,
              usable: Callable[[NodeRecord | None], bool], record: Callable[[], NodeRecord]) -> None:
        """The mesh is up: offers go out (:meth:`run_forever`) and come in (:meth:`accept`).
        ``usable``: whether a peer can be pulled from now; ``record``: this node's record (republished
        with its free space)."""
        self.index = index
        self._mesh = _Mesh(puller, transfers, usable, record)

    @property
    def config(self) -> HandoffConfig:
        """Read at every use: the cluster config may change it while running."""
        return self._settings().handoff

    def holds(self, key: ChunkKey) -> bool:
        """This node holds the chunk, in some tier, with the heads its engine needs."""
        return self.tiers.holds(key, self.heads)

    # -- bookkeeping (any thread; plain dict updates) ---------------------------------------------------
    def on_hit(self, key: ChunkKey) -> None:
        self.hits[key] = self.hits.get(key, 0) + 1

    def on_served(self, key: ChunkKey) -> None:
        """A peer pulled ``key`` from us (whether another node holds it too is checked when the
        count is reached: the puller's own copy, announced and dropped, may still be in flight)."""
        self.on_hit(key)
        if self.config.replicate_after:
            self.served[key] = self.served.get(key, 0) + 1

    def on_gone(self, key: ChunkKey) -> None:
        """No tier of ours holds ``key`` any more. A chunk worth keeping (hit ``min_hits`` times) that
        no other node holds is lost to the cluster: counted as dropped."""
        hits = self.hits.pop(key, None)
        self.served.pop(key, None)
        if hits is not None and hits >= self.config.min_hits and not self.others_hold(key):
            self.metrics.handoff_chunks.labels("dropped").inc()

    def others_hold(self, key: ChunkKey) -> bool:
        """Another node announces ``key`` (a dict probe of the mirror, no etcd read in lookup mode: safe
        under tier locks)."""
        index = self.index
        if index is None:
            return False
        owners = index.owners(self.fp, [key], ask=False)[0]
        return any(n != self.node_id for n in owners)

    # -- free space in the node record --------------------------------------------------------------------
    def free(self) -> dict[str, int]:
        tiers = self.tiers
        free = {"cpu": tiers.cpu.free_slots * tiers.cpu.slot_bytes}
        if tiers.disk is not None:
            free["disk"] = max(0, tiers.disk.capacity_bytes - tiers.disk.used_bytes)
        return free

    def refresh_capacity(self, now: float) -> None:
        """Republish the record when free space moved by a chunk or more, at most every interval."""
        mesh, index = self._mesh, self.index
        if now - self._published_at < self.config.capacity_interval_s or mesh is None or index is None:
            return
        free = self.free()
        last = self._published_free
        if last is not None and all(abs(free.get(t, 0) - last.get(t, 0)) < self.chunk_bytes for t in free):
            return
        self._published_free, self._published_at = free, now
        index.set_record(mesh.record())

    # -- sender -------------------------------------------------------------------------------------------
    async def run_forever(self) -> None:
        async def counted() -> None:
            try:
                await self.step()
            finally:
                self.steps += 1

        await every(lambda: STEP_S, counted, "hand-off step")

    async def step(self) -> None:
        now = time.monotonic()
        self.refresh_capacity(now)
        budget = self.config.budget_bytes_per_s
        if budget <= 0:
            return
        self._bucket.rate_per_s = self._bucket.burst = float(budget)
        for key, when in list(self._offered.items()):
            if now - when > REOFFER_S:
                del self._offered[key]
        replicas = self._replicas()
        keys = replicas + [k for k in self._nearly_dropped() if k not in set(replicas)]
        if keys:
            await self._offer(keys, set(replicas), now)

    def _nearly_dropped(self) -> list[ChunkKey]:
        """The coldest sole copies of the last tier, when that tier is nearly full."""
        tiers = self.tiers
        if tiers.disk is not None:
            disk = tiers.disk
            if disk.capacity_bytes - disk.used_bytes >= self.config.free_below * disk.capacity_bytes:
                return []
            cold = disk.coldest(CANDIDATES)
        else:
            cpu = tiers.cpu
            if cpu.free_slots >= self.config.free_below * cpu.num_slots:
                return []
            cold = cpu.coldest(CANDIDATES)
        return [k for k in cold if k not in self._offered and self.hits.get(k, 0) >= self.config.min_hits
                and self.holds(k) and not self.others_hold(k)]

    def _replicas(self) -> list[ChunkKey]:
        """Chunks pulled from us ``replicate_after`` times that no other node holds now. One that another
        node holds keeps its count and is looked at again next step: the puller's copy may be announced
        and dropped within a step, and a replica skipped for it must not be lost for good (it was: the
        hot-chunk test failed about one run in eight)."""
        if not self.config.replicate_after:
            return []
        hot = [k for k, n in self.served.items() if n >= self.config.replicate_after and k not in self._offered
               and self.holds(k) and not self.others_hold(k)]
        for key in hot:
            del self.served[key]
        return hot

    async def _offer(self, keys: list[ChunkKey], hot: set[ChunkKey], now: float) -> None:
        mesh = self._mesh
        size = self.chunk_bytes
        targets = self._targets()
        if mesh is None or not targets:
            return
        while keys and targets and self._bucket.tokens >= size:
            record, room = targets[0]
            n = min(len(keys), OFFER_BATCH, room, int(self._bucket.tokens // size))
            if n <= 0:
                targets.pop(0)
                continue
            batch, keys = keys[:n], keys[n:]
            peer = record.peer()
            if peer is None:
                targets.pop(0)
                continue
            for key in batch:
                self._offered[key] = now
            self.metrics.handoff_chunks.labels("offered").inc(len(batch))
            accepted = await mesh.transfers.offer(peer, self.fp, self.node_id, batch,
                                                  self._settings().transfer.timeout_s)
            taken = sum(accepted)
            self._bucket.spend(taken * size)
            self.metrics.handoff_chunks.labels("accepted").inc(taken)
            self.metrics.handoff_chunks.labels("replicas").inc(sum(1 for k, a in zip(batch, accepted, strict=True)
                                                                 if a and k in hot))
            self.metrics.handoff_bytes.labels("out").inc(taken * size)
            log.debug("offered %d chunks to %s: %d taken", len(batch), record.node_id, taken)
            targets.pop(0)  # the next batch goes to the next peer: one slow peer does not get them all

    def _targets(self) -> list[tuple[NodeRecord, int]]:
        """Peers that can take our chunks, with room for how many: cache-only agents first, then the most
        free; only peers that hold our heads, speak our wire and TLS setting, and are not backed off."""
        index, mesh = self.index, self._mesh
        if index is None or mesh is None:
            return []
        fp_hex, total = self.fp.hex(), self.num_kv_heads
        out: list[tuple[bool, int, NodeRecord]] = []
        for node, record in index.nodes().items():
            if node == self.node_id or fp_hex not in record.fingerprints or not mesh.usable(record):
                continue
            if record.heads_of(fp_hex, total) != self.heads:
                continue
            free = sum(record.free.values())
            if free >= self.chunk_bytes:
                out.append((record.role != "cache", -free, record))
        out.sort(key=lambda t: (t[0], t[1]))
        return [(r, -f // self.chunk_bytes) for _, f, r in out]

    # -- receiver ----------------------------------------------------------------------------------------
    def accept(self, node: str, keys: list[ChunkKey]) -> list[bool]:
        """On the loop (the transfer server): which offered chunks we take; their pulls start now."""
        if self.index is None or self._mesh is None or NodeId(node) == self.node_id:
            return [False] * len(keys)
        free = self.free()
        room = sum(free.values()) // self.chunk_bytes - self._arriving
        accepted: list[bool] = []
        for key in keys:
            take = room > 0 and not self.holds(key)
            room -= take
            accepted.append(take)
        taken = [k for k, a in zip(keys, accepted, strict=True) if a]
        if taken:
            self._arriving += len(taken)
            self._tasks.spawn(self._receive(NodeId(node), taken), f"receive-from-{node}")
        return accepted

    async def _receive(self, node: NodeId, keys: list[ChunkKey]) -> None:
        puller = self._mesh.puller if self._mesh is not None else None
        try:
            if puller is None:
                return
            chunks = [PlannedChunk(i, k, 0, 0, node, heads=self.heads) for i, k in enumerate(keys)]
            missed = await puller.pull_from(node, chunks, time.monotonic() + ARRIVE_S)
            got = len(keys) - len(missed)
            self.metrics.handoff_chunks.labels("received").inc(got)
            self.metrics.handoff_bytes.labels("in").inc(got * self.chunk_bytes)
            for key in keys:
                if self.holds(key):
                    self.hits.setdefault(key, self.config.min_hits)  # it was hit where it came from
        finally:
            self._arriving -= len(keys)

