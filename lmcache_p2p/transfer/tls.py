"""TLS for the TCP transport (``transfer.tls_ca_cert``, ``tls_cert``, ``tls_key``): opt-in, all or none.

Every node holds a certificate and key issued by the cluster's CA (``lmcache-p2p certs``).
Connections are mutual TLS 1.3 under that CA: an owner refuses a client without a cluster
certificate before reading a byte of the HMAC handshake, and a requester refuses an owner
without one. Host names are not checked (peers are addressed by the IPs in their node records);
instead the handshake is *bound* to the TLS channel: both HMAC proofs cover SHA-256 of the
owner's certificate (RFC 5929 "tls-server-end-point"). A relay holding some other cluster
certificate that terminates TLS on both sides presents its own certificate to the requester, so
neither proof verifies: holding a certificate is not enough, the cluster secret is still needed,
and what crosses the wire is encrypted and integrity-protected by TLS.

A certificate may *name nodes* (``lmcache-p2p certs DIR NAME=node:NODE_ID``: a URI SAN
``urn:lmcache-p2p:node:<node id>``). A requester refuses an owner whose certificate names nodes
but not the one it planned the pull from (:class:`~lmcache_p2p.errors.PeerIdentityError`, before
the HMAC handshake); a name covers that node and its tensor-parallel ranks ``<name>-r<k>``
(``config.rank_config``). An owner refuses to start with a certificate that names nodes other
than its own. With ``transfer.tls_require_node_name`` (unset: on when this node's own certificate
names a node) a requester also refuses an owner whose certificate names no node: such a
certificate (one shared by every node, or any other certificate the CA issued) could otherwise
answer as any node. Off (one certificate shared by all), only the proofs say which node answers.

Issue transfer certificates from a CA of their own (``k8s/generate-certs.sh`` does: ``pki/transfer``
apart from ``pki/etcd``): ``transfer.tls_ca_cert`` then trusts no etcd client or server certificate,
so a key that opens etcd does not open the transfer port, and the other way round.

TLS carries the handshake only. Both sides drive an ``ssl.SSLObject`` over memory BIOs on the raw
socket (:class:`TlsChannel`) through the TLS handshake and the HMAC handshake inside it, which also
agrees on a sealing key by an ephemeral X25519 exchange; every later frame travels on the bare socket
sealed with AES-256-GCM (``seal.py``: Python's ``ssl`` moved 0.29-0.38x plain TCP's bytes, the
cipher alone 4-7x what ``ssl`` made of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..certs import NODE_URI as NODE_URI  # re-exported: requesters and tests read them here
from ..certs import names_node as names_node
from ..config import TransferConfig
from ..errors import ConfigError, HandshakeError, PeerTimeout
from .netio import PlainChannel, send_all

_READ_BYTES = 1 << 18


def _context(tc: TransferConfig, purpose: ssl.Purpose) -> ssl.SSLContext:
    assert tc.tls_ca_cert is not None and tc.tls_cert is not None and tc.tls_key is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # the handshake is bound to the owner's certificate instead (see above)
    ctx.verify_mode = ssl.CERT_REQUIRED
    if purpose is ssl.Purpose.CLIENT_AUTH:
        ctx.num_tickets = 0  # no session resumption: tickets would be bytes after the handshake for nothing
    try:
        ctx.load_verify_locations(cafile=tc.tls_ca_cert)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("transfer.tls_ca_cert", f"cannot load {tc.tls_ca_cert}: {exc}") from exc
    try:
        ctx.load_cert_chain(tc.tls_cert, tc.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("transfer.tls_cert", f"cannot load {tc.tls_cert} with key {tc.tls_key}: {exc}") from exc
    return ctx


def server_context(tc: TransferConfig) -> ssl.SSLContext:
    return _context(tc, ssl.Purpose.CLIENT_AUTH)


def client_context(tc: TransferConfig) -> ssl.SSLContext:
    return _context(tc, ssl.Purpose.SERVER_AUTH)


def cert_nodes(cert: Mapping[str, Any] | None) -> frozenset[str]:
    """The node ids a certificate names (a validated peer certificate, as ``getpeercert()`` gives it)."""
    sans = (cert or {}).get("subjectAltName", ())
    return frozenset(v[len(NODE_URI):] for k, v in sans if k == "URI" and v.startswith(NODE_URI))


def peer_nodes(ssl_object: ssl.SSLObject | None) -> frozenset[str]:
    """:func:`cert_nodes` of the certificate the other side presented (verified under the CA)."""
    return cert_nodes(ssl_object.getpeercert() if ssl_object is not None else None)


def own_nodes(server: ssl.SSLContext, client: ssl.SSLContext) -> frozenset[str]:
    """:func:`cert_nodes` of this node's own certificate, read the way a peer reads it: through a TLS
    handshake in memory between our server and client contexts (``ssl`` has no public certificate
    parser). A certificate the CA does not vouch for fails here, at start, instead of at every peer."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    sides = [client.wrap_bio(c_in, c_out, server_side=False), server.wrap_bio(s_in, s_out, server_side=True)]
    pending = list(sides)
    try:
        for _ in range(8):
            for side in list(pending):
                with contextlib.suppress(ssl.SSLWantReadError):
                    side.do_handshake()
                    pending.remove(side)
            s_in.write(c_out.read())
            c_in.write(s_out.read())
            if not pending:
                return cert_nodes(sides[0].getpeercert())
    except ssl.SSLError as exc:
        raise ConfigError("transfer.tls_cert", f"not usable under transfer.tls_ca_cert: {exc.reason or exc}") from exc
    raise ConfigError("transfer.tls_cert", "a TLS handshake with itself did not complete")


def cert_binding(der: bytes) -> bytes:
    """The channel binding both HMAC proofs cover: SHA-256 of the owner's certificate (DER)."""
    return hashlib.sha256(der).digest()


def own_binding(cert_path: str) -> bytes:
    """:func:`cert_binding` of the first certificate in a PEM file (this owner's own)."""
    pem = Path(cert_path).read_text()
    end = pem.find("-----END CERTIFICATE-----")
    if end < 0:
        raise ConfigError("transfer.tls_cert", f"{cert_path} holds no PEM certificate")
    return cert_binding(ssl.PEM_cert_to_DER_cert(pem[: end + len("-----END CERTIFICATE-----")]))


def peer_binding(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> bytes:
    """:func:`cert_binding` of the certificate the owner presented on this connection."""
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise HandshakeError("the owner presented no certificate")
    return cert_binding(der)


class TlsChannel(PlainChannel):
    """TLS over a non-blocking socket, either side: exact reads and ordered sends with deadlines. It carries
    the handshake; the frames after it are sealed on the bare socket (``seal.py``)."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool = True) -> None:
        super().__init__(sock)
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = ctx.wrap_bio(self._in, self._out, server_side=server_side)
        self._buf = bytearray(_READ_BYTES)

    @property
    def ssl_object(self) -> ssl.SSLObject:
        return self._ssl

    def drained(self) -> bool:
        """Nothing received is left unread: the socket may carry other bytes from here on."""
        return not self._in.pending and not self._ssl.pending()

    async def handshake(self, timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush(deadline)
                await self._fill(deadline)
        await self._flush(deadline)

    async def recv_exact(self, buf: memoryview, timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        pos = 0
        while pos < len(buf):
            try:
                n: int = self._ssl.read(len(buf) - pos, buf[pos:])  # type: ignore[assignment]  # into buf
            except ssl.SSLWantReadError:
                await self._flush(deadline)  # TLS 1.3 may owe the peer records (tickets, key updates)
                await self._fill(deadline)
                continue
            except ssl.SSLZeroReturnError as exc:
                raise ConnectionResetError("peer closed the TLS session") from exc
            if n == 0:
                raise ConnectionResetError("peer closed the connection")
            pos += n

    async def send_all(self, buffers: Sequence[bytes | memoryview], timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        for b in buffers:
            self._ssl.write(b)  # encrypts into the outgoing BIO (the one copy TLS needs)
        await self._flush(deadline)

    async def _fill(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise PeerTimeout("TLS: no data in time")
        try:
            n = await asyncio.wait_for(loop.sock_recv_into(self.sock, self._buf), remaining)
        except TimeoutError as exc:
            raise PeerTimeout("TLS: no data in time") from exc
        if n == 0:
            raise ConnectionResetError("peer closed the connection")
        self._in.write(memoryview(self._buf)[:n])

    async def _flush(self, deadline: float) -> None:
        if self._out.pending:
            remaining = max(0.0, deadline - asyncio.get_running_loop().time())
            await send_all(self.sock, [self._out.read()], remaining)
