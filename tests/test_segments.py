"""Segments (``segments.py``): declared spans, their keys, and the blend plan."""

from __future__ import annotations

import math

import pytest

from lmcache_p2p.keys import FingerprintDigest, chunk_keys
from lmcache_p2p.request_params import SELECTIONS
from lmcache_p2p.segments import gradual_layer, plan_blend, segment_chunks

ROOT = FingerprintDigest(b"r" * 16)
C = 256


def rag(base: list[int], docs: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    prompt, spans = list(base), []
    for d in docs:
        spans.append((len(prompt), len(prompt) + len(d)))
        prompt += d
    return prompt + [7] * 40, spans


BASE = list(range(1000, 1256))
DOCS = [list(range(2000 + 1000 * i, 2000 + 1000 * i + n)) for i, n in enumerate([512, 300, 700])]


def test_segment_keys_do_not_depend_on_what_precedes_the_segment_but_on_the_base():
    p1, s1 = rag(BASE, DOCS)
    p2, s2 = rag(BASE, [DOCS[2], DOCS[0], DOCS[1]])
    k1 = {tuple(seg.keys): seg for seg in segment_chunks(ROOT, p1, s1, C)}
    k2 = {tuple(seg.keys): seg for seg in segment_chunks(ROOT, p2, s2, C)}
    assert set(k1) == set(k2)  # the same three documents, found at other offsets
    assert sorted(seg.start for seg in k1.values()) != sorted(seg.start for seg in k2.values())
    assert [seg.num_tokens for seg in segment_chunks(ROOT, p1, s1, C)] == [[256, 256], [256, 44], [256, 256, 188]]
    other_base = segment_chunks(ROOT, rag(BASE[:-1] + [5], DOCS)[0], s1, C)
    assert not set(k1) & {tuple(seg.keys) for seg in other_base}
    other_root = segment_chunks(FingerprintDigest(b"s" * 16), p1, s1, C)
    assert not set(k1) & {tuple(seg.keys) for seg in other_root}
    prefix = set(chunk_keys(ROOT, p1, C))  # never a prefix key
    assert not prefix & {k for seg in segment_chunks(ROOT, p1, s1, C) for k in seg.keys}


def test_plan_blend_extends_the_exact_prefix_over_held_segments():
    prompt, spans = rag(BASE, DOCS)
    segs = segment_chunks(ROOT, prompt, spans, C)
    everything = plan_blend(segs, 256, len(prompt), lambda keys: True, 0.1)
    assert everything is not None
    assert (everything.exact_end, everything.end) == (256, spans[-1][1])
    assert [(s.start, s.skip, s.end) for s in everything.segments] == [(256, 0, 768), (768, 0, 1068),
                                                                       (1068, 0, 1768)]
    # the first ceil(10 %) of each document; adjacent runs stay apart (distinct documents)
    assert everything.recompute == [(256, 308), (768, 798), (1068, 1138)]
    assert everything.recomputed_tokens == 52 + 30 + 70

    # the second document is held nowhere: it is fresh (computed after the base alone, then placed)
    missing = set(segs[1].keys)
    fresh = plan_blend(segs, 256, len(prompt), lambda keys: not missing & set(keys), 0.0)
    assert fresh is not None and fresh.end == spans[-1][1] and fresh.recompute == []
    assert [s.fresh for s in fresh.segments] == [False, True, False] and fresh.base_end == 256
    assert fresh.fresh_tokens == 300 and fresh.cost_tokens == 300
    # ... also when the base is not exactly held (the worker computes it first: a prefix)
    unheld_base = plan_blend(segs, 0, len(prompt), lambda keys: not missing & set(keys), 0.0)
    assert unheld_base is not None and unheld_base.end == spans[-1][1] and unheld_base.recompute == [(0, 256)]
    assert [s.fresh for s in unheld_base.segments] == [False, True, False]
    # nothing held at all: no blend (the engine computes it, and saves its first document)
    assert plan_blend(segs, 256, len(prompt), lambda keys: False, 0.1) is None

    # CacheBlend's selection: the same budget, the tokens picked by the worker; glue still recomputed
    picked = plan_blend(segs, 0, len(prompt), lambda keys: True, 0.1, selection="deviation")
    assert picked is not None and picked.recompute == [(0, 256)] and picked.select == 52 + 30 + 70
    assert picked.recomputed_tokens == 256 + 152
    # ... whose pass over the whole span (layers 0-1 of each token) is part of what the blend costs: a
    # document declared 15 times at a tiny fraction is a 15-document pass, not 15 tokens
    assert picked.probe_tokens == spans[-1][1]  # layers unknown: counted as the whole model
    picked30 = plan_blend(segs, 0, len(prompt), lambda keys: True, 0.1, selection="deviation", num_layers=30)
    assert picked30 is not None and picked30.probe_tokens == math.ceil(spans[-1][1] * 2 / 30)
    assert picked30.cost_tokens == 256 + 152 + picked30.probe_tokens
    repeated, rspans = rag(BASE, [DOCS[0]] * 15)
    rsegs = segment_chunks(ROOT, repeated, rspans, C)
    tiny = plan_blend(rsegs, 256, len(repeated), lambda keys: True, 1e-6, selection="deviation", num_layers=4)
    assert tiny is not None and tiny.recomputed_tokens == 15 and tiny.cost_tokens == 15 + (rspans[-1][1] - 256) // 2
    assert plan_blend(segs, 0, len(prompt), lambda keys: True, 0.1).probe_tokens == 0  # "first": no pass
    # the question's selection: the same budget picked by the worker; its pass is the question (the prompt
    # after the blend) and the glue recomputed once before it
    asked = plan_blend(segs, 0, len(prompt), lambda keys: True, 0.1, selection="question", num_layers=30)
    assert asked is not None and asked.select == picked.select and asked.selection == "question"
    assert asked.question == len(prompt) - asked.end and asked.probe_tokens == asked.question + 256
    heads = plan_blend(segs, 0, len(prompt), lambda keys: True, 0.1, selection="question-heads", num_layers=30)
    assert heads is not None and heads.question == asked.question and heads.probe_tokens == asked.probe_tokens
    # the gradual selections' second round is charged too: the question (and the glue) asked again after half
    # the picks are recomputed, those picks recomputed once more at the end ...
    twice = plan_blend(segs, 0, len(prompt), lambda keys: True, 0.1, selection="question-gradual", num_layers=30)
    assert twice is not None and twice.select == picked.select and twice.question == asked.question
    assert twice.probe_tokens == 2 * (asked.question + 256) + picked.select // 2
    # ... and CacheBlend's: twice the budget (with the glue) through the first third of the layers (0..10)
    layered = plan_blend(segs, 0, len(prompt), lambda keys: True, 0.1, selection="deviation-gradual", num_layers=30)
    assert layered is not None and layered.question == 0
    assert layered.probe_tokens == picked30.probe_tokens + math.ceil((2 * picked.select + 256) * 11 / 30)
    assert [gradual_layer(n) for n in (30, 4, 2, 1)] == [10, 2, 1, 0]
    with pytest.raises(ValueError, match="selection"):
        plan_blend(segs, 0, len(prompt), lambda keys: True, 0.1, selection="random")

    # an exact prefix into the first document: its rest is loaded from the segment, recomputed from there
    into = plan_blend(segs, 512, len(prompt), lambda keys: True, 0.5)
    assert into is not None and into.segments[0].skip == 256 and into.recompute[0] == (512, 640)

    # no base held: the base is recomputed as glue before the first document
    glue = plan_blend(segs, 0, len(prompt), lambda keys: True, 0.0)
    assert glue is not None and glue.recompute == [(0, 256)]

    # nothing beyond the exact prefix: no blend
    assert plan_blend(segs, spans[-1][1], len(prompt), lambda keys: True, 0.1) is None
    assert plan_blend(segs, 256, len(prompt), lambda keys: False, 0.1) is None


def test_plan_blend_leaves_the_last_prompt_token_to_the_engine():
    prompt = BASE + DOCS[0]  # the document ends the prompt
    segs = segment_chunks(ROOT, prompt, [(256, 768)], C)
    plan = plan_blend(segs, 256, len(prompt), lambda keys: True, 1.0)
    assert plan is not None and plan.end == len(prompt) - 1 and plan.segments[0].end == len(prompt) - 1
    assert plan.recompute == [(256, len(prompt) - 1)]


def test_a_selection_of_every_segment_token_runs_no_pass():
    """Fraction 1 selects every placed token: nothing to choose between, so no selection pass is run or charged."""
    prompt, spans = rag(BASE, DOCS)
    segs = segment_chunks(ROOT, prompt, spans, C)
    for selection in SELECTIONS[1:]:
        every = plan_blend(segs, 256, len(prompt), lambda keys: True, 1.0, selection=selection, num_layers=30)
        assert every is not None and every.select == spans[-1][1] - 256 and every.probe_tokens == 0


def test_the_self_lead_in_keys_its_own_kv_and_plans_a_first_sight_as_fresh_segments():
    """A segment's KV after a copy of itself is keyed apart from its KV after the base alone (the "none" keys
    are those of before lead-ins existed); with "self" no segment of a plain computation is canonical except
    one the base and a copy of itself precede, so a request that asks to blend with nothing held computes
    every segment fresh, each twice, and that is its cost."""
    import hashlib

    from lmcache_p2p.keys import LEAD_INS, segment_root, tokens_to_array
    from lmcache_p2p.segments import canonical_in_context, ingest_prompt

    old = hashlib.blake2b(bytes(ROOT), digest_size=16, person=b"lmcp2p-segment")
    old.update(tokens_to_array(BASE).tobytes())
    assert segment_root(ROOT, BASE) == segment_root(ROOT, BASE, "none") == old.digest()
    assert segment_root(ROOT, BASE, "self") != old.digest()
    with pytest.raises(ValueError, match="lead-in 'other'"):
        segment_root(ROOT, BASE, "other")
    assert set(LEAD_INS) == {"none", "self"}

    prompt, spans = rag(BASE, DOCS)
    by_lead = {lead: segment_chunks(ROOT, prompt, spans, C, lead) for lead in LEAD_INS}
    assert not {k for s in by_lead["none"] for k in s.keys} & {k for s in by_lead["self"] for k in s.keys}

    # nothing held: "none" computes plainly (and saves its first document); "self" blends every segment fresh
    assert plan_blend(by_lead["none"], 256, len(prompt), lambda keys: False, 0.1, lead_in="none") is None
    first = plan_blend(by_lead["self"], 256, len(prompt), lambda keys: False, 0.1, lead_in="self")
    assert first is not None and all(s.fresh for s in first.segments) and first.lead_in == "self"
    assert first.fresh_tokens == 2 * (512 + 300 + 700)
    assert first.cost_tokens == first.fresh_tokens + first.recomputed_tokens
    held = plan_blend(by_lead["self"], 256, len(prompt), lambda keys: True, 0.1, lead_in="self")
    assert held is not None and held.fresh_tokens == 0

    # what a plain computation saves: "none" its first segment; "self" none of these ...
    assert canonical_in_context(by_lead["none"], prompt, "none") == by_lead["none"][:1]
    assert canonical_in_context(by_lead["self"], prompt, "self") == []
    # ... but the second copy of an ingested document, under the keys a query with that document looks up
    doc = DOCS[1]
    ingest, ingest_spans = ingest_prompt(BASE, doc)
    assert ingest == BASE + doc + doc and ingest_spans == [[256, 556], [556, 856]]
    copies = segment_chunks(ROOT, ingest, [tuple(s) for s in ingest_spans], C, "self")
    assert canonical_in_context(copies, ingest, "self") == [copies[1]]
    assert copies[1].keys == by_lead["self"][1].keys
    # a copy with anything between it and the base other than one copy of itself is not canonical
    glued = BASE + doc + [5] + doc
    apart = segment_chunks(ROOT, glued, [(256, 556), (557, 857)], C, "self")
    assert canonical_in_context(apart, glued, "self") == []
    other = BASE + DOCS[0][:300] + doc
    assert canonical_in_context(segment_chunks(ROOT, other, [(256, 556), (556, 856)], C, "self"), other, "self") == []
