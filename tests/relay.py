"""A TCP relay between a requester and an owner, for tests that put something on the network path.

``Relay(listen_host, listen_port, target_port)`` forwards every connection to ``127.0.0.1:target_port``;
subclasses decide how the owner-to-requester direction is carried (``downstream``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable


class Relay:
    def __init__(self, target_port: int, host: str = "127.0.0.1", port: int = 0) -> None:
        self._target = target_port
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            threading.Thread(target=self._carry, args=(self.pipe, client, server), daemon=True).start()
            threading.Thread(target=self._carry, args=(self.downstream, server, client), daemon=True).start()

    @staticmethod
    def _carry(direction: Callable[[socket.socket, socket.socket], None], src: socket.socket,
               dst: socket.socket) -> None:
        """One direction of a connection; when it ends, both sockets are shut (waking the other direction)
        and this one's source is closed: every socket is closed by the thread that reads it."""
        try:
            direction(src, dst)
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            src.close()

    @staticmethod
    def pipe(src: socket.socket, dst: socket.socket, rate: int | None = None) -> None:
        """Copy ``src`` to ``dst`` until either closes; at most ``rate`` bytes per second if given."""
        with contextlib.suppress(OSError):
            while data := src.recv(16384):
                dst.sendall(data)
                if rate is not None:
                    time.sleep(len(data) / rate)

    def downstream(self, owner: socket.socket, requester: socket.socket) -> None:
        self.pipe(owner, requester)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:  # their threads wake up and close them
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
