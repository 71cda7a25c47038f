"""The transfer wire protocol: frames, messages and the authenticated handshake.

Every frame is an 8-byte prefix, a msgpack map, then raw payload bytes::

    | header_len u32 LE | payload_len u32 LE | msgpack map (header_len) | payload (payload_len) |

Only the owner sends payloads (one chunk per ``chunk`` frame). ``header_len`` is bounded by
``max_frame_bytes``; a payload must be exactly the chunk length its header announces. A frame
that breaks any rule is a :class:`ProtocolError` and closes that connection only.

Handshake (client C, server S, secret K, ``v`` = ``ids.WIRE_VERSION``, ``fp`` = fingerprint digest)::

    C -> S  hello     {v, fp, nc, node?, nixl, mac, ack?, x?} S checks v (error frame + close)
    S -> C  challenge {ns, node, x?, proof = HMAC(K, "S" v fp nc ns cb owner requester xs)}
    C -> S  auth      {proof = HMAC(K, "C" v fp nc ns cb owner requester xs)}   S checks before serving
                                                        anything, then fp
    S -> C  ready     {nixl: {name, md} | None, ack?}

``owner`` is the node id S answers as (``challenge.node``), ``requester`` the one C claims
(``hello.node``; absent, empty: a tool such as ``lookup --explain``), ``cb`` the channel binding.
C goes on only if ``owner`` is the node whose record it planned the pull from
(:class:`~.errors.PeerIdentityError` otherwise): proving the secret is not enough, the answer must
come from that node. A relay that forwards the handshake to some real node therefore fails it
unless it is pointed at by that very node's record; only the payload MAC (or TLS) stops that one.

With TLS (``transfer.tls_*``) the handshake runs inside mutual TLS; ``cb`` is SHA-256 of the owner's
certificate (channel binding, see ``tls.py``; empty without TLS), and a certificate that names
nodes must name the planned one. ``x`` (TLS only, both required) are ephemeral X25519 key shares,
``xs`` both of them (empty without TLS): after ``ready`` TLS steps aside and every frame is sealed
with AES-256-GCM under a key from that exchange and the secret (``seal.py``).

With ``mac`` (``transfer.payload_mac``), both sides derive a session key
``HMAC(K, "M" v fp nc ns cb owner requester xs)`` and every chunk frame carries ``m``, a GMAC of its
header and payload under that key, the request id and index its nonce (ids must grow: a get or pin
whose id does not exceed the last one's is refused, so no nonce repeats under a key): a relay on the
path that passed the handshake still cannot change a chunk (xxh3 in the header is a checksum, not a
MAC). A client that asked for it rejects any chunk without a valid ``m``, so stripping the flag from
``hello`` gains nothing; a server that requires it refuses clients that did not ask. On a sealed
connection a chunk's seal already authenticates it under a key of that session: ``get`` answers carry
no ``m``; ``pin`` answers (NIXL READs bypass the seal) still do.

Requests after ``ready`` (``id`` chosen by the client; many may be in flight)::

    get     {id, keys, heads?} -> ack {id} (when asked: ``hello.ack``, ``ready.ack``), then per key:
                                  chunk {id, i, h, m?} + payload | miss {id, i, why}; then end {id}
    pin     {id, keys, heads?} -> ack {id} (when asked), then pinned {id, lease, items: [[h, addr] | None]}
                                  (NIXL reads these)

``heads`` (optional, one entry per key): ``[first, end)`` KV heads wanted, or nil for all the owner
holds. Payloads are head-major, so the owner answers with that byte range of its chunk and a header
of its own (that range's length and checksum, computed after checking the whole stored chunk).
    release {lease}         -> (no answer) unpins a lease early; pins expire anyway
    offer   {id, node, keys} -> offered {id, accept: [bool]}   the sender (node ``node``) would drop
                               these chunks, or wants a copy elsewhere: the receiver takes those it
                               has room for by pulling them from ``node`` (``handoff.py``)
    recent  {id, keys}      -> recent {id, ago: [seconds | nil]}   which of these chunks this node
                               dropped lately, how long ago (``lookup --explain``)

``ack`` tells slow from hung: the owner sends it as soon as it reads a ``get`` or ``pin``, before any
tier is read, so a requester that hears nothing from an owner (no ack, no byte on the connection) for
its round trip and the pull's expected time after asking knows it is not serving at all (stopped, its
host dropping packets), while one that acknowledged is alive however late its payload (``client.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import struct
from typing import Any

import msgpack
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ..errors import ProtocolError
from ..ids import NODE_ID_RE, WIRE_VERSION

PREFIX = struct.Struct("<II")
PREFIX_SIZE = PREFIX.size
NONCE_BYTES = 32
MAX_KEYS_PER_REQUEST = 4096

Message = dict[str, Any]


def encode_body(msg: Message) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)  # type: ignore[no-any-return]


def encode(msg: Message, payload_len: int = 0) -> bytes:
    body = encode_body(msg)
    return PREFIX.pack(len(body), payload_len) + body


def decode_prefix(data: bytes | bytearray | memoryview, max_frame_bytes: int) -> tuple[int, int]:
    header_len, payload_len = PREFIX.unpack_from(data)
    if header_len == 0 or header_len > max_frame_bytes:
        raise ProtocolError(f"frame header of {header_len} bytes (limit {max_frame_bytes})")
    return header_len, payload_len


def decode(body: bytes | bytearray | memoryview) -> Message:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=1 << 24)
    except Exception as exc:  # msgpack raises a zoo of types for garbage
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("frame is not a map with a string 't'")
    return msg


def field(msg: Message, name: str, kind: type | tuple[type, ...]) -> Any:
    """``msg[name]`` checked against ``kind`` (bool is never an int here)."""
    value = msg.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ProtocolError(f"{msg.get('t')!r} frame: field {name!r} must be {kind}, got {type(value).__name__}")
    return value


def key_list(msg: Message) -> list[bytes]:
    keys = field(msg, "keys", list)
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise ProtocolError(f"{len(keys)} keys in one request (limit {MAX_KEYS_PER_REQUEST})")
    for key in keys:
        if not isinstance(key, bytes) or len(key) != 16:
            raise ProtocolError("keys must be 16-byte binaries")
    return keys


def head_ranges(msg: Message, n: int) -> list[tuple[int, int] | None]:
    """The optional per-key ``heads`` of a get or pin request."""
    heads = msg.get("heads")
    if heads is None:
        return [None] * n
    if not isinstance(heads, list) or len(heads) != n:
        raise ProtocolError("heads must be a list with one entry per key")
    out: list[tuple[int, int] | None] = []
    for h in heads:
        if h is None:
            out.append(None)
        elif (isinstance(h, list) and len(h) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in h)
              and 0 <= h[0] < h[1] <= 0xFFFF):
            out.append((h[0], h[1]))
        else:
            raise ProtocolError("heads entries must be [first, end) with 0 <= first < end < 65536, or nil")
    return out


def node_id(msg: Message, name: str = "node") -> str:
    node = field(msg, name, str)
    if not NODE_ID_RE.fullmatch(node):
        raise ProtocolError(f"{name} must be a node id")
    return node


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


@dataclasses.dataclass(frozen=True, slots=True)
class Transcript:
    """What both HMAC proofs and the session key cover, besides the role and WIRE_VERSION."""

    fingerprint: bytes
    nonce_c: bytes
    nonce_s: bytes
    binding: bytes  # SHA-256 of the owner's certificate with TLS (``tls.py``), empty without
    owner: str  # the node id the owner answers as
    requester: str  # the node id the requester claims ("" for a tool)
    shares: bytes = b""  # both X25519 key shares, the requester's first, with TLS (``seal.py``); empty without

    def encode(self) -> bytes:
        out = bytearray(self.fingerprint + self.nonce_c + self.nonce_s)
        for part in (self.binding, self.owner.encode(), self.requester.encode(), self.shares):
            if len(part) > 255:
                raise ProtocolError("handshake field over 255 bytes")
            out += struct.pack("<B", len(part)) + part
        return bytes(out)


def proof(secret: bytes, role: bytes, t: Transcript) -> bytes:
    """HMAC-SHA256 binding the role, version, fingerprint, both nonces, the channel and both node ids."""
    msg = b"lmcache-p2p/" + role + struct.pack("<I", WIRE_VERSION) + t.encode()
    return hmac.new(secret, msg, hashlib.sha256).digest()


def session_key(secret: bytes, t: Transcript) -> bytes:
    """The per-session payload MAC key: both nonces make it fresh for every connection."""
    return proof(secret, b"M", t)


def seal_bound(secret: bytes, t: Transcript) -> bytes:
    """What keys the sealing key's derivation from the X25519 secret (``seal.Exchange.key``)."""
    return proof(secret, b"E", t)


def mac_on(payload_mac: bool | None, tls: bool) -> bool:
    """``transfer.payload_mac`` resolved: unset (None) means on unless the connection runs TLS."""
    return payload_mac if payload_mac is not None else not tls


def chunk_mac(key: bytes, rid: int, index: int, header: bytes, payload: memoryview | bytes) -> bytes:
    """GMAC (AES-GCM encrypting nothing, NIST SP 800-38D) under the session key over the header and the
    payload, its nonce the request id and the chunk's index; 16 bytes. A nonce is never used twice under a
    key: the key is the session's, and an owner refuses a get or pin whose id does not exceed the last
    one's (``TransferServer``). 13-19 GB/s on one core here (AES-NI, carry-less multiply) for 256 KiB-2 MiB
    chunks, against keyed BLAKE3's 6: one pass at each end of every chunk served."""
    mac = Cipher(algorithms.AES(key), modes.GCM(struct.pack("<QI", rid, index))).encryptor()
    mac.authenticate_additional_data(header)
    mac.authenticate_additional_data(payload)
    mac.finalize()
    return mac.tag


def proof_ok(expected: bytes, got: object) -> bool:
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)
