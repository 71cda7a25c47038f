"""What the scheduler-side connector tells the worker-side connector each step: the loads and saves
(``ChunkTransfer``, see ``integrations/blocks.py`` for how chunks map to engine blocks)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..blocks import ChunkTransfer
from ..segments import BlendTransfer, SegmentSave

__all__ = ["BlendTransfer", "ChunkTransfer", "LMCacheP2PMetadata", "SegmentSave"]


@dataclasses.dataclass
class LMCacheP2PMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = dataclasses.field(default_factory=list)
    saves: list[ChunkTransfer] = dataclasses.field(default_factory=list)
    blends: list[BlendTransfer] = dataclasses.field(default_factory=list)  # blended loads (segments.py)
    segment_saves: list[SegmentSave] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: int = 0  # this step's tokens: the worker times prefill steps by it
    uncacheable: dict[str, int] = dataclasses.field(default_factory=dict)  # new requests not cached, by reason
