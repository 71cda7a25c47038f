"""The requester's side of one connection: an ``asyncio.BufferedProtocol`` that reads frames.

Receive states (one frame at a time, each buffer handed to the kernel is exactly what is due)::

    PREFIX (8 bytes) -> BODY (header_len) -> [PAYLOAD: straight into a reserved pool slot] -> PREFIX

A chunk's payload lands in ``dst.reserve().view`` with no intermediate copy (on a sealed connection,
``seal.py``: in a scratch buffer, opened from there into the slot), is verified
against its header and only then committed; a mismatch releases the slot and counts as a miss.
Many requests are in flight at once, told apart by id. A request given up on is *abandoned*
(``abandon``: its remaining frames are read into scratch and dropped, the slot it was filling is
released, the connection and the other requests on it go on) or its connection is aborted
(``abort``: a peer that sent no byte for the liveness period); either way no byte lands in a slot
of a request after it was given up. A frame that breaks the protocol closes the connection and
fails every request on it.

Why one file of this size: one protocol's receive states and the table of requests they fill share one rule, that no
byte lands in a slot after its request was given up; split, that rule would span two files.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import socket
import time
from collections.abc import Sequence

from ..chunk import ChunkHeader
from ..errors import ChunkError, ProtocolError, TierError, TransferError
from ..keys import ChunkKey, FingerprintDigest
from ..tiers.cpu_pool import CpuPool, Reservation
from . import wire
from .base import MissReason, PullResult, Want
from .checks import PayloadMac, verdict
from .seal import TAG, Seal

log = logging.getLogger(__name__)

# An owner that acknowledges is taken for not serving (stopped, unreachable) once silent for twice its
# round trip plus four variations after a get, and never sooner than this: two of Python's GIL switch
# intervals for an owner's loop beside its spinning engine (its acks teach the variation when it is
# slower), a small part of any recompute worth a pull.
ACK_FLOOR_S = 0.01
ACK_RTTS = 2.0
# An owner given up on for its silence that then answered was only scheduled late (a starved host): each
# such give-up doubles the silence it is allowed, up to this many times, until an ack in time is measured
# again (TCP's retransmission-timer backoff)
MAX_SILENCE_BACKOFF = 16.0
_DISCARD_BYTES = 1 << 18
_STAGE_BYTES = 1 << 16
_PREFIX, _BODY = range(2)


class _Request:
    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.future: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        self.sent_at = time.monotonic()
        # Resolved by the owner's first frame for this request (its ack, else its answer) or by the
        # request's end: the owner was heard from (``client.py`` tells slow from hung by it)
        self.heard: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def hear(self) -> None:
        if not self.heard.done():
            self.heard.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)
            self.future.exception()  # mark retrieved: an abandoned request has no awaiter
        self.hear()


class _GetRequest(_Request):
    """Streams chunks of one ``get`` into ``dst``; the result fills in as frames arrive."""

    def __init__(self, rid: int, wants: Sequence[Want], fp: FingerprintDigest, dst: CpuPool,
                 result: PullResult) -> None:
        super().__init__(rid)
        self.wants, self.fp, self.dst, self.result = wants, fp, dst, result
        self.current: tuple[ChunkHeader, Reservation, ChunkKey | None] | None = None
        self.mac_key: bytes | None = None  # set: every chunk must carry a valid session MAC
        self._mac: tuple[int, bytes, object] | None = None  # (index, header bytes, claimed MAC) of current

    def on_chunk(self, msg: wire.Message, payload_len: int) -> memoryview | None:
        i = wire.field(msg, "i", int)
        if not 0 <= i < len(self.wants):
            raise ProtocolError(f"chunk index {i} out of range")
        raw_header = wire.field(msg, "h", bytes)
        self._mac = (i, raw_header, msg.get("m"))
        try:
            header = ChunkHeader.unpack(raw_header)
        except ChunkError as exc:
            raise ProtocolError(f"bad chunk header: {exc}") from exc
        if not answers(self.wants[i], header, self.fp) or header.length != payload_len:
            raise ProtocolError("chunk header does not match the request or the payload length")
        if payload_len > self.dst.slot_bytes:
            self.result.missed[header.key] = MissReason.CAPACITY
            return None
        try:
            reservation = self.dst.reserve()
        except TierError:
            self.result.missed[header.key] = MissReason.CAPACITY
            return None
        self.current = (header, reservation, self.wants[i].store_as)
        return reservation.view[:payload_len]

    def on_payload(self) -> None:
        assert self.current is not None and self._mac is not None
        header, reservation, store_as = self.current
        self.current = None
        index, raw_header, claimed = self._mac
        mac = None if self.mac_key is None else PayloadMac(self.mac_key, self.rid, index, raw_header, claimed)
        why = verdict(header, reservation.view[: header.length], mac)
        if why is not None:
            self.dst.release(reservation)
            self.result.missed[header.key] = why
            if why is MissReason.MAC:
                log.error("%s: chunk %s failed its session MAC: changed on the way; dropped", self.result.peer,
                          header.key.hex()[:16])
            else:
                log.warning("%s: chunk %s failed its checksum; dropped", self.result.peer, header.key.hex()[:16])
            return
        if not self.dst.commit(reservation, header if store_as is None else dataclasses.replace(header, key=store_as)):
            self.result.missed[header.key] = MissReason.INVALIDATED
            return
        self.result.loaded[header.key] = header

    def on_miss(self, msg: wire.Message) -> None:
        i = wire.field(msg, "i", int)
        if not 0 <= i < len(self.wants):
            raise ProtocolError(f"miss index {i} out of range")
        self.result.missed[self.wants[i].key] = MissReason.ABSENT

    def drop_current(self) -> None:
        if self.current is not None:
            self.dst.release(self.current[1])
            self.current = None


class Connection(asyncio.BufferedProtocol):
    def __init__(self, peer: str, max_frame_bytes: int) -> None:
        self.peer = peer
        self.nixl: wire.Message | None = None  # the owner's NIXL info from the handshake
        self.mac_key: bytes | None = None  # the session's payload MAC key, when asked for
        self.seal: Seal | None = None  # set: every frame is sealed (after a TLS handshake, seal.py)
        self.acks = False  # the owner acknowledges each get (agreed in the handshake, wire.py)
        # Round trips to the owner's loop (handshake steps, then acks): RFC 6298's smoothed time and
        # variation, what "no ack by now" is measured against (``ack_timeout``)
        self.srtt: float | None = None
        self.rttvar = 0.0
        # When the owner was last given up on for its silence: an ack for a request sent before then
        # measures how long the owner was stopped, not a round trip, and is no sample (Karn's rule: one
        # such ack after a 5 s stop made the ack timeout seconds long, and every later pull from that
        # owner waited out its deadline instead of its silence)
        self.silenced_at = float("-inf")
        self.silence_backoff = 1.0  # doubled at each give-up for silence, back to 1 at the next ack in time
        # Doubled at each give-up on an answer that stopped mid-way, back to 1 when an answer arrives whole:
        # an owner that paused mid-answer had acknowledged in time, so its pauses (a starved host: 40 ms
        # beside the suite's other lane) widen the pause it is allowed, not the wait for its next ack
        self.stall_backoff = 1.0
        self.max_frame_bytes = max_frame_bytes
        self._transport: asyncio.Transport | None = None
        self.last_progress = time.monotonic()  # when bytes last arrived (time.monotonic())
        self._ids = itertools.count(1)
        self._pending: dict[int, _Request] = {}
        # Frames are parsed out of a small staging buffer; a payload (or a body too big for the
        # stage) becomes the *target* and the kernel writes straight into it.
        self._stage = bytearray(_STAGE_BYTES)
        self._stage_mv = memoryview(self._stage)
        self._start = self._end = 0
        self._state = _PREFIX
        self._header_len = self._payload_len = 0
        self._target: memoryview | None = None
        self._tpos = 0
        self._target_is_body = False
        self._skip = 0
        self._scratch = memoryview(bytearray(_DISCARD_BYTES))
        self._receiver: _GetRequest | None = None  # whose payload is the target now
        self._prefix = b""  # the prefix of the frame being read: a sealed body's associated data
        self._sealed = memoryview(bytearray(0))  # a sealed payload lands here, then opens into ...
        self._open_into: memoryview | None = None  # ... its pool slot
        self.closed = False

    # -- asyncio callbacks ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._tpos :]
        if self._skip:
            return self._scratch[: min(self._skip, len(self._scratch))]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._stage) - self._end < _STAGE_BYTES // 4:
            n = self._end - self._start
            self._stage[:n] = self._stage[self._start : self._end]
            self._start, self._end = 0, n
        return self._stage_mv[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.last_progress = time.monotonic()  # bytes arrived: the peer is alive (a slow answer is still coming)
        try:
            if self._target is not None:
                self._tpos += nbytes
                if self._tpos < len(self._target):
                    return
                self._finish_target()
            elif self._skip:
                self._skip -= nbytes
                if self._skip:
                    return
            else:
                self._end += nbytes
            self._parse()
        except (ProtocolError, TransferError) as exc:
            log.warning("closing connection to %s: %s", self.peer, exc)
            self.abort(exc)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(TransferError(f"connection to {self.peer} lost: {exc or 'closed by peer'}"))

    # -- frame state machine -----------------------------------------------------------------------
    def _parse(self) -> None:
        """Consume staged bytes: frames, and the first part of a payload, until more are needed."""
        while True:
            avail = self._end - self._start
            if self._target is not None:
                take = min(avail, len(self._target) - self._tpos)
                self._target[self._tpos : self._tpos + take] = self._stage_mv[self._start : self._start + take]
                self._start += take
                self._tpos += take
                if self._tpos < len(self._target):
                    return
                self._finish_target()
            elif self._skip:
                take = min(avail, self._skip)
                self._start += take
                self._skip -= take
                if self._skip:
                    return
            elif self._state == _PREFIX:
                if avail < wire.PREFIX_SIZE:
                    return
                self._prefix = bytes(self._stage_mv[self._start : self._start + wire.PREFIX_SIZE])
                self._header_len, self._payload_len = wire.decode_prefix(self._prefix, self.max_frame_bytes)
                self._start += wire.PREFIX_SIZE
                self._state = _BODY
                if self._header_len > len(self._stage) // 2:
                    self._set_target(memoryview(bytearray(self._header_len)), is_body=True)
            else:
                if avail < self._header_len:
                    return
                body = self._stage_mv[self._start : self._start + self._header_len]
                self._start += self._header_len
                self._state = _PREFIX
                self._on_message(self._decode(body), self._payload_len)

    def _set_target(self, target: memoryview, is_body: bool = False) -> None:
        self._target, self._tpos, self._target_is_body = target, 0, is_body

    def _finish_target(self) -> None:
        target, self._target = self._target, None
        assert target is not None
        if self._target_is_body:
            self._state = _PREFIX
            self._on_message(self._decode(target), self._payload_len)
            return
        receiver = self._receiver
        if self._open_into is not None:
            dst, self._open_into = self._open_into, None
            assert self.seal is not None
            self.seal.open_payload(target, dst)  # a failed tag closes the connection; abort drops the slot
        self._receiver = None
        if receiver is not None:
            receiver.on_payload()

    def _decode(self, body: memoryview) -> wire.Message:
        return wire.decode(body if self.seal is None else self.seal.open_body(self._prefix, body))

    def _on_message(self, msg: wire.Message, payload_len: int) -> None:
        kind = msg["t"]
        if payload_len and kind != "chunk":
            raise ProtocolError(f"{kind!r} frame with a payload")
        if kind not in ("chunk", "miss", "end", "pinned", "offered", "recent", "ack"):
            raise ProtocolError(f"unexpected {kind!r} frame after the handshake")
        request = self._pending.get(wire.field(msg, "id", int))
        target: memoryview | None = None
        plain_len = payload_len
        if self.seal is not None and payload_len:
            if payload_len < TAG:
                raise ProtocolError("sealed payload shorter than its tag")
            plain_len = payload_len - TAG
        if request is not None and not request.heard.done():
            if kind == "ack" and request.sent_at > self.silenced_at:
                self.observe_rtt(time.monotonic() - request.sent_at)
                self.silence_backoff = 1.0
            request.hear()
        if kind == "ack":
            pass
        elif kind == "chunk":
            if isinstance(request, _GetRequest):
                target = request.on_chunk(msg, plain_len)
        elif kind == "miss" and isinstance(request, _GetRequest):
            request.on_miss(msg)
        elif request is not None:
            del self._pending[request.rid]
            if not request.future.done():
                request.future.set_result(msg)
        if target is not None:
            self._receiver = request if isinstance(request, _GetRequest) else None
            if self.seal is not None:
                self._open_into = target
                if len(self._sealed) < payload_len:
                    self._sealed = memoryview(bytearray(payload_len))
                target = self._sealed[:payload_len]
            self._set_target(target)
        else:
            self._skip = payload_len

    # -- round trips ------------------------------------------------------------------------------
    def observe_rtt(self, sample: float) -> None:
        """One round trip to the owner's loop (RFC 6298's update, gains 1/8 and 1/4)."""
        if self.srtt is None:
            self.srtt, self.rttvar = sample, sample / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - sample)
            self.srtt = 0.875 * self.srtt + 0.125 * sample

    def silence_timeout(self) -> float | None:
        """How long the owner may stay silent after a request it answers at once (a handshake step, an
        acknowledged get) before it is taken for not serving at all: twice its round trip plus four
        variations, at least ``ACK_FLOOR_S``, times the backoff of give-ups since the last ack in time (None:
        no round trip measured yet)."""
        if self.srtt is None:
            return None
        return max(ACK_FLOOR_S, ACK_RTTS * self.srtt + 4 * self.rttvar) * self.silence_backoff

    def rtt_text(self) -> str:
        """The estimate the silence allowed rests on, for the log: round trip, its variation, the backoff."""
        if self.srtt is None:
            return "no round trip measured"
        return (f"round trip {1e3 * self.srtt:.2f} ms, variation {1e3 * self.rttvar:.2f} ms, "
                f"backoff {self.silence_backoff:g}x, pause backoff {self.stall_backoff:g}x")

    def silenced(self) -> float:
        """The owner is given up on for its silence now: acks of requests sent before are no round-trip
        samples, and the silence it is allowed doubles until an ack in time is measured again."""
        self.silenced_at = time.monotonic()
        self.silence_backoff = min(MAX_SILENCE_BACKOFF, 2 * self.silence_backoff)
        return self.silenced_at

    def stalled(self) -> None:
        """An answer under way is given up on for a pause: the next answer may pause twice as long."""
        self.stall_backoff = min(MAX_SILENCE_BACKOFF, 2 * self.stall_backoff)

    def ack_timeout(self) -> float | None:
        """:meth:`silence_timeout` after a get or pin, for an owner that acknowledges them (None: it does
        not, or no round trip was measured yet)."""
        return self.silence_timeout() if self.acks else None

    # -- requests ---------------------------------------------------------------------------------
    def send(self, msg: wire.Message) -> None:
        if self.closed or self._transport is None:
            raise TransferError(f"connection to {self.peer} is closed")
        if self.seal is None:
            self._transport.write(wire.encode(msg))
        else:
            self._transport.writelines(self.seal.seal_frame(msg, None, None))

    def start_get(self, wants: Sequence[Want], fp: FingerprintDigest, dst: CpuPool,
                  result: PullResult) -> _GetRequest:
        request = _GetRequest(next(self._ids), wants, fp, dst, result)
        request.mac_key = self.mac_key if self.seal is None else None  # a seal authenticates each chunk
        self._pending[request.rid] = request
        self.send(_request("get", request.rid, wants))
        return request

    def start_pin(self, wants: Sequence[Want]) -> _Request:
        return self._ask(_request("pin", 0, wants))

    def start_offer(self, node: str, keys: Sequence[ChunkKey]) -> _Request:
        return self._ask({"t": "offer", "node": node, "keys": list(keys)})

    def start_recent(self, keys: Sequence[ChunkKey]) -> _Request:
        return self._ask({"t": "recent", "keys": list(keys)})

    def _ask(self, msg: wire.Message) -> _Request:
        """Send a request whose one answer frame carries its id; the answer resolves ``.future``."""
        request = _Request(next(self._ids))
        self._pending[request.rid] = request
        self.send({**msg, "id": request.rid})
        return request

    def transport_socket(self) -> socket.socket | None:
        return self._transport.get_extra_info("socket") if self._transport is not None else None

    def abandon(self, request: _Request) -> None:
        """Stop caring about ``request``: its remaining frames are read and dropped."""
        self._pending.pop(request.rid, None)
        request.fail(TransferError("abandoned"))
        if request is self._receiver and isinstance(request, _GetRequest) and self._target is not None:
            self._receiver = None
            request.drop_current()
            self._skip = len(self._target) - self._tpos
            self._target = None
            self._open_into = None

    def abort(self, exc: BaseException) -> None:
        self._fail_all(exc)
        if self._transport is not None:
            self._transport.abort()

    def _fail_all(self, exc: BaseException) -> None:
        self.closed = True
        if self._receiver is not None:
            self._receiver.drop_current()
            self._receiver = None
        self._open_into = None
        for request in self._pending.values():
            request.fail(exc)
        self._pending.clear()


def _request(kind: str, rid: int, wants: Sequence[Want]) -> wire.Message:
    msg: wire.Message = {"t": kind, "id": rid, "keys": [w.key for w in wants]}
    if any(w.heads is not None for w in wants):
        msg["heads"] = [None if w.heads is None else list(w.heads) for w in wants]
    return msg


def answers(want: Want, header: ChunkHeader, fp: FingerprintDigest) -> bool:
    """``header`` is what was asked: the key, the fingerprint and (when asked for) the head range."""
    return header.key == want.key and header.fingerprint == fp and want.heads in (None, header.heads)
