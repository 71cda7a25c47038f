"""The chunks that left this node's last tier lately: the miss reason ``evicted`` (a miss of a chunk held
here a moment ago) and ``lookup --explain``'s "dropped N s ago" (answered to peers too: ``recent``)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from ..keys import ChunkKey

RECENT_DROPS = 4096  # chunks remembered as dropped


class RecentDrops:
    """The last ``size`` chunks dropped, newest last; safe from any thread (the locks of two tiers may
    call in at once)."""

    def __init__(self, size: int = RECENT_DROPS) -> None:
        self._size = size
        self._at: OrderedDict[ChunkKey, float] = OrderedDict()
        self._lock = threading.Lock()

    def dropped(self, key: ChunkKey) -> None:
        with self._lock:
            self._at[key] = time.monotonic()
            self._at.move_to_end(key)
            while len(self._at) > self._size:
                self._at.popitem(last=False)

    def returned(self, key: ChunkKey) -> None:
        """The chunk is held again."""
        if self._at:
            with self._lock:
                self._at.pop(key, None)

    def ago(self, keys: list[ChunkKey]) -> list[float | None]:
        """Seconds since each chunk left this node's last tier (None: not among the last ``size``)."""
        now = time.monotonic()
        with self._lock:
            return [None if (t := self._at.get(k)) is None else round(now - t, 3) for k in keys]
