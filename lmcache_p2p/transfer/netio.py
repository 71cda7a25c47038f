"""Socket helpers: zero-copy exact reads and scatter sends with deadlines (owner side), TCP keep-alive."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

from ..errors import PeerTimeout


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
    """The owner's side of one plain TCP connection (see :class:`~.tls.TlsChannel` for TLS)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def recv_exact(self, buf: memoryview, timeout: float) -> None:
        await recv_exact(self.sock, buf, timeout)

    async def send_all(self, buffers: Sequence[bytes | memoryview], timeout: float) -> None:
        await send_all(self.sock, buffers, timeout)


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
