"""The owner side: serves chunks of a :class:`CpuPool` to authenticated peers.

One task per connection, on raw non-blocking sockets: requests are read with
``sock_recv_into`` and every chunk leaves as ``sendmsg([frame, slot view])`` straight out of
the pinned slot (no payload copy; asyncio 3.11 transports would copy what the kernel does not
take at once). With TLS (``transfer.tls_*``) the same socket carries a :class:`~.tls.TlsChannel`
through the handshake, then a :class:`~.seal.SealedChannel`: each slot is sealed from its pinned view
into a reused send buffer. Requests of one connection are served in order;
connections are independent.
A connection that fails the handshake or sends a malformed, oversized or truncated frame is
logged and closed; nothing else is affected and no payload was sent on it. The server answers
as ``node_id`` (this node's id, bound in its proof): requesters refuse it under any other name.

Why one file of this size: a connection's whole life on the owner, from accept and the handshake to its last frame,
in the order it is lived, with every limit an unauthenticated or hostile peer meets (pre-auth budget, frame sizes,
pins, sends) enforced in that one path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import socket
import ssl
import time
from collections.abc import Callable, Collection
from typing import Any

from .. import failpoints
from ..chunk import ChunkHeader, slice_heads, verify
from ..errors import ChunkError, HandshakeError, ProtocolError, TierError, TransferError
from ..ids import WIRE_VERSION
from ..keys import ChunkKey, FingerprintDigest, HeadRange
from ..tiers.cpu_pool import CpuPool, Pin
from . import wire
from .netio import PlainChannel, recv_frame, set_keepalive
from .nixl_engine import NixlEngine
from .seal import Exchange, Seal, SealedChannel
from .tls import TlsChannel

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 600.0  # an authenticated connection with no request for this long is closed
MAX_CONNECTIONS = 512  # authenticated connections
# Before a client has proved the secret it gets little: a short deadline for each handshake step,
# at most PREAUTH_PER_SOURCE connections per source address and PREAUTH_TOTAL in all. Past a limit
# the *oldest* unauthenticated connection (of that source, else any) is closed to admit the new one:
# idle connections can't lock out a peer that completes its handshake in milliseconds.
HANDSHAKE_STEP_S = 2.0
PREAUTH_PER_SOURCE = 16
PREAUTH_TOTAL = 128
_SEND_BATCH_BYTES = 4 << 20  # chunks gathered into one sendmsg (their pins held until it returns)
_SEND_BATCH_BUFFERS = 64
_INLINE_CHECK_BYTES = 1 << 20  # a chunk checked before a head range is cut out of it: larger ones off the loop


@dataclasses.dataclass(slots=True)
class ServerStats:
    connections: int = 0
    rejected: int = 0
    chunks_sent: int = 0
    bytes_sent: int = 0
    misses: int = 0
    accept_errors: int = 0
    preauth_dropped: int = 0


@dataclasses.dataclass(slots=True)
class _Session:
    sock: socket.socket
    peer: str
    source: str = ""
    chan: PlainChannel | None = None  # set once the connection is accepted (TLS: handshaken; then sealed)
    fingerprint: FingerprintDigest = FingerprintDigest(b"")
    authenticated: bool = False
    mac_key: bytes | None = None
    acks: bool = False  # the client asked for an ack of each get (wire.py)
    last_rid: int = 0  # gets and pins must raise it: their ids are the payload MAC's nonces (wire.chunk_mac)
    leases: dict[int, tuple[float, list[Pin]]] = dataclasses.field(default_factory=dict)


class TransferServer:
    def __init__(
        self,
        pool: CpuPool,
        fingerprints: Collection[FingerprintDigest],
        secret: bytes,
        *,
        node_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 5.0,
        max_frame_bytes: int = 1 << 20,
        pin_timeout_s: float = 30.0,
        nixl: NixlEngine | None = None,
        prepare: Callable[[ChunkKey], bool] | None = None,
        require_mac: bool = False,
        tls: tuple[ssl.SSLContext, bytes] | None = None,
        on_offer: Callable[[str, list[ChunkKey]], list[bool]] | None = None,
        on_served: Callable[[ChunkKey], None] | None = None,
        on_recent: Callable[[list[ChunkKey]], list[float | None]] | None = None,
    ) -> None:
        if not secret:
            raise ValueError("secret must not be empty: every connection is authenticated")
        self.pool = pool
        self.fingerprints = frozenset(fingerprints)
        self._secret = secret
        self.node_id = node_id
        self._host, self._port = host, port
        self._timeout = timeout_s
        self._max_frame = max_frame_bytes
        self._pin_timeout = pin_timeout_s
        self._nixl = nixl
        self._prepare = prepare  # makes a chunk held in a slower tier servable from the pool
        self._require_mac = require_mac
        self._tls = tls  # (server context, channel binding: SHA-256 of our certificate)
        self.on_offer = on_offer  # a peer offers chunks (hand-off, replica): which we take; on the loop, no I/O
        self.on_served = on_served  # a chunk was pinned for a peer (counts pulls: hot-chunk replication)
        self.on_recent = on_recent  # seconds since each chunk was dropped here (None: not lately)
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._sessions: set[asyncio.Task[None]] = set()
        self._preauth: dict[asyncio.Task[None], _Session] = {}  # insertion order = age
        # Sessions past their handshake. Counted on their own: a dropped unauthenticated session stays in
        # _sessions until its cancelled task runs, which a flood drained in one go can delay past 512 drops.
        self._authenticated: set[asyncio.Task[None]] = set()
        self._leases = itertools.count(1)
        self.stats = ServerStats()

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("server not started")
        return int(self._sock.getsockname()[1])

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError as exc:
            sock.close()
            raise TransferError(f"cannot listen on {self._host}:{self._port}: {exc}") from exc
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())
        log.info("transfer server listening on %s:%d", self._host, self.port)

    async def close(self) -> None:
        tasks = [t for t in (self._accept_task, *self._sessions) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        backoff = 0.01
        while True:
            try:
                conn, addr = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE/ENFILE/ENOBUFS...: free what we can, keep accepting
                self.stats.accept_errors += 1
                log.warning("accept failed (%s); dropping the oldest unauthenticated connection", exc)
                self._drop_oldest_preauth(None)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.01
            if len(self._authenticated) >= MAX_CONNECTIONS:
                log.warning("refusing connection from %s: %d authenticated connections open", addr,
                            len(self._authenticated))
                conn.close()
                continue
            source = str(addr[0])
            if sum(1 for s in self._preauth.values() if s.source == source) >= PREAUTH_PER_SOURCE:
                self._drop_oldest_preauth(source)
            elif len(self._preauth) >= PREAUTH_TOTAL:
                self._drop_oldest_preauth(None)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_keepalive(conn)
            session = _Session(conn, f"{addr[0]}:{addr[1]}", source)
            task = loop.create_task(self._serve(session))
            self._sessions.add(task)
            self._preauth[task] = session
            task.add_done_callback(self._forget)
            await asyncio.sleep(0)  # a backlog drained without yielding would starve the sessions it admits

    @property
    def authenticated_connections(self) -> int:
        return len(self._authenticated)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._sessions.discard(task)
        self._preauth.pop(task, None)
        self._authenticated.discard(task)

    def _drop_oldest_preauth(self, source: str | None) -> None:
        for task, session in self._preauth.items():
            if source is None or session.source == source:
                self.stats.preauth_dropped += 1
                del self._preauth[task]
                with contextlib.suppress(OSError):
                    session.sock.close()  # frees the descriptor now; the task ends on its next read
                task.cancel()
                return

    async def _serve(self, s: _Session) -> None:
        self.stats.connections += 1
        try:
            await self._handshake(s)
            s.authenticated = True
            task = asyncio.current_task()
            assert task is not None
            self._preauth.pop(task, None)
            self._authenticated.add(task)
            while True:
                msg = await self._recv(s, IDLE_TIMEOUT_S)
                await self._dispatch(s, msg)
        except (HandshakeError, ProtocolError) as exc:
            self.stats.rejected += 1
            log.warning("closing connection from %s: %s", s.peer, exc)
        except (TransferError, ConnectionError, OSError) as exc:
            log.info("connection from %s ended: %s", s.peer, exc)
        finally:
            for _, pins in s.leases.values():
                self._unpin_all(pins)
            s.sock.close()

    # -- framing ---------------------------------------------------------------------------------
    async def _recv(self, s: _Session, first_byte_timeout: float) -> wire.Message:
        assert s.chan is not None
        return await recv_frame(s.chan, first_byte_timeout, self._timeout, self._max_frame)

    async def _send(self, s: _Session, msg: wire.Message) -> None:
        assert s.chan is not None
        await s.chan.send_all(s.chan.frame(msg), self._timeout)

    # -- handshake -------------------------------------------------------------------------------
    async def _handshake(self, s: _Session) -> None:
        step = min(self._timeout, HANDSHAKE_STEP_S)
        binding = b""
        if self._tls is None:
            s.chan = PlainChannel(s.sock)
        else:
            chan = TlsChannel(s.sock, self._tls[0])
            try:
                await chan.handshake(step)
            except ssl.SSLError as exc:  # no cluster certificate, not TLS at all, ...
                raise HandshakeError(f"TLS handshake failed: {exc.reason or exc}") from exc
            s.chan, binding = chan, self._tls[1]
        try:
            await self._authenticate(s, step, binding)
        except ssl.SSLError as exc:  # a TLS alert, a record that fails its MAC
            raise HandshakeError(f"TLS failed during the handshake: {exc.reason or exc}") from exc

    async def _authenticate(self, s: _Session, step: float, binding: bytes) -> None:
        hello = await self._recv(s, step)
        if hello["t"] != "hello":
            raise ProtocolError(f"expected hello, got {hello['t']!r}")
        if wire.field(hello, "v", int) != WIRE_VERSION:
            await self._refuse(s, "version")
            raise HandshakeError(f"wire version {hello['v']} != {WIRE_VERSION}")
        fingerprint = FingerprintDigest(wire.field(hello, "fp", bytes))
        nonce_c = wire.field(hello, "nc", bytes)
        if len(nonce_c) != wire.NONCE_BYTES:
            raise ProtocolError("bad client nonce")
        requester = wire.node_id(hello) if "node" in hello else ""
        exchange = Exchange() if self._tls is not None else None
        shares = b""
        if exchange is not None:  # TLS carries this handshake only: the frames after it are sealed (seal.py)
            theirs = hello.get("x")
            if not isinstance(theirs, bytes):
                raise ProtocolError("a TLS hello without a key share")
            shares = theirs + exchange.share
        t = wire.Transcript(bytes(fingerprint), nonce_c, wire.nonce(), binding, self.node_id, requester, shares)
        challenge: wire.Message = {"t": "challenge", "ns": t.nonce_s, "node": self.node_id,
                                   "proof": wire.proof(self._secret, b"S", t)}
        if exchange is not None:
            challenge["x"] = exchange.share
        await self._send(s, challenge)
        auth = await self._recv(s, step)
        if auth["t"] != "auth" or not wire.proof_ok(wire.proof(self._secret, b"C", t), auth.get("proof")):
            raise HandshakeError("client failed to prove the cluster secret")
        if requester:  # the node the client claimed, covered by its proof: for the logs
            s.peer = f"{requester}@{s.peer}"
        if fingerprint not in self.fingerprints:  # told only to a peer that proved the secret
            await self._refuse(s, "fingerprint")
            raise HandshakeError(f"fingerprint {fingerprint.hex()[:12]} not served here")
        if hello.get("mac") is True:
            s.mac_key = wire.session_key(self._secret, t)
        elif self._require_mac:
            await self._refuse(s, "payload MAC required")
            raise HandshakeError("client did not ask for the payload MAC this node requires")
        s.fingerprint = fingerprint
        nixl: dict[str, Any] | None = None
        if hello.get("nixl") is True and self._nixl is not None:
            nixl = {"name": self._nixl.name, "md": self._nixl.agent_metadata()}
            self._nixl.keep_progress(max(10.0, 2 * self._timeout))  # the peer wires up now
        s.acks = hello.get("ack") is True
        seal = None
        if exchange is not None:
            seal = Seal(exchange.key(hello.get("x"), wire.seal_bound(self._secret, t)), owner=True)
        await self._send(s, {"t": "ready", "nixl": nixl, "ack": s.acks})
        if seal is not None:
            assert isinstance(s.chan, TlsChannel)
            if not s.chan.drained():  # the requester sends nothing between auth and ready
                raise ProtocolError("bytes after auth before ready")
            s.chan = SealedChannel(s.sock, seal)

    async def _refuse(self, s: _Session, why: str) -> None:
        with contextlib.suppress(TransferError, OSError):
            await self._send(s, {"t": "error", "why": why})

    # -- requests --------------------------------------------------------------------------------
    async def _dispatch(self, s: _Session, msg: wire.Message) -> None:
        kind = msg["t"]
        if kind in ("get", "pin"):
            keys = wire.key_list(msg)
            heads = wire.head_ranges(msg, len(keys))
            rid = wire.field(msg, "id", int)
            if rid <= s.last_rid:
                raise ProtocolError(f"request id {rid} does not exceed the last one's ({s.last_rid})")
            s.last_rid = rid
            if s.acks:  # alive: before any pin or tier read (wire.py)
                await self._send(s, {"t": "ack", "id": rid})
            serve = self._serve_get if kind == "get" else self._serve_pin
            await serve(s, rid, keys, heads)
        elif kind == "offer":
            rid, node, keys = wire.field(msg, "id", int), wire.node_id(msg), wire.key_list(msg)
            handler = self.on_offer
            accept = handler(node, [ChunkKey(k) for k in keys]) if handler is not None else [False] * len(keys)
            await self._send(s, {"t": "offered", "id": rid, "accept": accept})
        elif kind == "recent":
            rid, keys = wire.field(msg, "id", int), wire.key_list(msg)
            recent = self.on_recent
            ago = recent([ChunkKey(k) for k in keys]) if recent is not None else [None] * len(keys)
            await self._send(s, {"t": "recent", "id": rid, "ago": ago})
        elif kind == "release":
            lease = s.leases.pop(wire.field(msg, "lease", int), None)
            if lease is not None:
                self._unpin_all(lease[1])
        else:
            raise ProtocolError(f"unknown request {kind!r}")

    async def _pin(self, s: _Session, key: bytes, heads: HeadRange | None) -> tuple[Pin, ChunkHeader, int] | None:
        """Pin a chunk; returns the pin, the header to send and the offset of its bytes in the slot."""
        pin = self.pool.pin(ChunkKey(key), self._pin_timeout)
        if pin is None and self._prepare is not None and await self._prepared(ChunkKey(key)):
            pin = self.pool.pin(ChunkKey(key), self._pin_timeout)
        if pin is not None and pin.header.fingerprint != s.fingerprint:
            self.pool.unpin(pin)
            pin = None
        if pin is None:
            self.stats.misses += 1
            return None
        if self.on_served is not None:
            self.on_served(pin.key)
        if heads is None or heads == pin.header.heads:
            return pin, pin.header, 0
        big = pin.header.length > _INLINE_CHECK_BYTES  # hashing it would hold up every other connection
        sliced = await asyncio.to_thread(self._slice, pin, heads) if big else self._slice(pin, heads)
        if sliced is None:
            self.pool.unpin(pin)
            self.stats.misses += 1
            return None
        return pin, *sliced

    def _slice(self, pin: Pin, heads: HeadRange) -> tuple[ChunkHeader, int] | None:
        """A head range of a pinned chunk. The whole chunk is checked first: the range gets a checksum
        of its own, which must not vouch for bytes that changed in memory since they were stored."""
        h0, h1 = pin.header.heads
        if not h0 <= heads[0] < heads[1] <= h1:
            return None  # not held here (a node holds one range per fingerprint)
        view = self.pool.slot_view(pin.slot, pin.header.length)
        try:
            verify(pin.header, view)
        except ChunkError as exc:
            log.error("chunk %s changed in memory; not served: %s", pin.key.hex()[:16], exc)
            return None
        header, _ = slice_heads(pin.header, view, heads)
        return header, (heads[0] - h0) * (pin.header.length // (h1 - h0))

    async def _prepared(self, key: ChunkKey) -> bool:
        """Bring a chunk held in a slower tier into the pool, off the loop (disk I/O); a pool with
        no unpinned slot answers "absent" for it rather than failing the connection."""
        assert self._prepare is not None
        try:
            return await asyncio.to_thread(self._prepare, key)
        except TierError as exc:
            log.info("cannot bring %s into the pool: %s", key.hex()[:16], exc)
            return False

    async def _serve_get(self, s: _Session, rid: int, keys: list[bytes], heads: list[HeadRange | None]) -> None:
        """Stream the chunks, several per ``sendmsg`` (frames and pinned slot views, no copies)."""
        assert s.chan is not None
        pins: list[Pin] = []
        buffers: list[bytes | memoryview] = []
        pending = 0
        try:
            for i, key in enumerate(keys):
                pinned = await self._pin(s, key, heads[i])
                if pinned is None:
                    buffers += s.chan.frame({"t": "miss", "id": rid, "i": i, "why": "absent"})
                else:
                    pin, sent, offset = pinned
                    pins.append(pin)
                    length = sent.length
                    header = sent.pack()
                    view = self.pool.slot_view(pin.slot, offset + length)[offset:]
                    frame: wire.Message = {"t": "chunk", "id": rid, "i": i, "h": header}
                    if s.mac_key is not None and not isinstance(s.chan, SealedChannel):  # a seal authenticates
                        frame["m"] = wire.chunk_mac(s.mac_key, rid, i, header, view)
                    buffers += s.chan.frame(frame, view)
                    pending += length
                    if i == 0 and failpoints.armed(failpoints.MID_ANSWER):
                        await self._flush(s, buffers, pins)  # a test's hung owner: one frame out, then stopped
                        pending = 0
                        failpoints.fire(failpoints.MID_ANSWER)
                if pending >= _SEND_BATCH_BYTES or len(buffers) >= _SEND_BATCH_BUFFERS:
                    await self._flush(s, buffers, pins)
                    pending = 0
            buffers += s.chan.frame({"t": "end", "id": rid})
            await self._flush(s, buffers, pins)
        finally:
            self._unpin_all(pins)

    async def _flush(self, s: _Session, buffers: list[bytes | memoryview], pins: list[Pin]) -> None:
        assert s.chan is not None
        await s.chan.send_all(buffers, self._timeout)
        self.stats.chunks_sent += len(pins)
        self.stats.bytes_sent += sum(len(b) for b in buffers if isinstance(b, memoryview))
        self._unpin_all(pins)
        buffers.clear()
        pins.clear()

    async def _serve_pin(self, s: _Session, rid: int, keys: list[bytes], heads: list[HeadRange | None]) -> None:
        if self._nixl is None:
            raise ProtocolError("pin request but NIXL is not served here")
        self._expire_leases(s)
        pins: list[Pin] = []
        items: list[list[Any] | None] = []
        for i, key in enumerate(keys):
            pinned = await self._pin(s, key, heads[i])
            if pinned is None:
                items.append(None)
                continue
            pin, sent, offset = pinned
            pins.append(pin)
            header = sent.pack()
            item: list[Any] = [header, self.pool.slot_address(pin.slot) + offset]
            if s.mac_key is not None:  # the requester checks it over the bytes its READ brings in
                view = self.pool.slot_view(pin.slot, offset + sent.length)[offset:]
                item.append(wire.chunk_mac(s.mac_key, rid, i, header, view))
            items.append(item)
        lease = next(self._leases)
        s.leases[lease] = (time.monotonic() + self._pin_timeout, pins)
        self._nixl.keep_progress(min(self._pin_timeout, 2 * self._timeout))
        await self._send(s, {"t": "pinned", "id": rid, "lease": lease, "items": items})

    def _expire_leases(self, s: _Session) -> None:
        now = time.monotonic()
        for lease, (deadline, pins) in list(s.leases.items()):
            if deadline <= now:
                del s.leases[lease]
                self._unpin_all(pins)

    def _unpin_all(self, pins: list[Pin]) -> None:
        for pin in pins:
            self.pool.unpin(pin)
