"""The etcd schema of the mesh index (version 1).

All keys live under ``/lmcache-p2p/v1/<cluster>/``::

    config                                   msgpack cluster config        permanent, watched
    nodes/<node_id>                          msgpack NodeRecord            on the node's lease
    blocks/<fp_hex:32>/<key_hex:32>/<node>   one tier byte                 on the node's lease
    invalidate/<id>                          msgpack Invalidation          on its own lease (10 min)

A block entry costs one short key and a one-byte value: its presence says "this node holds this
chunk", the byte says in which tier (a hint for choosing among owners). Fixed-width hex parts let
the mirror cut a key by offset instead of splitting it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NewType

import msgpack

from ..errors import IndexError_
from ..keys import ChunkKey, FingerprintDigest

SCHEMA_VERSION = 1
WIRE_VERSION = 1
NodeId = NewType("NodeId", str)

# Tier bytes stored as block values; lower is faster.
TIER_GPU = 0
TIER_CPU = 1
TIER_DISK = 2

_HEX = 32  # hex chars of a 16-byte digest


class Schema:
    """Key layout for one cluster. All keys are bytes."""

    def __init__(self, cluster: str) -> None:
        self.root = f"/lmcache-p2p/v{SCHEMA_VERSION}/{cluster}/".encode()
        self.config = self.root + b"config"
        self.nodes = self.root + b"nodes/"
        self.blocks = self.root + b"blocks/"
        self.invalidations = self.root + b"invalidate/"  # see lmcache_p2p.invalidation

    def node(self, node_id: NodeId) -> bytes:
        return self.nodes + node_id.encode()

    def blocks_of(self, fp: FingerprintDigest) -> bytes:
        """Prefix of every block entry of one fingerprint (ends with ``/``)."""
        return self.blocks + fp.hex().encode() + b"/"

    def block(self, fp: FingerprintDigest, key: ChunkKey, node_id: NodeId) -> bytes:
        return b"%s%s/%s/%s" % (self.blocks, fp.hex().encode(), key.hex().encode(), node_id.encode())

    def parse_block(self, prefix_len: int, etcd_key: bytes) -> tuple[ChunkKey, NodeId]:
        """``(chunk key, node)`` of a block entry under a ``blocks_of`` prefix of ``prefix_len``."""
        try:
            key = ChunkKey(bytes.fromhex(etcd_key[prefix_len:prefix_len + _HEX].decode()))
        except ValueError as exc:
            raise IndexError_(f"malformed block key {etcd_key!r}") from exc
        return key, NodeId(etcd_key[prefix_len + _HEX + 1:].decode())


@dataclasses.dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node publishes about itself at ``nodes/<node_id>``."""

    node_id: NodeId
    addresses: dict[str, str]  # transport name -> "host:port"
    transports: tuple[str, ...]
    fingerprints: tuple[str, ...] = ()  # hex digests served
    capacities: dict[str, int] = dataclasses.field(default_factory=dict)  # tier name -> bytes
    software_version: str = ""
    wire_version: int = WIRE_VERSION
    started_at: float = dataclasses.field(default_factory=time.time)
    nixl_metadata: bytes | None = None
    metrics_url: str | None = None
    models: dict[str, str] = dataclasses.field(default_factory=dict)  # fingerprint hex -> model id
    tenants: dict[str, str] = dataclasses.field(default_factory=dict)  # fingerprint hex -> tenant salt (salted)

    def pack(self) -> bytes:
        return msgpack.packb(
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes) -> NodeRecord:
        try:
            raw = msgpack.unpackb(data, raw=False)
            known = {f.name for f in dataclasses.fields(cls)}
            fields = {k: v for k, v in raw.items() if k in known}  # newer writers may add fields
            fields["node_id"] = NodeId(str(fields["node_id"]))
            fields["transports"] = tuple(fields.get("transports", ()))
            fields["fingerprints"] = tuple(fields.get("fingerprints", ()))
            return cls(**fields)
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
            raise IndexError_(f"malformed node record: {exc}") from exc
