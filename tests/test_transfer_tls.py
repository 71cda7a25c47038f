"""TLS on the TCP transport, between real processes: mutual TLS under the cluster CA, the HMAC
handshake bound to the owner's certificate, and what a relay on the path can and cannot do."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from relay import Relay

from lmcache_p2p.aio import LoopThread
from lmcache_p2p.certs import make_certs
from lmcache_p2p.config import AgentConfig, TransferConfig
from lmcache_p2p.errors import ConfigError, PeerIdentityError, TransferError
from lmcache_p2p.ids import PeerAddress
from lmcache_p2p.keys import ChunkKey, FingerprintDigest
from lmcache_p2p.testing.peer_process import OwnerProcess, demo_chunk
from lmcache_p2p.tiers.cpu_pool import CpuPool
from lmcache_p2p.transfer.base import MissReason, PullResult
from lmcache_p2p.transfer.client import ConnectionPool, TcpTransport
from lmcache_p2p.transfer.seal import TAG
from lmcache_p2p.transfer.stack import TransferStack
from lmcache_p2p.transfer.tls import client_context, server_context

SECRET = "tls-test-secret-7f3a9c1e5b2d80461c9e4a7b0c"
FP = FingerprintDigest(b"tls-fingerprint!")
SIZE = 256 << 10
N = 8


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_certs(d, ["owner", "requester", "mallory"])  # mallory: a valid cluster certificate, no secret
    make_certs(d / "other", ["stranger"])  # another CA altogether
    return d


def tls_config(pki: Path, name: str, ca: Path | None = None) -> TransferConfig:
    return TransferConfig(tls_ca_cert=str(ca or pki / "ca.crt"), tls_cert=str(pki / f"{name}.crt"),
                          tls_key=str(pki / f"{name}.key"))


@pytest.fixture(scope="module")
def owner(pki: Path) -> Iterator[OwnerProcess]:
    o = OwnerProcess(SECRET, FP, N, SIZE, seed=7,
                     tls=(str(pki / "ca.crt"), str(pki / "owner.crt"), str(pki / "owner.key")))
    yield o
    o.close()


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread("tls-test")
    yield lt
    lt.stop()


def pull(loop: LoopThread, client: TcpTransport, port: int, keys: list[ChunkKey], pool: CpuPool,
         timeout: float = 5.0, node: str = "owner") -> PullResult:
    try:
        deadline = time.monotonic() + timeout
        return loop.run(client.pull(PeerAddress("127.0.0.1", port, node), FP, keys, pool, deadline), timeout + 10)
    finally:
        loop.run(client.close(), 10)


@pytest.mark.parametrize("payload_mac", [None, True])
def test_tls_pulls_are_byte_exact(owner: OwnerProcess, pki: Path, loop: LoopThread, payload_mac: bool | None) -> None:
    pool = CpuPool(SIZE * (N + 2), SIZE)
    keys = [owner.key(i) for i in range(N)]
    client = TcpTransport(SECRET.encode(), 3.0, tls=client_context(tls_config(pki, "requester")),
                          payload_mac=payload_mac)  # with the MAC asked for too (one certificate shared by all)
    result = pull(loop, client, owner.port, keys, pool)
    assert len(result.loaded) == N and not result.missed
    for i, key in enumerate(keys):
        out = np.empty(SIZE, np.uint8)
        assert pool.read_into(key, out.data) is not None
        np.testing.assert_array_equal(out, demo_chunk(owner.seed, i, SIZE, FP)[1])


def test_tls_owner_refuses_plain_tcp_strangers_and_wrong_secrets(owner: OwnerProcess, pki: Path,
                                                                   loop: LoopThread) -> None:
    keys = [owner.key(i) for i in range(2)]
    before = owner.command({"cmd": "stats"})["rejected"]
    clients = [
        TcpTransport(SECRET.encode(), 3.0),  # no TLS at all
        # trusts the cluster CA, but its own certificate comes from another CA
        TcpTransport(SECRET.encode(), 3.0, tls=client_context(tls_config(pki / "other", "stranger", pki / "ca.crt"))),
        # a cluster certificate, not the secret: the owner's proof fails at the requester, which hangs up
        TcpTransport(b"x" * 40, 3.0, tls=client_context(tls_config(pki, "requester"))),
    ]
    for client in clients:
        pool = CpuPool(SIZE * 4, SIZE)
        result = pull(loop, client, owner.port, keys, pool)
        assert not result.loaded and set(result.missed.values()) == {MissReason.PEER_ERROR}
        assert len(pool) == 0
    assert owner.command({"cmd": "stats"})["rejected"] - before == 2  # refused before the HMAC handshake


def test_requester_refuses_an_owner_without_a_cluster_certificate(pki: Path, loop: LoopThread) -> None:
    other = pki / "other"
    stranger = OwnerProcess(SECRET, FP, 2, SIZE,
                            tls=(str(other / "ca.crt"), str(other / "stranger.crt"), str(other / "stranger.key")))
    try:
        pool = CpuPool(SIZE * 4, SIZE)
        client = TcpTransport(SECRET.encode(), 3.0, tls=client_context(tls_config(pki, "requester")))
        result = pull(loop, client, stranger.port, [stranger.key(0)], pool)
        assert not result.loaded and len(pool) == 0
    finally:
        stranger.close()


class TerminatingRelay:
    """A man in the middle holding a *valid* cluster certificate (no cluster secret): it terminates
    TLS towards the requester and opens its own TLS session to the owner, relaying the plaintext.

    On an asyncio loop of its own: an SSL socket read in one thread while another writes it (a
    blocking relay's two pipes) can stall on TLS 1.3's post-handshake messages."""

    def __init__(self, target_port: int, pki: Path) -> None:
        cfg = tls_config(pki, "mallory")
        self._server_ctx, self._client_ctx = server_context(cfg), client_context(cfg)
        self._target = target_port
        self.relayed = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._session, "127.0.0.1", 0, ssl=self._server_ctx))
        self.port: int = self._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:  # the requester's TLS session is up (asyncio finished its handshake before calling us)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target, ssl=self._client_ctx)
        except (OSError, ssl.SSLError):
            writer.close()
            return
        self._writers.add(up_writer)
        self.relayed += 1

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ssl.SSLError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            for writer in self._writers:
                writer.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await writer.wait_closed()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def test_a_relay_with_a_cluster_certificate_cannot_pass_the_bound_handshake(owner: OwnerProcess, pki: Path,
                                                                            loop: LoopThread) -> None:
    relay = TerminatingRelay(owner.port, pki)
    try:
        pool = CpuPool(SIZE * 4, SIZE)
        # generous deadlines: two TLS handshakes through a Python relay on a loaded machine must finish,
        # so that what refuses is the channel binding, not a timeout
        client = TcpTransport(SECRET.encode(), 15.0, tls=client_context(tls_config(pki, "requester")))
        result = pull(loop, client, relay.port, [owner.key(0), owner.key(1)], pool, timeout=15.0)
        assert relay.relayed == 1  # both TLS sessions were up: only the channel binding stopped it
        assert not result.loaded and set(result.missed.values()) == {MissReason.PEER_ERROR}
        assert len(pool) == 0
    finally:
        relay.close()


class FlippingRelay(Relay):
    """Flips one bit of the owner's stream 64 KiB in: inside a chunk payload, after the handshake."""

    def downstream(self, owner: socket.socket, requester: socket.socket) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while data := owner.recv(16384):
                if seen <= 65536 < seen + len(data):
                    data = bytearray(data)
                    data[65536 - seen] ^= 0x10
                seen += len(data)
                requester.sendall(data)


def test_bytes_changed_on_the_path_never_land(owner: OwnerProcess, pki: Path, loop: LoopThread) -> None:
    relay = FlippingRelay(owner.port)
    try:
        pool = CpuPool(SIZE * (N + 2), SIZE)
        keys = [owner.key(i) for i in range(N)]
        client = TcpTransport(SECRET.encode(), 3.0, tls=client_context(tls_config(pki, "requester")))
        result = pull(loop, client, relay.port, keys, pool)
        assert not result.loaded and set(result.missed.values()) == {MissReason.PEER_ERROR}
        assert len(pool) == 0  # TLS broke the connection at the changed record: nothing committed
    finally:
        relay.close()


class RecordingRelay(Relay):
    """Keeps every byte the owner sends."""

    def __init__(self, target_port: int) -> None:
        self.recorded = bytearray()
        super().__init__(target_port)

    def downstream(self, owner: socket.socket, requester: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := owner.recv(16384):
                self.recorded += data
                requester.sendall(data)


def test_after_the_tls_handshake_every_chunk_crosses_sealed(owner: OwnerProcess, pki: Path, loop: LoopThread) -> None:
    relay = RecordingRelay(owner.port)
    try:
        pool = CpuPool(SIZE * (N + 2), SIZE)
        keys = [owner.key(i) for i in range(N)]
        client = TcpTransport(SECRET.encode(), 5.0, tls=client_context(tls_config(pki, "requester")))
        result = pull(loop, client, relay.port, keys, pool)
        assert len(result.loaded) == N and not result.missed
        for i, key in enumerate(keys):
            out = np.empty(SIZE, np.uint8)
            assert pool.read_into(key, out.data) is not None
            sent = demo_chunk(owner.seed, i, SIZE, FP)[1]
            np.testing.assert_array_equal(out, sent)
            assert sent[1000:1064].tobytes() not in relay.recorded  # nothing in the clear
        # TLS carried the handshake, then stepped aside: each chunk's frame prefix is on the wire as it is,
        # announcing the payload sealed with its tag (inside TLS records it would be encrypted too)
        assert relay.recorded.count(struct.pack("<I", SIZE + TAG)) >= N
    finally:
        relay.close()


def test_tls_config_is_all_or_nothing_and_names_the_field(pki: Path) -> None:
    with pytest.raises(ConfigError, match="transfer.tls_key"):
        TransferConfig(tls_ca_cert=str(pki / "ca.crt"), tls_cert=str(pki / "owner.crt"))
    with pytest.raises(ConfigError, match="transfer.tls_cert"):
        server_context(TransferConfig(tls_ca_cert=str(pki / "ca.crt"), tls_cert=str(pki / "missing.crt"),
                                      tls_key=str(pki / "owner.key")))
    with pytest.raises(ConfigError, match="transfer.tls_ca_cert"):
        client_context(TransferConfig(tls_ca_cert=str(pki / "missing.crt"), tls_cert=str(pki / "owner.crt"),
                                      tls_key=str(pki / "owner.key")))
    with pytest.raises(ConfigError, match="transfer.tls_cert"):  # a key that is not the certificate's
        server_context(TransferConfig(tls_ca_cert=str(pki / "ca.crt"), tls_cert=str(pki / "owner.crt"),
                                      tls_key=str(pki / "mallory.key")))
    assert not TransferConfig().tls and tls_config(pki, "owner").tls


@pytest.fixture(scope="module")
def named_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per-node certificates: each names its node (``lmcache-p2p certs DIR NAME=node:NAME``)."""
    d = tmp_path_factory.mktemp("named-pki")
    make_certs(d, ["eng=node:eng", "other=node:other", "requester=node:requester"])
    return d


def owner_with(pki: Path, cert: str, node_id: str) -> OwnerProcess:
    return OwnerProcess(SECRET, FP, 2, SIZE, seed=7, node_id=node_id,
                        tls=(str(pki / "ca.crt"), str(pki / f"{cert}.crt"), str(pki / f"{cert}.key")))


def handshake(loop: LoopThread, pki: Path, peer: PeerAddress) -> None:
    pool = ConnectionPool(SECRET.encode(), 3.0, 1 << 20, tls=client_context(tls_config(pki, "requester")))

    async def run() -> None:
        try:
            await pool.get(peer, FP, 5.0)
        finally:
            await pool.close()

    loop.run(run(), 15)


def test_a_certificate_naming_a_node_serves_only_as_that_node_and_its_ranks(named_pki: Path,
                                                                            loop: LoopThread) -> None:
    o = owner_with(named_pki, "eng", "eng-r1")  # rank 1 of engine "eng": its certificate names "eng"
    try:
        pool = CpuPool(SIZE * 4, SIZE)
        client = TcpTransport(SECRET.encode(), 3.0, tls=client_context(tls_config(named_pki, "requester")))
        assert pull(loop, client, o.port, [o.key(0), o.key(1)], pool, node="eng-r1").complete
        # planned as another node: refused on the certificate, before a byte of the handshake
        with pytest.raises(PeerIdentityError, match=r"certificate names \['eng'\], not the node 'other'"):
            handshake(loop, named_pki, PeerAddress("127.0.0.1", o.port, "other"))
        # a name covers the engine's ranks; which rank answers is still the proof's to say
        with pytest.raises(PeerIdentityError, match="answered as node 'eng-r1', not the node 'eng-r0'"):
            handshake(loop, named_pki, PeerAddress("127.0.0.1", o.port, "eng-r0"))
        assert o.command({"cmd": "stats"})["rejected"] == 0  # the owner was never asked for anything
    finally:
        o.close()


def test_an_owner_refuses_to_start_with_another_nodes_certificate(named_pki: Path,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TransferError, match="did not answer|failed to start"):
        owner_with(named_pki, "other", "eng")
    err = capfd.readouterr().err
    assert "transfer.tls_cert: " in err and "names the nodes ['other'], not this node 'eng'" in err


def test_an_unnamed_certificate_is_refused_as_any_node_where_names_are_required(named_pki: Path,
                                                                                loop: LoopThread) -> None:
    """Per-node certificates (``transfer.tls_require_node_name``, on by default when one's own
    certificate names a node): an owner presenting a certificate of the same CA that names no node
    (one shared by all, or any other the CA issued) is refused as the node it claims, before the HMAC
    handshake, counted and logged; a node with names off (a shared certificate) still accepts it."""
    make_certs(named_pki, ["unnamed"])
    o = owner_with(named_pki, "unnamed", "eng")  # holds the secret, claims to be "eng"
    try:
        keys, peer = [o.key(0), o.key(1)], PeerAddress("127.0.0.1", o.port, "eng")
        ctx = client_context(tls_config(named_pki, "requester"))
        strict = ConnectionPool(SECRET.encode(), 3.0, 1 << 20, tls=ctx, require_node_name=True)

        async def connect() -> None:
            try:
                await strict.get(peer, FP, 5.0)
            finally:
                await strict.close()

        with pytest.raises(PeerIdentityError, match="the owner's certificate names no node"):
            loop.run(connect(), 15)
        assert strict.refused_certificates == 1
        pool = CpuPool(SIZE * 4, SIZE)
        client = TcpTransport(SECRET.encode(), 3.0, tls=ctx, require_node_name=True)
        result = pull(loop, client, o.port, keys, pool, node="eng")
        assert not result.loaded and set(result.missed.values()) == {MissReason.PEER_ERROR} and len(pool) == 0
        assert client.health.failures(peer) == 1  # a peer error: backed off
        assert o.command({"cmd": "stats"})["rejected"] == 0  # refused on the certificate, nothing asked
        lax = TcpTransport(SECRET.encode(), 3.0, tls=ctx, require_node_name=False)
        assert pull(loop, lax, o.port, keys, pool, node="eng").complete  # names off: only the proofs tell
    finally:
        o.close()


def test_the_default_requires_names_when_this_nodes_own_certificate_names_it(named_pki: Path) -> None:
    make_certs(named_pki, ["unnamed"])
    pool = CpuPool(SIZE * 2, SIZE)

    def requires(cert: str, node: str, setting: bool | None = None) -> bool:
        tc = dataclasses.replace(tls_config(named_pki, cert), tls_require_node_name=setting)
        stack = TransferStack.build(AgentConfig(node_id=node, transfer=tc), pool, [FP], SECRET.encode())
        return stack.control.require_node_name

    assert requires("requester", "requester")  # a per-node certificate: on
    assert not requires("unnamed", "x")  # one shared by all: off (only the proofs tell nodes apart)
    assert requires("unnamed", "x", True) and not requires("requester", "requester", False)
    with pytest.raises(ConfigError, match="transfer.tls_require_node_name"):
        TransferConfig(tls_require_node_name=True)  # without TLS


@pytest.fixture(scope="module")
def split_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As ``k8s/generate-certs.sh`` issues them: an etcd CA and a transfer CA (same subject name)."""
    d = tmp_path_factory.mktemp("split-pki")
    make_certs(d / "etcd", ["etcd-client", "etcd-server=DNS:localhost"])
    make_certs(d / "transfer", ["eng=node:eng", "requester=node:requester"])
    return d


def test_an_etcd_certificate_is_refused_on_the_transfer_port(split_pki: Path, loop: LoopThread) -> None:
    """The etcd client key is in every agent and router pod: with the transfer CA apart from etcd's,
    an owner presenting it (with the secret, as any node) fails TLS, and so does a requester."""
    etcd, transfer = split_pki / "etcd", split_pki / "transfer"
    assert (etcd / "ca.crt").read_bytes() != (transfer / "ca.crt").read_bytes()
    for cert in ("etcd-client", "etcd-server"):
        o = OwnerProcess(SECRET, FP, 2, SIZE, node_id="eng",
                         tls=(str(etcd / "ca.crt"), str(etcd / f"{cert}.crt"), str(etcd / f"{cert}.key")))
        try:
            pool = CpuPool(SIZE * 4, SIZE)
            client = TcpTransport(SECRET.encode(), 3.0, tls=client_context(tls_config(transfer, "requester")),
                                  require_node_name=True)
            result = pull(loop, client, o.port, [o.key(0)], pool, node="eng")
            assert not result.loaded and set(result.missed.values()) == {MissReason.PEER_ERROR}, cert
            assert len(pool) == 0
        finally:
            o.close()
    o = owner_with(transfer, "eng", "eng")
    try:
        before = o.command({"cmd": "stats"})["rejected"]
        pool = CpuPool(SIZE * 4, SIZE)
        as_requester = client_context(tls_config(etcd, "etcd-client", transfer / "ca.crt"))
        result = pull(loop, TcpTransport(SECRET.encode(), 3.0, tls=as_requester), o.port, [o.key(0)], pool,
                      node="eng")
        assert not result.loaded and len(pool) == 0
        deadline = time.monotonic() + 10  # the owner counts it once its side of the TLS handshake gives up
        while o.command({"cmd": "stats"})["rejected"] - before < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert o.command({"cmd": "stats"})["rejected"] - before == 1  # refused in TLS, before the handshake
        client = TcpTransport(SECRET.encode(), 3.0, tls=client_context(tls_config(transfer, "requester")))
        assert pull(loop, client, o.port, [o.key(0)], pool, node="eng").complete
    finally:
        o.close()
