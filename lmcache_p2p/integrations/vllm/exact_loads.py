"""Exact prefix loads on the worker side: a hit's chunks into the request's blocks.

    the load skeleton (``staged_loads.py``: plan, the Loader, a private verified copy of each
    chunk) -> scattered into the engine's blocks

A chunk that fails, and every later one, is returned by block id: vLLM recomputes them (fail closed).
"""

from __future__ import annotations

import logging
import time

import torch

from ...kernels.paged import PagedKV
from ...keys import ChunkKey
from ...plan import LOCAL
from ...transfers import ChunkTransfer, blocks_from
from .staged_loads import LoadParts, staged_chunks

log = logging.getLogger(__name__)


class ExactLoads:
    """Loads of exact prefixes into the engine's paged KV (``kv``: None in tests without an engine)."""

    def __init__(self, parts: LoadParts, kv: PagedKV | None, num_layers: int) -> None:
        self.parts = parts
        self.kv = kv
        self.num_layers = num_layers

    def load(self, t: ChunkTransfer, remote: bool) -> set[int]:
        """Load ``t``'s chunks into its blocks; returns the blocks that must be recomputed. ``remote``: pull
        what peers hold (a load thread); else only what this node holds now (the forward thread)."""
        kv, metrics = self.kv, self.parts.metrics
        assert kv is not None
        t0 = time.perf_counter()
        keys = [ChunkKey(k) for k in t.keys]
        failed: set[int] = set()
        loaded = len(t.block_ids)  # chunks in place: all, or those before the first that failed
        with staged_chunks(self.parts, t, keys, t.num_tokens, remote) as load:
            plan, sources = load.plan, load.sources
            t2 = time.perf_counter()
            for i, blocks in enumerate(t.block_ids):
                pin = load.pin(i)
                if pin is not None and pin.header.length != kv.payload_nbytes(len(blocks)):
                    log.error("request %s: chunk %d is %d bytes, its %d blocks need %d: layout mismatch", t.req_id,
                              i, pin.header.length, len(blocks), kv.payload_nbytes(len(blocks)))
                    metrics.count_misses("load_failed", t.num_tokens[i])
                    failed, loaded = blocks_from(t, i), i
                    break
                if pin is None:
                    failed, loaded = blocks_from(t, i), i
                    if i >= len(plan.chunks):  # offered by the scheduler side, but no owner this worker may ask
                        metrics.load_failures.labels("no_usable_owner").inc(len(keys) - i)
                        metrics.count_misses("owner_unusable", sum(t.num_tokens[i:]))
                    why = ("no usable owner (backed off, awaited for an overdue answer, or gone)"
                           if i >= len(plan.chunks) else "its pull missed or was declined")
                    log.info("request %s: chunk %d of %d not loaded: %s; %d blocks recomputed", t.req_id, i,
                             len(keys), why, len(failed))
                    break
                # Scattered from a private copy verified there: pool slots are registered memory a peer
                # may write to, so bytes checked in a slot are not the bytes the engine would read.
                staged = load.stage(i)
                if staged is None:
                    metrics.count_misses("load_failed", t.num_tokens[i])
                    failed, loaded = blocks_from(t, i), i
                    log.info("request %s: %d blocks recomputed from chunk %d on", t.req_id, len(failed), i)
                    break
                self._scatter(staged, blocks, t.skip_blocks if i == 0 else 0)
        log.debug("request %s: %d chunks (%d from peers) plan %.2f ms, load %.2f ms, scatter %.2f ms", t.req_id,
                  len(keys), len(plan.chunks) - len(plan.by_source().get(LOCAL, [])), 1e3 * load.plan_s,
                  1e3 * load.load_s, 1e3 * (time.perf_counter() - t2))
        metrics.lookups.inc()
        self.parts.loader().count_hits(plan.chunks[:loaded])  # chunks after a failed one are recomputed with it
        outcome = "full" if loaded == len(keys) else "partial" if loaded else "none"
        metrics.load_seconds.labels(outcome).observe(time.perf_counter() - t0)
        if loaded and sources:  # one line per request a hit served: that the mesh works shows in the engine's own log
            by: dict[str, int] = {}
            for i in range(min(loaded, len(sources))):
                by[sources[i]] = by.get(sources[i], 0) + t.num_tokens[i]
            log.info("request %s: %d tokens from cache (%s) in %.1f ms%s", t.req_id, sum(by.values()),
                     ", ".join(f"{name} {n}" for name, n in by.items()), 1e3 * (time.perf_counter() - t0),
                     f"; {len(failed)} blocks recomputed" if failed else "")
        return failed

    def _scatter(self, staging: torch.Tensor, blocks: list[int], skip: int) -> None:
        kv = self.kv
        assert kv is not None
        nbytes = kv.payload_nbytes(len(blocks))
        payload = staging[:nbytes]
        if skip:
            # Payload is head-major, then layer-major; drop the first ``skip`` blocks of every head and
            # layer (they belong to vLLM's own prefix cache and may be shared with other requests).
            heads, layers = kv.geometry.heads, self.num_layers
            parts = payload.view(heads, layers, len(blocks), kv.payload_nbytes(1) // (layers * heads))
            payload = parts[:, :, skip:, :].contiguous().view(-1)
            blocks = blocks[skip:]
        if blocks:
            kv.scatter(payload, torch.tensor(blocks, dtype=torch.int64))
