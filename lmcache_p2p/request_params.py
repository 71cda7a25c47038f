"""What a client may ask of the cache with one request: the names it reads in ``kv_transfer_params``.

vLLM hands a request's ``kv_transfer_params`` (a JSON object of the client's) to the connector; these
are the names lmcache-p2p reads there. Each is defined once, in :data:`PARAMS` (what it takes, its bound,
what happens beyond it; ``docs/reference/request-params.md`` is generated from it), and a request's are
read once, by :meth:`RequestParams.parse`, on the engine's scheduler side and in the router alike.

A value a name does not take is never an error of the request: the request is served as if it had not
asked, and the name goes to ``malformed`` with why. The scheduler side logs and counts it
(``request_params_refused_total{param}``) as it does the bounds only it can enforce, at run time: a canary
ask over ``canary.requested_per_minute``, a revision etcd has not reached. A new parameter: a constant, a
row of :data:`PARAMS`, a field and its line in :meth:`RequestParams.parse`, a case in
``tests/test_request_params_parse.py``. No vLLM import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

SEGMENTS_PARAM = "lmcache_p2p_segments"
BLEND_PARAM = "lmcache_p2p_blend"
FRACTION_PARAM = "lmcache_p2p_recompute_fraction"
SELECTION_PARAM = "lmcache_p2p_blend_selection"
CANARY_PARAM = "lmcache_p2p_canary"
REVISION_PARAM = "lmcache_p2p_index_revision"
EXPECT_PARAM = "lmcache_p2p_expect_chunks"

MAX_SEGMENTS = 256
# how a blend picks the tokens it recomputes (segments.py); "-gradual": in two rounds, the second scored over
# the cache the first refreshed (CacheBlend's gradual filtering); "question-heads": the question's reads per
# head, a position scored by its largest share of any head's
SELECTIONS = ("first", "deviation", "question", "deviation-gradual", "question-gradual", "question-heads")

Span = tuple[int, int]


class ParamError(ValueError):
    """A value a request parameter does not take (the message starts with the parameter's name)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """One request parameter, as the reference page and ``security.md`` state it."""

    name: str
    takes: str
    does: str
    bound: str
    beyond: str


PARAMS = (
    Param(SEGMENTS_PARAM, "a list of `[start, end]` token spans of the prompt",
          "declares the prompt's segments (RAG documents): each saved under its own keys and reused in any "
          "order and position (`docs/guides/rag-segments.md`)",
          f"at most {MAX_SEGMENTS} spans, ascending, disjoint, inside the prompt",
          "the request is served prefix-only"),
    Param(BLEND_PARAM, "`true` or `false`",
          "blends (`true`) or only saves (`false`) its declared segments; unset: `blend.by_default`, or `true` "
          "when it asks for a blend setting below",
          "the blend's model work (recompute, selection and fresh segments) at most `blend.max_recompute_tokens` "
          "and vLLM's step budget, expected to finish before its load's deadline",
          "not blended (a malformed value), or served prefix-only (over a bound)"),
    Param(FRACTION_PARAM, "a number in [0, 1]", "this request's own `blend.recompute_fraction`",
          "as `lmcache_p2p_blend`", "`blend.recompute_fraction` is used"),
    Param(SELECTION_PARAM, "one of " + ", ".join(f"`{s}`" for s in SELECTIONS),
          "this request's own `blend.selection`", "as `lmcache_p2p_blend`", "`blend.selection` is used"),
    Param(CANARY_PARAM, "`true` (`false`: as unset)",
          "the request is computed, and every owner's copy of its chunks is held against what it computed "
          "(`docs/guides/canary.md`)",
          "`canary.requested_per_minute` per engine (a burst of a sixth of it); each check copies at most 16 "
          "chunks and asks at most `canary.max_owners` owners",
          "served as any request"),
    Param(REVISION_PARAM, "a positive integer (an etcd revision)",
          "read your writes: waits until the index mirror has followed etcd to this revision",
          "a revision etcd has reached; at most 2 s of waiting",
          "`etcd.index: lookup`: refused after one read; the request is planned at once with what is known"),
    Param(EXPECT_PARAM, "a positive integer (chunks)",
          "disaggregated prefill: waits until the prompt's first this many chunks are in the index "
          "(the router sends it to the decode engine)",
          "at most 2 s of waiting", "planned with what the mirror holds"),
)


def read_spans(raw: Any, prompt_len: int) -> list[Span]:
    """``lmcache_p2p_segments``'s value as spans of a ``prompt_len``-token prompt; :class:`ParamError`
    naming the problem when it is not a list of ascending, disjoint ``[start, end]`` spans inside it."""
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ParamError(f"{SEGMENTS_PARAM}: a non-empty list of [start, end] spans is needed")
    if len(raw) > MAX_SEGMENTS:
        raise ParamError(f"{SEGMENTS_PARAM}: {len(raw)} spans, at most {MAX_SEGMENTS}")
    spans: list[Span] = []
    for span in raw:
        if (not isinstance(span, (list, tuple)) or len(span) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in span)):
            raise ParamError(f"{SEGMENTS_PARAM}: {span!r} is not a [start, end] pair of token offsets")
        start, end = span
        if not 0 <= start < end <= prompt_len:
            raise ParamError(f"{SEGMENTS_PARAM}: [{start}, {end}] is empty or outside the {prompt_len}-token prompt")
        if spans and start < spans[-1][1]:
            raise ParamError(f"{SEGMENTS_PARAM}: [{start}, {end}] overlaps or precedes the span before it")
        spans.append((start, end))
    return spans


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ParamError(f"{name}: {value!r} is not a positive integer")
    return value


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ParamError(f"{FRACTION_PARAM}: {value!r} is not a number in [0, 1]")
    return float(value)


def _selection(value: Any) -> str:
    if value not in SELECTIONS:
        raise ParamError(f"{SELECTION_PARAM}: {value!r} is not one of {SELECTIONS}")
    return str(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ParamError(f"{name}: {value!r} is not true or false")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class RequestParams:
    """A request's parameters, each as its name takes it (unset: not asked, or malformed)."""

    segments: tuple[Span, ...] | None = None
    blend: bool | None = None  # as the request said it (a malformed flag: False)
    fraction: float | None = None
    selection: str | None = None
    canary: bool = False
    index_revision: int = 0  # 0: none
    expect_chunks: int = 0  # 0: none
    malformed: tuple[tuple[str, str], ...] = ()  # (name, why), each left out above

    @classmethod
    def parse(cls, raw: Any, prompt_len: int) -> RequestParams:
        """A request's ``kv_transfer_params`` (anything: vLLM passes what the client sent) for a prompt of
        ``prompt_len`` tokens. Never raises."""
        if not isinstance(raw, Mapping):
            return cls()
        values: dict[str, Any] = {}
        malformed: list[tuple[str, str]] = []
        readers = ((SEGMENTS_PARAM, "segments", lambda v: tuple(read_spans(v, prompt_len))),
                   (BLEND_PARAM, "blend", lambda v: _flag(BLEND_PARAM, v)),
                   (FRACTION_PARAM, "fraction", _fraction),
                   (SELECTION_PARAM, "selection", _selection),
                   (CANARY_PARAM, "canary", lambda v: _flag(CANARY_PARAM, v)),
                   (REVISION_PARAM, "index_revision", lambda v: _positive_int(REVISION_PARAM, v)),
                   (EXPECT_PARAM, "expect_chunks", lambda v: _positive_int(EXPECT_PARAM, v)))
        for name, field, read in readers:
            if name not in raw:
                continue
            try:
                values[field] = read(raw[name])
            except ParamError as exc:
                malformed.append((name, str(exc)))
                if field == "blend":
                    values[field] = False  # a flag it did not manage to say: not blended
        return cls(**values, malformed=tuple(malformed))

    def wants_blend(self, default: bool) -> bool:
        """Whether its segments are blended: ``lmcache_p2p_blend`` when it said, else true when it asks for
        a blend setting (a recompute fraction or selection), else ``default`` (``blend.by_default``)."""
        if self.blend is not None:
            return self.blend
        return default or self.fraction is not None or self.selection is not None

    @property
    def says_blend(self) -> bool:
        """It says whether to blend (the flag, even malformed: not blended) or asks for a blend setting;
        else the engine's ``blend.by_default`` decides."""
        return self.blend is not None or self.fraction is not None or self.selection is not None

    def without_revision(self) -> RequestParams:
        """The same, the index revision refused (the request is planned with what the mirror holds)."""
        return dataclasses.replace(self, index_revision=0)
