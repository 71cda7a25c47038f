"""One resumable watch of an etcd prefix: the only watch loop in lmcache-p2p.

    sync:    range read of the prefix at revision R  ->  load(kvs, R)
    follow:  watch from R+1  ->  apply(events) per batch; progress notifications advance R
    break:   (member down, leader lost, silent stream)  ->  back off, resume from R+1
    history gone (compacted, or etcd's revision went backwards)  ->  one resync, then follow
    resync() (etcd replaced under a stream that did not notice)  ->  the same, asked for

A sync that finds etcd's revision below the one already seen (a fresh or restored etcd) calls
``on_rewind(seen, now)`` before ``load``. The mirror, invalidation (and its generation record) and
the cluster-config watcher each own one. Callbacks run on the loop and must not raise; if one
does, the batch is skipped, counted in ``callback_errors`` and logged, and the watch goes on: a
supervised loop never dies silently (``CancelledError`` ends it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from ..aio import cancel_and_wait
from ..backoff import jittered
from ..errors import IndexError_, WatchBehind, WatchCompacted
from .client import EtcdClient, KeyValue, WatchEvent

log = logging.getLogger(__name__)

Loader = Callable[[list[KeyValue], int], None]
Applier = Callable[[Sequence[WatchEvent]], None]
Rewound = Callable[[int, int], None]


class ResumableWatch:
    def __init__(self, client: EtcdClient, prefix: bytes, *, load: Loader, apply: Applier, name: str,
                 max_backoff_s: float = 1.0, on_rewind: Rewound | None = None) -> None:
        self._client = client
        self.prefix = prefix
        self._load = load
        self._apply = apply
        self._on_rewind = on_rewind
        self.name = name
        self._max_backoff_s = max_backoff_s
        self.revision = 0  # everything under the prefix up to here has been loaded or applied
        self._need_sync = True
        self.synced = asyncio.Event()  # set after the first successful sync
        self.connected = False  # the stream is following now
        self._task: asyncio.Task[None] | None = None
        self.resyncs = 0
        self.rewinds = 0  # syncs that found etcd's revision below the one seen
        self.interruptions = 0
        self.lagging_members = 0  # watches a member took while behind the revision seen: retried, not resynced
        self._rewound_from = 0  # the revision seen when a read proved etcd went back (0: none pending)
        self._followed_at = 0.0  # when the current stream was created (monotonic; 0: none)
        self.callback_errors = 0

    def start(self) -> None:
        """Sync and follow in the background (etcd may be down: it keeps trying)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"watch-{self.name}")

    async def wait_synced(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the first sync; False if etcd did not answer in time."""
        try:
            async with asyncio.timeout(timeout):
                await self.synced.wait()
            return True
        except TimeoutError:
            return False

    async def resync(self) -> None:
        """Read the prefix afresh and follow from there (the stream is restarted)."""
        task = self._task
        if task is None:
            return
        await cancel_and_wait(task)
        if self._task is not task:  # stopped (or resynced) meanwhile
            return
        self.connected = False
        self._need_sync = True
        self._task = asyncio.create_task(self._run(), name=f"watch-{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.connected = False

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                if self._need_sync:
                    await self._sync()
                await self._follow()
            except WatchBehind as exc:
                went_back = await self._went_back()
                if went_back is not False:  # etcd went back, or unknown (the read failed): resync, as for a restore
                    log.warning("watch %s: %s, and %s; resyncing", self.name, exc,
                                "so is etcd (a restored or new etcd)" if went_back else "etcd's revision is unknown")
                    if went_back:
                        self._rewound_from = max(self._rewound_from, self.revision)
                    self._need_sync = True
                    continue
                self.lagging_members += 1  # it catches up in moments: a new watch, not a read of the prefix
                log.info("watch %s: %s (a member still applying); retrying in %.2fs", self.name, exc, backoff)
            except WatchCompacted as exc:
                log.warning("watch %s: %s; resyncing", self.name, exc)
                self._need_sync = True
                continue
            except IndexError_ as exc:
                self.interruptions += 1
                log.info("watch %s interrupted at rev %d (%s); retrying in %.2fs", self.name, self.revision,
                         exc, backoff)
            except Exception:
                self.interruptions += 1
                log.exception("watch %s: unexpected error at rev %d; retrying", self.name, self.revision)
            finally:
                self.connected = False
            if self._followed_at and time.monotonic() - self._followed_at >= self._max_backoff_s:
                backoff = 0.05  # a stream that lived a while broke: a new failure, not the same one again
            self._followed_at = 0.0
            await asyncio.sleep(jittered(backoff))
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _sync(self) -> None:
        kvs, revision = await self._client.get_prefix(self.prefix)
        seen = max(self.revision, self._rewound_from)
        if revision < seen or self._rewound_from:  # a rewind proven before this read counts, even if etcd
            self.rewinds += 1                      # has climbed past the revision seen since
            if self._on_rewind is not None:
                self._call(self._on_rewind, seen, revision)
        self._rewound_from = 0
        self._call(self._load, kvs, revision)
        self.revision = revision
        self._need_sync = False
        self.resyncs += 1
        self.synced.set()

    async def _went_back(self) -> bool | None:
        """Whether etcd itself (a linearizable read: what the quorum committed) is below the revision seen;
        None when the read failed (not known: the caller resyncs, as it would for a restore)."""
        try:
            _, revision = await self._client.get(self.prefix)
        except Exception as exc:  # IndexError_ while etcd is unreachable; anything else is logged too
            log.log(logging.INFO if isinstance(exc, IndexError_) else logging.ERROR,
                    "watch %s: reading etcd's revision failed: %s", self.name, exc)
            return None
        return revision < self.revision

    async def _follow(self) -> None:
        async for batch in self._client.watch(self.prefix, self.revision + 1):
            if not self.connected:
                self.connected, self._followed_at = True, time.monotonic()
            if batch.events:
                self._call(self._apply, batch.events)
            self.revision = max(self.revision, batch.revision)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            self.callback_errors += 1
            log.exception("watch %s: callback failed; batch skipped", self.name)
