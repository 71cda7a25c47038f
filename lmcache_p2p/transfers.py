"""What the scheduler side hands its workers each step (``integrations/vllm/metadata.py``): a request's chunks to
load or save (:class:`ChunkTransfer`), a blended load (:class:`BlendTransfer`) and a segment save
(:class:`SegmentSave`), and how chunks map to engine blocks. No vLLM import: unit-testable anywhere.

Chunk ``i`` of a prompt covers tokens ``[i*C, min((i+1)*C, n))`` and so the engine blocks
``[i*C/B, ceil(min((i+1)*C, n)/B))`` of the request's block list (C = chunk size, B = block
size, C a multiple of B)::

    tokens:   |<----- chunk 0 (256) ----->|<----- chunk 1 (256) ----->|<- tail (90) ->|
    blocks:   |  b0 (128)   |  b1 (128)   |  b2 (128)   |  b3 (128)   |  b4 (128)    |
    ChunkTransfer.block_ids = [[b0, b1], [b2, b3], [b4]]   skip_blocks: leading blocks already
                                                         filled by vLLM's own prefix cache
"""

from __future__ import annotations

import dataclasses

from .keys import ChunkKey, chunk_spans
from .segments import SegmentChunks


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
    finished: bool = False  # saves: a finished request's tail; vLLM frees its blocks once the worker reports it
    index_revision: int = 0  # loads: the scheduler's mirror revision when it offered the hit
    deadline: float = 0.0  # async loads: when the worker gives up and vLLM recomputes (time.monotonic(); 0: none)
    canary: bool = False  # saves: the engine computed what the mesh holds; compare every owner's copy (canary.py)


def chunk_transfer(req_id: str, num_tokens: int, keys: list[ChunkKey], block_ids: list[int], start: int, end: int,
                   chunk: int, block: int) -> ChunkTransfer:
    """The chunks covering tokens ``[start, end)`` of a ``num_tokens`` prompt, with their engine blocks
    (``block_ids`` is the request's whole block list: chunk i's blocks start at ``i * chunk / block``).
    ``start`` is where vLLM's own prefix cache stopped (block-aligned): the blocks of the first chunk
    before it are ``skip_blocks``, loaded but not overwritten. A partial tail chunk has fewer blocks."""
    spans = chunk_spans(num_tokens, chunk)
    first, last = start // chunk, -(-end // chunk)
    per = chunk // block
    chunk_blocks = [block_ids[i * per: i * per + -(-(spans[i][1] - spans[i][0]) // block)] for i in range(first, last)]
    return ChunkTransfer(req_id, [bytes(k) for k in keys[first:last]],
                         [spans[i][1] - spans[i][0] for i in range(first, last)], chunk_blocks,
                         skip_blocks=(start - first * chunk) // block)


def blocks_from(t: ChunkTransfer, chunk: int) -> set[int]:
    """The blocks of chunk ``chunk`` and every later one, less those vLLM's own prefix cache filled."""
    blocks = [b for i, later in enumerate(t.block_ids[chunk:], chunk)
              for b in (later[t.skip_blocks:] if i == 0 else later)]
    return set(blocks)


@dataclasses.dataclass(slots=True)
class SegmentSave:
    """Save the segments of a request that computed its prompt (from its blocks)."""

    req_id: str
    segments: list[SegmentChunks]
    block_ids: list[int]


@dataclasses.dataclass(slots=True)
class BlendTransfer:
    """A blended load: the exact prefix chunks, then segment chunks moved into place, then the
    recompute runs; the worker reports blocks of ``[exact_end, end)`` (all of them) when any part fails."""

    req_id: str
    exact: ChunkTransfer | None
    segments: list[SegmentChunks]
    recompute: list[tuple[int, int]]
    token_ids: list[int]  # the prompt up to ``end`` (the recompute runs' inputs)
    block_ids: list[int]  # the request's blocks
    exact_end: int
    end: int
    base_end: int = 0  # where the first declared segment starts (fresh segments are computed after the base)
    select: int = 0  # selection "deviation" or "question": segment tokens the worker picks
    sync: bool = False
    index_revision: int = 0
    deadline: float = 0.0
    selection: str = "first"  # how the worker picks ``select`` tokens: "deviation" or "question"
    question: list[int] = dataclasses.field(default_factory=list)  # the prompt after ``end`` ("question")
    lead_in: str = "none"  # what fresh segments are computed after besides the base (``keys.LEAD_INS``)

    def blocks(self, block_size: int) -> set[int]:
        """The blocks the blend fills (recomputed by the engine when it fails)."""
        return set(self.block_ids[self.exact_end // block_size: -(-self.end // block_size)])
