"""The object format (version 2): a chunk sealed for a store that is not trusted.

    offset  size  field
    0       4     magic b"LMPO"
    4       1     object format version (2)
    5       1     sealing: 1 AES-256-GCM (a cluster secret is set), 0 none (no secret: checksum only)
    6       12    nonce (random per object; zeros when not sealed)
    18      ...   body, encrypted when sealed: [80-byte chunk header][payload][uploader id][u8 its length]
    end-16  16    the AEAD tag (sealed only)

The AEAD key is derived (HKDF-SHA256) from the cluster secret and the tenant of the chunk's fingerprint
(its :func:`~lmcache_p2p.index.schema.tenant_digest`, or a fixed label without a tenant). The associated
data is the first 18 bytes and the object's name (``<prefix>/<cluster>/<fp>/<key>``): an object moved
under another name, or its preamble changed, does not authenticate. A bucket reader without the secret
learns the object's size and nothing of its KV; a bucket writer can delete or replay objects, not forge
them. A replayed older object of the same name authenticates (it once was that chunk): the reader compares
the epoch in its (authenticated) chunk header with the one the etcd meta recorded (``tier.py``).

Version 1 (an unencrypted chunk with a keyed BLAKE3 MAC, starting with the chunk magic ``LMP2``) is refused
as unsupported. A reader with a secret refuses unsealed objects, one without refuses sealed ones.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..chunk import HEADER_SIZE, MAGIC, ChunkHeader, verify
from ..errors import MalformedChunk
from ..ids import NODE_ID_RE, NodeId
from ..keys import ChunkKey, FingerprintDigest

OBJECT_MAGIC = b"LMPO"
OBJECT_FORMAT_VERSION = 2  # 1: the chunk, its uploader and a BLAKE3 MAC, not encrypted
SEALED, PLAIN = 1, 0
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_UPLOADER_BYTES = 255
_PREAMBLE = struct.Struct("<4sBB12s")
PREAMBLE_SIZE = _PREAMBLE.size
_KEY_INFO = b"lmcache-p2p object v2\x00"
NO_TENANT = "-"  # the key label of a fingerprint without a tenant salt


def object_key(secret: bytes, tenant: str) -> bytes:
    """The AEAD key of one tenant's objects (``tenant``: a tenant digest, or "" for none)."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_KEY_INFO + (tenant or NO_TENANT).encode())
    return hkdf.derive(secret)


def max_object_size(slot_bytes: int) -> int:
    """The largest object a chunk of at most ``slot_bytes`` of payload packs into: what a read may fetch."""
    return PREAMBLE_SIZE + HEADER_SIZE + slot_bytes + MAX_UPLOADER_BYTES + 1 + TAG_BYTES


def pack_object(header: ChunkHeader, payload: bytes | memoryview, node: NodeId, name: str,
                key: bytes | None) -> bytes | bytearray:
    """The object for chunk ``header`` stored under ``name``: sealed under ``key`` (see :func:`object_key`),
    or only checksummed when ``key`` is None (no cluster secret)."""
    node_bytes = node.encode()
    if len(node_bytes) > MAX_UPLOADER_BYTES:
        raise MalformedChunk(f"uploader id of {len(node_bytes)} bytes")
    parts = (header.pack(), payload, node_bytes, bytes([len(node_bytes)]))
    if key is None:
        return b"".join((_PREAMBLE.pack(OBJECT_MAGIC, OBJECT_FORMAT_VERSION, PLAIN, bytes(NONCE_BYTES)), *parts))
    preamble = _PREAMBLE.pack(OBJECT_MAGIC, OBJECT_FORMAT_VERSION, SEALED, os.urandom(NONCE_BYTES))
    body = b"".join(parts)
    out = bytearray(PREAMBLE_SIZE + len(body) + TAG_BYTES)  # one buffer: ciphertext and tag land after the preamble
    out[:PREAMBLE_SIZE] = preamble
    AESGCM(key).encrypt_into(preamble[-NONCE_BYTES:], body, preamble + name.encode(), memoryview(out)[PREAMBLE_SIZE:])
    return out


def unpack_object(data: bytes, name: str, key: ChunkKey, fp: FingerprintDigest, aead_key: bytes | None
                  ) -> tuple[ChunkHeader, memoryview, NodeId]:
    """The verified header, payload and uploader of object ``name``, which should hold chunk ``key`` of
    ``fp``; raises :class:`~lmcache_p2p.errors.ChunkError` for anything else (the epoch is the caller's)."""
    body = memoryview(_open(data, name, aead_key))
    header = ChunkHeader.unpack(body)
    if header.key != key or header.fingerprint != fp:
        raise MalformedChunk(f"object holds chunk {header.key.hex()[:16]} of {header.fingerprint.hex()[:8]}")
    end = HEADER_SIZE + header.length
    if len(body) < end + 1 or len(body) != end + body[-1] + 1:
        raise MalformedChunk(f"object body is {len(body)} bytes, its header says a {header.length}-byte payload")
    node = bytes(body[end:-1]).decode("ascii", errors="replace")
    if not NODE_ID_RE.fullmatch(node):
        raise MalformedChunk(f"object names an invalid uploader {node[:40]!r}")
    return header, verify(header, body[HEADER_SIZE:end]), NodeId(node)


def _open(data: bytes, name: str, aead_key: bytes | None) -> bytes | memoryview:
    """The body of an object: checked preamble, then decrypted and authenticated when sealed."""
    if len(data) < PREAMBLE_SIZE + HEADER_SIZE + 1:
        raise MalformedChunk(f"object of {len(data)} bytes is too short")
    if data[:4] == MAGIC:
        raise MalformedChunk("object format 1 (MACed, not encrypted) is no longer supported")
    magic, version, sealing, nonce = _PREAMBLE.unpack_from(data)
    if magic != OBJECT_MAGIC:
        raise MalformedChunk(f"bad object magic {magic!r}")
    if version != OBJECT_FORMAT_VERSION:
        raise MalformedChunk(f"unsupported object format version {version}")
    if aead_key is None:
        if sealing != PLAIN:
            raise MalformedChunk("object is sealed, and this node has no cluster secret")
        return memoryview(data)[PREAMBLE_SIZE:]
    if sealing != SEALED:
        raise MalformedChunk("object is not sealed, and this cluster has a secret")
    try:
        return AESGCM(aead_key).decrypt(nonce, memoryview(data)[PREAMBLE_SIZE:],
                                        bytes(data[:PREAMBLE_SIZE]) + name.encode())
    except InvalidTag as exc:
        raise MalformedChunk("object does not authenticate under the cluster secret and its tenant's key (forged, "
                             "corrupted, or moved from another name)") from exc
