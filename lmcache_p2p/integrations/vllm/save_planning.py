"""What of a computing request is saved, step by step, on the scheduler side (the worker copies it).

A request's prompt is saved once complete (its declared segments with it: ``SegmentSave``), then every chunk
its generated tokens fill, so the next turn of a conversation, on any node, finds its history; when it
finishes, the rest of what it computed (its tail, the last chunk cut where its KV ends) from blocks vLLM holds
for it until the worker has copied them. Each save passes admission first (``admission.py``). Keys grow from
the last one saved (``RequestRecord.last_generated``): a generated chunk hashes its own tokens, never the
whole history again.
"""

from __future__ import annotations

import logging

from ...keys import ChunkKey, chunk_keys, chunk_keys_from
from ...transfers import ChunkTransfer, SegmentSave, chunk_transfer
from .admission import Admission
from .metadata import LMCacheP2PMetadata
from .request_record import RequestRecord

log = logging.getLogger(__name__)


class SavePlanning:
    def __init__(self, chunk: int, block: int, admission: Admission) -> None:
        self._chunk, self._block = chunk, block
        self._admission = admission

    def after_step(self, req_id: str, record: RequestRecord, done: int, meta: LMCacheP2PMetadata) -> None:
        """A computing request scheduled in this step, ``done`` tokens computed once it runs: its saves into
        ``meta`` (its prompt once complete, then its output's full chunks)."""
        if done > len(record.prompt):
            # decoding: its prompt was computed in an earlier step (its load, if any, went through, or vLLM
            # has recomputed what failed); were vLLM to preempt it now, its hit may be offered again when
            # it is rescheduled (its KV freed, its chunks in the mesh)
            record.loaded = False
        if done < len(record.prompt) or record.blended:
            return
        assert record.keys is not None  # computing: keyed
        if not record.prompt_saved:
            admission = self._admission
            seen = admission.seen(record.keys) if record.sighted else admission.sighted(record.keys)
            record.sighted = True
            save = admission.admitted(chunk_transfer(req_id, len(record.prompt), record.keys, record.block_ids, 0,
                                                     len(record.prompt), self._chunk, self._block), seen)
            save.canary = record.canary
            if save.keys:
                meta.saves.append(save)
            if record.save_segments:  # those computed as their keys promise (segments.canonical_in_context):
                # the others are computed after documents this client chose; a blend computes them fresh
                meta.segment_saves.append(SegmentSave(req_id, record.save_segments, list(record.block_ids)))
                admission.remember_saved(ChunkKey(k) for seg in record.save_segments for k in seg.keys)
            record.prompt_saved, record.full_chunks_saved = True, len(record.prompt) // self._chunk
        # With asynchronous scheduling the newest sampled token may still be a placeholder: save
        # only chunks whose every token is known (a later step saves the rest).
        full = min(done, len(record.request.all_token_ids)) // self._chunk
        if full > record.full_chunks_saved:
            generated = self._generated(record, full)
            if generated.keys:
                meta.saves.append(generated)

    def _keys_from(self, record: RequestRecord, first: int, end: int) -> list[ChunkKey]:
        """The keys of the chunks of prompt + output from chunk ``first`` to token ``end`` (the last one cut
        short there), chained from the key of chunk ``first - 1``: the prompt's, or the last generated
        chunk's saved; only when that one is not known, the whole history keyed again."""
        chunk = self._chunk
        assert record.identity is not None and record.keys is not None  # computing: keyed
        root, mm_items = record.identity
        in_prompt = len(record.prompt) // chunk  # the prompt's full chunks, whose keys are ``record.keys``
        parent = (root if first == 0 else record.keys[first - 1] if first <= in_prompt else record.last_generated)
        tokens = record.request.all_token_ids
        if parent is None:
            return chunk_keys(root, list(tokens[:end]), chunk, mm_items=mm_items)[first:]
        return chunk_keys_from(bytes(parent), list(tokens[first * chunk:end]), chunk, first * chunk, mm_items)

    def _generated(self, record: RequestRecord, full: int) -> ChunkTransfer:
        """The full chunks ``[full_chunks_saved, full)`` of prompt + output."""
        first, chunk = record.full_chunks_saved, self._chunk
        new = self._keys_from(record, first, full * chunk)
        per = chunk // self._block
        record.full_chunks_saved, record.last_generated = full, new[-1]
        return self._admission.admitted(ChunkTransfer(record.request.request_id, [bytes(k) for k in new],
                                                      [chunk] * (full - first),
                                                      [record.block_ids[i * per:(i + 1) * per]
                                                       for i in range(first, full)],
                                                      generated=True), self._admission.seen(new))

    def finished_tail(self, record: RequestRecord, block_ids: list[int] | None) -> ChunkTransfer | None:
        """The chunks a finished request computed that no save covered: from its last saved full chunk
        to where its KV ends (the last token generated never had its KV computed), the last cut short."""
        request = record.request
        tokens = request.all_token_ids
        done = min(int(request.num_computed_tokens), len(tokens) - 1)
        covered = max(len(record.prompt), record.full_chunks_saved * self._chunk)
        if not record.prompt_saved or record.blended or done <= covered:
            return None
        first = record.full_chunks_saved
        # chunk_transfer reads the keys of chunks ``first`` on: those before are not keyed again
        keys = [ChunkKey(b"")] * first + self._keys_from(record, first, done)
        blocks = list(block_ids) if block_ids else record.block_ids
        save = chunk_transfer(request.request_id, done, keys, blocks, first * self._chunk, done, self._chunk,
                              self._block)
        if any(len(b) != -(-n // self._block) for b, n in zip(save.block_ids, save.num_tokens, strict=True)):
            log.warning("request %s: %d blocks known, fewer than its %d computed tokens; its tail is not saved",
                        request.request_id, len(blocks), done)
            return None
        save = self._admission.admitted(save, self._admission.seen([ChunkKey(k) for k in save.keys]))
        if not save.keys:
            return None  # nothing worth saving: vLLM frees its blocks at once
        save.generated, save.finished = True, True
        return save
