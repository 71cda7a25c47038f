"""An in-process :class:`~lmcache_p2p.transfer.base.Transport` for fast unit tests.

Owners are CPU pools registered under a :class:`PeerAddress` on a shared :class:`LoopbackNet`; a
pull copies the owner's verified bytes (the requested head range) into the destination pool and
verifies them again on arrival, as the TCP and NIXL transports do. Faults are set per owner:
``dead`` (connection refused), ``hang`` (answers nothing until the deadline), ``corrupt`` (one
byte flipped on the way), ``delay_s`` (answers late), ``connect_s`` (the first pull of each transport
from it takes that long more: a connection and handshake, reported as the pull's ``setup_s``). Peer
health (backoff) is shared with the real transports' :func:`~lmcache_p2p.transfer.guard.guarded_pull`.

Never instead of the integration tests: those pull over real sockets and NIXL agents in other
processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Collection, Sequence
from typing import Any

from ..aio import remaining
from ..chunk import ChunkHeader, slice_heads, verify
from ..config import AgentConfig
from ..errors import ChunkError, PeerTimeout, TierError, TransferError
from ..ids import WIRE_VERSION, NodeId, PeerAddress
from ..keys import ChunkKey, FingerprintDigest
from ..tiers.cpu_pool import CpuPool
from ..transfer.base import MissReason, PullResult, Transport, Want, wants_of
from ..transfer.guard import guarded_pull
from ..transfer.health import PeerHealth
from ..transfer.stack import ServerHooks, TransfersFactory


@dataclasses.dataclass(slots=True)
class Owner:
    pool: CpuPool
    fault: str | None = None  # None | "dead" | "hang" | "corrupt"
    delay_s: float = 0.0
    late_s: float = 0.0  # > 0: nothing by the pull's deadline (missed ``LATE``), everything this much after it
    connect_s: float = 0.0  # the first pull of each transport from it pays this (a connection and handshake)
    served: int = 0  # chunks sent
    hooks: ServerHooks = ServerHooks()  # what an agent's transfer server would ask of it


class LoopbackNet:
    """Owners by address, shared by every :class:`LoopbackTransport` of one test."""

    def __init__(self) -> None:
        self.owners: dict[tuple[str, int], Owner] = {}
        self._ports = itertools.count(20000)

    def add(self, peer: PeerAddress, pool: CpuPool, hooks: ServerHooks | None = None) -> Owner:
        owner = self.owners[(peer.host, peer.port)] = Owner(pool, hooks=hooks or ServerHooks())
        return owner

    def port(self) -> int:
        """A port no owner of this net has."""
        return next(self._ports)

    def owner(self, peer: PeerAddress) -> Owner:
        return self.owners[(peer.host, peer.port)]


class LoopbackTransport:
    def __init__(self, net: LoopbackNet, health: PeerHealth, name: str = "loopback") -> None:
        self.net = net
        self.health = health
        self.name = name
        self.pulls: list[tuple[PeerAddress, int]] = []  # (peer, chunks asked) per pull, in order
        self.silences: list[float | None] = []  # the silence each pull allowed its owner (``silence_s``)
        self._connected: set[tuple[str, int]] = set()

    async def pull(self, peer: PeerAddress, fingerprint: FingerprintDigest, keys: Sequence[ChunkKey | Want],
                   dst: CpuPool, deadline: float, silence_s: float | None = None) -> PullResult:
        wants = wants_of(keys)
        self.silences.append(silence_s)
        self.pulls.append((peer, len(wants)))
        owner = self.net.owners.get((peer.host, peer.port))
        if owner is not None and owner.late_s > 0 and owner.fault is None:
            return self._late(peer, fingerprint, wants, dst, deadline, owner.late_s)
        return await guarded_pull(self.health, peer, wants,
                                  lambda result: self._pull(peer, fingerprint, wants, dst, result, deadline))

    def _late(self, peer: PeerAddress, fp: FingerprintDigest, wants: Sequence[Want], dst: CpuPool,
              deadline: float, late_s: float) -> PullResult:
        """An owner that answers ``late_s`` past the deadline: what a TCP pull still arriving at its load's
        deadline returns (``guard.guarded_pull``), its rest landing in the background."""
        early = PullResult(peer)
        early.miss_rest(wants, MissReason.LATE)

        async def rest() -> PullResult:
            await asyncio.sleep(remaining(deadline) + late_s)
            result = PullResult(peer)
            await self._pull(peer, fp, wants, dst, result, time.monotonic() + 60.0)
            return result

        early.late = asyncio.ensure_future(rest())
        early.progress_at = time.monotonic
        return early

    async def _pull(self, peer: PeerAddress, fp: FingerprintDigest, wants: Sequence[Want], dst: CpuPool,
                    result: PullResult, deadline: float) -> None:
        owner = self.net.owners.get((peer.host, peer.port))
        if owner is None or owner.fault == "dead":
            raise TransferError(f"{peer}: connection refused")
        if owner.connect_s and (peer.host, peer.port) not in self._connected:
            t0 = time.perf_counter()
            await asyncio.sleep(owner.connect_s)
            self._connected.add((peer.host, peer.port))
            result.setup_s = time.perf_counter() - t0
        if owner.fault == "hang" or owner.delay_s >= remaining(deadline):
            await asyncio.sleep(remaining(deadline))
            raise PeerTimeout(f"{peer}: pull of {len(wants)} chunks ran past its deadline")
        if owner.delay_s:
            await asyncio.sleep(owner.delay_s)
        for want in wants:
            if owner.hooks.prepare is not None:
                owner.hooks.prepare(want.key)  # from its disk tier, as its transfer server would
            pin = owner.pool.pin(want.key, 5.0)
            if pin is None or pin.header.fingerprint != fp:
                if pin is not None:
                    owner.pool.unpin(pin)
                result.missed[want.key] = MissReason.ABSENT
                continue
            try:
                header, payload = slice_heads(pin.header, verify(pin.header, owner.pool.slot_view(pin.slot,
                                              pin.header.length)), want.heads or pin.header.heads)
                self._land(want, header, payload, dst, result, corrupt=owner.fault == "corrupt")
                owner.served += 1
                if owner.hooks.on_served is not None:
                    owner.hooks.on_served(want.key)
            except ChunkError:  # the owner's own copy is bad, or the heads asked are not all there
                result.missed[want.key] = MissReason.ABSENT
            finally:
                owner.pool.unpin(pin)

    @staticmethod
    def _land(want: Want, header: ChunkHeader, payload: memoryview, dst: CpuPool, result: PullResult,
              corrupt: bool) -> None:
        """Copy into a slot of ``dst``, verify on arrival, commit (under ``store_as`` for a piece)."""
        try:
            reservation = dst.reserve()
        except TierError:
            result.missed[want.key] = MissReason.CAPACITY
            return
        view = reservation.view[: header.length]
        view[:] = payload
        if corrupt:
            view[len(view) // 2] ^= 0xFF
        try:
            verify(header, view)
        except ChunkError:
            dst.release(reservation)
            result.missed[want.key] = MissReason.CHECKSUM
            return
        stored = header if want.store_as is None else dataclasses.replace(header, key=want.store_as)
        if not dst.commit(reservation, stored):
            result.missed[want.key] = MissReason.INVALIDATED
            return
        result.loaded[want.key] = header

    def forget_except(self, live: Collection[PeerAddress]) -> None:
        self.health.forget_except(live)

    async def close(self) -> None:
        pass


class LoopbackStack:
    """An agent's transfers over a :class:`LoopbackNet`, in place of TCP and NIXL: its pool is served
    there under an address of its own, and it pulls with a :class:`LoopbackTransport`::

        net = LoopbackNet()
        agent = CacheAgent(config, fp, chunk_bytes, index_factory=..., transfers=LoopbackStack.factory(net))
    """

    def __init__(self, net: LoopbackNet, config: AgentConfig, pool: CpuPool, hooks: ServerHooks) -> None:
        self.net = net
        self.pool = pool
        self.hooks = hooks
        self.health = PeerHealth(config.transfer.backoff_s, max(config.transfer.backoff_s, 30.0))
        self.transports: dict[str, Transport] = {"loopback": LoopbackTransport(net, self.health)}
        self.address = PeerAddress(config.transfer.advertise_host or "127.0.0.1", net.port(), NodeId(config.node_id))
        self.owner: Owner | None = None

    @classmethod
    def factory(cls, net: LoopbackNet) -> TransfersFactory:
        def build(config: AgentConfig, pool: CpuPool, fingerprints: Collection[FingerprintDigest],
                  secret: bytes | None, hooks: ServerHooks) -> LoopbackStack:
            return cls(net, config, pool, hooks)
        return build

    async def start(self) -> None:
        self.owner = self.net.add(self.address, self.pool, self.hooks)

    def node_record(self) -> dict[str, Any]:
        return {"host": self.address.host, "port": self.address.port, "wire_version": WIRE_VERSION,
                "transports": list(self.transports)}

    def chunks_sent(self) -> int:
        return self.owner.served if self.owner is not None else 0

    async def offer(self, peer: PeerAddress, fp: FingerprintDigest, node_id: str, keys: Sequence[ChunkKey],
                    timeout: float) -> list[bool]:
        """What the peer's ``on_offer`` takes (it pulls those from us, as over TCP)."""
        owner = self.net.owners.get((peer.host, peer.port))
        if owner is None or owner.fault is not None or owner.hooks.on_offer is None:
            return [False] * len(keys)
        return owner.hooks.on_offer(node_id, list(keys))

    def forget_except(self, live: Collection[PeerAddress]) -> None:
        self.health.forget_except(live)

    async def close(self) -> None:
        self.net.owners.pop((self.address.host, self.address.port), None)
