"""Socket helpers: zero-copy exact reads and scatter sends with deadlines (owner side), TCP keep-alive,
staggered connect attempts (requester side)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from ..errors import PeerTimeout, ProtocolError
from . import wire

T = TypeVar("T")


async def recv_exact(sock: socket.socket, buf: memoryview, timeout: float) -> None:
    """Fill ``buf`` from ``sock`` within ``timeout`` seconds; EOF raises ``ConnectionResetError``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pos = 0
    while pos < len(buf):
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise PeerTimeout(f"no data within {timeout:.1f}s")
        try:
            n = await asyncio.wait_for(loop.sock_recv_into(sock, buf[pos:]), remaining)
        except TimeoutError as exc:
            raise PeerTimeout(f"no data within {timeout:.1f}s") from exc
        if n == 0:
            raise ConnectionResetError("peer closed the connection")
        pos += n


async def send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview], timeout: float) -> None:
    """``sendmsg`` the buffers in order, without copying them, within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        try:
            sent = sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            sent = 0
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        if views:
            await _writable(loop, sock, deadline)


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket, deadline: float) -> None:
    fut: asyncio.Future[bool] = loop.create_future()

    def settle(ready: bool) -> None:
        if not fut.done():
            fut.set_result(ready)

    fd = sock.fileno()
    loop.add_writer(fd, settle, True)
    timer = loop.call_at(deadline, settle, False)
    try:
        ready = await fut
    finally:
        timer.cancel()
        loop.remove_writer(fd)
    if not ready:
        raise PeerTimeout("peer stopped reading")


class PlainChannel:
    """One plain TCP connection as the owner serves it and either side runs its handshake on (see
    :class:`~.tls.TlsChannel` for TLS, :class:`~.seal.SealedChannel` for what follows a TLS handshake)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def recv_exact(self, buf: memoryview, timeout: float) -> None:
        await recv_exact(self.sock, buf, timeout)

    async def send_all(self, buffers: Sequence[bytes | memoryview], timeout: float) -> None:
        await send_all(self.sock, buffers, timeout)

    def frame(self, msg: wire.Message, payload: memoryview | None = None) -> list[bytes | memoryview]:
        """The buffers of one frame, to pass to :meth:`send_all` in order (the payload is not copied)."""
        head = wire.encode(msg, 0 if payload is None else len(payload))
        return [head] if payload is None else [head, payload]

    def open(self, prefix: bytes | memoryview, body: bytes | memoryview) -> bytes | memoryview:
        """A received frame's body as sent (a sealed channel opens it here)."""
        return body


async def recv_frame(chan: PlainChannel, first_byte_timeout: float, timeout: float,
                     max_frame_bytes: int) -> wire.Message:
    """The next frame's message; a frame with a payload is a :class:`ProtocolError` (only the owner's chunk
    frames carry one, and those are read by ``connection.py``). Its first byte within ``first_byte_timeout``,
    the rest within ``timeout`` each."""
    prefix = bytearray(wire.PREFIX_SIZE)
    await chan.recv_exact(memoryview(prefix)[:1], first_byte_timeout)
    await chan.recv_exact(memoryview(prefix)[1:], timeout)
    header_len, payload_len = wire.decode_prefix(prefix, max_frame_bytes)
    if payload_len:
        raise ProtocolError(f"peer sent a {payload_len}-byte payload where none is due")
    body = bytearray(header_len)
    await chan.recv_exact(memoryview(body), timeout)
    return wire.decode(chan.open(bytes(prefix), memoryview(body)))


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3


def set_keepalive(sock: socket.socket | None) -> None:
    """TCP keep-alive: a peer that vanished without a FIN (power loss, partition) is noticed in ~25 s
    even on an idle pooled connection."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                       ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


CONNECT_STAGGER_S = 0.25  # a connect attempt not answered by then gets a fresh one beside it
CONNECT_ATTEMPTS = 4  # in flight at once: each one the owner may accept, then see closed unused


async def staggered_connect(attempt: Callable[[], Awaitable[T]], discard: Callable[[T], None], timeout: float,
                            every_s: float = CONNECT_STAGGER_S, most: int = CONNECT_ATTEMPTS) -> T:
    """The first of several connect attempts to succeed, a new one started every ``every_s`` while none has.

    A SYN lost on the way (a link that just came back from a partition, a lossy path) is sent again by
    the kernel only after a second (each second on Linux >= 6.5, doubling from 1 s before): a large
    share of a load deadline. A fresh attempt every ``every_s``
    bounds that wait to ``every_s`` once the path works. An attempt that fails with an answer (refused,
    unreachable) ends the connect at once: that answer will not change in a quarter-second. Attempts
    that complete after the winner are closed with ``discard``. Raises ``TimeoutError`` past ``timeout``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending: set[asyncio.Task[T]] = set()
    try:
        while True:
            if len(pending) < most:
                pending.add(asyncio.ensure_future(attempt()))
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            done, pending = await asyncio.wait(pending, timeout=min(every_s, left),
                                               return_when=asyncio.FIRST_COMPLETED)
            winners = [task.result() for task in done if task.exception() is None]
            if winners:
                for extra in winners[1:]:
                    discard(extra)
                return winners[0]
            answers = [exc for task in done if (exc := task.exception()) is not None]
            if answers:
                raise answers[0]  # refused, unreachable, ...: the path answered
    finally:
        for task in pending:
            task.cancel()
        # One may have completed meanwhile: close it, never leak it.
        for result in await asyncio.gather(*pending, return_exceptions=True):
            if not isinstance(result, BaseException):
                discard(result)


async def connect_tcp(host: str, port: int, timeout: float) -> socket.socket:
    """A connected non-blocking TCP socket: :func:`staggered_connect` attempts, so a lost SYN costs
    ``CONNECT_STAGGER_S``, not the kernel's 1 s retransmission timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    refused: OSError | None = None
    for family, kind, proto, _, address in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):

        async def attempt(family: int = family, kind: int = kind, proto: int = proto,
                          address: Any = address) -> socket.socket:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, address)
            except BaseException:
                sock.close()
                raise
            return sock

        try:
            return await staggered_connect(attempt, socket.socket.close, max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise
        except OSError as exc:  # refused or unreachable at this address (::1 of a dual-stack name): the next
            refused = exc
    raise refused if refused is not None else OSError(f"{host}: no address to connect to")
