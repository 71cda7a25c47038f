"""One lease per agent, kept alive on one stream: liveness as an object (after etcd's Go
``concurrency.Session``).

Everything a node writes to the index is attached to its session's lease, so when the node dies
or is partitioned for longer than the TTL, etcd deletes its entries and nobody has to clean up.

* ``done()`` completes when the session stops holding the lease: lost, closed or orphaned.
  ``lost`` tells the first case apart; the owner then opens a new session and re-registers.
* ``close()`` revokes the lease: every entry under it vanishes at once.
* ``orphan()`` stops refreshing without revoking: entries live until the TTL runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import grpc.aio
from etcd3aio._protobuf import LeaseKeepAliveRequest, LeaseStub

from ..errors import IndexError_
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
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def create(cls, client: EtcdClient, ttl: int) -> Session:
        """Grant a lease of ``ttl`` seconds and start refreshing it every ``ttl / 3``."""
        lease_id, granted = await client.grant(ttl)
        session = cls(client, lease_id, granted)
        session._task = asyncio.create_task(session._keepalive(), name=f"lease-{lease_id:x}")
        log.info("etcd session: lease %x, ttl %ds", lease_id, granted)
        return session

    @property
    def ttl_left_s(self) -> float:
        """Seconds until the lease expires unless refreshed (as last confirmed by etcd)."""
        return max(0.0, self._expires_at - time.monotonic())

    def is_done(self) -> bool:
        return self._done.is_set()

    async def done(self) -> None:
        """Wait until the session no longer holds its lease (lost, closed or orphaned)."""
        await self._done.wait()

    async def close(self) -> None:
        """Stop refreshing and revoke the lease: the entries attached to it vanish at once."""
        await self._stop_task()
        if not self.lost:
            try:
                await self.client.revoke(self.lease_id)
            except IndexError_ as exc:
                log.warning("revoking lease %x failed (entries expire in <= %ds): %s", self.lease_id, self.ttl, exc)
        self._done.set()

    async def orphan(self) -> None:
        """Stop refreshing; the lease and its entries live until the TTL runs out."""
        await self._stop_task()
        self._done.set()

    async def _stop_task(self) -> None:
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None

    def _mark_lost(self, why: str) -> None:
        log.warning("etcd session lost: lease %x %s", self.lease_id, why)
        self.lost = True
        self._done.set()

    async def _keepalive(self) -> None:
        backoff = 0.1
        while True:
            try:
                if await self._refresh_stream():
                    return  # the lease is gone
            except (grpc.aio.AioRpcError, TimeoutError, OSError) as exc:
                log.debug("lease %x keep-alive stream failed: %s", self.lease_id, exc)
            if self.ttl_left_s <= 0:
                self._mark_lost("expired: no refresh reached etcd within the TTL")
                return
            await asyncio.sleep(min(backoff, self.ttl_left_s))
            backoff = min(backoff * 2, 1.0)

    async def _refresh_stream(self) -> bool:
        """Refresh on one stream until it breaks; True when etcd says the lease no longer exists."""
        call = LeaseStub(self.client.channel).LeaseKeepAlive(metadata=self.client.metadata())
        try:
            while True:
                sent_at = time.monotonic()
                await call.write(LeaseKeepAliveRequest(ID=self.lease_id))
                wait = max(0.1, min(self.client.timeout, self.ttl_left_s))
                resp = await asyncio.wait_for(call.read(), wait)
                if resp is grpc.aio.EOF:
                    raise OSError("keep-alive stream closed by the server")
                if resp.TTL <= 0:
                    self._mark_lost("expired or revoked")
                    return True
                self._expires_at = sent_at + resp.TTL
                await asyncio.sleep(max(0.5, resp.TTL / 3))
        finally:
            call.cancel()
