"""Reads from the object store, as one more transport of the :class:`~lmcache_p2p.transfer.pull.Puller`.

    one pull (the chunks planned at ``@objects``)
    ---------------------------------------------
    1 the etcd metas of its chunks, one linearizable txn per 64: the epoch each object was uploaded at
      (no meta: the object is gone with it, ``absent``)
    2 per chunk, FETCH_PARALLEL at once: a ranged GET of at most max_object_size(pool slot) bytes
      404 -> absent (entries forgotten); larger or empty -> refused (deleted); store error -> the pull fails
    3 open it off the loop (authenticate, decrypt, check key, fingerprint, checksum: ``format.py``), then
      its header's epoch against the meta's: older -> a replay (refused, deleted); newer -> an upload not
      yet announced (a miss, kept); then the invalidation gate, then into the pool

The store is not trusted (``tier.py``); etcd is: a bucket writer can put an older object of the same name
back, not change the meta that says which epoch the name holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from ..aio import remaining
from ..chunk import ChunkHeader, slice_heads
from ..errors import (
    ChunkError,
    LMCacheP2PError,
    MalformedRecord,
    ObjectMissing,
    ObjectSizeRefused,
    ObjectStoreError,
    PeerTimeout,
    TransferError,
)
from ..ids import NodeId, PeerAddress
from ..index.records import decode_object_meta
from ..keys import ChunkKey, FingerprintDigest
from ..tiers.cpu_pool import CpuPool
from ..transfer.base import MissReason, PullResult, Want
from ..transfer.guard import GuardedTransport
from .format import max_object_size, unpack_object

if TYPE_CHECKING:
    from .tier import ObjectTier

log = logging.getLogger(__name__)

FETCH_PARALLEL = 8  # object reads in flight per load
META_BATCH = 64  # metas read per etcd txn (etcd's default --max-txn-ops is 128)


class ObjectTransport(GuardedTransport):
    """The object store as one more transport (``objects``): the :class:`~lmcache_p2p.transfer.pull.Puller`
    pulls from it like from a slow peer (the node ``@objects``), through the same retry round and backoff
    rule (:func:`~lmcache_p2p.transfer.guard.guarded_pull`, :class:`PeerHealth`).

    A read is bounded, authenticated and checked against its meta's epoch (the module docstring), cut to
    the heads wanted and committed into the pool (the pool's admission gate applies); an object that is not
    its chunk, or that an invalidation or quarantine stands against, is deleted with its etcd entries. A 404
    is ``absent`` (its entries are forgotten); a store error, an etcd error reading the metas, or a read past
    the deadline fails the rest of the pull and backs the store off, never "absent". The store's speed is
    measured per pull (its bytes over the pull's wall time, reads in parallel): what the fetch-or-recompute
    budget predicts."""

    name = "objects"

    def __init__(self, tier: ObjectTier) -> None:
        self.tier = tier
        self.health = tier.health
        self.address = tier.address

    async def _pull(self, peer: PeerAddress, fp: FingerprintDigest, wants: Sequence[Want], dst: CpuPool,
                    result: PullResult, deadline: float, silence_s: float | None) -> None:
        """``silence_s`` is not used: the store sends no acks (its requests' own timeouts bound them)."""
        if fp != self.tier.fp:  # only this fingerprint's tenant key is known here: never read (nor delete) others
            result.miss_rest(wants, MissReason.ABSENT)
            return
        epochs = await self._epochs(fp, [w.key for w in wants], deadline)
        limit = max_object_size(dst.slot_bytes)
        gate = asyncio.Semaphore(FETCH_PARALLEL)
        failed: list[ObjectStoreError] = []

        async def one(want: Want) -> None:
            async with gate:
                if failed or remaining(deadline) <= 0:
                    return  # the store failed this pull already, or time is up: missed with the rest
                epoch = epochs.get(want.key)
                if epoch is None:
                    result.missed[want.key] = MissReason.ABSENT
                    return
                try:
                    data = await self._read(want.key, fp, limit, deadline)
                except ObjectStoreError as exc:
                    failed.append(exc)
                    return
                except ObjectSizeRefused as exc:
                    self._refuse(want.key, fp, "oversize" if exc.size > limit else "corrupt", str(exc))
                    result.missed[want.key] = MissReason.CHECKSUM
                    return
                if data is None:
                    result.missed[want.key] = MissReason.ABSENT
                    return
                await self._land(want, fp, data, epoch, dst, result, deadline)

        await asyncio.gather(*(one(w) for w in wants))
        if failed:  # one backoff step per pull, however many of its reads hung on the same store
            raise TransferError(f"object store: {failed[0]}")
        if remaining(deadline) <= 0 and any(w.key not in result.loaded and w.key not in result.missed for w in wants):
            raise PeerTimeout("object store: reads not done by the deadline")

    async def _epochs(self, fp: FingerprintDigest, keys: list[ChunkKey], deadline: float) -> dict[ChunkKey, int]:
        """Chunk -> the epoch its object was uploaded at, from the etcd metas (linearizable: a member that lags
        must not vouch for an older epoch). A chunk without a (valid) meta is left out."""
        tier = self.tier
        if tier.client is None:
            return {}
        schema, out = tier.schema, {}
        try:
            async with asyncio.timeout(max(remaining(deadline), 0.0)):
                for i in range(0, len(keys), META_BATCH):
                    found, _rev = await tier.client.get_prefixes(
                        [schema.object_meta(fp, k) for k in keys[i:i + META_BATCH]], serializable=False)
                    for kv in (kv for kvs in found for kv in kvs):
                        try:
                            meta = decode_object_meta(kv.key, kv.value, prefix_len=len(schema.objects))
                        except MalformedRecord as exc:
                            tier.rejects.add(exc, kv.key)
                            continue
                        out[meta.key] = meta.epoch
        except (LMCacheP2PError, TimeoutError) as exc:
            raise TransferError(f"object store: reading the objects' metas from etcd failed: {exc}") from exc
        return out

    async def _read(self, key: ChunkKey, fp: FingerprintDigest, limit: int, deadline: float) -> bytes | None:
        """The object's bytes (at most ``limit``); None when it is not there (a 404 forgets it); raises
        ObjectStoreError when the store failed, ObjectSizeRefused for an object no chunk packs into."""
        tier = self.tier
        try:
            data = await tier.store.get(tier.name(key, fp), deadline, limit=limit)
        except ObjectMissing:
            tier.ops.labels("get", "missing").inc()
            tier.forget_soon(key, fp, delete_object=False)
            return None
        except ObjectStoreError as exc:
            tier.ops.labels("get", "error").inc()
            log.warning("object read of %s failed: %s", key.hex()[:16], exc)
            raise
        tier.bytes.labels("down").inc(len(data))
        return data

    def _refuse(self, key: ChunkKey, fp: FingerprintDigest, result: str, why: str) -> None:
        """An object that must never be served: counted, logged, deleted with its etcd entries."""
        self.tier.ops.labels("get", result).inc()
        log.error("object %s refused (%s): %s; deleted", self.tier.name(key, fp), result, why)
        self.tier.forget_soon(key, fp, delete_object=True)

    async def _land(self, want: Want, fp: FingerprintDigest, data: bytes, epoch: int, dst: CpuPool,
                    result: PullResult, deadline: float) -> None:
        """Open an object read for ``want`` (off the loop), check it against its meta's ``epoch`` and the
        invalidation gate, and commit it into ``dst``."""
        tier, key = self.tier, want.key
        try:
            header, payload, uploader = await asyncio.to_thread(unpack_object, data, tier.name(key, fp), key, fp,
                                                                tier.seal_key)
            if want.heads is not None and header.heads != want.heads:
                header, payload = slice_heads(header, payload, want.heads)
        except ChunkError as exc:
            self._refuse(key, fp, "corrupt", str(exc))
            result.missed[key] = MissReason.CHECKSUM
            return
        if header.epoch < epoch:  # an older object of this name put back: etcd says the name holds a newer one
            self._refuse(key, fp, "replayed", f"epoch {header.epoch:#x}, its meta says {epoch:#x}")
            result.missed[key] = MissReason.CHECKSUM
            return
        if header.epoch > epoch:  # uploaded again, its meta not announced yet (or read before it was): kept
            tier.ops.labels("get", "unannounced").inc()
            result.missed[key] = MissReason.ABSENT
            return
        self._commit(want, header, payload, uploader, dst, result, deadline)

    def _commit(self, want: Want, header: ChunkHeader, payload: memoryview, uploader: NodeId, dst: CpuPool,
                result: PullResult, deadline: float) -> None:
        tier, key = self.tier, want.key
        if tier.covers(header, uploader):
            tier.ops.labels("get", "invalidated").inc()
            tier.forget_soon(key, header.fingerprint, delete_object=True)
            result.missed[key] = MissReason.INVALIDATED
            return
        if remaining(deadline) <= 0:  # verified too late: the engine is recomputing it already
            tier.ops.labels("get", "late").inc()
            result.missed[key] = MissReason.LATE
            return
        try:
            stored = dst.put(header if want.store_as is None else dataclasses.replace(header, key=want.store_as),
                             payload)
        except LMCacheP2PError as exc:
            log.warning("storing object %s failed: %s", key.hex()[:16], exc)
            stored = False
        tier.ops.labels("get", "ok" if stored else "refused").inc()
        if stored:
            result.loaded[key] = header
        else:
            result.missed[key] = MissReason.INVALIDATED

    def forget_except(self, live: Collection[PeerAddress]) -> None:
        """No per-peer state: the store is one address."""

    async def close(self) -> None:
        """Nothing held open."""
