"""The etcd :class:`~lmcache_p2p.index.protocol.BlockIndex`: a sync facade over one node's
session, publisher and per-fingerprint mirrors, all running on the agent's loop thread.

If the lease is lost (partition longer than the TTL, etcd restored from backup), a guard task
opens a new session, hands it to the publisher (which republishes the node record and every
entry it holds) and calls ``on_new_lease``. ``close()`` revokes the lease: the node's entries
vanish from every mirror at once.

Construct from an :class:`~lmcache_p2p.config.AgentConfig`::

    loop = LoopThread()
    index = EtcdBlockIndex.open(loop, config, record, [fingerprint.digest])
    index.add_many(fp, keys, TIER_CPU)          # engine thread, returns at once
    n = index.longest_prefix(fp, keys)          # scheduler thread, dict probes
    index.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence

from ..aio import LoopThread, cancel_and_wait
from ..config import AgentConfig
from ..errors import IndexError_
from ..keys import ChunkKey, FingerprintDigest
from .client import EtcdClient
from .mirror import Mirror
from .publisher import Publisher
from .schema import NodeId, NodeRecord, Schema
from .session import Session

log = logging.getLogger(__name__)

_EMPTY: frozenset[NodeId] = frozenset()


class EtcdBlockIndex:
    def __init__(self, loop: LoopThread, config: AgentConfig, record: NodeRecord,
                 on_new_lease: Callable[[Session], None] | None = None) -> None:
        if record.node_id != config.node_id:
            raise ValueError(f"record.node_id {record.node_id!r} != config.node_id {config.node_id!r}")
        self._loop = loop
        self._config = config
        self._record = record
        self._on_new_lease = on_new_lease
        self.schema = Schema(config.cluster)
        self.client = EtcdClient(config.etcd)
        self._mirrors: dict[FingerprintDigest, Mirror] = {}
        self._session: Session | None = None
        self._publisher: Publisher | None = None
        self._guard: asyncio.Task[None] | None = None
        self._closing = False

    @classmethod
    def open(cls, loop: LoopThread, config: AgentConfig, record: NodeRecord,
             fingerprints: Sequence[FingerprintDigest] = (),
             on_new_lease: Callable[[Session], None] | None = None) -> EtcdBlockIndex:
        """Connect, take a lease, register the node and sync a mirror per fingerprint."""
        index = cls(loop, config, record, on_new_lease)
        timeout = config.etcd.timeout_s * 4
        try:
            loop.run(index._open(), timeout)
            for fp in fingerprints:
                index.follow(fp)
        except Exception:
            index.close()
            raise
        return index

    async def _open(self) -> None:
        await self.client.connect()
        self._session = await Session.create(self.client, self._config.etcd.lease_ttl_s)
        self._publisher = Publisher(self.client, self.schema, self._record, self._session)
        self._publisher.start()
        await self._publisher.flush(self._config.etcd.timeout_s)  # the node record is visible on return
        self._guard = asyncio.create_task(self._renew_on_loss(), name="index-lease-guard")

    def follow(self, fp: FingerprintDigest) -> Mirror:
        """Keep a mirror of ``fp``'s block entries (idempotent); returns after the first sync."""
        if fp not in self._mirrors:
            mirror = Mirror(self.client, self.schema, fp)
            self._loop.run(mirror.start(self._config.etcd.timeout_s * 4), self._config.etcd.timeout_s * 5)
            self._mirrors[fp] = mirror
        return self._mirrors[fp]

    @property
    def node_id(self) -> NodeId:
        return self._record.node_id

    @property
    def publisher(self) -> Publisher:
        if self._publisher is None:
            raise IndexError_("index is not open")
        return self._publisher

    @property
    def session(self) -> Session:
        if self._session is None:
            raise IndexError_("index is not open")
        return self._session

    def mirror(self, fp: FingerprintDigest) -> Mirror:
        return self._mirrors[fp]

    # ---- BlockIndex --------------------------------------------------------------------------
    def add(self, fp: FingerprintDigest, key: ChunkKey, tier: int) -> None:
        self.publisher.add_many(fp, (key,), tier)

    def add_many(self, fp: FingerprintDigest, keys: Iterable[ChunkKey], tier: int) -> None:
        self.publisher.add_many(fp, keys, tier)

    def remove(self, fp: FingerprintDigest, key: ChunkKey) -> None:
        self.publisher.remove_many(fp, (key,))

    def remove_many(self, fp: FingerprintDigest, keys: Iterable[ChunkKey]) -> None:
        self.publisher.remove_many(fp, keys)

    def set_record(self, record: NodeRecord) -> None:
        if record.node_id != self._record.node_id:
            raise ValueError(f"record is for {record.node_id!r}, this index is {self._record.node_id!r}")
        self._record = record
        self.publisher.set_record(record)

    def lookup(self, fp: FingerprintDigest, keys: Sequence[ChunkKey]) -> list[frozenset[NodeId]]:
        mirror = self._mirrors.get(fp)
        return mirror.lookup(keys) if mirror is not None else [_EMPTY] * len(keys)

    def longest_prefix(self, fp: FingerprintDigest, keys: Sequence[ChunkKey]) -> int:
        mirror = self._mirrors.get(fp)
        return mirror.longest_prefix(keys) if mirror is not None else 0

    def nodes(self) -> dict[NodeId, NodeRecord]:
        for mirror in self._mirrors.values():
            return mirror.nodes()
        return {}

    def owners(self, fp: FingerprintDigest, keys: Sequence[ChunkKey]) -> list[dict[NodeId, int]]:
        """Per key, the nodes holding it with their tier byte (lower is faster)."""
        mirror = self._mirrors.get(fp)
        return [mirror.owners(k) for k in keys] if mirror is not None else [{} for _ in keys]

    def stats(self) -> dict[str, float]:
        """Gauges for the agent's metrics: mirror size, publish backlog and lag, lease state."""
        publisher, session = self._publisher, self._session
        return {
            "index_chunks": float(sum(len(m) for m in self._mirrors.values())),
            "publish_pending": float(publisher.pending) if publisher is not None else 0.0,
            "publish_lag_s": float(publisher.lag_s) if publisher is not None else 0.0,
            "lease_up": 1.0 if session is not None and not session.is_done() else 0.0,
            "lease_ttl_left_s": session.ttl_left_s if session is not None else 0.0,
        }

    def flush(self, timeout: float) -> None:
        """Wait until every queued change is in etcd."""
        self._loop.run(self.publisher.flush(timeout), timeout + 1.0)

    def close(self) -> None:
        """Revoke the lease (entries vanish at once), stop mirrors, close the connection."""
        self._closing = True
        with contextlib.suppress(Exception):
            self._loop.run(self._close(), self._config.etcd.timeout_s * 2)

    async def _close(self) -> None:
        await cancel_and_wait(self._guard)
        for mirror in self._mirrors.values():
            await mirror.stop()
        if self._publisher is not None:
            await self._publisher.stop()
        if self._session is not None:
            await self._session.close()
        await self.client.close()

    async def _renew_on_loss(self) -> None:
        while True:
            await self.session.done()
            if self._closing or not self.session.lost:
                return
            backoff = 0.1
            while True:
                try:
                    self._session = await Session.create(self.client, self._config.etcd.lease_ttl_s)
                    break
                except IndexError_ as exc:
                    log.warning("index: new lease failed, retrying: %s", exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
            self.publisher.republish_all(self._session)
            log.info("index: re-registered under lease %x", self._session.lease_id)
            if self._on_new_lease is not None:
                self._on_new_lease(self._session)
