"""The fetch-or-recompute budget and the estimates it decides by (pure functions, no I/O)."""

from __future__ import annotations

import pytest

from lmcache_p2p.estimates import FADE_HALF_LIFE_S, PRIOR_LATENCY_S, PeerEstimates, PrefillRate
from lmcache_p2p.ids import NodeId
from lmcache_p2p.keys import ChunkKey
from lmcache_p2p.plan import (
    DEADLINE_SLACK_S,
    FIRST_CONTACT_S,
    LOCAL,
    SILENCE_SHARE,
    HitPlan,
    PlannedChunk,
    fetch_budget,
)

MiB = 1 << 20


def plan_of(*sources: str) -> HitPlan:
    chunks = tuple(PlannedChunk(i, ChunkKey(bytes([i]) * 16), 256 * i, 256 * (i + 1), NodeId(s))
                   for i, s in enumerate(sources))
    return HitPlan(256 * len(sources), chunks)


def budget(plan: HitPlan, per_peer_s_per_chunk: dict[str, float], tokens_per_s: float | None, max_s: float = 5.0):
    return fetch_budget(plan, chunk_bytes=lambda c: MiB,
                        expected_s=lambda peer, nbytes: per_peer_s_per_chunk[peer] * nbytes / MiB,
                        recompute_s=lambda t: None if tokens_per_s is None else t / tokens_per_s, max_s=max_s)


def test_all_local_needs_no_deadline() -> None:
    b = budget(plan_of(LOCAL, LOCAL), {}, 1000.0)
    assert len(b.plan.chunks) == 2 and b.expected_s == 0.0 and b.deadline_s == DEADLINE_SLACK_S


def test_fast_peer_is_pulled_with_a_deadline_from_its_expected_time() -> None:
    b = budget(plan_of(LOCAL, "a", "a", "b"), {"a": 0.002, "b": 0.003}, 10_000.0)  # recompute: 25.6 ms/chunk
    assert len(b.plan.chunks) == 4
    assert b.expected_s == pytest.approx(0.004)  # a's two chunks in a row; b's in parallel
    assert b.deadline_s == pytest.approx(0.012)  # 3 x expected
    assert b.recompute_s == pytest.approx(768 / 10_000)


def test_a_peer_slower_than_recompute_is_not_asked() -> None:
    b = budget(plan_of(LOCAL, "slow", "slow"), {"slow": 1.0}, 10_000.0)
    assert [c.source for c in b.plan.chunks] == [LOCAL]
    assert b.declined_at == pytest.approx((1.0, 256 / 10_000))  # the two estimates the choice was made by
    assert budget(plan_of(LOCAL, "a"), {"a": 0.001}, 10_000.0).declined_at is None


def test_the_cut_keeps_the_longest_worthwhile_prefix_and_the_local_chunks_after_it() -> None:
    # fast peer for two chunks, then a slow one: the slow chunk and what follows are recomputed
    b = budget(plan_of("a", LOCAL, "slow", LOCAL), {"a": 0.001, "slow": 10.0}, 1000.0)
    assert [c.source for c in b.plan.chunks] == ["a", LOCAL]
    b = budget(plan_of("a", LOCAL, LOCAL), {"a": 0.001}, 1000.0)
    assert len(b.plan.chunks) == 3


def test_without_a_prefill_rate_every_pull_is_kept_and_the_deadline_is_bounded() -> None:
    b = budget(plan_of("a", "a"), {"a": 10.0}, None, max_s=5.0)
    assert len(b.plan.chunks) == 2 and b.deadline_s == 5.0 and b.recompute_s is None


def test_without_a_prefill_rate_a_fast_peer_still_gets_the_whole_allowance() -> None:
    # nothing is known to be faster than waiting: a scheduling hiccup must not turn a hit into a miss
    b = budget(plan_of("a", "a"), {"a": 0.001}, None, max_s=5.0)
    assert len(b.plan.chunks) == 2 and b.deadline_s == 5.0


def test_a_peer_never_measured_gets_the_recompute_time() -> None:
    b = fetch_budget(plan_of("new"), chunk_bytes=lambda c: MiB, expected_s=lambda peer, nbytes: 0.002,
                     recompute_s=lambda t: t / 1000, max_s=5.0, known=lambda peer: False)
    assert b.deadline_s == pytest.approx(FIRST_CONTACT_S)  # not 3 x a guess: its first pull also connects
    # and its silence is not cut to a share of the recompute time: a late first ack is not a hung owner
    assert b.silence_s is None
    b = fetch_budget(plan_of("new", "new", "new", "new", "new", "new"), chunk_bytes=lambda c: MiB,
                     expected_s=lambda peer, nbytes: 0.002, recompute_s=lambda t: t / 1000, max_s=5.0,
                     known=lambda peer: False)
    assert b.deadline_s == pytest.approx(1.536)  # the recompute time when that is longer
    b = fetch_budget(plan_of("new"), chunk_bytes=lambda c: MiB, expected_s=lambda peer, nbytes: 0.002,
                     recompute_s=lambda t: None, max_s=5.0, known=lambda peer: False)
    assert b.deadline_s == 5.0


def test_a_measured_owner_may_stay_silent_for_a_share_of_the_recompute_time() -> None:
    b = budget(plan_of(LOCAL, "a", "a"), {"a": 0.002}, 10_000.0)
    assert b.silence_s == pytest.approx(512 / 10_000 / SILENCE_SHARE)
    assert budget(plan_of("a"), {"a": 0.001}, None).silence_s is None  # no recompute to weigh against


def test_the_deadline_never_exceeds_recompute() -> None:
    b = budget(plan_of("a"), {"a": 0.02}, 10_000.0)  # expected 20 ms, recompute 25.6 ms
    assert b.deadline_s == pytest.approx(0.0256)


def test_a_pull_not_expected_to_finish_in_the_time_left_is_not_started() -> None:
    """A load that queued behind others has less time left than its deadline once gave: the pulls that
    would overrun it are declined as late, the ones that fit are kept (recompute would take longer)."""
    plan = plan_of(LOCAL, "a", "a", "a")
    rates = {"a": 0.010}  # 10 ms a chunk, one after another; recompute 25.6 ms a chunk
    assert budget(plan, rates, 10_000.0).late == 0 and len(budget(plan, rates, 10_000.0).plan.chunks) == 4
    b = fetch_budget(plan, chunk_bytes=lambda c: MiB, expected_s=lambda peer, nbytes: 0.010 * nbytes / MiB,
                     recompute_s=lambda t: t / 10_000.0, max_s=5.0, left_s=0.025)
    assert [c.source for c in b.plan.chunks] == [LOCAL, "a", "a"] and b.late == 1
    # without a prefill rate too: nothing is known to beat waiting, but what cannot finish is not started
    b = fetch_budget(plan, chunk_bytes=lambda c: MiB, expected_s=lambda peer, nbytes: 0.010 * nbytes / MiB,
                     recompute_s=lambda t: None, max_s=5.0, left_s=0.015)
    assert [c.source for c in b.plan.chunks] == [LOCAL, "a"] and b.late == 2
    # a chunk declined as slower than recompute is not late
    b = fetch_budget(plan_of(LOCAL, "slow"), chunk_bytes=lambda c: MiB, expected_s=lambda peer, nbytes: 1.0,
                     recompute_s=lambda t: t / 10_000.0, max_s=5.0, left_s=0.001)
    assert len(b.plan.chunks) == 1 and b.late == 0


def test_peer_estimates_learn_from_pulls() -> None:
    est = PeerEstimates()
    assert est.expected_s("x", 0) == PRIOR_LATENCY_S and not est.known("x")
    for _ in range(20):
        est.observe("x", 8 * MiB, 0.004)  # 2 GB/s, fixed costs included
        est.observe("x", 1024, 0.0005)
    assert est.known("x") and est.expected_s("x", 8 * MiB) == pytest.approx(0.004, rel=0.01)
    assert est.expected_s("x", 1024) == pytest.approx(0.0005, rel=0.01)
    assert est.expected_s("y", 8 * MiB) > est.expected_s("x", 8 * MiB)  # unknown peers get less credit


def test_a_peer_measured_slow_is_asked_again_once_its_estimate_fades() -> None:
    """One slow pull (a load spike) must not keep a peer out of every plan: without new measurements its
    estimate fades back to the prior, so it gets asked (and measured) again."""
    now = [100.0]
    est = PeerEstimates(clock=lambda: now[0])
    est.observe("x", 8 * MiB, 2.0)  # 4 MB/s
    slow = est.expected_s("x", 8 * MiB)
    assert slow == pytest.approx(2.0)
    now[0] += FADE_HALF_LIFE_S
    assert est.expected_s("x", 8 * MiB) == pytest.approx((slow + est.expected_s("y", 8 * MiB)) / 2)
    now[0] += 10 * FADE_HALF_LIFE_S
    assert est.expected_s("x", 8 * MiB) < 0.02 and est.known("x")  # back near the prior
    est.observe("x", 8 * MiB, 2.0)  # measured slow again: blended with what was believed just before
    assert 0.5 < est.expected_s("x", 8 * MiB) < 2.0
    est.observe("z", 64 * MiB, 0.008)  # 8 GB/s: better than the prior, kept however long it goes unmeasured
    now[0] += 100 * FADE_HALF_LIFE_S
    assert est.expected_s("z", 64 * MiB) == pytest.approx(0.008)


def test_a_peer_whose_answers_land_late_now_and_then_gets_a_wider_deadline_up_to_recompute() -> None:
    """A steady peer keeps a tight deadline; one whose pulls land tens of ms off now and then (a busy host:
    seen, 5 chunks expected at ~6 ms arrived after 79 ms) gets 4 deviations of margin, never past recompute."""
    now = [0.0]
    steady, noisy = PeerEstimates(clock=lambda: now[0]), PeerEstimates(clock=lambda: now[0])
    for i in range(20):
        steady.observe("a", 5 * MiB, 0.006)
        noisy.observe("a", 5 * MiB, 0.080 if i % 4 == 3 else 0.006)
    assert steady.deviation_s("a") == pytest.approx(0.0, abs=1e-9)
    assert noisy.deviation_s("a") > 0.01

    def deadline(est: PeerEstimates, tokens_per_s: float) -> float:
        return fetch_budget(plan_of("a"), chunk_bytes=lambda c: MiB, expected_s=est.expected_s,
                            recompute_s=lambda t: t / tokens_per_s, max_s=5.0, known=est.known,
                            deviation_s=est.deviation_s).deadline_s

    expected = noisy.expected_s("a", MiB)
    assert deadline(steady, 1000.0) == pytest.approx(3 * steady.expected_s("a", MiB))
    assert deadline(noisy, 1000.0) == pytest.approx(expected + 4 * noisy.deviation_s("a"))
    assert deadline(noisy, 1000.0) > 3 * expected
    assert deadline(noisy, 10_000.0) == pytest.approx(max(0.0256, expected))  # capped at the recompute time
    now[0] += 10 * FADE_HALF_LIFE_S  # nothing measured for a while: the deviation fades
    assert noisy.deviation_s("a") < 0.001 * 4


def test_prefill_rate_ignores_decode_steps() -> None:
    rate = PrefillRate()
    assert rate.recompute_s(1000) is None
    rate.observe(1, 0.005)  # a decode step
    assert rate.tokens_per_s is None
    rate.observe(2048, 0.2)
    assert rate.recompute_s(1024) == pytest.approx(0.1)


def test_the_prefill_fit_tells_a_steps_fixed_cost_from_its_cost_per_token() -> None:
    """Steps of mixed sizes on an engine whose step costs 20 ms plus 0.1 ms a token (with 5 % noise): the
    fit predicts each step within 10 %; one rate through the origin (what the planner had) was off by more
    than 1.5x on the small steps. Steps of one size cannot tell the two apart: one rate, as before."""
    import random

    rng = random.Random(7)
    rate = PrefillRate()
    sizes = [2048, 150, 600, 2048, 256, 1200, 180, 2048, 400, 900] * 3
    old_rate = None  # the single rate of before: an exponentially weighted mean of tokens/second, gain 0.3
    worst_old = worst_new = 1.0
    for tokens in sizes:
        seconds = (0.020 + 0.0001 * tokens) * rng.uniform(0.95, 1.05)
        predicted = rate.recompute_s(tokens)
        if predicted is not None and rate.samples >= 10:
            worst_new = max(worst_new, seconds / predicted, predicted / seconds)
            assert old_rate is not None
            worst_old = max(worst_old, seconds * old_rate / tokens, tokens / old_rate / seconds)
        rate.observe(tokens, seconds)
        old_rate = tokens / seconds if old_rate is None else 0.7 * old_rate + 0.3 * tokens / seconds
    assert worst_new < 1.10 and worst_old > 1.5, (worst_new, worst_old)
    assert rate.overhead_s == pytest.approx(0.020, rel=0.25)
    assert rate.tokens_per_s == pytest.approx(10_000, rel=0.1)
    assert rate.recompute_s(1000) == pytest.approx(0.12, rel=0.1)

    steady = PrefillRate()
    for _ in range(5):
        steady.observe(2048, 0.2)
    assert steady.overhead_s == 0.0 and steady.recompute_s(1024) == pytest.approx(0.1)
