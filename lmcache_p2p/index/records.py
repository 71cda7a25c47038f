"""The records kept beside the index's own (``schema.py`` lays out every key): standing invalidations
(``invalidate/<id>``), the object store's metas (``objects/<fp>/<key>``) and the cluster's generation
(``generation``). Each has one decode function that raises :class:`~lmcache_p2p.errors.MalformedRecord`
for anything it can't vouch for; readers count the reject and skip the record."""

from __future__ import annotations

import dataclasses
import re
import secrets
import time

import msgpack

from ..errors import MalformedRecord
from ..ids import NO_ORIGIN, NODE_ID_RE, NodeDigest, NodeId
from ..keys import ChunkKey, FingerprintDigest
from .schema import _HEX, _HEX_RE, _TENANT_DIGEST_RE, MAX_RECORD_BYTES, tenant_value

# ---- invalidations ----------------------------------------------------------------------------
INVALIDATION_KINDS = ("fingerprint", "tenant", "node")
MIN_FP_PREFIX = 8


@dataclasses.dataclass(frozen=True, slots=True)
class Invalidation:
    """A standing invalidation: drop every matching chunk stamped before ``revision``.

    ``value`` is a fingerprint digest prefix, a :func:`tenant_digest` or a node id.

    ``revision`` is the etcd revision at which the record was written (its ``mod_revision``), so
    it is known from the read, not stored in the value. See :mod:`lmcache_p2p.invalidation`.
    """

    id: str
    kind: str
    value: str
    issued_at: float
    revision: int = 0

    def __post_init__(self) -> None:
        if self.kind not in INVALIDATION_KINDS:
            raise ValueError(f"invalidation kind must be one of {INVALIDATION_KINDS}, got {self.kind!r}")
        if not self.value:
            raise ValueError(f"invalidation {self.kind}: value must not be empty")
        if self.kind == "fingerprint" and not re.fullmatch(rf"[0-9a-f]{{{MIN_FP_PREFIX},32}}", self.value):
            raise ValueError(f"fingerprint: expected {MIN_FP_PREFIX}-32 lower-case hex chars, got {self.value!r}")
        if self.kind == "tenant" and not _TENANT_DIGEST_RE.fullmatch(self.value):
            raise ValueError(f"tenant: expected a tenant digest (64 lower-case hex chars), got {self.value[:80]!r}")

    def pack(self) -> bytes:
        return msgpack.packb({"kind": self.kind, "value": self.value, "issued_at": self.issued_at},
                             use_bin_type=True)

    @classmethod
    def unpack(cls, id_: str, data: bytes, revision: int = 0) -> Invalidation:
        return decode_invalidation(id_.encode(), data, revision, prefix_len=0)


def decode_invalidation(etcd_key: bytes, data: bytes, revision: int, *, prefix_len: int) -> Invalidation:
    try:
        id_ = etcd_key[prefix_len:].decode()
        raw = msgpack.unpackb(data, raw=False)
        if not isinstance(raw, dict):
            raise TypeError(f"expected a map, got {type(raw).__name__}")
        kind, value, issued_at = raw["kind"], raw["value"], raw.get("issued_at", 0.0)
        if not isinstance(kind, str) or not isinstance(value, str) or not isinstance(issued_at, (int, float)):
            raise TypeError("kind and value must be strings, issued_at a number")
        if kind == "tenant" and value:
            value = tenant_value(value)
        return Invalidation(id_, kind, value, float(issued_at), revision)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise MalformedRecord("invalidation", f"{etcd_key[-40:]!r}: {exc}") from exc


# ---- objects in the object store ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class ObjectMeta:
    """``objects/<fp>/<key>``: what the cleanup needs to know of an object without reading it: its size,
    when it was uploaded (wall clock), by which node, and the chunk's epoch, tokens, heads and origin
    (the node that computed it: ``invalidate --node`` finds its objects without reading them), and the
    :func:`tenant_digest` of its fingerprint ("" without a tenant: ``invalidate --tenant`` finds the objects
    of a fingerprint no running node serves). A reader takes the object only if the epoch in its
    authenticated header is this ``epoch`` (an older object put back under the name is a replay)."""

    fp: FingerprintDigest
    key: ChunkKey
    size: int
    uploaded_at: float
    node: NodeId
    epoch: int
    num_tokens: int
    heads: tuple[int, int]
    origin: NodeDigest = NO_ORIGIN
    tenant: str = ""

    def pack(self) -> bytes:
        return msgpack.packb({"size": self.size, "at": self.uploaded_at, "node": self.node, "epoch": self.epoch,
                              "tokens": self.num_tokens, "heads": list(self.heads), "origin": bytes(self.origin),
                              "tenant": self.tenant})


def decode_object_meta(etcd_key: bytes, data: bytes, *, prefix_len: int) -> ObjectMeta:
    """An ``objects/<fp>/<key>`` record under a prefix of ``prefix_len``."""
    fp_hex, key_hex = etcd_key[prefix_len:prefix_len + _HEX], etcd_key[prefix_len + _HEX + 1:]
    if not (_HEX_RE.fullmatch(fp_hex) and _HEX_RE.fullmatch(key_hex)
            and etcd_key[prefix_len + _HEX:prefix_len + _HEX + 1] == b"/"):
        raise MalformedRecord("object meta", f"{etcd_key[-80:]!r}: expected <32 hex>/<32 hex>")
    if len(data) > MAX_RECORD_BYTES:
        raise MalformedRecord("object meta", f"{len(data)} bytes")
    try:
        raw = msgpack.unpackb(data, raw=False)
        if not isinstance(raw, dict):
            raise TypeError(f"expected a map, got {type(raw).__name__}")
        size, at, node, epoch, tokens, heads = (raw["size"], raw["at"], raw["node"], raw["epoch"], raw["tokens"],
                                                raw["heads"])
        origin, tenant = raw.get("origin", NO_ORIGIN), raw.get("tenant", "")
        if not (isinstance(origin, bytes) and len(origin) == len(NO_ORIGIN)):
            raise TypeError("origin: 16 bytes")
        if not (isinstance(tenant, str) and (not tenant or _TENANT_DIGEST_RE.fullmatch(tenant))):
            raise TypeError("tenant: a tenant digest (64 lower-case hex chars) or empty")
        if not (isinstance(size, int) and isinstance(at, (int, float)) and isinstance(node, str)
                and isinstance(epoch, int) and isinstance(tokens, int) and isinstance(heads, list)
                and len(heads) == 2 and all(isinstance(h, int) for h in heads)):
            raise TypeError("size, epoch, tokens: ints; at: a number; node: a string; heads: two ints")
        if not NODE_ID_RE.fullmatch(node) or size < 0 or epoch < 0 or not 0 <= heads[0] < heads[1]:
            raise ValueError("node id, size, epoch or heads out of range")
        return ObjectMeta(FingerprintDigest(bytes.fromhex(fp_hex.decode())), ChunkKey(bytes.fromhex(key_hex.decode())),
                          size, float(at), NodeId(node), epoch, tokens, (heads[0], heads[1]), NodeDigest(origin),
                          tenant)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise MalformedRecord("object meta", f"{etcd_key[-80:]!r}: {exc}") from exc


# ---- the generation of the etcd history -----------------------------------------------------------
MAX_GENERATION = (1 << 24) - 1  # a generation id is the top 24 bits of every chunk epoch


@dataclasses.dataclass(frozen=True, slots=True)
class Generation:
    """``generation``: the random id of this etcd history (see :mod:`lmcache_p2p.index.generation`);
    ``revision`` is the record's ``mod_revision``, known from the read."""

    id: int
    created_at: float
    revision: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.id <= MAX_GENERATION:
            raise ValueError(f"generation id must be in [1, {MAX_GENERATION}], got {self.id}")

    @classmethod
    def new(cls, avoid: int | None = None) -> Generation:
        """A fresh random id, other than ``avoid`` (the generation it replaces)."""
        while True:
            id_ = 1 + secrets.randbelow(MAX_GENERATION)
            if id_ != avoid:
                return cls(id_, time.time())

    def pack(self) -> bytes:
        return msgpack.packb({"id": self.id, "created_at": self.created_at}, use_bin_type=True)


def decode_generation(data: bytes, revision: int) -> Generation:
    try:
        raw = msgpack.unpackb(data, raw=False)
        if not isinstance(raw, dict):
            raise TypeError(f"expected a map, got {type(raw).__name__}")
        id_, created_at = raw["id"], raw.get("created_at", 0.0)
        if not isinstance(id_, int) or isinstance(id_, bool) or not isinstance(created_at, (int, float)):
            raise TypeError("id must be an int, created_at a number")
        return Generation(id_, float(created_at), revision)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise MalformedRecord("generation", str(exc)) from exc
