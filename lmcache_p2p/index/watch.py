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
from collections.abc import Callable, Sequence

from ..aio import cancel_and_wait
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
                if await self._went_back():
                    log.warning("watch %s: %s, and so is etcd (a restored or new etcd); resyncing", self.name, exc)
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
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _sync(self) -> None:
        kvs, revision = await self._client.get_prefix(self.prefix)
        if revision < self.revision:
            self.rewinds += 1
            if self._on_rewind is not None:
                self._call(self._on_rewind, self.revision, revision)
        self._call(self._load, kvs, revision)
        self.revision = revision
        self._need_sync = False
        self.resyncs += 1
        self.synced.set()

    async def _went_back(self) -> bool:
        """Whether etcd itself (a linearizable read: what the quorum committed) is below the revision seen;
        a read that fails counts as not known yet: the watch is retried and asks again."""
        try:
            _, revision = await self._client.get(self.prefix)
        except IndexError_:
            return False
        return revision < self.revision

    async def _follow(self) -> None:
        async for batch in self._client.watch(self.prefix, self.revision + 1):
            self.connected = True
            if batch.events:
                self._call(self._apply, batch.events)
            self.revision = max(self.revision, batch.revision)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            self.callback_errors += 1
            log.exception("watch %s: callback failed; batch skipped", self.name)
