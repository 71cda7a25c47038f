"""Sealed frames: the record layer of a TLS connection once its handshake is done.

Python's ``ssl`` holds a TLS pull to 1.2-2.1 GB/s a core (0.29-0.38x plain TCP): TLS cuts every 2 MiB chunk
into 128 records of 16 KiB, each sealed, framed and copied through the BIOs on its own, and Python reads one
record a call (``docs/benchmarks/transfer.md``). The cipher is not the cost: AES-256-GCM over a whole chunk at
once runs at 9-12 GB/s here. So TLS does what it is good at, the handshake (mutual certificates under the
cluster CA, the channel binding, the HMAC proofs inside it), and then steps aside: every later frame travels on
the bare socket, its msgpack body and its payload each sealed once with AES-256-GCM under a key only the two
ends hold::

    | header_len u32 LE | payload_len u32 LE | sealed body (header_len) | sealed payload (payload_len) |

Both lengths count the 16-byte tags; the prefix is the body's associated data, so a changed length fails the
body's tag. The key comes from an ephemeral X25519 exchange inside the TLS handshake (``hello.x`` and
``challenge.x``, covered by both HMAC proofs), mixed with the cluster secret: a recording of the connection
cannot be opened later with the secret, nor with a node's certificate key. The nonce is the direction, the part
(body or payload) and the frame's index in that direction: TCP delivers in order, so a dropped, repeated or
reordered frame fails its tag, and a nonce is never used twice under a key (the key is the connection's own).
A frame whose tag fails closes the connection, as TLS would: whatever is on the path changes bytes.

The owner seals each payload from its pinned slot into a send buffer it reuses once the batch is sent; the
requester reads the sealed payload into a scratch buffer of its connection and opens it into the reserved pool
slot, where it is verified against its header as every chunk is. NIXL READs do not pass here (the fabric has
no TLS): their integrity is ``transfer.payload_mac``'s, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import ProtocolError
from .netio import PlainChannel
from .wire import PREFIX, Message, encode_body

TAG = 16
SHARE_BYTES = 32
_NONCE = struct.Struct("<IQ")
_BODY, _PAYLOAD = 0, 1
TO_REQUESTER, TO_OWNER = 0, 1  # the direction a frame travels: part of its nonce


class Exchange:
    """One side's ephemeral X25519 key for one handshake."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.share = self._private.public_key().public_bytes_raw()

    def key(self, their_share: object, bound: bytes) -> bytes:
        """The connection's sealing key: HMAC-SHA256 keyed by ``bound`` (a proof of the cluster secret over the
        handshake's transcript, which covers both shares) over the X25519 secret."""
        if not isinstance(their_share, bytes) or len(their_share) != SHARE_BYTES:
            raise ProtocolError("key share must be 32 bytes")
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(their_share))
        except ValueError as exc:  # an all-zero result: a share of small order
            raise ProtocolError(f"unusable key share: {exc}") from exc
        return hmac.new(bound, b"lmcache-p2p/seal" + shared, hashlib.sha256).digest()


class Seal:
    """Both directions of one sealed connection: what this side sends (``tx``) and receives (``rx``)."""

    def __init__(self, key: bytes, *, owner: bool) -> None:
        if len(key) != 32:
            raise ValueError("sealing key must be 32 bytes")
        self._aead = AESGCM(key)
        self._tx_dir, self._rx_dir = (TO_REQUESTER, TO_OWNER) if owner else (TO_OWNER, TO_REQUESTER)
        self._tx = self._rx = 0  # frames sent, bodies opened
        self._rx_frame = -1  # the index of the frame whose payload comes next

    def _nonce(self, direction: int, part: int, index: int) -> bytes:
        return _NONCE.pack(direction << 1 | part, index)

    # -- sending --------------------------------------------------------------------------------------
    def seal_frame(self, msg: Message, payload: memoryview | None, out: bytearray | None) -> list[bytes | memoryview]:
        """The frame's buffers, in order: prefix and sealed body, then (with a payload) the payload sealed into
        ``out`` (at least ``len(payload) + TAG`` bytes) with its tag."""
        body = encode_body(msg)
        index, self._tx = self._tx, self._tx + 1
        sealed_len = len(payload) + TAG if payload is not None else 0
        prefix = PREFIX.pack(len(body) + TAG, sealed_len)
        head = prefix + self._aead.encrypt(self._nonce(self._tx_dir, _BODY, index), body, prefix)
        if payload is None:
            return [head]
        assert out is not None and len(out) >= len(payload) + TAG
        sealed = memoryview(out)[: len(payload) + TAG]
        self._aead.encrypt_into(self._nonce(self._tx_dir, _PAYLOAD, index), payload, None, sealed)
        return [head, sealed]

    # -- receiving ------------------------------------------------------------------------------------
    def open_body(self, prefix: bytes | memoryview, sealed: bytes | memoryview) -> bytes:
        index, self._rx = self._rx, self._rx + 1
        self._rx_frame = index
        try:
            return self._aead.decrypt(self._nonce(self._rx_dir, _BODY, index), bytes(sealed), bytes(prefix))
        except InvalidTag as exc:
            raise ProtocolError("a sealed frame failed its tag: changed on the way") from exc

    def open_payload(self, sealed: memoryview, dst: memoryview) -> None:
        """Open the payload of the frame whose body was opened last from ``sealed`` (ciphertext and tag) into
        ``dst`` (exactly the plaintext's length); a failed tag is a :class:`ProtocolError` (``dst`` then holds
        garbage: the caller releases it)."""
        if len(sealed) < TAG or len(dst) != len(sealed) - TAG:
            raise ProtocolError("sealed payload shorter than its tag")
        try:
            self._aead.decrypt_into(self._nonce(self._rx_dir, _PAYLOAD, self._rx_frame), sealed, None, dst)
        except InvalidTag as exc:
            raise ProtocolError("a sealed chunk failed its tag: changed on the way") from exc


class SealedChannel(PlainChannel):
    """The owner's side of a sealed connection: frames out sealed from the pinned slots into send buffers it
    reuses once each batch is sent, frames in opened."""

    def __init__(self, sock: socket.socket, seal: Seal) -> None:
        super().__init__(sock)
        self.seal = seal
        self._free: list[bytearray] = []
        self._busy: list[bytearray] = []

    def frame(self, msg: Message, payload: memoryview | None = None) -> list[bytes | memoryview]:
        out = None
        if payload is not None:
            need = len(payload) + TAG
            out = next((b for b in self._free if len(b) >= need), None)
            if out is None:
                out = bytearray(need)
            else:
                self._free.remove(out)
            self._busy.append(out)
        return self.seal.seal_frame(msg, payload, out)

    def open(self, prefix: bytes | memoryview, body: bytes | memoryview) -> bytes | memoryview:
        return self.seal.open_body(prefix, body)

    async def send_all(self, buffers: Sequence[bytes | memoryview], timeout: float) -> None:
        try:
            await super().send_all(buffers, timeout)
        finally:
            self._free.extend(self._busy)  # sent (or the connection is done): reusable
            self._busy.clear()
