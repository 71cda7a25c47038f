"""A request's ``kv_transfer_params`` read once (``request_params.py``): each name as it takes it, anything
else left out and named with why, never an exception; the table every reference of them is made from."""

from __future__ import annotations

import dataclasses

import pytest

from lmcache_p2p import request_params as rp
from lmcache_p2p.request_params import (
    BLEND_PARAM,
    CANARY_PARAM,
    EXPECT_PARAM,
    FRACTION_PARAM,
    PARAMS,
    REVISION_PARAM,
    SEGMENTS_PARAM,
    SELECTION_PARAM,
    ParamError,
    RequestParams,
    read_spans,
)


def test_every_parameter_is_read_into_its_field() -> None:
    got = RequestParams.parse({SEGMENTS_PARAM: [[0, 10], [10, 20], [30, 100]], BLEND_PARAM: True,
                               FRACTION_PARAM: 1, SELECTION_PARAM: "question", CANARY_PARAM: True,
                               REVISION_PARAM: 7, EXPECT_PARAM: 3, "someone_elses": {"x": 1}}, 100)
    assert got == RequestParams(((0, 10), (10, 20), (30, 100)), True, 1.0, "question", True, 7, 3)
    assert RequestParams.parse(None, 100) == RequestParams.parse([SEGMENTS_PARAM], 100) == RequestParams()
    assert RequestParams.parse({}, 100) == RequestParams()


def test_spans_are_sorted_disjoint_and_inside_the_prompt_and_what_is_wrong_is_named() -> None:
    for bad, words in [([], "non-empty"), ([[5, 5]], "empty or outside"), ([[0, 101]], "outside"),
                       ([[10, 20], [15, 30]], "overlaps"), ([[10, 20], [0, 5]], "precedes"), ([[0, "9"]], "pair"),
                       ([[True, 9]], "pair"), ("0-9", "non-empty list"), ([[0, 1]] * 300, "at most")]:
        with pytest.raises(ParamError, match=words):
            read_spans(bad, 100)
        got = RequestParams.parse({SEGMENTS_PARAM: bad, CANARY_PARAM: True}, 100)
        assert got.segments is None and got.canary  # the rest still read
        assert [name for name, _ in got.malformed] == [SEGMENTS_PARAM] and words in got.malformed[0][1]


@pytest.mark.parametrize(("name", "bad"), [
    (FRACTION_PARAM, -0.1), (FRACTION_PARAM, 1.5), (FRACTION_PARAM, "0.2"), (FRACTION_PARAM, True),
    (FRACTION_PARAM, None), (SELECTION_PARAM, "best"), (SELECTION_PARAM, 1), (CANARY_PARAM, "yes"),
    (CANARY_PARAM, 1), (REVISION_PARAM, "50"), (REVISION_PARAM, True), (REVISION_PARAM, -5), (REVISION_PARAM, 0),
    (EXPECT_PARAM, 2.0), (EXPECT_PARAM, [4]), (BLEND_PARAM, "yes"), (BLEND_PARAM, None),
])
def test_a_value_a_name_does_not_take_is_left_out_and_named(name: str, bad: object) -> None:
    got = RequestParams.parse({name: bad}, 100)
    assert [n for n, _ in got.malformed] == [name] and got.malformed[0][1].startswith(name + ":")
    expected = RequestParams(blend=False) if name == BLEND_PARAM else RequestParams()  # a bad flag: not blended
    assert dataclasses.replace(got, malformed=()) == expected


def test_a_request_is_blended_when_it_asks_or_when_the_operator_says_every_one_is() -> None:
    def wants(raw: object, default: bool) -> bool:
        return RequestParams.parse(raw, 100).wants_blend(default)

    assert not wants(None, False) and wants(None, True)
    assert not wants({SEGMENTS_PARAM: [[0, 1]]}, False)
    assert wants({BLEND_PARAM: True}, False) and not wants({BLEND_PARAM: False}, True)
    assert wants({FRACTION_PARAM: 0.3}, False) and wants({SELECTION_PARAM: "deviation"}, False)
    assert not wants({BLEND_PARAM: "yes"}, True)  # a flag it did not manage to say: not blended
    assert not wants({FRACTION_PARAM: "lots"}, False) and wants({FRACTION_PARAM: "lots"}, True)  # as if unasked
    assert not RequestParams.parse({FRACTION_PARAM: "lots"}, 100).says_blend
    assert RequestParams.parse({BLEND_PARAM: "yes"}, 100).says_blend


def test_the_table_names_every_parameter_once() -> None:
    constants = {v for k, v in vars(rp).items() if k.endswith("_PARAM")}
    assert [p.name for p in PARAMS] == sorted({p.name for p in PARAMS}, key=[p.name for p in PARAMS].index)
    assert {p.name for p in PARAMS} == constants and len(PARAMS) == len(constants)
    assert all(p.takes and p.does and p.bound and p.beyond for p in PARAMS)
    assert RequestParams.parse({REVISION_PARAM: 9}, 1).without_revision().index_revision == 0
