"""What the scheduler-side connector tells the worker-side connector each step: the loads and saves
(``ChunkTransfer``, see ``transfers.py`` for how chunks map to engine blocks); what each worker tells
the scheduler once at start (``WorkerCapability``), and after each step (``WorkerState``)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ...transfers import BlendTransfer, ChunkTransfer, SegmentSave

__all__ = ["BlendTransfer", "ChunkTransfer", "LMCacheP2PMetadata", "SegmentSave", "WorkerCapability", "WorkerState"]


@dataclasses.dataclass
class LMCacheP2PMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = dataclasses.field(default_factory=list)
    saves: list[ChunkTransfer] = dataclasses.field(default_factory=list)
    blends: list[BlendTransfer] = dataclasses.field(default_factory=list)  # blended loads (segments.py)
    segment_saves: list[SegmentSave] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: int = 0  # this step's tokens: the worker times prefill steps by it
    uncacheable: dict[str, int] = dataclasses.field(default_factory=dict)  # new requests not cached, by reason
    refused: dict[str, int] = dataclasses.field(default_factory=dict)  # request parameters not honoured, by name
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # chunks admission kept out of saves
    missed: dict[str, int] = dataclasses.field(default_factory=dict)  # prompt tokens not from cache, by reason
    blend_refused: int = 0  # new requests that asked for a blend this engine can't do (served prefix-only)
    reset_cache: bool = False  # vLLM reset its caches (e.g. new weights): each worker drops its node's chunks


@dataclasses.dataclass
class WorkerCapability(KVConnectorHandshakeMetadata):
    """What a worker told its scheduler once, after its KV caches were registered (vLLM hands every
    worker's ``get_handshake_metadata`` to the scheduler's ``set_xfer_handshake_metadata`` before the
    first step): ``blend_refusal`` None when it can blend, else why not."""

    blend_refusal: str | None


@dataclasses.dataclass
class WorkerState(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after each step (vLLM aggregates the ranks' into one):
    ``unavailable``, the peers their pulls do not ask now (an answer overdue, or backed off), by node id.
    The scheduler offers no hit held only there: a load that would fail at once costs a request vLLM's
    failed-load round (a step or two) on top of computing it. After a cache reset the scheduler offers
    no hit until every worker checked the weights (``resets``), and none ever again once one stopped
    sharing."""

    unavailable: frozenset[str] = frozenset()
    resets: int = 0  # cache resets the workers checked the weights at (the fewest of any rank)
    stopped_sharing: str | None = None  # why a worker stopped sharing (its weights changed in place)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, WorkerState):
            return self
        return WorkerState(self.unavailable | other.unavailable, min(self.resets, other.resets),
                           self.stopped_sharing or other.stopped_sharing)
