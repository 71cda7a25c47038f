"""``make_plan``: the longest run of leading chunks, owner choice, and covering a node's KV heads
from one peer or from pieces of several (pure function, no I/O)."""

from __future__ import annotations

from lmcache_p2p.ids import NodeId
from lmcache_p2p.keys import ChunkKey, HeadRange
from lmcache_p2p.plan import LOCAL, HitPlan, Piece, fetch_budget, make_plan

KEYS = [ChunkKey(bytes([i]) * 16) for i in range(4)]
SPANS = [(0, 256), (256, 512), (512, 768), (768, 900)]


def plan(owners: list[dict[str, int]], *, local: set[int] = frozenset(), usable: set[str] | None = None,
         inflight: dict[str, int] | None = None, need: HeadRange = (0, 4),
         heads: dict[str, HeadRange] | None = None) -> HitPlan:
    return make_plan(
        KEYS, SPANS, local=lambda k: KEYS.index(k) in local,
        owners=lambda ks: [{NodeId(n): t for n, t in owners[KEYS.index(k)].items()} for k in ks],
        usable=lambda n: usable is None or n in usable, inflight={NodeId(k): v for k, v in (inflight or {}).items()},
        num_tokens=900, need=need, heads_of=(lambda n: (heads or {}).get(n, (0, 4))))


def test_the_plan_stops_at_the_first_chunk_nobody_holds() -> None:
    p = plan([{"a": 1}, {}, {"a": 1}, {"a": 1}], local={0})
    assert [c.source for c in p.chunks] == [LOCAL] and p.hit_tokens == 256


def test_local_first_then_least_loaded_then_faster_tier() -> None:
    p = plan([{"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 2, "b": 1}, {"a": 1}], local={3}, inflight={"a": 1})
    assert [c.source for c in p.chunks] == ["b", "a", "b", LOCAL]  # b idle; then a; then b's faster tier
    assert p.chunks[0].alternatives == ("a",) and p.hit_tokens == 900


def test_backed_off_peers_are_not_planned() -> None:
    p = plan([{"a": 1, "b": 1}, {"a": 1}, {}, {}], usable={"b"})
    assert [c.source for c in p.chunks] == ["b"]


def test_a_peer_holding_more_heads_sends_the_range_needed() -> None:
    p = plan([{"full": 1}] * 4, need=(2, 4))
    assert all(c.source == "full" and c.heads == (2, 4) and not c.pieces for c in p.chunks)
    assert p.chunks[0].parts() == (Piece(NodeId("full"), (2, 4)),)


def test_pieces_from_the_ranks_of_a_tp_engine_cover_the_heads() -> None:
    heads = {"r0": (0, 2), "r1": (2, 4), "r1b": (2, 4)}
    p = plan([{"r0": 1, "r1": 1, "r1b": 2}] * 4, heads=heads)
    first = p.chunks[0]
    assert [(x.source, x.heads) for x in first.pieces] == [("r0", (0, 2)), ("r1", (2, 4))]
    assert first.pieces[1].alternatives == ("r1b",)  # holds the same piece: the retry goes there
    assert len(p.chunks) == 4


def test_a_head_nobody_holds_ends_the_plan() -> None:
    p = plan([{"r0": 1}] * 4, heads={"r0": (0, 2)})
    assert p.chunks == ()


def test_overlapping_ranges_are_cut_where_the_last_piece_starts() -> None:
    p = plan([{"x": 1, "y": 1}] * 4, heads={"x": (0, 3), "y": (1, 4)})
    assert [(x.source, x.heads) for x in p.chunks[0].pieces] == [("x", (0, 3)), ("y", (3, 4))]


def test_the_budget_counts_each_piece_on_its_own_peer() -> None:
    p = plan([{"r0": 1, "r1": 1}] * 4, heads={"r0": (0, 2), "r1": (2, 4)})
    seen: dict[str, int] = {}

    def expected(peer: str, nbytes: int) -> float:
        seen[peer] = nbytes
        return 0.001

    fetch_budget(p, chunk_bytes=lambda c: 1000, expected_s=expected, recompute_s=lambda t: 1.0, max_s=5.0)
    assert seen == {"r0": 2000, "r1": 2000}  # each holds half of each of the 4 chunks
