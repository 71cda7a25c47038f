"""The seam between the agent / connector and the mesh index.

Two implementations: :class:`~lmcache_p2p.index.etcd_index.EtcdBlockIndex` (etcd: session,
publisher, mirrors) and :class:`~lmcache_p2p.testing.memory_index.MemoryIndex` (in-process fake for unit
tests). Every method is thread-safe and returns without network I/O: writes are queued and
published in the background, reads probe an in-memory mirror; with ``etcd.index: lookup`` a read of
keys not asked lately makes one bounded etcd round trip first (``owners(..., ask=False)`` never does).
The index is a hint: an owner may have evicted a chunk since it was announced, and the pull protocol
confirms with the owner.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from ..ids import NodeId
from ..keys import ChunkKey, FingerprintDigest
from .schema import NodeRecord

if TYPE_CHECKING:
    from .client import EtcdClient
    from .mirror import Mirror


class BlockIndex(Protocol):
    @property
    def node_id(self) -> NodeId: ...

    def add_many(self, fp: FingerprintDigest, keys: Iterable[ChunkKey], tier: int) -> None:
        """Announce that this node holds ``keys`` in ``tier`` (a tier byte, 0 = fastest)."""

    def remove_many(self, fp: FingerprintDigest, keys: Iterable[ChunkKey]) -> None:
        """Withdraw ``keys`` (evicted); unknown keys are ignored."""

    def set_record(self, record: NodeRecord) -> None:
        """Replace this node's record (addresses, fingerprints served, capacities)."""

    def lookup(self, fp: FingerprintDigest, keys: Sequence[ChunkKey]) -> list[frozenset[NodeId]]:
        """Owners of each key, this node included."""

    def owners(self, fp: FingerprintDigest, keys: Sequence[ChunkKey], *, ask: bool = True) -> list[dict[NodeId, int]]:
        """Per key, the nodes holding it (this node included) with their tier byte (lower is faster).
        ``ask`` False: only what is known here now, whatever the index mode (callers holding locks)."""

    def longest_prefix(self, fp: FingerprintDigest, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys are held by at least one node."""

    def nodes(self) -> dict[NodeId, NodeRecord]:
        """Live nodes' records."""

    def close(self) -> None:
        """Withdraw everything this node announced, at once, and stop."""

    # What an agent reads of the index's health and its etcd side (an in-memory index: always online, no etcd)
    @property
    def online(self) -> bool:
        """Registered under a live lease and every mirror synced: the node is part of the mesh."""

    @property
    def client(self) -> EtcdClient | None:
        """The etcd connection, where there is one: invalidations, the cluster config and the gate watch it."""

    def mirror(self, fp: FingerprintDigest) -> Mirror | None:
        """The watch-fed mirror of ``fp``'s block entries (None: nothing to wait for, e.g. in memory)."""

    def stats(self) -> dict[str, float]:
        """Gauges for the agent's metrics (``index_chunks``, ``publish_pending``, ``publish_lag_s``, ``lease_up``,
        ``degraded``, ...); an index without etcd may return none."""

    def faults(self) -> dict[str, int]:
        """Control-plane faults met and recovered from so far, by kind (running totals)."""
