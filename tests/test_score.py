"""``/v1/score`` plans each engine with the planner itself (``make_plan``): the least-loaded holder,
pieces from the ranks of a TP engine. In-memory index, no etcd (tests/test_routing.py checks the
score against real loads)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lmcache_p2p.config import AgentConfig
from lmcache_p2p.estimates import PeerEstimates, PrefillRate
from lmcache_p2p.ids import NodeId
from lmcache_p2p.index.schema import NodeRecord, Served
from lmcache_p2p.keys import ChunkKey, Fingerprint, chunk_keys, chunk_spans, tokens_to_array
from lmcache_p2p.score import score
from lmcache_p2p.testing.memory_index import MemoryIndex, MemoryMesh

CONFIG = AgentConfig(node_id="e")
FINGERPRINT = Fingerprint.of(CONFIG.layout)
FP = FINGERPRINT.digest
HEADS = FINGERPRINT.num_kv_heads
TOKENS = list(range(4 * CONFIG.chunk_size))


@dataclasses.dataclass
class _Agent:
    """What scoring reads of its agent, over an in-memory index."""

    index: MemoryIndex
    config: AgentConfig = CONFIG
    fp = FP
    fingerprint = FINGERPRINT
    node_id: NodeId = NodeId("e")
    chunk_bytes: int = 1 << 20
    peer_estimates: PeerEstimates = dataclasses.field(default_factory=PeerEstimates)
    prefill: PrefillRate = dataclasses.field(default_factory=PrefillRate)

    def keys_for(self, token_ids: Sequence[int] | np.ndarray) -> tuple[list[ChunkKey], list[tuple[int, int]]]:
        arr = tokens_to_array(token_ids)
        return chunk_keys(FP, arr, CONFIG.chunk_size), chunk_spans(len(arr), CONFIG.chunk_size)

    def holds(self, key: ChunkKey) -> bool:
        return False

    def usable(self, record: NodeRecord | None) -> bool:
        return record is not None

    def node_record(self) -> NodeRecord:
        return self.index.nodes()[self.node_id]


def _node(mesh: MemoryMesh, node: str, heads: tuple[int, int], keys: Sequence[ChunkKey]) -> MemoryIndex:
    served = {FP.hex(): Served(FINGERPRINT.model_id, heads=(*heads, HEADS))}
    index = MemoryIndex(mesh, NodeRecord(NodeId(node), {"tcp": "127.0.0.1:7470"}, ("tcp",), served=served))
    index.add_many(FP, keys, 1)
    return index


def test_score_plans_pieces_from_the_ranks_of_a_tp_engine_as_the_planner_does() -> None:
    mesh = MemoryMesh()
    keys = chunk_keys(FP, tokens_to_array(TOKENS), CONFIG.chunk_size)
    agent = _Agent(_node(mesh, "e", (0, HEADS), keys[:1]))
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
