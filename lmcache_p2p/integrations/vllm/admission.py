"""Admission (scheduler side): which computed chunks a save keeps, and the keys this engine asked its
worker to save.

A partial chunk shorter than ``tiers.min_save_tokens`` is not saved, and with
``tiers.save_after_sightings`` N > 1 a chunk is saved only once its key was in N requests' prompts on
this node (counts for the newest ``SIGHTINGS_MAX`` keys): a one-off prompt never takes a slot or an
etcd entry; the Nth request with it computes it once more and saves it. A key's chunk is useless
without its predecessors' (keys chain), so a save is cut at the first key short of N. What a save leaves
out is counted by reason for the worker (``admission_skipped_chunks_total``: this side has no registry).

While the mirror is not following etcd (etcd down at start, or an outage), it cannot learn what this
engine's own worker stores: :attr:`Admission.saved` remembers the chunks asked of the worker (a bounded
LRU of keys), which the scheduler counts as held too, so local hits keep working. A key the worker has
evicted since fails its load, and vLLM recomputes it (fail closed).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable

from ...keys import ChunkKey
from ...transfers import ChunkTransfer

SAVED_KEYS_MAX = 65536  # chunks this engine saved, remembered for lookups while etcd is unreachable
SIGHTINGS_MAX = 65536  # chunk keys whose prompt sightings are counted (tiers.save_after_sightings > 1)


class Admission:
    def __init__(self, chunk_size: int, *, save_after_sightings: int, min_save_tokens: int) -> None:
        self._chunk = chunk_size
        self._save_after = save_after_sightings
        self._min_tokens = min_save_tokens
        self.saved: OrderedDict[ChunkKey, None] = OrderedDict()  # asked of our worker; newest last
        self._sightings: OrderedDict[ChunkKey, int] = OrderedDict()  # prompts each key was in; newest last
        self._skipped: dict[str, int] = {}  # chunks kept out of saves since the last step, by reason

    def admitted(self, save: ChunkTransfer, seen: int | None = None) -> ChunkTransfer:
        """``save`` cut to its first ``seen`` chunks (those sighted often enough, ``tiers.save_after_sightings``;
        None: all) and without a partial chunk shorter than ``tiers.min_save_tokens`` (only its last can be
        partial). The keys it keeps are remembered as saved."""
        keep = len(save.keys) if seen is None else min(seen, len(save.keys))
        self._count_skipped("sightings", len(save.keys) - keep)
        n = save.num_tokens[keep - 1] if keep else self._chunk
        if n < self._chunk and n < self._min_tokens:
            keep -= 1
            self._count_skipped("short", 1)
        if keep != len(save.keys):
            save = dataclasses.replace(save, keys=save.keys[:keep], num_tokens=save.num_tokens[:keep],
                                       block_ids=save.block_ids[:keep])
        self.remember_saved(ChunkKey(k) for k in save.keys)
        return save

    def sighted(self, keys: list[ChunkKey]) -> int | None:
        """Count one more prompt sighting of ``keys``; how many of them, from the first, were now seen in at
        least ``tiers.save_after_sightings`` prompts (None: every key is admitted, nothing counted)."""
        if self._save_after <= 1:
            return None
        sightings = self._sightings
        for key in keys:
            sightings[key] = sightings.get(key, 0) + 1
            sightings.move_to_end(key)
        while len(sightings) > SIGHTINGS_MAX:
            sightings.popitem(last=False)
        return self.seen(keys)

    def seen(self, keys: list[ChunkKey]) -> int | None:
        """How many of ``keys``, from the first, were seen in ``tiers.save_after_sightings`` prompts (None: all
        are admitted); the run stops at the first short of it."""
        if self._save_after <= 1:
            return None
        for i, key in enumerate(keys):
            if self._sightings.get(key, 0) < self._save_after:
                return i
        return len(keys)

    def remember_saved(self, keys: Iterable[ChunkKey]) -> None:
        saved = self.saved
        for key in keys:
            saved[key] = None
            saved.move_to_end(key)
        while len(saved) > SAVED_KEYS_MAX:
            saved.popitem(last=False)

    def take_skipped(self) -> dict[str, int]:
        """The chunks left out since the last call, by reason (for the next step's metadata)."""
        skipped, self._skipped = self._skipped, {}
        return skipped

    def _count_skipped(self, reason: str, chunks: int) -> None:
        if chunks > 0:
            self._skipped[reason] = self._skipped.get(reason, 0) + chunks
