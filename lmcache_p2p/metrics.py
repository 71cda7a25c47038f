"""Prometheus metrics of one agent, all under ``lmcache_p2p_*``, on an injected registry.

Library code never touches prometheus_client's global registry: the agent receives a
``CollectorRegistry`` (tests give each agent its own) and serves it on ``metrics_port``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from . import cputime
from .index.protocol import BlockIndex
from .index.schema import Rejects
from .tiers import CpuPool, DiskTier, TieredStore

_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0, 10.0)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


# Per-peer series (peer_errors_total, pull_expected_seconds) an agent exposes at most: in a fleet of 1,000
# nodes, one series per peer per node would be 10^6; past this, errors count under peer="other" and only
# the slowest peers' estimates are shown.
PER_PEER_SERIES = 32
OTHER_PEERS = "other"
RECENT_S = 300  # the window of hit_ratio_recent (and of status's HIT%)

class AgentMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._refreshers: list[Callable[[], None]] = []
        self._served_seen = 0  # the server's running count at the last scrape
        self._evictions_seen: dict[str, int] = {}
        # Registered first, so a scrape refreshes the state-mirroring gauges before reading them.
        registry.register(_Refresher(self.refresh))
        ns = "lmcache_p2p"
        self.lookups = Counter("lookups", "Prompt lookups served by the agent", namespace=ns, registry=registry)
        self.hit_tokens = Counter("hit_tokens", "Prompt tokens found cached, by source and tier",
                                  ["source", "tier"], namespace=ns, registry=registry)
        self.miss_tokens = Counter(
            "miss_tokens", "Prompt tokens the engine computed that the cache did not give it, by the reason of the "
            "first chunk missed (no_owner: nobody announces it; evicted: this engine saved it and no node holds it "
            "now; other_identity: nodes serve the model under another fingerprint, none under ours; quarantined: only "
            "quarantined owners; owner_unusable: owners this node can't pull from (another wire or TLS, no record, "
            "backed off after errors); declined: the fetch-or-recompute budget chose recomputing; load_failed: "
            "planned, but the pull or its verification failed)", ["reason"], namespace=ns, registry=registry)
        self.load_seconds = Histogram(
            "load_seconds", "Whole loads, from the start of a request's load until its chunks are in the engine's "
            "blocks (or given up), by outcome (full, partial, none)", ["outcome"], namespace=ns, registry=registry,
            buckets=_LATENCY_BUCKETS)
        self.hit_ratio_recent = Gauge(
            "hit_ratio_recent", f"Tokens from cache over tokens looked up, over the last {RECENT_S // 60} minutes "
            "(-1: nothing looked up then)", namespace=ns, registry=registry)
        self._recent = RecentRatio(RECENT_S)
        self.loaded_chunks = Counter("loaded_chunks", "Chunks loaded for the engine, by source",
                                     ["source"], namespace=ns, registry=registry)
        self.load_failures = Counter("load_failures", "Chunks planned as hits that could not be loaded",
                                     ["reason"], namespace=ns, registry=registry)
        self.uncacheable_requests = Counter(
            "uncacheable_requests", "Requests whose KV can't be keyed, neither loaded nor saved, by reason "
            "(prompt_embeds, unknown_adapter, multimodal_unhashed)", ["reason"], namespace=ns, registry=registry)
        self.request_params_refused = Counter(
            "request_params_refused", "kv_transfer_params a client sent that were not honoured (over an operator "
            "limit, or naming what cannot be: an index revision etcd has not reached), by parameter", ["param"],
            namespace=ns, registry=registry)
        self.canary_checks = Counter(
            "canary_checks", "Owners' copies of chunks compared with what this engine computed (canary.py), by "
            "outcome (match, mismatch: the owner was quarantined, unavailable)", ["outcome"], namespace=ns,
            registry=registry)
        self.blend_requests = Counter(
            "blend_requests", "Requests whose declared segments were reused at another position (blended, not "
            "exact), by outcome (loaded; partial: up to a segment chunk that could not be had, the engine computes the "
            "rest; failed: no segment token reused, the engine computes them all; refused: asked of an engine set to "
            "blend that can't, e.g. an attention ISA whose K/V order it can't place: served prefix-only)", ["outcome"],
            namespace=ns, registry=registry)
        self.blend_tokens = Counter(
            "blend_tokens", "Tokens of blended requests, by kind (segment: placed from segment chunks, loaded or "
            "fresh; recomputed: run through the model over the blended cache; fresh: of segments held nowhere, "
            "computed after the base alone and saved)", ["kind"], namespace=ns, registry=registry)
        self.stored_chunks = Counter("stored_chunks", "Chunks stored by the engine", namespace=ns, registry=registry)
        self.admission_skipped = Counter(
            "admission_skipped_chunks", "Chunks of computed prompts left out of saves, by reason (short: a last "
            "partial chunk under tiers.min_save_tokens; sightings: seen in fewer than tiers.save_after_sightings "
            "prompts here)", ["reason"], namespace=ns, registry=registry)
        self.handoff_chunks = Counter(
            "handoff_chunks", "Hand-offs and replicas: chunks offered to peers, accepted by them, replicas among those "
            "accepted, received from peers, and dropped (hit, held by no other node, evicted)", ["event"],
            namespace=ns, registry=registry)
        self.handoff_bytes = Counter("handoff_bytes", "Bytes of chunks handed off to peers (out) and from them (in)",
                                     ["direction"], namespace=ns, registry=registry)
        self.object_ops = Counter("object_ops", "Object store calls, by operation (put, get, delete) and result (ok, "
                                  "error, missing, corrupt, invalidated, refused)", ["op", "result"], namespace=ns,
                                  registry=registry)
        self.object_bytes = Counter("object_bytes", "Bytes moved to (up) and from (down) the object store",
                                    ["direction"], namespace=ns, registry=registry)
        self.object_uploads_dropped = Counter("object_uploads_dropped", "Chunks worth keeping not uploaded to the "
                                              "object store, by reason (spill_full, budget_off, invalidated, "
                                              "uploading_elsewhere: another node claimed it)", ["reason"],
                                              namespace=ns, registry=registry)
        self.object_uploads_pending = Gauge("object_uploads_pending", "Uploads to the object store queued or in "
                                            "flight", namespace=ns, registry=registry)
        self.objects = Gauge("objects", "Objects of this node's fingerprint in the object store (as of the last "
                             "cleanup pass)", namespace=ns, registry=registry)
        self.object_tier = Gauge("object_tier", "1 while this node has the object tier (objects.url)", namespace=ns,
                                 registry=registry)
        self.assembled_chunks = Counter("assembled_chunks", "Chunks assembled from head ranges pulled from several "
                                        "peers (the ranks of a tensor-parallel engine)", namespace=ns,
                                        registry=registry)
        self.mixed_origin_chunks = Counter("mixed_origin_chunks", "Chunks not assembled because their pieces "
                                           "were computed by different engines (recomputed)", namespace=ns,
                                           registry=registry)
        self.pull_bytes = Counter("pull_bytes", "Bytes pulled from peers", ["transport"], namespace=ns,
                                  registry=registry)
        self.pull_chunks = Counter("pull_chunks", "Chunks requested from peers, by outcome",
                                   ["transport", "outcome"], namespace=ns, registry=registry)
        self.pull_coalesced = Counter("pull_coalesced", "Chunks a load did not ask a peer for: another load was "
                                      "pulling them into the pool already (it waited for that pull)",
                                      namespace=ns, registry=registry)
        self.pull_seconds = Histogram("pull_seconds", "Latency of one pull request to one peer", ["transport"],
                                      namespace=ns, registry=registry, buckets=_LATENCY_BUCKETS)
        self.silent_owner_seconds = Histogram(
            "silent_owner_seconds", "How long a pull waited on an owner that acknowledged nothing, or went "
            "silent mid-answer (stopped, unreachable), before its chunks were recomputed: what a hung owner cost "
            "the engine over a miss (pull_chunks_total{outcome=\"unanswered\"} and {outcome=\"stalled\"} count "
            "its chunks)", ["transport"], namespace=ns,
            registry=registry, buckets=_LATENCY_BUCKETS)
        self.load_queue_seconds = Histogram("load_queue_seconds", "Time an asynchronous load waited for a load "
                                            "thread (transfer.load_threads) before it started", namespace=ns,
                                            registry=registry, buckets=_LATENCY_BUCKETS)
        self.fetch_decisions = Counter(
            "fetch_decisions", "The fetch-or-recompute planner's choices, in chunks a peer or the object store "
            "held: pull; recompute_faster (the engine was expected to compute them sooner); deadline (not expected "
            "to arrive in the time the load had left)", ["decision"], namespace=ns, registry=registry)
        self.estimate_ratio = Histogram(
            "estimate_ratio", "What happened over what the planner expected: a load's pulls (pull: their time over "
            "the budget's expected time) and this engine's prefill steps (recompute: the step's time over what the "
            "step-cost fit the planner decides by predicted: a fixed cost plus a cost per token). Near 1: the "
            "planner's choices are right on average",
            ["estimate"], namespace=ns, registry=registry, buckets=_RATIO_BUCKETS)
        self.served_chunks = Counter("served_chunks", "Chunks served to peers", namespace=ns, registry=registry)
        self.checksum_failures = Counter("checksum_failures", "Chunks dropped because their checksum did not match",
                                         namespace=ns, registry=registry)
        self.peer_errors = Counter("peer_errors", "Failed requests to peers", ["peer"], namespace=ns,
                                   registry=registry)
        self.evictions = Counter("evictions", "Chunks evicted, by tier", ["tier"], namespace=ns, registry=registry)
        self.tier_used = Gauge("tier_used_bytes", "Bytes held per tier", ["tier"], namespace=ns, registry=registry)
        self.tier_capacity = Gauge("tier_capacity_bytes", "Capacity per tier", ["tier"], namespace=ns,
                                   registry=registry)
        self.chunks_held = Gauge("chunks_held", "Chunks held per tier", ["tier"], namespace=ns, registry=registry)
        self.index_chunks = Gauge("index_chunks", "Chunks of this fingerprint in the mirror of the etcd index",
                                  namespace=ns, registry=registry)
        self.index_nodes = Gauge("index_nodes", "Nodes in the mirror of the etcd index", namespace=ns,
                                 registry=registry)
        self.publish_pending = Gauge("publish_pending", "Index updates waiting to be written to etcd",
                                     namespace=ns, registry=registry)
        self.publish_lag = Gauge("publish_lag_seconds", "Age of the oldest unpublished index update",
                                 namespace=ns, registry=registry)
        self.lease_up = Gauge("lease_up", "1 while the agent holds a live etcd lease", namespace=ns,
                              registry=registry)
        self.degraded = Gauge("degraded", "1 while the node is outside the mesh (no live etcd lease or the mirror "
                              "not synced): it serves local hits and pulls from its last mirror", namespace=ns,
                              registry=registry)
        self._counts = _LiveCounters()
        registry.register(self._counts)
        self.pins = Gauge("pins", "Live pins on CPU slots", namespace=ns, registry=registry)
        self.peers_backed_off = Gauge("peers_backed_off", "Peers not asked for chunks until their backoff has passed",
                                      namespace=ns, registry=registry)
        self.pull_expected = Gauge("pull_expected_seconds", "Expected time to pull one chunk, per peer measured "
                                   "(the planner pulls while this beats recompute_chunk_seconds; the "
                                   f"{PER_PEER_SERIES} slowest peers only)", ["peer"],
                                   namespace=ns, registry=registry)
        self.recompute_chunk = Gauge("recompute_chunk_seconds", "This engine's time to compute one chunk "
                                     "(from its measured prefill rate; 0 until measured)", namespace=ns,
                                     registry=registry)
        self.info = Info("agent", "Agent identity and versions", namespace=ns, registry=registry)

    def watch_rejects(self, rejects: Rejects) -> None:
        """Export ``rejects`` as ``lmcache_p2p_index_rejected_total{kind}``."""
        self._counts.rejects = rejects

    def set_lease_losses(self, total: int) -> None:
        """``lmcache_p2p_lease_losses_total``: leases lost and replaced so far (a counter kept by the index)."""
        self._counts.lease_losses = total

    def live_counters(self) -> dict[str, tuple[str, ...]]:
        """Names (without ``_total``) and label names of the counters kept outside prometheus_client."""
        return dict(_LiveCounters.LABELS)

    def on_collect(self, fn: Callable[[], None]) -> None:
        """Gauges that mirror other objects' state are refreshed by ``fn`` before each scrape."""
        self._refreshers.append(fn)

    def refresh(self) -> None:
        for fn in self._refreshers:
            fn()
        ratio = self._recent.ratio()
        self.hit_ratio_recent.set(-1.0 if ratio is None else ratio)

    # -- hits and misses: the counters and the recent window, together ----------------------------------
    def count_hits(self, source: str, tier: str, tokens: int) -> None:
        """``tokens`` prompt tokens the engine got from the cache (``source``: local, peer, objects)."""
        if tokens > 0:
            self.hit_tokens.labels(source, tier).inc(tokens)
            self._recent.add(tokens, 0)

    def count_misses(self, reason: str, tokens: int) -> None:
        """``tokens`` prompt tokens the engine computed because the cache did not give them (``reason``:
        see ``miss_tokens``' help)."""
        if tokens > 0:
            self.miss_tokens.labels(reason).inc(tokens)
            self._recent.add(0, tokens)

    def mirror(self, tiers: TieredStore, index: BlockIndex | None, served_total: int | None) -> None:
        """Set the gauges that mirror an agent's state: its tiers, its index (mirror size, publisher,
        lease), and the chunks its transfer server has sent (``served_total``, a running count)."""
        held: list[CpuPool | DiskTier] = [tiers.cpu]
        if tiers.disk is not None:  # not `if disk:`: an empty tier has len() 0
            held.append(tiers.disk)
        for tier in held:
            self.tier_used.labels(tier.name).set(tier.used_bytes)
            self.tier_capacity.labels(tier.name).set(tier.capacity_bytes)
            self.chunks_held.labels(tier.name).set(len(tier))
            seen = self._evictions_seen.get(tier.name, 0)  # the tier's running count at the last scrape
            self.evictions.labels(tier.name).inc(max(tier.stats.evictions - seen, 0))
            self._evictions_seen[tier.name] = tier.stats.evictions
        self.pins.set(tiers.cpu.pinned_count())
        if served_total is not None:
            self.served_chunks.inc(max(served_total - self._served_seen, 0))
            self._served_seen = served_total
        if index is None:
            return
        self.index_nodes.set(len(index.nodes()))
        self._counts.etcd_faults = index.faults()
        gauges = {"index_chunks": self.index_chunks, "publish_pending": self.publish_pending,
                  "publish_lag_s": self.publish_lag, "lease_up": self.lease_up, "degraded": self.degraded}
        for name, value in index.stats().items():
            gauge = gauges.get(name)
            if gauge is not None:
                gauge.set(value)
            elif name == "lease_losses":
                self.set_lease_losses(int(value))


class RecentRatio:
    """Hits over hits and misses within the last ``window_s`` seconds, in buckets of a tenth of it
    (any thread)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._bucket_s = window_s / 10
        self._buckets: collections.deque[list[float]] = collections.deque()  # [start, hits, misses], oldest first
        self._lock = threading.Lock()

    def add(self, hits: int, misses: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._buckets or now - self._buckets[-1][0] >= self._bucket_s:
                self._buckets.append([now, 0.0, 0.0])
            bucket = self._buckets[-1]
            bucket[1] += hits
            bucket[2] += misses
            self._expire(now)

    def ratio(self, now: float | None = None) -> float | None:
        """None: nothing was looked up in the window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire(now)
            hits = sum(b[1] for b in self._buckets)
            total = hits + sum(b[2] for b in self._buckets)
        return hits / total if total else None

    def _expire(self, now: float) -> None:
        while self._buckets and now - self._buckets[0][0] > self.window_s:
            self._buckets.popleft()


class _Refresher:
    """A collector with no metrics of its own: it runs the agent's gauge refreshers on each scrape."""

    def __init__(self, refresh: Callable[[], None]) -> None:
        self._refresh = refresh

    def collect(self) -> list[Metric]:
        self._refresh()
        return []


class _LiveCounters:
    """Counters whose values live in other objects (the index's, shared with non-agent readers)."""

    LABELS = {"lmcache_p2p_index_rejected": ("kind",), "lmcache_p2p_lease_losses": (),
              "lmcache_p2p_etcd_faults": ("kind",), "lmcache_p2p_cpu_seconds": ("thread",)}

    def __init__(self) -> None:
        self.rejects: Rejects | None = None
        self.lease_losses = 0
        self.etcd_faults: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        rejected = CounterMetricFamily("lmcache_p2p_index_rejected", "Malformed etcd keys or values skipped, by kind",
                                       labels=["kind"])
        counts = dict(self.rejects.counts) if self.rejects is not None else {}
        for kind, n in sorted(counts.items()):
            rejected.add_metric([kind], n)
        yield rejected
        losses = CounterMetricFamily("lmcache_p2p_lease_losses", "Times the etcd lease was lost and re-taken")
        losses.add_metric([], self.lease_losses)
        yield losses
        faults = CounterMetricFamily("lmcache_p2p_etcd_faults", "Control-plane faults met and recovered from, by "
                                     "kind (watch interrupted/resynced/callback_failed, keepalive_failed/restarted, "
                                     "publish_failed)", labels=["kind"])
        for kind, n in sorted(self.etcd_faults.items()):
            faults.add_metric([kind], n)
        yield faults
        cpu = CounterMetricFamily("lmcache_p2p_cpu_seconds", "CPU time of this process's lmcache-p2p threads, by "
                                  "role (loop, load, store, tiers, canary, verify, scheduler, events): what the "
                                  "cache costs the engine's host, apart from the engine", labels=["thread"])
        for role, seconds in sorted(cputime.seconds().items()):
            cpu.add_metric([role], seconds)
        yield cpu
