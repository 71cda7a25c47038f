"""The cache agent: tiers + mesh index + transports, behind a small synchronous API.

    lookup(token_ids) -> HitPlan          dict probes only: local store, then the index mirror
    load(plan, dsts)  -> [loaded?]        budget, pull, a verified copy into each destination
    store(token_ids, chunks) -> Future    returns at once; checksum, copy and publish run behind
    intake.reserve / intake.commit        fill a CPU slot in place (a gather), publish it behind
    loader                                the load path itself (plan, budget, pull; ``load_pinned``:
                                          pinned verified CPU slots, the engine's path; a stopped one
                                          before start and after stop: local plans, every load a miss)

The agent composes the parts; each concern lives in its own module:

    tiers/            where chunks are held (CPU pool, disk), eviction, admission
    intake.py         the engine's own chunks in: headers, admission, announcement, on a writer thread
    advert.py         this node's record in etcd, and the proof of the engine it announces
    quarantine_gate.py  what a quarantine means for the chunks held here
    index/            the mesh index: lease, publisher, watch-fed mirror (``BlockIndex``)
    plan.py           which chunks to load from where (and whether pulling beats recomputing)
    load.py           plan -> budget -> pull -> pinned verified slots, with one absolute deadline
    transfer/pull.py  plan -> pull -> retry -> verify -> metrics (``Puller``), over transfer/'s transports
    handoff.py        hand-off of sole copies and replication
    objects/          the object tier: uploads behind eviction, loads planned like a slow peer (node.py: as
                      a node builds it)
    invalidation.py   mesh-wide invalidation barriers and the chunk TTL
    coordinator/      the cluster config in etcd, and which of its fields apply live (apply.py)
    score.py          ``/v1/score`` next to ``/metrics``

Every side effect is injected: the config, the Prometheus registry, the index (an
``index_factory`` building a :class:`BlockIndex` once the node record is known) and the
transports. The network side runs on one asyncio loop in a background thread (:class:`LoopThread`).

Why one file of this size: the agent composes its parts (index, tiers, transports, Loader, Intake, advert, gate,
object tier) and starts and stops them in one order, with the API an engine and the CLI call; the parts themselves
are rooms of their own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CollectorRegistry

from . import __version__
from .advert import Advert, Live
from .aio import LoopThread, TaskSet, every
from .chunk import ChunkHeader
from .config import AgentConfig
from .coordinator.apply import LiveConfig, set_log_level
from .coordinator.cluster_config import ClusterConfig
from .coordinator.store import ConfigWatcher
from .errors import LMCacheP2PError
from .estimates import PeerEstimates, PrefillRate
from .handoff import Handoff
from .ids import OBJECTS, TIER_CODES, WIRE_VERSION, NodeId, origin_of
from .index.protocol import BlockIndex
from .index.quarantine import Quarantine, QuarantineRecord
from .index.schema import NodeRecord, Rejects, Schema
from .intake import Intake
from .invalidation import MeshInvalidation
from .keys import ChunkKey, Fingerprint, HeadRange
from .load import Loader, StoppedLoader, keys_of
from .metrics import AgentMetrics
from .metrics_http import MetricsServer
from .plan import HitPlan
from .planner_gauges import PlannerGauges
from .quarantine_gate import QuarantineGate
from .score import Scorer, http_app
from .tiers import TieredStore
from .tiers.recent import RecentDrops
from .transfer.pull import Puller
from .transfer.stack import ServerHooks, Transfers, TransfersFactory, TransferStack

if TYPE_CHECKING:
    from .objects.tier import ObjectTier

log = logging.getLogger(__name__)
IndexFactory = Callable[[LoopThread, NodeRecord], BlockIndex]


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
        # its config: its own, with the cluster config's live fields applied as they change
        self.live = LiveConfig(config, self.live_setters)
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
        self.advert = Advert(self.node_id, fingerprint, self.heads, role, secret)  # what its record says
        self.metrics = metrics if metrics is not None else AgentMetrics(CollectorRegistry())
        self.metrics.on_collect(lambda: self.metrics.mirror(
            self.tiers, self.index, self._stack.chunks_sent() if self._stack is not None else None))
        self.rejects = Rejects()  # malformed etcd contents skipped by every reader of this agent
        self.peer_estimates = PeerEstimates()  # pull latency and bandwidth per peer, measured here
        self.prefill = PrefillRate()  # this engine's prefill rate (the worker connector feeds it)
        self.planner_gauges = PlannerGauges(
            self.metrics, self.peer_estimates, self.prefill, chunk_bytes=chunk_bytes, chunk_size=config.chunk_size,
            backed_off=lambda: self._stack.health.backed_off() if self._stack is not None else 0)
        self.metrics.on_collect(self.planner_gauges.refresh)
        # The object tier, when ``objects.url`` is set: uploads of what this node evicts, reads as a transport.
        self.objects: ObjectTier | None = None
        if config.objects.url is not None:
            from .objects.node import node_object_tier  # obstore is imported only where it is used

            self.objects = node_object_tier(
                lambda: self.config, fp=self.fp, num_kv_heads=fingerprint.num_kv_heads, node_id=self.node_id,
                metrics=self.metrics, secret=secret, rejects=self.rejects,
                hits=lambda key: self.handoff.hits.get(key, 0), others_hold=lambda key: self.handoff.others_hold(key),
                covers=self._covers_object,
                # the invalidation is built after the tier (it takes the tiers, which take the tier's offer)
                covers_tenant=lambda header, tenant: self.invalidation.covers_tenant(header, tenant))
        # The hooks are this agent's methods, over parts made just below (each needs the tiers).
        self.tiers = TieredStore.from_config(
            config.tiers, chunk_bytes, admit=self._admit, stamp=self._stamp, listener=self._on_tier_change,
            # copies another node holds too go first (``handoff.evict_copies_first``)
            evict_first=(lambda key: self.handoff.others_hold(key)) if config.handoff.evict_copies_first else None,
            spill=self.objects.offer if self.objects is not None else None)
        self.invalidation = MeshInvalidation(
            config, self.tiers, {self.fp: fingerprint}, self.metrics.registry, rejects=self.rejects,
            listeners=[self.objects.cleanup_soon] if self.objects is not None else [])
        # chunks of owners the canary found wrong: never admitted, dropped, not recovered
        self._tasks = TaskSet("background")  # on the loop
        self.gate = QuarantineGate(self.origin, self.tiers, lambda: self.invalidation.removed.labels("quarantine"),
                                   self._tasks)
        self.metrics.watch_rejects(self.rejects)
        self.loop: LoopThread | None = None
        self.index: BlockIndex | None = None
        self._stack: Transfers | None = None
        self._metrics_server: MetricsServer | None = None
        # the engine's own chunks come in here (headers, admission, announcement), behind the caller
        self.intake = Intake(self.tiers, self.fp, self.heads, self.origin, lambda: self.invalidation.epoch,
                             self.metrics.stored_chunks)
        self.puller: Puller | None = None  # once the transports are up
        self._prune: concurrent.futures.Future[None] | None = None
        self._handoff_task: concurrent.futures.Future[None] | None = None
        self.handoff = Handoff(settings=lambda: self.config, fp=self.fp, num_kv_heads=fingerprint.num_kv_heads,
                               node_id=self.node_id, heads=self.heads, chunk_bytes=chunk_bytes, tiers=self.tiers,
                               metrics=self.metrics)
        self.drops = RecentDrops()  # recently evicted or removed
        self._config_watch: ConfigWatcher | None = None
        # the load path (load.py): a stopped one (local plans, every load a miss) until its parts are up
        self._stopped_loader = StoppedLoader(self.tiers, self.fp, self.heads, config.chunk_size)
        self.loader: Loader | StoppedLoader = self._stopped_loader
        self.scorer: Scorer | None = None  # what /v1/score reads (score.py), once the index is up
        self._started = False

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> CacheAgent:
        from .index.etcd_index import EtcdBlockIndex

        if self.config.log_level is not None:
            set_log_level(self.config.log_level)
        self.loop = LoopThread(f"lmcache-p2p-{self.node_id}")
        try:
            hooks = ServerHooks(prepare=self.tiers.ensure_in_cpu, on_offer=self.handoff.accept,
                                on_served=self.handoff.on_served, on_recent=self.drops.ago)
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
            client = self.index.client
            self.invalidation.start(self.loop, client)
            if client is not None:  # the cluster config in etcd: live fields apply as they change
                self._config_watch = ConfigWatcher(client, self.config.cluster, self._on_cluster_config,
                                                   rejects=self.rejects)
                self.loop.run(self._config_watch.start(0.0), self.config.etcd.timeout_s)
                self.loop.run(self.gate.start(client, self.index_schema, self.rejects, self.config.etcd.start_wait_s),
                              self.config.etcd.start_wait_s + self.config.etcd.timeout_s)
            if self.objects is not None:
                self._start_objects(self.objects, client)
            loader = self.loader = Loader(
                tiers=self.tiers, fp=self.fp, num_kv_heads=self.fingerprint.num_kv_heads, heads=self.heads,
                node_id=self.node_id, chunk_size=self.config.chunk_size, chunk_bytes=self.chunk_bytes,
                transfer=self.config.transfer, tiers_config=self.config.tiers, index=self.index, puller=self.puller,
                quarantine=self.gate.quarantine, objects=self.objects, peer_estimates=self.peer_estimates,
                prefill=self.prefill, metrics=self.metrics, on_hit=self.handoff.on_hit,
                model_id=self.fingerprint.model_id, dropped=lambda key: self.drops.ago([key])[0] is not None)
            recovered = self.gate.drop(self.invalidation.vet_recovered(self.tiers.recover()))
            mine = [h.key for h in recovered if self._mine(h)]  # others stay on disk, unannounced
            if mine:
                self.index.add_many(self.fp, mine, TIER_CODES["disk"])
            self._prune = self.loop.submit(self._prune_peers_forever())
            self.scorer = Scorer(settings=lambda: self.config, fingerprint=self.fingerprint, node_id=self.node_id,
                                 chunk_bytes=self.chunk_bytes, index=self.index, peer_estimates=self.peer_estimates,
                                 prefill=self.prefill, holds=self.holds, usable=loader.usable,
                                 record=self.node_record)
            self.handoff.start(index=self.index, puller=self.puller, transfers=self._stack, usable=loader.usable,
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
                 "" if self.index is None or self.index.online else " (degraded: etcd not reachable yet)")
        return self

    def _start_objects(self, objects: ObjectTier, client: Any) -> None:
        """Loads at once; uploads of what this node evicts from here on; records and cleanup in etcd."""
        assert self.loop is not None

        async def start() -> None:
            objects.start(client)

        self.loop.run(start(), self.config.etcd.timeout_s)
        log.info("object tier: %s bucket %s prefix %s", objects.store.url, self.config.objects.bucket,
                 self.config.objects.prefix)

    def _covers_object(self, header: ChunkHeader, holder: NodeId) -> bool:
        """An object ``holder`` uploaded must not be loaded (nor kept): a standing invalidation covers it, or
        a quarantined node computed it."""
        return self.invalidation.covers_held_by(header, holder) or self.gate.blocks(header)

    @property
    def config(self) -> AgentConfig:
        """The config in effect now (:class:`LiveConfig`)."""
        return self.live.config

    @property
    def quarantine(self) -> Quarantine | None:
        """The owners the canary found wrong (never planned), once etcd is there."""
        return self.gate.quarantine

    def node_record(self) -> NodeRecord:
        """This node's record as it stands now (``advert.py``)."""
        stack, server = self._stack, self._metrics_server
        return self.advert.record(Live(
            transfer=stack.node_record() if stack is not None else {},
            metrics_port=server.port if server is not None else None,
            capacities={"cpu": self.tiers.cpu.capacity_bytes,
                        **({"disk": self.tiers.disk.capacity_bytes} if self.tiers.disk is not None else {})},
            free=self.handoff.free(), config=self.config, config_revision=self.live.revision,
            config_deviations=self.live.deviations))

    def live_setters(self) -> dict[str, Callable[[AgentConfig], None] | None]:
        """What applies each live field of the cluster config (``coordinator/apply.py``'s table: a test holds
        the two to each other) while this node runs, given the new config; None: read at every use. A new
        live field: its row there, its setter here."""
        return {
            "tiers.chunk_ttl_s": self._set_chunk_ttl,
            "tiers.eviction": lambda c: self.tiers.set_eviction(c.tiers.eviction),
            "transfer.backoff_s": self._set_backoff,
            "log_level": lambda c: set_log_level(c.log_level),
            "handoff.budget_bytes_per_s": None,
            "handoff.replicate_after": None,
        }

    def _set_chunk_ttl(self, config: AgentConfig) -> None:
        self._tasks.spawn(self.invalidation.set_ttl(config.tiers.chunk_ttl_s), "set-chunk-ttl")

    def _set_backoff(self, config: AgentConfig) -> None:
        if self._stack is not None:
            self._stack.health.set_base(config.transfer.backoff_s)
        if self.objects is not None:
            self.objects.health.set_base(max(config.transfer.backoff_s, 0.1))

    def _on_cluster_config(self, cluster: ClusterConfig) -> None:
        """On the loop: the cluster config changed; apply its live fields (``coordinator/apply.py``)."""
        watch = self._config_watch
        assert watch is not None
        self.live.apply(cluster, watch.stored, watch.revision)
        if self.index is not None:
            self.index.set_record(self.node_record())

    @property
    def transfer_stack(self) -> Transfers | None:
        return self._stack

    def _nodes(self) -> dict[NodeId, NodeRecord]:
        index = self.index
        return index.nodes() if index is not None else {}

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_server.port if self._metrics_server else None

    def stop(self, flush_to_disk: bool = True) -> None:
        """Stop cleanly: finish pending stores, write CPU chunks back to disk, revoke the lease."""
        t0 = time.monotonic()
        self.loader, self.scorer = self._stopped_loader, None  # loads from here on are misses
        for future in (self._prune, self._handoff_task):
            if future is not None:
                future.cancel()
        self._prune = self._handoff_task = None
        for watch in (self._config_watch, self.gate):  # the etcd watches
            if watch is not None and self.loop is not None:
                with contextlib.suppress(LMCacheP2PError, RuntimeError):
                    self.loop.run(watch.stop(), self.config.etcd.timeout_s)
        self._config_watch = None
        self.invalidation.stop()
        self.intake.close()
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
            self.drops.dropped(key)
            return
        self.drops.returned(key)
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
        if self.gate.refused(header):
            return False
        if not self.invalidation.covers(header):
            return True
        self.invalidation.count_refused(header)
        return False

    def _stamp(self, header: ChunkHeader) -> ChunkHeader:
        """The header an admitted chunk is held under: a peer's epoch is never trusted above ours."""
        return self.invalidation.stamp(header)

    # -- lookup and load (load.py's: one path for the engine and for this API) -------------------------
    def keys_for(self, token_ids: Sequence[int] | np.ndarray) -> tuple[list[ChunkKey], list[tuple[int, int]]]:
        return keys_of(self.fp, token_ids, self.config.chunk_size)

    def lookup(self, token_ids: Sequence[int] | np.ndarray) -> HitPlan:
        """The plan of a prompt, counted (see :meth:`Loader.lookup`)."""
        return self.loader.lookup(token_ids)

    # -- canary (canary.py; the mesh side of its checks is MeshCopies, over this agent's parts) -------
    @property
    def index_schema(self) -> Schema:
        return Schema(self.config.cluster)

    def quarantine_owner(self, record: QuarantineRecord) -> None:
        """Write ``record`` to etcd: every planner stops using the owner (this one at once)."""
        if self.loop is None or self.gate.quarantine is None:
            log.error("canary: cannot quarantine %s without etcd", record.node)
            return
        try:
            self.loop.run(self.gate.add(record, self.config.canary.quarantine_ttl_s), self.config.etcd.timeout_s * 2)
        except LMCacheP2PError as exc:
            log.error("canary: writing the quarantine of %s failed: %s", record.node, exc)

    def load(self, plan: HitPlan, dsts: Sequence[memoryview], timeout: float | None = None) -> list[bool]:
        """Fill ``dsts[i]`` with chunk ``plan.chunks[i]`` within ``timeout`` (default ``transfer.timeout_s``);
        returns which were loaded (see :meth:`Loader.load`; the engine's path is the Loader's
        ``load_pinned``)."""
        return self.loader.load(plan, dsts, time.monotonic() + (timeout if timeout is not None
                                                                 else self.config.transfer.timeout_s))

    def unavailable_peers(self) -> frozenset[str]:
        """Peers this node's pulls do not ask now (held: an answer overdue; or backed off), by node id."""
        return self._stack.health.unavailable() if self._stack is not None else frozenset()

    async def _prune_peers_forever(self) -> None:
        """Per-peer state (connections, NIXL registrations, backoff, in-flight counts, metric labels)
        is kept only for the nodes in the index: checked every lease TTL, so churn never grows it."""
        async def prune() -> None:
            index, stack, puller = self.index, self._stack, self.puller
            if index is not None and stack is not None and puller is not None:
                nodes = index.nodes()
                stack.forget_except(puller.live_peers(nodes))
                puller.prune(nodes)

        await every(lambda: max(1.0, float(self.config.etcd.lease_ttl_s)), prune, "pruning per-peer state")

    # -- store (intake.py) -------------------------------------------------------------------------------
    def store_chunks(self, keys: Sequence[ChunkKey], num_tokens: Sequence[int],
                     chunks: Sequence[memoryview]) -> concurrent.futures.Future[int]:
        """Store chunks in the background (:meth:`Intake.store_chunks`)."""
        return self.intake.store_chunks(keys, num_tokens, chunks)

    def store(self, token_ids: Sequence[int] | np.ndarray, chunks: Sequence[memoryview]
              ) -> concurrent.futures.Future[int]:
        """Store the first ``len(chunks)`` chunks of a prompt in the background."""
        keys, spans = self.keys_for(token_ids)
        if len(chunks) > len(keys):
            raise ValueError(f"{len(chunks)} chunks given for a prompt of {len(keys)} chunks")
        return self.intake.store_chunks(keys[: len(chunks)], [e - s for s, e in spans[: len(chunks)]], chunks)
