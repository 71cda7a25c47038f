"""The names every layer shares: a node's id, where a node's transfer server listens, a tier's code
and the wire version.

Defined once, here below the index and the transfer layer, so the tiers, the planner, the etcd
schema and the transports all say the same thing without importing each other. (Not to be
confused with ``identity.py``: what a *model* is.)
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
from typing import NewType

NodeId = NewType("NodeId", str)
"""A node's name in the mesh: ``nodes/<node_id>`` in etcd, the id its handshake proves."""

OBJECTS = NodeId("@objects")
"""The owner the index lists for a chunk the object store holds (``blocks/<fp>/<key>/@objects``,
written by the uploader without a lease). No node can take the name: node ids have no ``@``."""

NODE_ID_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,253}")
"""The node ids accepted from others (etcd keys and records, handshakes, certificates, an object's
uploader); a node's own ``node_id`` is held to config.py's narrower rule. No ``@``: a certificate,
handshake or node record can't name itself :data:`OBJECTS` (only a block entry's owner may be it,
:func:`is_owner_id`)."""


def is_owner_id(owner: str) -> bool:
    """Whether ``owner`` may own a block entry: a node id, or the object store (:data:`OBJECTS`)."""
    return owner == OBJECTS or NODE_ID_RE.fullmatch(owner) is not None

NodeDigest = NewType("NodeDigest", bytes)
"""16 bytes naming a node in a chunk's header (the node that computed it): :func:`node_digest`."""

NO_ORIGIN = NodeDigest(bytes(16))
"""The origin of a chunk no single node computed (assembled from pieces of several) or of unknown origin."""


def node_digest(node_id: str) -> NodeDigest:
    """The 16-byte name of ``node_id`` (BLAKE2b, personalised: not forgeable into another node's by
    choosing an id)."""
    return NodeDigest(hashlib.blake2b(node_id.encode(), digest_size=16, person=b"lmcache-p2p/node").digest())


_RANK_SUFFIX = re.compile(r"-r\d+$")


def engine_of(node_id: str) -> str:
    """The engine a node's agent runs in: a tensor-parallel rank's agent is ``<engine>-r<rank>``
    (``config.rank_config``; a certificate naming the engine covers its ranks), any other node is its own."""
    return _RANK_SUFFIX.sub("", node_id)


def origin_of(node_id: str) -> NodeDigest:
    """The origin a chunk header carries for what ``node_id`` computes: the digest of its *engine*, so
    the ranks of one tensor-parallel engine share it and a chunk assembled from their head ranges keeps it."""
    return node_digest(engine_of(node_id))


# The transfer protocol's version (handshake and frames: transfer/wire.py); every node record carries it,
# and nodes pull only from owners that speak the same (peers.compatible).
# 2: proofs carry a channel binding (TLS); 3: chunk format 3 (head ranges), heads in get/pin, offer, recent;
# 4: proofs and the MAC key bind the owner's node id (challenge.node) and the requester's (hello.node);
# 5: chunk format 4 (the computing node in the header);
# 6: the payload MAC is GMAC (was keyed BLAKE3), the ids of gets and pins must grow;
# 7: with TLS, X25519 shares in hello and challenge, and every frame after ready sealed (transfer/seal.py)
WIRE_VERSION = 7


class TierCode(enum.IntEnum):
    """The tier byte of a block entry in etcd: where an owner holds the chunk; lower is faster."""

    GPU = 0
    CPU = 1
    DISK = 2
    OBJECT = 3  # the cluster's object store (owner ``OBJECTS``)


TIER_GPU, TIER_CPU, TIER_DISK = int(TierCode.GPU), int(TierCode.CPU), int(TierCode.DISK)
TIER_OBJECT = int(TierCode.OBJECT)
TIER_NAMES = {int(t): t.name.lower() for t in TierCode}  # tier byte -> "gpu" | "cpu" | "disk"
TIER_CODES = {name: code for code, name in TIER_NAMES.items()}  # "gpu" | "cpu" | "disk" -> tier byte


@dataclasses.dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a peer's transfer server listens, and which node must answer there: the node record
    (``nodes/<node_id>`` in etcd) it came from. The handshake fails unless the owner proves the
    cluster secret as ``node_id`` (:class:`~lmcache_p2p.errors.PeerIdentityError`)."""

    host: str
    port: int
    node_id: NodeId

    def __str__(self) -> str:
        return f"{self.node_id}@{self.host}:{self.port}"


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``"host:port"`` (split at the last colon, port 1-65535 in ASCII digits);
    None where it is not one. The one parser of a node record's addresses."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    return host, int(port)
