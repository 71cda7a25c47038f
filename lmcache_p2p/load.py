"""Loading a hit plan: the one path from a plan to verified chunks, for the engine and the agent's API.

    plan ──budget──▶ the leading chunks whose pulls beat recomputing (remote loads only)
         ──pull────▶ peers' chunks into the CPU pool, verified on arrival, until the deadline
         ──pin─────▶ one pinned, re-verified CPU slot per chunk (None: not to be had; the caller
                     recomputes it and everything after it)

The worker connector (``integrations/vllm/worker.py``) scatters the pins into the engine's
blocks; :meth:`CacheAgent.load` copies them out. Both go through :func:`load_pinned`.

One deadline: absolute, on ``time.monotonic()`` (one clock for every process of a host, so the
scheduler side sets it when it offers the hit and its workers keep it). The budget may only bring
it closer (a pull expected to take 5 ms gets ~15 ms, not the request's whole allowance); it then
goes unchanged to :meth:`Puller.pull` and the transports. Nothing converts it back and forth.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from .aio import remaining
from .keys import ChunkKey
from .metrics import AgentMetrics
from .plan import LOCAL, FetchBudget, HitPlan, PlannedChunk
from .tiers import Pin

log = logging.getLogger(__name__)


class Loading(Protocol):
    """What a load uses of its agent (:class:`~lmcache_p2p.agent.CacheAgent`)."""

    metrics: AgentMetrics

    def budget(self, plan: HitPlan, left_s: float | None = None) -> FetchBudget: ...

    def holds(self, key: ChunkKey) -> bool: ...

    def pull(self, chunks: Sequence[PlannedChunk], deadline: float, patience: float | None = None) -> None: ...

    def pin_chunk(self, chunk: PlannedChunk, *, remote: bool) -> Pin | None: ...


def budgeted(node: Loading, plan: HitPlan, deadline: float, label: str = "") -> tuple[FetchBudget, float]:
    """The budget: ``plan`` cut to the pulls expected to beat recomputing and to finish before
    ``deadline`` (the load may have queued behind others), and ``deadline`` brought as close as the
    kept pulls' own allowance. Each decision is counted (``fetch_decisions_total``: pull,
    recompute_faster, deadline; the declined ones in ``load_failures_total`` too)."""
    budget = node.budget(plan, left_s=remaining(deadline))
    declined = len(plan.chunks) - len(budget.plan.chunks)
    metrics = node.metrics
    pulled = sum(1 for c in budget.plan.chunks if c.source != LOCAL)
    if pulled:
        metrics.fetch_decisions.labels("pull").inc(pulled)
    if budget.late:
        metrics.fetch_decisions.labels("deadline").inc(budget.late)
        metrics.load_failures.labels("deadline").inc(budget.late)
    if declined > budget.late:
        metrics.fetch_decisions.labels("recompute_faster").inc(declined - budget.late)
        metrics.load_failures.labels("recompute_faster").inc(declined - budget.late)
    if declined:
        why = ""
        if budget.declined_at is not None:
            pull_s, recompute_s = budget.declined_at
            why = (f"; the first declined as slower than recomputing: pull expected {1e3 * pull_s:.1f} ms, "
                   f"recompute {1e3 * recompute_s:.1f} ms")
        log.info("%spulling %d of %d chunks, recomputing the rest (%d not expected in the %.1f ms left%s)", label,
                 len(budget.plan.chunks), len(plan.chunks), budget.late, 1e3 * remaining(deadline), why)
    kept = min(deadline, time.monotonic() + budget.deadline_s)
    log.debug("%sbudget: %d chunks, expected %.1f ms, recompute %s, deadline in %.1f ms", label,
              len(budget.plan.chunks), 1e3 * budget.expected_s,
              "unknown" if budget.recompute_s is None else f"{1e3 * budget.recompute_s:.1f} ms",
              1e3 * (kept - time.monotonic()))
    return budget, kept


def load_pinned(node: Loading, plan: HitPlan, deadline: float, *, remote: bool = True,
                label: str = "") -> list[Pin | None]:
    """One pin (or None) per chunk of ``plan``; the caller unpins every pin it got.

    ``remote``: budget the plan, pull what peers hold until ``deadline``, read what the disk tier
    holds until ``deadline``. Without it, or past the deadline, nothing is pulled and no disk is read
    (the caller is the engine's forward thread, or the engine has waited long enough): only what the
    CPU pool holds now is pinned, and disk chunks are promoted in the background for the next request.
    Chunks the budget declined are None.
    """
    kept, late, load_deadline = plan, set(), deadline
    if remote:
        budget, deadline = budgeted(node, plan, deadline, label)
        kept = budget.plan
        pulls = [c for c in kept.chunks if c.source != LOCAL and not node.holds(c.key)]
        if pulls and remaining(deadline) <= 0:
            # Queued past its deadline (behind other loads, or its mirror's wait): asking a peer now
            # would only hold it while an answer nobody waits for arrives. The engine recomputes.
            late = {c.key for c in pulls}
            node.metrics.load_failures.labels("deadline").inc(len(late))
            log.info("%sdeadline passed before %d pulls started; recomputed", label, len(late))
        elif pulls:
            started = time.monotonic()
            # An answer still arriving at the deadline is worth waiting for while it keeps coming, as
            # long as the engine could not have computed the tokens sooner (nor past the load's deadline).
            patience = load_deadline if budget.recompute_s is None else min(load_deadline,
                                                                            started + budget.recompute_s)
            node.pull(pulls, deadline, patience if patience > deadline else None)
            if budget.expected_s > 0 and len(pulls) == sum(1 for c in kept.chunks if c.source != LOCAL):
                node.metrics.estimate_ratio.labels("pull").observe((time.monotonic() - started) / budget.expected_s)
    pins = [None if chunk.key in late else node.pin_chunk(chunk, remote=remote and remaining(load_deadline) > 0)
            for chunk in kept.chunks]
    return pins + [None] * (len(plan.chunks) - len(kept.chunks))
