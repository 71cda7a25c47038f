"""The pull orchestration (``transfer/pull.py``) as a unit: plan -> pull -> retry -> verify -> assemble ->
metrics, over the loopback transport and the in-memory index, in milliseconds. The same paths run
against real owner processes over TCP and NIXL in test_transfer_peers, test_agent_mesh and test_tp."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from agent_helpers import wait_until
from prometheus_client import CollectorRegistry

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.chunk import make_header
from lmcache_p2p.estimates import PeerEstimates
from lmcache_p2p.ids import NO_ORIGIN, OBJECTS, WIRE_VERSION, NodeDigest, NodeId, PeerAddress, engine_of, origin_of
from lmcache_p2p.index.schema import NodeRecord, Served
from lmcache_p2p.keys import ChunkKey, FingerprintDigest, HeadRange, chunk_keys, piece_key
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.plan import Piece, PlannedChunk, make_plan
from lmcache_p2p.testing.loopback import LoopbackNet, LoopbackTransport
from lmcache_p2p.testing.memory_index import MemoryIndex, MemoryMesh
from lmcache_p2p.tiers.cpu_pool import CpuPool
from lmcache_p2p.transfer.health import PeerHealth
from lmcache_p2p.transfer.pull import Puller

FP = FingerprintDigest(b"\x01" * 16)
HEADS = 4
SLOT = 4096  # bytes per chunk: 1 KiB per head
CHUNK = 256


def payload(key: ChunkKey, heads: HeadRange = (0, HEADS)) -> bytes:
    """The full chunk's bytes for ``key`` (deterministic), or its head range ``heads``."""
    full = np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(SLOT)
    per = SLOT // HEADS
    return full[heads[0] * per : heads[1] * per]


class Mesh:
    """Owner pools on a loopback net, their records in an in-memory index, one requester's Puller."""

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self.net = LoopbackNet()
        self.index_mesh = MemoryMesh()
        self.health = PeerHealth(30.0)
        self.transport = LoopbackTransport(self.net, self.health)
        self.registry = CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        self.pool = CpuPool(16 * SLOT, SLOT)
        self.announced: list[ChunkKey] = []
        self.me = MemoryIndex(self.index_mesh, self.record("me", 1))
        self.estimates = PeerEstimates()
        self.puller = Puller(NodeId("me"), FP, self.pool, {"loopback": self.transport}, ["loopback"], self.health,
                             self.me.nodes, self.metrics, self.estimates, loop, on_loaded=self.announced.append)
        self.owners: dict[str, MemoryIndex] = {}
        self.pools: dict[str, CpuPool] = {}

    def record(self, node: str, port: int, heads: HeadRange = (0, HEADS), **fields: object) -> NodeRecord:
        base: dict[str, object] = {"node_id": NodeId(node), "addresses": {"loopback": f"127.0.0.1:{port}"},
                                   "transports": ("loopback",), "served": {FP.hex(): Served(heads=(*heads, HEADS))}}
        return NodeRecord(**{**base, **fields})  # type: ignore[arg-type]

    def owner(self, node: str, keys: list[ChunkKey], heads: HeadRange = (0, HEADS), tier: int = 1,
              origin: NodeDigest = NO_ORIGIN) -> PeerAddress:
        port = 7000 + len(self.owners)
        pool = self.pools[node] = CpuPool(16 * SLOT, SLOT)
        for key in keys:
            data = payload(key, heads)
            pool.put(make_header(key, FP, data, CHUNK, heads=heads, origin=origin), memoryview(data))
        peer = PeerAddress("127.0.0.1", port, node)
        self.net.add(peer, pool)
        index = self.owners[node] = MemoryIndex(self.index_mesh, self.record(node, port, heads))
        index.add_many(FP, keys, tier)
        return peer

    def plan(self, keys: list[ChunkKey]) -> list[PlannedChunk]:
        spans = [(i * CHUNK, (i + 1) * CHUNK) for i in range(len(keys))]
        nodes = self.me.nodes()
        p = make_plan(keys, spans, local=self.pool.contains,
                      owners=lambda ks: [{n: t for n, t in o.items() if n != "me"} for o in self.me.owners(FP, ks)],
                      usable=lambda n: self.puller.usable(nodes.get(n)), inflight=self.puller.inflight(),
                      num_tokens=len(keys) * CHUNK, need=(0, HEADS),
                      heads_of=lambda n: nodes[n].heads_of(FP.hex(), HEADS))
        return list(p.chunks)

    def held(self, key: ChunkKey) -> bytes | None:
        pin = self.pool.pin(key, 1.0)
        if pin is None:
            return None
        try:
            return bytes(self.pool.slot_view(pin.slot, pin.header.length))
        finally:
            self.pool.unpin(pin)

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(f"lmcache_p2p_{name}", labels) or 0.0


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    with LoopThread("test-pull") as loop:
        yield loop


@pytest.fixture
def mesh(loop: LoopThread) -> Mesh:
    return Mesh(loop)


KEYS = chunk_keys(FP, list(range(4 * CHUNK)), CHUNK)


def test_planned_chunks_arrive_verified_and_are_announced(mesh: Mesh) -> None:
    mesh.owner("a", KEYS)
    chunks = mesh.plan(KEYS)
    assert [c.source for c in chunks] == ["a"] * 4
    mesh.puller.pull(chunks, time.monotonic() + 2.0)
    assert all(mesh.held(k) == payload(k) for k in KEYS)
    assert mesh.announced == KEYS  # each published as it landed
    assert mesh.value("pull_chunks_total", transport="loopback", outcome="loaded") == 4
    assert mesh.value("pull_bytes_total", transport="loopback") == 4 * SLOT
    assert mesh.puller.inflight() == {} and mesh.puller.estimates.known(NodeId("a"))


def test_a_dead_owner_is_retried_on_the_alternative_and_backed_off(mesh: Mesh) -> None:
    dead = mesh.owner("a", KEYS)
    mesh.owner("b", KEYS, tier=2)
    mesh.net.owner(dead).fault = "dead"
    chunks = mesh.plan(KEYS)  # spread over both owners, each the other's alternative
    from_a = [c for c in chunks if c.source == "a"]
    assert from_a and all(c.alternatives == ("b",) for c in from_a)
    mesh.puller.pull(chunks, time.monotonic() + 2.0)
    assert all(mesh.held(k) == payload(k) for k in KEYS)  # a's share from b, on the retry
    assert mesh.value("pull_chunks_total", transport="loopback", outcome="peer_error") == len(from_a)
    assert mesh.value("peer_errors_total", peer="a") == 1
    assert not mesh.puller.usable(mesh.me.nodes()[NodeId("a")])  # backed off: not planned next time
    more = chunk_keys(FP, list(range(6 * CHUNK)), CHUNK)[4:]
    mesh.owners["a"].add_many(FP, more, 1)
    mesh.owners["b"].add_many(FP, more, 2)
    assert [c.source for c in mesh.plan([*KEYS, *more])[4:]] == ["b", "b"]  # a is backed off: not planned


def test_a_hung_owner_costs_the_deadline_not_more(mesh: Mesh) -> None:
    hung = mesh.owner("a", KEYS)
    mesh.net.owner(hung).fault = "hang"
    t0 = time.monotonic()
    mesh.puller.pull(mesh.plan(KEYS), time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 1.0
    assert not any(mesh.pool.contains(k) for k in KEYS)
    assert mesh.value("pull_chunks_total", transport="loopback", outcome="timeout") == 4
    assert mesh.puller.inflight() == {}


def test_the_first_contacts_connection_cost_stays_out_of_the_peers_estimate(mesh: Mesh) -> None:
    """A first pull also connects and handshakes (once per connection): taken for the peer's bandwidth, one
    slow handshake would make every later pull look slower than recomputing, and the planner would stop
    asking a healthy peer."""
    slow_start = mesh.owner("a", KEYS)
    mesh.net.owner(slow_start).connect_s = 0.3
    t0 = time.monotonic()
    mesh.puller.pull(mesh.plan(KEYS[:2]), time.monotonic() + 2.0)
    assert time.monotonic() - t0 >= 0.3 and all(mesh.pool.contains(k) for k in KEYS[:2])
    assert mesh.estimates.known("a")
    assert mesh.estimates.expected_s("a", 2 * SLOT) < 0.05  # what a pull over the open connection costs
    mesh.puller.pull(mesh.plan(KEYS[2:]), time.monotonic() + 2.0)  # the connection is open now: no setup
    assert all(mesh.pool.contains(k) for k in KEYS[2:])
    assert mesh.estimates.expected_s("a", 2 * SLOT) < 0.05
    assert mesh.value("pull_seconds_sum", transport="loopback") >= 0.3  # the pull's own time still counts it


def test_corrupt_bytes_are_dropped_then_fetched_from_the_alternative(mesh: Mesh) -> None:
    liar = mesh.owner("a", KEYS[:1])
    mesh.owner("b", KEYS[:1])
    mesh.net.owner(liar).fault = "corrupt"
    [chunk] = mesh.plan(KEYS[:1])
    chunk = type(chunk)(chunk.index, chunk.key, chunk.start, chunk.end, NodeId("a"), (NodeId("b"),), chunk.heads)
    mesh.puller.pull([chunk], time.monotonic() + 2.0)
    assert mesh.held(KEYS[0]) == payload(KEYS[0])
    assert mesh.value("checksum_failures_total") == 1
    assert mesh.value("pull_chunks_total", transport="loopback", outcome="checksum") == 1


def test_a_corrupt_owner_without_alternative_leaves_nothing(mesh: Mesh) -> None:
    liar = mesh.owner("a", KEYS)
    mesh.net.owner(liar).fault = "corrupt"
    mesh.puller.pull(mesh.plan(KEYS), time.monotonic() + 2.0)
    assert not any(mesh.pool.contains(k) for k in KEYS) and mesh.announced == []
    assert mesh.value("checksum_failures_total") == 4


def test_pieces_from_two_ranks_are_assembled_into_the_chunk(mesh: Mesh) -> None:
    mesh.owner("r0", KEYS, heads=(0, 1))
    mesh.owner("r1", KEYS, heads=(1, HEADS))
    chunks = mesh.plan(KEYS)
    assert all([p.source for p in c.pieces] == ["r0", "r1"] for c in chunks)
    mesh.puller.pull(chunks, time.monotonic() + 2.0)
    for key in KEYS:
        assert mesh.held(key) == payload(key)
        assert mesh.pool.header(key).heads == (0, HEADS)  # type: ignore[union-attr]
        assert not mesh.pool.contains(piece_key(key, (0, 1))) and not mesh.pool.contains(piece_key(key, (1, HEADS)))
    assert mesh.value("assembled_chunks_total") == 4 and mesh.announced == KEYS


def test_pieces_keep_their_engines_origin_and_pieces_of_two_engines_are_never_assembled(mesh: Mesh) -> None:
    """The ranks of one engine share its origin, and the chunk assembled from them keeps it; pieces two
    engines computed would make a chunk nobody computed: not assembled (recomputed), counted, no piece left."""
    mesh.owner("e-r0", KEYS[:2], heads=(0, 2), origin=origin_of("e-r0"))
    mesh.owner("e-r1", KEYS[:2], heads=(2, HEADS), origin=origin_of("e-r1"))
    mesh.owner("a-r0", KEYS[2:], heads=(0, 2), origin=origin_of("a-r0"))
    mesh.owner("b-r1", KEYS[2:], heads=(2, HEADS), origin=origin_of("b-r1"))
    chunks = mesh.plan(KEYS)
    mesh.puller.pull(chunks, time.monotonic() + 2.0)
    for key in KEYS[:2]:
        assert mesh.held(key) == payload(key) and mesh.pool.header(key).origin == origin_of("e")  # type: ignore[union-attr]
    assert not mesh.pool.contains(KEYS[2]) and not mesh.pool.contains(KEYS[3]) and len(mesh.pool) == 2
    assert mesh.value("assembled_chunks_total") == 2 and mesh.value("mixed_origin_chunks_total") == 2
    assert mesh.announced == KEYS[:2]


def test_the_planner_takes_a_chunks_pieces_from_one_engine_when_it_can(mesh: Mesh) -> None:
    """Two engines hold every head in halves: each chunk's second piece comes from its first piece's engine
    even where the other engine's rank is less loaded."""
    for engine in ("a", "b"):
        mesh.owner(f"{engine}-r0", KEYS, heads=(0, 2), origin=origin_of(engine))
        mesh.owner(f"{engine}-r1", KEYS, heads=(2, HEADS), origin=origin_of(engine))
    chunks = mesh.plan(KEYS)
    assert all(len({engine_of(p.source) for p in c.pieces}) == 1 for c in chunks), chunks
    assert {engine_of(c.pieces[0].source) for c in chunks} == {"a", "b"}  # load still spreads the chunks
    mesh.puller.pull(chunks, time.monotonic() + 2.0)
    assert all(mesh.held(key) == payload(key) for key in KEYS) and mesh.value("mixed_origin_chunks_total") == 0


def test_copies_pulled_with_their_own_nonces_land_apart(mesh: Mesh, loop: LoopThread) -> None:
    """The canary pulls each owner's copy of one chunk aside, under a key with a nonce of its own: a copy
    that lands late (an overdue pull of another owner's) never lands under the key read for this one."""
    key = KEYS[0]
    mesh.owner("a", [key])
    mesh.owner("b", [key])
    other = bytes(b ^ 0x5A for b in payload(key))
    mesh.pools["b"].remove(key)
    mesh.pools["b"].put(make_header(key, FP, other, CHUNK, heads=(0, HEADS)), memoryview(other))
    copies = [PlannedChunk(0, key, 0, CHUNK, NodeId(o), heads=(0, HEADS), pieces=(Piece(NodeId(o), (0, HEADS)),),
                           nonce=nonce) for o, nonce in (("a", b"check-1"), ("b", b"check-2"))]
    for c in copies:
        assert loop.run(mesh.puller.pull_from(c.source, [c], time.monotonic() + 2.0), 5) == []
    held = [mesh.held(c.piece_key((0, HEADS))) for c in copies]
    assert held == [payload(key), other] and copies[0].piece_key((0, HEADS)) != copies[1].piece_key((0, HEADS))
    assert not mesh.pool.contains(piece_key(key, (0, HEADS)))  # nothing under the nonce-less key


def test_pieces_that_land_after_their_load_gave_up_are_assembled_or_dropped(mesh: Mesh, loop: LoopThread) -> None:
    """A rank that answers past the load's deadline: its pieces land later, when the load has dropped the
    pieces that came in time; they are dropped too, never left in the pool unannounced. When every piece of a
    chunk lands late it is assembled and announced. A canary's copy (a nonce) landing late is only dropped."""
    mesh.owner("e-r0", KEYS[:2], heads=(0, 2))
    late = mesh.owner("e-r1", KEYS[:2], heads=(2, HEADS))
    mesh.net.owner(late).late_s = 0.1
    mesh.puller.pull(mesh.plan(KEYS[:2]), time.monotonic() + 0.1)
    assert not any(mesh.pool.contains(k) for k in KEYS[:2])  # recomputed

    def arrived_late() -> float:
        return mesh.value("pull_chunks_total", transport="loopback", outcome="arrived_late")

    assert wait_until(lambda: arrived_late() == 2 and len(mesh.pool) == 0, 5.0)
    time.sleep(0.1)
    assert len(mesh.pool) == 0 and mesh.announced == []
    for owner, heads, late_s in (("f-r0", (0, 2), 0.1), ("f-r1", (2, HEADS), 0.4)):  # every piece late, one
        mesh.net.owner(mesh.owner(owner, KEYS[2:], heads=heads)).late_s = late_s  # later still: assembled once in
    chunks = mesh.plan(KEYS[2:])
    assert all({p.source for p in c.pieces} == {"f-r0", "f-r1"} for c in chunks), chunks
    mesh.puller.pull(chunks, time.monotonic() + 0.1)
    assert wait_until(lambda: all(mesh.pool.contains(k) for k in KEYS[2:]), 5.0)
    assert wait_until(lambda: len(mesh.pool) == 2, 5.0)  # the pieces gone
    assert all(mesh.held(k) == payload(k) for k in KEYS[2:]) and mesh.announced == KEYS[2:]
    mesh.net.owner(mesh.owner("g", [KEYS[0]], heads=(0, 2))).late_s = 0.1
    copy = PlannedChunk(0, KEYS[0], 0, CHUNK, NodeId("g"), heads=(0, 2), pieces=(Piece(NodeId("g"), (0, 2)),),
                        nonce=b"check")
    assert loop.run(mesh.puller.pull_from(NodeId("g"), [copy], time.monotonic() + 0.1), 5) == [copy]
    assert wait_until(lambda: arrived_late() == 7, 5.0)
    time.sleep(0.1)
    assert len(mesh.pool) == 2 and not mesh.pool.contains(KEYS[0])  # the late copy: dropped, not assembled


def test_a_piece_changed_in_memory_after_it_landed_is_not_assembled(mesh: Mesh, loop: LoopThread) -> None:
    """A piece slot written after commit (a peer's NIXL WRITE into the pool, a stray write): the
    assembled chunk would get a fresh checksum over the changed bytes, so the copy is checked first."""
    mesh.owner("r0", KEYS, heads=(0, 1))
    mesh.owner("r1", KEYS, heads=(1, HEADS))
    chunks = mesh.plan(KEYS)
    loop.run(mesh.puller.pull_all(chunks, time.monotonic() + 2.0), 5)  # the pieces land, verified on arrival
    pin = mesh.pool.pin(piece_key(KEYS[1], (1, HEADS)), 1.0)
    assert pin is not None
    mesh.pool.slot_view(pin.slot, pin.header.length)[pin.header.length // 2] ^= 0x01
    mesh.pool.unpin(pin)
    assert [mesh.puller.assemble(c) for c in chunks] == [True, False, True, True]
    assert not mesh.pool.contains(KEYS[1]) and KEYS[1] not in mesh.announced
    assert all(mesh.held(k) == payload(k) for k in (KEYS[0], KEYS[2], KEYS[3]))
    assert len(mesh.pool) == 3 and mesh.pool.free_slots == mesh.pool.num_slots - 3  # no piece, no slot left
    assert mesh.value("checksum_failures_total") == 1 and mesh.value("assembled_chunks_total") == 3


def test_a_missing_piece_means_no_chunk_and_no_leftover_pieces(mesh: Mesh) -> None:
    mesh.owner("r0", KEYS, heads=(0, 2))
    r1 = mesh.owner("r1", KEYS, heads=(2, HEADS))
    chunks = mesh.plan(KEYS)
    mesh.net.owner(r1).fault = "dead"  # dies between the plan and the pull
    mesh.puller.pull(chunks, time.monotonic() + 2.0)
    for key in KEYS:
        assert not mesh.pool.contains(key)
        assert not mesh.pool.contains(piece_key(key, (0, 2)))  # the piece that came is not kept
    assert mesh.value("assembled_chunks_total") == 0 and len(mesh.pool) == 0


def test_only_peers_with_our_wire_tls_and_a_common_transport_are_usable(mesh: Mesh) -> None:
    ok = mesh.record("x", 7100)
    assert mesh.puller.usable(ok)
    assert not mesh.puller.usable(mesh.record("x", 7100, wire_version=WIRE_VERSION + 1))
    assert not mesh.puller.usable(mesh.record("x", 7100, tls=True))
    assert not mesh.puller.usable(mesh.record("x", 7100, transports=("nixl",), addresses={"nixl": "h:1"}))
    assert not mesh.puller.usable(mesh.record("x", 7100, addresses={"loopback": "no-port"}))
    assert not mesh.puller.usable(None)


def test_a_chunk_planned_from_an_owner_that_left_the_index_is_a_miss(mesh: Mesh) -> None:
    mesh.owner("a", KEYS)
    chunks = mesh.plan(KEYS)
    mesh.index_mesh.expire(NodeId("a"))  # lease gone between plan and pull
    mesh.puller.pull(chunks, time.monotonic() + 2.0)
    assert not any(mesh.pool.contains(k) for k in KEYS) and not mesh.transport.pulls


def test_prune_forgets_the_labels_and_counts_of_departed_peers(mesh: Mesh) -> None:
    dead = mesh.owner("a", KEYS)
    mesh.net.owner(dead).fault = "dead"
    mesh.puller.pull(mesh.plan(KEYS), time.monotonic() + 2.0)
    assert mesh.value("peer_errors_total", peer="a") == 1
    mesh.index_mesh.expire(NodeId("a"))
    nodes = mesh.me.nodes()
    assert mesh.puller.live_peers(nodes) == set()
    mesh.puller.prune(nodes)
    assert mesh.registry.get_sample_value("lmcache_p2p_peer_errors_total", {"peer": "a"}) is None


def test_whole_chunks_from_one_peer_for_a_hand_off(mesh: Mesh, loop: LoopThread) -> None:
    mesh.owner("a", KEYS[:2])
    absent = PlannedChunk(2, KEYS[2], 2 * CHUNK, 3 * CHUNK, NodeId("a"), heads=(0, HEADS))
    missed = loop.run(mesh.puller.pull_from(NodeId("a"), [*mesh.plan(KEYS[:2]), absent], time.monotonic() + 2), 5)
    assert missed == [absent] and all(mesh.held(k) == payload(k) for k in KEYS[:2])
    assert mesh.value("pull_chunks_total", transport="loopback", outcome="absent") == 1


def test_nothing_is_asked_once_the_deadline_has_passed(mesh: Mesh) -> None:
    # a pull started that late would only time out and back a healthy owner off
    mesh.owner("a", KEYS)
    mesh.puller.pull(mesh.plan(KEYS), time.monotonic() - 0.001)
    assert mesh.transport.pulls == [] and not any(mesh.pool.contains(k) for k in KEYS)
    assert mesh.value("pull_chunks_total", transport="none", outcome="expired") == len(KEYS)  # counted, not lost
    mesh.puller.pull(mesh.plan(KEYS), time.monotonic() + 2.0)
    assert all(mesh.pool.contains(k) for k in KEYS)  # the owner was not backed off


def test_concurrent_loads_of_the_same_chunks_pull_each_once(mesh: Mesh) -> None:
    """Requests sharing a prefix arrive together: the second load waits for the first one's pull of the
    shared chunks instead of asking the owner again, and pulls only what it alone needs."""
    more = chunk_keys(FP, list(range(6 * CHUNK)), CHUNK)
    owner = mesh.owner("a", more)
    mesh.net.owner(owner).delay_s = 0.2  # the first pull is still on the wire when the second load plans
    first, second = mesh.plan(more[:4]), mesh.plan(more)
    deadline = time.monotonic() + 3.0
    waits = [threading.Thread(target=mesh.puller.pull, args=(first, deadline))]
    waits[0].start()
    time.sleep(0.05)
    mesh.puller.pull(second, deadline)
    waits[0].join()
    assert all(mesh.held(k) == payload(k) for k in more)
    assert mesh.net.owner(owner).served == 6  # not 4 + 6
    assert mesh.transport.pulls == [(owner, 4), (owner, 2)]
    assert mesh.value("pull_coalesced_total") == 4


def test_a_load_waiting_on_another_loads_pull_keeps_its_own_deadline(mesh: Mesh) -> None:
    owner = mesh.owner("a", KEYS)
    mesh.net.owner(owner).delay_s = 1.5
    slow = threading.Thread(target=mesh.puller.pull, args=(mesh.plan(KEYS), time.monotonic() + 3.0))
    slow.start()
    assert wait_until(lambda: len(mesh.puller._landing) == len(KEYS), 5.0)  # the first load's pull is under way
    t0 = time.monotonic()
    mesh.puller.pull(mesh.plan(KEYS), time.monotonic() + 0.1)  # gives up on the shared pull at its deadline
    assert time.monotonic() - t0 < 1.0  # the shared pull takes 1.5 s
    slow.join()
    assert all(mesh.held(k) == payload(k) for k in KEYS)  # the first load's pull landed them all
    assert mesh.net.owner(owner).served == 4


def test_a_shared_pull_that_fails_fails_every_load_waiting_on_it(mesh: Mesh) -> None:
    owner = mesh.owner("a", KEYS)
    mesh.net.owner(owner).fault = "hang"
    # One deadline for both: a load with time left after the shared pull failed asks again (the next test), and
    # planning the second load beside a CPU hog took long enough to leave it some
    deadline = time.monotonic() + 0.3
    loads = [threading.Thread(target=mesh.puller.pull, args=(mesh.plan(KEYS), deadline)) for _ in range(2)]
    for t in loads:
        t.start()
        time.sleep(0.02)
    for t in loads:
        t.join()
    assert not any(mesh.pool.contains(k) for k in KEYS)
    assert len(mesh.transport.pulls) == 1  # one pull asked the owner, the other load waited on it
    assert mesh.puller._landing == {}  # nothing left behind


def test_a_load_with_time_left_pulls_itself_what_a_shorter_shared_pull_missed(mesh: Mesh) -> None:
    owner = mesh.owner("a", KEYS)
    mesh.net.owner(owner).delay_s = 0.3  # longer than the first load's deadline, shorter than the second's
    short = threading.Thread(target=mesh.puller.pull, args=(mesh.plan(KEYS), time.monotonic() + 0.15))
    short.start()
    time.sleep(0.05)
    mesh.puller.pull(mesh.plan(KEYS), time.monotonic() + 3.0)
    short.join()
    assert all(mesh.held(k) == payload(k) for k in KEYS)


def test_two_loads_sharing_pieces_both_get_the_chunk_and_leave_no_pieces(mesh: Mesh) -> None:
    """Two loads of a chunk assembled from two ranks' pieces, the second joining the first's pulls: the
    first to assemble must not drop pieces the second still needs; the last one drops them."""
    r0 = mesh.owner("r0", KEYS, heads=(0, 1))
    mesh.owner("r1", KEYS, heads=(1, HEADS))
    mesh.net.owner(r0).delay_s = 1.0
    deadline = time.monotonic() + 5.0
    first = threading.Thread(target=mesh.puller.pull, args=(mesh.plan(KEYS), deadline))
    first.start()
    assert wait_until(lambda: len(mesh.puller._landing) >= len(KEYS), 5.0)  # r0's pieces' pulls under way
    mesh.puller.pull(mesh.plan(KEYS), deadline)
    first.join()
    for key in KEYS:
        assert mesh.held(key) == payload(key)
        assert not mesh.pool.contains(piece_key(key, (0, 1))) and not mesh.pool.contains(piece_key(key, (1, HEADS)))
    assert mesh.net.owner(r0).served == 4 and mesh.puller._piece_users == {}


def test_a_chunk_two_peers_fail_to_send_comes_from_a_source_without_a_node_record(mesh: Mesh) -> None:
    """The object store is one more owner behind its own transport (``sources``, no node record): a part
    that missed on its source is tried on each alternative in turn, the store last, within one deadline;
    the store's failures back it off by the same rule as a peer's."""
    store_net, store_health = LoopbackNet(), PeerHealth(30.0)
    store = LoopbackTransport(store_net, store_health, name="objects")
    address = PeerAddress("127.0.0.1", 9000, OBJECTS)
    bucket = CpuPool(16 * SLOT, SLOT)
    for key in KEYS:
        bucket.put(make_header(key, FP, payload(key), CHUNK, heads=(0, HEADS)), memoryview(payload(key)))
    held = store_net.add(address, bucket)
    puller = Puller(NodeId("me"), FP, mesh.pool, {"loopback": mesh.transport}, ["loopback"], mesh.health,
                    mesh.me.nodes, mesh.metrics, mesh.estimates, mesh.loop, on_loaded=mesh.announced.append,
                    sources={OBJECTS: (store, address)})
    dead = mesh.owner("a", KEYS)
    mesh.net.owner(dead).fault = "dead"
    mesh.owner("b", [])  # listed as an alternative, holds none of them
    plan = [PlannedChunk(i, k, i * CHUNK, (i + 1) * CHUNK, NodeId("a"), alternatives=(NodeId("b"), OBJECTS),
                         heads=(0, HEADS)) for i, k in enumerate(KEYS)]
    puller.pull(plan, time.monotonic() + 3.0)
    assert all(mesh.held(k) == payload(k) for k in KEYS)
    assert sorted(mesh.announced) == sorted(KEYS)
    assert len(store.pulls) == 1 and mesh.estimates.known(OBJECTS)  # one read of them all, measured
    for k in KEYS:
        mesh.pool.remove(k)
    held.fault = "dead"  # the store fails: backed off like a peer, then not asked at all
    puller.pull(plan, time.monotonic() + 1.0)
    assert not any(mesh.pool.contains(k) for k in KEYS) and not store_health.available(address)
    puller.pull(plan, time.monotonic() + 1.0)
    assert mesh.value("pull_chunks_total", transport="objects", outcome="backoff") == len(KEYS)
