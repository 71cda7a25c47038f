"""One exception tree for lmcache-p2p.

    LMCacheP2PError
    ├── ConfigError (also ValueError)     invalid configuration; the message names the field
    ├── ChunkError                        a chunk that must not reach the engine
    │   ├── ChecksumMismatch              payload bytes differ from the header checksum
    │   └── MalformedChunk                bad magic, version, length or key in a header
    ├── TierError                         a tier cannot take or give a chunk
    │   └── CapacityError                 nothing evictable: every slot is pinned
    ├── IndexError_                       the etcd block index failed (translated gRPC errors)
    │   ├── LeaseLost                     the session's lease expired or was revoked
    │   ├── WatchCompacted                a watch's start revision was compacted away: resync
    │   └── MalformedRecord               a key or value read from etcd that the schema rejects
    └── TransferError                     a peer transfer failed (translated socket/NIXL/UCX errors)
        ├── HandshakeError                wrong secret, protocol version or fingerprint
        │   └── PeerIdentityError         the peer proved the secret, but is not the node planned
        ├── ProtocolError                 malformed, oversized or unexpected frame
        └── PeerTimeout                   a network wait ran past its deadline

Lower-level exceptions are translated where they enter (``raise ... from exc``) so callers
only ever catch these.
"""

from __future__ import annotations


class LMCacheP2PError(Exception):
    """Root of every exception raised by lmcache-p2p."""


class ConfigError(LMCacheP2PError, ValueError):
    """Invalid configuration. ``field`` is the dotted name of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ChunkError(LMCacheP2PError):
    """A chunk that failed verification; its bytes are never handed out."""


class ChecksumMismatch(ChunkError):
    pass


class MalformedChunk(ChunkError):
    pass


class TierError(LMCacheP2PError):
    pass


class CapacityError(TierError):
    pass


class IndexError_(LMCacheP2PError):  # noqa: N801 - avoid shadowing the builtin IndexError
    pass


class LeaseLost(IndexError_):
    pass


class WatchCompacted(IndexError_):
    """History before ``revision`` is gone: the watcher must resync from a range read."""

    def __init__(self, message: str, revision: int) -> None:
        super().__init__(message)
        self.revision = revision


class WatchBehind(WatchCompacted):
    """The member that took a watch is at a revision below one already seen: a member still applying
    what the others committed (a follower a few revisions behind), or a restored or new etcd. Only a
    linearizable read tells them apart."""


class MalformedRecord(IndexError_):
    """A key or value read from etcd that the schema rejects; ``kind`` names the record type."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"malformed {kind}: {message}")
        self.kind = kind


class TransferError(LMCacheP2PError):
    pass


class HandshakeError(TransferError):
    pass


class PeerIdentityError(HandshakeError):
    """The peer that answered is not the node whose record the pull was planned from: it proved the
    secret as another node id, or its certificate names other nodes (a record pointing at another
    node's address, or a relay)."""


class ProtocolError(TransferError):
    pass


class PeerTimeout(TransferError):
    pass


class SharedConnectionAborted(TransferError):
    """The connection this pull shared was closed because another pull on it ran past its deadline. That
    pull charged the peer; this one is a bystander: its chunks miss (``aborted``), the peer is not charged
    again (one overrun with N pulls on the connection once backed the peer off 2^N times as long)."""


class ObjectStoreError(LMCacheP2PError):
    """The object store did not answer in time, refused, or failed (``lmcache_p2p/objects/``): a miss."""


class ObjectMissing(ObjectStoreError):
    """The object store does not hold the object asked for."""


class ObjectSizeRefused(LMCacheP2PError):
    """A GET found an object whose ``size`` the reader does not take (larger than its bound, or empty): the
    object is there and the store answered, so it is the object's fault, not the store's."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size
