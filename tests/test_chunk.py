import os

import pytest

from lmcache_p2p.chunk import HEADER_SIZE, ChunkHeader, make_header, slice_heads, verify
from lmcache_p2p.errors import ChecksumMismatch, MalformedChunk
from lmcache_p2p.ids import NO_ORIGIN, node_digest

KEY, FP = b"k" * 16, b"f" * 16


def test_header_round_trip_and_verify():
    payload = os.urandom(4096)
    header = make_header(KEY, FP, payload, 200)
    packed = header.pack()
    assert len(packed) == HEADER_SIZE
    assert ChunkHeader.unpack(packed) == header
    assert bytes(verify(header, payload)) == payload
    assert header.origin == NO_ORIGIN  # nobody named


def test_the_origin_names_the_computing_node_and_survives_every_copy():
    payload = os.urandom(4096)
    header = make_header(KEY, FP, payload, 256, heads=(0, 4), origin=node_digest("engine-a"))
    again = ChunkHeader.unpack(header.pack())
    assert again.origin == node_digest("engine-a") != node_digest("engine-b")
    assert len(again.origin) == 16 and again.origin != NO_ORIGIN
    # A head range cut out of it (what an owner serves a TP rank) keeps who computed it.
    assert slice_heads(again, memoryview(payload), (1, 3))[0].origin == node_digest("engine-a")
    # A version-3 header (no origin: 64 bytes) is refused, never read as a chunk without one.
    old = bytearray(header.pack())
    old[4:6] = (3).to_bytes(2, "little")
    with pytest.raises(MalformedChunk, match="version 3"):
        ChunkHeader.unpack(old)


def test_flipped_byte_and_wrong_length_are_refused():
    payload = bytearray(os.urandom(4096))
    header = make_header(KEY, FP, payload, 256)
    payload[100] ^= 0x01
    with pytest.raises(ChecksumMismatch):
        verify(header, payload)
    with pytest.raises(MalformedChunk):
        verify(header, payload[:-1])


def test_bad_magic_version_and_truncation():
    packed = bytearray(make_header(KEY, FP, b"x", 1).pack())
    with pytest.raises(MalformedChunk, match="needs 80"):
        ChunkHeader.unpack(packed[:10])
    bad = bytearray(packed)
    bad[0:4] = b"XXXX"
    with pytest.raises(MalformedChunk, match="magic"):
        ChunkHeader.unpack(bad)
    bad = bytearray(packed)
    bad[4] = 99
    with pytest.raises(MalformedChunk, match="version"):
        ChunkHeader.unpack(bad)
