"""Canary checks on the worker side (``canary.py``): what the engine computed for a canary request's
full chunks, copied on the forward thread (its blocks are reused after the step), then held against
every owner's copy on the canary thread.

At most ``CANARY_MAX_PENDING`` checks wait, each of at most ``CANARY_MAX_CHUNKS`` chunks: a flood of
canary requests is skipped, and a failure here only skips the check.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

import torch

from ... import cputime
from ...aio import unpin_thread
from ...canary import Canary
from ...kernels.paged import PagedKV
from ...keys import ChunkKey
from ...transfers import ChunkTransfer

log = logging.getLogger(__name__)
CANARY_MAX_PENDING = 4  # canary checks waiting for the canary thread (the references are held in memory)
CANARY_MAX_CHUNKS = 16  # full chunks one canary check compares (the reference is copied on the forward thread)


class CanaryChecks:
    def __init__(self, canary: Canary, kv: PagedKV, chunk_size: int) -> None:
        self.canary = canary
        self.kv = kv
        self.chunk_size = chunk_size
        self._checks: list[concurrent.futures.Future[Any]] = []  # submitted, not yet done
        self._checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-p2p-canary",
                                                              initializer=cputime.initializer("canary", unpin_thread))

    def check_later(self, t: ChunkTransfer) -> None:
        """Copy what the engine computed for each full chunk of ``t``, then compare every owner's copy with
        it on the canary thread."""
        self._checks = [f for f in self._checks if not f.done()]
        if len(self._checks) >= CANARY_MAX_PENDING:
            log.warning("request %s: %d canary checks are waiting; this one is skipped", t.req_id, len(self._checks))
            return
        chunks: list[tuple[ChunkKey, int, int, bytes]] = []
        start = 0
        try:
            for key, ntok, blocks in zip(t.keys, t.num_tokens, t.block_ids, strict=True):
                if ntok == self.chunk_size and blocks and len(chunks) < CANARY_MAX_CHUNKS:
                    out = torch.empty(self.kv.payload_nbytes(len(blocks)), dtype=torch.uint8)
                    self.kv.gather(torch.tensor(blocks, dtype=torch.int64), out)
                    chunks.append((ChunkKey(key), start, start + ntok, out.numpy().tobytes()))
                start += ntok
        except Exception as exc:  # a cache problem must never become a serving problem
            log.warning("request %s: canary gather failed, no check: %s", t.req_id, exc)
            return
        if chunks:
            future = self._checker.submit(self.canary.check, chunks)
            future.add_done_callback(_log_failure)
            self._checks.append(future)

    def shutdown(self) -> None:
        self._checker.shutdown(wait=True, cancel_futures=True)


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("canary check failed", exc_info=future.exception())
