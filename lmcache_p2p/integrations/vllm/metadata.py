"""What the scheduler-side connector tells the worker-side connector each step.

Chunk ``i`` of a prompt covers tokens ``[i*C, min((i+1)*C, n))`` and so the engine blocks
``[i*C/B, ceil(min((i+1)*C, n)/B))`` of the request's block list (C = chunk size, B = block
size, C a multiple of B)::

    tokens:   |<----- chunk 0 (256) ----->|<----- chunk 1 (256) ----->|<- tail (90) ->|
    blocks:   |  b0 (128)   |  b1 (128)   |  b2 (128)   |  b3 (128)   |  b4 (128)    |
    LoadSpec.block_ids = [[b0, b1], [b2, b3], [b4]]   skip_blocks: leading blocks already
                                                      filled by vLLM's own prefix cache
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclasses.dataclass(slots=True)
class ChunkTransfer:
    """One request's chunks to load into, or save from, the engine's blocks."""

    req_id: str
    keys: list[bytes]
    num_tokens: list[int]  # tokens of each chunk (< chunk size only for the prompt's tail)
    block_ids: list[list[int]]  # engine blocks of each chunk, in order
    skip_blocks: int = 0  # leading blocks of the first chunk not to overwrite (loads only)
    sync: bool = False  # loads: every chunk is this engine's own; load inline, never pull
    generated: bool = False  # saves: chunks filled by generated tokens (not prompt misses)


@dataclasses.dataclass
class LMCacheP2PMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = dataclasses.field(default_factory=list)
    saves: list[ChunkTransfer] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: int = 0  # this step's tokens: the worker times prefill steps by it
