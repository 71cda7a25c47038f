import os

import pytest

from lmcache_p2p.chunk import HEADER_SIZE, ChunkHeader, make_header, verify
from lmcache_p2p.errors import ChecksumMismatch, MalformedChunk

KEY, FP = b"k" * 16, b"f" * 16


def test_header_round_trip_and_verify():
    payload = os.urandom(4096)
    header = make_header(KEY, FP, payload, 200)
    packed = header.pack()
    assert len(packed) == HEADER_SIZE
    assert ChunkHeader.unpack(packed) == header
    assert bytes(verify(header, payload)) == payload


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
    with pytest.raises(MalformedChunk, match="needs 64"):
        ChunkHeader.unpack(packed[:10])
    bad = bytearray(packed)
    bad[0:4] = b"XXXX"
    with pytest.raises(MalformedChunk, match="magic"):
        ChunkHeader.unpack(bad)
    bad = bytearray(packed)
    bad[4] = 99
    with pytest.raises(MalformedChunk, match="version"):
        ChunkHeader.unpack(bad)
