"""Pull orchestration: the remote part of a hit plan, into this node's CPU pool.

    puller = Puller(node_id, fp, pool, transports, ["nixl", "tcp"], health, index.nodes, metrics, estimates, loop)
    puller.pull(plan_chunks, deadline)     # blocks the caller until ``deadline``; never raises for a peer
    await puller.pull_from(node, chunks, deadline)   # on the loop: whole chunks from one peer (hand-offs)

Every deadline is absolute, on ``time.monotonic()``, and handed down unchanged to the transports.

One pass: the planned chunks are grouped by owner (a chunk assembled from several owners' head
ranges is one *part* per piece), every group is pulled concurrently over the first transport in
``preference`` both sides speak, verified on arrival by the transport and committed into the
pool; the parts that missed are tried on their planned alternative owners, one per round, while the
deadline allows (peers, and the object store: one more owner, behind its own transport in
``sources``); pieces are then concatenated into their chunk, each checked again in the copy
(a piece changed in memory since it landed is dropped, the chunk recomputed: ``assembly.py``). Metrics (pull
latency, bytes, outcome per chunk, checksum failures, peer errors) and the per-peer latency
model are fed here.
A chunk another load is pulling into the pool already (requests sharing a prefix, arriving together)
is not asked for twice: the later load waits for that pull, within its own deadline, and asks itself
only if it missed (``pull_coalesced_total``). Which peers are worth asking (``usable``) and how many
chunks each is already sending us (``inflight``, for the planner) are answered here too.

Nothing in this module knows about etcd or the engine: the index comes in as ``nodes()`` (the
mirror's live node records), the transports as a mapping by name, so the unit tests drive it with
the loopback transport and in-memory records (``lmcache_p2p.testing``).

Why one file of this size: one pass of one pull (owners grouped, transports chosen, alternatives tried, the deadline
kept, metrics counted) read as one algorithm; how pieces of a chunk from several owners are assembled is
``assembly.py``'s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from ..aio import LoopThread, remaining
from ..errors import LMCacheP2PError, TierError
from ..estimates import PeerEstimates
from ..ids import NodeId, PeerAddress
from ..keys import ChunkKey, FingerprintDigest
from ..metrics import OTHER_PEERS, PER_PEER_SERIES, AgentMetrics
from ..peers import PeerRecord, compatible
from ..plan import Piece, PlannedChunk
from ..tiers.cpu_pool import CpuPool
from . import assembly
from .base import SILENT, MissReason, PullResult, Transport, Want
from .health import PeerHealth

log = logging.getLogger(__name__)

JOIN_SLACK_S = 0.25  # a load joins another's pull of a chunk if that pull's deadline is at most this much earlier


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    """One pull: a planned chunk's whole range from its source, or one piece of it."""

    chunk: PlannedChunk
    piece: Piece

    @property
    def want(self) -> Want:
        if not self.chunk.pieces:
            return Want(self.chunk.key, self.chunk.heads)
        return Want(self.chunk.key, self.piece.heads, self.chunk.piece_key(self.piece.heads))

    @property
    def pool_key(self) -> ChunkKey:
        """The key the part lands under in the pool (the chunk's, or its piece's)."""
        return self.want.store_as or self.chunk.key


class Puller:
    def __init__(
        self,
        node_id: NodeId,
        fp: FingerprintDigest,
        pool: CpuPool,
        transports: Mapping[str, Transport],
        preference: Sequence[str],
        health: PeerHealth,
        nodes: Callable[[], Mapping[NodeId, PeerRecord]],
        metrics: AgentMetrics,
        estimates: PeerEstimates,
        loop: LoopThread,
        *,
        tls: bool = False,
        pin_timeout_s: float = 5.0,
        on_loaded: Callable[[ChunkKey], None] | None = None,
        sources: Mapping[NodeId, tuple[Transport, PeerAddress]] | None = None,
    ) -> None:
        self.node_id = node_id
        self.fp = fp
        self.pool = pool
        self.transports = transports
        self.preference = tuple(preference)  # transport names, most preferred first
        self.health = health
        self.nodes = nodes
        self.metrics = metrics
        self.estimates = estimates
        self.loop = loop
        self.tls = tls
        self.pin_timeout_s = pin_timeout_s
        self.on_loaded = on_loaded  # a whole chunk landed in the pool (the agent announces it)
        # Owners with no node record, each behind its own transport (the object store: ``@objects``)
        self.sources = dict(sources or {})
        self._inflight: dict[NodeId, int] = {}
        self._inflight_lock = threading.Lock()  # the planner reads it from the engine's threads
        self._error_peers: set[NodeId] = set()  # label values of peer_errors, pruned with the peers
        # Being pulled now (on the loop): that pull's deadline, and whether the part landed.
        self._landing: dict[ChunkKey, tuple[float, asyncio.Future[bool]]] = {}
        self._piece_users: dict[ChunkKey, int] = {}  # piece key -> loads that will assemble from it
        # (chunk key, nonce) -> pulls of its pieces still arriving past their deadline (on the loop): settled
        # (assembled or dropped) once the last of them ended
        self._late_pulls: dict[tuple[ChunkKey, bytes], int] = {}
        self._pieces_lock = threading.Lock()

    # -- which peers -------------------------------------------------------------------------------
    def transport_for(self, record: PeerRecord | None) -> Transport | None:
        """The most preferred transport both sides speak."""
        if record is None:
            return None
        for name in self.preference:
            if name in record.transports and name in self.transports:
                return self.transports[name]
        return None

    def usable(self, record: PeerRecord | None) -> bool:
        """A peer we can pull from now: compatible (``peers.compatible``, the rule the scheduler side
        counts hits by) over the transports running here, and not backed off."""
        if record is None or not compatible(record, tls=self.tls, transports=self.transports):
            return False
        peer = record.peer()
        return peer is not None and self.health.available(peer)

    def inflight(self) -> dict[NodeId, int]:
        """Chunks being pulled now, per owner (the planner spreads new pulls away from busy owners)."""
        with self._inflight_lock:
            return {n: c for n, c in self._inflight.items() if c}

    # -- pulling -----------------------------------------------------------------------------------
    def pull(self, chunks: Sequence[PlannedChunk], deadline: float, patience: float | None = None,
             silence_s: float | None = None) -> None:
        """Pull ``chunks`` into the pool by ``deadline`` (from any thread but the loop's); what
        misses is simply not in the pool afterwards: the caller recomputes it.

        ``patience`` (absolute, later than ``deadline``): an answer still arriving at ``deadline`` is
        waited for on, until ``patience``, as long as its bytes keep coming (a slow peer is not a hung
        one: one that sent nothing for the pull's own allowance, or a tenth of the patience, is given up
        on; what it sends later still lands in the pool). ``silence_s``: how long an owner may leave a
        request unacknowledged before it is taken for not serving and its chunks recomputed (see
        ``Transport.pull``; None: a third of the pull's allowance)."""
        pieced = [c for c in chunks if c.pieces]
        pieces = [c.piece_key(p.heads) for c in pieced for p in c.pieces]
        with self._pieces_lock:  # another load may share them (a joined pull): dropped by the last one
            for key in pieces:
                self._piece_users[key] = self._piece_users.get(key, 0) + 1
        try:
            try:
                until = max(deadline, patience or 0.0)
                self.loop.run(self.pull_all(chunks, deadline, patience, silence_s), remaining(until) + 1.0)
            except LMCacheP2PError as exc:
                log.warning("pull of %d chunks failed: %s", len(chunks), exc)
            for chunk in pieced:
                self.assemble(chunk, drop_pieces=False)
        finally:
            self._drop_pieces(pieces)

    async def pull_all(self, chunks: Sequence[PlannedChunk], deadline: float, patience: float | None = None,
                       silence_s: float | None = None) -> None:
        """On the loop: one concurrent pull per owner, then retry rounds on the alternatives (peers, the
        object store), each part's next one per round, while the deadline allows. Nothing is asked once
        ``deadline`` has passed (a late pull would only back a healthy peer off): its chunks are counted
        ``expired``, and how late the loop reached it logged (a starved host)."""
        late = time.monotonic() - deadline  # remaining() stops at 0
        if late >= 0:
            self.metrics.pull_chunks.labels("none", str(MissReason.EXPIRED)).inc(len(chunks))
            log.info("pull of %d chunks not asked: the load's deadline had passed %.1f ms before this loop reached "
                     "it; computed", len(chunks), 1e3 * late)
            return
        groups: dict[NodeId, list[Part]] = {}
        for c in chunks:
            for piece in c.parts():
                groups.setdefault(piece.source, []).append(Part(c, piece))
        results = await asyncio.gather(*(self._pull_parts(peer, group, deadline, patience, silence_s)
                                         for peer, group in groups.items()))
        missed = [part for result in results for part in result]
        for round_ in range(max((len(p.piece.alternatives) for p in missed), default=0)):
            retry: dict[NodeId, list[Part]] = {}
            for part in missed:
                if round_ < len(part.piece.alternatives):
                    retry.setdefault(part.piece.alternatives[round_], []).append(part)
            if not retry or remaining(deadline) <= 0:
                return
            results = await asyncio.gather(*(self._pull_parts(peer, group, deadline, silence_s=silence_s)
                                             for peer, group in retry.items()))
            missed = [part for result in results for part in result]

    async def pull_from(self, node: NodeId, chunks: list[PlannedChunk], deadline: float) -> list[PlannedChunk]:
        """Pull whole ``chunks`` (this node's heads) from ``node`` into the pool; those that missed. Always
        asked of ``node`` itself (hand-offs, a canary's copy of one owner), never joined to another pull."""
        missed = await self._pull_own(node, [Part(c, c.parts()[0]) for c in chunks], deadline)
        return [p.chunk for p in missed]

    async def _pull_parts(self, node: NodeId, parts: list[Part], deadline: float,
                          patience: float | None = None, silence_s: float | None = None) -> list[Part]:
        """Pull ``parts`` from ``node``; returns those that missed. Never raises for the peer's failure.

        A part already being pulled into the pool by another load (concurrent requests sharing a prefix)
        is not asked for again: this load waits for that pull's outcome, within its own deadline."""
        loop = asyncio.get_running_loop()
        own: list[Part] = []
        joined: list[tuple[Part, asyncio.Future[bool]]] = []
        for part in parts:
            pulling = self._landing.get(part.pool_key)
            # Joined only if that pull may run about as long as this load would: a load with much more
            # time than the load that started it (a tight budget) pulls on its own.
            if pulling is not None and pulling[0] >= deadline - JOIN_SLACK_S:
                joined.append((part, pulling[1]))
            else:
                own.append(part)
        mine: dict[ChunkKey, tuple[float, asyncio.Future[bool]]] = {}
        for part in own:
            if part.pool_key not in self._landing:
                mine[part.pool_key] = self._landing[part.pool_key] = (deadline, loop.create_future())
        missed: list[Part] = list(own)
        try:
            if own:
                missed = await self._pull_own(node, own, deadline, patience, silence_s)
        finally:
            lost = {p.pool_key for p in missed}
            for key, entry in mine.items():
                del self._landing[key]
                entry[1].set_result(key not in lost)
        if joined:
            again: list[Part] = []
            for part, shared in joined:
                try:
                    async with asyncio.timeout(remaining(deadline)):
                        landed = await asyncio.shield(shared)
                except TimeoutError:
                    landed = False
                if landed:
                    self.metrics.pull_coalesced.inc()
                else:
                    # That pull missed (its load's deadline may have been shorter than ours): ask once
                    # more ourselves while time is left (a peer it found dead is backed off: no wait).
                    (again if remaining(deadline) > 0 else missed).append(part)
            if again:
                missed += await self._pull_own(node, again, deadline, silence_s=silence_s)
        return missed

    async def _pull_own(self, node: NodeId, parts: list[Part], deadline: float,
                        patience: float | None = None, silence_s: float | None = None) -> list[Part]:
        record = self.nodes().get(node)
        transport: Transport | None
        peer: PeerAddress | None
        if node in self.sources:
            transport, peer = self.sources[node]
        else:
            transport, peer = self.transport_for(record), record.peer() if record is not None else None
        if transport is None or peer is None:
            log.info("no %s for %s: %d chunks not pulled", "node record" if record is None else "usable transport",
                     node, len(parts))
            return parts
        with self._inflight_lock:
            self._inflight[node] = self._inflight.get(node, 0) + len(parts)
        t0, t_start = time.perf_counter(), time.monotonic()
        try:
            result = await transport.pull(peer, self.fp, [p.want for p in parts], self.pool, deadline, silence_s)
        except (LMCacheP2PError, OSError, ValueError, OverflowError) as exc:
            # A transport should report failures in its result; whatever escapes is a miss, never the
            # caller's (the engine's) exception.
            log.warning("pull from %s failed: %s: %s", node, type(exc).__name__, exc)
            self._peer_error(node)
            return parts
        finally:
            with self._inflight_lock:
                self._inflight[node] -= len(parts)
        self._account(transport.name, node, result, time.perf_counter() - t0)
        self._announce(parts, result)
        if result.late is None:
            return [p for p in parts if p.chunk.key not in result.loaded]
        early = set(result.loaded)
        late = result.late
        for part in parts:
            if part.chunk.pieces:
                ident = (part.chunk.key, part.chunk.nonce)
                self._late_pulls[ident] = self._late_pulls.get(ident, 0) + 1
        late.add_done_callback(lambda done: self._arrived_late(transport.name, node, parts, early, done, t0))
        loaded = set(early)
        if not SILENT.isdisjoint(result.missed.values()):
            return [p for p in parts if p.chunk.key not in loaded]  # the owner is not serving: recompute now
        # Bytes stalled for the pull's own allowance or a tenth of its patience (a first byte may take a
        # while; a hung peer then costs at most that much more than recomputing at once would)
        stall_s = max(deadline - t_start, 0.1 * ((patience or deadline) - t_start))
        if patience is not None and await self._wait_while_arriving(result, stall_s, patience):
            loaded |= set(late.result().loaded)
        return [p for p in parts if p.chunk.key not in loaded]

    @staticmethod
    async def _wait_while_arriving(result: PullResult, stall_s: float, patience: float) -> bool:
        """Wait on for ``result``'s late rest while its bytes keep coming, until ``patience``; whether
        the rest arrived. A peer that sent nothing for ``stall_s`` is taken for hung: the load gives up
        on it (its health is settled by the late rest's own end)."""
        assert result.late is not None
        late, stall_s = result.late, max(stall_s, 0.005)
        while not late.done() and remaining(patience) > 0:
            if result.progress_at is not None and time.monotonic() - result.progress_at() > stall_s:
                return False
            await asyncio.wait({late}, timeout=min(remaining(patience), stall_s))
        return late.done() and not late.cancelled() and late.exception() is None

    def _announce(self, parts: list[Part], result: PullResult, skip: Collection[ChunkKey] = ()) -> None:
        if self.on_loaded is not None:
            for part in parts:
                if part.chunk.key in result.loaded and not part.chunk.pieces and part.chunk.key not in skip:
                    self.on_loaded(part.chunk.key)

    def _arrived_late(self, transport: str, node: NodeId, parts: list[Part], early: set[ChunkKey],
                      late: asyncio.Future[PullResult], t0: float) -> None:
        """The rest of a pull past its deadline: what arrived is in the pool (for its load, if it waited, or
        later requests; announced), and the whole pull's time teaches the peer's estimate how slow it was."""
        settle = []  # chunks of pieces whose last late pull this was: off the loop (assembling pins and copies)
        for part in parts:
            ident = (part.chunk.key, part.chunk.nonce)
            if part.chunk.pieces and ident in self._late_pulls:
                self._late_pulls[ident] -= 1
                if not self._late_pulls[ident]:
                    del self._late_pulls[ident]
                    settle.append(part.chunk)
        if settle:
            asyncio.get_running_loop().run_in_executor(None, self._settle_late_pieces, settle)
        if late.cancelled() or late.exception() is not None:
            return
        result = late.result()
        seconds = time.perf_counter() - t0
        arrived = {k: h for k, h in result.loaded.items() if k not in early}
        self.metrics.pull_chunks.labels(transport, "arrived_late").inc(len(arrived))
        self.metrics.pull_bytes.labels(transport).inc(sum(h.length for h in arrived.values()))
        if result.complete:
            self.estimates.observe(node, sum(h.length for h in result.loaded.values()), seconds - result.setup_s)
        if arrived:
            log.info("pull from %s: %d chunks arrived past their deadline, %.1f ms after the pull started (kept, "
                     "announced)", node, len(arrived), 1e3 * seconds)
        if any(r in (MissReason.PEER_ERROR, MissReason.TIMEOUT) for r in result.missed.values()):
            self._peer_error(node)
            log.warning("pull from %s: no answer in %.1f ms; the peer is backed off", node, 1e3 * seconds)
        self._announce(parts, result, skip=early)

    def _settle_late_pieces(self, chunks: list[PlannedChunk]) -> None:
        """Pieces that landed after their load gave up (``chunks``: those whose pulls past the deadline have all
        ended): announced or dropped, never left in the pool unknown. A chunk whose pieces are all there is
        assembled (and announced); the rest go, unless another load is assembling them. A canary's copy (a
        chunk with a nonce) is only dropped: it is what the check doubts."""
        for chunk in chunks:
            keys = [chunk.piece_key(p.heads) for p in chunk.pieces]
            with self._pieces_lock:
                if any(k in self._piece_users for k in keys):
                    continue  # another load's: it assembles and drops them
            if not chunk.nonce and self.assemble(chunk, drop_pieces=False):
                log.info("chunk %s assembled from pieces that arrived late", chunk.key.hex()[:16])
            with self._pieces_lock:
                gone = [k for k in keys if k not in self._piece_users]
            for key in gone:
                self.pool.remove(key)

    def assemble(self, chunk: PlannedChunk, drop_pieces: bool = True) -> bool:
        """Concatenate a chunk's pieces (head ranges pulled from several peers) into one slot under
        the chunk's key; the pieces go either way (``drop_pieces`` False: the caller drops them, when
        no other load still needs them). True if it landed (or another load had assembled it)."""
        pool = self.pool
        keys = [chunk.piece_key(p.heads) for p in chunk.pieces]
        if pool.contains(chunk.key):
            if drop_pieces:
                self._drop_pieces(keys)
            return True
        pins = [pool.pin(k, self.pin_timeout_s) for k in keys]
        try:
            got = [p for p in pins if p is not None]
            if len(got) < len(pins) or not assembly.fit(chunk, got, pool.slot_bytes, self.metrics):
                return False
            reservation = pool.reserve()
            try:
                header = assembly.fill(pool, self.fp, chunk, got, reservation.view, self.metrics)
            except BaseException:
                pool.release(reservation)
                raise
            if header is None:
                pool.release(reservation)
                return False
            if not pool.commit(reservation, header):
                return False
            self.metrics.assembled_chunks.inc()
            if self.on_loaded is not None:
                self.on_loaded(chunk.key)
            return True
        except TierError as exc:
            log.warning("no slot to assemble chunk %s: %s", chunk.key.hex()[:16], exc)
            return False
        finally:
            for pin in pins:
                if pin is not None:
                    pool.unpin(pin)
            if drop_pieces:
                self._drop_pieces(keys)

    def _drop_pieces(self, keys: list[ChunkKey]) -> None:
        """Remove pieces from the pool unless another load holds them for its own assembly."""
        with self._pieces_lock:
            gone = []
            for key in keys:
                users = self._piece_users.get(key, 0) - 1
                if users > 0:
                    self._piece_users[key] = users
                else:
                    self._piece_users.pop(key, None)
                    gone.append(key)
        for key in gone:
            self.pool.remove(key)

    # -- bookkeeping -------------------------------------------------------------------------------
    def live_peers(self, nodes: Mapping[NodeId, PeerRecord]) -> set[PeerAddress]:
        return {a for r in nodes.values() if r.node_id != self.node_id and (a := r.peer()) is not None}

    def prune(self, nodes: Mapping[NodeId, PeerRecord]) -> None:
        """Forget in-flight counts and metric labels of nodes no longer in the index."""
        with self._inflight_lock:
            for node in [n for n, count in self._inflight.items() if count == 0 and n not in nodes]:
                del self._inflight[node]
        for node in [n for n in self._error_peers if n not in nodes]:
            self._error_peers.discard(node)
            with contextlib.suppress(KeyError):
                self.metrics.peer_errors.remove(node)

    def _peer_error(self, node: NodeId) -> None:
        """Count a failed request to ``node``: under its own series while fewer than ``PER_PEER_SERIES`` peers
        have one, else under ``peer="other"`` (bounded series in a large fleet)."""
        if node not in self._error_peers and len(self._error_peers) >= PER_PEER_SERIES:
            self.metrics.peer_errors.labels(OTHER_PEERS).inc()
            return
        self._error_peers.add(node)
        self.metrics.peer_errors.labels(node).inc()

    def _account(self, transport: str, node: NodeId, result: PullResult, seconds: float) -> None:
        m = self.metrics
        m.pull_seconds.labels(transport).observe(seconds)
        nbytes = sum(h.length for h in result.loaded.values())
        m.pull_bytes.labels(transport).inc(nbytes)
        if result.loaded and not result.missed:  # what the next pull over this connection will cost
            self.estimates.observe(node, nbytes, seconds - result.setup_s)
        m.pull_chunks.labels(transport, "loaded").inc(len(result.loaded))
        for reason in result.missed.values():
            m.pull_chunks.labels(transport, str(reason)).inc()
        if result.missed:
            reasons = collections.Counter(str(r) for r in result.missed.values())
            log.info("pull from %s: %d of %d chunks missed (%s) in %.1f ms", node, len(result.missed),
                     len(result.missed) + len(result.loaded), ", ".join(f"{n} {r}" for r, n in reasons.items()),
                     1e3 * seconds)
        if not SILENT.isdisjoint(result.missed.values()):
            m.silent_owner_seconds.labels(transport).observe(seconds)
        m.checksum_failures.inc(sum(1 for r in result.missed.values() if r == MissReason.CHECKSUM))
        if any(r in (MissReason.PEER_ERROR, MissReason.TIMEOUT) for r in result.missed.values()):
            self._peer_error(node)
