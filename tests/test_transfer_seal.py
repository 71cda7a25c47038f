"""Sealed frames (``transfer/seal.py``): what follows a TLS handshake. Each frame's body and payload are
sealed once with AES-256-GCM under a key from an ephemeral X25519 exchange; the nonce is the direction, the
part and the frame's index, so a changed, dropped, repeated or reordered frame fails its tag."""

from __future__ import annotations

import os

import pytest

from lmcache_p2p.errors import ProtocolError
from lmcache_p2p.transfer import wire
from lmcache_p2p.transfer.seal import TAG, Exchange, Seal

KEY = bytes(range(32))


def pair(key: bytes = KEY) -> tuple[Seal, Seal]:
    return Seal(key, owner=True), Seal(key, owner=False)


def split(buffers: list[bytes | memoryview]) -> tuple[bytes, bytes, bytes | None]:
    """(prefix, sealed body, sealed payload or None) of one sealed frame's buffers."""
    head = bytes(buffers[0])
    return head[: wire.PREFIX_SIZE], head[wire.PREFIX_SIZE :], bytes(buffers[1]) if len(buffers) > 1 else None


def send_chunk(owner: Seal, payload: bytes, i: int = 0) -> tuple[bytes, bytes, bytes]:
    out = bytearray(len(payload) + TAG + 15)
    prefix, body, sealed = split(owner.seal_frame({"t": "chunk", "id": 1, "i": i}, memoryview(payload), out))
    assert sealed is not None
    return prefix, body, sealed


def open_chunk(requester: Seal, prefix: bytes, body: bytes, sealed: bytes) -> tuple[wire.Message, bytes]:
    msg = wire.decode(requester.open_body(prefix, body))
    dst = bytearray(len(sealed) - TAG)
    requester.open_payload(memoryview(sealed), memoryview(dst))
    return msg, bytes(dst)


@pytest.mark.parametrize("size", [1, 15, 16, 17, 4096, 256 << 10, (2 << 20) + 3])
def test_a_sealed_chunk_opens_to_the_same_bytes_and_hides_them_on_the_way(size: int) -> None:
    owner, requester = pair()
    payload = os.urandom(size)
    prefix, body, sealed = send_chunk(owner, payload)
    assert len(sealed) == size + TAG and wire.PREFIX.unpack(prefix) == (len(body), len(sealed))
    if size >= 64:
        assert payload[:64] not in sealed  # encrypted, not only authenticated
    msg, got = open_chunk(requester, prefix, body, sealed)
    assert msg == {"t": "chunk", "id": 1, "i": 0} and got == payload


def test_a_changed_byte_anywhere_in_a_sealed_frame_fails_it() -> None:
    payload = os.urandom(4096)
    for part, at in (("prefix", 5), ("body", 3), ("payload", 100), ("tag", -1)):
        owner, requester = pair()
        prefix, body, sealed = map(bytearray, send_chunk(owner, payload))
        target = {"prefix": prefix, "body": body, "payload": sealed, "tag": sealed}[part]
        target[at] ^= 0x01
        with pytest.raises(ProtocolError, match="failed its tag"):
            open_chunk(requester, bytes(prefix), bytes(body), bytes(sealed))


def test_a_dropped_repeated_or_reordered_frame_fails_its_tag() -> None:
    owner, requester = pair()
    frames = [send_chunk(owner, os.urandom(1024), i) for i in range(3)]
    open_chunk(requester, *frames[0])
    with pytest.raises(ProtocolError):
        open_chunk(requester, *frames[0])  # repeated
    owner, requester = pair()
    frames = [send_chunk(owner, os.urandom(1024), i) for i in range(3)]
    with pytest.raises(ProtocolError):
        open_chunk(requester, *frames[1])  # the first one dropped (or the two swapped)
    owner, requester = pair()
    frames = [send_chunk(owner, os.urandom(1024), i) for i in range(2)]
    msg, _ = open_chunk(requester, frames[0][0], frames[0][1], frames[0][2])
    with pytest.raises(ProtocolError):  # a payload spliced from another frame under its body
        open_chunk(requester, frames[1][0], frames[1][1], frames[0][2])


def test_a_frame_does_not_open_in_the_direction_it_did_not_travel() -> None:
    owner, requester = pair()
    prefix, body, _ = split(requester.seal_frame({"t": "get", "id": 1}, None, None))
    assert wire.decode(owner.open_body(prefix, body)) == {"t": "get", "id": 1}
    prefix, body, _ = split(requester.seal_frame({"t": "get", "id": 2}, None, None))
    with pytest.raises(ProtocolError):
        Seal(KEY, owner=False).open_body(prefix, body)  # reflected back at the requester


def test_both_ends_of_an_exchange_agree_on_a_key_that_is_new_every_connection() -> None:
    bound = b"b" * 32
    a, b = Exchange(), Exchange()
    key = a.key(b.share, bound)
    assert key == b.key(a.share, bound) and len(key) == 32
    assert a.key(b.share, b"c" * 32) != key  # the cluster secret's proof over the transcript is mixed in
    c, d = Exchange(), Exchange()
    assert c.key(d.share, bound) != key  # same secret and transcript, fresh shares: another key
    with pytest.raises(ProtocolError, match="32 bytes"):
        a.key(b"short", bound)
    with pytest.raises(ProtocolError, match="unusable key share"):
        a.key(bytes(32), bound)  # a share of small order: an all-zero secret
