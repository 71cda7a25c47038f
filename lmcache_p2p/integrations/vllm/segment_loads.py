"""Segment loads on the worker side (``segments.py``, ``blend.py``): a request's declared segments,
cached at other positions, blended into its blocks.

A blend runs in two parts: *gather* (the exact prefix into place, held segment chunks pulled or pinned
and decoded: the load thread for a pulled blend) and *place* (the forward thread, which owns the model):
fresh segments computed after the base (and their lead-in) and saved, every segment written at its position, the
recompute. Nothing of the segment region is written before *place*: a fresh segment's computation uses
the region's blocks as scratch. Whatever fails goes back to vLLM by block id, never less than the blend
was to fill.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ...aio import remaining
from ...keys import ChunkKey
from ...segments import KV_ERROR_ENV, SegmentChunks, fresh_cost, merge_runs, selection_pass, subtract_runs
from ...transfers import BlendTransfer, blocks_from
from .blend import Blender, select
from .exact_loads import ExactLoads
from .saves import Saves
from .staged_loads import LoadParts, staged_chunks

log = logging.getLogger(__name__)


class SegmentLoads:
    """``blender`` None: this engine can't blend (every blend fails, back to vLLM)."""

    def __init__(self, parts: LoadParts, exact: ExactLoads, saves: Saves, blender: Blender | None,
                 block_size: int) -> None:
        self.parts = parts
        self.exact = exact
        self.saves = saves
        self.blender = blender
        self.block_size = block_size

    def blend(self, t: BlendTransfer, remote: bool, place: bool = True) -> tuple[BlendTransfer, set[int], list[Any]]:
        """Gather ``t`` (and, ``place``: place it, here on the forward thread). Returns what is to be
        blended (``t`` cut where its segments stopped loading), the blocks vLLM must recompute (from
        the cut on; all of them when anything else fails) and the gathered segment KV (to place)."""
        metrics = self.parts.metrics
        # the exact prefix's blocks count as not filled until its load says otherwise: a blend that fails
        # before or inside that load reports them too (vLLM must never run over blocks nobody filled)
        exact_failed: set[int] = blocks_from(t.exact, 0) if t.exact is not None else set()
        failed: set[int] = set()
        try:
            if self.blender is None:
                raise ValueError("this engine can't blend (see the warning at start)")
            self._within_deadline(t)
            if t.exact is not None:
                exact_failed = self.exact.load(t.exact, remote=remote)
                if exact_failed:
                    raise ValueError("its exact prefix did not load")
            cut, gathered = self._gather_segments(t, remote)
            if cut < t.end:  # a chunk not loaded (a dead owner, a corrupt copy, the planner's budget)
                log.info("request %s: segments loaded up to position %d of %d; the engine computes the rest",
                         t.req_id, cut, t.end)
                failed = set(t.block_ids[cut // self.block_size: -(-t.end // self.block_size)])
                t = dataclasses.replace(t, end=cut, recompute=[(s, min(e, cut)) for s, e in t.recompute if s < cut])
                if cut <= t.exact_end:  # not one segment token reused: counted here, nothing left to place
                    metrics.blend_requests.labels("failed").inc()
                    return t, failed, []
            if place:
                self.place(t, gathered)
        except Exception as exc:  # a cache problem must never become a serving problem: the engine computes it
            log.info("request %s: blend failed (%s); %d tokens recomputed by the engine", t.req_id, exc,
                     t.end - t.exact_end)
            metrics.blend_requests.labels("failed").inc()
            # everything it was to fill: from the exact prefix's end (the whole prefix too when its load
            # did not finish) to the end it had before a cut (``failed``: the blocks past the cut)
            return t, t.blocks(self.block_size) | exact_failed | failed, []
        if place:
            self.count(t, partial=bool(failed))
            return t, failed, []
        return t, failed, gathered

    def _within_deadline(self, t: BlendTransfer) -> None:
        """Refuse (ValueError) a blend whose model work (recomputed runs, selected tokens, fresh segments) is
        expected, at this engine's measured prefill rate, to run past its load's deadline: it would run as one
        nested forward outside vLLM's step budget, stalling every other request's decode for that long;
        refused, vLLM computes the prompt itself, chunked into its steps."""
        layers = self.blender.num_layers if t.select and self.blender is not None else 0
        tokens = (sum(e - s for s, e in t.recompute) + t.select + fresh_cost(t.segments, t.lead_in)
                  + selection_pass(t.selection, t.select, t.segments, t.end - t.exact_end, len(t.question),
                                   t.recompute, layers))
        expected = self.parts.prefill.recompute_s(tokens)
        left = remaining(self.parts.deadline(t))
        if expected is not None and expected > left:
            self.parts.metrics.load_failures.labels("deadline").inc()
            raise ValueError(f"its model work ({tokens} tokens) is expected to take {expected:.2f} s, "
                             f"more than the {max(left, 0.0):.2f} s left before its deadline")

    def count(self, t: BlendTransfer, partial: bool) -> None:
        recomputed = sum(e - s for s, e in t.recompute) + t.select
        metrics = self.parts.metrics
        metrics.blend_requests.labels("partial" if partial else "loaded").inc()
        metrics.blend_tokens.labels("recomputed").inc(recomputed)
        metrics.blend_tokens.labels("segment").inc(max(t.end - t.exact_end - recomputed, 0))

    def _gather_segments(self, t: BlendTransfer, remote: bool) -> tuple[int, list[tuple[torch.Tensor, int, int]]]:
        """Pull (or pin locally) the held segment chunks of ``t`` and decode the positions they cover, up
        to the first chunk not loaded. Returns where that is (``t.end``: everything) and the pieces:
        ``(kv, first position, segment start)``."""
        assert self.blender is not None
        blender = self.blender
        held = [seg for seg in t.segments if not seg.fresh]
        keys = [ChunkKey(k) for seg in held for k in seg.keys]
        num_tokens = [n for seg in held for n in seg.num_tokens]
        gathered: list[tuple[torch.Tensor, int, int]] = []
        with staged_chunks(self.parts, t, keys, num_tokens, remote) as load:
            planned = len(load.plan.chunks)
            if planned < len(keys):
                log.info("request %s: segment chunk %d of %d has no usable owner in this node's mirror", t.req_id,
                         planned + 1, len(keys))
            i = 0
            for seg in held:
                first = 0  # the chunk's first token in its segment
                for n in seg.num_tokens:
                    lo = max(seg.start + first, seg.start + seg.skip)
                    hi = min(seg.start + first + n, seg.end)
                    staged = load.stage(i)
                    if staged is None:
                        if i < planned:
                            log.info("request %s: segment chunk %d of %d (from %s) not loaded", t.req_id, i + 1,
                                     len(keys), load.sources[i])
                        return min(lo, t.end), gathered
                    if lo < hi:
                        kv = blender.decode(staged, n)[:, :, lo - seg.start - first: hi - seg.start - first]
                        gathered.append((kv, lo, seg.start))
                    first += n
                    i += 1
        return t.end, gathered

    def place(self, t: BlendTransfer, gathered: list[tuple[torch.Tensor, int, int]]) -> None:
        """The forward thread's part: fresh segments, every segment at its position, the recompute."""
        assert self.blender is not None
        blender = self.blender
        runs = list(t.recompute)
        fresh = [seg for seg in t.segments if seg.fresh and seg.start + seg.skip < t.end]
        if fresh:
            base = [(s, min(e, t.base_end)) for s, e in runs if s < t.base_end]
            if base:  # the base in place first (fresh segments attend to it): a prefix, computed exactly
                blender.recompute(t.token_ids, base, t.block_ids)
                runs = subtract_runs(runs, base)
            pieces, unplaced = self._fresh(t, fresh)
            gathered = gathered + pieces
            runs += unplaced
        for kv, at, turn in gathered:
            blender.write(kv, t.block_ids, at, turn)
        if t.select:
            segment_runs = [(seg.start + seg.skip, min(seg.end, t.end)) for seg in t.segments]
            candidates = subtract_runs(segment_runs, runs)
            if t.select >= sum(e - s for s, e in candidates):
                runs += candidates  # every candidate: nothing to select between (no pass run)
            else:
                runs += select(blender, t.selection, t.token_ids, t.block_ids, (t.exact_end, t.end), merge_runs(runs),
                               candidates, t.select, t.question)
        runs = merge_runs(runs)
        blender.recompute(t.token_ids, runs, t.block_ids)
        path = os.environ.get(KV_ERROR_ENV)
        if path:  # the diagnostic `bench blend --kv-error` reads (Blender.kv_error)
            error = blender.kv_error(t.token_ids, t.block_ids, (t.exact_end, t.end), runs)
            with open(path, "a") as f:
                f.write(json.dumps({"request": t.req_id, "span": [t.exact_end, t.end], "selection": t.selection,
                                    "recomputed": sum(e - s for s, e in runs), "runs": runs, **error}) + "\n")

    def _fresh(self, t: BlendTransfer, fresh: list[SegmentChunks]) -> tuple[list[tuple[torch.Tensor, int, int]],
                                                                               list[tuple[int, int]]]:
        """Compute each fresh segment after the base and its lead-in (``t.lead_in``: "self", a copy of the
        segment; "none", nothing), in the blend region's own blocks (scratch: the base's KV copied to its
        start), save it under its keys and return it to be placed; a segment the scratch can't hold (or whose
        last token the request does not give) is recomputed in place instead (returned as a run) and not
        saved."""
        assert self.blender is not None
        blender, bs, base = self.blender, self.block_size, t.base_end
        # blocks wholly inside the region and past the base (which the fresh computations read)
        scratch = t.block_ids[-(-max(t.exact_end, base) // bs): t.end // bs]
        pieces: list[tuple[torch.Tensor, int, int]] = []
        unplaced: list[tuple[int, int]] = []
        copied = False
        for seg in fresh:
            lo, hi = seg.start + seg.skip, min(seg.end, t.end)
            tokens = t.token_ids[seg.start: seg.start + seg.length]
            lead = tokens if t.lead_in == "self" else []
            if -(-(base + len(lead) + seg.length) // bs) > len(scratch) or len(t.token_ids) < seg.start + seg.length:
                log.info("request %s: a fresh segment at %d is computed in this context only (no scratch for it "
                         "and its lead-in); not saved", t.req_id, seg.start)
                unplaced.append((lo, hi))
                continue
            if not copied:
                blender.write(blender.read(t.block_ids, 0, base, 0), scratch, 0, 0)
                copied = True
            context = t.token_ids[:base] + lead
            if lead:  # the lead-in after the base, then the segment after both
                blender.recompute(context, [(base, len(context))], scratch)
            kv = blender.isolated(context + tokens, len(context), scratch)
            self.saves.store_segment(t.req_id, seg, _slicer(kv))
            pieces.append((kv[:, :, lo - seg.start: hi - seg.start], lo, seg.start))
        if pieces:
            self.parts.metrics.blend_tokens.labels("fresh").inc(sum(kv.shape[2] for kv, _, _ in pieces))
        return pieces, unplaced


def _slicer(kv: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
    """``kv``'s tokens ``[first, first + n)`` (a segment's KV, to store chunk by chunk)."""
    return lambda first, n: kv[:, :, first:first + n]
