"""The agent's HTTP endpoint (``/metrics`` and the score API in front of it) on a bounded pool of threads, and
the scrape the tools (``status``, ``doctor``, ``verify``, ``lookup --explain``) read other nodes' metrics with.

Both face whoever can reach a port or write a node record: the server holds at most ``HTTP_WORKERS`` threads
and ``HTTP_QUEUE`` waiting connections in the engine's own process, and cuts each after ``HTTP_TIMEOUT_S``;
the scrape follows no redirect and reads at most ``MAX_SCRAPE_BYTES`` within its timeout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

HTTP_WORKERS = 4  # requests served at once: the engine's process runs the model; these threads share its GIL
HTTP_QUEUE = 16  # connections accepted beyond them, waiting for a worker; more get a 503 at once
HTTP_TIMEOUT_S = 5.0  # a connection is cut this long after it was accepted (also each read's timeout)


class _Quiet(WSGIRequestHandler):
    timeout = HTTP_TIMEOUT_S  # StreamRequestHandler: the connection's socket timeout

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
        pass


BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: 31\r\n\r\n{\"error\": \"too many requests\"}\n")


class _Bounded(WSGIServer):
    """The standard library's WSGI server on ``HTTP_WORKERS`` threads: a connection waits for one (at most
    ``HTTP_QUEUE`` of them), or gets a 503 at once, and is cut ``HTTP_TIMEOUT_S`` after it was accepted,
    however it dribbles (a client that sends a byte now and then holds no worker longer). A thread per
    connection (what ``ThreadingWSGIServer`` does) would let slow clients put threads and bodies without
    bound into the engine's own process."""

    address_family = socket.AF_INET
    request_queue_size = 64  # the listen backlog

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(HTTP_WORKERS + HTTP_QUEUE)
        self._pool = concurrent.futures.ThreadPoolExecutor(HTTP_WORKERS, thread_name_prefix="lmcache-p2p-http")
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            _busy(request)
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address, time.monotonic() + HTTP_TIMEOUT_S)

    def _serve(self, request: Any, client_address: Any, deadline: float) -> None:
        cut = threading.Timer(max(deadline - time.monotonic(), 0.0), _cut, (request,))
        try:
            if time.monotonic() >= deadline:  # waited out its time in the queue
                _busy(request)
                return
            cut.start()
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a client's broken or cut connection, as socketserver's own threads take it
            self.handle_error(request, client_address)
        finally:
            cut.cancel()
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away or timed out: nothing to print into the engine's log

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _busy(request: Any) -> None:
    with contextlib.suppress(OSError):
        request.settimeout(0.5)
        request.sendall(BUSY)


def _cut(request: Any) -> None:
    """A connection's time is up: whatever its handler waits on returns."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


class _Bounded6(_Bounded):
    address_family = socket.AF_INET6


WsgiApp = Callable[..., Iterable[bytes]]


class MetricsServer:
    """The agent's HTTP endpoint: ``/metrics`` (Prometheus), and whatever ``wrap`` adds in front of it
    (the score API), on a bounded pool of threads (:class:`_Bounded`); ``port=0`` picks a free port."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 wrap: Callable[[WsgiApp], WsgiApp] | None = None) -> None:
        app: WsgiApp = make_wsgi_app(registry)
        if wrap is not None:
            app = wrap(app)
        server = make_server(host, port, app, _Bounded6 if ":" in host else _Bounded, handler_class=_Quiet)
        assert isinstance(server, _Bounded)
        self._server = server
        self._thread = threading.Thread(target=self._server.serve_forever, name="lmcache-p2p-http", daemon=True)
        self._thread.start()
        self.port: int = self._server.server_port

    @property
    def refused(self) -> int:
        """Connections answered 503 at once: every worker busy and the queue full."""
        return self._server.refused

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


SCRAPE_TIMEOUT_S = 2.0
MAX_SCRAPE_BYTES = 4 << 20


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """Prometheus text format -> ``{"name{labels}": value}``.

    A node record's ``metrics_url`` is whatever someone wrote into etcd: only ``http``/``https``,
    no redirects, at most ``MAX_SCRAPE_BYTES``, and ``timeout`` for the whole request.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"refusing to fetch {url[:100]!r}: only http(s) URLs")
    deadline = time.monotonic() + timeout
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
        resp = conn.getresponse()
        if resp.status != 200:
            raise ValueError(f"{url}: HTTP {resp.status}")
        body = bytearray()
        while len(body) <= MAX_SCRAPE_BYTES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: no complete answer within {timeout:.1f}s")
            piece = resp.read(65536)
            if not piece:
                break
            body += piece
        if len(body) > MAX_SCRAPE_BYTES:
            raise ValueError(f"{url}: answer larger than {MAX_SCRAPE_BYTES} bytes")
    finally:
        conn.close()
    text = body.decode(errors="replace")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
