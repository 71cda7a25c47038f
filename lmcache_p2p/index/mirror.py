"""An in-memory view of ``nodes/`` and ``blocks/<fp>/``, each fed by one :class:`ResumableWatch`.

Each prefix is read at a revision R (paged), then followed from R+1; a broken stream resumes
from the last revision seen (progress notifications advance it on a quiet prefix), and history
that is gone (compaction, a restored etcd) means one resync that swaps the new map in at once.
Until the first sync (etcd down at start) the mirror is empty and readers simply see no owners.

Every key and value goes through the schema's decoders: a malformed one is skipped and counted
in the shared :class:`~lmcache_p2p.index.schema.Rejects`, never raised.

Readers (any thread) never touch the network and take no lock: ``lookup`` and
``longest_prefix`` probe a dict whose reference is swapped atomically on resync; the loop is the
only writer. Owner sets are interned, so a chunk held by the usual one or two nodes costs a dict
slot and its 16-byte key.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence

from ..errors import MalformedRecord
from ..ids import NodeId
from ..keys import ChunkKey, FingerprintDigest
from .client import EtcdClient, KeyValue, WatchEvent
from .schema import (
    NodeRecord,
    Rejects,
    Schema,
    decode_block_key,
    decode_node_key,
    decode_node_record,
    decode_tier,
)
from .watch import ResumableWatch

log = logging.getLogger(__name__)

EMPTY: frozenset[NodeId] = frozenset()


class Owners:
    """Interned owner set of a chunk: node ids and the tier byte each holds it in."""

    __slots__ = ("nodes", "tiers")

    def __init__(self, tiers: tuple[tuple[NodeId, int], ...]) -> None:
        self.tiers = tiers
        self.nodes = frozenset(n for n, _ in tiers)


class Mirror:
    reads_etcd = False  # readers answer from the watch-fed map; LookupMirror reads etcd in prefetch

    def __init__(self, client: EtcdClient, schema: Schema, fp: FingerprintDigest,
                 on_change: Callable[[], None] | None = None, rejects: Rejects | None = None,
                 follow_blocks: bool = True) -> None:
        """``follow_blocks`` False: only the node records are followed (:class:`~.lookup.LookupMirror`
        asks for block entries instead)."""
        self.fp = fp
        self._nodes_prefix = schema.nodes
        self._blocks_prefix = schema.blocks_of(fp)
        self._plen = len(self._blocks_prefix)
        self._nlen = len(self._nodes_prefix)
        self._blocks: dict[ChunkKey, Owners] = {}
        self._nodes: dict[NodeId, NodeRecord] = {}
        self._intern: dict[tuple[tuple[NodeId, int], ...], Owners] = {}
        self._on_change = on_change
        # Every owner change, (node, key, old tier, new tier; None: not held), on the loop: must not block.
        self.on_block: Callable[[NodeId, ChunkKey, int | None, int | None], None] | None = None
        self.rejects = rejects if rejects is not None else Rejects()
        self._changed = threading.Condition()
        short = fp.hex()[:8]
        self._node_watch = ResumableWatch(client, self._nodes_prefix, load=self._load_nodes, apply=self._apply_nodes,
                                          name=f"nodes-{short}")
        self._block_watch = None if not follow_blocks else ResumableWatch(
            client, self._blocks_prefix, load=self._load_blocks, apply=self._apply_blocks, name=f"blocks-{short}")
        self.events_total = 0

    def faults(self) -> dict[str, int]:
        """Control-plane faults its watches met so far (``lmcache_p2p_etcd_faults_total{kind}``)."""
        watches = self._watches
        return {"watch_interrupted": sum(w.interruptions for w in watches),
                "watch_resynced": sum(max(w.resyncs - 1, 0) for w in watches),  # after the first sync
                "watch_member_behind": sum(w.lagging_members for w in watches),  # retried, no resync
                "watch_callback_failed": sum(w.callback_errors for w in watches)}

    def prefetch(self, keys: Sequence[ChunkKey], min_revision: int = 0) -> None:
        """Make the readers' answers for ``keys`` current (any thread but the loop's). Nothing to do
        here: the watch keeps every key current; :class:`~.lookup.LookupMirror` asks etcd."""

    # ---- readers: any thread, no I/O ---------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> list[frozenset[NodeId]]:
        """Owners of each key (empty when nobody announced it)."""
        get = self._blocks.get
        return [o.nodes if (o := get(k)) is not None else EMPTY for k in keys]

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def longest_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys have at least one owner."""
        blocks = self._blocks
        for i, k in enumerate(keys):
            if k not in blocks:
                return i
        return len(keys)

    def owners(self, key: ChunkKey) -> dict[NodeId, int]:
        """Owner -> tier byte of one key."""
        o = self._blocks.get(key)
        return dict(o.tiers) if o is not None else {}

    def nodes(self) -> dict[NodeId, NodeRecord]:
        return dict(self._nodes)

    def snapshot(self) -> dict[ChunkKey, dict[NodeId, int]]:
        return {k: dict(o.tiers) for k, o in list(self._blocks.items())}

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def _watches(self) -> tuple[ResumableWatch, ...]:
        return (self._node_watch,) if self._block_watch is None else (self._node_watch, self._block_watch)

    @property
    def revision(self) -> int:
        return min(w.revision for w in self._watches)

    @property
    def blocks_revision(self) -> int:
        """How far the block entries are followed: every chunk announced at or before it is here."""
        return self._watches[-1].revision

    @property
    def resyncs(self) -> int:
        return self._watches[-1].resyncs

    @property
    def synced(self) -> bool:
        """Both prefixes have been read at least once (etcd answered since start)."""
        return all(w.synced.is_set() for w in self._watches)

    @property
    def connected(self) -> bool:
        """Both watches are following etcd right now."""
        return all(w.connected for w in self._watches)

    def memory_bytes(self) -> int:
        """Estimate of the block map's memory: the dict, its keys and the interned owner sets."""
        blocks = self._blocks
        size = sys.getsizeof(blocks) + sum(sys.getsizeof(k) for k in blocks)
        for o in list(self._intern.values()):
            size += sys.getsizeof(o) + sys.getsizeof(o.tiers) + sys.getsizeof(o.nodes)
        return size

    def wait_for(self, predicate: Callable[[Mirror], bool], timeout: float) -> bool:
        """Block (not on the loop thread) until ``predicate(self)`` holds; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.1))
        return True

    # ---- loop side ---------------------------------------------------------------------------
    async def start(self, wait_s: float) -> bool:
        """Start following; wait up to ``wait_s`` for the first sync. False: etcd did not answer in
        time, and the mirror fills in the background when it does."""
        for watch in self._watches:
            watch.start()
        nodes_ok = await self._node_watch.wait_synced(wait_s)
        if self._block_watch is None:
            return nodes_ok
        return await self._block_watch.wait_synced(wait_s if nodes_ok else 0.0) and nodes_ok

    async def stop(self) -> None:
        for watch in self._watches:
            await watch.stop()

    def _load_nodes(self, kvs: list[KeyValue], revision: int) -> None:
        nodes: dict[NodeId, NodeRecord] = {}
        for kv in kvs:
            record = self._node(kv.key, kv.value)
            if record is not None:
                nodes[record.node_id] = record
        self._nodes = nodes
        log.info("mirror %s: %d nodes at rev %d", self.fp.hex()[:8], len(nodes), revision)
        self._notify()

    def _load_blocks(self, kvs: list[KeyValue], revision: int) -> None:
        self._intern = {}
        new_blocks: dict[ChunkKey, dict[NodeId, int]] = {}
        for kv in kvs:
            entry = self._block(kv.key, kv.value)
            if entry is not None:
                new_blocks.setdefault(entry[0], {})[entry[1]] = entry[2]
        old_blocks = self._blocks
        self._blocks = {k: self._interned(tuple(sorted(v.items()))) for k, v in new_blocks.items()}
        if self.on_block is not None:  # a resync: report what changed
            for key in old_blocks.keys() | self._blocks.keys():
                before = dict(old_blocks[key].tiers) if key in old_blocks else {}
                after = new_blocks.get(key, {})
                for node in before.keys() | after.keys():
                    if before.get(node) != after.get(node):
                        self._report(node, key, before.get(node), after.get(node))
        log.info("mirror %s: synced %d chunks at rev %d", self.fp.hex()[:8], len(self._blocks), revision)
        self._notify()

    def _apply_nodes(self, events: Sequence[WatchEvent]) -> None:
        for ev in events:
            if ev.deleted:
                try:
                    self._nodes.pop(decode_node_key(self._nlen, ev.key), None)
                except MalformedRecord:
                    pass  # never admitted
                continue
            record = self._node(ev.key, ev.value)
            if record is not None:
                self._nodes[record.node_id] = record
        self.events_total += len(events)
        self._notify()

    def _apply_blocks(self, events: Sequence[WatchEvent]) -> None:
        for ev in events:
            if ev.deleted:
                with contextlib.suppress(MalformedRecord):  # a malformed key was never admitted
                    self._set_owner(*decode_block_key(self._plen, ev.key), None)
                continue
            entry = self._block(ev.key, ev.value)
            if entry is not None:
                self._set_owner(*entry)
        self.events_total += len(events)
        self._notify()

    def _node(self, key: bytes, value: bytes) -> NodeRecord | None:
        try:
            return decode_node_record(value, decode_node_key(self._nlen, key))
        except MalformedRecord as exc:
            self.rejects.add(exc, key)
            return None

    def _block(self, key: bytes, value: bytes) -> tuple[ChunkKey, NodeId, int] | None:
        try:
            chunk, node = decode_block_key(self._plen, key)
            return chunk, node, decode_tier(value)
        except MalformedRecord as exc:
            self.rejects.add(exc, key)
            return None

    def _set_owner(self, key: ChunkKey, node: NodeId, tier: int | None) -> None:
        cur = self._blocks.get(key)
        tiers = dict(cur.tiers) if cur is not None else {}
        if self.on_block is not None and tiers.get(node) != tier:
            self._report(node, key, tiers.get(node), tier)
        if tier is None:
            tiers.pop(node, None)
        else:
            tiers[node] = tier
        if tiers:
            self._blocks[key] = self._interned(tuple(sorted(tiers.items())))
        else:
            self._blocks.pop(key, None)

    def _report(self, node: NodeId, key: ChunkKey, old: int | None, new: int | None) -> None:
        hook = self.on_block
        if hook is not None:
            try:
                hook(node, key, old, new)
            except Exception:
                log.exception("mirror on_block callback failed")

    def _interned(self, tiers: tuple[tuple[NodeId, int], ...]) -> Owners:
        o = self._intern.get(tiers)
        if o is None:
            if len(self._intern) > 65536:
                self._intern.clear()  # interning only saves memory; never let it grow unbounded
            o = self._intern[tiers] = Owners(tiers)
        return o

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:
                log.exception("mirror on_change callback failed")
