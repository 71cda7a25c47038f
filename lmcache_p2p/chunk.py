"""The chunk format: a fixed 80-byte header and the payload.

    offset size  field
    0      4     magic b"LMP2"
    4      2     format version (u16)
    6      2     first KV head held (u16)
    8      16    chunk key
    24     16    fingerprint digest
    40     4     payload length in bytes (u32)
    44     2     number of tokens in the chunk (u16; < chunk_size for a prompt's tail)
    46     2     end of the KV heads held (u16, exclusive)
    48     8     epoch (u64): the generation of etcd's history (high 24 bits) and the revision
                 (low 40) up to which the computing node had applied invalidations; a standing
                 invalidation at revision R covers a chunk of another generation, or of this one
                 below R (``invalidation.py``, ``index/generation.py``)
    56     8     xxh3_64 of the payload (u64)
    64     16    origin: the engine that computed the chunk (``ids.origin_of``: the ranks of a TP
                 engine share it; zeros: unknown). Kept by every copy, and a chunk is never
                 assembled from pieces of two origins: ``invalidate --node`` and a quarantine reach
                 every copy of what an engine computed. A claim of whoever serves it, not a proof:
                 the canary holds the holder to what it serves (``canary.py``)

All integers little-endian. The payload is the bytes of the engine blocks that hold the
chunk's tokens, head-major (``kernels/layout.py``): heads ``[h0, h1)`` are ``h1 - h0`` equal
segments, so :func:`slice_heads` can cut any sub-range out of a payload without knowing more.
``verify`` is the only way bytes leave a reader: it raises instead of returning anything that
does not match its header.
"""

from __future__ import annotations

import dataclasses
import struct

import xxhash

from .errors import ChecksumMismatch, MalformedChunk
from .ids import NO_ORIGIN, NodeDigest
from .keys import ChunkKey, FingerprintDigest, HeadRange

MAGIC = b"LMP2"
CHUNK_FORMAT_VERSION = 4  # 2: u32 length and the epoch; 3: the head range; 4: the origin
_HEADER = struct.Struct("<4sHH16s16sIHHQQ16s")
MAX_PAYLOAD = (1 << 32) - 1
MAX_HEADS = (1 << 16) - 1
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 80


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
    heads: HeadRange = (0, 1)
    origin: NodeDigest = NO_ORIGIN
    version: int = CHUNK_FORMAT_VERSION

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC, self.version, self.heads[0], self.key, self.fingerprint, self.length, self.num_tokens,
            self.heads[1], self.epoch, self.checksum, self.origin)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> ChunkHeader:
        if len(data) < HEADER_SIZE:
            raise MalformedChunk(f"header needs {HEADER_SIZE} bytes, got {len(data)}")
        magic, version, h0, key, fp, length, ntok, h1, epoch, csum, origin = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise MalformedChunk(f"bad magic {magic!r}")
        if version != CHUNK_FORMAT_VERSION:
            raise MalformedChunk(f"unsupported chunk format version {version}")
        if not h0 < h1 or length % (h1 - h0):
            raise MalformedChunk(f"head range [{h0}, {h1}) does not split a {length}-byte payload")
        return cls(ChunkKey(key), FingerprintDigest(fp), length, ntok, csum, epoch, (h0, h1), NodeDigest(origin),
                   version)


def make_header(
    key: ChunkKey, fingerprint: FingerprintDigest, payload: memoryview | bytes, num_tokens: int, epoch: int = 0,
    heads: HeadRange = (0, 1), origin: NodeDigest = NO_ORIGIN,
) -> ChunkHeader:
    if len(payload) > MAX_PAYLOAD:
        raise MalformedChunk(f"payload of {len(payload)} bytes exceeds the format's {MAX_PAYLOAD}")
    if not 0 <= heads[0] < heads[1] <= MAX_HEADS or len(payload) % (heads[1] - heads[0]):
        raise MalformedChunk(f"head range {heads} does not split a {len(payload)}-byte payload")
    return ChunkHeader(key, fingerprint, len(payload), num_tokens, checksum(payload), epoch, heads, origin)


def slice_heads(header: ChunkHeader, view: memoryview, heads: HeadRange) -> tuple[ChunkHeader, memoryview]:
    """The sub-range ``heads`` of a verified chunk: its header (own length and checksum) and bytes.

    The caller must have verified ``view`` against ``header`` just before: the new checksum is
    computed over these bytes, so it vouches for them only as far as that check did."""
    h0, h1 = header.heads
    if not h0 <= heads[0] < heads[1] <= h1:
        raise MalformedChunk(f"heads {heads} are not within the chunk's [{h0}, {h1})")
    if heads == header.heads:
        return header, view
    per = header.length // (h1 - h0)
    part = view[(heads[0] - h0) * per : (heads[1] - h0) * per]
    return dataclasses.replace(header, length=len(part), checksum=checksum(part), heads=heads), part


def verify(header: ChunkHeader, payload: memoryview | bytes | bytearray) -> memoryview:
    """Return ``payload`` as a memoryview only if its length and checksum match ``header``."""
    view = memoryview(payload).cast("B")
    if len(view) != header.length:
        raise MalformedChunk(f"payload is {len(view)} bytes, header says {header.length}")
    actual = checksum(view)
    if actual != header.checksum:
        raise ChecksumMismatch(f"chunk {header.key.hex()}: checksum {actual:#x} != {header.checksum:#x}")
    return view
