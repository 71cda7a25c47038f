"""How the chunks this node's engine computes come into its tiers: each gets its header (checksum, the mesh's
invalidation epoch, this rank's heads, this engine's origin), passes the tiers' admission (nothing a standing
invalidation covers, nor a quarantined node computed) and is announced by the tiers' listener, all on one
writer thread behind the caller: the engine's save path returns at once.

Two ways in: :meth:`Intake.store_chunks` copies finished payloads; :meth:`Intake.reserve` hands out a CPU slot
to fill in place (the worker gathers a chunk from the engine's KV blocks straight into it), then
:meth:`Intake.commit` (or :meth:`Intake.release`, to give it back unfilled).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from . import cputime
from .chunk import make_header
from .errors import TierError
from .ids import NodeDigest
from .keys import ChunkKey, FingerprintDigest, HeadRange
from .tiers import Reservation, TieredStore

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, tiers: TieredStore, fp: FingerprintDigest, heads: HeadRange, origin: NodeDigest,
                 epoch: Callable[[], int], stored: Counter) -> None:
        self._tiers = tiers
        self._fp = fp
        self._heads = heads
        self._origin = origin
        self._epoch = epoch  # the mesh's invalidation epoch now (``MeshInvalidation.epoch``)
        self._stored = stored  # lmcache_p2p_stored_chunks_total
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-p2p-store",
                                                             initializer=cputime.initializer("store"))

    def store_chunks(self, keys: Sequence[ChunkKey], num_tokens: Sequence[int],
                     chunks: Sequence[memoryview]) -> concurrent.futures.Future[int]:
        """Store chunks in the background; how many were stored (not held already, nor refused). The caller
        must not modify ``chunks`` until the future is done."""
        if not len(keys) == len(num_tokens) == len(chunks):
            raise ValueError("keys, num_tokens and chunks must have the same length")
        return self._writer.submit(self._store_now, list(keys), list(num_tokens), list(chunks))

    def holds(self, key: ChunkKey) -> bool:
        """This node holds the chunk, in some tier, with the heads its engine computes."""
        return self._tiers.holds(key, self._heads)

    def reserve(self) -> Reservation:
        """A CPU slot to fill in place (e.g. a gather from the engine's KV cache), then :meth:`commit`."""
        return self._tiers.cpu.reserve()

    def release(self, reservation: Reservation) -> None:
        self._tiers.cpu.release(reservation)

    def commit(self, reservation: Reservation, key: ChunkKey, num_tokens: int,
               length: int) -> concurrent.futures.Future[None]:
        """Checksum, commit and announce a filled slot in the background."""
        return self._writer.submit(self._commit_now, reservation, key, num_tokens, length)

    def drain(self, timeout: float) -> None:
        """Wait until what was handed in before this call is stored (or refused)."""
        self._writer.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """Finish what was handed in; nothing more is taken."""
        self._writer.shutdown(wait=True)

    def _commit_now(self, reservation: Reservation, key: ChunkKey, num_tokens: int, length: int) -> None:
        try:
            header = make_header(key, self._fp, reservation.view[:length], num_tokens, self._epoch(),
                                 heads=self._heads, origin=self._origin)
        except BaseException:
            self._tiers.cpu.release(reservation)
            raise
        if self._tiers.commit_reserved(reservation, header):  # releases the slot itself when refused
            self._stored.inc()

    def _store_now(self, keys: list[ChunkKey], num_tokens: list[int], chunks: list[memoryview]) -> int:
        stored = 0
        for key, ntok, payload in zip(keys, num_tokens, chunks, strict=True):
            if self.holds(key):
                continue
            try:
                if self._tiers.put(key, self._fp, payload, ntok, self._epoch(), self._heads, self._origin) is None:
                    continue  # covered by a standing invalidation
            except TierError as exc:
                log.warning("store of %s skipped: %s", key.hex(), exc)
                continue
            stored += 1
            self._stored.inc()
        return stored
