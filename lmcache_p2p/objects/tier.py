"""The object tier: chunks that leave every node's memory and disk, kept in an S3-compatible store.

    eviction (tier locks)        uploader (the agent's loop)            any node's load
    ---------------------        ---------------------------            ---------------
    last tier drops a chunk:     budget (bytes/s) and max_inflight ->   the index lists ``@objects``
    sole copy, hit >= min_hits?  PUT <prefix>/<fp>/<key>, then one      as an owner (tier 3): the
    keep its bytes (memory, or   etcd txn: objects/<fp>/<key> (meta)    planner weighs it like a slow
    the disk file moved aside)   + blocks/<fp>/<key>/@objects; the      peer (measured latency and
    and queue it                 kept bytes go once the PUT answered    bandwidth) -> GET, verify, pool

An object is immutable and content-addressed: its name is the chunk's (the key already hashes the
tokens, the model and everything else that decides the KV), its body::

    [80-byte chunk header][payload][uploader node id][u8 its length][32-byte MAC, when a secret is set]

A read checks the length, the header's key, fingerprint and checksum and, with a cluster secret,
the keyed BLAKE3 MAC over everything before it (the store is not trusted: anyone with write access
could put bytes with a matching xxh3 there; without the secret they cannot MAC them). A bad object
is deleted with its etcd entries and never served; an object a standing invalidation covers (by its
epoch, fingerprint or uploader) is never loaded and is deleted. The cleanup pass reads the
``objects/`` records of this node's fingerprint and deletes what an invalidation covers or
``tiers.chunk_ttl_s`` expired (every node with the tier runs it: deletes are idempotent).

Faults: every store call has a deadline (a load's own; ``objects.timeout_s`` for the rest), an error is
a miss and backs the store off (doubling from ``transfer.backoff_s``) but is never remembered as
"absent"; only a 404 removes the index entries. Saves never wait on the store: an offer only
enqueues, and past ``objects.spill_bytes`` of bytes waiting it drops the chunk (counted).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, Protocol

import blake3

from ..aio import remaining
from ..chunk import HEADER_SIZE, ChunkHeader, slice_heads, verify
from ..config import AgentConfig
from ..errors import ChunkError, LMCacheP2PError, MalformedChunk, MalformedRecord, ObjectMissing, ObjectStoreError
from ..ids import NODE_ID_RE, OBJECTS, TIER_OBJECT, NodeId
from ..index.client import EtcdClient, op_delete, op_put
from ..index.schema import ObjectMeta, Rejects, Schema, decode_object_meta
from ..keys import ChunkKey, Fingerprint, FingerprintDigest, HeadRange
from ..metrics import AgentMetrics
from ..plan import PlannedChunk
from ..tiers import TieredStore
from .store import ObjectStore

log = logging.getLogger(__name__)

MAC_BYTES = 32
FETCH_PARALLEL = 8  # object reads in flight per load
MAX_BACKOFF_S = 30.0
ANNOUNCE_BATCH = 64  # uploads announced per etcd txn (2 operations each: etcd's default --max-txn-ops is 128)
MAX_UNANNOUNCED = 65536  # uploads confirmed but not yet in etcd (etcd down): beyond, the oldest are forgotten
ANNOUNCE_RETRY_S = 1.0


class Node(Protocol):
    """What the object tier uses of its agent (:class:`~lmcache_p2p.agent.CacheAgent`)."""

    config: AgentConfig
    fp: FingerprintDigest
    fingerprint: Fingerprint
    node_id: NodeId
    heads: HeadRange
    tiers: TieredStore
    metrics: AgentMetrics

    def covers(self, header: ChunkHeader, holder: NodeId) -> bool: ...

    def computed_by_quarantined(self, header: ChunkHeader) -> bool: ...

    def wants_upload(self, header: ChunkHeader) -> bool: ...

    def observe_objects(self, nbytes: int, seconds: float) -> None: ...


@dataclasses.dataclass(slots=True)
class _Upload:
    header: ChunkHeader
    data: bytes | None  # the chunk's payload, copied out of the CPU pool
    path: Path | None  # or the disk tier's file (header + payload), moved aside
    size: int


def object_mac(secret: bytes, body: bytes | memoryview) -> bytes:
    """Keyed BLAKE3 under a key derived from the cluster secret (4.4x BLAKE2b's speed here: 2.5 GB/s)."""
    return blake3.blake3(body, key=hashlib.sha256(b"lmcache-p2p object\0" + secret).digest()).digest(MAC_BYTES)


def pack_object(header: ChunkHeader, payload: bytes | memoryview, node: NodeId, secret: bytes | None) -> bytes:
    node_bytes = node.encode()
    body = b"".join((header.pack(), payload, node_bytes, bytes([len(node_bytes)])))
    return body + object_mac(secret, body) if secret else body


def unpack_object(data: bytes, key: ChunkKey, fp: FingerprintDigest, secret: bytes | None
                  ) -> tuple[ChunkHeader, memoryview, NodeId]:
    """The verified header, payload and uploader of an object that should hold chunk ``key``; raises
    :class:`~lmcache_p2p.errors.ChunkError` for anything else."""
    view = memoryview(data)
    if secret:
        if len(view) < HEADER_SIZE + 2 + MAC_BYTES:
            raise MalformedChunk(f"object of {len(view)} bytes is too short")
        body, mac = view[:-MAC_BYTES], view[-MAC_BYTES:]
        if not hmac.compare_digest(object_mac(secret, body), mac):
            raise MalformedChunk("object MAC does not match the cluster secret")
        view = body
    header = ChunkHeader.unpack(view)
    if header.key != key or header.fingerprint != fp:
        raise MalformedChunk(f"object holds chunk {header.key.hex()[:16]} of {header.fingerprint.hex()[:8]}")
    end = HEADER_SIZE + header.length
    if len(view) < end + 1 or len(view) != end + view[-1] + 1:
        raise MalformedChunk(f"object is {len(view)} bytes, its header says a {header.length}-byte payload")
    node = bytes(view[end:-1]).decode("ascii", errors="replace")
    if not NODE_ID_RE.fullmatch(node):
        raise MalformedChunk(f"object names an invalid uploader {node[:40]!r}")
    return header, verify(header, view[HEADER_SIZE:end]), NodeId(node)


class ObjectTier:
    def __init__(self, agent: Node, store: ObjectStore, client: EtcdClient | None, *, secret: bytes | None = None,
                 spill_dir: Path | None = None, rejects: Rejects | None = None) -> None:
        self.agent = agent
        self.store = store
        self.client = client
        self.config = agent.config.objects
        self._secret = secret
        self._schema = Schema(agent.config.cluster)
        self._spill_dir = spill_dir
        self.rejects = rejects if rejects is not None else Rejects()
        self._queue: collections.deque[_Upload] = collections.deque()
        self._waiting = 0  # bytes kept for uploads queued or in flight
        self._waiting_lock = threading.Lock()  # offers come from the tiers' threads, releases from the loop
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tokens = float(self.config.budget_bytes_per_s)
        self._refilled = time.monotonic()
        self._inflight = 0
        self._failures = 0
        self._backoff_until = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._unannounced: collections.deque[ObjectMeta] = collections.deque(maxlen=MAX_UNANNOUNCED)
        self._announce_wake: asyncio.Event | None = None
        self._cleanup_soon: asyncio.Event | None = None
        self.offered = {"memory": 0, "file": 0}  # chunks taken for upload: CPU victims' bytes, disk victims' files
        self.objects = 0  # this fingerprint's objects and their bytes, as of the last cleanup pass
        self.object_bytes = 0
        metrics = agent.metrics
        self.ops, self.bytes, self.dropped = metrics.object_ops, metrics.object_bytes, metrics.object_uploads_dropped
        metrics.on_collect(self._gauges)
        if spill_dir is not None:  # bytes kept by a previous run for uploads it never made: not ours to trust
            with contextlib.suppress(OSError):
                for stale in spill_dir.glob("*.chunk"):
                    stale.unlink(missing_ok=True)

    def _gauges(self) -> None:
        metrics = self.agent.metrics
        running = self._loop is not None
        metrics.object_tier.set(1 if running else 0)
        metrics.object_uploads_pending.set(self.pending if running else 0)
        metrics.objects.set(self.objects)

    def name(self, key: ChunkKey, fp: FingerprintDigest | None = None) -> str:
        """``<prefix>/<cluster>/<fingerprint>/<key>``: clusters sharing a bucket never see each other's objects."""
        return f"{self.config.prefix}/{self.agent.config.cluster}/{(fp or self.agent.fp).hex()}/{key.hex()}"

    @property
    def pending(self) -> int:
        """Uploads queued, in flight, or confirmed and not yet announced in etcd."""
        return len(self._queue) + self._inflight + len(self._unannounced)

    # -- lifecycle (on the loop) ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._announce_wake = asyncio.Event()
        self._spawn(self._upload_forever(), "object-uploads")
        if self.client is not None:
            self._spawn(self._announce_forever(), "object-announce")
        if self.config.cleanup_interval_s > 0 and self.client is not None:
            self._cleanup_soon = asyncio.Event()
            self._spawn(self._cleanup_forever(), "object-cleanup")

    async def stop(self) -> None:
        """Stop uploading; what was uploaded and not yet announced is announced now (bounded by
        ``objects.timeout_s``), so no object is left that no record names."""
        if self._unannounced and self.client is not None:
            with contextlib.suppress(LMCacheP2PError, TimeoutError):
                async with asyncio.timeout(self.config.timeout_s):
                    while self._unannounced:
                        await self._announce_batch()
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for item in list(self._queue):
            self._release(item)
        self._queue.clear()
        self._loop = None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("object tier task %s failed: %r", task.get_name(), task.exception())

    # -- uploads -----------------------------------------------------------------------------------------
    def offer(self, header: ChunkHeader, data: memoryview | Path) -> bool:
        """A chunk leaves this node's last tier (any thread, tier locks held: only copies or renames and
        enqueues). ``data``: its payload in memory, or the disk tier's file. True when it is kept for an
        upload (a file is then this tier's to delete)."""
        loop = self._loop
        if loop is None or self.config.budget_bytes_per_s == 0 or not self.agent.wants_upload(header):
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
        while True:
            try:
                await self._uploads()
            except Exception:  # supervised: logged, and uploads go on
                log.exception("object uploads failed")
                await asyncio.sleep(ANNOUNCE_RETRY_S)

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

            self._spawn(upload(), "object-upload")

    async def _take_tokens(self, size: int) -> None:
        """Wait until ``objects.budget_bytes_per_s`` allows ``size`` more bytes (a burst of one second)."""
        budget = float(self.config.budget_bytes_per_s)
        while True:
            now = time.monotonic()
            self._tokens = min(max(budget, float(size)), self._tokens + (now - self._refilled) * budget)
            self._refilled = now
            if self._tokens >= size:
                self._tokens -= size
                return
            await asyncio.sleep((size - self._tokens) / budget)

    async def _upload(self, item: _Upload) -> None:
        header, agent = item.header, self.agent
        if agent.covers(header, agent.node_id):  # invalidated while it waited: never stored
            self.dropped.labels("invalidated").inc()
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
            # MAC and copy off the loop (it serves pulls; hashlib releases the GIL on large buffers)
            body = await asyncio.to_thread(pack_object, header, payload, agent.node_id, self._secret)
            await self.store.put(self.name(header.key), body, time.monotonic() + self.config.timeout_s)
            self.bytes.labels("up").inc(len(body))
        except (ObjectStoreError, LMCacheP2PError, OSError) as exc:
            self.ops.labels("put", "error").inc()
            log.warning("upload of chunk %s failed: %s", header.key.hex()[:16], exc)
            return
        self.ops.labels("put", "ok").inc()
        if self._announce_wake is not None:
            self._unannounced.append(ObjectMeta(agent.fp, header.key, len(body), time.time(), agent.node_id,
                                                header.epoch, header.num_tokens, header.heads, header.origin))
            self._announce_wake.set()

    async def _announce_forever(self) -> None:
        """Confirmed uploads into etcd, in batches: per object its index entry (``@objects``, tier 3) and the
        cleanup's record, without a lease. With etcd down they wait (the newest ``MAX_UNANNOUNCED``)."""
        assert self._announce_wake is not None and self.client is not None
        while True:
            if not self._unannounced:
                self._announce_wake.clear()
                await self._announce_wake.wait()
                continue
            try:
                await self._announce_batch()
            except LMCacheP2PError as exc:
                log.warning("announcing uploaded objects failed (retried): %s", exc)
                await asyncio.sleep(ANNOUNCE_RETRY_S)
            except Exception:  # supervised: logged, and the next batch is tried
                log.exception("announcing uploaded objects failed")
                await asyncio.sleep(ANNOUNCE_RETRY_S)

    async def _announce_batch(self) -> None:
        """One txn of up to ``ANNOUNCE_BATCH`` confirmed uploads (put back in front if it fails). An object an
        invalidation covers by now is deleted instead."""
        assert self.client is not None
        batch = [self._unannounced.popleft() for _ in range(min(ANNOUNCE_BATCH, len(self._unannounced)))]
        ops: list[object] = []
        for meta in batch:
            if self._covered(meta):
                self._spawn(self._forget(meta.key, delete_object=True, fp=meta.fp), "object-forget")
                continue
            ops += [op_put(self._schema.object_meta(meta.fp, meta.key), meta.pack()),
                    op_put(self._schema.block(meta.fp, meta.key, OBJECTS), bytes([TIER_OBJECT]))]
        if not ops:
            return
        try:
            await self.client.txn([], ops)
        except BaseException:
            self._unannounced.extendleft(reversed(batch))
            raise

    def _covered(self, meta: ObjectMeta) -> bool:
        return self.agent.covers(ChunkHeader(meta.key, meta.fp, 0, meta.num_tokens, 0, meta.epoch, meta.heads,
                                             meta.origin), meta.node)

    @property
    def unannounced(self) -> int:
        return len(self._unannounced)

    # -- loads -------------------------------------------------------------------------------------------
    def usable(self) -> bool:
        """Not backed off after errors (an unreachable store costs one deadline, then is left alone)."""
        return time.monotonic() >= self._backoff_until

    def _failed(self) -> None:
        self._failures += 1
        base = max(self.agent.config.transfer.backoff_s, 0.1)
        self._backoff_until = time.monotonic() + min(MAX_BACKOFF_S, base * 2 ** (self._failures - 1))

    async def fetch(self, chunks: Sequence[PlannedChunk], deadline: float) -> list[PlannedChunk]:
        """Read ``chunks`` from the store into the CPU pool by ``deadline``; returns those that missed.

        The store's speed is measured per load (its bytes over the load's wall time, reads in parallel),
        which is what the fetch-or-recompute budget predicts."""
        gate = asyncio.Semaphore(FETCH_PARALLEL)
        failed = False
        got = 0
        t0 = time.perf_counter()

        async def one(chunk: PlannedChunk) -> bool:
            nonlocal failed, got
            async with gate:
                try:
                    data = await self._read(chunk, deadline)
                except ObjectStoreError:
                    failed = True
                    return False
                if data is None:
                    return False
                got += len(data)
                return await self._land(chunk, data, deadline)

        results = await asyncio.gather(*(one(c) for c in chunks))
        if failed:  # one backoff step per load, however many of its reads hung on the same store
            self._failed()
        elif got:
            self._failures = 0
            self.agent.observe_objects(got, time.perf_counter() - t0)
        return [c for c, ok in zip(chunks, results, strict=True) if not ok]

    async def _read(self, chunk: PlannedChunk, deadline: float) -> bytes | None:
        """The object's bytes; None when it is not to be had (a 404 forgets it); raises ObjectStoreError when
        the store failed."""
        if remaining(deadline) <= 0 or not self.usable():
            return None
        try:
            data = await self.store.get(self.name(chunk.key), deadline)
        except ObjectMissing:
            self.ops.labels("get", "missing").inc()
            self._spawn(self._forget(chunk.key, delete_object=False), "object-forget")
            return None
        except ObjectStoreError as exc:
            self.ops.labels("get", "error").inc()
            log.warning("object read of %s failed: %s", chunk.key.hex()[:16], exc)
            raise
        self.bytes.labels("down").inc(len(data))
        return data

    async def _land(self, chunk: PlannedChunk, data: bytes, deadline: float) -> bool:
        """Verify an object read for ``chunk`` and store it in the CPU pool; True when it landed. A bad,
        invalidated or quarantined uploader's object is deleted."""
        name = self.name(chunk.key)
        try:
            header, payload, uploader = await asyncio.to_thread(unpack_object, data, chunk.key, self.agent.fp,
                                                                self._secret)
            if header.heads != chunk.heads:
                header, payload = slice_heads(header, payload, chunk.heads)
        except ChunkError as exc:
            self.ops.labels("get", "corrupt").inc()
            log.error("object %s is not chunk %s: %s; deleted", name, chunk.key.hex()[:16], exc)
            self._spawn(self._forget(chunk.key, delete_object=True), "object-forget")
            return False
        if self.agent.covers(header, uploader) or self.agent.computed_by_quarantined(header):
            self.ops.labels("get", "invalidated").inc()
            self._spawn(self._forget(chunk.key, delete_object=True), "object-forget")
            return False
        if remaining(deadline) <= 0:  # verified too late: the engine is recomputing it already
            self.ops.labels("get", "late").inc()
            return False
        try:
            stored = await asyncio.to_thread(self.agent.tiers.put_verified, header, payload)
        except LMCacheP2PError as exc:
            log.warning("storing object %s failed: %s", chunk.key.hex()[:16], exc)
            stored = False
        self.ops.labels("get", "ok" if stored else "refused").inc()
        return stored

    async def _forget(self, key: ChunkKey, *, delete_object: bool, fp: FingerprintDigest | None = None) -> None:
        """Delete an object (when asked) and its etcd entries; failures are logged, the next cleanup retries."""
        fp = fp or self.agent.fp
        try:
            if delete_object:
                with contextlib.suppress(ObjectMissing):
                    await self.store.delete(self.name(key, fp), time.monotonic() + self.config.timeout_s)
                self.ops.labels("delete", "ok").inc()
            if self.client is not None:
                await self.client.txn([], [op_delete(self._schema.object_meta(fp, key)),
                                           op_delete(self._schema.block(fp, key, OBJECTS))])
        except LMCacheP2PError as exc:
            self.ops.labels("delete", "error").inc()
            log.warning("forgetting object %s failed: %s", key.hex()[:16], exc)

    # -- cleanup -------------------------------------------------------------------------------------------
    def cleanup_soon(self) -> None:
        """On the loop: a new invalidation arrived; the next cleanup pass runs now."""
        if self._cleanup_soon is not None:
            self._cleanup_soon.set()

    async def _cleanup_forever(self) -> None:
        assert self._cleanup_soon is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cleanup_soon.wait(), self.config.cleanup_interval_s)
            self._cleanup_soon.clear()
            try:
                await self.cleanup()
            except LMCacheP2PError as exc:
                log.warning("object cleanup failed: %s", exc)
            except Exception:  # supervised: logged, and the next pass runs
                log.exception("object cleanup failed")

    async def cleanup(self) -> int:
        """Delete the objects (of every fingerprint: a model nobody serves any more too) that an invalidation
        covers or the chunk TTL expired; returns how many. Also counts this fingerprint's objects and bytes."""
        if self.client is None:
            return 0
        kvs, _rev = await self.client.get_prefix(self._schema.objects)
        metas: list[ObjectMeta] = []
        for kv in kvs:
            try:
                metas.append(decode_object_meta(kv.key, kv.value, prefix_len=len(self._schema.objects)))
            except MalformedRecord as exc:
                self.rejects.add(exc, kv.key)
        ttl, now = self.agent.config.tiers.chunk_ttl_s, time.time()
        doomed = [m for m in metas if (ttl is not None and now - m.uploaded_at >= ttl) or self._covered(m)]
        for meta in doomed:
            await self._forget(meta.key, delete_object=True, fp=meta.fp)
        gone = {(m.fp, m.key) for m in doomed}
        mine = [m for m in metas if m.fp == self.agent.fp and (m.fp, m.key) not in gone]
        self.objects, self.object_bytes = len(mine), sum(m.size for m in mine)
        if doomed:
            log.info("object cleanup: deleted %d objects (invalidated or past the chunk TTL), %d of this fingerprint "
                     "kept", len(doomed), len(mine))
        return len(doomed)
