"""The correctness canary: peers' chunks held against the KV this node's own engine computes.

    scheduler: a sampled request (``canary.rate``, or one that asks: ``kv_transfer_params``
               ``{"lmcache_p2p_canary": true}``) is offered no hit: the engine computes it all
    worker:    its full prompt chunks are gathered as computed (the reference), then, off the
               forward pass, each owner the index lists is asked for its copy of the same key and
               the two are compared within the KV dtype's tolerance
    mismatch:  the owner is quarantined (``quarantine.py``: a record every planner obeys,
               ``status`` shows), the comparison counted (``canary_checks_total{outcome}``)

A key is derived by this node from the tokens it just computed, so the check covers the key chain
too: an owner whose chunk under this key is not the KV of these tokens under this model is wrong,
whatever its checksum says. The distance is relative L2 over the whole chunk,
``|a - b| / |a|``: recomputing the same prompt elsewhere differs by rounding (0 on the same
build, measured), another model's KV by about 1 or more.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .index.schema import NodeId
from .keys import ChunkKey, HeadRange, piece_key
from .plan import Piece, PlannedChunk
from .quarantine import QuarantineRecord

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}
DEFAULT_TOLERANCE = {"float32": 1e-3, "float16": 0.02, "bfloat16": 0.05}
FP8_TOLERANCE = 0.15
OUTCOMES = ("match", "mismatch", "unavailable")


def tolerance_for(kv_dtype: str) -> float:
    return DEFAULT_TOLERANCE.get(kv_dtype, FP8_TOLERANCE)


def kv_distance(reference: memoryview | bytes, other: memoryview | bytes, kv_dtype: str) -> float:
    """Relative L2 distance of two chunk payloads of ``kv_dtype`` (inf when their sizes differ or
    ``other`` holds non-finite values where ``reference`` does not)."""
    if len(reference) != len(other):
        return float("inf")
    dtype = TORCH_DTYPES.get(kv_dtype)
    if dtype is None:
        raise ValueError(f"no torch dtype for KV dtype {kv_dtype!r}")
    a = torch.frombuffer(bytearray(reference), dtype=dtype).float()
    b = torch.frombuffer(bytearray(other), dtype=dtype).float()
    norm = float(torch.linalg.vector_norm(a))
    diff = float(torch.linalg.vector_norm(a - b))
    if diff != diff:  # NaN: garbage where the reference is finite
        return float("inf")
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    owner: NodeId
    key: ChunkKey
    distance: float | None  # None: the owner's copy could not be had
    outcome: str


class CanaryNode(Protocol):
    """What the canary needs of its agent."""

    node_id: NodeId
    heads: HeadRange

    def owners_of(self, key: ChunkKey) -> list[NodeId]: ...

    def fetch_copy(self, owner: NodeId, chunk: PlannedChunk, deadline: float) -> bytes | None: ...

    def quarantine_owner(self, record: QuarantineRecord) -> None: ...


class Canary:
    def __init__(self, node: CanaryNode, kv_dtype: str, *, tolerance: float | None = None,
                 max_owners: int = 4, timeout_s: float = 5.0,
                 count: Callable[[str], None] = lambda outcome: None) -> None:
        self.node = node
        self.kv_dtype = kv_dtype
        self.tolerance = tolerance if tolerance is not None else tolerance_for(kv_dtype)
        self.max_owners = max_owners
        self.timeout_s = timeout_s
        self._count = count

    def check(self, chunks: Sequence[tuple[ChunkKey, int, int, bytes]]) -> list[Verdict]:
        """Compare every owner's copy of each ``(key, start, end, reference payload)`` with the
        reference; quarantines owners whose copy is not within tolerance. Never raises for a peer."""
        verdicts: list[Verdict] = []
        deadline = time.monotonic() + self.timeout_s
        for key, start, end, reference in chunks:
            owners = [o for o in self.node.owners_of(key) if o != self.node.node_id][: self.max_owners]
            for owner in owners:
                planned = PlannedChunk(0, key, start, end, owner, heads=self.node.heads,
                                       pieces=(Piece(owner, self.node.heads),))
                copy = self.node.fetch_copy(owner, planned, deadline)
                verdicts.append(self._judge(owner, key, reference, copy))
        return verdicts

    def _judge(self, owner: NodeId, key: ChunkKey, reference: bytes, copy: bytes | None) -> Verdict:
        if copy is None:
            self._count("unavailable")
            return Verdict(owner, key, None, "unavailable")
        distance = kv_distance(reference, copy, self.kv_dtype)
        if distance <= self.tolerance:
            self._count("match")
            log.debug("canary: %s's chunk %s matches (distance %.3g)", owner, key.hex()[:16], distance)
            return Verdict(owner, key, distance, "match")
        self._count("mismatch")
        log.error("canary: %s's chunk %s is not the KV this engine computes (distance %.3g > %.3g): quarantined",
                  owner, key.hex()[:16], distance, self.tolerance)
        self.node.quarantine_owner(QuarantineRecord(owner, self.node.node_id, key.hex(),
                                                    distance if distance != float("inf") else 1e300))
        return Verdict(owner, key, distance, "mismatch")


def scratch_key(key: ChunkKey, heads: HeadRange) -> ChunkKey:
    """Where a canary's copy of ``key`` lands in the pool (never announced, never served)."""
    return piece_key(key, heads)
