"""Quarantine: owners whose chunks are wrong in meaning (the canary found), obeyed by every planner.

    quarantine/<node_id>   msgpack {by, key, distance, reason, at}   until removed
                           (``lmcache-p2p verify --release NODE``) or its lease lapses
                           (``canary.quarantine_ttl_s`` after the last mismatch that wrote it)

A checksum proves a chunk's bytes are the bytes its owner computed, not that they are the KV this
model computes for these tokens: an owner running other weights under the same identity (an
identity pinned by name, a bad copy, a forger) serves verified garbage. The canary (``canary.py``)
recomputes sampled chunks with the engine itself; a mismatch writes this record. Every planner
(each worker's agent and each scheduler side) follows the prefix with one
:class:`~lmcache_p2p.index.watch.ResumableWatch` and never counts or pulls a chunk from a
quarantined owner, nor a chunk it computed that another node holds (a copy pulled from it: its
header's origin names the quarantined node's engine): every agent drops such copies when it learns of the
record and refuses them while it stands, so the holders, healthy, lose only those copies and keep
serving the rest. ``lmcache-p2p status`` and ``verify`` list the records. A malformed record is
skipped and counted like every other record; with etcd unreachable the last set read stands.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

import msgpack

from ..errors import IndexError_, MalformedRecord
from ..ids import NodeDigest, NodeId, origin_of
from .client import EtcdClient, KeyValue, WatchEvent, op_delete
from .schema import Rejects, Schema
from .watch import ResumableWatch

log = logging.getLogger(__name__)
KIND = "quarantine"


def prefix(schema: Schema) -> bytes:
    return schema.root + b"quarantine/"


@dataclasses.dataclass(frozen=True, slots=True)
class QuarantineRecord:
    node: NodeId  # the owner that served the wrong chunk
    by: str  # the node whose canary found it
    key: str  # hex of the chunk key compared
    distance: float  # relative L2 distance between the owner's KV and the recomputed KV
    reason: str = "kv_mismatch"
    at: float = dataclasses.field(default_factory=time.time)

    def pack(self) -> bytes:
        return msgpack.packb({"by": self.by, "key": self.key, "distance": self.distance, "reason": self.reason,
                              "at": self.at}, use_bin_type=True)


def decode(etcd_key: bytes, data: bytes, *, prefix_len: int) -> QuarantineRecord:
    """Validate one record; MalformedRecord names what is wrong."""
    try:
        node = etcd_key[prefix_len:].decode()
        fields = msgpack.unpackb(data, raw=False)
    except (UnicodeDecodeError, ValueError, msgpack.UnpackException) as exc:
        raise MalformedRecord(KIND, f"undecodable: {exc}") from exc
    if not node or "/" in node or not isinstance(fields, dict):
        raise MalformedRecord(KIND, "needs a node id and a map")
    by, key, distance, reason, at = (fields.get(f) for f in ("by", "key", "distance", "reason", "at"))
    if not (isinstance(by, str) and isinstance(key, str) and isinstance(reason, str)):
        raise MalformedRecord(KIND, "by, key and reason must be strings")
    if not (isinstance(distance, int | float) and isinstance(at, int | float) and math.isfinite(at)):
        raise MalformedRecord(KIND, "distance and at must be numbers")
    return QuarantineRecord(NodeId(node), by, key, float(distance), reason, float(at))


async def write(client: EtcdClient, schema: Schema, record: QuarantineRecord, *, ttl_s: int | None = None,
                lease: int = 0) -> int:
    """Quarantine ``record.node`` (on a new lease of ``ttl_s`` if given, else on ``lease``); the write's revision."""
    if ttl_s is not None:
        lease = (await client.grant(ttl_s))[0]
    return await client.put(prefix(schema) + record.node.encode(), record.pack(), lease=lease)


async def release(client: EtcdClient, schema: Schema, node: str) -> bool:
    """Lift ``node``'s quarantine; False if it had none."""
    kv, _ = await client.get(prefix(schema) + node.encode())
    if kv is None:
        return False
    await client.txn([], [op_delete(prefix(schema) + node.encode())])
    return True


async def read_all(client: EtcdClient, schema: Schema, rejects: Rejects | None = None) -> list[QuarantineRecord]:
    kvs, _ = await client.get_prefix(prefix(schema))
    return _decode_all(kvs, len(prefix(schema)), rejects or Rejects())


def _decode_all(kvs: Sequence[KeyValue], prefix_len: int, rejects: Rejects) -> list[QuarantineRecord]:
    out = []
    for kv in kvs:
        try:
            out.append(decode(kv.key, kv.value, prefix_len=prefix_len))
        except MalformedRecord as exc:
            rejects.add(exc, kv.key)
    return out


class Quarantine:
    """The quarantined owners, followed on the caller's loop; ``blocked`` answers on any thread."""

    def __init__(self, client: EtcdClient, schema: Schema, rejects: Rejects | None = None, *,
                 on_quarantined: Callable[[frozenset[NodeDigest]], None] = lambda _origins: None) -> None:
        """``on_quarantined`` is called on the loop with the origins of every quarantined node each time
        a node is newly quarantined (the agent drops the copies it holds of their chunks)."""
        self._prefix = prefix(schema)
        self._client, self._schema = client, schema
        self.rejects = rejects if rejects is not None else Rejects()
        self._records: dict[NodeId, QuarantineRecord] = {}  # replaced, never mutated: readers on any thread
        self._origins: frozenset[NodeDigest] = frozenset()  # origin_of each quarantined node (its engine), likewise
        self._on_quarantined = on_quarantined
        self.leases: dict[NodeId, int] = {}  # the live lease of each record this instance wrote with a TTL
        self._watch = ResumableWatch(client, self._prefix, load=self._load, apply=self._apply, name="quarantine")

    def blocked(self, node: str) -> bool:
        return node in self._records

    def blocks_origin(self, origin: bytes) -> bool:
        """A chunk whose header names ``origin`` was computed by a quarantined node."""
        return origin in self._origins

    def _set(self, records: dict[NodeId, QuarantineRecord]) -> None:
        new = records.keys() - self._records.keys()
        self._records = records
        self._origins = frozenset(origin_of(n) for n in records)
        if new:
            self._on_quarantined(self._origins)

    async def add(self, record: QuarantineRecord, ttl_s: float | None = None) -> int:
        """Quarantine ``record.node``: obeyed here at once, by every other planner when etcd has it; for
        ``ttl_s`` seconds (a lease: each new mismatch writes a new record, renewing it), or standing (None)."""
        self._set({**self._records, record.node: record})
        if ttl_s is None:
            return await write(self._client, self._schema, record)
        # a new lease per write (its TTL whole again), the last one this node wrote for it revoked: one live
        # lease per node quarantined, however many mismatches confirm it
        lease = (await self._client.grant(math.ceil(ttl_s)))[0]
        revision = await write(self._client, self._schema, record, lease=lease)
        old, self.leases[record.node] = self.leases.get(record.node), lease
        if old is not None:
            try:
                await self._client.revoke(old)  # it holds no key now: the record moved to the new lease
            except IndexError_ as exc:  # lapsed already, or etcd unreachable: it expires on its own
                log.debug("revoking the quarantine lease %x of %s: %s", old, record.node, exc)
        return revision

    def records(self) -> list[QuarantineRecord]:
        return list(self._records.values())

    @property
    def revision(self) -> int:
        return self._watch.revision

    async def start(self, wait_s: float) -> bool:
        """Follow the prefix; waits up to ``wait_s`` for the first read (False: etcd did not answer)."""
        self._watch.start()
        return await self._watch.wait_synced(wait_s)

    async def stop(self) -> None:
        await self._watch.stop()

    def _load(self, kvs: list[KeyValue], _revision: int) -> None:
        self._set({r.node: r for r in _decode_all(kvs, len(self._prefix), self.rejects)})

    def _apply(self, events: Sequence[WatchEvent]) -> None:
        records = dict(self._records)
        for ev in events:
            node = NodeId(ev.key[len(self._prefix):].decode(errors="replace"))
            if ev.deleted:
                if records.pop(node, None) is not None:
                    log.warning("quarantine of %s lifted", node)
                continue
            try:
                record = decode(ev.key, ev.value, prefix_len=len(self._prefix))
            except MalformedRecord as exc:
                self.rejects.add(exc, ev.key)
                continue
            if record.node not in records:
                log.error("owner %s quarantined by %s: its chunk %s differs from the recomputed KV (distance %.3g)",
                          record.node, record.by, record.key[:16], record.distance)
            records[record.node] = record
        self._set(records)
