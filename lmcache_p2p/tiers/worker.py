"""The tier worker: the one thread that does disk I/O for the tiered store.

    CPU victim (copied out of its slot) ──▶ queue ──▶ write the file
    promote(key)                        ──▶ queue ──▶ read the file into a CPU slot (verified), commit

No disk I/O runs under a pool lock, on the agent's event loop or on the engine's forward-pass
thread: they only enqueue. The store bounds the bytes staged for write-back; the queue itself is
bounded too (an overflow is skipped and counted, never waited for).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from .. import cputime
from ..errors import LMCacheP2PError
from ..keys import ChunkKey

log = logging.getLogger(__name__)

MAX_QUEUE = 4096


class TierWorker:
    def __init__(self, write_back: Callable[[ChunkKey], None], promote: Callable[[ChunkKey], bool],
                 name: str = "lmcache-p2p-tiers") -> None:
        self._write_back = write_back
        self._promote = promote
        self._queue: queue.Queue[tuple[str, ChunkKey] | None] = queue.Queue(MAX_QUEUE)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.skipped = 0
        self.errors = 0
        self._thread.start()

    def write_back(self, key: ChunkKey) -> None:
        self._put(("w", key))

    def promote(self, key: ChunkKey) -> None:
        self._put(("p", key))

    def _put(self, item: tuple[str, ChunkKey]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.skipped += 1

    @property
    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def drain(self, timeout: float) -> bool:
        """Wait until everything queued so far is done (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        cputime.register("tiers")
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    cputime.finish()
                    return
                op, key = item
                if op == "w":
                    self._write_back(key)
                else:
                    self._promote(key)
            except (LMCacheP2PError, OSError) as exc:
                self.errors += 1
                log.warning("tier worker: %s failed: %s", item, exc)
            except Exception:
                self.errors += 1
                log.exception("tier worker: unexpected error on %s", item)
            finally:
                self._queue.task_done()
