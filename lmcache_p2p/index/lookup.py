"""The index without a block watch: a request's owners are asked of etcd when it arrives (``etcd.index: lookup``).

A :class:`~.mirror.Mirror` on every node receives every chunk event of the fleet: deliveries grow with
nodes x events, and each node spends CPU applying the whole fleet's churn (``bench scale`` measures both
and names the first limit at 1,000 nodes). Here only the node records are followed; the block entries
of the keys a request needs are read in one read-only txn (``EtcdClient.get_prefixes``: one round trip
to any member, serializable) and kept ``lookup_cache_s``, so the scheduler's lookup, the worker's plan
and the score of one request cost one read between them. Memory is the keys asked lately, not the fleet's.

The readers keep the :class:`~.protocol.BlockIndex` contract (no network I/O): they answer from what was
asked. :meth:`LookupMirror.prefetch` is the one call that reads, bounded by ``lookup_timeout_s``: called
on the loop's own thread (where a blocking read would deadlock) or when etcd is slow or down it leaves the
answers as they are, and a key never asked has no owners: a miss, computed by the engine, never an error.
Trade-offs against the watch: a read on the request path (measured: ``bench scale`` lookup p50/p99), no
owner-change events (``lmcache-p2p events`` needs the watch), and an eviction's check whether a chunk is
held elsewhere sees only keys asked lately (unknown: treated as a sole copy, handed off as such).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ..aio import LoopThread
from ..errors import MalformedRecord
from ..ids import NodeId
from ..keys import ChunkKey, FingerprintDigest
from .client import EtcdClient
from .mirror import EMPTY, Mirror, Owners
from .publisher import TXN_MAX_OPS
from .schema import Rejects, Schema, decode_block_key, decode_tier

log = logging.getLogger(__name__)

MAX_CACHED = 1 << 17  # keys whose owners are remembered (LRU): ~130k chunks, ~30 MB at most


class LookupMirror(Mirror):
    reads_etcd = True

    def __init__(self, client: EtcdClient, schema: Schema, fp: FingerprintDigest, loop: LoopThread, *,
                 cache_s: float, timeout_s: float, on_change: Callable[[], None] | None = None,
                 rejects: Rejects | None = None) -> None:
        super().__init__(client, schema, fp, on_change=on_change, rejects=rejects, follow_blocks=False)
        self._client = client
        self._loop = loop
        self._cache_s = cache_s
        self._timeout_s = timeout_s
        # key -> (monotonic time read, etcd revision read at, owners or None: nobody). Written on the loop
        # under the lock; readers probe it without one (single C-level dict operations under the GIL),
        # iterations take the lock.
        self._asked: OrderedDict[ChunkKey, tuple[float, int, Owners | None]] = OrderedDict()
        self._lock = threading.Lock()
        self._read_revision = 0
        self._quiet_until = 0.0  # after a failed read: answer from what is known until then
        self.lookups_total = 0
        self.lookup_failures = 0

    # ---- the one reading call ------------------------------------------------------------------
    def prefetch(self, keys: Sequence[ChunkKey], min_revision: int = 0) -> None:
        """Read the owners of ``keys`` not asked within ``lookup_cache_s``, and of those last read below
        ``min_revision`` (a scheduler or a router saw that state: read linearizably). Bounded by
        ``lookup_timeout_s``; after a failed read, answers come from what is known for ``lookup_cache_s``
        (etcd unreachable must not cost every scheduler step a timeout). Never raises."""
        now = time.monotonic()
        if self._loop.in_loop_thread or not keys or now < self._quiet_until:
            return  # on the loop, or etcd just failed us: answer from what is known
        with self._lock:
            asked = self._asked
            behind = [k for k in dict.fromkeys(keys) if (e := asked.get(k)) is not None and e[1] < min_revision]
            want = [k for k in dict.fromkeys(keys)
                    if (e := asked.get(k)) is None or now - e[0] > self._cache_s or e[1] < min_revision]
        if not want:
            return
        self.lookups_total += 1
        try:
            self._loop.run(self._read(want, linearizable=bool(behind) or min_revision > self._read_revision),
                           self._timeout_s)
        except (Exception, concurrent.futures.CancelledError) as exc:  # timeout, etcd down, the loop stopping
            self.lookup_failures += 1
            self._quiet_until = time.monotonic() + max(self._cache_s, self._timeout_s)
            log.debug("lookup of %d keys failed: %s: %s", len(want), type(exc).__name__, exc)

    async def _read(self, keys: list[ChunkKey], linearizable: bool) -> None:
        prefixes = [self._blocks_prefix + k.hex().encode() + b"/" for k in keys]
        batches = [prefixes[i : i + TXN_MAX_OPS] for i in range(0, len(prefixes), TXN_MAX_OPS)]  # etcd's txn limit
        async with asyncio.timeout(self._timeout_s):
            answers = await asyncio.gather(*(self._client.get_prefixes(b, serializable=not linearizable)
                                             for b in batches))
        found = [kvs for batch, _ in answers for kvs in batch]
        revision = min(rev for _, rev in answers)
        now = time.monotonic()
        entries: list[tuple[ChunkKey, tuple[float, int, Owners | None]]] = []
        for key, kvs in zip(keys, found, strict=True):
            tiers: dict[NodeId, int] = {}
            for kv in kvs:
                try:
                    chunk, node = decode_block_key(self._plen, kv.key)
                    tier = decode_tier(kv.value)
                except MalformedRecord as exc:
                    self.rejects.add(exc, kv.key)
                    continue
                if chunk == key:
                    tiers[node] = tier
            entries.append((key, (now, revision, self._interned(tuple(sorted(tiers.items()))) if tiers else None)))
        with self._lock:
            asked = self._asked
            for key, entry in entries:
                asked[key] = entry
                asked.move_to_end(key)
            while len(asked) > MAX_CACHED:
                asked.popitem(last=False)
            self._read_revision = max(self._read_revision, revision)
        self._notify()

    # ---- readers: any thread, no I/O ---------------------------------------------------------
    def _get(self, key: ChunkKey) -> Owners | None:
        entry = self._asked.get(key)
        return entry[2] if entry is not None else None

    def lookup(self, keys: Sequence[ChunkKey]) -> list[frozenset[NodeId]]:
        return [o.nodes if (o := self._get(k)) is not None else EMPTY for k in keys]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._get(ChunkKey(key)) is not None

    def longest_prefix(self, keys: Sequence[ChunkKey]) -> int:
        for i, k in enumerate(keys):
            if self._get(k) is None:
                return i
        return len(keys)

    def owners(self, key: ChunkKey) -> dict[NodeId, int]:
        o = self._get(key)
        return dict(o.tiers) if o is not None else {}

    def snapshot(self) -> dict[ChunkKey, dict[NodeId, int]]:
        """What was asked lately (not the fleet's index: that is what this mode does not keep)."""
        with self._lock:
            items = list(self._asked.items())
        return {k: dict(o.tiers) for k, (_, _, o) in items if o is not None}

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for _, _, o in self._asked.values() if o is not None)

    @property
    def blocks_revision(self) -> int:
        """The revision of the latest read (the scheduler passes it on: its worker re-reads the keys it
        last read below it)."""
        return self._read_revision

    @property
    def revision(self) -> int:
        return self._read_revision

    def memory_bytes(self) -> int:
        with self._lock:
            items = list(self._asked.items())
        return sys.getsizeof(self._asked) + sum(sys.getsizeof(k) + sys.getsizeof(e) for k, e in items)
