"""The pacing rules (``backoff.py``): the backoff (doubling, capped, jittered between half and all of the nominal
wait) and the token bucket."""

from __future__ import annotations

import math
import random

import pytest

from lmcache_p2p.backoff import Backoff, TokenBucket, jittered


def test_delays_double_up_to_the_cap_and_stay_within_half_and_all_of_the_nominal_wait() -> None:
    b = Backoff(0.1, 1.0, rng=random.Random(7).random)
    nominal = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    for n in nominal:
        assert b.nominal_s == pytest.approx(n)
        assert n / 2 <= b.next() <= n
    b.reset()
    assert b.nominal_s == pytest.approx(0.1)


def test_a_fleet_retrying_after_the_same_failure_spreads_out() -> None:
    """1,000 nodes whose etcd went away at the same instant: their first retries cover the interval, not
    one instant (the lockstep an unjittered backoff gives)."""
    rng = random.Random(11)
    first = sorted(Backoff(1.0, 10.0, rng=rng.random).next() for _ in range(1000))
    assert first[0] >= 0.5 and first[-1] <= 1.0
    buckets = {min(int((d - 0.5) * 10), 4) for d in first}  # five 100 ms buckets over [0.5, 1.0]
    assert buckets == {0, 1, 2, 3, 4}  # every one is hit
    assert max(first.count(d) for d in first) == 1
    assert jittered(2.0, lambda: 0.0) == 1.0 and jittered(2.0, lambda: 1.0) == 2.0


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)


def test_a_token_bucket_starts_full_refills_at_its_rate_and_never_holds_more_than_its_burst() -> None:
    now = [0.0]
    bucket = TokenBucket(2.0, 3.0, clock=lambda: now[0])
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]  # the burst, then nothing
    assert bucket.wait_s() == pytest.approx(0.5)
    now[0] = 0.25
    assert not bucket.take() and bucket.tokens == pytest.approx(0.5)
    now[0] = 100.0
    assert bucket.tokens == 3.0  # capped at the burst, however long it waited
    assert bucket.take(2.5) and not bucket.take(1.0)
    bucket.spend(2.0)  # used after a check: it may go into debt
    assert bucket.tokens == pytest.approx(-1.5) and bucket.wait_s(1.0) == pytest.approx(1.25)
    assert bucket.wait_s(4.0) == math.inf  # more than the burst never fits
    bucket.rate_per_s, bucket.burst = 0.0, 1.0  # changed live (a config field)
    now[0] = 1e6
    assert bucket.wait_s() == math.inf and bucket.tokens == pytest.approx(-1.5)
    with pytest.raises(ValueError):
        TokenBucket(-1.0, 1.0)
