"""The chunk format: a fixed 64-byte header and the payload.

    offset size  field
    0      4     magic b"LMP2"
    4      2     format version (u16)
    6      2     reserved (0)
    8      16    chunk key
    24     16    fingerprint digest
    40     4     payload length in bytes (u32)
    44     4     number of tokens in the chunk (u32; < chunk_size for a prompt's tail)
    48     8     epoch (u64): the etcd revision up to which the computing node had applied
                 invalidations; a standing invalidation at revision R covers chunks with epoch < R
    56     8     xxh3_64 of the payload (u64)

All integers little-endian. The payload is, for every layer in order, the bytes of the
engine blocks that hold the chunk's tokens. ``verify`` is the only way bytes leave a reader:
it raises instead of returning anything that does not match its header.
"""

from __future__ import annotations

import dataclasses
import struct

import xxhash

from .errors import ChecksumMismatch, MalformedChunk
from .keys import ChunkKey, FingerprintDigest

MAGIC = b"LMP2"
CHUNK_FORMAT_VERSION = 2  # 2: u32 length and the epoch
_HEADER = struct.Struct("<4sHH16s16sIIQQ")
MAX_PAYLOAD = (1 << 32) - 1
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 64


def checksum(payload: memoryview | bytes | bytearray) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkHeader:
    key: ChunkKey
    fingerprint: FingerprintDigest
    length: int
    num_tokens: int
    checksum: int
    epoch: int = 0
    version: int = CHUNK_FORMAT_VERSION

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC, self.version, 0, self.key, self.fingerprint, self.length, self.num_tokens, self.epoch,
            self.checksum)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> ChunkHeader:
        if len(data) < HEADER_SIZE:
            raise MalformedChunk(f"header needs {HEADER_SIZE} bytes, got {len(data)}")
        magic, version, _, key, fp, length, ntok, epoch, csum = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise MalformedChunk(f"bad magic {magic!r}")
        if version != CHUNK_FORMAT_VERSION:
            raise MalformedChunk(f"unsupported chunk format version {version}")
        return cls(ChunkKey(key), FingerprintDigest(fp), length, ntok, csum, epoch, version)


def make_header(
    key: ChunkKey, fingerprint: FingerprintDigest, payload: memoryview | bytes, num_tokens: int, epoch: int = 0
) -> ChunkHeader:
    if len(payload) > MAX_PAYLOAD:
        raise MalformedChunk(f"payload of {len(payload)} bytes exceeds the format's {MAX_PAYLOAD}")
    return ChunkHeader(key, fingerprint, len(payload), num_tokens, checksum(payload), epoch)


def verify(header: ChunkHeader, payload: memoryview | bytes | bytearray) -> memoryview:
    """Return ``payload`` as a memoryview only if its length and checksum match ``header``."""
    view = memoryview(payload).cast("B")
    if len(view) != header.length:
        raise MalformedChunk(f"payload is {len(view)} bytes, header says {header.length}")
    actual = checksum(view)
    if actual != header.checksum:
        raise ChecksumMismatch(f"chunk {header.key.hex()}: checksum {actual:#x} != {header.checksum:#x}")
    return view
