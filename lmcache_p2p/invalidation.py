"""Invalidation across the mesh: drop chunks everywhere, bytes and index entries alike.

An operator (``lmcache-p2p invalidate``) writes one key; every agent watches the prefix::

    invalidate/<id>   msgpack {kind, value, issued_at}   on a lease of ISSUE_TTL_S (they expire)

    kind          value                 an agent drops
    fingerprint   hex prefix (>= 8)     every chunk whose fingerprint digest starts with it (model upgrade)
    tenant        tenant salt           every chunk of its fingerprints salted with it
    node          node id               everything, if it is that node

Each agent reads the existing keys when it starts (so a node that was down catches up within
the lease), then follows one watch. An invalidation is applied once per agent process, to every
matching chunk it holds at that moment: ``TieredStore.remove`` frees the CPU slot and deletes the
disk file, and the store's listener deletes the block entry in etcd. Invalidation is a purge at
a point in time: chunks stored afterwards (a node still serving the old model) stay.

The per-chunk TTL (``tiers.chunk_ttl_s``) is a local sweep every ``min(ttl/4, 5 s)``: a chunk's age
counts from the oldest copy this node has seen of it (CPU ``stored_at``, disk file mtime), so a
chunk written back to disk does not restart its clock. Removals are counted in
``lmcache_p2p_invalidated_chunks_total{reason}`` (reason: fingerprint, tenant, node, ttl).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import msgpack
from etcd3aio._protobuf import WatchCreateRequest, WatchRequest, WatchStub
from etcd3aio.kv import prefix_range_end
from prometheus_client import CollectorRegistry, Counter

from .aio import LoopThread
from .config import AgentConfig
from .errors import IndexError_, LMCacheP2PError
from .index.client import EtcdClient
from .index.schema import NodeId, Schema
from .keys import ChunkKey, Fingerprint, FingerprintDigest

if TYPE_CHECKING:  # the tiers import torch; the invalidate CLI must start fast
    from .tiers import TieredStore

log = logging.getLogger(__name__)

KINDS = ("fingerprint", "tenant", "node")
ISSUE_TTL_S = 600
MIN_FP_PREFIX = 8
MAX_SWEEP_INTERVAL_S = 5.0
_PUT = 0  # mvccpb.Event.EventType


@dataclasses.dataclass(frozen=True, slots=True)
class Invalidation:
    id: str
    kind: str
    value: str
    issued_at: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"invalidation kind must be one of {KINDS}, got {self.kind!r}")
        if not self.value:
            raise ValueError(f"invalidation {self.kind}: value must not be empty")
        if self.kind == "fingerprint" and not re.fullmatch(rf"[0-9a-f]{{{MIN_FP_PREFIX},32}}", self.value):
            raise ValueError(f"fingerprint: expected {MIN_FP_PREFIX}-32 lower-case hex chars, got {self.value!r}")

    def pack(self) -> bytes:
        return msgpack.packb({"kind": self.kind, "value": self.value, "issued_at": self.issued_at},
                             use_bin_type=True)

    @classmethod
    def unpack(cls, id_: str, data: bytes) -> Invalidation:
        try:
            raw = msgpack.unpackb(data, raw=False)
            return cls(id_, str(raw["kind"]), str(raw["value"]), float(raw.get("issued_at", 0.0)))
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
            raise IndexError_(f"malformed invalidation {id_!r}: {exc}") from exc

    def matches(self, fp: FingerprintDigest, fingerprint: Fingerprint | None, node_id: str) -> bool:
        """Whether a chunk of ``fp`` (described by ``fingerprint`` when known) held by ``node_id`` goes."""
        if self.kind == "node":
            return self.value == node_id
        if self.kind == "fingerprint":
            return fp.hex().startswith(self.value)
        return fingerprint is not None and fingerprint.tenant_salt == self.value


async def issue(client: EtcdClient, schema: Schema, kind: str, value: str, *, ttl_s: int = ISSUE_TTL_S,
                clock: Callable[[], float] = time.time) -> tuple[Invalidation, int]:
    """Write one invalidation under a lease of its own; ``(invalidation, revision of the write)``."""
    inv = Invalidation(uuid.uuid4().hex[:16], kind, value.lower() if kind == "fingerprint" else value, clock())
    lease_id, _ = await client.grant(ttl_s)
    revision = await client.put(schema.invalidations + inv.id.encode(), inv.pack(), lease=lease_id)
    return inv, revision


class MeshInvalidation:
    """One agent's side: follows ``invalidate/`` and sweeps expired chunks, on the agent's loop.

    ``fingerprints`` are those this agent serves (digest -> fingerprint): a tenant is matched
    through them; a chunk of an unknown fingerprint (an old disk file) matches by digest only.
    """

    def __init__(self, config: AgentConfig, store: TieredStore, fingerprints: Mapping[FingerprintDigest, Fingerprint],
                 registry: CollectorRegistry, *, wall_clock: Callable[[], float] = time.time) -> None:
        self._schema = Schema(config.cluster)
        self._timeout = config.etcd.timeout_s
        self._ttl_s = config.tiers.chunk_ttl_s
        self._store = store
        self._fingerprints = dict(fingerprints)
        self._node_id = NodeId(config.node_id)
        self._wall = wall_clock
        self.removed = Counter("invalidated_chunks", "Chunks dropped by invalidation or TTL, by reason",
                               ["reason"], namespace="lmcache_p2p", registry=registry)
        self._seen: set[str] = set()
        self._born: dict[ChunkKey, float] = {}  # wall time of the oldest copy seen, for the TTL
        self._rev = 0
        self._need_read = True
        self._client: EtcdClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: LoopThread | None = None

    # -- lifecycle (any thread but the loop's) ---------------------------------------------------
    def start(self, loop: LoopThread, index: object) -> None:
        """Apply the invalidations already issued, then follow new ones (when ``index`` is in etcd)."""
        from .index.etcd_index import EtcdBlockIndex

        self._loop = loop
        self._client = index.client if isinstance(index, EtcdBlockIndex) else None
        loop.run(self._start(), self._timeout * 5)

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            with contextlib.suppress(LMCacheP2PError, RuntimeError):
                loop.run(self._stop(), self._timeout)

    async def _start(self) -> None:
        if self._client is not None:
            self._need_read = True
            try:
                await self._read_existing()
            except IndexError_ as exc:
                log.warning("invalidation: reading issued invalidations failed (will retry): %s", exc)
            self._tasks.append(asyncio.create_task(self._follow(), name="invalidation-watch"))
        if self._ttl_s is not None:
            self._tasks.append(asyncio.create_task(self._sweep_forever(), name="chunk-ttl-sweeper"))

    async def _stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- invalidations ---------------------------------------------------------------------------
    def apply(self, inv: Invalidation) -> int:
        """Drop every held chunk ``inv`` matches (blocking: deletes files); returns how many."""
        dropped = 0
        for key in list(self._store.inventory()):
            header = self._store.header(key)
            if header is None:
                continue
            if inv.matches(header.fingerprint, self._fingerprints.get(header.fingerprint), self._node_id):
                dropped += self._store.remove(key)
        self.removed.labels(inv.kind).inc(dropped)
        log.info("invalidation %s (%s %s): dropped %d chunks", inv.id, inv.kind, inv.value, dropped)
        return dropped

    async def _apply_new(self, id_: str, data: bytes) -> None:
        if id_ in self._seen:
            return
        self._seen.add(id_)
        try:
            inv = Invalidation.unpack(id_, data)
        except IndexError_ as exc:
            log.warning("invalidation: skipping %s", exc)
            return
        await asyncio.to_thread(self.apply, inv)

    async def _read_existing(self) -> None:
        assert self._client is not None
        prefix = self._schema.invalidations
        kvs, self._rev = await self._client.get_prefix(prefix)
        for kv in kvs:
            await self._apply_new(kv.key[len(prefix):].decode(), kv.value)
        self._need_read = False

    async def _follow(self) -> None:
        backoff = 0.05
        while True:
            try:
                if self._need_read:
                    await self._read_existing()
                await self._watch()
                backoff = 0.05
            except (IndexError_, grpc.aio.AioRpcError, OSError) as exc:
                log.info("invalidation watch interrupted (%s); resuming at rev %d", exc, self._rev)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _watch(self) -> None:
        assert self._client is not None
        prefix = self._schema.invalidations
        call = WatchStub(self._client.channel).Watch(metadata=self._client.metadata(require_leader=True))
        try:
            await call.write(WatchRequest(create_request=WatchCreateRequest(
                key=prefix, range_end=prefix_range_end(prefix), start_revision=self._rev + 1)))
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise OSError("watch stream closed by the server")
                if resp.compact_revision > 0 or resp.canceled:
                    self._need_read = True  # history gone: read what is issued now
                    return
                for ev in resp.events:
                    self._rev = ev.kv.mod_revision
                    if ev.type == _PUT:
                        await self._apply_new(ev.kv.key[len(prefix):].decode(), ev.kv.value)
        finally:
            call.cancel()

    # -- per-chunk TTL -----------------------------------------------------------------------------
    async def _sweep_forever(self) -> None:
        assert self._ttl_s is not None
        interval = min(self._ttl_s / 4, MAX_SWEEP_INTERVAL_S)
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(self.sweep)
            except (LMCacheP2PError, OSError) as exc:
                log.warning("chunk TTL sweep failed: %s", exc)

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
        with cpu._lock:  # noqa: SLF001 - stored_at is the pool's own record of when a chunk arrived
            cpu_now = cpu._clock()  # noqa: SLF001
            cpu_born = {k: now - (cpu_now - e.stored_at) for k, e in cpu._entries.items()}  # noqa: SLF001
        old = self._born
        born: dict[ChunkKey, float] = {}
        for key, t in cpu_born.items():
            born[key] = min(t, old.get(key, t))
        if disk is None:
            return born
        for key in disk.keys():
            seen = old.get(key)
            if seen is None:
                try:
                    seen = os.stat(disk._file(key)).st_mtime  # noqa: SLF001 - the file's mtime is its stored time
                except OSError:
                    continue  # removed meanwhile
            born[key] = min(seen, born.get(key, seen))
        return born
