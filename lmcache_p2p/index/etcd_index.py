"""The etcd :class:`~lmcache_p2p.index.protocol.BlockIndex`: a sync facade over one node's
session, publisher and per-fingerprint mirrors, all running on the agent's loop thread.

etcd is a hint, not a dependency: ``open`` never fails because etcd is down. It waits up to
``etcd.start_wait_s`` for a lease and the first sync, then returns either way; until etcd
answers the node runs *degraded* (local hits only, an empty or last-known mirror, writes queued
in the publisher's desired state). A supervised registrar task takes a lease as soon as etcd
answers and, whenever the lease is lost (partition longer than the TTL, etcd restored from
backup, expired during an outage), takes a new one, hands it to the publisher (which
republishes the node record and every entry it holds) and calls ``on_new_lease``.
``close()`` revokes the lease: the node's entries vanish from every mirror at once.

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
from ..backoff import jittered
from ..config import AgentConfig
from ..errors import IndexError_
from ..ids import NodeId
from ..keys import ChunkKey, FingerprintDigest
from .client import EtcdClient
from .lookup import LookupMirror
from .mirror import Mirror
from .publisher import Publisher
from .schema import NodeRecord, Rejects, Schema
from .session import Session

log = logging.getLogger(__name__)

_EMPTY: frozenset[NodeId] = frozenset()


def make_mirror(loop: LoopThread, config: AgentConfig, client: EtcdClient, schema: Schema, fp: FingerprintDigest,
                rejects: Rejects) -> Mirror:
    """The reader of ``fp``'s block entries ``etcd.index`` asks for: a watch-fed mirror, or lookups."""
    if config.etcd.index == "lookup":
        return LookupMirror(client, schema, fp, loop, cache_s=config.etcd.lookup_cache_s,
                            timeout_s=config.etcd.lookup_timeout_s, rejects=rejects)
    return Mirror(client, schema, fp, rejects=rejects)


class EtcdBlockIndex:
    def __init__(self, loop: LoopThread, config: AgentConfig, record: NodeRecord,
                 on_new_lease: Callable[[Session], None] | None = None, rejects: Rejects | None = None) -> None:
        if record.node_id != config.node_id:
            raise ValueError(f"record.node_id {record.node_id!r} != config.node_id {config.node_id!r}")
        self._loop = loop
        self._config = config
        self._record = record
        self._on_new_lease = on_new_lease
        self.schema = Schema(config.cluster)
        self.client = EtcdClient(config.etcd)
        self.rejects = rejects if rejects is not None else Rejects()
        self._mirrors: dict[FingerprintDigest, Mirror] = {}
        self._session: Session | None = None
        self._publisher: Publisher | None = None
        self._registrar: asyncio.Task[None] | None = None
        self._closing = False
        self.leases_taken = 0
        self.lease_losses = 0
        self._old_sessions = {"keepalive_failed": 0, "keepalive_restarted": 0}  # of sessions replaced

    @classmethod
    def open(cls, loop: LoopThread, config: AgentConfig, record: NodeRecord,
             fingerprints: Sequence[FingerprintDigest] = (),
             on_new_lease: Callable[[Session], None] | None = None, rejects: Rejects | None = None) -> EtcdBlockIndex:
        """Start registering the node and mirroring each fingerprint; returns within about
        ``etcd.start_wait_s`` whether or not etcd answered (see :attr:`online`)."""
        index = cls(loop, config, record, on_new_lease, rejects)
        wait = config.etcd.start_wait_s
        try:
            loop.run(index._open(fingerprints, wait), wait * 2 + config.etcd.timeout_s + 5.0)
        except Exception:
            index.close()
            raise
        if not index.online:
            log.warning("index: etcd %s not reachable within %.1fs; running degraded (local hits only) until "
                        "it answers", ",".join(config.etcd.endpoints), wait)
        return index

    async def _open(self, fingerprints: Sequence[FingerprintDigest], wait_s: float) -> None:
        await self.client.connect(lazy=True)
        self._publisher = Publisher(self.client, self.schema, self._record, None)
        self._publisher.start()
        self._registrar = asyncio.create_task(self._register_forever(), name="index-registrar")
        deadline = asyncio.get_running_loop().time() + wait_s
        for fp in fingerprints:
            await self._follow(fp, max(deadline - asyncio.get_running_loop().time(), 0.0))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(deadline - asyncio.get_running_loop().time(), 0.0)):
                await self._publisher.flush(wait_s)  # the node record is visible on return when etcd is up

    def follow(self, fp: FingerprintDigest) -> Mirror:
        """Keep a mirror of ``fp``'s block entries (idempotent); waits up to ``etcd.start_wait_s``
        for its first sync."""
        wait = self._config.etcd.start_wait_s
        return self._loop.run(self._follow(fp, wait), wait + self._config.etcd.timeout_s + 5.0)

    async def _follow(self, fp: FingerprintDigest, wait_s: float) -> Mirror:
        mirror = self._mirrors.get(fp)
        if mirror is None:
            mirror = self._mirrors[fp] = make_mirror(self._loop, self._config, self.client, self.schema, fp,
                                                     self.rejects)
            await mirror.start(wait_s)
        return mirror

    @property
    def online(self) -> bool:
        """Registered under a live lease and every mirror synced: the node is part of the mesh."""
        session = self._session
        return session is not None and session.up and all(m.synced for m in self._mirrors.values())

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
            raise IndexError_("no etcd session yet (etcd has not answered)")
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
        if mirror is None:
            return [_EMPTY] * len(keys)
        mirror.prefetch(keys)
        return mirror.lookup(keys)

    def longest_prefix(self, fp: FingerprintDigest, keys: Sequence[ChunkKey]) -> int:
        mirror = self._mirrors.get(fp)
        if mirror is None:
            return 0
        mirror.prefetch(keys)
        return mirror.longest_prefix(keys)

    def nodes(self) -> dict[NodeId, NodeRecord]:
        for mirror in self._mirrors.values():
            return mirror.nodes()
        return {}

    def owners(self, fp: FingerprintDigest, keys: Sequence[ChunkKey], *, ask: bool = True) -> list[dict[NodeId, int]]:
        """Per key, the nodes holding it with their tier byte (lower is faster); ``ask`` False: no etcd
        read even in lookup mode (a caller under tier locks)."""
        mirror = self._mirrors.get(fp)
        if mirror is None:
            return [{} for _ in keys]
        if ask:
            mirror.prefetch(keys)
        return [mirror.owners(k) for k in keys]

    def stats(self) -> dict[str, float]:
        """Gauges for the agent's metrics: mirror size, publish backlog and lag, lease state."""
        publisher, session = self._publisher, self._session
        return {
            "index_chunks": float(sum(len(m) for m in self._mirrors.values())),
            "publish_pending": float(publisher.pending) if publisher is not None else 0.0,
            "publish_lag_s": float(publisher.lag_s) if publisher is not None else 0.0,
            "lease_up": 1.0 if session is not None and session.up else 0.0,
            "lease_ttl_left_s": session.ttl_left_s if session is not None else 0.0,
            "degraded": 0.0 if self.online else 1.0,
            "lease_losses": float(self.lease_losses),
        }

    def faults(self) -> dict[str, int]:
        """Control-plane faults met so far, by kind (running totals: the agent exports them as
        ``lmcache_p2p_etcd_faults_total{kind}``): watch streams interrupted and resumed, watches resynced
        from a range read (history compacted, etcd restored), watch callbacks that failed, lease
        keep-alive streams that failed and were restarted by the watchdog, publisher transactions
        that failed and were retried."""
        out = dict(self._old_sessions)
        session = self._session
        if session is not None:
            out["keepalive_failed"] += session.stream_failures
            out["keepalive_restarted"] += session.watchdog_restarts
        for mirror in self._mirrors.values():
            for kind, n in mirror.faults().items():
                out[kind] = out.get(kind, 0) + n
        out["publish_failed"] = self._publisher.errors_total if self._publisher is not None else 0
        return out

    def flush(self, timeout: float) -> None:
        """Wait until every queued change is in etcd."""
        self._loop.run(self.publisher.flush(timeout), timeout + 1.0)

    def close(self) -> None:
        """Revoke the lease (entries vanish at once), stop mirrors, close the connection."""
        self._closing = True
        with contextlib.suppress(Exception):
            self._loop.run(self._close(), self._config.etcd.timeout_s * 2)

    async def _close(self) -> None:
        await cancel_and_wait(self._registrar)
        for mirror in self._mirrors.values():
            await mirror.stop()
        if self._publisher is not None:
            await self._publisher.stop()
        if self._session is not None:
            await self._session.close()
        await self.client.close()

    async def _register_forever(self) -> None:
        """Hold a lease whenever etcd answers; after a loss, take a new one and republish."""
        backoff = 0.1
        while not self._closing:
            try:
                session = await Session.create(self.client, self._config.etcd.lease_ttl_s)
            except Exception as exc:  # IndexError_ while etcd is down; anything else is logged too
                log.log(logging.INFO if isinstance(exc, IndexError_) else logging.ERROR,
                        "index: taking a lease failed (retrying in %.1fs): %s", backoff, exc)
                await asyncio.sleep(jittered(backoff))
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.1
            renewed = self._session is not None
            if self._session is not None:
                self._old_sessions["keepalive_failed"] += self._session.stream_failures
                self._old_sessions["keepalive_restarted"] += self._session.watchdog_restarts
            self._session = session
            self.leases_taken += 1
            self.publisher.set_session(session)
            if renewed:
                log.info("index: re-registered under lease %x; republishing %d entries", session.lease_id,
                         self.publisher.held())
                if self._on_new_lease is not None:
                    try:
                        self._on_new_lease(session)
                    except Exception:
                        log.exception("index: on_new_lease callback failed")
            await session.done()
            if self._closing or not session.lost:
                return
            self.lease_losses += 1
