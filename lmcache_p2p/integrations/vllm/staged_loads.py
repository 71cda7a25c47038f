"""The worker's one load skeleton, shared by exact prefix loads and segment loads:

    the load's deadline -> this rank's mirror given a moment to reach the scheduler's revision -> a plan
    -> the Loader (budget, pulls until the deadline, pinned verified slots) -> each chunk staged
    (a private copy, verified again) -> every pin released on the way out

What is done with a staged chunk (scattered into blocks, decoded for a blend) and how a failure is reported
to vLLM are the callers'. :func:`staged_chunks` is a context manager: the pins are released when its block
ends, however it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from ...estimates import PrefillRate
from ...ids import OBJECTS
from ...keys import ChunkKey
from ...load import Loader, StoppedLoader
from ...metrics import AgentMetrics
from ...plan import LOCAL, HitPlan
from ...tiers import TieredStore
from ...tiers.cpu_pool import Pin
from ...transfers import BlendTransfer, ChunkTransfer

log = logging.getLogger(__name__)
INDEX_WAIT_S = 0.5  # at most, per load, for this rank's mirror to reach the scheduler's (one event behind)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadParts:
    """What a worker's loads use of its agent, and nothing else of it.

    ``loader`` is read at each load: the agent's Loader while it runs, its StoppedLoader (every load a
    miss) from the moment it stops, so a load that comes across a stop needs no check of its own.
    ``timeout_s`` (``transfer.timeout_s``) is the longest a load may take; ``prefill`` the engine's
    measured prefill rate (what recomputing would cost)."""

    loader: Callable[[], Loader | StoppedLoader]
    metrics: AgentMetrics
    prefill: PrefillRate
    timeout_s: float

    def deadline(self, t: ChunkTransfer | BlendTransfer) -> float:
        """The load's absolute deadline, set by the scheduler side when it offered the hit (one host, one
        monotonic clock); never more than ``timeout_s`` from now (a rank on another host, whose clock
        differs, or a transfer from an older scheduler without one)."""
        latest = time.monotonic() + self.timeout_s
        return latest if t.deadline <= 0 else min(t.deadline, latest)


class StagedChunks:
    """A load's plan and its pins, chunk by chunk in the order of the keys asked for."""

    def __init__(self, tiers: TieredStore, metrics: AgentMetrics, req_id: str, plan: HitPlan,
                 pins: list[Pin | None], sources: list[str], plan_s: float, load_s: float) -> None:
        self.plan = plan
        self.sources = sources  # where each planned chunk came from: ``local cpu``, ``peer <node>``, ``objects``
        self.plan_s, self.load_s = plan_s, load_s
        self._tiers, self._metrics, self._req_id, self._pins = tiers, metrics, req_id, pins

    def pin(self, i: int) -> Pin | None:
        """Chunk ``i``'s pinned slot; None where it was not loaded (not planned, missed, late or declined)."""
        return self._pins[i] if i < len(self._pins) else None

    def stage(self, i: int) -> torch.Tensor | None:
        """A private verified copy of chunk ``i`` (valid until this thread's next stage); None where it was not
        loaded, or where its slot changed in memory after it was stored (dropped and counted)."""
        pin = self.pin(i)
        if pin is None:
            return None
        staged = self._tiers.cpu.stage(pin)
        if staged is None:
            self._metrics.checksum_failures.inc()
            log.warning("request %s: chunk %d changed in memory after it was stored; not used", self._req_id, i)
        return staged


@contextlib.contextmanager
def staged_chunks(parts: LoadParts, t: ChunkTransfer | BlendTransfer, keys: Sequence[ChunkKey],
                  num_tokens: Sequence[int], remote: bool) -> Iterator[StagedChunks]:
    """Plan and load ``keys`` (chunks of ``num_tokens`` tokens each, one run) for ``t``'s request: ``remote``,
    what peers and the object store hold too (a load thread); else only what this node holds now (the forward
    thread)."""
    started = time.perf_counter()
    spans, end = [], 0
    for n in num_tokens:
        spans.append((end, end + n))
        end += n
    deadline = parts.deadline(t)  # the load path is read at each step: a stop meanwhile makes the rest a miss
    if remote and keys and not parts.loader().wait_for_index(keys, t.index_revision,
                                                             min(deadline, time.monotonic() + INDEX_WAIT_S)):
        log.info("request %s: this rank's mirror did not reach the scheduler's revision %d in time", t.req_id,
                 t.index_revision)
    plan = parts.loader().plan(keys, spans, end)
    tiers = parts.loader().tiers  # the agent's one store, the same for either load path
    sources = [_source_of(tiers, c.key, c.source) for c in plan.chunks]  # before the load moves them
    planned = time.perf_counter()
    pins = (parts.loader().load_pinned(plan, deadline, remote=remote, label=f"request {t.req_id}: ")
            if plan.chunks else [])
    try:
        yield StagedChunks(tiers, parts.metrics, t.req_id, plan, pins, sources, planned - started,
                           time.perf_counter() - planned)
    finally:
        for pin in pins:
            if pin is not None:
                tiers.cpu.unpin(pin)


def _source_of(tiers: TieredStore, key: ChunkKey, source: str) -> str:
    if source == LOCAL:
        return f"local {tiers.where(key) or 'cpu'}"
    return "objects" if source == OBJECTS else f"peer {source}"
