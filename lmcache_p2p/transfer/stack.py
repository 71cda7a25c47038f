"""Everything transfer-related one agent runs, built from its :class:`AgentConfig`.

    stack = TransferStack.build(config, pool, [fingerprint.digest])   # secret from cluster_secret()
    await stack.start()                                               # on the agent's loop
    stack.node_record()                    # host, port, wire version, transports: into nodes/<node_id>
    result = await stack.transports["tcp"].pull(record.peer(), fp, keys, pool, deadline)  # time.monotonic() based
    await stack.close()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import ssl
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from ..config import AgentConfig, cluster_secret
from ..errors import ConfigError, PeerTimeout, ProtocolError, TransferError
from ..ids import WIRE_VERSION, PeerAddress
from ..keys import ChunkKey, FingerprintDigest
from ..tiers.cpu_pool import CpuPool
from . import tls, wire
from .base import Transport
from .client import ConnectionPool, TcpTransport
from .health import PeerHealth
from .nixl import NixlTransport
from .nixl_engine import NixlEngine
from .server import TransferServer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerHooks:
    """What the transfer server asks of its agent (on the loop, no I/O; ``prepare`` on a thread)."""

    prepare: Callable[[ChunkKey], bool] | None = None  # bring a chunk into the CPU pool (disk I/O) before serving it
    on_offer: Callable[[str, list[ChunkKey]], list[bool]] | None = None  # a peer offers chunks: which we take
    on_served: Callable[[ChunkKey], None] | None = None  # a chunk was pinned for a peer
    on_recent: Callable[[list[ChunkKey]], list[float | None]] | None = None  # seconds since each was dropped


class Transfers(Protocol):
    """What an agent runs to serve and pull chunks: :class:`TransferStack` (TCP, NIXL) or, in unit
    tests, :class:`~lmcache_p2p.testing.loopback.LoopbackStack`."""

    transports: dict[str, Transport]
    health: PeerHealth

    async def start(self) -> None: ...

    def node_record(self) -> dict[str, Any]: ...

    def chunks_sent(self) -> int: ...

    async def offer(self, peer: PeerAddress, fp: FingerprintDigest, node_id: str, keys: Sequence[ChunkKey],
                    timeout: float) -> list[bool]: ...

    def forget_except(self, live: Collection[PeerAddress]) -> None: ...

    async def close(self) -> None: ...


TransfersFactory = Callable[[AgentConfig, CpuPool, Collection[FingerprintDigest], bytes | None, ServerHooks],
                            Transfers]
"""Builds an agent's transfers: (config, pool, fingerprints served, secret, hooks) -> Transfers."""


def _tls_contexts(config: AgentConfig) -> tuple[tuple[ssl.SSLContext, bytes] | None, ssl.SSLContext | None, bool]:
    """(server context and channel binding, client context, whether owners' certificates must name a
    node); all None and False without TLS. Refuses a certificate that names another node than this one."""
    tc = config.transfer
    if not tc.tls:
        return None, None, False
    assert tc.tls_cert is not None
    server, client = tls.server_context(tc), tls.client_context(tc)
    named = tls.own_nodes(server, client)
    if named and not tls.names_node(named, config.node_id):
        raise ConfigError("transfer.tls_cert", f"{tc.tls_cert} names the nodes {sorted(named)}, not this "
                          f"node {config.node_id!r}: every peer would refuse it")
    if not named and tc.payload_mac is None:
        log.warning("%s names no node: if other nodes share it, whoever holds it and can write etcd can "
                    "relay this node's connections and inject chunks; issue one per node (lmcache-p2p "
                    "certs DIR NODE=node:NODE) or set transfer.payload_mac: true", tc.tls_cert)
    require = tc.tls_require_node_name if tc.tls_require_node_name is not None else bool(named)
    if require and not named:
        log.warning("transfer.tls_require_node_name is on but %s names no node: peers that require names "
                    "refuse this node as an owner", tc.tls_cert)
    return (server, tls.own_binding(tc.tls_cert)), client, require


@dataclasses.dataclass(slots=True)
class TransferStack:
    config: AgentConfig
    server: TransferServer
    transports: dict[str, Transport]
    nixl: NixlEngine | None
    health: PeerHealth
    control: ConnectionPool  # small requests of our own (offers), apart from the pulls' connections

    @classmethod
    def build(
        cls,
        config: AgentConfig,
        pool: CpuPool,
        fingerprints: Collection[FingerprintDigest],
        secret: bytes | None = None,
        hooks: ServerHooks | None = None,
    ) -> TransferStack:
        """Create the NIXL engine (if configured), the server (answering through ``hooks``) and one
        client per transport."""
        hooks = hooks if hooks is not None else ServerHooks()
        tc = config.transfer
        secret = secret if secret is not None else cluster_secret(config)
        if not secret:
            raise ConfigError("transfer.secret", "a cluster secret is required (or set LMCACHE_P2P_SECRET)")
        health = PeerHealth(tc.backoff_s, max(tc.backoff_s, 30.0))
        nixl = None
        if "nixl" in tc.transports:
            if not tc.tls and tc.listen_host not in ("127.0.0.1", "::1", "localhost"):
                log.warning("NIXL without transfer.tls_*: the NIXL access material of this node's pool crosses "
                            "the network in the clear after the handshake; on a network you do not trust, "
                            "set transfer.tls_ca_cert, tls_cert and tls_key")
            nixl = NixlEngine(f"{config.node_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}", pool)
        server_tls, client_tls, require_name = _tls_contexts(config)
        mac = wire.mac_on(tc.payload_mac, tc.tls)
        server = TransferServer(
            pool, fingerprints, secret, node_id=config.node_id, host=tc.listen_host, port=tc.port,
            timeout_s=tc.timeout_s, max_frame_bytes=tc.max_frame_bytes, pin_timeout_s=config.tiers.pin_timeout_s,
            nixl=nixl, prepare=hooks.prepare, require_mac=mac, tls=server_tls, on_offer=hooks.on_offer,
            on_served=hooks.on_served, on_recent=hooks.on_recent,
        )
        transports: dict[str, Transport] = {}
        for name in tc.transports:
            if name == "tcp":
                transports[name] = TcpTransport(secret, tc.timeout_s, tc.max_frame_bytes, health,
                                                payload_mac=mac, tls=client_tls, node_id=config.node_id,
                                                require_node_name=require_name)
            elif name == "nixl" and nixl is not None:
                transports[name] = NixlTransport(nixl, secret, tc.timeout_s, tc.max_frame_bytes, health,
                                                 tls=client_tls, payload_mac=mac, require_node_name=require_name)
        control = ConnectionPool(secret, tc.timeout_s, tc.max_frame_bytes, payload_mac=mac, tls=client_tls,
                                 node_id=config.node_id, require_node_name=require_name)
        return cls(config, server, transports, nixl, health, control)

    async def offer(self, peer: PeerAddress, fp: FingerprintDigest, node_id: str, keys: Sequence[ChunkKey],
                    timeout: float) -> list[bool]:
        """Offer ``keys`` to ``peer`` (it pulls those it takes from ``node_id``, us); which it took.
        A peer that fails or does not answer in time is backed off like a failed pull."""
        if not self.health.available(peer):
            return [False] * len(keys)
        try:
            conn = await self.control.get(peer, fp, timeout)
            request = conn.start_offer(node_id, keys)
            try:
                answer = await asyncio.wait_for(request.future, timeout)
            except TimeoutError as exc:
                conn.abandon(request)
                raise PeerTimeout(f"{peer}: no answer to an offer within {timeout:.1f}s") from exc
            accept = wire.field(answer, "accept", list)
            if len(accept) != len(keys) or not all(isinstance(a, bool) for a in accept):
                raise ProtocolError(f"{peer}: offer answer does not match the {len(keys)} keys offered")
        except TransferError as exc:
            self.health.record_failure(peer, exc)
            return [False] * len(keys)
        self.health.record_success(peer)
        return accept

    def forget_except(self, live: Collection[PeerAddress]) -> None:
        """Per-peer state (connections, NIXL registrations, backoff) only for the peers in ``live``."""
        for transport in self.transports.values():
            transport.forget_except(live)
        self.control.forget_except(live)
        self.health.forget_except(live)

    async def start(self) -> None:
        await self.server.start()

    def chunks_sent(self) -> int:
        return self.server.stats.chunks_sent

    def node_record(self) -> dict[str, Any]:
        """The transfer part of this node's etcd record (msgpack-able)."""
        tc = self.config.transfer
        host = tc.advertise_host or tc.listen_host
        # Never the NIXL agent metadata: it grants one-sided access to the pool. Peers get it only
        # over the authenticated TCP connection, after the HMAC handshake.
        return {"host": host, "port": self.server.port, "wire_version": WIRE_VERSION,
                "transports": list(self.transports)}

    async def close(self) -> None:
        await self.control.close()
        for transport in self.transports.values():
            await transport.close()
        await self.server.close()
        if self.nixl is not None:
            await self.nixl.close()

