"""The correctness canary: peers' chunks held against the KV this node's own engine computes.

    scheduler: a sampled request (``canary.rate``, or one that asks: ``kv_transfer_params``
               ``{"lmcache_p2p_canary": true}``) is offered no hit: the engine computes it all
    worker:    its full prompt chunks are gathered as computed (the reference), then, off the
               forward pass, each owner the index lists is asked for its copy of the same key and
               the two are compared within the KV dtype's tolerance
    mismatch:  when another owner's copy agrees with the reference (two computations against
               one), the owner that served the wrong copy is quarantined (``index/quarantine.py``:
               a record every planner obeys, ``status`` shows), and every holder drops the copies
               it holds of chunks that owner's engine computed. Else it is counted as
               ``unconfirmed`` and logged (``canary_checks_total{outcome}``); a copy this node
               holds that differs is replaced

Whom a mismatch names: the holder answers for what it serves. A chunk header's ``origin`` (the
engine that computed it) is written by whoever serves the copy and proves nothing, so it never
names a culprit on its own: a holder serving wrong KV under a zero origin or under an innocent
node's is the one quarantined. The one exception spares an honest relay: when the origin names an
owner whose *own* copy is found wrong in the same check, that owner is the culprit (it is
quarantined for its own copy anyway) and every holder drops what it computed, the relay's copy
included.

A key is derived by this node from the tokens it just computed, so the check covers the key chain
too: an owner whose chunk under this key is not the KV of these tokens under this model is wrong,
whatever its checksum says. The distance is relative L2 over the whole chunk,
``|a - b| / |a|``: recomputing the same prompt elsewhere differs by rounding (0 on the same
build, measured), another model's KV by about 1 or more.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from .aio import remaining
from .chunk import ChunkHeader
from .errors import LMCacheP2PError
from .ids import NO_ORIGIN, NodeDigest, NodeId, origin_of
from .index.quarantine import QuarantineRecord
from .keys import ChunkKey, HeadRange
from .plan import Piece, PlannedChunk

if TYPE_CHECKING:
    from .aio import LoopThread
    from .index.protocol import BlockIndex
    from .index.schema import NodeRecord
    from .keys import FingerprintDigest
    from .tiers import TieredStore
    from .transfer.pull import Puller

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}
DEFAULT_TOLERANCE = {"float32": 1e-3, "float16": 0.02, "bfloat16": 0.05}
FP8_TOLERANCE = 0.15
OUTCOMES = ("match", "mismatch", "unconfirmed", "unavailable")


def tolerance_for(kv_dtype: str) -> float:
    return DEFAULT_TOLERANCE.get(kv_dtype, FP8_TOLERANCE)


def kv_distance(reference: memoryview | bytes, other: memoryview | bytes, kv_dtype: str) -> float:
    """Relative L2 distance of two chunk payloads of ``kv_dtype`` (inf when their sizes differ or
    ``other`` holds non-finite values where ``reference`` does not)."""
    if len(reference) != len(other):
        return float("inf")
    if reference == other:  # bit-identical (NaN encodings included)
        return 0.0
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
class Copy:
    """An owner's copy of a chunk, verified on arrival, and the node its header says computed it."""

    payload: bytes
    origin: NodeDigest


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    owner: NodeId  # the holder asked
    key: ChunkKey
    distance: float | None  # None: the owner's copy could not be had
    outcome: str
    quarantined: NodeId | None = None  # whom a mismatch quarantined (the holder, or the owner its origin names)


class CanaryNode(Protocol):
    """What the canary needs of its agent."""

    node_id: NodeId
    heads: HeadRange

    def owners_of(self, key: ChunkKey) -> list[NodeId]: ...

    def fetch_copy(self, owner: NodeId, chunk: PlannedChunk, deadline: float) -> Copy | None: ...

    def quarantine_owner(self, record: QuarantineRecord) -> None: ...

    def replace_if_differs(self, key: ChunkKey, num_tokens: int, reference: bytes,
                           differs: Callable[[bytes, bytes], bool]) -> None: ...


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
        reference, and this node's own copy if it holds one. Never raises for a peer.

        One computation against one copy can't tell which side is wrong (this node may be the one
        running other weights), so an owner is quarantined only when another owner's copy, computed
        independently, agrees with the reference: two against one. A mismatch nobody corroborates
        is counted (``unconfirmed``) and logged, and quarantines nobody. A held copy that differs
        from what this engine just computed is replaced by it."""
        verdicts: list[Verdict] = []
        for key, start, end, reference in chunks:
            self.node.replace_if_differs(key, end - start, reference, self._differs)
            owners = [o for o in self.node.owners_of(key) if o != self.node.node_id][: self.max_owners]
            found: list[_Found] = []
            for owner in owners:
                planned = PlannedChunk(0, key, start, end, owner, heads=self.node.heads,
                                       pieces=(Piece(owner, self.node.heads),), nonce=os.urandom(8))
                copy = self.node.fetch_copy(owner, planned, time.monotonic() + self.timeout_s)
                if copy is None:
                    found.append(_Found(owner, None))
                else:
                    found.append(_Found(owner, kv_distance(reference, copy.payload, self.kv_dtype), copy.origin))
            verdicts += self._judge(key, found)
        return verdicts

    def _differs(self, reference: bytes, copy: bytes) -> bool:
        return kv_distance(reference, copy, self.kv_dtype) > self.tolerance

    def _judge(self, key: ChunkKey, found: Sequence[_Found]) -> list[Verdict]:
        ok = any(f.distance is not None and f.distance <= self.tolerance for f in found)
        # owners whose own copy is wrong here, by the origin their own chunks carry
        wrong = {origin_of(f.owner): f.owner for f in found
                 if f.distance is not None and f.distance > self.tolerance}
        out, quarantined = [], set()
        for f in found:
            culprit = None
            if f.distance is None:
                outcome = "unavailable"
            elif f.distance <= self.tolerance:
                outcome = "match"
                log.debug("canary: %s's chunk %s matches (distance %.3g)", f.owner, key.hex()[:16], f.distance)
            elif ok:
                outcome = "mismatch"
                # The holder answers for what it serves, unless the engine its copy names served it wrong here too.
                culprit = wrong.get(f.origin, f.owner)
                log.error("canary: %s's copy of chunk %s is not the KV this engine and another owner compute "
                          "(distance %.3g > %.3g): %s quarantined", f.owner, key.hex()[:16],
                          f.distance, self.tolerance, culprit)
                if culprit not in quarantined:
                    quarantined.add(culprit)
                    self.node.quarantine_owner(QuarantineRecord(culprit, self.node.node_id, key.hex(),
                                                                min(f.distance, 1e300)))
            else:
                outcome = "unconfirmed"
                log.warning("canary: %s's chunk %s differs from what this engine computes (distance %.3g > %.3g) "
                            "and no other owner agrees with either side: not quarantined", f.owner,
                            key.hex()[:16], f.distance, self.tolerance)
            self._count(outcome)
            out.append(Verdict(f.owner, key, f.distance, outcome, culprit))
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class _Found:
    owner: NodeId
    distance: float | None  # None: no copy
    origin: NodeDigest = NO_ORIGIN  # the origin its header carries (a claim of the holder's)


class MeshCopies:
    """The mesh side of a canary check (:class:`CanaryNode`), over a started agent's parts: the index
    (owners, node records), the puller (a copy pulled aside under a scratch key, verified like every
    pull), the CPU pool (copied out of registered memory and verified again), the quarantine (written
    through the agent, so its own planner stops at once)."""

    def __init__(self, *, node_id: NodeId, heads: HeadRange, fp: FingerprintDigest,
                 tiers: TieredStore, puller: Puller, loop: LoopThread, pin_timeout_s: float,
                 index: Callable[[], BlockIndex | None], usable: Callable[[NodeRecord | None], bool],
                 store: Callable[[list[ChunkKey], list[int], list[memoryview]], object],
                 quarantine: Callable[[QuarantineRecord], None]) -> None:
        self.node_id = node_id
        self.heads = heads
        self.fp = fp
        self.tiers = tiers
        self.puller = puller
        self.loop = loop
        self.pin_timeout_s = pin_timeout_s
        self._index = index  # the agent's index (None while etcd is not yet open)
        self._usable = usable
        self._store = store
        self.quarantine_owner = quarantine

    def owners_of(self, key: ChunkKey) -> list[NodeId]:
        """Peers the index lists for ``key`` that this node could pull from (quarantined ones left out)."""
        index = self._index()
        if index is None:
            return []
        nodes = index.nodes()
        return [n for n in index.owners(self.fp, [key])[0] if n != self.node_id and self._usable(nodes.get(n))]

    def fetch_copy(self, owner: NodeId, chunk: PlannedChunk, deadline: float) -> Copy | None:
        """``owner``'s copy of ``chunk`` (a one-piece plan), pulled aside under a scratch key (never
        announced) and verified like every pull, then copied out of registered memory and verified
        again there; None if it could not be had by ``deadline``."""
        if not chunk.pieces:
            return None
        scratch = chunk.piece_key(chunk.pieces[0].heads)  # this pull's own (the chunk's nonce)
        try:
            missed = self.loop.run(self.puller.pull_from(owner, [chunk], deadline), remaining(deadline) + 1.0)
            if missed:
                return None
            held = self._staged_copy(scratch)
            return None if held is None else Copy(held[1], held[0].origin)
        except LMCacheP2PError as exc:
            log.warning("canary: pulling %s from %s failed: %s", chunk.key.hex()[:16], owner, exc)
            return None
        finally:
            self.tiers.cpu.remove(scratch)

    def _staged_copy(self, key: ChunkKey) -> tuple[ChunkHeader, bytes] | None:
        pin = self.tiers.cpu.pin(key, self.pin_timeout_s)
        if pin is None:
            return None
        try:
            staged = self.tiers.cpu.stage(pin)
            return (pin.header, staged.numpy().tobytes()) if staged is not None else None
        finally:
            self.tiers.cpu.unpin(pin)

    def replace_if_differs(self, key: ChunkKey, num_tokens: int, reference: bytes,
                           differs: Callable[[bytes, bytes], bool]) -> None:
        """This node's copy of ``key``, if it differs from what its engine just computed
        (``reference``), is dropped and the computed one stored in its place."""
        held = self._staged_copy(key)
        if held is None or not differs(reference, held[1]):
            return
        log.error("canary: this node's copy of chunk %s is not the KV its engine computes: replaced", key.hex()[:16])
        self.tiers.remove(key)
        self._store([key], [num_tokens], [memoryview(reference)])
