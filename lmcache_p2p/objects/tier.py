"""The object tier: chunks that leave every node's memory and disk, kept in an S3-compatible store.

    eviction (tier locks)        uploader (the agent's loop)            any node's load
    ---------------------        ---------------------------            ---------------
    last tier drops a chunk:     budget (bytes/s) and max_inflight ->   the index lists ``@objects``
    sole copy, hit >= min_hits?  PUT <prefix>/<fp>/<key>, then one      as an owner (tier 3): the
    keep its bytes (memory, or   etcd txn: objects/<fp>/<key> (meta)    planner weighs it like a slow
    the disk file moved aside)   + blocks/<fp>/<key>/@objects; the      peer (measured latency and
    and queue it                 kept bytes go once the PUT answered    bandwidth) -> GET, verify, pool

An object is immutable and content-addressed: its name is the chunk's (the key already hashes the
tokens, the model and everything else that decides the KV); its body is the chunk and its uploader,
encrypted and authenticated (AES-256-GCM) under a key of the cluster secret and the fingerprint's tenant,
bound to its name (``format.py``). The store is not trusted: a bucket reader learns sizes, not KV; a
bucket writer can delete, put oversized or garbage objects, or put back an older object of the same name.
A read fetches at most the largest object a chunk of the pool's slot size packs into (a ranged GET:
a larger object is refused before its body is read), authenticates it, checks its header's key,
fingerprint and checksum, and takes it only if its epoch is the one the etcd meta recorded at upload
(an older object under the name is a replay: refused). A bad object is deleted with its etcd entries
and never served; an object a standing invalidation covers (by its epoch, fingerprint, tenant or
uploader) is never loaded and is deleted. The cleanup pass reads every ``objects/`` record and deletes
what an invalidation covers (a tenant's by the tenant the meta carries: also a fingerprint no running
node serves) or ``tiers.chunk_ttl_s`` expired (every node with the tier runs it: deletes are idempotent).
Two nodes never upload one chunk: an upload first claims its name (``uploads/<fp>/<key>`` in etcd, put
only where no meta or other claim stands, under a lease; the announce deletes it), else it is dropped.

Reads are a transport (:class:`~lmcache_p2p.objects.transport.ObjectTransport`): the puller asks the store
for chunks planned there, or for those a peer failed to send when the store is their alternative, in the
same retry round as peers. Faults: every store call has a deadline (a load's own; ``objects.timeout_s``
for the rest), an error is a miss and backs the store off (the peers' rule,
:class:`~lmcache_p2p.transfer.health.PeerHealth`) but is never remembered as "absent"; only a 404 removes
the index entries. Saves never wait on the store: an offer only enqueues, and past ``objects.spill_bytes``
of bytes waiting it drops the chunk (counted). Retry loops wait a jittered backoff (``backoff.py``).

Why one file of this size: the tier's reads, uploads and upload claims share the store's sealing keys, one upload
queue and the index entries they keep true; the transport (``transport.py``), the object format (``format.py``) and
a node's upload policy (``node.py``) are rooms of their own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path

from ..aio import TaskSet, every
from ..backoff import Backoff, TokenBucket
from ..chunk import HEADER_SIZE, ChunkHeader, verify
from ..config import AgentConfig
from ..errors import LMCacheP2PError, MalformedChunk, MalformedRecord, ObjectMissing, ObjectStoreError
from ..ids import OBJECTS, TIER_OBJECT, NodeId, PeerAddress
from ..index.client import EtcdClient, compare_mod_revision, op_delete, op_put
from ..index.records import ObjectMeta, decode_object_meta
from ..index.schema import Rejects, Schema, tenant_digest
from ..keys import ChunkKey, FingerprintDigest
from ..metrics import AgentMetrics
from ..transfer.health import PeerHealth
from .format import object_key, pack_object
from .store import ObjectStore

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
ANNOUNCE_BATCH = 42  # uploads announced per etcd txn (3 operations each: etcd's default --max-txn-ops is 128)
CLAIM_TTL_S = 60  # the lease of uploads' claims on their object names (a dead uploader's lapse with it)
CLAIM_LEASE_EVERY_S = 20.0  # a new claim lease this often: a claim stands at least CLAIM_TTL_S - this
MAX_UNANNOUNCED = 65536  # uploads confirmed but not yet in etcd (etcd down): beyond, the oldest are forgotten
RETRY_FIRST_S = 1.0  # the first wait of a retry loop (uploads, announces), doubling up to MAX_BACKOFF_S


Covers = Callable[[ChunkHeader, NodeId], bool]  # (header, holder): an invalidation or quarantine stands against it
CoversTenant = Callable[[ChunkHeader, str], bool]  # (header, tenant digest): a tenant invalidation stands against it


@dataclasses.dataclass(slots=True)
class _Upload:
    header: ChunkHeader
    data: bytes | None  # the chunk's payload, copied out of the CPU pool
    path: Path | None  # or the disk tier's file (header + payload), moved aside
    size: int


class ObjectTier:
    """Uploads (behind eviction), their etcd records and the cleanup; reads are an ``ObjectTransport``'s
    over this tier (``objects/transport.py``), which its owner builds.

    Given what it uses, never the agent: ``keep(header)`` whether a chunk leaving this node is worth an
    upload; ``covers(header, holder)`` whether an invalidation (or a quarantine of its computing node)
    stands against a chunk ``holder`` held; ``ttl_s()`` the chunk TTL now (the cluster config may change
    it); ``covers_tenant(header, tenant)`` whether a tenant invalidation stands against a chunk of that tenant
    (the tenant an object's meta carries: the cleanup's, for fingerprints this node does not serve). Objects
    are sealed under a key of ``secret`` and this fingerprint's tenant (``config.layout.tenant_salt``); without
    a secret they are only checksummed. Started on the loop with the etcd client (None: no index, nothing
    announced or cleaned up, and no object is read: a read needs its meta's epoch)."""

    def __init__(self, config: AgentConfig, store: ObjectStore, *, fp: FingerprintDigest, node_id: NodeId,
                 metrics: AgentMetrics, keep: Callable[[ChunkHeader], bool], covers: Covers,
                 ttl_s: Callable[[], float | None], secret: bytes | None = None, spill_dir: Path | None = None,
                 rejects: Rejects | None = None, covers_tenant: CoversTenant | None = None) -> None:
        self.store = store
        self.client: EtcdClient | None = None
        self.config = config.objects
        self.cluster = config.cluster
        self.fp = fp
        self.node_id = node_id
        self._keep = keep
        self._covers = covers
        self._covers_tenant = covers_tenant
        self._ttl_s = ttl_s
        salt = config.layout.tenant_salt
        self.tenant = tenant_digest(salt) if salt else ""  # this fingerprint's, in every meta it announces
        self.seal_key = object_key(secret, self.tenant) if secret else None
        self.schema = Schema(config.cluster)
        self._spill_dir = spill_dir
        self.rejects = rejects if rejects is not None else Rejects()
        self._queue: collections.deque[_Upload] = collections.deque()
        self._waiting = 0  # bytes kept for uploads queued or in flight
        self._waiting_lock = threading.Lock()  # offers come from the tiers' threads, releases from the loop
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        budget = float(self.config.budget_bytes_per_s)
        self._bucket = TokenBucket(budget, budget)  # upload bytes (objects.budget_bytes_per_s)
        self._inflight = 0
        self._tasks = TaskSet("object tier")
        self._unannounced: collections.deque[ObjectMeta] = collections.deque(maxlen=MAX_UNANNOUNCED)
        self._claim_lease: tuple[int, float] | None = None  # (lease id, monotonic time granted)
        self._announce_wake: asyncio.Event | None = None
        self._cleanup_soon: asyncio.Event | None = None
        self.offered = {"memory": 0, "file": 0}  # chunks taken for upload: CPU victims' bytes, disk victims' files
        self.objects = 0  # this fingerprint's objects and their bytes, as of the last cleanup pass
        self.object_bytes = 0
        self.metrics = metrics
        self.ops, self.bytes, self.dropped = metrics.object_ops, metrics.object_bytes, metrics.object_uploads_dropped
        metrics.on_collect(self._gauges)
        # The store's backoff is the peers' rule (``PeerHealth``): one for every source a load reads from.
        backoff_s = max(config.transfer.backoff_s, 0.1)
        self.health = PeerHealth(backoff_s, max(backoff_s, MAX_BACKOFF_S))
        url = urllib.parse.urlsplit(store.url)  # the store as a peer: its backoff and estimates' key
        self.address = PeerAddress(url.hostname or "", url.port or (443 if url.scheme == "https" else 80), OBJECTS)
        if spill_dir is not None:  # bytes kept by a previous run for uploads it never made: not ours to trust
            with contextlib.suppress(OSError):
                for stale in spill_dir.glob("*.chunk"):
                    stale.unlink(missing_ok=True)

    def _gauges(self) -> None:
        metrics = self.metrics
        running = self._loop is not None
        metrics.object_tier.set(1 if running else 0)
        metrics.object_uploads_pending.set(self.pending if running else 0)
        metrics.objects.set(self.objects)

    def name(self, key: ChunkKey, fp: FingerprintDigest | None = None) -> str:
        """``<prefix>/<cluster>/<fingerprint>/<key>``: clusters sharing a bucket never see each other's objects."""
        return f"{self.config.prefix}/{self.cluster}/{(fp or self.fp).hex()}/{key.hex()}"

    @property
    def pending(self) -> int:
        """Uploads queued, in flight, or confirmed and not yet announced in etcd."""
        return len(self._queue) + self._inflight + len(self._unannounced)

    # -- lifecycle (on the loop) ----------------------------------------------------------------------
    def start(self, client: EtcdClient | None) -> None:
        self.client = client
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._announce_wake = asyncio.Event()
        self._tasks.spawn(self._upload_forever(), "object-uploads")
        if self.client is not None:
            self._tasks.spawn(self._announce_forever(), "object-announce")
        if self.config.cleanup_interval_s > 0 and self.client is not None:
            self._cleanup_soon = asyncio.Event()
            self._tasks.spawn(self._cleanup_forever(), "object-cleanup")

    async def stop(self) -> None:
        """Stop uploading; what was uploaded and not yet announced is announced now (bounded by
        ``objects.timeout_s``), so no object is left that no record names."""
        if self._unannounced and self.client is not None:
            with contextlib.suppress(LMCacheP2PError, TimeoutError):
                async with asyncio.timeout(self.config.timeout_s):
                    while self._unannounced:
                        await self._announce_batch()
        await self._tasks.cancel_all()
        for item in list(self._queue):
            self._release(item)
        self._queue.clear()
        self._loop = None

    # -- uploads -----------------------------------------------------------------------------------------
    def offer(self, header: ChunkHeader, data: memoryview | Path) -> bool:
        """A chunk leaves this node's last tier (any thread, tier locks held: only copies or renames and
        enqueues). ``data``: its payload in memory, or the disk tier's file. True when it is kept for an
        upload (a file is then this tier's to delete)."""
        loop = self._loop
        if loop is None or self.config.budget_bytes_per_s == 0 or not self._keep(header):
            if loop is not None and self.config.budget_bytes_per_s == 0:
                self.dropped.labels("budget_off").inc()
            return False
        size = header.length
        if isinstance(data, Path) and self._spill_dir is None:
            return False
        with self._waiting_lock:
            full = self._waiting + size > self.config.spill_bytes
            if not full:
                self._waiting += size
        if full:
            self.dropped.labels("spill_full").inc()
            return False
        if isinstance(data, Path):
            assert self._spill_dir is not None
            moved = self._spill_dir / f"{header.key.hex()}.{uuid.uuid4().hex[:8]}.chunk"
            try:
                os.replace(data, moved)
            except OSError as exc:
                log.warning("keeping %s for its upload failed: %s", data.name, exc)
                self._release(_Upload(header, None, None, size))
                return False
            item = _Upload(header, None, moved, size)
            self.offered["file"] += 1
        else:
            item = _Upload(header, bytes(data[: header.length]), None, size)
            self.offered["memory"] += 1
        self._queue.append(item)
        with contextlib.suppress(RuntimeError):  # the loop is closing: the item is released by stop()
            loop.call_soon_threadsafe(self._wake_up)
        return True

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _release(self, item: _Upload) -> None:
        with self._waiting_lock:
            self._waiting -= item.size
        if item.path is not None:
            item.path.unlink(missing_ok=True)

    async def _upload_forever(self) -> None:
        backoff = Backoff(RETRY_FIRST_S, MAX_BACKOFF_S)
        while True:
            started = time.monotonic()
            try:
                await self._uploads()
            except Exception:  # supervised: logged, and uploads go on
                log.exception("object uploads failed")
                if time.monotonic() - started > MAX_BACKOFF_S:  # it ran a while: a new failure, not a loop
                    backoff.reset()
                await asyncio.sleep(backoff.next())

    async def _uploads(self) -> None:
        assert self._wake is not None
        slots = asyncio.Semaphore(self.config.max_inflight)
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._take_tokens(self._queue[0].size)
            await slots.acquire()
            if not self._queue:
                slots.release()
                continue
            item = self._queue.popleft()
            self._inflight += 1

            async def upload(item: _Upload = item) -> None:
                try:
                    await self._upload(item)
                finally:
                    self._inflight -= 1
                    self._release(item)
                    slots.release()

            self._tasks.spawn(upload(), "object-upload")

    async def _take_tokens(self, size: int) -> None:
        """Wait until ``objects.budget_bytes_per_s`` allows ``size`` more bytes (a burst of one second, or of
        one object larger than that); the budget is read again at least every second (a live config field)."""
        bucket = self._bucket
        while True:
            budget = float(self.config.budget_bytes_per_s)
            bucket.rate_per_s, bucket.burst = budget, max(budget, float(size))
            if bucket.take(size):
                return
            await asyncio.sleep(min(bucket.wait_s(size), 1.0))

    async def _upload(self, item: _Upload) -> None:
        header = item.header
        if self._covers(header, self.node_id):  # invalidated while it waited: never stored
            self.dropped.labels("invalidated").inc()
            return
        if not await self._claim(header):
            self.dropped.labels("uploading_elsewhere").inc()
            return
        try:
            if item.data is not None:
                payload: bytes | memoryview = item.data
            else:
                assert item.path is not None
                raw = await asyncio.to_thread(item.path.read_bytes)
                if ChunkHeader.unpack(raw) != header:
                    raise MalformedChunk("the disk file kept for upload holds another chunk")
                payload = verify(header, memoryview(raw)[HEADER_SIZE:])  # a disk fault is never uploaded
            # seal and copy off the loop (it serves pulls; OpenSSL releases the GIL)
            name = self.name(header.key)
            body = await asyncio.to_thread(pack_object, header, payload, self.node_id, name, self.seal_key)
            await self.store.put(name, body, time.monotonic() + self.config.timeout_s)
            self.bytes.labels("up").inc(len(body))
        except (ObjectStoreError, LMCacheP2PError, OSError) as exc:
            self.ops.labels("put", "error").inc()
            log.warning("upload of chunk %s failed: %s", header.key.hex()[:16], exc)
            await self._unclaim(header.key)
            return
        self.ops.labels("put", "ok").inc()
        if self._announce_wake is not None:
            self._unannounced.append(ObjectMeta(self.fp, header.key, len(body), time.time(), self.node_id,
                                                header.epoch, header.num_tokens, header.heads, header.origin,
                                                self.tenant))
            self._announce_wake.set()

    async def _claim(self, header: ChunkHeader) -> bool:
        """Claim the chunk's object name before the PUT: two nodes uploading one chunk would leave the object
        of one beside the meta of the other, which readers refuse as a replay (and delete). The claim is an
        etcd record put only where neither a meta nor another claim stands, under a lease never kept alive
        (one per ``CLAIM_LEASE_EVERY_S``, of ``CLAIM_TTL_S``: a node that dies mid-upload lets its claims
        lapse); the announce deletes it. False: another node's
        object stands or is on its way. etcd unreachable: uploaded unclaimed (announcing waits for etcd
        anyway; the race is then only a lost object, never wrong KV)."""
        if self.client is None:
            return True
        meta, claim = self.schema.object_meta(self.fp, header.key), self.schema.upload_claim(self.fp, header.key)
        try:
            if self._claim_lease is None or time.monotonic() - self._claim_lease[1] > CLAIM_LEASE_EVERY_S:
                self._claim_lease = ((await self.client.grant(CLAIM_TTL_S))[0], time.monotonic())
            ok, _ = await self.client.txn([compare_mod_revision(meta, 0), compare_mod_revision(claim, 0)],
                                          [op_put(claim, self.node_id.encode(), lease=self._claim_lease[0])])
            return ok
        except LMCacheP2PError as exc:
            log.debug("claiming the upload of chunk %s: %s (uploaded unclaimed)", header.key.hex()[:16], exc)
            return True

    async def _unclaim(self, key: ChunkKey) -> None:
        if self.client is not None:
            with contextlib.suppress(LMCacheP2PError):
                await self.client.txn([], [op_delete(self.schema.upload_claim(self.fp, key))])

    async def _announce_forever(self) -> None:
        """Confirmed uploads into etcd, in batches: per object its index entry (``@objects``, tier 3) and the
        cleanup's record, without a lease. With etcd down they wait (the newest ``MAX_UNANNOUNCED``)."""
        assert self._announce_wake is not None and self.client is not None
        backoff = Backoff(RETRY_FIRST_S, MAX_BACKOFF_S)
        while True:
            if not self._unannounced:
                self._announce_wake.clear()
                await self._announce_wake.wait()
                continue
            try:
                await self._announce_batch()
                backoff.reset()
            except LMCacheP2PError as exc:
                log.warning("announcing uploaded objects failed (retried): %s", exc)
                await asyncio.sleep(backoff.next())
            except Exception:  # supervised: logged, and the next batch is tried
                log.exception("announcing uploaded objects failed")
                await asyncio.sleep(backoff.next())

    async def _announce_batch(self) -> None:
        """One txn of up to ``ANNOUNCE_BATCH`` confirmed uploads (put back in front if it fails). An object an
        invalidation covers by now is deleted instead."""
        assert self.client is not None
        batch = [self._unannounced.popleft() for _ in range(min(ANNOUNCE_BATCH, len(self._unannounced)))]
        ops: list[object] = []
        for meta in batch:
            if self._covered(meta):
                self.forget_soon(meta.key, meta.fp, delete_object=True)
                continue
            ops += [op_put(self.schema.object_meta(meta.fp, meta.key), meta.pack()),
                    op_put(self.schema.block(meta.fp, meta.key, OBJECTS), bytes([TIER_OBJECT])),
                    op_delete(self.schema.upload_claim(meta.fp, meta.key))]
        if not ops:
            return
        try:
            await self.client.txn([], ops)
        except BaseException:
            self._unannounced.extendleft(reversed(batch))
            raise

    def _covered(self, meta: ObjectMeta) -> bool:
        header = ChunkHeader(meta.key, meta.fp, 0, meta.num_tokens, 0, meta.epoch, meta.heads, meta.origin)
        if self._covers(header, meta.node):
            return True
        return bool(meta.tenant) and self._covers_tenant is not None and self._covers_tenant(header, meta.tenant)

    @property
    def unannounced(self) -> int:
        return len(self._unannounced)

    # -- reads (the transport's) -------------------------------------------------------------------------
    def usable(self) -> bool:
        """Not backed off after errors (an unreachable store costs one deadline, then is left alone)."""
        return self.health.available(self.address)

    def covers(self, header: ChunkHeader, holder: NodeId) -> bool:
        """Whether an invalidation or quarantine stands against an object ``holder`` uploaded."""
        return self._covers(header, holder)

    def forget_soon(self, key: ChunkKey, fp: FingerprintDigest, *, delete_object: bool) -> None:
        """On the loop: :meth:`_forget` in the background."""
        self._tasks.spawn(self._forget(key, delete_object=delete_object, fp=fp), "object-forget")

    async def _forget(self, key: ChunkKey, *, delete_object: bool, fp: FingerprintDigest | None = None) -> None:
        """Delete an object (when asked) and its etcd entries; failures are logged, the next cleanup retries."""
        fp = fp or self.fp
        try:
            if delete_object:
                with contextlib.suppress(ObjectMissing):
                    await self.store.delete(self.name(key, fp), time.monotonic() + self.config.timeout_s)
                self.ops.labels("delete", "ok").inc()
            if self.client is not None:
                await self.client.txn([], [op_delete(self.schema.object_meta(fp, key)),
                                           op_delete(self.schema.block(fp, key, OBJECTS))])
        except LMCacheP2PError as exc:
            self.ops.labels("delete", "error").inc()
            log.warning("forgetting object %s failed: %s", key.hex()[:16], exc)

    # -- cleanup -------------------------------------------------------------------------------------------
    def cleanup_soon(self) -> None:
        """On the loop: a new invalidation arrived; the next cleanup pass runs now."""
        if self._cleanup_soon is not None:
            self._cleanup_soon.set()

    async def _cleanup_forever(self) -> None:
        await every(lambda: self.config.cleanup_interval_s, self.cleanup, "object cleanup", wake=self._cleanup_soon)

    async def cleanup(self) -> int:
        """Delete the objects (of every fingerprint: a model nobody serves any more too) that an invalidation
        covers or the chunk TTL expired; returns how many. Also counts this fingerprint's objects and bytes."""
        if self.client is None:
            return 0
        kvs, _rev = await self.client.get_prefix(self.schema.objects)
        metas: list[ObjectMeta] = []
        for kv in kvs:
            try:
                metas.append(decode_object_meta(kv.key, kv.value, prefix_len=len(self.schema.objects)))
            except MalformedRecord as exc:
                self.rejects.add(exc, kv.key)
        ttl, now = self._ttl_s(), time.time()
        doomed = [m for m in metas if (ttl is not None and now - m.uploaded_at >= ttl) or self._covered(m)]
        for meta in doomed:
            await self._forget(meta.key, delete_object=True, fp=meta.fp)
        gone = {(m.fp, m.key) for m in doomed}
        mine = [m for m in metas if m.fp == self.fp and (m.fp, m.key) not in gone]
        self.objects, self.object_bytes = len(mine), sum(m.size for m in mine)
        if doomed:
            log.info("object cleanup: deleted %d objects (invalidated or past the chunk TTL), %d of this fingerprint "
                     "kept", len(doomed), len(mine))
        return len(doomed)
