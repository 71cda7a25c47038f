"""In-memory :class:`~lmcache_p2p.index.protocol.BlockIndex` for fast unit tests.

Several :class:`MemoryIndex` objects that share one :class:`MemoryMesh` see each other's
entries, as agents sharing an etcd cluster would, but changes are visible at once and nothing
expires by itself: call :meth:`MemoryMesh.expire` to simulate a lost lease.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from ..ids import NodeId
from ..index.schema import NodeRecord
from ..keys import ChunkKey, FingerprintDigest

_EMPTY: frozenset[NodeId] = frozenset()


class MemoryMesh:
    """The shared state: ``fp -> key -> {node: tier}`` and node records."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocks: dict[FingerprintDigest, dict[ChunkKey, dict[NodeId, int]]] = {}
        self.records: dict[NodeId, NodeRecord] = {}

    def expire(self, node_id: NodeId) -> None:
        """Drop everything ``node_id`` announced, as when its lease expires."""
        with self.lock:
            self.records.pop(node_id, None)
            for keys in self.blocks.values():
                for key in [k for k, owners in keys.items() if node_id in owners]:
                    del keys[key][node_id]
                    if not keys[key]:
                        del keys[key]


class MemoryIndex:
    def __init__(self, mesh: MemoryMesh, record: NodeRecord) -> None:
        self._mesh = mesh
        self._node = record.node_id
        with mesh.lock:
            mesh.records[record.node_id] = record

    @property
    def node_id(self) -> NodeId:
        return self._node

    def add(self, fp: FingerprintDigest, key: ChunkKey, tier: int) -> None:
        self.add_many(fp, (key,), tier)

    def add_many(self, fp: FingerprintDigest, keys: Iterable[ChunkKey], tier: int) -> None:
        if not 0 <= tier <= 255:
            raise ValueError(f"tier must be in [0, 255], got {tier}")
        with self._mesh.lock:
            table = self._mesh.blocks.setdefault(fp, {})
            for key in keys:
                table.setdefault(key, {})[self._node] = tier

    def remove(self, fp: FingerprintDigest, key: ChunkKey) -> None:
        self.remove_many(fp, (key,))

    def remove_many(self, fp: FingerprintDigest, keys: Iterable[ChunkKey]) -> None:
        with self._mesh.lock:
            table = self._mesh.blocks.get(fp, {})
            for key in keys:
                owners = table.get(key)
                if owners is not None and owners.pop(self._node, None) is not None and not owners:
                    del table[key]

    def set_record(self, record: NodeRecord) -> None:
        if record.node_id != self._node:
            raise ValueError(f"record is for {record.node_id!r}, this index is {self._node!r}")
        with self._mesh.lock:
            self._mesh.records[self._node] = record

    def lookup(self, fp: FingerprintDigest, keys: Sequence[ChunkKey]) -> list[frozenset[NodeId]]:
        with self._mesh.lock:
            table = self._mesh.blocks.get(fp, {})
            return [frozenset(table[k]) if k in table else _EMPTY for k in keys]

    def longest_prefix(self, fp: FingerprintDigest, keys: Sequence[ChunkKey]) -> int:
        with self._mesh.lock:
            table = self._mesh.blocks.get(fp, {})
            for i, k in enumerate(keys):
                if k not in table:
                    return i
            return len(keys)

    def owners(self, fp: FingerprintDigest, keys: Sequence[ChunkKey], *, ask: bool = True) -> list[dict[NodeId, int]]:
        with self._mesh.lock:
            held = self._mesh.blocks.get(fp, {})
            return [dict(held.get(k, {})) for k in keys]

    def nodes(self) -> dict[NodeId, NodeRecord]:
        with self._mesh.lock:
            return dict(self._mesh.records)

    def close(self) -> None:
        self._mesh.expire(self._node)

    # no etcd: always part of the mesh, nothing to wait for, nothing to count
    online = True
    client = None

    def mirror(self, fp: FingerprintDigest) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {}

    def faults(self) -> dict[str, int]:
        return {}
