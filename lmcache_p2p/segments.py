"""Segments: parts of a prompt whose KV is reused wherever they appear (RAG documents in any order).

A request declares its segments as token spans of its prompt (``kv_transfer_params``)::

    {"lmcache_p2p_segments": [[256, 768], [768, 1280], [1280, 1792]]}

    prompt:  | base (system prompt) | doc B | doc A | doc C | question |
    keys:    prefix chain (exact, as every prompt)
             segment chains: root = H(request root, base); each doc's chunks chain over its own tokens

Spans are sorted, disjoint and inside the prompt; the tokens between them ("glue": separators) and
after the last belong to no segment. Segments must be token-identical across requests: a client
tokenizes each document alone and concatenates the ids (tokenizing the joined text can merge tokens
at the seams, and then the keys differ: a miss, never wrong KV).

Under a segment key is the segment's canonical KV: computed after the base and the lead-in (``blend.lead_in``:
nothing, or a copy of the segment), keys turned back to position 0 (``blend.py``). A request that computed
its prompt saves the segments it computed that way (:func:`canonical_in_context`); a blend computes the
others fresh. A later request with the same base and any of those documents, in
any order, claims the prompt up to the end of its last cached segment as one hit (vLLM counts hits
as a prefix) and makes that claim true before its forward pass (:func:`plan_blend`):

    exact:      the longest prefix held under prefix keys, loaded as today (bit-exact)
    segments:   each cached segment after it, its keys turned to the segment's new position
    recompute:  glue, and the first ``recompute_fraction`` of each loaded segment's tokens, run through
                the model over the blended cache: the cross-attention a document never saw where it
                was computed is restored where it matters most (its first tokens)

A blended prompt's KV is close to, not equal to, a full prefill's: such a request saves nothing
under prefix keys (they promise exact KV), and needs vLLM's own prefix cache off (``blend.py``).
Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from .keys import FingerprintDigest, chunk_keys, chunk_spans, segment_root
from .request_params import SELECTIONS


@dataclasses.dataclass(slots=True)
class SegmentChunks:
    """One segment's chunks as a prompt holds them: chunk ``i`` covers the segment's tokens
    ``[i*C, min((i+1)*C, length))``, at prompt positions from ``start``."""

    keys: list[bytes]
    num_tokens: list[int]
    start: int  # where the segment starts in this prompt
    skip: int = 0  # loads: leading tokens not written (an exact prefix already covers them)
    end: int = 0  # loads: positions from here on are not written (vLLM computes the prompt's last token)
    fresh: bool = False  # loads: held nowhere; computed after the base (and the lead-in), saved, then placed

    @property
    def length(self) -> int:
        return sum(self.num_tokens)


@dataclasses.dataclass(slots=True)
class BlendPlan:
    """How the prompt up to ``end`` is made: exact prefix to ``exact_end``, then segments, with the
    ``recompute`` runs (``[start, end)`` positions) computed through the model afterwards."""

    exact_end: int
    end: int
    segments: list[SegmentChunks]
    recompute: list[tuple[int, int]]
    base_end: int = 0
    select: int = 0  # selection "deviation" or "question": segment tokens the worker picks (:func:`plan_blend`)
    num_layers: int = 0  # the model's layers: what share of them the selection's pass runs (0: unknown, all)
    selection: str = "first"
    question: int = 0  # "question": the prompt's tokens after ``end``, run over the blended cache to select
    lead_in: str = "none"  # what fresh segments are computed after besides the base (``keys.LEAD_INS``)

    @property
    def probe_tokens(self) -> int:
        """The selection's pass, in tokens run through the whole model: the deviation selection's over the
        span (:func:`probe_cost`), the question selection's over the question (and the glue recomputed
        before it, once more)."""
        return selection_pass(self.selection, self.select, self.segments, self.end - self.exact_end, self.question,
                              self.recompute, self.num_layers)

    @property
    def recomputed_tokens(self) -> int:
        return sum(e - s for s, e in self.recompute) + self.select

    @property
    def fresh_tokens(self) -> int:
        """Tokens of fresh segments: computed once more, after the base and their lead-in (their canonical
        KV): :func:`fresh_cost`."""
        return fresh_cost(self.segments, self.lead_in)

    @property
    def cost_tokens(self) -> int:
        """What the blend runs through the model: its recompute, its fresh segments and the deviation
        selection's pass (the operator's ``blend.max_recompute_tokens`` bounds it)."""
        return self.recomputed_tokens + self.fresh_tokens + self.probe_tokens


def segment_chunks(root: FingerprintDigest, prompt: Sequence[int], spans: list[tuple[int, int]],
                   chunk: int, lead_in: str = "none") -> list[SegmentChunks]:
    """Each declared segment's chunks (keys chained from :func:`~lmcache_p2p.keys.segment_root`), for KV
    computed after ``lead_in`` (:data:`~lmcache_p2p.keys.LEAD_INS`)."""
    base = segment_root(root, prompt[:spans[0][0]], lead_in)
    out = []
    for start, end in spans:
        tokens = prompt[start:end]
        keys = chunk_keys(base, tokens, chunk)
        out.append(SegmentChunks([bytes(k) for k in keys], [e - s for s, e in chunk_spans(len(tokens), chunk)],
                                 start))
    return out


def fresh_cost(segments: Sequence[SegmentChunks], lead_in: str) -> int:
    """Tokens run through the model to compute the fresh ones of ``segments``: each after the base and, with
    the "self" lead-in, after a copy of itself (twice its length)."""
    return sum(seg.length for seg in segments if seg.fresh) * (2 if lead_in == "self" else 1)


def canonical_in_context(segments: list[SegmentChunks], prompt: Sequence[int], lead_in: str) -> list[SegmentChunks]:
    """The declared ``segments`` whose KV, as a plain computation of ``prompt`` makes it, is the canonical KV
    their keys promise (what a computed request saves of its segments): with the "none" lead-in the first one
    (right after the base); with "self" each one that the base and one copy of itself precede exactly (a
    document ingested as base + document + document, both copies declared: the second is saved)."""
    if not segments:
        return []
    if lead_in == "none":
        return segments[:1]
    base = segments[0].start
    return [seg for seg in segments if seg.start - base == seg.length
            and list(prompt[base:seg.start]) == list(prompt[seg.start:seg.start + seg.length])]


def ingest_prompt(base: Sequence[int], segment: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """The prompt (and its declared spans) that, computed plainly (not asked to blend), saves ``segment``'s KV
    after ``base`` under the "self" lead-in: the base, the segment, the segment again; both copies declared,
    the second one saved (:func:`canonical_in_context`)."""
    n, b = len(segment), len(base)
    return [*base, *segment, *segment], [[b, b + n], [b + n, b + 2 * n]]


KV_ERROR_ENV = "LMCACHE_P2P_BLEND_KV_ERROR"  # a file: each blend's K/V error per layer against a full prefill
DEVIATION_LAYER = 1  # the layer whose keys the deviation selection compares (layer 0's never move)


def selection_pass(selection: str, select: int, segments: Sequence[SegmentChunks], span: int, question: int,
                   glue: Sequence[tuple[int, int]], num_layers: int) -> int:
    """What choosing ``select`` of the placed ``segments``' tokens runs through the model, in tokens through
    all of it: nothing when every placed token is selected; the question's ``question`` tokens and the
    ``glue`` runs once more for "question"; :func:`probe_cost` of the blend's ``span`` for "deviation".
    The gradual selections add their second round: "question-gradual" runs the question (and the glue)
    again after recomputing the first half of its picks, which the final recompute runs once more;
    "deviation-gradual" runs the first round's ``GRADUAL_WIDEN`` x ``select`` survivors (and the glue)
    through the first ``gradual_layer`` layers."""
    if not select or select >= sum(seg.end - seg.start - seg.skip for seg in segments):
        return 0
    glued = sum(e - s for s, e in glue)
    if selection in ("question", "question-heads"):
        return question + glued
    if selection == "question-gradual":
        return 2 * (question + glued) + select // 2
    if selection == "deviation-gradual":
        survivors = GRADUAL_WIDEN * select + glued
        second = math.ceil(survivors * (gradual_layer(num_layers) + 1) / num_layers) if num_layers > 0 else survivors
        return probe_cost(span, num_layers) + second
    return probe_cost(span, num_layers)


GRADUAL_WIDEN = 2  # "deviation-gradual": the first round keeps this many times the budget for the second


def gradual_layer(num_layers: int) -> int:
    """The layer whose keys "deviation-gradual"'s second round compares: a third of the way down (CacheBlend
    filters layer by layer; one deeper layer is where a token's deviation has had context to build up)."""
    return max(min(max(DEVIATION_LAYER + 1, num_layers // 3), num_layers - 1), 0)


def reads_question(selection: str) -> bool:
    """Whether ``selection`` runs the rest of the prompt (the question) over the blended cache."""
    return selection.startswith("question")


def probe_cost(span: int, num_layers: int) -> int:
    """The deviation selection's pass over a blend's ``span`` tokens (layers ``0..DEVIATION_LAYER`` of each,
    :meth:`~lmcache_p2p.integrations.vllm.blend.Blender.deviating`) in tokens run through all
    ``num_layers`` (0: unknown, counted as all): what budgets, deadlines and the step bound charge it."""
    if span <= 0:
        return 0
    if num_layers <= 0:
        return span
    return math.ceil(span * min(DEVIATION_LAYER + 1, num_layers) / num_layers)


def plan_blend(segments: list[SegmentChunks], exact_end: int, prompt_len: int, held: Callable[[list[bytes]], bool],
               fraction: float, selection: str = "first", num_layers: int = 0,
               lead_in: str = "none") -> BlendPlan | None:
    """The blend that extends a prompt's exact prefix (``exact_end`` tokens) over its segments; None
    when none of them is held past it and ``lead_in`` is "none" (such a request is computed plainly and saves
    its first segment, whose KV is then canonical; with the "self" lead-in no segment of a plain computation
    is, so every segment is computed fresh, saved and placed: the price of a document's first sight).

    Every segment after the exact prefix is placed: a held one is loaded; one held nowhere is
    **fresh**: the worker computes it after the base and its ``lead_in`` (the KV its key promises,
    whatever precedes it in this prompt), saves it and places it like a loaded one (the part of the base
    the exact prefix does not cover is computed first). Glue before a placed segment (and the base, when
    not exactly held) is recomputed, and of each placed segment ``ceil(fraction * tokens)`` tokens: its first ones
    (``selection`` "first", EPIC's), or (``"deviation"``, CacheBlend's) the ones whose keys move most
    once recomputed in this context, picked by the worker (``select``; its pass over the blend's span is
    part of the plan's cost, :func:`probe_cost` of ``num_layers``), or (``"question"``, ProphetKV's and
    A³'s) the ones the rest of the prompt (the question) reads most when run over the blended cache,
    picked by the worker. Nothing past ``prompt_len - 1`` (vLLM computes the last prompt token itself)."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection {selection!r}: one of {SELECTIONS}")
    limit = prompt_len - 1
    base_end = segments[0].start if segments else 0
    end, loads, runs, select, any_held = exact_end, [], [], 0, False
    for seg in segments:
        seg_end = seg.start + seg.length
        if seg_end <= exact_end:
            continue
        if end >= limit:
            break
        is_held = held(seg.keys)
        any_held = any_held or is_held
        first = max(seg.start, exact_end)
        if first > end:
            runs.append((end, first))  # glue: no KV held for it
        loads.append(dataclasses.replace(seg, skip=first - seg.start, end=min(seg_end, limit), fresh=not is_held))
        n = math.ceil(fraction * (seg_end - first))
        if selection == "first" and n:
            runs.append((first, min(first + n, seg_end)))
        elif n:
            select += min(n, min(seg_end, limit) - first)
        end = min(seg_end, limit)
    if not any_held and lead_in == "none":  # a request computed plainly saves its first segment (canonical)
        return None
    recompute = merge_runs([(s, min(e, end)) for s, e in runs if s < end])
    question = prompt_len - end if reads_question(selection) else 0
    return BlendPlan(exact_end, end, loads, recompute, base_end, select, num_layers, selection, question, lead_in)


def merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end)`` runs sorted, overlapping or touching ones joined."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(runs):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def subtract_runs(runs: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The positions of ``runs`` in none of ``minus``, as sorted runs."""
    out: list[tuple[int, int]] = []
    taken = merge_runs(minus)
    for s, e in merge_runs(runs):
        for ms, me in taken:
            if me <= s or ms >= e:
                continue
            if ms > s:
                out.append((s, ms))
            s = max(s, me)
        if s < e:
            out.append((s, e))
    return out
