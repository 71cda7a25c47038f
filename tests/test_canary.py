"""The canary's parts: the KV distance, the verdicts and quarantines of one check, and the
quarantine records over a real etcd (written, followed, malformed ones skipped, released). The
whole path with real vLLM engines is ``test_vllm_canary.py``."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from agent_helpers import wait_until

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.canary import Canary, Copy, kv_distance, tolerance_for
from lmcache_p2p.ids import NO_ORIGIN, NodeDigest, NodeId, origin_of
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.quarantine import Quarantine, QuarantineRecord, prefix, read_all, release, write
from lmcache_p2p.index.schema import Rejects, Schema
from lmcache_p2p.keys import ChunkKey, HeadRange
from lmcache_p2p.plan import PlannedChunk


def _kv(seed: int, n: int = 4096, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _bytes(t: torch.Tensor) -> bytes:
    return t.view(torch.uint8).numpy().tobytes()


def test_distance_tells_rounding_from_other_weights() -> None:
    a = _kv(1)
    assert kv_distance(_bytes(a), _bytes(a), "bfloat16") == 0.0
    rounded = (a.float() * (1 + 1e-3 * torch.randn(a.shape, generator=torch.Generator().manual_seed(2)))).bfloat16()
    assert kv_distance(_bytes(a), _bytes(rounded), "bfloat16") < tolerance_for("bfloat16")
    assert kv_distance(_bytes(a), _bytes(_kv(3)), "bfloat16") > 1.0  # another model's KV
    assert kv_distance(_bytes(a), _bytes(a)[:-2], "bfloat16") == float("inf")
    nan = a.clone()
    nan[7] = float("nan")
    assert kv_distance(_bytes(a), _bytes(nan), "bfloat16") == float("inf")
    assert kv_distance(_bytes(nan), _bytes(nan), "bfloat16") == 0.0  # bit-identical, NaN or not
    f32 = _kv(4, dtype=torch.float32)
    assert kv_distance(_bytes(f32), _bytes(f32 + 1e-2), "float32") > tolerance_for("float32")


class _Node:
    """The canary's view of an agent: owners with fixed copies (unit test of the verdicts only)."""

    node_id = NodeId("me")
    heads: HeadRange = (0, 2)

    def __init__(self, copies: dict[NodeId, bytes | None], held: bytes | None = None,
                 origins: dict[NodeId, NodeDigest] | None = None) -> None:
        self.copies = copies
        self.origins = origins or {}  # the origin in each holder's copy (default: the holder computed it)
        self.held = held  # this node's own copy of the key, if any
        self.replaced: list[ChunkKey] = []
        self.quarantined: list[QuarantineRecord] = []
        self.asked: list[tuple[NodeId, PlannedChunk]] = []

    def owners_of(self, key: ChunkKey) -> list[NodeId]:
        return [self.node_id, *self.copies]

    def fetch_copy(self, owner: NodeId, chunk: PlannedChunk, deadline: float) -> Copy | None:
        self.asked.append((owner, chunk))
        assert deadline > time.monotonic()
        payload = self.copies[owner]
        return None if payload is None else Copy(payload, self.origins.get(owner, origin_of(owner)))

    def quarantine_owner(self, record: QuarantineRecord) -> None:
        self.quarantined.append(record)

    def replace_if_differs(self, key: ChunkKey, num_tokens: int, reference: bytes,
                           differs: Callable[[bytes, bytes], bool]) -> None:
        if self.held is not None and differs(reference, self.held):
            self.replaced.append(key)


def test_one_check_quarantines_the_wrong_owner_and_only_it() -> None:
    reference = _bytes(_kv(1))
    node = _Node({NodeId("good"): reference, NodeId("bad"): _bytes(_kv(9)), NodeId("gone"): None})
    counted: list[str] = []
    key = ChunkKey(b"k" * 16)
    verdicts = Canary(node, "bfloat16", count=counted.append).check([(key, 0, 256, reference)])
    assert {v.owner: v.outcome for v in verdicts} == {"good": "match", "bad": "mismatch", "gone": "unavailable"}
    assert sorted(counted) == ["match", "mismatch", "unavailable"]
    assert [(r.node, r.by, r.key) for r in node.quarantined] == [("bad", "me", key.hex())]
    assert node.quarantined[0].distance > 1.0
    assert node.replaced == []  # it held no copy
    # Never asks itself; asks each owner for this node's heads, as a one-piece plan.
    assert [o for o, _ in node.asked] == ["good", "bad", "gone"]
    assert all(c.pieces and c.pieces[0].heads == (0, 2) and c.key == key for _, c in node.asked)


def test_a_relay_of_a_wrong_copy_is_spared_when_its_origin_serves_it_wrong_too() -> None:
    """``puller`` pulled ``bad``'s chunk (its header names ``bad``), and ``bad``'s own copy is wrong in the
    same check: ``bad`` is the culprit, once; the relay is not quarantined (it drops ``bad``'s chunks when the
    record lands). The ranks of one tensor-parallel engine share its origin: ``tp-r1`` pulled from ``tp-r0``."""
    reference, wrong = _bytes(_kv(1)), _bytes(_kv(9))
    key = ChunkKey(b"k" * 16)
    node = _Node({NodeId("good"): reference, NodeId("bad"): wrong, NodeId("puller"): wrong,
                  NodeId("tp-r0"): wrong, NodeId("cache"): wrong},
                 origins={NodeId("puller"): origin_of("bad"), NodeId("cache"): origin_of("tp-r1")})
    verdicts = Canary(node, "bfloat16", max_owners=5).check([(key, 0, 256, reference)])
    assert {v.owner: (v.outcome, v.quarantined) for v in verdicts} == {
        "good": ("match", None), "bad": ("mismatch", "bad"), "puller": ("mismatch", "bad"),
        "tp-r0": ("mismatch", "tp-r0"), "cache": ("mismatch", "tp-r0")}
    assert [r.node for r in node.quarantined] == ["bad", "tp-r0"]
    assert origin_of("tp-r0") == origin_of("tp-r1") == origin_of("tp") != origin_of("tp-r")


def test_the_holder_answers_for_a_wrong_copy_whatever_origin_it_claims() -> None:
    """The origin is written by whoever serves the copy: a holder serving wrong KV under a zero origin, under
    an innocent node's (one right in this check, this node, or one gone from the mesh) or under one that
    serves nothing here is the one quarantined, never the node its header names."""
    reference, wrong = _bytes(_kv(1)), _bytes(_kv(9))
    key = ChunkKey(b"k" * 16)
    for origin in (NO_ORIGIN, origin_of("good"), origin_of("me"), origin_of("gone-node"), origin_of("elsewhere")):
        node = _Node({NodeId("good"): reference, NodeId("liar"): wrong}, origins={NodeId("liar"): origin})
        verdicts = Canary(node, "bfloat16").check([(key, 0, 256, reference)])
        assert {v.owner: (v.outcome, v.quarantined) for v in verdicts} == {
            "good": ("match", None), "liar": ("mismatch", "liar")}, origin
        assert [r.node for r in node.quarantined] == ["liar"]
    # An owner whose own copy is right is never named by another's wrong copy claiming its origin.
    node = _Node({NodeId("honest"): reference, NodeId("liar"): wrong},
                 origins={NodeId("honest"): origin_of("elsewhere"), NodeId("liar"): origin_of("honest")})
    verdicts = Canary(node, "bfloat16").check([(key, 0, 256, reference)])
    assert {v.owner: v.quarantined for v in verdicts} == {"honest": None, "liar": "liar"}


def test_one_computation_against_one_copy_quarantines_nobody() -> None:
    """This node may be the one running other weights: a mismatch no other owner corroborates is
    counted and logged, never a quarantine (else a wrong checker would quarantine every healthy owner)."""
    reference = _bytes(_kv(1))
    key = ChunkKey(b"k" * 16)
    for copies in ({NodeId("other"): _bytes(_kv(9))},
                   {NodeId("x"): _bytes(_kv(8)), NodeId("y"): _bytes(_kv(9)), NodeId("gone"): None}):
        node = _Node(copies)
        verdicts = Canary(node, "bfloat16").check([(key, 0, 256, reference)])
        assert {v.outcome for v in verdicts} <= {"unconfirmed", "unavailable"} and node.quarantined == []


def test_a_held_copy_that_differs_from_the_computed_kv_is_replaced() -> None:
    reference = _bytes(_kv(1))
    key = ChunkKey(b"k" * 16)
    node = _Node({}, held=_bytes(_kv(9)))
    Canary(node, "bfloat16").check([(key, 0, 256, reference)])
    assert node.replaced == [key]
    same = _Node({}, held=reference)
    Canary(same, "bfloat16").check([(key, 0, 256, reference)])
    assert same.replaced == []


def test_max_owners_bounds_the_pulls() -> None:
    reference = _bytes(_kv(1))
    node = _Node({NodeId(f"o{i}"): reference for i in range(6)})
    assert len(Canary(node, "bfloat16", max_owners=2).check([(ChunkKey(b"k" * 16), 0, 256, reference)])) == 2


def test_quarantine_records_are_followed_validated_and_released(etcd, cluster_name: str, loop: LoopThread) -> None:
    from conftest import agent_config

    config = agent_config("tool", cluster_name, etcd.endpoints)
    schema = Schema(cluster_name)
    client = EtcdClient(config.etcd)
    rejects = Rejects()
    loop.run(client.connect(), 10.0)
    follower = Quarantine(client, schema, rejects)
    try:
        assert loop.run(follower.start(5.0), 10.0) and follower.records() == []
        record = QuarantineRecord(NodeId("engine-f"), "engine-b", "ab" * 16, 1.4)
        loop.run(write(client, schema, record), 10.0)
        loop.run(client.put(prefix(schema) + b"junk", b"\xc1not msgpack"), 10.0)
        deadline = time.monotonic() + 10.0
        while not (follower.blocked("engine-f") and rejects.counts.get("quarantine", 0)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)  # the record, then the junk (a later revision): both seen by the follower
        assert follower.blocked("engine-f") and not follower.blocked("engine-a")
        assert [r.node for r in loop.run(read_all(client, schema), 10.0)] == ["engine-f"]  # junk skipped
        assert rejects.counts["quarantine"] == 1  # the junk, counted once
        assert loop.run(release(client, schema, "engine-f"), 10.0)
        assert not loop.run(release(client, schema, "engine-f"), 10.0)
        deadline = time.monotonic() + 10.0
        while follower.blocked("engine-f") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not follower.blocked("engine-f")
    finally:
        loop.run(follower.stop(), 10.0)
        loop.run(client.close(), 10.0)


def test_a_quarantine_lapses_unless_a_new_mismatch_renews_it(etcd, cluster_name: str, loop: LoopThread) -> None:
    from conftest import agent_config

    config = agent_config("tool", cluster_name, etcd.endpoints)
    schema = Schema(cluster_name)
    client = EtcdClient(config.etcd)
    loop.run(client.connect(), 10.0)
    writer, follower = Quarantine(client, schema), Quarantine(client, schema)
    try:
        assert loop.run(follower.start(5.0), 10.0)
        record = QuarantineRecord(NodeId("engine-f"), "engine-b", "ab" * 16, 1.4)
        loop.run(writer.add(record, ttl_s=3), 10.0)
        assert wait_until(lambda: follower.blocked("engine-f"), 10.0)
        first = writer.leases[NodeId("engine-f")]
        time.sleep(2.0)
        loop.run(writer.add(record, ttl_s=3), 10.0)  # confirmed again before it lapsed: 3 s more
        # on a new lease, the first one revoked: one live lease per quarantined node, however many confirmations
        assert writer.leases[NodeId("engine-f")] != first and first not in loop.run(client.leases(), 10.0)
        time.sleep(2.0)  # 4 s after the first write: it stands
        assert follower.blocked("engine-f")
        assert wait_until(lambda: not follower.blocked("engine-f"), 15.0)  # no more confirmation: it lapses
        assert loop.run(read_all(client, schema), 10.0) == []
    finally:
        loop.run(follower.stop(), 10.0)
        loop.run(client.close(), 10.0)



def test_a_holder_drops_the_copies_a_quarantined_node_computed_and_keeps_its_own(etcd, cluster_name: str,
                                                                                 tmp_path) -> None:
    """c pulls a's chunks (re-announced under c, a's origin in their headers) and computes its own; once a is
    quarantined, c drops exactly the pulled copies (counted ``quarantine``), keeps serving its own, is not
    quarantined itself, and does not take a's chunks back in while the record stands."""
    from agent_helpers import AgentProcess, agent_yaml
    from test_agent_mesh import load_and_check, requester

    from lmcache_p2p.testing.synthetic import preload, synthetic_tokens

    tokens = 1024 + 100
    a = AgentProcess(agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints),
                     seeds=(1,), tokens=tokens, log=tmp_path / "a.log").wait_ready()
    c = requester(tmp_path, cluster_name, etcd.endpoints)
    try:
        pulled = sum(load_and_check(c, seed=1, num_tokens=tokens)[0])
        assert pulled >= 2 and len(c.tiers.inventory()) == pulled
        assert preload(c, 7, tokens) == 5
        schema = Schema(cluster_name)
        c.loop.run(write(c.index.client, schema, QuarantineRecord(NodeId("a"), "b", "ab" * 16, 1.4)), 10.0)
        assert wait_until(lambda: len(c.tiers.inventory()) == 5, 10.0)
        assert c.invalidation.removed.labels("quarantine")._value.get() == pulled
        assert c.lookup(synthetic_tokens(7, tokens)).hit_tokens == tokens  # its own chunks: all still there
        assert c.lookup(synthetic_tokens(1, tokens)).hit_tokens == 0  # a's: no owner to take them from
        # Offered again (a pull from a lagging planner): refused at the gate while a stands quarantined.
        payload = memoryview(bytes(c.chunk_bytes))
        key = ChunkKey(b"q" * 16)
        assert c.tiers.put(key, c.fp, payload, 256, heads=c.heads, origin=origin_of("a")) is None
        assert c.tiers.put(key, c.fp, payload, 256, heads=c.heads, origin=origin_of("d")) is not None
        assert c.invalidation.removed.labels("quarantine")._value.get() == pulled + 1
    finally:
        c.stop()
        a.stop()
