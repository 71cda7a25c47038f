"""Saves on the worker side: what the engine computed, from its blocks into the agent's CPU pool.

Each new chunk is gathered from the engine's blocks straight into a reserved CPU slot (synchronous: the
blocks may be reused after the step), then checksummed, committed and published in the background. A
request whose load failed this step has nothing saved from its first unloaded block on (the forward pass
ran over blocks nobody filled). Declared segments are stored with their keys turned to position 0
(``blend.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ...intake import Intake
from ...kernels.paged import PagedKV
from ...keys import ChunkKey
from ...segments import SegmentChunks
from ...transfers import ChunkTransfer, SegmentSave
from .blend import Blender

log = logging.getLogger(__name__)


class Saves:
    def __init__(self, intake: Intake, kv: PagedKV | None, blender: Blender | None) -> None:
        self.intake = intake
        self.kv = kv
        self.blender = blender

    def save(self, t: ChunkTransfer, unloaded: set[int]) -> None:
        """Gather and store ``t``'s chunks not held yet; ``unloaded``: the request's blocks whose load failed
        this step (nothing from the first chunk touching them on is saved)."""
        intake, kv = self.intake, self.kv
        assert kv is not None
        for key, ntok, blocks in zip(t.keys, t.num_tokens, t.block_ids, strict=True):
            if unloaded.intersection(blocks):
                log.info("request %s: its load failed this step; its chunks from there on are not saved", t.req_id)
                return
            if intake.holds(ChunkKey(key)) or not blocks:
                continue
            nbytes = kv.payload_nbytes(len(blocks))
            try:
                res = intake.reserve()
            except Exception as exc:  # a full, pinned pool must not fail the forward pass
                log.warning("request %s: no slot to save a chunk: %s", t.req_id, exc)
                return
            try:
                out = torch.frombuffer(res.view, dtype=torch.uint8, count=nbytes)
                kv.gather(torch.tensor(blocks, dtype=torch.int64), out)
            except Exception as exc:  # the slot goes back; the chunk is simply not cached
                intake.release(res)
                log.warning("request %s: gathering a chunk failed: %s", t.req_id, exc)
                return
            intake.commit(res, ChunkKey(key), ntok, nbytes)

    def save_segments(self, t: SegmentSave) -> None:
        """The declared segments a request computed as their keys promise (``segments.canonical_in_context``),
        from its blocks, keys turned to the segment's position 0 (``blend.py``)."""
        blender = self.blender
        if blender is None:
            return
        for seg in t.segments:
            def kv_of(first: int, n: int, seg: SegmentChunks = seg) -> torch.Tensor:
                return blender.read(t.block_ids, seg.start + first, seg.start + first + n, seg.start)
            self.store_segment(t.req_id, seg, kv_of)

    def store_segment(self, req_id: str, seg: SegmentChunks, kv_of: Callable[[int, int], torch.Tensor]) -> None:
        """Store ``seg``'s chunks not held yet; ``kv_of(first, n)``: the KV of its tokens ``[first, first + n)``."""
        intake = self.intake
        first = 0
        for key, n in zip(seg.keys, seg.num_tokens, strict=True):
            first += n
            if intake.holds(ChunkKey(key)):
                continue
            kv = kv_of(first - n, n)
            nbytes = kv.numel() * kv.element_size()
            try:
                res = intake.reserve()
            except Exception as exc:  # a full, pinned pool must not fail the forward pass
                log.warning("request %s: no slot to save a segment chunk: %s", req_id, exc)
                return
            try:
                torch.frombuffer(res.view, dtype=torch.uint8, count=nbytes).copy_(kv.contiguous().view(-1)
                                                                                    .view(torch.uint8))
            except Exception:
                intake.release(res)
                raise
            intake.commit(res, ChunkKey(key), n, nbytes)
