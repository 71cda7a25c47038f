"""An in-memory view of ``nodes/`` and ``blocks/<fp>/`` fed by one watch stream.

Sync: read both prefixes at one revision R (paged), then one gRPC watch stream carrying two
watchers (nodes, blocks) from R+1. Each watcher's last applied revision is tracked separately;
a broken stream (member killed, leader lost: the stream asks for ``hasleader``) resumes each
watcher from its own revision, so nothing is skipped or applied twice. A compacted start
revision or a cancelled watcher means history is gone: the mirror resyncs from a fresh range
read and swaps the new maps in at once.

Readers (any thread) never touch the network and take no lock: ``lookup`` and
``longest_prefix`` probe a dict whose reference is swapped atomically on resync; the loop is the
only writer. Owner sets are interned, so a chunk held by the usual one or two nodes costs a dict
slot and its 16-byte key.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import grpc.aio
from etcd3aio._protobuf import WatchCreateRequest, WatchRequest, WatchStub
from etcd3aio.kv import prefix_range_end

from ..aio import cancel_and_wait
from ..errors import IndexError_
from ..keys import ChunkKey, FingerprintDigest
from .client import EtcdClient, KeyValue
from .schema import NodeId, NodeRecord, Schema

log = logging.getLogger(__name__)

EMPTY: frozenset[NodeId] = frozenset()
_PUT, _DELETE = 0, 1  # mvccpb.Event.EventType


class Owners:
    """Interned owner set of a chunk: node ids and the tier byte each holds it in."""

    __slots__ = ("nodes", "tiers")

    def __init__(self, tiers: tuple[tuple[NodeId, int], ...]) -> None:
        self.tiers = tiers
        self.nodes = frozenset(n for n, _ in tiers)


class Mirror:
    def __init__(self, client: EtcdClient, schema: Schema, fp: FingerprintDigest,
                 on_change: Callable[[], None] | None = None) -> None:
        self.fp = fp
        self._client = client
        self._nodes_prefix = schema.nodes
        self._blocks_prefix = schema.blocks_of(fp)
        self._plen = len(self._blocks_prefix)
        self._blocks: dict[ChunkKey, Owners] = {}
        self._nodes: dict[NodeId, NodeRecord] = {}
        self._intern: dict[tuple[tuple[NodeId, int], ...], Owners] = {}
        self._rev = {self._nodes_prefix: 0, self._blocks_prefix: 0}
        self._on_change = on_change
        self._changed = threading.Condition()
        self._task: asyncio.Task[None] | None = None
        self._need_resync = True
        self.resyncs = 0
        self.events_total = 0

    # ---- readers: any thread, no I/O ---------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> list[frozenset[NodeId]]:
        """Owners of each key (empty when nobody announced it)."""
        get = self._blocks.get
        return [o.nodes if (o := get(k)) is not None else EMPTY for k in keys]

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
    def revision(self) -> int:
        return min(self._rev.values())

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
    async def start(self, timeout: float) -> None:
        """Sync (raises IndexError_ if etcd cannot be read in time), then follow the watch.

        After ``stop()`` a new ``start()`` resumes the watch from the revision it stopped at, so
        the changes in between are replayed (or, if compacted away, a resync happens).
        """
        if self._need_resync:
            async with asyncio.timeout(timeout):
                await self._resync()
        self._task = asyncio.create_task(self._run(), name=f"index-mirror-{self.fp.hex()[:8]}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                if self._need_resync:
                    await self._resync()
                await self._watch()
                backoff = 0.05
            except (IndexError_, grpc.aio.AioRpcError, TimeoutError, OSError) as exc:
                log.info("mirror %s: watch interrupted (%s), resuming at rev %d",
                         self.fp.hex()[:8], _why(exc), self.revision)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _resync(self) -> None:
        nodes, rev = await self._client.get_prefix(self._nodes_prefix)
        blocks, _ = await self._client.get_prefix(self._blocks_prefix, revision=rev)
        self._intern = {}
        new_blocks: dict[ChunkKey, dict[NodeId, int]] = {}
        parse = self._parse_block
        for kv in blocks:
            key, node = parse(kv.key)
            new_blocks.setdefault(key, {})[node] = kv.value[0] if kv.value else 0
        self._blocks = {k: self._interned(tuple(sorted(v.items()))) for k, v in new_blocks.items()}
        self._nodes = dict(self._records(nodes))
        self._rev = {self._nodes_prefix: rev, self._blocks_prefix: rev}
        self._need_resync = False
        self.resyncs += 1
        log.info("mirror %s: synced %d chunks, %d nodes at rev %d", self.fp.hex()[:8], len(self._blocks),
                 len(self._nodes), rev)
        self._notify()

    def _records(self, kvs: list[KeyValue]) -> list[tuple[NodeId, NodeRecord]]:
        out = []
        for kv in kvs:
            try:
                out.append((NodeId(kv.key[len(self._nodes_prefix):].decode()), NodeRecord.unpack(kv.value)))
            except IndexError_ as exc:
                log.warning("mirror: skipping node %r: %s", kv.key, exc)
        return out

    async def _watch(self) -> None:
        """Follow one stream until it breaks (raises) or history is gone (sets ``_need_resync``)."""
        call = WatchStub(self._client.channel).Watch(metadata=self._client.metadata(require_leader=True))
        try:
            for prefix in (self._nodes_prefix, self._blocks_prefix):
                await call.write(WatchRequest(create_request=WatchCreateRequest(
                    key=prefix, range_end=prefix_range_end(prefix), start_revision=self._rev[prefix] + 1)))
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise OSError("watch stream closed by the server")
                if resp.compact_revision > 0 or resp.canceled:
                    log.warning("mirror %s: watch %s (compacted at %d): resyncing", self.fp.hex()[:8],
                                resp.cancel_reason or "cancelled", resp.compact_revision)
                    self._need_resync = True
                    return
                if resp.events:
                    self._apply(resp.events)
        finally:
            call.cancel()

    def _apply(self, events: Sequence[object]) -> None:
        blocks_prefix, nodes_prefix = self._blocks_prefix, self._nodes_prefix
        for ev in events:
            kv = ev.kv  # type: ignore[attr-defined]
            k: bytes = kv.key
            deleted = ev.type == _DELETE  # type: ignore[attr-defined]
            if k.startswith(blocks_prefix):
                key, node = self._parse_block(k)
                self._set_owner(key, node, None if deleted else (kv.value[0] if kv.value else 0))
                self._rev[blocks_prefix] = kv.mod_revision
            elif k.startswith(nodes_prefix):
                node = NodeId(k[len(nodes_prefix):].decode())
                if deleted:
                    self._nodes.pop(node, None)
                else:
                    self._nodes.update(self._records([KeyValue(k, kv.value, kv.mod_revision, kv.lease)]))
                self._rev[nodes_prefix] = kv.mod_revision
        self.events_total += len(events)
        self._notify()

    def _parse_block(self, k: bytes) -> tuple[ChunkKey, NodeId]:
        p = self._plen
        try:
            return ChunkKey(bytes.fromhex(k[p:p + 32].decode())), NodeId(k[p + 33:].decode())
        except ValueError as exc:
            raise IndexError_(f"malformed block key {k!r}") from exc

    def _set_owner(self, key: ChunkKey, node: NodeId, tier: int | None) -> None:
        cur = self._blocks.get(key)
        tiers = dict(cur.tiers) if cur is not None else {}
        if tier is None:
            tiers.pop(node, None)
        else:
            tiers[node] = tier
        if tiers:
            self._blocks[key] = self._interned(tuple(sorted(tiers.items())))
        else:
            self._blocks.pop(key, None)

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


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name} {exc.details() or ''}".strip()
    return f"{type(exc).__name__}: {exc}"
