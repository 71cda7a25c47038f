"""Requester side: authenticated pooled connections and the TCP transport.

One connection per (peer, fingerprint), opened on first use, handshaken (the server must prove
the cluster secret too, *as the node the peer address names*: ``PeerAddress.node_id``, from the
node record the pull was planned from), then shared by every concurrent pull to that peer. With
TLS the owner's certificate must name that node too, or, unless ``require_node_name``, no node.

The handshake runs on the raw socket (through TLS when on: ``tls.py``), then the connection is handed to asyncio,
sealed after a TLS handshake (``seal.py``). A pull waits on an owner's silence and pauses here (``silent_for``,
``stalled_for``); the guard around every transport's pull (backoff, overdue answers) is ``guard.py``'s, the
frames of one connection ``connection.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from ..aio import remaining
from ..errors import (
    HandshakeError,
    PeerIdentityError,
    PeerTimeout,
    ProtocolError,
    TransferError,
)
from ..ids import WIRE_VERSION, PeerAddress
from ..keys import FingerprintDigest
from ..tiers.cpu_pool import CpuPool
from . import wire
from .base import MissReason, PullResult, Want
from .connection import ACK_FLOOR_S, Connection, _Request
from .guard import GuardedTransport, Overdue
from .health import PeerHealth
from .netio import PlainChannel, connect_tcp, recv_frame, set_keepalive
from .seal import Exchange, Seal
from .tls import TlsChannel, names_node, peer_binding, peer_nodes

log = logging.getLogger(__name__)

# An owner silent for a third of a pull's allowance (3x its expected time: the expected time itself) and
# for its ack timeout is not serving; one that is merely busy acknowledges sooner than its pull was
# expected to take (a canary's or a hand-off's seconds-long allowance waits that much longer).
SILENT_SHARE = 3.0
# An answer under way (its owner alive a moment ago, perhaps reading a chunk from its disk between frames)
# may pause this many times that silence before its owner is taken for stopped mid-answer.
STALL_SILENCES = 2.0


def batch_size(max_frame_bytes: int) -> int:
    """Keys per request such that the request and a ``pinned`` answer fit in one frame."""
    return max(1, min(wire.MAX_KEYS_PER_REQUEST, (max_frame_bytes - 256) // 96))


class ConnectionPool:
    def __init__(self, secret: bytes, timeout_s: float, max_frame_bytes: int, want_nixl: bool = False,
                 payload_mac: bool | None = None, tls: ssl.SSLContext | None = None,
                 node_id: str | None = None, require_node_name: bool = False) -> None:
        """``payload_mac``: as ``transfer.payload_mac`` (None: on unless ``tls``). ``node_id``: the node
        this requester is (bound in the proofs, told to the owner); None for a tool that is no node
        (``lookup --explain``). ``require_node_name``: with ``tls``, refuse an owner whose certificate
        names no node (``transfer.tls_require_node_name``)."""
        if not secret:
            raise ValueError("secret must not be empty")
        self._secret = secret
        self._node_id = node_id
        self._tls = tls  # mutual TLS under the cluster CA (client context), see tls.py
        self._require_node_name = require_node_name
        self.refused_certificates = 0  # owners refused for what their certificate names (or does not)
        self._payload_mac = wire.mac_on(payload_mac, tls is not None)
        self._timeout = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._want_nixl = want_nixl
        self._conns: dict[tuple[PeerAddress, bytes], Connection] = {}
        self._locks: dict[tuple[PeerAddress, bytes], asyncio.Lock] = {}

    @property
    def require_node_name(self) -> bool:
        return self._require_node_name

    async def get(self, peer: PeerAddress, fp: FingerprintDigest, timeout: float) -> Connection:
        key = (peer, bytes(fp))
        conn = self._conns.get(key)
        if conn is not None and not conn.closed:
            return conn
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), timeout)
        except TimeoutError as exc:
            raise PeerTimeout(f"{peer}: waiting for a connection") from exc
        try:
            conn = self._conns.get(key)
            if conn is None or conn.closed:
                # a new connection starts from the last one's round trips: a peer that stopped answering
                # is not given the whole deadline to say hello
                conn = await self._connect(peer, fp, min(timeout, self._timeout), known=conn)
                self._conns[key] = conn
            return conn
        finally:
            lock.release()

    async def _connect(self, peer: PeerAddress, fp: FingerprintDigest, timeout: float,
                       known: Connection | None = None) -> Connection:
        """A connection handshaken on the raw socket (through TLS, when on), then handed to asyncio as a
        :class:`Connection`: sealed after a TLS handshake (``seal.py``), plain otherwise."""
        try:
            async with asyncio.timeout(timeout):
                sock = await connect_tcp(peer.host, peer.port, timeout)
        except TimeoutError as exc:
            raise PeerTimeout(f"{peer}: connect timed out") from exc
        except OSError as exc:
            raise TransferError(f"{peer}: connect failed: {exc}") from exc
        conn = Connection(str(peer), self.max_frame_bytes)
        if known is not None:
            conn.srtt, conn.rttvar, conn.silence_backoff = known.srtt, known.rttvar, known.silence_backoff
            conn.stall_backoff = known.stall_backoff
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_keepalive(sock)
            try:
                await asyncio.wait_for(self._handshake(sock, conn, peer, fp, timeout), timeout)
            except TimeoutError as exc:
                raise PeerTimeout(f"{peer}: handshake timed out") from exc
            await asyncio.get_running_loop().create_connection(lambda: conn, sock=sock)
        except BaseException:
            sock.close()
            raise
        return conn

    async def _handshake(self, sock: socket.socket, conn: Connection, peer: PeerAddress, fp: FingerprintDigest,
                         timeout: float) -> None:
        binding = b""
        exchange: Exchange | None = None
        chan = PlainChannel(sock)
        if self._tls is not None:
            chan = tls_chan = TlsChannel(sock, self._tls, server_side=False)
            with _handshake_step(conn.peer, "TLS handshake timed out"):
                await tls_chan.handshake(timeout)
            binding = peer_binding(tls_chan.ssl_object)
            self._check_owner_certificate(peer, peer_nodes(tls_chan.ssl_object))
            exchange = Exchange()  # TLS carries this handshake only: the frames after it are sealed (seal.py)
        nonce_c = wire.nonce()
        hello: wire.Message = {"t": "hello", "v": WIRE_VERSION, "fp": bytes(fp), "nc": nonce_c,
                               "nixl": self._want_nixl, "mac": self._payload_mac, "ack": True}
        if self._node_id is not None:
            hello["node"] = self._node_id
        if exchange is not None:
            hello["x"] = exchange.share
        asked = time.monotonic()
        await _say(chan, conn, hello, timeout)
        challenge = await _answer(chan, conn, timeout, "hello")
        hello_rtt = time.monotonic() - asked
        if challenge["t"] == "error":
            raise HandshakeError(f"{conn.peer} refused the handshake: {challenge.get('why')!r}")
        if challenge["t"] != "challenge":
            raise HandshakeError(f"{conn.peer} did not answer hello with a challenge ({challenge['t']!r})")
        shares = b""
        if exchange is not None:
            theirs = challenge.get("x")
            if not isinstance(theirs, bytes):
                raise HandshakeError(f"{conn.peer} sent no key share over TLS")
            shares = exchange.share + theirs
        t = wire.Transcript(bytes(fp), nonce_c, wire.field(challenge, "ns", bytes), binding,
                            wire.field(challenge, "node", str), self._node_id or "", shares)
        if not wire.proof_ok(wire.proof(self._secret, b"S", t), challenge.get("proof")):
            raise HandshakeError(f"{conn.peer} failed to prove the cluster secret"
                                 + (" over this TLS channel" if binding else ""))
        if t.owner != peer.node_id:  # the proof covers t.owner: a relay cannot change it
            raise PeerIdentityError(f"{peer}: answered as node {t.owner!r}, not the node {peer.node_id!r} this pull "
                                    "was planned from (its record points at another node's address, or a relay)")
        asked = time.monotonic()
        await _say(chan, conn, {"t": "auth", "proof": wire.proof(self._secret, b"C", t)}, timeout)
        if self._payload_mac:  # every chunk must carry a valid MAC under this session's key
            conn.mac_key = wire.session_key(self._secret, t)
        ready = await _answer(chan, conn, timeout, "auth")
        # One round-trip sample from the handshake, the faster of its two steps: each also measures both
        # sides' proofs and key derivation, and this node's own loop when its engine holds the GIL (a
        # first auth step took 17 ms): taken whole, the first pulls' ack timeout exceeded their allowance
        # and a stopped owner was waited for to the deadline (two runs in ten), not given up on at silence.
        conn.observe_rtt(min(hello_rtt, time.monotonic() - asked))
        if ready["t"] == "error":
            raise HandshakeError(f"{conn.peer} refused the connection: {ready.get('why')!r}")
        if ready["t"] != "ready":
            raise HandshakeError(f"{conn.peer} did not accept the handshake ({ready['t']!r})")
        nixl = ready.get("nixl")
        conn.nixl = nixl if isinstance(nixl, dict) else None
        conn.acks = ready.get("ack") is True
        if exchange is not None:
            assert isinstance(chan, TlsChannel)
            if not chan.drained():  # the owner sends nothing after ready until asked
                raise ProtocolError(f"{conn.peer}: bytes after ready")
            conn.seal = Seal(exchange.key(challenge.get("x"), wire.seal_bound(self._secret, t)), owner=False)

    def _check_owner_certificate(self, peer: PeerAddress, named: frozenset[str]) -> None:
        """The owner's certificate may serve as ``peer.node_id``: it names that node (or its engine), or
        names none and names are not required. Before a byte of the HMAC handshake."""
        if names_node(named, peer.node_id) or not (named or self._require_node_name):
            return
        why = (f"names {sorted(named)}, not the node {peer.node_id!r} this pull was planned from" if named else
               "names no node, and transfer.tls_require_node_name is on (a certificate that is no node's "
               "transfer certificate, or one shared by several nodes, would let its holder answer as any node)")
        self.refused_certificates += 1
        log.error("refusing %s as node %r: its TLS certificate %s", peer, peer.node_id, why)
        raise PeerIdentityError(f"{peer}: the owner's certificate {why}")

    def forget_except(self, live: Collection[PeerAddress]) -> None:
        """Close and drop the connections (and their locks) to peers not in ``live``; closed ones too."""
        for key in [k for k, c in self._conns.items() if k[0] not in live or c.closed]:
            self._conns.pop(key).abort(TransferError("peer left the mesh"))
        for key in [k for k, lock in self._locks.items() if k[0] not in live and not lock.locked()]:
            del self._locks[key]

    def __len__(self) -> int:
        return len(self._conns)

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.abort(TransferError("pool closed"))
        self._conns.clear()


def silence_allowed(floor: float | None, allowance: float, silence_s: float | None) -> float | None:
    """How long an owner that answers a request at once (a handshake step, an acknowledged get or pin)
    may stay silent after it before it is taken for not serving: its silence timeout ``floor`` (from its
    round trips; None: none measured, or it sends no acks: nothing is decided by silence), or longer,
    a third of the request's ``allowance`` (the time the whole pull was expected to take: an owner busy
    enough to be slower than that to acknowledge would not deliver in time either), or the caller's
    ``silence_s`` where that is shorter (a load waits on a silent owner no longer than it can afford
    beside recomputing: see ``Puller.pull``)."""
    if floor is None:
        return None
    share = allowance / SILENT_SHARE
    return max(floor, share if silence_s is None else min(share, silence_s))


@contextlib.contextmanager
def _handshake_step(peer: str, silent: str) -> Iterator[None]:
    """What a handshake step's socket and TLS errors mean: ``silent`` names a timeout."""
    try:
        yield
    except PeerTimeout as exc:
        raise PeerTimeout(f"{peer}: {silent}") from exc
    except ssl.SSLError as exc:  # a TLS alert: the owner refused this node's certificate, ...
        raise HandshakeError(f"{peer}: TLS failed during the handshake: {exc.reason or exc}") from exc
    except OSError as exc:
        raise TransferError(f"{peer}: connection lost during the handshake: {exc}") from exc


async def _say(chan: PlainChannel, conn: Connection, msg: wire.Message, timeout: float) -> None:
    """Send one handshake frame."""
    with _handshake_step(conn.peer, "the owner stopped reading during the handshake"):
        await chan.send_all(chan.frame(msg), timeout)


async def _answer(chan: PlainChannel, conn: Connection, timeout: float, asked: str) -> wire.Message:
    """The owner's answer to a handshake step, within ``timeout``, and its first byte within a third of it
    when that is longer than its silence timeout (:func:`silence_allowed`; ``ACK_FLOOR_S`` for a peer never
    heard from before: a stopped owner this node never connected to costs a third of the pull's allowance,
    not all of it): a :class:`PeerTimeout` when nothing came. A load's own ``silence_s`` does not apply: a
    first handshake of a serving owner was seen taking 17 ms (its answers carry proofs and keys)."""
    silence = min(timeout, max(conn.silence_timeout() or ACK_FLOOR_S, timeout / SILENT_SHARE))
    with _handshake_step(conn.peer, f"nothing heard in {1e3 * silence:.1f} ms after {asked}"):
        return await recv_frame(chan, silence, timeout, conn.max_frame_bytes)


async def silent_for(conn: Connection, requests: Sequence[_Request], deadline: float,
                     silence_s: float | None = None) -> float:
    """How long the owner was silent after ``requests`` were sent (no ack, no byte on the connection) when
    that passed the silence :func:`silence_allowed` (the pull's allowance runs to ``deadline``); 0.0 when
    it was heard from (or sends no acks, or the deadline comes first)."""
    sent = min(r.sent_at for r in requests)
    wait = silence_allowed(conn.ack_timeout(), deadline - sent, silence_s)
    if wait is None or wait >= remaining(deadline):
        return 0.0
    # One request heard from is enough: the owner is serving (what it still owes is the answers' wait)
    _, unheard = await asyncio.wait([r.heard for r in requests], timeout=max(0.0, sent + wait - time.monotonic()),
                                    return_when=asyncio.FIRST_COMPLETED)
    if len(unheard) == len(requests):
        await reads_settled()
    if conn.last_progress >= sent or any(r.heard.done() for r in requests):
        return 0.0
    return conn.silenced() - sent


async def reads_settled() -> None:
    """Let the loop run the reads that are ready now before a silence is decided: a timer that fired
    while this thread waited for the GIL (the engine's forward pass holds it for milliseconds) comes
    before the socket's readiness is polled, and the bytes already waiting there would be missed. Two
    yields: the first polls the sockets and queues their reads after this task, the second runs after
    them."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def stalled_for(conn: Connection, futures: Sequence[asyncio.Future[Any]], deadline: float,
                      silence_s: float | None = None, *, since: float) -> float:
    """Wait for ``futures`` (an answer the owner has begun) until ``deadline``; how long no byte came on the
    connection when that passed ``STALL_SILENCES`` times the silence :func:`silent_for` allows, times the
    connection's pause backoff (the owner stopped mid-answer; it was alive a moment ago, and may read a chunk
    from its disk between frames); 0.0 when every future is done (the backoff back to 1), or the deadline
    came with bytes still coming. Bytes of any pull on the connection count: an owner sending another answer
    first is serving. The silence is counted from ``since`` at the earliest (when the requests were sent): a
    connection's last byte may be older than the question (a pull whose ack wait the deadline cut short came
    here and was taken for stalled at once, 544 ms after another pull's last byte). A requester starved
    itself reads what waited in its socket before it looks (the loop runs ready reads before its timers'
    callbacks)."""
    allowed = silence_allowed(conn.ack_timeout(), remaining(deadline), silence_s)
    wait = math.inf if allowed is None else STALL_SILENCES * allowed * conn.stall_backoff
    while True:
        pending = [f for f in futures if not f.done()]
        if not pending:
            conn.stall_backoff = 1.0
            return 0.0
        left = remaining(deadline)
        if left <= 0:
            return 0.0
        quiet = time.monotonic() - max(conn.last_progress, since)
        if quiet >= wait:
            await reads_settled()
            quiet = time.monotonic() - max(conn.last_progress, since)
        if quiet >= wait:
            conn.stalled()
            return quiet
        await asyncio.wait(pending, timeout=min(left, wait - quiet))


class TcpTransport(GuardedTransport):
    """Pulls chunk payloads over the authenticated TCP connection itself."""

    name = "tcp"

    def __init__(self, secret: bytes, timeout_s: float = 5.0, max_frame_bytes: int = 1 << 20,
                 health: PeerHealth | None = None, payload_mac: bool | None = None,
                 tls: ssl.SSLContext | None = None, node_id: str | None = None,
                 require_node_name: bool = False) -> None:
        """``timeout_s``: connecting, and the liveness period: how long from its start a pull may still
        arrive after its load's deadline before it gives up, and how long a connection with a pull overdue
        may go without a byte before it is closed (see :func:`~.guard.guarded_pull`)."""
        self._pool = ConnectionPool(secret, timeout_s, max_frame_bytes, payload_mac=payload_mac, tls=tls,
                                    node_id=node_id, require_node_name=require_node_name)
        self._liveness_s = timeout_s
        self.health = health if health is not None else PeerHealth(2.0)

    async def _pull(self, peer: PeerAddress, fp: FingerprintDigest, keys: Sequence[Want], dst: CpuPool,
                    result: PullResult, deadline: float, silence_s: float | None) -> None:
        started = time.monotonic()
        conn = await self._pool.get(peer, fp, remaining(deadline))
        result.setup_s = time.monotonic() - started
        step = batch_size(self._pool.max_frame_bytes)
        requests = [conn.start_get(keys[i : i + step], fp, dst, result) for i in range(0, len(keys), step)]
        futures = [r.future for r in requests]

        def give_up() -> None:  # nothing more lands in our slots; other pulls on the connection go on
            for request in requests:
                conn.abandon(request)

        try:
            silent_s = await silent_for(conn, requests, deadline, silence_s)
            stalled_s = 0.0 if silent_s else await stalled_for(conn, futures, deadline, silence_s,
                                                               since=min(r.sent_at for r in requests))
            pending = [f for f in futures if not f.done()]
        except BaseException:  # cancelled
            give_up()
            raise
        if silent_s or stalled_s:
            # Nothing at all from an owner that acknowledges gets, or nothing more once its answer began: it
            # is not serving (stopped, unreachable). The load recomputes now, not at its deadline; the rest
            # may still come until the liveness deadline (a stopped owner continued), held like any overdue
            # answer (see guard.guarded_pull).
            why, reason = ((f"no ack nor byte in {1e3 * silent_s:.1f} ms", MissReason.UNANSWERED) if silent_s else
                           (f"no byte in {1e3 * stalled_s:.1f} ms mid-answer", MissReason.STALLED))
            log.info("%s: %s (%s)", conn.peer, why, conn.rtt_text())
            raise Overdue(conn, futures, give_up, silent_s or stalled_s, max(deadline, started + self._liveness_s),
                           self._liveness_s, why, reason)
        if pending:
            # Still arriving: a slow peer, or a hung one. The rest may take until the liveness deadline
            # (the answer then lands in the pool for later requests); see guard.guarded_pull.
            raise Overdue(conn, futures, give_up, deadline - started, max(deadline, started + self._liveness_s),
                           self._liveness_s, f"pull of {len(keys)} chunks ran past its deadline")
        for future in futures:
            exc = future.exception()
            if exc is not None:
                raise exc

    def forget_except(self, live: Collection[PeerAddress]) -> None:
        self._pool.forget_except(live)

    async def close(self) -> None:
        await self._pool.close()
