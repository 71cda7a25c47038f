"""NIXL transport: the owner pins and describes, the requester READs one-sidedly.

    requester                                  owner
    pin {id, keys}            ─── TCP ──▶      pin each key (deadline), answer
                              ◀── TCP ───      pinned {lease, items: [header, slot address, mac?] | None}
    reserve local slots, one prepared READ of every present chunk (NIXL/UCX, no owner CPU)
    verify each checksum (and MAC), commit or release (a READ left in flight by a deadline or a
    cancellation keeps its slots until NIXL says it is over: no late writes)
    release {lease}           ─── TCP ──▶      unpin (pins expire anyway)

Handshake and control frames share the authenticated TCP connection of the TCP transport
(``hello`` asks for the owner's NIXL agent metadata, loaded once per peer). With
``transfer.payload_mac`` the owner computes each pinned chunk's session MAC (GMAC of the header and
the slot's bytes, the pin request id and index its nonce, as the TCP transport does) and sends it in the
pinned answer; the requester checks it over the bytes its READ brought in, so nothing on the
fabric's path can change a chunk unnoticed. It costs the owner one GMAC pass per chunk served.

The READ runs on the engine's agent thread (``nixl_engine.py``), so the loop overlaps it: each landed
group (~16 MiB) is checked on a verifier thread and its chunks committed while the next one is read, and
the next pin batch is staged while this one is read; the last group, which nothing overlaps, is split
across both verifier threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import ssl
import time
from collections.abc import Collection, Sequence

from .. import cputime
from ..aio import remaining
from ..chunk import ChunkHeader
from ..errors import ChunkError, PeerTimeout, ProtocolError, TierError, TransferError
from ..ids import PeerAddress
from ..keys import ChunkKey, FingerprintDigest
from ..tiers.cpu_pool import CpuPool, Reservation
from . import wire
from .base import MissReason, PullResult, Want
from .checks import PayloadMac, verdicts
from .client import ConnectionPool, batch_size, silent_for
from .connection import Connection, answers
from .guard import GuardedTransport
from .health import PeerHealth
from .nixl_engine import NixlEngine

log = logging.getLogger(__name__)

# Keys per pin request. The first batch is small so the first READ starts early; the rest are
# large, since every batch costs a descriptor preparation and a pause between READs.
FIRST_PIN_BATCH = 32
PIN_BATCH = 512


class NixlTransport(GuardedTransport):
    name = "nixl"

    def __init__(self, engine: NixlEngine, secret: bytes, timeout_s: float = 5.0,
                 max_frame_bytes: int = 1 << 20, health: PeerHealth | None = None,
                 tls: ssl.SSLContext | None = None, payload_mac: bool = False,
                 require_node_name: bool = False) -> None:
        self.engine = engine
        self._pool = ConnectionPool(secret, timeout_s, max_frame_bytes, want_nixl=True, tls=tls,
                                    payload_mac=payload_mac, require_node_name=require_node_name)
        self.health = health if health is not None else PeerHealth(2.0)
        self._verifier = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="nixl-verify",
                                                               initializer=cputime.initializer("verify"))
        self._remote_of: dict[PeerAddress, str] = {}  # the NIXL agent name registered for each peer

    def _accepts(self, dst: CpuPool) -> None:
        if dst is not self.engine.pool:
            raise ValueError("NIXL pulls land only in the pool registered with the engine")

    async def _pull(self, peer: PeerAddress, fp: FingerprintDigest, keys: Sequence[Want], dst: CpuPool,
                    result: PullResult, deadline: float, silence_s: float | None) -> None:
        t0 = time.perf_counter()
        conn = await self._pool.get(peer, fp, remaining(deadline))
        if conn.nixl is None:
            raise TransferError(f"{peer} does not serve NIXL")
        remote = await self.engine.add_remote(wire.field(conn.nixl, "md", bytes))
        self._remote_of[peer] = remote
        result.setup_s = time.perf_counter() - t0
        # Every pin request goes out at once: the owner answers batch k+1 while batch k is read, and each
        # batch is staged while the one before it is read (the READs queue on the agent thread).
        batches = _pin_batches(keys, batch_size(self._pool.max_frame_bytes))
        requests = [conn.start_pin(batch) for batch in batches]
        reading: list[asyncio.Task[asyncio.Task[None]]] = []
        try:
            silent_s = await silent_for(conn, requests, deadline, silence_s)
            if silent_s:  # an owner that acknowledges pins sent nothing: not serving (stopped, unreachable)
                raise PeerTimeout(f"{conn.peer}: no ack nor byte in {1e3 * silent_s:.1f} ms")
            for request, batch in zip(requests, batches, strict=True):
                try:
                    answer = await asyncio.wait_for(request.future, remaining(deadline))
                except TimeoutError as exc:
                    raise PeerTimeout(f"{conn.peer}: no pin answer before the deadline") from exc
                reading.append(asyncio.create_task(
                    self._read_batch(conn, remote, fp, batch, answer, dst, result, deadline)))
                await asyncio.sleep(0)  # let it stage its batch and queue its READ before the next answer
            for task in reading:
                await task  # the first failure ends the pull (the other batches' READs are abandoned below)
        finally:
            for request in requests:
                if not request.future.done():
                    conn.abandon(request)  # its pins, if granted, expire on the owner
            for task in reading:
                task.cancel()  # a no-op for those done
            finishing = [t.result() for t in await _settled(reading)]
            await asyncio.gather(*finishing)

    async def _read_batch(self, conn: Connection, remote: str, fp: FingerprintDigest, keys: Sequence[Want],
                          answer: wire.Message, dst: CpuPool, result: PullResult,
                          deadline: float) -> asyncio.Task[None]:
        """READ one pinned batch, each group checked (off the loop) and committed as it lands; returns the task
        that waits for the last checks."""
        loop = asyncio.get_running_loop()
        lease, rid = wire.field(answer, "lease", int), wire.field(answer, "id", int)
        staged: list[_Staged] = []
        checks: list[asyncio.Future[list[MissReason | None]]] = []
        held: dict[int, asyncio.Future[str]] = {}  # staged index -> the abandoned READ that may still write it

        def quarantine(group: range, landed: asyncio.Future[str]) -> None:
            held.update(dict.fromkeys(group, landed))

        def deliver(part: range, judged: asyncio.Future[list[MissReason | None]]) -> None:
            if judged.cancelled() or judged.exception() is not None:
                return  # their slots go back unused (below, or in _finish)
            for i, why in zip(part, judged.result(), strict=True):
                if not staged[i].settled:
                    staged[i].settled = True
                    self._deliver(staged[i], why, dst, result)

        def check(group: range) -> None:
            # The last group overlaps nothing: both verifier threads share it.
            half = len(group) // 2
            parts = [group] if group.stop < len(staged) or half == 0 else [group[:half], group[half:]]
            for part in parts:
                items = [(staged[i].header, staged[i].reservation.view, staged[i].mac) for i in part]
                checks.append(loop.run_in_executor(self._verifier, verdicts, items))
                checks[-1].add_done_callback(functools.partial(deliver, part))

        try:
            for i, (want, item) in enumerate(zip(keys, self._items(answer, len(keys)), strict=True)):
                if item is None:
                    result.missed[want.key] = MissReason.ABSENT
                    continue
                header, address, mac = self._check(item, want, fp, conn.mac_key is not None)
                if header.length > dst.slot_bytes:
                    result.missed[want.key] = MissReason.CAPACITY
                    continue
                try:
                    staged.append(_Staged(header, dst.reserve(), address, want.store_as,
                                          None if conn.mac_key is None else
                                          PayloadMac(conn.mac_key, rid, i, header.pack(), mac)))
                except TierError:
                    result.missed[want.key] = MissReason.CAPACITY
            await self.engine.read(
                remote,
                [dst.slot_address(s.reservation.slot) for s in staged],
                [s.address for s in staged],
                [s.header.length for s in staged],
                deadline,
                quarantine=quarantine,
                on_group=check,
            )
        except BaseException:  # a deadline, a failure, our cancellation: only the groups that landed are committed
            try:
                await asyncio.gather(*checks, return_exceptions=True)
            finally:
                for i, s in enumerate(staged):
                    if s.settled:
                        continue
                    s.settled = True
                    landed = held.get(i)
                    if landed is None:
                        dst.release(s.reservation)
                    else:  # no late writes: held until NIXL says the READ is over
                        landed.add_done_callback(functools.partial(_release_after, dst, s.reservation))
            raise
        finally:
            with contextlib.suppress(TransferError):
                conn.send({"t": "release", "lease": lease})
        return loop.create_task(self._finish(staged, checks, dst))

    @staticmethod
    async def _finish(staged: list[_Staged], checks: list[asyncio.Future[list[MissReason | None]]],
                      dst: CpuPool) -> None:
        """Wait for the batch's last checks (each commits its part as it ends); a slot whose check failed or
        was cancelled goes back unused (the READ is over)."""
        try:
            await asyncio.gather(*checks)
        finally:
            for s in staged:
                if not s.settled:
                    s.settled = True
                    dst.release(s.reservation)

    @staticmethod
    def _items(answer: wire.Message, n: int) -> list[object]:
        items = wire.field(answer, "items", list)
        if len(items) != n:
            raise ProtocolError(f"pinned answer has {len(items)} items for {n} keys")
        return items

    @staticmethod
    def _check(item: object, want: Want, fp: FingerprintDigest, want_mac: bool) -> tuple[ChunkHeader, int, object]:
        if not (isinstance(item, list) and len(item) in (2, 3) and isinstance(item[0], bytes)
                and isinstance(item[1], int) and not isinstance(item[1], bool)):
            raise ProtocolError("pinned item must be [header, address] or [header, address, mac]")
        try:
            header = ChunkHeader.unpack(item[0])
        except ChunkError as exc:
            raise ProtocolError(f"bad chunk header: {exc}") from exc
        if not answers(want, header, fp):
            raise ProtocolError("pinned header does not match the requested key, fingerprint or heads")
        return header, item[1], item[2] if len(item) == 3 and want_mac else None

    @staticmethod
    def _deliver(staged: _Staged, why: MissReason | None, dst: CpuPool, result: PullResult) -> None:
        header, reservation = staged.header, staged.reservation
        if why is not None:
            dst.release(reservation)
            result.missed[header.key] = why
            log.warning("%s: chunk %s failed its %s; not committed", result.peer, header.key.hex(),
                        "session MAC" if why is MissReason.MAC else "checksum")
            return
        as_key = staged.store_as
        if not dst.commit(reservation, header if as_key is None else dataclasses.replace(header, key=as_key)):
            result.missed[header.key] = MissReason.INVALIDATED
            return
        result.loaded[header.key] = header

    def forget_except(self, live: Collection[PeerAddress]) -> None:
        self._pool.forget_except(live)
        if self.engine.reads_abandoned:
            return  # an abandoned READ may still use a remote registration: forget them next time
        for peer in [p for p in self._remote_of if p not in live]:
            self.engine.forget_remote(self._remote_of.pop(peer))

    async def close(self) -> None:
        await self._pool.close()
        self._verifier.shutdown(wait=True)


async def _settled(tasks: list[asyncio.Task[asyncio.Task[None]]]) -> list[asyncio.Task[asyncio.Task[None]]]:
    """Wait for every task to end; those that ended with a result."""
    await asyncio.gather(*tasks, return_exceptions=True)
    return [t for t in tasks if not t.cancelled() and t.exception() is None]


def _pin_batches(keys: Sequence[Want], limit: int) -> list[Sequence[Want]]:
    """``keys`` split for pinning: ``FIRST_PIN_BATCH`` first, then ``PIN_BATCH`` (each <= ``limit``)."""
    first = min(FIRST_PIN_BATCH, limit)
    step = min(PIN_BATCH, limit)
    return [keys[:first], *(keys[i : i + step] for i in range(first, len(keys), step))]


@dataclasses.dataclass(slots=True)
class _Staged:
    """A chunk of a pinned batch: where it comes from, the slot it lands in, and whether that slot is settled
    (committed or released: a slot is settled once)."""

    header: ChunkHeader
    reservation: Reservation
    address: int  # in the owner's registered pool
    store_as: ChunkKey | None
    mac: PayloadMac | None
    settled: bool = False


def _release_after(dst: CpuPool, reservation: Reservation, _landed: asyncio.Future[str]) -> None:
    dst.release(reservation)
