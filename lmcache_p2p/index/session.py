"""One lease per agent, kept alive on one stream: liveness as an object (after etcd's Go
``concurrency.Session``).

Everything a node writes to the index is attached to its session's lease, so when the node dies
or is partitioned for longer than the TTL, etcd deletes its entries and nobody has to clean up.

* ``done()`` completes when the session stops holding the lease: lost, closed or orphaned.
  ``lost`` tells the first case apart; the owner then opens a new session and re-registers.
* ``close()`` revokes the lease: every entry under it vanishes at once.
* ``orphan()`` stops refreshing without revoking: entries live until the TTL runs out.

The lease is *lost* only when etcd says so (a keep-alive answered with TTL 0, or NOT_FOUND).
Any other failure of the keep-alive (a broken or silent stream, etcd down, an unexpected
exception) is retried with backoff for as long as it takes: etcd keeps leases across restarts
and extends them when a new leader takes over, so after an outage the lease is usually still
alive, and if it is not, the first answer says so. A watchdog restarts a keep-alive that has not
confirmed a refresh for a TTL. ``up`` is true only while the last confirmed refresh is still
within the TTL: the truth as far as this node can know it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..aio import cancel_and_wait
from ..backoff import jittered
from ..errors import IndexError_, LeaseLost
from .client import EtcdClient

log = logging.getLogger(__name__)


class Session:
    """A granted lease and its keep-alive task. Create with ``await Session.create(...)``."""

    def __init__(self, client: EtcdClient, lease_id: int, ttl: int) -> None:
        self.client = client
        self.lease_id = lease_id
        self.ttl = ttl
        self.lost = False
        self._expires_at = time.monotonic() + ttl
        self._refreshed_at = time.monotonic()
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.stream_failures = 0
        self.watchdog_restarts = 0

    @classmethod
    async def create(cls, client: EtcdClient, ttl: int) -> Session:
        """Grant a lease of ``ttl`` seconds and start refreshing it every ``ttl / 3``."""
        lease_id, granted = await client.grant(ttl)
        session = cls(client, lease_id, granted)
        session._start_keepalive()
        session._watchdog = asyncio.create_task(session._watch_refreshes(), name=f"lease-watchdog-{lease_id:x}")
        log.info("etcd session: lease %x, ttl %ds", lease_id, granted)
        return session

    @property
    def ttl_left_s(self) -> float:
        """Seconds until the lease expires unless refreshed (as last confirmed by etcd)."""
        return max(0.0, self._expires_at - time.monotonic())

    @property
    def up(self) -> bool:
        """The lease is held and etcd confirmed it within its TTL."""
        return not self._done.is_set() and self.ttl_left_s > 0

    def is_done(self) -> bool:
        return self._done.is_set()

    async def done(self) -> None:
        """Wait until the session no longer holds its lease (lost, closed or orphaned)."""
        await self._done.wait()

    async def close(self) -> None:
        """Stop refreshing and revoke the lease: the entries attached to it vanish at once."""
        await self._stop_tasks()
        if not self.lost:
            try:
                await self.client.revoke(self.lease_id)
            except IndexError_ as exc:
                log.warning("revoking lease %x failed (entries expire in <= %ds): %s", self.lease_id, self.ttl, exc)
        self._done.set()

    async def orphan(self) -> None:
        """Stop refreshing; the lease and its entries live until the TTL runs out."""
        await self._stop_tasks()
        self._done.set()

    async def _stop_tasks(self) -> None:
        current = asyncio.current_task()
        for task in (self._watchdog, self._task):
            if task is not current:
                await cancel_and_wait(task)
        self._task = self._watchdog = None

    def _mark_lost(self, why: str) -> None:
        if not self.lost:
            log.warning("etcd session lost: lease %x %s", self.lease_id, why)
        self.lost = True
        self._done.set()

    def _refreshed(self, sent_at: float, ttl: int) -> None:
        self._expires_at = sent_at + ttl
        self._refreshed_at = time.monotonic()

    def _start_keepalive(self) -> None:
        self._task = asyncio.create_task(self._keepalive(), name=f"lease-{self.lease_id:x}")

    async def _keepalive(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self.client.keep_alive(self.lease_id, self._refreshed)
            except LeaseLost as exc:
                self._mark_lost(f"is gone ({exc})")
                return
            except IndexError_ as exc:
                self.stream_failures += 1
                log.debug("lease %x keep-alive stream failed: %s", self.lease_id, exc)
            except Exception:  # never let the task die silently: retry, the watchdog keeps watching
                self.stream_failures += 1
                log.exception("lease %x keep-alive failed unexpectedly; retrying", self.lease_id)
            if self.ttl_left_s > 0.0:
                backoff = min(backoff, max(self.ttl_left_s / 4, 0.05))
            await asyncio.sleep(jittered(backoff))
            backoff = min(backoff * 2, 1.0)

    async def _watch_refreshes(self) -> None:
        """Restart a keep-alive that has confirmed nothing for a whole TTL (hung, or dead)."""
        while not self._done.is_set():
            await asyncio.sleep(max(self.ttl / 3, 0.2))
            task = self._task
            stale = time.monotonic() - self._refreshed_at > self.ttl
            if task is not None and (task.done() or stale) and not self._done.is_set():
                self.watchdog_restarts += 1
                log.warning("lease %x: no refresh confirmed for %.1fs; restarting the keep-alive", self.lease_id,
                            time.monotonic() - self._refreshed_at)
                await cancel_and_wait(task)
                self._refreshed_at = time.monotonic()  # one TTL of grace for the new stream
                self._start_keepalive()
