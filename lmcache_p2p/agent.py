"""The cache agent: tiers + mesh index + transports, behind a small synchronous API.

    lookup(token_ids) -> HitPlan          dict probes only: local store, then the index mirror
    load_pinned(plan, deadline) -> [Pin | None]   budget, pull, pin verified CPU slots (load.py; the
                                          engine's path)
    load(plan, dsts)  -> [loaded?]        the same, then a verified copy into each destination
    store(token_ids, chunks) -> Future    returns at once; checksum, copy and publish run behind
    reserve_chunk / commit_chunk          fill a CPU slot in place (a gather), publish it behind

The agent composes the parts; each concern lives in its own module:

    tiers/            where chunks are held (CPU pool, disk), eviction, admission
    index/            the mesh index: lease, publisher, watch-fed mirror (``BlockIndex``)
    plan.py           which chunks to load from where (and whether pulling beats recomputing)
    load.py           plan -> budget -> pull -> pinned verified slots, with one absolute deadline
    transfer/pull.py  plan -> pull -> retry -> verify -> metrics (``Puller``), over transfer/'s transports
    handoff.py        hand-off of sole copies and replication
    objects/          the object tier: uploads behind eviction, loads planned like a slow peer
    invalidation.py   mesh-wide invalidation barriers and the chunk TTL
    coordinator/      the cluster config in etcd, and which of its fields apply live (apply.py)
    score.py          ``/v1/score`` next to ``/metrics``

Every side effect is injected: the config, the Prometheus registry, the index (an
``index_factory`` building a :class:`BlockIndex` once the node record is known) and the
transports. The network side runs on one asyncio loop in a background thread (:class:`LoopThread`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CollectorRegistry

from . import __version__, cputime
from .aio import LoopThread, every
from .chunk import ChunkHeader, make_header
from .config import AdvertisedHosts, AgentConfig, advertised_hosts, cluster_secret, is_wildcard
from .coordinator import apply as cluster_config_apply
from .coordinator.apply import set_log_level
from .coordinator.cluster_config import ClusterConfig
from .coordinator.store import ConfigWatcher
from .errors import LMCacheP2PError, TierError
from .estimates import PeerEstimates, PrefillRate
from .handoff import Handoff
from .ids import OBJECTS, TIER_CODES, WIRE_VERSION, NodeId, origin_of
from .index.protocol import BlockIndex
from .index.quarantine import Quarantine, QuarantineRecord
from .index.schema import NodeRecord, Rejects, Schema, Served, tenant_digest
from .invalidation import MeshInvalidation
from .keys import ChunkKey, Fingerprint, HeadRange
from .load import Loader, keys_of, local_plan
from .metrics import PER_PEER_SERIES, AgentMetrics, MetricsServer
from .plan import FetchBudget, HitPlan, PlannedChunk
from .router.proof import engine_proof, router_key, signed_engine_proof
from .score import Scorer, http_app
from .tiers import Pin, Reservation, TieredStore
from .transfer.pull import Puller
from .transfer.stack import ServerHooks, Transfers, TransfersFactory, TransferStack

if TYPE_CHECKING:
    from .objects.tier import ObjectTier

log = logging.getLogger(__name__)
IndexFactory = Callable[[LoopThread, NodeRecord], BlockIndex]
RECENT_DROPS = 4096  # chunks remembered as dropped, for ``lookup --explain``


class CacheAgent:
    @classmethod
    def of(cls, config: AgentConfig, **parts: Any) -> CacheAgent:
        """An agent of ``config``'s own layout (outside vLLM: ``lmcache-p2p agent``, tools, tests): its
        fingerprint and chunk size from ``config.layout``; ``parts`` as the constructor takes them."""
        return cls(config, Fingerprint.of(config.layout), config.layout.chunk_bytes(config.chunk_size), **parts)

    def __init__(
        self,
        config: AgentConfig,
        fingerprint: Fingerprint,
        chunk_bytes: int,
        *,
        index_factory: IndexFactory | None = None,
        metrics: AgentMetrics | None = None,
        secret: bytes | None = None,
        heads: HeadRange | None = None,
        role: str = "engine",
        transfers: TransfersFactory = TransferStack.build,
    ) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.fp = fingerprint.digest
        # The KV heads of every chunk this agent stores and loads (a TP rank's; default all of them)
        self.heads: HeadRange = heads if heads is not None else (0, fingerprint.num_kv_heads)
        self.role = role  # "engine" (inside vLLM) or "cache" (a cache-only agent: hand-offs go there first)
        self.node_id = NodeId(config.node_id)
        self.origin = origin_of(self.node_id)  # in the header of every chunk this node computes (its engine's)
        self.chunk_bytes = chunk_bytes
        self._index_factory = index_factory
        self._transfers_factory = transfers
        self._secret = secret
        self._proof: tuple[tuple[str, str, str | None], str | None] | None = None  # (what it proves, the proof)
        self.metrics = metrics if metrics is not None else AgentMetrics(CollectorRegistry())
        self.metrics.on_collect(lambda: self.metrics.mirror(
            self.tiers, self.index, self._stack.chunks_sent() if self._stack is not None else None))
        self.metrics.on_collect(self._planner_gauges)
        self.rejects = Rejects()  # malformed etcd contents skipped by every reader of this agent
        self.peer_estimates = PeerEstimates()  # pull latency and bandwidth per peer, measured here
        self.prefill = PrefillRate()  # this engine's prefill rate (the worker connector feeds it)
        # The object tier, when ``objects.url`` is set: uploads of what this node evicts, reads as a transport.
        self.objects: ObjectTier | None = self._object_tier() if config.objects.url is not None else None
        # The hooks are this agent's methods, over parts made just below (each needs the tiers).
        self.tiers = TieredStore.from_config(
            config.tiers, chunk_bytes, admit=self._admit, stamp=self._stamp, listener=self._on_tier_change,
            evict_first=self._held_elsewhere if config.handoff.evict_copies_first else None,
            spill=self.objects.offer if self.objects is not None else None)
        self.invalidation = MeshInvalidation(
            config, self.tiers, {self.fp: fingerprint}, self.metrics.registry, rejects=self.rejects,
            listeners=[self.objects.cleanup_soon] if self.objects is not None else [])
        self.metrics.watch_rejects(self.rejects)
        self.loop: LoopThread | None = None
        self.index: BlockIndex | None = None
        self._stack: Transfers | None = None
        self._metrics_server: MetricsServer | None = None
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-p2p-store",
                                                             initializer=cputime.initializer("store"))
        self.puller: Puller | None = None  # once the transports are up
        self._prune: concurrent.futures.Future[None] | None = None
        self._handoff_task: concurrent.futures.Future[None] | None = None
        self._tasks: set[asyncio.Task[object]] = set()  # background tasks on the loop, kept referenced
        self.handoff = Handoff(settings=lambda: self.config, fp=self.fp, num_kv_heads=fingerprint.num_kv_heads,
                               node_id=self.node_id, heads=self.heads, chunk_bytes=chunk_bytes, tiers=self.tiers,
                               metrics=self.metrics)
        self._dropped: OrderedDict[ChunkKey, float] = OrderedDict()  # recently evicted or removed, newest last
        self._dropped_lock = threading.Lock()
        self._config_watch: ConfigWatcher | None = None
        self.quarantine: Quarantine | None = None  # owners the canary found wrong: never planned
        self.config_revision = 0  # of the cluster config applied
        self._pending_restart: list[str] = []  # fields of it that wait for a restart (logged when this changes)
        self.config_deviations: dict[str, str] = {}  # field -> "restart" | "node": where the node differs from it
        self.loader: Loader | None = None  # the load path (load.py), once the parts it uses are up
        self.scorer: Scorer | None = None  # what /v1/score reads (score.py), once the index is up
        self._expected_shown: set[str] = set()  # peers with a pull_expected_seconds series now
        self._started = False

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> CacheAgent:
        from .index.etcd_index import EtcdBlockIndex

        if self.config.log_level is not None:
            set_log_level(self.config.log_level)
        self.loop = LoopThread(f"lmcache-p2p-{self.node_id}")
        try:
            hooks = ServerHooks(prepare=self.tiers.ensure_in_cpu, on_offer=self.handoff.accept,
                                on_served=self.handoff.on_served, on_recent=self.dropped_ago)
            self._stack = self._transfers_factory(self.config, self.tiers.cpu, [self.fp], self._secret, hooks)
            self.loop.run(self._stack.start(), self.config.transfer.timeout_s)
            objects, sources = self.objects, None
            if objects is not None:  # the object store: one more owner, behind a transport of its own
                from .objects.transport import ObjectTransport

                sources = {OBJECTS: (ObjectTransport(objects), objects.address)}
            self.puller = Puller(self.node_id, self.fp, self.tiers.cpu, self._stack.transports,
                                 list(self._stack.transports), self._stack.health, self._nodes, self.metrics,
                                 self.peer_estimates, self.loop, tls=self.config.transfer.tls,
                                 pin_timeout_s=self.config.tiers.pin_timeout_s,
                                 on_loaded=lambda key: self._on_tier_change(key, "cpu"),
                                 sources=sources)
            if self.config.metrics_port is not None:
                self._metrics_server = MetricsServer(
                    self.metrics.registry, self.config.metrics_host, self.config.metrics_port,
                    wrap=lambda metrics_app: http_app(metrics_app, lambda: self.scorer, self.config.score_api_key))
            record = self.node_record()
            if self._index_factory is not None:
                self.index = self._index_factory(self.loop, record)
            else:  # returns within etcd.start_wait_s even when etcd is down (degraded until it answers)
                self.index = EtcdBlockIndex.open(self.loop, self.config, record, [self.fp], rejects=self.rejects,
                                                 on_new_lease=lambda _session: self.invalidation.recheck())
            # Standing invalidations first, so nothing they cover is recovered or published.
            client = self.index.client if isinstance(self.index, EtcdBlockIndex) else None
            self.invalidation.start(self.loop, client)
            if client is not None:  # the cluster config in etcd: live fields apply as they change
                self._config_watch = ConfigWatcher(client, self.config.cluster, self._on_cluster_config,
                                                   rejects=self.rejects)
                self.loop.run(self._config_watch.start(0.0), self.config.etcd.timeout_s)
                self.quarantine = Quarantine(client, self.index_schema, rejects=self.rejects,
                                             on_quarantined=self._on_quarantined)
                self.loop.run(self.quarantine.start(self.config.etcd.start_wait_s),
                              self.config.etcd.start_wait_s + self.config.etcd.timeout_s)
            if self.objects is not None:
                self._start_objects(self.objects, client)
            self.loader = Loader(tiers=self.tiers, fp=self.fp, num_kv_heads=self.fingerprint.num_kv_heads,
                                 heads=self.heads, node_id=self.node_id, chunk_size=self.config.chunk_size,
                                 chunk_bytes=self.chunk_bytes, transfer=self.config.transfer,
                                 tiers_config=self.config.tiers, index=self.index, puller=self.puller,
                                 quarantine=self.quarantine, objects=self.objects,
                                 peer_estimates=self.peer_estimates, prefill=self.prefill, metrics=self.metrics,
                                 on_hit=self.handoff.on_hit, model_id=self.fingerprint.model_id,
                                 dropped=lambda key: self.dropped_ago([key])[0] is not None)
            recovered = self._drop_quarantined(self.invalidation.vet_recovered(self.tiers.recover()))
            mine = [h.key for h in recovered if self._mine(h)]  # others stay on disk, unannounced
            if mine:
                self.index.add_many(self.fp, mine, TIER_CODES["disk"])
            self._prune = self.loop.submit(self._prune_peers_forever())
            self.scorer = Scorer(settings=lambda: self.config, fingerprint=self.fingerprint, node_id=self.node_id,
                                 chunk_bytes=self.chunk_bytes, index=self.index, peer_estimates=self.peer_estimates,
                                 prefill=self.prefill, holds=self.holds, usable=self.loader.usable,
                                 record=self.node_record)
            self.handoff.start(index=self.index, puller=self.puller, transfers=self._stack, usable=self.loader.usable,
                               record=self.node_record)
            self._handoff_task = self.loop.submit(self.handoff.run_forever())
            self.metrics.info.info({"node_id": self.node_id, "version": __version__,
                                    "wire_version": str(WIRE_VERSION), "fingerprint": self.fingerprint.short})
        except BaseException:
            self.stop()
            raise
        self._started = True
        log.info("agent %s started: %d chunks recovered from disk (%d of this fingerprint), serving %s%s",
                 self.node_id, len(recovered), len(mine), self.node_record().addresses,
                 "" if getattr(self.index, "online", True) else " (degraded: etcd not reachable yet)")
        return self

    def _object_tier(self) -> ObjectTier:
        """The object tier (``objects/``), given what it uses of this node; started by :meth:`start`."""
        from .objects.store import ObjectStore
        from .objects.tier import ObjectTier

        spill_dir = None
        if self.config.tiers.disk_path:  # a disk victim's file is moved aside until its upload is confirmed
            spill_dir = Path(self.config.tiers.disk_path) / ".objects-spill"
            spill_dir.mkdir(parents=True, exist_ok=True)
        secret = self._secret if self._secret is not None else cluster_secret(self.config)
        return ObjectTier(self.config, ObjectStore(self.config.objects), fp=self.fp, node_id=self.node_id,
                          metrics=self.metrics, keep=self.wants_upload, covers=self._covers_object,
                          ttl_s=lambda: self.config.tiers.chunk_ttl_s, secret=secret, spill_dir=spill_dir,
                          rejects=self.rejects,
                          # the invalidation is built after the tier (it takes the tiers, which take the tier's offer)
                          covers_tenant=lambda header, tenant: self.invalidation.covers_tenant(header, tenant))

    def _start_objects(self, objects: ObjectTier, client: Any) -> None:
        """Loads at once; uploads of what this node evicts from here on; records and cleanup in etcd."""
        assert self.loop is not None

        async def start() -> None:
            objects.start(client)

        self.loop.run(start(), self.config.etcd.timeout_s)
        log.info("object tier: %s bucket %s prefix %s", objects.store.url, self.config.objects.bucket,
                 self.config.objects.prefix)

    # -- the object tier's hooks (objects/tier.py) ----------------------------------------------------------
    def wants_upload(self, header: ChunkHeader) -> bool:
        """A chunk leaving this node that is worth keeping in the object store: this agent's, with every
        head, hit ``objects.min_hits`` times, and no other node (nor the store) holds it. Dict probes
        only (called under tier locks)."""
        return (header.fingerprint == self.fp and header.heads == (0, self.fingerprint.num_kv_heads)
                and self.handoff.hits.get(header.key, 0) >= self.config.objects.min_hits
                and not self.handoff.others_hold(header.key))

    def _covers_object(self, header: ChunkHeader, holder: NodeId) -> bool:
        """An object ``holder`` uploaded must not be loaded (nor kept): a standing invalidation covers it, or
        a quarantined node computed it."""
        return self.invalidation.covers_held_by(header, holder) or self.computed_by_quarantined(header)

    def computed_by_quarantined(self, header: ChunkHeader) -> bool:
        """The chunk was computed by a quarantined node other than this one (wherever it is held: a pulled
        copy, an object). A quarantined node keeps its own: its engine reads them as it computes them, and
        no other planner takes them from it."""
        return (self.quarantine is not None and header.origin != self.origin
                and self.quarantine.blocks_origin(header.origin))

    def _on_quarantined(self, _origins: frozenset[bytes]) -> None:
        """(on the loop) A node was quarantined: drop the copies this node holds of chunks it computed."""
        self.background(asyncio.get_running_loop().create_task(
            asyncio.to_thread(lambda: self._drop_quarantined([h for h in map(self.tiers.header, self.tiers.inventory())
                                                              if h is not None]))))

    def _drop_quarantined(self, headers: list[ChunkHeader]) -> list[ChunkHeader]:
        """Remove (blocking) the chunks of ``headers`` a quarantined node computed; the others."""
        keep, dropped = [], 0
        for header in headers:
            if self.computed_by_quarantined(header):
                dropped += self.tiers.remove(header.key)
            else:
                keep.append(header)
        if dropped:
            self.invalidation.removed.labels("quarantine").inc(dropped)
            log.warning("dropped %d chunks computed by a quarantined node (copies this node held)", dropped)
        return keep

    def node_record(self) -> NodeRecord:
        stack = self._stack
        metrics_url = None
        if self._metrics_server is not None:  # the host its server binds (or ours, when it binds every one)
            host = self._hosts.metrics
            metrics_url = f"http://{f'[{host}]' if ':' in host else host}:{self._metrics_server.port}/metrics"
        transfer = stack.node_record() if stack is not None else {}
        host = str(transfer.get("host"))
        address = f"{self._advertise_host() if is_wildcard(host) else host}:{transfer.get('port')}"
        proof = self._engine_proof(metrics_url)  # routers use the engine this record announces only with it
        return NodeRecord(
            node_id=self.node_id,
            addresses={t: address for t in transfer.get("transports", ())},
            transports=tuple(transfer.get("transports", ())),
            served={self.fp.hex(): Served(
                model=self.fingerprint.model_id,
                tenant=tenant_digest(self.fingerprint.tenant_salt) if self.fingerprint.tenant_salt else "",
                heads=(*self.heads, self.fingerprint.num_kv_heads),
                layout=dataclasses.asdict(self.fingerprint))},  # a layout's salt is published as its digest
            capacities={"cpu": self.tiers.cpu.capacity_bytes,
                        **({"disk": self.tiers.disk.capacity_bytes} if self.tiers.disk is not None else {})},
            software_version=__version__,
            wire_version=WIRE_VERSION,
            metrics_url=metrics_url,
            tls=self.config.transfer.tls,
            role=self.role,
            free=self.handoff.free(),
            config_revision=self.config_revision,
            config_deviations=dict(self.config_deviations),
            engine_url=self.config.engine_url,
            engine_pool=self.config.engine_pool,
            engine_proof=proof,
        )

    def _engine_proof(self, metrics_url: str | None) -> str | None:
        """The proof of the engine this node announces (``router/proof.py``): signed with the node's transfer
        TLS key where it has one (a router given the transfer CA accepts no other), else keyed by the router
        key of the cluster secret. Made once per announced engine."""
        c = self.config
        if not c.engine_url:
            return None
        what = (c.engine_url, c.engine_pool, metrics_url)
        if self._proof is not None and self._proof[0] == what:
            return self._proof[1]
        proof: str | None = None
        if c.transfer.tls_cert is not None and c.transfer.tls_key is not None:
            proof = signed_engine_proof(Path(c.transfer.tls_cert).read_bytes(), Path(c.transfer.tls_key).read_bytes(),
                                        cluster=c.cluster, node_id=self.node_id, engine_url=c.engine_url,
                                        engine_pool=c.engine_pool, metrics_url=metrics_url)
        else:
            secret = self._secret if self._secret is not None else cluster_secret(c)
            if secret:
                proof = engine_proof(router_key(secret), cluster=c.cluster, node_id=self.node_id,
                                     engine_url=c.engine_url, engine_pool=c.engine_pool, metrics_url=metrics_url)
        self._proof = (what, proof)
        return proof

    def live_setters(self) -> dict[str, Callable[[AgentConfig], None] | None]:
        """What applies each live field of the cluster config (``coordinator/apply.py``'s table: a test holds
        the two to each other) while this node runs, given the new config; None: read at every use. A new
        live field: its row there, its setter here."""
        return {
            "tiers.chunk_ttl_s": lambda c: self.background(
                asyncio.get_running_loop().create_task(self.invalidation.set_ttl(c.tiers.chunk_ttl_s))),
            "tiers.eviction": lambda c: self.tiers.set_eviction(c.tiers.eviction),
            "transfer.backoff_s": self._set_backoff,
            "log_level": lambda c: set_log_level(c.log_level),
            "handoff.budget_bytes_per_s": None,
            "handoff.replicate_after": None,
        }

    def _set_backoff(self, config: AgentConfig) -> None:
        if self._stack is not None:
            self._stack.health.set_base(config.transfer.backoff_s)
        if self.objects is not None:
            self.objects.health.set_base(max(config.transfer.backoff_s, 0.1))

    def _on_cluster_config(self, cluster: ClusterConfig) -> None:
        """On the loop: the cluster config changed; apply its live fields (``coordinator/apply.py``)."""
        watch = self._config_watch
        assert watch is not None
        new, pending = cluster_config_apply.apply(self.config, cluster, watch.stored, live_only=True)
        if pending and pending != self._pending_restart:
            log.warning("cluster config (rev %d) changes %s: takes effect when this node restarts", watch.revision,
                        ", ".join(pending))
        self._pending_restart = pending
        old, self.config = self.config, new
        value = cluster_config_apply.field_value
        for dotted, setter in self.live_setters().items():
            if setter is not None and value(new, dotted) != value(old, dotted):
                setter(new)
        if new != old:
            log.info("cluster config rev %d applied", watch.revision)
        self.config_revision = watch.revision
        self.config_deviations = cluster_config_apply.deviations(new, cluster, watch.stored)
        if self.index is not None:
            self.index.set_record(self.node_record())

    def dropped_ago(self, keys: list[ChunkKey]) -> list[float | None]:
        """Seconds since each chunk left this node's last tier (None: not among the last RECENT_DROPS)."""
        now = time.monotonic()
        with self._dropped_lock:
            return [None if (t := self._dropped.get(k)) is None else round(now - t, 3) for k in keys]

    @property
    def transfer_stack(self) -> Transfers | None:
        return self._stack

    def _nodes(self) -> dict[NodeId, NodeRecord]:
        index = self.index
        return index.nodes() if index is not None else {}

    def background(self, task: asyncio.Task[object]) -> None:
        """Keep a loop task referenced until it ends (and log what it raised)."""
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception())

    @functools.cached_property
    def _hosts(self) -> AdvertisedHosts:
        """Where peers reach this node and its /metrics (``config.advertised_hosts``), resolved once, at
        start: a wildcard listen host without an advertise host is detected or refused (ConfigError)."""
        hosts = advertised_hosts(self.config)
        if hosts.detected:
            log.info("transfer.listen_host is %s: advertising %s, this host's outward address (set "
                     "transfer.advertise_host to choose another)", self.config.transfer.listen_host, hosts.transfer)
        for warning in hosts.warnings:
            log.warning("%s", warning)
        return hosts

    def _advertise_host(self) -> str:
        return self._hosts.transfer

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_server.port if self._metrics_server else None

    def stop(self, flush_to_disk: bool = True) -> None:
        """Stop cleanly: finish pending stores, write CPU chunks back to disk, revoke the lease."""
        t0 = time.monotonic()
        self.loader = self.scorer = None  # loads from here on are misses
        for future in (self._prune, self._handoff_task):
            if future is not None:
                future.cancel()
        self._prune = self._handoff_task = None
        if self._config_watch is not None and self.loop is not None:
            with contextlib.suppress(LMCacheP2PError, RuntimeError):
                self.loop.run(self._config_watch.stop(), self.config.etcd.timeout_s)
            self._config_watch = None
        if self.quarantine is not None and self.loop is not None:
            with contextlib.suppress(LMCacheP2PError, RuntimeError):
                self.loop.run(self.quarantine.stop(), self.config.etcd.timeout_s)
            self.quarantine = None
        self.invalidation.stop()
        self._writer.shutdown(wait=True)
        if self.objects is not None and self.loop is not None:  # stopped, it takes no more uploads
            with contextlib.suppress(LMCacheP2PError, RuntimeError):
                self.loop.run(self.objects.stop(), self.config.etcd.timeout_s)
        self.tiers.close()  # the tier worker finishes the write-backs queued so far
        if flush_to_disk and self._started:
            self.tiers.flush_to_disk()
        if self.index is not None:
            try:
                self.index.close()
            except LMCacheP2PError as exc:
                log.warning("closing the index failed: %s", exc)
            self.index = None
        if self.loop is not None:
            if self._stack is not None:
                self._run_quiet(self._stack.close())
                self._stack = None
            self.loop.stop()
            self.loop = None
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
        if self._started:
            log.info("agent %s stopped in %.2f s", self.node_id, time.monotonic() - t0)
        self._started = False

    def _run_quiet(self, coro: object) -> None:
        assert self.loop is not None
        try:
            self.loop.run(coro, self.config.transfer.timeout_s)  # type: ignore[arg-type]
        except (LMCacheP2PError, OSError) as exc:
            log.warning("shutdown step failed: %s", exc)

    def __enter__(self) -> CacheAgent:
        return self.start() if not self._started else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- index wiring ------------------------------------------------------------------------------
    def _on_tier_change(self, key: ChunkKey, tier: str | None) -> None:
        index = self.index
        if index is None:
            return
        if tier is None:
            index.remove_many(self.fp, [key])
            self.handoff.on_gone(key)
            with self._dropped_lock:  # tier locks of two tiers may call in at once
                self._dropped[key] = time.monotonic()
                self._dropped.move_to_end(key)
                while len(self._dropped) > RECENT_DROPS:
                    self._dropped.popitem(last=False)
            return
        if self._dropped:
            with self._dropped_lock:
                self._dropped.pop(key, None)
        header = self.tiers.header(key)  # lock-free dict probes: safe under the tiers' locks
        if header is not None and self._mine(header):  # only what this agent serves is announced
            index.add_many(self.fp, [key], TIER_CODES[tier])

    def _mine(self, header: ChunkHeader) -> bool:
        """A chunk of this agent's fingerprint and heads (not a piece on its way to assembly, nor a
        chunk another rank layout left on disk)."""
        return header.fingerprint == self.fp and header.heads == self.heads

    def holds(self, key: ChunkKey) -> bool:
        """This agent holds the chunk, in some tier, with the heads its engine needs."""
        return self.tiers.holds(key, self.heads)

    def _admit(self, header: ChunkHeader) -> bool:
        """The store's admission gate: nothing a standing invalidation covers, nor a quarantined node
        computed, gets in."""
        if self.computed_by_quarantined(header):
            self.invalidation.removed.labels("quarantine").inc()
            return False
        if not self.invalidation.covers(header):
            return True
        self.invalidation.count_refused(header)
        return False

    def _stamp(self, header: ChunkHeader) -> ChunkHeader:
        """The header an admitted chunk is held under: a peer's epoch is never trusted above ours."""
        return self.invalidation.stamp(header)

    def _held_elsewhere(self, key: ChunkKey) -> bool:
        """Another node holds ``key`` too: the pool evicts such copies first (``handoff.evict_copies_first``)."""
        return self.handoff.others_hold(key)

    # -- lookup and load (load.py's: one path for the engine and for this API) -------------------------
    def keys_for(self, token_ids: Sequence[int] | np.ndarray) -> tuple[list[ChunkKey], list[tuple[int, int]]]:
        return keys_of(self.fp, token_ids, self.config.chunk_size)

    def lookup(self, token_ids: Sequence[int] | np.ndarray) -> HitPlan:
        """The plan of a prompt, counted (see :meth:`Loader.lookup`)."""
        loader = self.loader
        if loader is not None:
            return loader.lookup(token_ids)
        keys, spans = self.keys_for(token_ids)
        return self.plan(keys, spans, sum(e - s for s, e in spans))

    def count_hits(self, chunks: Sequence[PlannedChunk]) -> None:
        """Tokens the engine got from the cache (see :meth:`Loader.count_hits`)."""
        if self.loader is not None:
            self.loader.count_hits(chunks)

    def plan(self, keys: Sequence[ChunkKey], spans: Sequence[tuple[int, int]], num_tokens: int) -> HitPlan:
        loader = self.loader
        if loader is None:  # not started, or stopping: what the tiers hold
            return local_plan(self.tiers, self.heads, keys, spans, num_tokens)
        return loader.plan(keys, spans, num_tokens)

    def wait_for_index(self, keys: Sequence[ChunkKey], revision: int, deadline: float) -> bool:
        loader = self.loader
        return loader is not None and loader.wait_for_index(keys, revision, deadline)

    def usable(self, record: NodeRecord | None) -> bool:
        loader = self.loader
        return loader is not None and loader.usable(record)

    # -- canary (canary.py; the mesh side of its checks is MeshCopies, over this agent's parts) -------
    @property
    def index_schema(self) -> Schema:
        return Schema(self.config.cluster)

    def quarantine_owner(self, record: QuarantineRecord) -> None:
        """Write ``record`` to etcd: every planner stops using the owner (this one at once)."""
        if self.loop is None or self.quarantine is None:
            log.error("canary: cannot quarantine %s without etcd", record.node)
            return
        try:
            self.loop.run(self.quarantine.add(record, self.config.canary.quarantine_ttl_s),
                          self.config.etcd.timeout_s * 2)
        except LMCacheP2PError as exc:
            log.error("canary: writing the quarantine of %s failed: %s", record.node, exc)

    def load(self, plan: HitPlan, dsts: Sequence[memoryview], timeout: float | None = None) -> list[bool]:
        """Fill ``dsts[i]`` with chunk ``plan.chunks[i]``; returns which were loaded (see :meth:`Loader.load`)."""
        loader = self.loader
        if loader is None:  # not started, or stopping: nothing to load from
            if len(dsts) != len(plan.chunks):
                raise ValueError(f"need one destination per planned chunk: {len(dsts)} != {len(plan.chunks)}")
            return [False] * len(plan.chunks)
        return loader.load(plan, dsts, self.deadline(timeout))

    def deadline(self, timeout: float | None = None) -> float:
        """An absolute load deadline ``timeout`` (default ``transfer.timeout_s``) from now."""
        return time.monotonic() + (timeout if timeout is not None else self.config.transfer.timeout_s)

    def unavailable_peers(self) -> frozenset[str]:
        """Peers this node's pulls do not ask now (held: an answer overdue; or backed off), by node id."""
        return self._stack.health.unavailable() if self._stack is not None else frozenset()

    def _planner_gauges(self) -> None:
        """What the fetch-or-recompute planner believes now (refreshed on each scrape)."""
        m = self.metrics
        m.peers_backed_off.set(self._stack.health.backed_off() if self._stack is not None else 0)
        expected = {p: self.peer_estimates.expected_s(p, self.chunk_bytes) for p in self.peer_estimates.snapshot()}
        shown = set(sorted(expected, key=lambda p: expected[p], reverse=True)[:PER_PEER_SERIES])
        for peer in self._expected_shown - shown:  # bounded: the slowest peers only
            with contextlib.suppress(KeyError):
                m.pull_expected.remove(peer)
        for peer in shown:
            m.pull_expected.labels(peer).set(expected[peer])
        self._expected_shown = shown
        m.recompute_chunk.set(self.prefill.recompute_s(self.config.chunk_size) or 0.0)

    def budget(self, plan: HitPlan, left_s: float | None = None) -> FetchBudget:
        """Cut ``plan`` to the pulls expected to beat recomputing and to finish in ``left_s`` (started only)."""
        if self.loader is None:
            raise RuntimeError("the agent is not started: nothing can be loaded")
        return self.loader.budget(plan, left_s)

    def load_pinned(self, plan: HitPlan, deadline: float | None = None, *, remote: bool = True,
                    label: str = "") -> list[Pin | None]:
        """Pins on CPU-pool slots holding ``plan``'s chunks, verified (see :mod:`lmcache_p2p.load`).

        The caller reads ``tiers.cpu.stage(pin)`` (a private verified copy; e.g. scatters it into the
        engine's blocks) and must ``unpin_chunk`` every pin it got; pins expire anyway after
        ``tiers.pin_timeout_s``. ``deadline`` is absolute (``time.monotonic()``; default
        ``transfer.timeout_s`` from now).
        """
        loader = self.loader
        if loader is None:  # not started, or stopping: nothing to load from
            return [None] * len(plan.chunks)
        return loader.load_pinned(plan, deadline if deadline is not None else self.deadline(), remote=remote,
                                  label=label)

    def pull(self, chunks: Sequence[PlannedChunk], deadline: float, patience: float | None = None) -> None:
        """Pull ``chunks`` into the CPU pool by ``deadline`` (:meth:`Loader.pull`); nothing when not started."""
        loader = self.loader
        if loader is not None:
            loader.pull(chunks, deadline, patience)

    def unpin_chunk(self, pin: Pin) -> None:
        self.tiers.cpu.unpin(pin)

    def chunk_header(self, key: ChunkKey) -> ChunkHeader | None:
        return self.tiers.header(key)

    async def _prune_peers_forever(self) -> None:
        """Per-peer state (connections, NIXL registrations, backoff, in-flight counts, metric labels)
        is kept only for the nodes in the index: checked every lease TTL, so churn never grows it."""
        async def prune() -> None:
            self._prune_peers()

        await every(lambda: max(1.0, float(self.config.etcd.lease_ttl_s)), prune, "pruning per-peer state")

    def _prune_peers(self) -> None:
        index, stack, puller = self.index, self._stack, self.puller
        if index is None or stack is None or puller is None:
            return
        nodes = index.nodes()
        stack.forget_except(puller.live_peers(nodes))
        puller.prune(nodes)

    # -- store -------------------------------------------------------------------------------------------
    def store_chunks(self, keys: Sequence[ChunkKey], num_tokens: Sequence[int],
                     chunks: Sequence[memoryview]) -> concurrent.futures.Future[int]:
        """Store chunks in the background. The caller must not modify ``chunks`` until the future is done."""
        if not len(keys) == len(num_tokens) == len(chunks):
            raise ValueError("keys, num_tokens and chunks must have the same length")
        return self._writer.submit(self._store_now, list(keys), list(num_tokens), list(chunks))

    def store(self, token_ids: Sequence[int] | np.ndarray, chunks: Sequence[memoryview]
              ) -> concurrent.futures.Future[int]:
        keys, spans = self.keys_for(token_ids)
        if len(chunks) > len(keys):
            raise ValueError(f"{len(chunks)} chunks given for a prompt of {len(keys)} chunks")
        return self.store_chunks(keys[: len(chunks)], [e - s for s, e in spans[: len(chunks)]], chunks)

    def reserve_chunk(self) -> Reservation:
        """A CPU slot to fill in place (e.g. a gather from the engine's KV cache), then ``commit_chunk``."""
        return self.tiers.cpu.reserve()

    def release_chunk(self, reservation: Reservation) -> None:
        self.tiers.cpu.release(reservation)

    def commit_chunk(self, reservation: Reservation, key: ChunkKey, num_tokens: int,
                     length: int) -> concurrent.futures.Future[None]:
        """Checksum, commit and announce a filled slot in the background."""
        return self._writer.submit(self._commit_now, reservation, key, num_tokens, length)

    def _commit_now(self, reservation: Reservation, key: ChunkKey, num_tokens: int, length: int) -> None:
        try:
            header = make_header(key, self.fp, reservation.view[:length], num_tokens, self.invalidation.epoch,
                                 heads=self.heads, origin=self.origin)
        except BaseException:
            self.tiers.cpu.release(reservation)
            raise
        if self.tiers.commit_reserved(reservation, header):  # releases the slot itself when refused
            self.metrics.stored_chunks.inc()

    def _store_now(self, keys: list[ChunkKey], num_tokens: list[int], chunks: list[memoryview]) -> int:
        stored = 0
        for key, ntok, payload in zip(keys, num_tokens, chunks, strict=True):
            if self.holds(key):
                continue
            try:
                if self.tiers.put(key, self.fp, payload, ntok, self.invalidation.epoch, self.heads,
                                  self.origin) is None:
                    continue  # covered by a standing invalidation
            except TierError as exc:
                log.warning("store of %s skipped: %s", key.hex(), exc)
                continue
            stored += 1
            self.metrics.stored_chunks.inc()
        return stored
