"""The etcd connection: gRPC channels to the endpoints, TLS and user/password from
:class:`~lmcache_p2p.config.EtcdConfig`, and the boundary where gRPC and etcd3aio errors become
:class:`~lmcache_p2p.errors.IndexError_` (:class:`~lmcache_p2p.errors.LeaseLost` for a lease that
is gone). Everything above this module sees only lmcache-p2p exceptions.

Plain HTTP: one channel balancing round-robin over every member. TLS: one channel *per endpoint*,
each verifying that member's own host name (or IP) against its certificate (one balanced channel
can check only one name); calls go to the current endpoint and a transient failure moves to the
next, so a dead or partitioned member costs one failed call. A member refusing connections is
skipped within the same call.

Runs on one asyncio loop (the agent's :class:`~lmcache_p2p.aio.LoopThread`); not thread-safe.

Why one file of this size: it is the one boundary where gRPC and etcd3aio errors become ours; every etcd call
(reads, pages, transactions, leases, keep-alives, watches) goes through its endpoint failover and ``translate``
here, and a call moved out could leave that boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import grpc
import grpc.aio
from etcd3aio._protobuf import (
    Compare,
    LeaseKeepAliveRequest,
    LeaseStub,
    WatchCreateRequest,
    WatchRequest,
    WatchStub,
)
from etcd3aio._protobuf import rpc_pb2 as _rpc
from etcd3aio.auth import AuthService
from etcd3aio.errors import EtcdConnectionError, EtcdError, EtcdTransientError
from etcd3aio.kv import KVService, prefix_range_end
from etcd3aio.lease import LeaseService
from etcd3aio.maintenance import MaintenanceService

from ..aio import cancel_and_wait
from ..backoff import jittered
from ..config import EtcdConfig
from ..errors import IndexError_, LeaseLost, WatchBehind, WatchCompacted

log = logging.getLogger(__name__)
_T = TypeVar("_T")

WATCH_PROGRESS_S = 5.0  # a quiet watch asks etcd how far it has seen this often
_DELETE = 1  # mvccpb.Event.EventType
MAX_RECEIVE_BYTES = 256 << 20  # big range reads; gRPC's default of 4 MiB is ~30k block entries
RANGE_PAGE = 20_000  # keys per range-read page
TOKEN_REFRESH_S = 240.0  # etcd simple tokens live 5 minutes
_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    key: bytes
    value: bytes  # empty for a delete
    mod_revision: int
    deleted: bool


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """What one watch response says: events (in order), and the revision the watcher has seen up to.

    ``revision`` is the last event's revision, or for a progress notification (no events) the
    store revision: every change under the prefix up to it has been delivered.
    """

    events: tuple[WatchEvent, ...]
    revision: int


Op = object  # an opaque txn operation built by op_put / op_delete
Comparison = object  # an opaque txn comparison built by compare_mod_revision


def op_put(key: bytes, value: bytes, lease: int = 0) -> Op:
    return KVService.txn_op_put(key, value, lease=lease)


def op_delete(key: bytes) -> Op:
    return KVService.txn_op_delete(key)


def compare_mod_revision(key: bytes, mod_revision: int) -> Comparison:
    """True while ``key``'s last modification is at ``mod_revision`` (0: the key does not exist)."""
    return Compare(result=Compare.EQUAL, target=Compare.MOD, key=key, mod_revision=mod_revision)


@contextlib.contextmanager
def translate(operation: str) -> Iterator[None]:
    """Map gRPC / etcd3aio / timeout errors raised inside the block to IndexError_ or LeaseLost."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        details = exc.details() or ""
        if exc.code() == grpc.StatusCode.NOT_FOUND and "lease" in details:
            raise LeaseLost(f"{operation}: {details}") from exc
        raise IndexError_(f"{operation}: {exc.code().name} {details}") from exc
    except (EtcdError, TimeoutError, OSError, asyncio.InvalidStateError, grpc.RpcError) as exc:
        raise IndexError_(f"{operation}: {type(exc).__name__}: {exc}") from exc


def is_transient(exc: BaseException) -> bool:
    """True for failures worth retrying: member down, leader change, timeout, overload."""
    if isinstance(exc, LeaseLost):
        return False
    cause = exc.__cause__ if isinstance(exc, IndexError_) else exc
    if isinstance(cause, grpc.aio.AioRpcError):
        return cause.code() in _TRANSIENT_CODES
    return isinstance(cause, (EtcdConnectionError, EtcdTransientError, TimeoutError, OSError))


def _split(endpoint: str) -> tuple[str, int | None]:
    url = urlsplit(endpoint if "//" in endpoint else "//" + endpoint)
    return url.hostname or "127.0.0.1", url.port


def endpoint_target(endpoint: str) -> str:
    """The gRPC target of one endpoint; over TLS its host is the name the certificate must carry."""
    host, port = _split(endpoint)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def channel_target(endpoints: Sequence[str]) -> str:
    """One plain-HTTP gRPC target for all endpoints.

    One endpoint goes through gRPC's DNS resolver (a headless service name may resolve to every
    member). Several are resolved here to addresses and balanced round-robin.
    """
    hosts = [_split(ep) for ep in endpoints]
    if len(hosts) == 1:
        return f"dns:///{endpoint_target(endpoints[0])}"
    addrs = []
    for host, port in hosts:
        ip = host if _is_ip(host) else socket.getaddrinfo(host, port, socket.AF_INET)[0][4][0]
        addrs.append(f"{ip}:{port}")
    return "ipv4:" + ",".join(addrs)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


@dataclass(slots=True)
class _Endpoint:
    name: str
    channel: grpc.aio.Channel
    kv: KVService
    lease: LeaseService
    maintenance: MaintenanceService


class EtcdClient:
    """An async etcd client. ``await connect()`` before use, ``await close()`` after."""

    def __init__(self, config: EtcdConfig) -> None:
        if not config.endpoints:
            raise IndexError_("etcd.endpoints is empty: configure etcd or start a private one")
        self.config = config
        self.timeout = config.timeout_s
        self._endpoints: list[_Endpoint] = []
        self._current = 0
        self._token: str | None = None
        self._refresh_task: asyncio.Task[None] | None = None

    async def connect(self, *, lazy: bool = False) -> None:
        """Open the channel. With ``lazy`` nothing waits on etcd: authentication (if configured)
        is retried in the background until etcd answers (agents start while etcd is down)."""
        options: list[tuple[str, str | int]] = [
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.max_send_message_length", 2 << 20),
            ("grpc.keepalive_time_ms", 6_000),  # etcd refuses pings under 5 s apart (too_many_pings)
            ("grpc.keepalive_timeout_ms", 3_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1_000),
            # A connection attempt is given up after 1 s (default 20 s) and retried with a fresh SYN: a
            # member whose link comes back is reconnected within ~1 s, not after the kernel's SYN backoff.
            ("grpc.min_reconnect_backoff_ms", 1_000),
        ]
        tls = self.config.ca_cert is not None or any(ep.startswith("https://") for ep in self.config.endpoints)
        channels: list[tuple[str, grpc.aio.Channel]] = []
        if tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.config.ca_cert),
                private_key=_read(self.config.cert_key),
                certificate_chain=_read(self.config.cert_cert),
            )
            for endpoint in self.config.endpoints:  # the target's host is the name verified
                target = endpoint_target(endpoint)
                channels.append((target, grpc.aio.secure_channel(target, creds, options=options)))
        else:
            target = channel_target(self.config.endpoints)
            channels.append((target, grpc.aio.insecure_channel(target, options=options)))
        # Per-endpoint channels: etcd3aio's own retries would stay on one member, failing over is ours.
        n = 1 if tls else 3
        self._endpoints = [_Endpoint(name, ch, KVService(ch, max_attempts=n), LeaseService(ch, max_attempts=n),
                                     MaintenanceService(ch, max_attempts=n)) for name, ch in channels]
        self._current = 0
        if self.config.user is not None and self.config.password is not None:
            if not lazy:
                await self._authenticate()
            self._refresh_task = asyncio.create_task(self._refresh_token(authenticated=not lazy),
                                                     name="etcd-token-refresh")

    async def _authenticate(self) -> None:
        assert self.config.user is not None and self.config.password is not None
        user, password = self.config.user, self.config.password
        resp = await self._unary("Auth.Authenticate",
                                 lambda ep: AuthService(ep.channel).authenticate(user, password, timeout=self.timeout))
        self._token = resp.token
        for ep in self._endpoints:
            for svc in (ep.kv, ep.lease, ep.maintenance):
                svc.set_token(self._token)

    async def _refresh_token(self, authenticated: bool) -> None:
        backoff = 0.2
        while True:
            if authenticated:
                await asyncio.sleep(TOKEN_REFRESH_S)
            try:
                await self._authenticate()
                authenticated, backoff = True, 0.2
            except IndexError_ as exc:
                log.warning("etcd authentication failed (retrying in %.1fs): %s", backoff, exc)
                authenticated = False
                await asyncio.sleep(jittered(backoff))
                backoff = min(backoff * 2, 10.0)

    async def close(self) -> None:
        await cancel_and_wait(self._refresh_task)
        for ep in self._endpoints:
            await ep.channel.close()
        self._endpoints = []

    async def __aenter__(self) -> EtcdClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- accessors -------------------------------------------------------------------------
    @property
    def endpoint(self) -> _Endpoint:
        """The endpoint calls go to now."""
        if not self._endpoints:
            raise IndexError_("etcd client is not connected")
        return self._endpoints[self._current % len(self._endpoints)]

    @property
    def lease(self) -> LeaseService:
        return self.endpoint.lease

    def _failed(self, ep: _Endpoint, exc: IndexError_, always: bool = False) -> None:
        """After a transient failure on ``ep``, calls go to the next endpoint (if ``ep`` is current)."""
        if len(self._endpoints) > 1 and (always or is_transient(exc)) and self.endpoint is ep:
            self._current = (self._current + 1) % len(self._endpoints)
            log.info("etcd %s failed (%s); next: %s", ep.name, exc, self.endpoint.name)

    @contextlib.contextmanager
    def _on(self, ep: _Endpoint, operation: str) -> Iterator[None]:
        """:func:`translate`, moving on to the next endpoint after a transient failure."""
        try:
            with translate(operation):
                yield
        except IndexError_ as exc:
            self._failed(ep, exc)
            raise

    async def _unary(self, operation: str, call: Callable[[_Endpoint], Awaitable[_T]]) -> _T:
        """``call`` on the current endpoint; an endpoint that refuses (UNAVAILABLE, fast) is skipped
        within this call, one that times out is left for the next call."""
        for attempt in range(len(self._endpoints) or 1):
            ep = self.endpoint
            try:
                with self._on(ep, operation):
                    return await call(ep)
            except IndexError_ as exc:
                cause = exc.__cause__
                refused = isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.UNAVAILABLE
                if not refused or attempt == len(self._endpoints) - 1:
                    raise
        raise AssertionError("unreachable")

    def _metadata(self, require_leader: bool = False) -> tuple[tuple[str, str], ...] | None:
        """Call metadata for raw streams: the auth token and, for watches, etcd's has-leader guard."""
        md: list[tuple[str, str]] = []
        if self._token:
            md.append(("token", self._token))
        if require_leader:
            md.append(("hasleader", "true"))
        return tuple(md) or None

    # ---- operations ------------------------------------------------------------------------
    async def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key (or None) and the store revision of the read."""
        resp = await self._unary("KV.Range", lambda ep: ep.kv.get(key, timeout=self.timeout))
        kvs = [KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs]
        return (kvs[0] if kvs else None), resp.header.revision

    async def get_prefix(self, prefix: bytes, revision: int = 0) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` as of one revision (paged reads pinned to that revision)."""
        out: list[KeyValue] = []
        end = prefix_range_end(prefix)
        start = prefix
        async for page, rev in self._pages(start, end, revision):
            revision = rev
            out.extend(page)
        return out, revision

    async def _pages(self, start: bytes, end: bytes, revision: int) -> AsyncIterator[tuple[list[KeyValue], int]]:
        while True:
            resp = await self._unary("KV.Range", functools.partial(self._page, start=start, end=end, revision=revision))
            revision = revision or resp.header.revision
            page = [KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs]
            yield page, revision
            if not resp.more or not page:
                return
            start = page[-1].key + b"\x00"

    def _page(self, ep: _Endpoint, start: bytes, end: bytes, revision: int) -> Awaitable[_rpc.RangeResponse]:
        return ep.kv.get(start, end, revision=revision, limit=RANGE_PAGE, timeout=self.timeout * 4)

    async def get_prefixes(self, prefixes: Sequence[bytes], *, serializable: bool = True
                           ) -> tuple[list[list[KeyValue]], int]:
        """Every key under each of ``prefixes`` in one read-only txn: one round trip, one revision.
        Not paged: for small prefixes (one chunk's owners). ``serializable``: any member answers from
        its own store (no quorum round; it may lag the leader by what it has not applied yet)."""
        ops = [KVService.txn_op_get(p, range_end=prefix_range_end(p), serializable=serializable) for p in prefixes]
        resp = await self._unary("KV.Txn", lambda ep: ep.kv.txn([], ops, timeout=self.timeout))
        out = [[KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease) for kv in r.response_range.kvs]
               for r in resp.responses]
        return out, int(resp.header.revision)

    async def count_prefix(self, prefix: bytes) -> int:
        resp = await self._unary("KV.Range", lambda ep: ep.kv.get(prefix, prefix_range_end(prefix), count_only=True,
                                                                   timeout=self.timeout))
        return int(resp.count)

    async def txn(self, compare: Sequence[object], success: Sequence[object], failure: Sequence[object] = ()
                  ) -> tuple[bool, int]:
        """Run a txn; ``(succeeded, revision)``."""
        resp = await self._unary("KV.Txn", lambda ep: ep.kv.txn(compare, success, failure,  # type: ignore[arg-type]
                                                                timeout=self.timeout))
        return bool(resp.succeeded), int(resp.header.revision)

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        resp = await self._unary("KV.Put", lambda ep: ep.kv.put(key, value, lease=lease, timeout=self.timeout))
        return int(resp.header.revision)

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: ``(lease_id, granted_ttl)``."""
        resp = await self._unary("Lease.Grant", lambda ep: ep.lease.grant(ttl, timeout=self.timeout))
        if resp.error:
            raise IndexError_(f"Lease.Grant: {resp.error}")
        return int(resp.ID), int(resp.TTL)

    async def revoke(self, lease_id: int) -> None:
        await self._unary("Lease.Revoke", lambda ep: ep.lease.revoke(lease_id, timeout=self.timeout))

    async def leases(self) -> set[int]:
        """The ids of every lease etcd holds."""
        resp = await self._unary("Lease.Leases", lambda ep: ep.lease.leases(timeout=self.timeout))
        return {int(lease.ID) for lease in resp.leases}

    async def status(self) -> tuple[int, int, int]:
        """``(db_size, db_size_in_use, revision)`` of the member that answers."""
        resp = await self._unary("Maintenance.Status", lambda ep: ep.maintenance.status(timeout=self.timeout))
        return int(resp.dbSize), int(resp.dbSizeInUse), int(resp.header.revision)

    async def compact(self, revision: int) -> None:
        await self._unary("KV.Compact", lambda ep: ep.kv.compact(revision, physical=True, timeout=self.timeout))

    # ---- streams -----------------------------------------------------------------------------
    async def keep_alive(self, lease_id: int, on_refresh: Callable[[float, int], None]) -> None:
        """Refresh ``lease_id`` on one stream, every TTL/3, until the stream breaks.

        Never returns normally: raises :class:`LeaseLost` when etcd says the lease is gone and
        :class:`IndexError_` for anything else (stream closed, timeout, member down).
        ``on_refresh(sent_at, ttl)`` hears every confirmed refresh (``sent_at`` is monotonic).
        """
        ep = self.endpoint
        call = LeaseStub(ep.channel).LeaseKeepAlive(metadata=self._metadata())
        try:
            while True:
                sent_at = time.monotonic()
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                with self._on(ep, "Lease.KeepAlive"):
                    async with asyncio.timeout(self.timeout):
                        await call.write(LeaseKeepAliveRequest(ID=lease_id))
                        resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise IndexError_("Lease.KeepAlive: stream closed by the server")
                if resp.TTL <= 0:
                    raise LeaseLost(f"lease {lease_id:x} expired or was revoked")
                on_refresh(sent_at, int(resp.TTL))
                await asyncio.sleep(max(0.5, resp.TTL / 3))
        finally:
            call.cancel()

    async def watch(self, prefix: bytes, start_revision: int, *, progress_every_s: float = WATCH_PROGRESS_S
                    ) -> AsyncIterator[WatchBatch]:
        """Every change under ``prefix`` from ``start_revision`` on, on one stream, until it breaks.

        Raises :class:`WatchCompacted` when the history from ``start_revision`` is gone (or etcd's
        revision went backwards: a restored or new cluster) and :class:`IndexError_` when the
        stream breaks or stays silent. A progress notification is asked for every
        ``progress_every_s``, so the revision of a quiet prefix advances too and a silent stream
        is noticed; the stream asks for ``hasleader``, so a member cut off from the quorum ends it.
        """
        ep = self.endpoint
        call = WatchStub(ep.channel).Watch(metadata=self._metadata(require_leader=True))
        ticker: asyncio.Task[None] | None = None
        try:
            create = WatchCreateRequest(key=prefix, range_end=prefix_range_end(prefix),
                                        start_revision=start_revision, progress_notify=True)
            with self._on(ep, "Watch"):
                async with asyncio.timeout(self.timeout):
                    await call.write(WatchRequest(create_request=create))
            ticker = asyncio.create_task(self._ask_progress(call, progress_every_s), name="etcd-watch-progress")
            while True:
                with self._on(ep, "Watch"):
                    async with asyncio.timeout(progress_every_s * 3 + self.timeout):
                        resp = await call.read()
                try:
                    batch = _watch_batch(resp, start_revision)
                except WatchBehind as exc:  # the next watch goes to another member, if there is one
                    self._failed(ep, exc, always=True)
                    raise
                except WatchCompacted:
                    raise
                except IndexError_ as exc:  # closed or cancelled by this member: try another
                    self._failed(ep, exc, always=True)
                    raise
                yield batch
        finally:
            await cancel_and_wait(ticker)
            call.cancel()

    async def _ask_progress(self, call: grpc.aio.StreamStreamCall, every_s: float) -> None:
        request = WatchRequest(progress_request=_rpc.WatchProgressRequest())
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError, OSError):
            while True:
                await asyncio.sleep(every_s)
                await call.write(request)


def _watch_batch(resp: object, start_revision: int) -> WatchBatch:
    """One watch response as a batch (empty for the creation answer); raises when the watch ended."""
    if resp is grpc.aio.EOF:
        raise IndexError_("Watch: stream closed by the server")
    if resp.compact_revision > 0:  # type: ignore[attr-defined]
        raise WatchCompacted(f"Watch: revision {start_revision} compacted (now {resp.compact_revision})",  # type: ignore[attr-defined]
                             resp.compact_revision)  # type: ignore[attr-defined]
    if resp.canceled:  # type: ignore[attr-defined]
        raise IndexError_(f"Watch: cancelled by etcd: {resp.cancel_reason or 'no reason'}")  # type: ignore[attr-defined]
    revision = int(resp.header.revision)  # type: ignore[attr-defined]
    if resp.created:  # type: ignore[attr-defined]
        if revision < start_revision - 1:  # a lagging member, or a restored etcd: the watcher asks which
            raise WatchBehind(f"Watch: this member is at revision {revision}, behind {start_revision - 1}",
                              revision)
        return WatchBatch((), start_revision - 1)  # following now; nothing new seen yet
    events = tuple(WatchEvent(ev.kv.key, ev.kv.value, int(ev.kv.mod_revision), ev.type == _DELETE)
                   for ev in resp.events)  # type: ignore[attr-defined]
    return WatchBatch(events, events[-1].mod_revision if events else revision)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None
