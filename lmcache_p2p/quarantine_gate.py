"""What a quarantine means for the chunks this node holds (``index/quarantine.py`` is the records and their
watch; the planners skip a quarantined owner there).

A chunk a quarantined node computed (its header's origin names that node's engine) is never admitted here,
the copies held of it are dropped when the quarantine arrives, and none is recovered from disk at start. A
quarantined node keeps its own chunks: its engine reads them as it computes them, and no other planner takes
them from it. The canary (``canary.py``) writes the records through :meth:`QuarantineGate.add`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import Counter

from .aio import TaskSet
from .chunk import ChunkHeader
from .ids import NodeDigest
from .index.client import EtcdClient
from .index.quarantine import Quarantine, QuarantineRecord
from .index.schema import Rejects, Schema
from .tiers import TieredStore

log = logging.getLogger(__name__)


class QuarantineGate:
    def __init__(self, origin: NodeDigest, tiers: TieredStore, removed: Callable[[], Any],
                 tasks: TaskSet) -> None:
        """``origin``: this node's engine's; ``removed()``: the counter of chunks removed for a quarantine
        (``invalidation_removed_chunks_total{reason="quarantine"}``); ``tasks``: where its loop tasks are kept."""
        self._origin = origin
        self._tiers = tiers
        self._removed = removed
        self._tasks = tasks
        self.quarantine: Quarantine | None = None  # the records, once etcd is there (:meth:`start`)

    def blocks(self, header: ChunkHeader) -> bool:
        """The chunk was computed by a quarantined node other than this one (wherever it is held: a pulled
        copy, an object)."""
        return (self.quarantine is not None and header.origin != self._origin
                and self.quarantine.blocks_origin(header.origin))

    def refused(self, header: ChunkHeader) -> bool:
        """The store's admission: the chunk is blocked (:meth:`blocks`), and counted removed."""
        if not self.blocks(header):
            return False
        counter: Counter = self._removed()
        counter.inc()
        return True

    def drop(self, headers: Sequence[ChunkHeader]) -> list[ChunkHeader]:
        """Remove (blocking) the chunks of ``headers`` a quarantined node computed; the others."""
        keep, dropped = [], 0
        for header in headers:
            if self.blocks(header):
                dropped += self._tiers.remove(header.key)
            else:
                keep.append(header)
        if dropped:
            self._removed().inc(dropped)
            log.warning("dropped %d chunks computed by a quarantined node (copies this node held)", dropped)
        return keep

    async def start(self, client: EtcdClient, schema: Schema, rejects: Rejects, wait_s: float) -> Quarantine:
        """Follow the records (on the loop); waits up to ``wait_s`` for the first read."""
        self.quarantine = Quarantine(client, schema, rejects=rejects, on_quarantined=self._on_quarantined)
        await self.quarantine.start(wait_s)
        return self.quarantine

    async def stop(self) -> None:
        quarantine, self.quarantine = self.quarantine, None
        if quarantine is not None:
            await quarantine.stop()

    async def add(self, record: QuarantineRecord, ttl_s: float | None) -> None:
        """Quarantine ``record.node`` (obeyed here at once; see :meth:`Quarantine.add`)."""
        if self.quarantine is None:
            raise RuntimeError(f"cannot quarantine {record.node} without etcd")
        await self.quarantine.add(record, ttl_s)

    def _on_quarantined(self, _origins: frozenset[bytes]) -> None:
        """(on the loop) A node was quarantined: drop the copies this node holds of chunks it computed."""
        tiers = self._tiers
        self._tasks.spawn(asyncio.to_thread(
            lambda: self.drop([h for h in map(tiers.header, tiers.inventory()) if h is not None])), "quarantine-drop")
