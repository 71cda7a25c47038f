"""The generation of the etcd history, and the epochs chunks carry.

An etcd revision orders writes only within one history. A fresh etcd (a new data dir) starts again
at revision 1, and one restored from a backup goes back to the backup's revision: chunks stamped
with revisions of the lost history would sort after every invalidation issued since. So an epoch
names its history too::

    generation      msgpack {id, created_at}          permanent; id: random, 1 .. 2^24-1
    epoch (u64)     generation id << 40 | revision    (revision: up to 2^40-1)

The first agent that finds no generation record writes one (a create-if-absent txn): a fresh etcd
gets a new id. An agent that sees etcd's revision go below one it had already seen (a restore: the
record came back with the old id) replaces the record it read with a new id (compare-and-swap on
its ``mod_revision``); whoever loses that race adopts the winner's. A chunk whose epoch names
another generation than the agent's current one is ordered before every invalidation (see
:mod:`lmcache_p2p.invalidation`). Epochs written before generations existed carry id 0: they belong
to no generation and are treated the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from ..backoff import jittered
from ..errors import IndexError_, MalformedRecord
from .client import EtcdClient, KeyValue, WatchEvent, compare_mod_revision, op_put
from .records import MAX_GENERATION, Generation, decode_generation
from .schema import Rejects, Schema
from .watch import ResumableWatch

log = logging.getLogger(__name__)

REVISION_BITS = 40
MAX_REVISION = (1 << REVISION_BITS) - 1
SETTLE_ATTEMPTS = 5
__all__ = ["Generation", "GenerationWatch", "cap_epoch", "epoch_generation", "epoch_revision", "make_epoch", "settle"]


def make_epoch(generation: int, revision: int) -> int:
    """The epoch of a chunk computed now: ``generation`` (0: not known) and the revision applied."""
    if not 0 <= generation <= MAX_GENERATION:
        raise ValueError(f"generation must be in [0, {MAX_GENERATION}], got {generation}")
    return generation << REVISION_BITS | min(max(revision, 0), MAX_REVISION)


def epoch_generation(epoch: int) -> int:
    return epoch >> REVISION_BITS


def epoch_revision(epoch: int) -> int:
    return epoch & MAX_REVISION


def cap_epoch(epoch: int, mine: int) -> int:
    """The epoch a chunk is held under here: never above this node's own (``mine``); a chunk of
    another generation is put at revision 0 of this node's, below every invalidation to come."""
    if epoch_generation(epoch) != epoch_generation(mine):
        return make_epoch(epoch_generation(mine), 0)
    return min(epoch, mine)


async def settle(client: EtcdClient, schema: Schema, seen: int | None) -> Generation:
    """The generation to follow. ``seen=None``: the stored one, written first if there is none.
    ``seen=<id>``: etcd's history went back under generation ``seen``, so a stored ``seen`` (or a
    malformed record) is replaced by a new id; another id already stored is returned as it is."""
    for _ in range(SETTLE_ATTEMPTS):
        kv, _ = await client.get(schema.generation)
        current = None
        if kv is not None:
            try:
                current = decode_generation(kv.value, kv.mod_revision)
            except MalformedRecord as exc:
                log.warning("generation record is malformed (%s); replacing it", exc)
        if current is not None and current.id != seen:
            return current
        new = Generation.new(avoid=seen)
        ok, revision = await client.txn([compare_mod_revision(schema.generation, kv.mod_revision if kv else 0)],
                                        [op_put(schema.generation, new.pack())])
        if ok:
            log.warning("etcd generation %s -> %d (%s)", seen if seen is not None else "none", new.id,
                        "its revision went backwards" if seen is not None else "no generation record yet")
            return Generation(new.id, new.created_at, revision)
    raise IndexError_(f"the generation record changed {SETTLE_ATTEMPTS} times while it was being settled")


class GenerationWatch:
    """Follows ``generation`` on the agent's loop: ``id`` is the generation followed (0: not known yet,
    or being replaced). A missing or malformed record is written, and :meth:`rewound` (any watch of
    this agent saw etcd's revision go back) replaces the current one. ``on_change(old, new)`` hears
    every change of ``id`` to a new generation, on the loop."""

    def __init__(self, client: EtcdClient, schema: Schema, *, on_change: Callable[[int, int], None],
                 rejects: Rejects) -> None:
        self._client = client
        self._key = schema.generation
        self._schema = schema
        self._on_change = on_change
        self._rejects = rejects
        self.id = 0
        self.ready = asyncio.Event()  # set once a generation is known
        self._replacing: int | None = None  # the generation whose history went back, until replaced
        self._settler: tuple[int | None, asyncio.Task[None]] | None = None
        self.watch = ResumableWatch(client, self._key, load=self._load, apply=self._apply, name="generation",
                                    on_rewind=self.rewound)

    def start(self) -> None:
        self.watch.start()

    async def stop(self) -> None:
        await self.watch.stop()
        if self._settler is not None:
            task = self._settler[1]
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def rewound(self, seen: int, now: int) -> None:
        """etcd's revision went back from ``seen`` to ``now`` (a restored or new etcd): until the generation
        is replaced, no chunk held counts as of the current one."""
        old = self.id
        log.warning("etcd's revision went back from %d to %d (a restored or new etcd): generation %d is replaced; "
                    "every chunk held now is ordered before every invalidation", seen, now, old)
        if old == 0:
            return  # not known yet, or already being replaced
        self._replacing, self.id = old, 0
        self._settle(old)

    def _load(self, kvs: list[KeyValue], _revision: int) -> None:
        kv = next((kv for kv in kvs if kv.key == self._key), None)
        self._read(kv.value if kv is not None else None, kv.mod_revision if kv is not None else 0)

    def _apply(self, events: Sequence[WatchEvent]) -> None:
        mine = [ev for ev in events if ev.key == self._key]
        if mine:
            self._read(None if mine[-1].deleted else mine[-1].value, mine[-1].mod_revision)

    def _read(self, value: bytes | None, revision: int) -> None:
        if value is None:
            self._settle(None)  # none yet (a fresh etcd), or deleted: write one
            return
        try:
            generation = decode_generation(value, revision)
        except MalformedRecord as exc:
            self._rejects.add(exc, self._key)
            self._settle(None)  # replaced by a good one
            return
        if generation.id != self._replacing:  # the record etcd went back to is being replaced
            self._adopt(generation.id)

    def _settle(self, seen: int | None) -> None:
        running = self._settler
        if running is not None and not running[1].done():
            if running[0] == seen or seen is None:
                return
            running[1].cancel()
        task = asyncio.create_task(self._settle_until_done(seen), name="generation-settle")
        self._settler = (seen, task)

    async def _settle_until_done(self, seen: int | None) -> None:
        backoff = 0.1
        while True:
            try:
                generation = await settle(self._client, self._schema, seen)
                break
            except IndexError_ as exc:
                log.info("settling the etcd generation failed (retrying in %.1fs): %s", backoff, exc)
            except Exception:  # supervised: logged, retried
                log.exception("settling the etcd generation failed; retrying")
            await asyncio.sleep(jittered(backoff))
            backoff = min(backoff * 2, 2.0)
        if seen is not None and seen == self._replacing:
            self._replacing = None
        self._adopt(generation.id)

    def _adopt(self, new: int) -> None:
        old = self.id
        if new == old:
            return
        self.id = new
        self.ready.set()
        self._on_change(old, new)
