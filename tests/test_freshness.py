"""The scheduler side's read-your-writes gate (``Freshness``): a request naming an index revision waits,
bounded, until the mirror has followed the block entries that far (a fake clock; no vLLM needed)."""

from __future__ import annotations

import pytest

from lmcache_p2p.integrations.freshness import Freshness
from lmcache_p2p.request_params import EXPECT_PARAM, REVISION_PARAM, RequestParams


def ask(raw: object) -> RequestParams:
    return RequestParams.parse(raw, 4096)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_waits_until_the_mirror_reaches_the_revision() -> None:
    clock = Clock()
    gate = Freshness(2.0, clock)
    params = ask({REVISION_PARAM: 50})
    assert gate.hold("r", params, revision=49, following=True)
    clock.now += 1.0
    assert gate.hold("r", params, revision=49, following=True)
    assert not gate.hold("r", params, revision=50, following=True)  # caught up: scheduled
    assert gate.held == 1 and gate.gave_up == 0


def test_waits_at_most_wait_s_then_never_again() -> None:
    clock = Clock()
    gate = Freshness(2.0, clock)
    params = ask({REVISION_PARAM: 50})
    assert gate.hold("r", params, 10, True)
    clock.now += 2.0
    assert not gate.hold("r", params, 10, True)  # planned with what the mirror holds
    clock.now += 0.1
    assert not gate.hold("r", params, 10, True)  # asked again (a failed load, say): no second wait
    assert gate.gave_up == 1
    gate.forget("r")
    assert len(gate) == 0


@pytest.mark.parametrize("params", [None, {}, {REVISION_PARAM: "50"}, {REVISION_PARAM: True}, {REVISION_PARAM: 5}])
def test_no_revision_or_an_old_one_never_waits(params) -> None:
    gate = Freshness(2.0, Clock())
    assert not gate.hold("r", ask(params), revision=10, following=True)
    assert len(gate) == 0


def test_a_mirror_not_following_etcd_never_waits() -> None:
    # etcd unreachable: the mirror can't move, so waiting would only delay the request
    gate = Freshness(2.0, Clock())
    assert not gate.hold("r", ask({REVISION_PARAM: 50}), revision=10, following=False)


def test_an_aborted_request_leaves_nothing_behind() -> None:
    gate = Freshness(2.0, Clock())
    for i in range(100):
        assert gate.hold(f"r{i}", ask({REVISION_PARAM: 50}), 10, True)
    for i in range(100):
        gate.forget(f"r{i}")
    assert len(gate) == 0 and gate.held == 100


def test_a_disaggregated_decode_waits_for_the_chunks_its_prefill_engine_saved() -> None:
    clock = Clock()
    gate = Freshness(2.0, clock)
    params = ask({EXPECT_PARAM: 4})
    assert gate.hold("d", params, revision=10, following=True, held=0)  # the prefill's saves not announced yet
    clock.now += 0.3
    assert gate.hold("d", params, revision=11, following=True, held=3)
    assert not gate.hold("d", params, revision=12, following=True, held=4)  # all there: planned now
    assert not gate.hold("e", params, revision=12, following=False, held=0)  # etcd not followed: no wait
    assert gate.hold("f", params, 12, True, held=1)
    clock.now += 2.0
    assert not gate.hold("f", params, 12, True, held=1)  # bounded: the decode engine computes the rest
    assert gate.held == 2 and gate.gave_up == 1
    for bad in (None, {}, {EXPECT_PARAM: "4"}, {EXPECT_PARAM: True}, {EXPECT_PARAM: -2}, [EXPECT_PARAM]):
        assert ask(bad).expect_chunks == 0
        assert not gate.hold("g", ask(bad), 12, True, held=0)
