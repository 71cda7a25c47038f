"""A TCP relay between a requester and an owner, for tests that put something on the network path.

``Relay(listen_host, listen_port, target_port)`` forwards every connection to ``127.0.0.1:target_port``;
subclasses decide how the owner-to-requester direction is carried (``downstream``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Relay:
    def __init__(self, target_port: int, host: str = "127.0.0.1", port: int = 0) -> None:
        self._target = target_port
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            threading.Thread(target=self.pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self.downstream, args=(server, client), daemon=True).start()

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
