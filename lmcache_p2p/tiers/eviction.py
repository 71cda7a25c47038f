"""Eviction policies: small pure classes that order keys, with no I/O and no sizes.

A tier tells its policy about inserts, accesses and removals, and asks ``evict(can_evict)``
for the next victim. The policy forgets the victim it returns; ``can_evict`` lets the tier
veto pinned keys, which stay in the policy. ``coldest(n)`` shows, without changing anything,
about the first ``n`` keys the policy would evict (the hand-off looks there for chunks to save).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Protocol

Key = Hashable


class EvictionPolicy(Protocol):
    def insert(self, key: Key) -> None: ...
    def access(self, key: Key) -> None: ...
    def remove(self, key: Key) -> None: ...
    def evict(self, can_evict: Callable[[Key], bool]) -> Key | None: ...
    def coldest(self, n: int) -> list[Key]: ...
    def __len__(self) -> int: ...


class LRU:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(self, can_evict: Callable[[Key], bool]) -> Key | None:
        for key in self._order:
            if can_evict(key):
                del self._order[key]
                return key
        return None

    def coldest(self, n: int) -> list[Key]:
        return list(itertools.islice(self._order, n))

    def __len__(self) -> int:
        return len(self._order)


class LFU:
    """Least frequently used first; ties broken by least recent access."""

    def __init__(self) -> None:
        self._freq: dict[Key, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, Key]] = []
        self._seq = itertools.count()

    def insert(self, key: Key) -> None:
        self._push(key, 1)

    def access(self, key: Key) -> None:
        if key in self._freq:
            self._push(key, self._freq[key][0] + 1)

    def _push(self, key: Key, freq: int) -> None:
        entry = (freq, next(self._seq))
        self._freq[key] = entry
        heapq.heappush(self._heap, (entry[0], entry[1], key))
        if len(self._heap) > 4 * len(self._freq) + 64:
            self._heap = [(f, s, k) for k, (f, s) in self._freq.items()]
            heapq.heapify(self._heap)

    def remove(self, key: Key) -> None:
        self._freq.pop(key, None)

    def evict(self, can_evict: Callable[[Key], bool]) -> Key | None:
        vetoed: list[tuple[int, int, Key]] = []
        victim: Key | None = None
        while self._heap:
            freq, seq, key = heapq.heappop(self._heap)
            if self._freq.get(key) != (freq, seq):
                continue  # stale heap entry
            if can_evict(key):
                del self._freq[key]
                victim = key
                break
            vetoed.append((freq, seq, key))
        for item in vetoed:
            heapq.heappush(self._heap, item)
        return victim

    def coldest(self, n: int) -> list[Key]:
        smallest = heapq.nsmallest(4 * n + 16, self._heap)  # some may be stale
        return [k for f, s, k in smallest if self._freq.get(k) == (f, s)][:n]

    def __len__(self) -> int:
        return len(self._freq)


class S3FIFO:
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO.

    New keys enter the small queue (about 10% of entries); a key accessed while there is
    promoted to main on eviction, otherwise it leaves and is remembered in the ghost queue.
    A ghost key that comes back goes straight to main. Main is a FIFO with a 2-bit
    frequency: an accessed key is reinserted with its frequency decremented.
    """

    def __init__(self, small_ratio: float = 0.1) -> None:
        self._small: deque[Key] = deque()
        self._main: deque[Key] = deque()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._where: dict[Key, str] = {}
        self._freq: dict[Key, int] = {}
        self._ratio = small_ratio

    def insert(self, key: Key) -> None:
        if key in self._where:
            self.access(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main.append(key)
            self._where[key] = "m"
        else:
            self._small.append(key)
            self._where[key] = "s"
        self._freq[key] = 0

    def access(self, key: Key) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, 3)

    def remove(self, key: Key) -> None:
        where = self._where.pop(key, None)
        self._freq.pop(key, None)
        if where == "s":
            self._small.remove(key)
        elif where == "m":
            self._main.remove(key)

    def evict(self, can_evict: Callable[[Key], bool]) -> Key | None:
        # Each key can be rotated at most a few times (frequency <= 3) before it is a victim
        # or found pinned; the bound keeps a fully pinned cache from looping forever.
        for _ in range(5 * len(self._where) + 1):
            use_small = bool(self._small) and (len(self._small) > self._ratio * len(self._where) or not self._main)
            queue = self._small if use_small else self._main
            if not queue:
                return None
            key = queue.popleft()
            if not can_evict(key):
                queue.append(key)
                continue
            if use_small and self._freq[key] > 0:
                self._freq[key] = 0
                self._main.append(key)
                self._where[key] = "m"
                continue
            if not use_small and self._freq[key] > 0:
                self._freq[key] -= 1
                self._main.append(key)
                continue
            del self._where[key], self._freq[key]
            if use_small:
                self._ghost[key] = None
                while len(self._ghost) > max(len(self._main), 16):
                    self._ghost.popitem(last=False)
            return key
        return None

    def coldest(self, n: int) -> list[Key]:
        # small first (new keys never accessed again leave from there), then main
        return list(itertools.islice(itertools.chain(self._small, self._main), n))

    def __len__(self) -> int:
        return len(self._where)


def switch_policy(old: EvictionPolicy, new: EvictionPolicy) -> EvictionPolicy:
    """``new`` holding ``old``'s keys, inserted coldest first (so a recency order carries over;
    frequency counts start afresh). The caller holds the tier's lock."""
    for key in old.coldest(len(old)):
        new.insert(key)
    return new


def make_policy(name: str) -> EvictionPolicy:
    policies: dict[str, type[LRU] | type[LFU] | type[S3FIFO]] = {"lru": LRU, "lfu": LFU, "s3fifo": S3FIFO}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(policies)}")
    return policies[name]()
