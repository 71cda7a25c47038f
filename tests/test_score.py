"""``/v1/score`` plans each engine with the planner itself (``make_plan``): the least-loaded holder,
pieces from the ranks of a TP engine; and a request's declared segments (documents) as its scheduler
side would blend them (``plan_blend``). In-memory index, no etcd (tests/test_routing.py checks the
score against real loads)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import pytest

from lmcache_p2p.config import AgentConfig, BlendConfig
from lmcache_p2p.estimates import PeerEstimates, PrefillRate
from lmcache_p2p.ids import NodeId
from lmcache_p2p.index.schema import NodeRecord, Served
from lmcache_p2p.keys import ChunkKey, Fingerprint, chunk_keys, tokens_to_array
from lmcache_p2p.score import ScoreError, Scorer, ScoreRequest, parse_request, score
from lmcache_p2p.segments import probe_cost, segment_chunks
from lmcache_p2p.testing.memory_index import MemoryIndex, MemoryMesh

# the deviation selection at 0.15 (the numbers below); the question selection's cost is checked beside it
CONFIG = AgentConfig(node_id="e", blend=BlendConfig(recompute_fraction=0.15, selection="deviation"))
FINGERPRINT = Fingerprint.of(CONFIG.layout)
FP = FINGERPRINT.digest
HEADS = FINGERPRINT.num_kv_heads
TOKENS = list(range(4 * CONFIG.chunk_size))


def _scorer(index: MemoryIndex, config: AgentConfig = CONFIG, prefill: PrefillRate | None = None) -> Scorer:
    """What an agent gives scoring, over an in-memory index: it holds nothing itself (its chunks are
    announced in the index) and can pull from every node with a record."""
    return Scorer(settings=lambda: config, fingerprint=FINGERPRINT, node_id=NodeId("e"), chunk_bytes=1 << 20,
                  index=index, peer_estimates=PeerEstimates(), prefill=prefill or PrefillRate(),
                  holds=lambda _key: False, usable=lambda record: record is not None,
                  record=lambda: index.nodes()[NodeId("e")])


def _node(mesh: MemoryMesh, node: str, heads: tuple[int, int], keys: Sequence[ChunkKey]) -> MemoryIndex:
    served = {FP.hex(): Served(FINGERPRINT.model_id, heads=(*heads, HEADS))}
    index = MemoryIndex(mesh, NodeRecord(NodeId(node), {"tcp": "127.0.0.1:7470"}, ("tcp",), served=served))
    index.add_many(FP, keys, 1)
    return index


def test_score_plans_pieces_from_the_ranks_of_a_tp_engine_as_the_planner_does() -> None:
    mesh = MemoryMesh()
    keys = chunk_keys(FP, tokens_to_array(TOKENS), CONFIG.chunk_size)
    agent = _scorer(_node(mesh, "e", (0, HEADS), keys[:1]))
    _node(mesh, "t-r0", (0, HEADS // 2), keys)
    _node(mesh, "t-r1", (HEADS // 2, HEADS), keys)
    _node(mesh, "p", (0, HEADS), keys[:2])
    rows = {r["node"]: r for r in score(agent, TOKENS)["nodes"]}
    assert set(rows) == {"e", "p"}  # a TP rank alone is no engine to route to
    e = rows["e"]
    assert e["matched_tokens"] == len(TOKENS) and e["local_tokens"] == {"cpu": CONFIG.chunk_size}
    # chunk 1 whole from p (the only whole holder), chunks 2-3 as pieces from both ranks
    assert e["sources"] == {"p": CONFIG.chunk_size, "t-r0": 2 * CONFIG.chunk_size, "t-r1": 2 * CONFIG.chunk_size}
    assert e["peer_tokens"] == 3 * CONFIG.chunk_size
    p = rows["p"]
    assert p["local_tokens"] == {"cpu": 2 * CONFIG.chunk_size} and p["matched_tokens"] == len(TOKENS)
    assert set(p["sources"]) == {"t-r0", "t-r1"}  # e holds chunk 0 only, which p holds itself


def _rag_prompt() -> tuple[list[int], list[tuple[int, int]]]:
    """A 256-token base, three 300-token documents, a 50-token question."""
    prompt, spans = list(range(10_000, 10_256)), []
    for d in range(3):
        spans.append((len(prompt), len(prompt) + 300))
        prompt += list(range(20_000 + 1000 * d, 20_300 + 1000 * d))
    return prompt + list(range(30_000, 30_050)), spans


def test_score_counts_the_documents_each_node_holds_or_can_pull_as_its_blend_would() -> None:
    prompt, spans = _rag_prompt()
    docs = [[ChunkKey(k) for k in seg.keys] for seg in segment_chunks(FP, prompt, spans, CONFIG.chunk_size)]
    mesh = MemoryMesh()
    agent = _scorer(_node(mesh, "e", (0, HEADS), []), prefill=PrefillRate(1000.0))
    _node(mesh, "p", (0, HEADS), docs[0] + docs[1])
    _node(mesh, "q", (0, HEADS), docs[2])
    asked = {r["node"]: r for r in score(agent, prompt, spans)["nodes"]}  # not asked to blend (by_default)
    assert all(r["segment_tokens"] == 0 and r["computed_tokens"] == len(prompt) for r in asked.values())
    rows = {r["node"]: r for r in score(agent, prompt, spans, blend=True)["nodes"]}
    # every node can have all three documents: p holds two and pulls one, e pulls them all
    # the base (held by nobody: glue), 15 % of each document, and the deviation selection's pass over the
    # blend (layers 0-1 of its 1,156 tokens, CONFIG's selection: probe_cost)
    recompute = 256 + 3 * 45 + probe_cost(256 + 900, CONFIG.layout.num_layers)
    for row in rows.values():
        assert row["matched_tokens"] == 0 and row["segment_tokens"] == 900 and row["recompute_tokens"] == recompute
        assert row["computed_tokens"] == 50 + recompute  # the question, and what the blend recomputes
        assert row["estimated_compute_ms"] == pytest.approx(50 + recompute)  # 1 token/ms
    assert rows["p"]["local_tokens"] == {"cpu": 600} and rows["p"]["sources"] == {"q": 300}
    # the question selection: its pass is the question (50 tokens) and the glue recomputed once before it
    asking = dataclasses.replace(CONFIG, blend=BlendConfig(recompute_fraction=0.15, selection="question"))
    e = _scorer(_node(mesh, "e", (0, HEADS), []), config=asking, prefill=PrefillRate(1000.0))
    row = {r["node"]: r for r in score(e, prompt, spans, blend=True)["nodes"]}["e"]
    assert row["recompute_tokens"] == 256 + 3 * 45 + (50 + 256)
    assert rows["e"]["local_tokens"] == {} and rows["e"]["sources"] == {"p": 600, "q": 300}
    assert rows["e"]["peer_tokens"] == 900
    # without segments: the exact prefix only, as before
    plain = {r["node"]: r for r in score(agent, prompt)["nodes"]}
    assert all(r["segment_tokens"] == 0 and r["computed_tokens"] == len(prompt) for r in plain.values())
    assert plain["e"]["estimated_compute_ms"] == pytest.approx(len(prompt))


def test_a_document_held_nowhere_is_computed_fresh_in_the_blend_after_the_base() -> None:
    prompt, spans = _rag_prompt()
    docs = [[ChunkKey(k) for k in seg.keys] for seg in segment_chunks(FP, prompt, spans, CONFIG.chunk_size)]
    base = chunk_keys(FP, tokens_to_array(prompt), CONFIG.chunk_size)[:1]  # the base, as an exact prefix
    # without the base held: the blend computes it first (a prefix), then document 1 fresh
    row = score(_scorer(_node(MemoryMesh(), "e", (0, HEADS), docs[0] + docs[2])), prompt, spans, True)["nodes"][0]
    assert row["matched_tokens"] == 0 and row["segment_tokens"] == 600
    pass_all = probe_cost(256 + 900, CONFIG.layout.num_layers)  # the deviation selection's pass
    assert row["recompute_tokens"] == 256 + 3 * 45 + 300 + pass_all and row["local_tokens"] == {"cpu": 600}
    # with it: document 1 is computed fresh within the blend, documents 0 and 2 placed
    held = _scorer(_node(MemoryMesh(), "e", (0, HEADS), base + docs[0] + docs[2]))
    row = score(held, prompt, spans, True)["nodes"][0]
    assert row["matched_tokens"] == 256 and row["segment_tokens"] == 600
    pass_after = probe_cost(900, CONFIG.layout.num_layers)  # ... from the exact prefix's end
    assert row["recompute_tokens"] == 3 * 45 + 300 + pass_after and row["local_tokens"] == {"cpu": 256 + 600}
    # a blend over blend.max_recompute_tokens is refused there: the exact prefix only
    small = dataclasses.replace(CONFIG, blend=dataclasses.replace(CONFIG.blend, max_recompute_tokens=100))
    row = score(_scorer(_node(MemoryMesh(), "e", (0, HEADS), base + docs[0] + docs[2]), config=small), prompt,
                spans, True)["nodes"][0]
    assert row["segment_tokens"] == 0 and row["computed_tokens"] == len(prompt) - 256


def test_score_requests_with_bad_segments_get_a_400_naming_them() -> None:
    model = FINGERPRINT.model_id
    assert parse_request(json.dumps({"tokens": [1] * 10}).encode(), model) == ScoreRequest([1] * 10)
    asked = parse_request(json.dumps({"tokens": [1] * 10, "segments": [[2, 5]], "blend": True}).encode(), model)
    assert asked == ScoreRequest([1] * 10, [(2, 5)], True)
    for bad, field in (([[5, 2]], "'segments'"), ([[0, 11]], "'segments'"), ([[0, 5], [4, 8]], "'segments'"),
                       ("x", "'segments'"), ([[1, "2"]], "'segments'"), ([], "'segments'")):
        with pytest.raises(ScoreError, match=field) as exc:
            parse_request(json.dumps({"tokens": [1] * 10, "segments": bad}).encode(), model)
        assert exc.value.status == 400
    with pytest.raises(ScoreError, match="'blend'"):
        parse_request(json.dumps({"tokens": [1] * 10, "blend": "yes"}).encode(), model)
