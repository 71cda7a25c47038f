"""The etcd schema of the mesh index (version 1).

All keys live under ``/lmcache-p2p/v1/<cluster>/``::

    config                                   msgpack cluster config        permanent, watched
    generation                               msgpack Generation            permanent (see index/generation.py)
    nodes/<node_id>                          msgpack NodeRecord            on the node's lease
    blocks/<fp_hex:32>/<key_hex:32>/<node>   one tier byte                 on the node's lease
    invalidate/<id>                          msgpack Invalidation          standing (optionally a lease)
    blocks/<fp_hex:32>/<key_hex:32>/@objects one tier byte (3)             permanent: the object store holds it
    objects/<fp_hex:32>/<key_hex:32>         msgpack ObjectMeta            permanent, with the entry above

A tenant salt never enters etcd: node records and invalidations carry its one-way digest
(:func:`tenant_digest`); values written by older versions that hold a raw salt decode to its digest.

A block entry costs one short key and a one-byte value: its presence says "this node holds this
chunk", the byte says in which tier (a hint for choosing among owners). Fixed-width hex parts let
the mirror cut a key by offset instead of splitting it.

Everything read back from etcd goes through one decode function per record type
(:func:`decode_node_key`, :func:`decode_node_record`, :func:`decode_block_key`, :func:`decode_tier`; the
records beside the index's: ``records.py``'s :func:`~.records.decode_invalidation`,
:func:`~.records.decode_object_meta`, :func:`~.records.decode_generation`); each raises
:class:`~lmcache_p2p.errors.MalformedRecord`, and readers count the reject in a :class:`Rejects` and
skip the record: nothing written into etcd by anyone
can crash an agent or reach an engine as an exception.

Why one file of this size: the etcd layout of version 1 (keys, and the records on the node's lease) in one place, so
that a change to what etcd holds is one diff and one version bump; the standing records (invalidations, object
metas, the generation) are in ``records.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

import msgpack

from ..config import ENGINE_POOLS, valid_engine_url
from ..errors import MalformedRecord
from ..ids import NODE_ID_RE, WIRE_VERSION, NodeId, PeerAddress, TierCode, host_port, is_owner_id
from ..keys import ChunkKey, FingerprintDigest

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

_HEX = 32  # hex chars of a 16-byte digest
_HEX_RE = re.compile(rb"[0-9a-f]{32}")
MAX_RECORD_BYTES = 64 << 10
__all__ = ["SCHEMA_VERSION", "NodeRecord", "Served", "Schema", "Rejects", "tenant_digest"]


class Schema:
    """Key layout for one cluster. All keys are bytes."""

    def __init__(self, cluster: str) -> None:
        self.root = f"/lmcache-p2p/v{SCHEMA_VERSION}/{cluster}/".encode()
        self.config = self.root + b"config"
        self.generation = self.root + b"generation"  # see lmcache_p2p.index.generation
        self.nodes = self.root + b"nodes/"
        self.blocks = self.root + b"blocks/"
        self.invalidations = self.root + b"invalidate/"  # see lmcache_p2p.invalidation
        self.objects = self.root + b"objects/"  # see lmcache_p2p.objects
        self.uploads = self.root + b"uploads/"  # an upload under way: its node, under a lease (objects/tier.py)

    def node(self, node_id: NodeId) -> bytes:
        return self.nodes + node_id.encode()

    def blocks_of(self, fp: FingerprintDigest) -> bytes:
        """Prefix of every block entry of one fingerprint (ends with ``/``)."""
        return self.blocks + fp.hex().encode() + b"/"

    def block(self, fp: FingerprintDigest, key: ChunkKey, node_id: NodeId) -> bytes:
        return b"%s%s/%s/%s" % (self.blocks, fp.hex().encode(), key.hex().encode(), node_id.encode())

    def object_meta(self, fp: FingerprintDigest, key: ChunkKey) -> bytes:
        return b"%s%s/%s" % (self.objects, fp.hex().encode(), key.hex().encode())

    def upload_claim(self, fp: FingerprintDigest, key: ChunkKey) -> bytes:
        return b"%s%s/%s" % (self.uploads, fp.hex().encode(), key.hex().encode())


class Rejects:
    """Counts of records skipped as malformed, by kind; each offending key is logged once.

    Shared by every reader of one agent (thread-safe); the agent exports it as
    ``lmcache_p2p_index_rejected_total{kind}``.
    """

    MAX_LOGGED = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self._logged: set[bytes] = set()

    def add(self, exc: MalformedRecord, key: bytes) -> None:
        with self._lock:
            self.counts[exc.kind] = self.counts.get(exc.kind, 0) + 1
            first = key not in self._logged and len(self._logged) < self.MAX_LOGGED
            if first:
                self._logged.add(key)
        if first:
            log.warning("etcd: skipping %r: %s", key[:200], exc)

    def total(self) -> int:
        return sum(self.counts.values())


# ---- decoding -------------------------------------------------------------------------------
def decode_node_key(prefix_len: int, etcd_key: bytes) -> NodeId:
    try:
        node = etcd_key[prefix_len:].decode()
    except UnicodeDecodeError as exc:
        raise MalformedRecord("node key", f"not UTF-8: {exc}") from exc
    if not NODE_ID_RE.fullmatch(node):
        raise MalformedRecord("node key", f"invalid node id {node[:80]!r}")
    return NodeId(node)


def decode_block_key(prefix_len: int, etcd_key: bytes) -> tuple[ChunkKey, NodeId]:
    """``(chunk key, node)`` of a block entry under a ``blocks_of`` prefix of ``prefix_len``."""
    hex_key = etcd_key[prefix_len:prefix_len + _HEX]
    if not _HEX_RE.fullmatch(hex_key) or etcd_key[prefix_len + _HEX:prefix_len + _HEX + 1] != b"/":
        raise MalformedRecord("block key", "expected <32 lower-case hex>/<node id>")
    try:
        owner = etcd_key[prefix_len + _HEX + 1:].decode()
    except UnicodeDecodeError as exc:
        raise MalformedRecord("block key", f"owner not UTF-8: {exc}") from exc
    if not is_owner_id(owner):
        raise MalformedRecord("block key", f"invalid owner {owner[:80]!r}")
    return ChunkKey(bytes.fromhex(hex_key.decode())), NodeId(owner)


_TIER_BYTES = frozenset(int(t) for t in TierCode)


def decode_tier(value: bytes) -> int:
    if len(value) != 1 or value[0] not in _TIER_BYTES:
        raise MalformedRecord("block value", f"expected one tier byte in {sorted(_TIER_BYTES)}, got {value[:8]!r}")
    return value[0]


def _field(raw: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = dataclasses.MISSING) -> Any:
    value = raw.get(name, default)
    if value is dataclasses.MISSING:
        raise MalformedRecord("node record", f"{name}: missing")
    if value is default:
        return value
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):  # a bool is an int
        raise MalformedRecord("node record", f"{name}: expected {kind}, got {type(value).__name__}")
    return value


def _str_map(raw: dict[str, Any], name: str) -> dict[str, str]:
    value = _field(raw, name, dict, {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise MalformedRecord("node record", f"{name}: expected a map of strings")
    return dict(value)


def _str_tuple(raw: dict[str, Any], name: str) -> tuple[str, ...]:
    value = _field(raw, name, (list, tuple), ())
    if not all(isinstance(v, str) for v in value):
        raise MalformedRecord("node record", f"{name}: expected a list of strings")
    return tuple(value)


def _address(name: str, address: str) -> str:
    if host_port(address) is None:
        raise MalformedRecord("node record", f"addresses.{name}: expected host:port with port in 1-65535, "
                                             f"got {address[:80]!r}")
    return address


@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """What a node serves of one fingerprint: its model, tenant, KV heads and public layout fields."""

    model: str = ""  # the model id ("": not published)
    tenant: str = ""  # tenant_digest(salt), "" without a salt (never the salt)
    heads: tuple[int, int, int] | None = None  # KV heads [h0, h1) of the model's total held (a
    # tensor-parallel rank's); None: every head
    layout: dict[str, Any] = dataclasses.field(default_factory=dict)  # the fingerprint's fields
    # (what ``lookup --explain`` names when two identities differ); a tenant salt becomes its digest

    def __post_init__(self) -> None:
        if "tenant_salt" in self.layout:  # never published: its digest is
            object.__setattr__(self, "layout", _public_layout(self.layout))

    def heads_of(self, num_kv_heads: int) -> tuple[int, int]:
        return (self.heads[0], self.heads[1]) if self.heads is not None else (0, num_kv_heads)

    @property
    def partial_heads(self) -> tuple[int, int, int] | None:
        """``heads`` when it holds some of the model's KV heads but not all (a tensor-parallel rank)."""
        held = self.heads
        return held if held is not None and held[1] - held[0] < held[2] else None


@dataclasses.dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node publishes about itself at ``nodes/<node_id>``."""

    node_id: NodeId
    addresses: dict[str, str]  # transport name -> "host:port"
    transports: tuple[str, ...]
    served: dict[str, Served] = dataclasses.field(default_factory=dict)  # fingerprint hex -> what of it
    capacities: dict[str, int] = dataclasses.field(default_factory=dict)  # tier name -> bytes
    software_version: str = ""
    wire_version: int = WIRE_VERSION
    started_at: float = dataclasses.field(default_factory=time.time)
    metrics_url: str | None = None
    tls: bool = False  # its transfer port speaks only TLS (transfer.tls_*): peers must match to pull
    role: str = "engine"  # "engine" (embedded in vLLM) or "cache" (a cache-only agent: hand-offs go there first)
    free: dict[str, int] = dataclasses.field(default_factory=dict)  # tier name -> free bytes (refreshed, rate-bounded)
    config_revision: int = 0  # etcd revision of the cluster config this node runs (0: none stored / not read)
    # agent config fields where the node does not run the stored cluster config's value: "restart" (it
    # applies at the next start) or "node" (the node's own file, environment or overrides set it)
    config_deviations: dict[str, str] = dataclasses.field(default_factory=dict)
    engine_url: str | None = None  # the engine's OpenAI-compatible base URL (config engine_url), for the router
    engine_pool: str = "mixed"  # the router's pool: mixed, prefill or decode
    # hex HMAC under the router key over the engine's announcement (lmcache_p2p/router/proof.py): routers
    # use an engine from a record only when it holds
    engine_proof: str | None = None

    @property
    def fingerprints(self) -> tuple[str, ...]:
        """The hex digests served, in the order published."""
        return tuple(self.served)

    def peer(self) -> PeerAddress | None:
        """Where this node's transfer server listens (its first address), bound to its node id."""
        parsed = host_port(next(iter(self.addresses.values()), ""))
        return PeerAddress(*parsed, self.node_id) if parsed is not None else None

    def heads_of(self, fp_hex: str, num_kv_heads: int) -> tuple[int, int]:
        """The KV heads this node holds of every chunk of a fingerprint."""
        served = self.served.get(fp_hex)
        return served.heads_of(num_kv_heads) if served is not None else (0, num_kv_heads)

    def pack(self) -> bytes:
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        raw["served"] = {fp: {"model": s.model, "tenant": s.tenant, "heads": None if s.heads is None else list(s.heads),
                              "layout": s.layout} for fp, s in self.served.items()}
        # For nodes of the previous release during a rolling upgrade (their planners read these: without them
        # a TP rank would look like a holder of every head); this release reads ``served`` only.
        raw["fingerprints"] = list(self.served)
        raw["heads"] = {fp: list(s.heads) for fp, s in self.served.items() if s.heads is not None}
        raw["models"] = {fp: s.model for fp, s in self.served.items() if s.model}  # and their CLIs: status,
        raw["tenants"] = {fp: s.tenant for fp, s in self.served.items() if s.tenant}  # invalidate --tenant,
        raw["layouts"] = {fp: s.layout for fp, s in self.served.items() if s.layout}  # lookup --explain
        return msgpack.packb(raw, use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes) -> NodeRecord:
        """Decode and validate every field; MalformedRecord names the first bad one."""
        return decode_node_record(data)


def decode_node_record(data: bytes, node_id: NodeId | None = None) -> NodeRecord:
    """A node record from its msgpack value; ``node_id``, when given, must match the record's."""
    if len(data) > MAX_RECORD_BYTES:
        raise MalformedRecord("node record", f"{len(data)} bytes, limit {MAX_RECORD_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MalformedRecord("node record", f"not msgpack: {exc}") from exc
    if not isinstance(raw, dict):
        raise MalformedRecord("node record", f"expected a map, got {type(raw).__name__}")
    record_id = _field(raw, "node_id", str)
    if not NODE_ID_RE.fullmatch(record_id) or (node_id is not None and record_id != node_id):
        raise MalformedRecord("node record", f"node_id {record_id[:80]!r} does not match its key {node_id!r}")
    addresses = {name: _address(name, a) for name, a in _str_map(raw, "addresses").items()}
    capacities = _sizes(raw, "capacities")
    wire_version = _field(raw, "wire_version", int, WIRE_VERSION)
    started_at = float(_field(raw, "started_at", (int, float), 0.0))
    if not math.isfinite(started_at):
        raise MalformedRecord("node record", "started_at: not finite")
    metrics_url = _field(raw, "metrics_url", (str, type(None)), None)
    return NodeRecord(
        node_id=NodeId(record_id), addresses=addresses, transports=_str_tuple(raw, "transports"),
        served=_served(raw) if "served" in raw else _served_legacy(raw), capacities=capacities,
        software_version=_field(raw, "software_version", str, ""), wire_version=wire_version,
        started_at=started_at, metrics_url=metrics_url, tls=_field(raw, "tls", bool, False), role=_role(raw),
        free=_sizes(raw, "free"), config_revision=_field(raw, "config_revision", int, 0),
        config_deviations=_deviations(raw), engine_url=_engine_url(raw),
        engine_pool=_one_of(raw, "engine_pool", ENGINE_POOLS, "mixed"), engine_proof=_engine_proof(raw))


_FP_HEX_RE = re.compile("[0-9a-f]{32}")


def _served(raw: dict[str, Any]) -> dict[str, Served]:
    """``served``: fingerprint hex -> {model, tenant, heads, layout}."""
    served = _field(raw, "served", dict)
    out: dict[str, Served] = {}
    for fp, entry in served.items():
        if not (isinstance(fp, str) and _FP_HEX_RE.fullmatch(fp)):
            raise MalformedRecord("node record", "served: expected 32 lower-case hex chars per fingerprint")
        if not isinstance(entry, dict):  # fields a newer version adds are ignored, as at the top level
            raise MalformedRecord("node record", f"served.{fp}: expected a map of model, tenant, heads, layout")
        model, tenant = entry.get("model", ""), entry.get("tenant", "")
        if not isinstance(model, str) or not isinstance(tenant, str):
            raise MalformedRecord("node record", f"served.{fp}: model and tenant must be strings")
        heads = entry.get("heads")
        out[fp] = Served(model, tenant_value(tenant) if tenant else "",
                         None if heads is None else _head_range(f"served.{fp}.heads", heads),
                         _layout(f"served.{fp}.layout", entry.get("layout", {})))
    return out


def _served_legacy(raw: dict[str, Any]) -> dict[str, Served]:
    """``served`` from a record an older version wrote (a rolling upgrade): ``fingerprints`` and four
    maps keyed by them (``models``, ``tenants``, ``heads``, ``layouts``), each validated as it was then;
    entries for a fingerprint not in ``fingerprints`` are dropped."""
    fingerprints = _str_tuple(raw, "fingerprints")
    if not all(_FP_HEX_RE.fullmatch(fp) for fp in fingerprints):
        raise MalformedRecord("node record", "fingerprints: expected 32 lower-case hex chars each")
    models = _str_map(raw, "models")
    tenants = {fp: tenant_value(value) for fp, value in _str_map(raw, "tenants").items()}
    heads = _field(raw, "heads", dict, {})
    if not all(isinstance(fp, str) for fp in heads):
        raise MalformedRecord("node record", "heads: expected fingerprint hex -> [first, end, total] KV heads")
    held = {fp: _head_range("heads", h) for fp, h in heads.items()}
    layouts = _field(raw, "layouts", dict, {})
    if not all(isinstance(fp, str) for fp in layouts):
        raise MalformedRecord("node record", "layouts: expected fingerprint hex -> {field: str | int}")
    fields = {fp: _layout("layouts", f) for fp, f in layouts.items()}
    return {fp: Served(models.get(fp, ""), tenants.get(fp, ""), held.get(fp), fields.get(fp, {}))
            for fp in fingerprints}


def _head_range(name: str, held: Any) -> tuple[int, int, int]:
    if not (isinstance(held, list) and len(held) == 3
            and all(isinstance(h, int) and not isinstance(h, bool) for h in held)
            and 0 <= held[0] < held[1] <= held[2] <= 0xFFFF):
        raise MalformedRecord("node record", f"{name}: expected [first, end, total] KV heads")
    return held[0], held[1], held[2]


def _layout(name: str, fields: Any) -> dict[str, Any]:
    if not (isinstance(fields, dict) and len(fields) <= 32
            and all(isinstance(k, str) and isinstance(v, (str, int)) for k, v in fields.items())):
        raise MalformedRecord("node record", f"{name}: expected {{field: str | int}}")
    return dict(fields)


def _deviations(raw: dict[str, Any]) -> dict[str, str]:
    deviations = _str_map(raw, "config_deviations")
    if len(deviations) > 64 or not all(v in ("restart", "node") for v in deviations.values()):
        raise MalformedRecord("node record", "config_deviations: expected at most 64 field -> 'restart' | 'node'")
    return deviations


def _role(raw: dict[str, Any]) -> str:
    return _one_of(raw, "role", ("engine", "cache"), "engine")


def _one_of(raw: dict[str, Any], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = _field(raw, name, str, default)
    if value not in allowed:
        raise MalformedRecord("node record", f"{name}: expected one of {allowed}, got {value[:20]!r}")
    return value


# The two forms of an engine proof (router/proof.py): keyed, and signed with the node's transfer certificate
KEYED_PROOF_RE = re.compile("[0-9a-f]{64}")
SIGNED_PROOF_RE = re.compile(r"x509:[A-Za-z0-9_-]{64,8192}\.[A-Za-z0-9_-]{32,1024}")


def _engine_proof(raw: dict[str, Any]) -> str | None:
    proof = _field(raw, "engine_proof", (str, type(None)), None)
    if proof is not None and not (KEYED_PROOF_RE.fullmatch(proof) or SIGNED_PROOF_RE.fullmatch(proof)):
        raise MalformedRecord("node record", "engine_proof: expected 64 lower-case hex chars, or x509:<certificate>."
                                             "<signature> in base64url")
    return proof


def _engine_url(raw: dict[str, Any]) -> str | None:
    url = _field(raw, "engine_url", (str, type(None)), None)
    if url is not None and not valid_engine_url(url):
        raise MalformedRecord("node record", f"engine_url: not an http(s) base URL: {url[:80]!r}")
    return url


def _sizes(raw: dict[str, Any], name: str) -> dict[str, int]:
    sizes = _field(raw, name, dict, {})
    if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for k, v in sizes.items()):
        raise MalformedRecord("node record", f"{name}: expected tier name -> bytes >= 0")
    return dict(sizes)


# ---- tenants ---------------------------------------------------------------------------------
TENANT_DOMAIN = b"lmcache-p2p tenant\x00"
_TENANT_DIGEST_RE = re.compile("[0-9a-f]{64}")


def tenant_digest(salt: str) -> str:
    """The one-way digest of a tenant salt (hex SHA-256, domain-separated): what node records,
    invalidations and tools carry. A salt is only as hidden as it is hard to guess."""
    return hashlib.sha256(TENANT_DOMAIN + salt.encode()).hexdigest()


def tenant_value(value: str) -> str:
    """A tenant read back from etcd: a digest as it is; a raw salt (an older version wrote it) as its
    digest. A raw salt that is itself 64 lower-case hex characters is taken for a digest."""
    return value if _TENANT_DIGEST_RE.fullmatch(value) else tenant_digest(value)


def _public_layout(fields: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in fields.items() if k != "tenant_salt"}
    salt = fields["tenant_salt"]
    out["tenant"] = tenant_digest(str(salt)) if salt else ""
    return out


def covers(ranges: Iterable[tuple[int, int]], want: tuple[int, int]) -> bool:
    """Whether the union of half-open ``ranges`` contains ``want``."""
    pos = want[0]
    for lo, hi in sorted(ranges):
        if lo > pos:
            break
        pos = max(pos, hi)
        if pos >= want[1]:
            return True
    return pos >= want[1]
