"""Hostile bytes against a live owner: it refuses, sends no payload, and keeps serving others."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_p2p.errors import HandshakeError
from lmcache_p2p.ids import WIRE_VERSION
from lmcache_p2p.keys import FingerprintDigest
from lmcache_p2p.testing.peer_process import OwnerProcess
from lmcache_p2p.tiers.cpu_pool import CpuPool
from lmcache_p2p.transfer import wire
from lmcache_p2p.transfer.client import ConnectionPool, TcpTransport

SECRET = "fuzz-secret-7f3a9c1e5b2d80461c9e4a7b"
FP = FingerprintDigest(b"fuzz-fingerprint")
SIZE = 64 << 10


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    transports = "tcp"
    with OwnerProcess(SECRET, FP, 8, SIZE, transports=transports, timeout_s=1.0) as o:
        yield o


def exchange(port: int, data: bytes, timeout: float = 3.0) -> list[tuple[dict[str, object], int]]:
    """Send ``data``, half-close, and parse every frame the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may already have closed on us
        received = b""
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    frames = []
    while len(received) >= wire.PREFIX_SIZE:
        header_len, payload_len = wire.PREFIX.unpack_from(received)
        body = received[wire.PREFIX_SIZE : wire.PREFIX_SIZE + header_len]
        frames.append((msgpack.unpackb(body), payload_len))
        received = received[wire.PREFIX_SIZE + header_len + payload_len :]
    return frames


def assert_nothing_served(frames: list[tuple[dict[str, object], int]]) -> None:
    for msg, payload_len in frames:
        assert payload_len == 0, msg
        assert msg.get("t") in ("challenge", "error"), msg


def frame(msg: object, payload_len: int = 0) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack("<II", len(body), payload_len) + body


def hello(version: int = WIRE_VERSION, fp: bytes = FP) -> bytes:
    return frame({"t": "hello", "v": version, "fp": fp, "nc": os.urandom(32), "nixl": False})


def good_pull(o: OwnerProcess) -> None:
    import asyncio

    async def run() -> int:
        client = TcpTransport(SECRET.encode(), 2.0)
        pool = CpuPool(SIZE * 4, SIZE)
        result = await client.pull(o.peer, FP, [o.key(0), o.key(1)], pool, time.monotonic() + 3.0)
        await client.close()
        return len(result.loaded)

    assert asyncio.run(run()) == 2


def test_wrong_version_and_fingerprint_are_refused(owner: OwnerProcess) -> None:
    frames = exchange(owner.port, hello(version=WIRE_VERSION + 1))
    assert frames == [({"t": "error", "why": "version"}, 0)]
    # Before its proof a client learns nothing about the fingerprints served: just a challenge.
    frames = exchange(owner.port, hello(fp=b"x" * 16))
    assert [msg["t"] for msg, _ in frames] == ["challenge"]
    # After a valid proof it is told the fingerprint is not served here.
    import asyncio

    async def wrong_fingerprint() -> None:
        pool = ConnectionPool(SECRET.encode(), 2.0, 1 << 20)
        try:
            await pool.get(owner.peer, FingerprintDigest(b"x" * 16), 3.0)
        finally:
            await pool.close()

    with pytest.raises(HandshakeError, match="fingerprint"):
        asyncio.run(wrong_fingerprint())
    good_pull(owner)


def test_requests_without_auth_or_with_a_bad_proof_get_nothing(owner: OwnerProcess) -> None:
    get = frame({"t": "get", "id": 1, "keys": [owner.key(0)]})
    assert_nothing_served(exchange(owner.port, get))
    assert_nothing_served(exchange(owner.port, hello() + get))
    assert_nothing_served(exchange(owner.port, hello() + frame({"t": "auth", "proof": b"\0" * 32}) + get))
    good_pull(owner)


def test_oversized_truncated_and_payload_frames_close_the_connection(owner: OwnerProcess) -> None:
    assert exchange(owner.port, struct.pack("<II", 1 << 30, 0) + b"x" * 100) == []
    assert exchange(owner.port, hello()[:-5]) == []
    assert exchange(owner.port, struct.pack("<II", 4, 10) + msgpack.packb({"t": "x"})) == []
    assert exchange(owner.port, b"\x01\x02\x03") == []
    good_pull(owner)


_msg = st.dictionaries(
    st.sampled_from(["t", "v", "fp", "nc", "id", "keys", "proof", "lease", "nixl"]),
    st.one_of(st.integers(-2, 2**40), st.binary(max_size=40), st.text(max_size=8),
              st.sampled_from(["hello", "auth", "get", "pin", "release"]),
              st.lists(st.binary(max_size=17), max_size=4)),
    max_size=6,
)
_frame = st.one_of(
    st.binary(max_size=64),
    _msg.map(frame),
    st.tuples(_msg, st.integers(0, 2**32 - 1)).map(lambda mp: frame(mp[0], mp[1])),
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(max_size=32)).map(
        lambda t: struct.pack("<II", t[0], t[1]) + t[2]),
    st.just(hello()),
)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(_frame, min_size=1, max_size=8))
def test_fuzzed_frames_never_get_a_payload(owner: OwnerProcess, frames: list[bytes]) -> None:
    assert_nothing_served(exchange(owner.port, b"".join(frames)))


@pytest.mark.slow
def test_server_still_serves_after_fuzzing(owner: OwnerProcess) -> None:
    good_pull(owner)
