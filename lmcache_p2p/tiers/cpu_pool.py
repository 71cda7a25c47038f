"""The CPU pool: one preallocated buffer cut into fixed-size slots.

    buffer: | slot 0 | slot 1 | ... | slot n-1 |     n = capacity_bytes // slot_bytes
    entry:  key -> (header, slot)                     header.length <= slot_bytes

No allocation happens per chunk: a store reserves a free slot (evicting by policy if none is
free), copies the payload in, and commits the header. Peers and the engine read a slot only
under a **pin**, which carries a deadline: an expired pin is ignored, so a crashed reader
cannot hold a slot forever. A removed chunk that is still pinned keeps its slot (as a
"zombie") until its pins are released or expire. Slots are registered memory a peer may write,
so what leaves the pool for the engine is a copy verified where it landed (``read_into``,
``stage``), never bytes checked in the slot and read from it later.

Every chunk enters through ``commit`` (``put`` included), which asks the ``admit`` hook first: a
chunk it refuses (one a standing invalidation covers) is never stored, its slot goes back, and
``commit`` returns False. Pulls, engine stores and promotions all pass this one gate; a chunk
it admits is held under the header the ``stamp`` hook gives it (the agent caps its epoch at its own).

With ``evict_first`` given (the agent: "another node holds this chunk too"), a full pool looks
among its policy's ``EVICT_FIRST_SCAN`` coldest chunks for one that predicate accepts and evicts
it before any other: copies go before the only copy in the cluster.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import torch

from ..chunk import ChunkHeader, verify
from ..errors import CapacityError, ChunkError, TierError
from ..keys import ChunkKey
from .base import EvictCallback, TierStats
from .eviction import LRU, EvictionPolicy, switch_policy

log = logging.getLogger(__name__)
EVICT_FIRST_SCAN = 32


@dataclasses.dataclass(frozen=True, slots=True)
class Pin:
    key: ChunkKey
    slot: int
    header: ChunkHeader
    deadline: float
    token: int


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    slot: int
    view: memoryview


@dataclasses.dataclass(slots=True)
class _Entry:
    header: ChunkHeader
    slot: int
    pins: dict[int, float]
    stored_at: float


class CpuPool:
    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        *,
        policy: EvictionPolicy | None = None,
        on_evict: EvictCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        pin_memory: bool = False,
        admit: Callable[[ChunkHeader], bool] | None = None,
        stamp: Callable[[ChunkHeader], ChunkHeader] | None = None,
        evict_first: Callable[[ChunkKey], bool] | None = None,
    ) -> None:
        """``admit(header)`` gates every chunk entering the pool; ``stamp(header)`` is the header an
        admitted chunk is held under (same key, length and checksum); ``evict_first(key)``: this chunk
        is held elsewhere too (called under the pool lock: dict probes only)."""
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        # zeros() touches every page now, so no page fault lands on the hot path later.
        self.buffer = torch.zeros(self.num_slots * slot_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._array = self.buffer.numpy()
        self._policy: EvictionPolicy = policy if policy is not None else LRU()
        self._on_evict = on_evict
        self._admit = admit
        self._stamp = stamp
        self._evict_first = evict_first
        self._clock = clock
        self._entries: dict[ChunkKey, _Entry] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._zombies: list[_Entry] = []
        self._pin_tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._staging = threading.local()  # per thread: a private buffer for stage()
        self.stats = TierStats()

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Evict by ``policy`` from now on (the cluster config changed ``eviction``)."""
        with self._lock:
            self._policy = switch_policy(self._policy, policy)

    # -- sizes and addresses -------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.header.length for e in self._entries.values())

    @property
    def base_address(self) -> int:
        return int(self.buffer.data_ptr())

    def slot_address(self, slot: int) -> int:
        return self.base_address + slot * self.slot_bytes

    def slot_view(self, slot: int, length: int | None = None) -> memoryview:
        start = slot * self.slot_bytes
        return self._array[start : start + (self.slot_bytes if length is None else length)].data

    # -- queries -----------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return key in self._entries

    def header(self, key: ChunkKey) -> ChunkHeader | None:
        entry = self._entries.get(key)
        return entry.header if entry is not None else None

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._entries)

    def ages(self) -> dict[ChunkKey, float]:
        """Each held chunk's seconds since it was stored (the pool's own record; the TTL sweep reads it)."""
        with self._lock:
            now = self._clock()
            return {key: now - entry.stored_at for key, entry in self._entries.items()}

    def listen_evictions(self, on_evict: EvictCallback) -> None:
        """``on_evict(header, payload)`` hears each victim, under the pool lock (dict probes and copies only)."""
        self._on_evict = on_evict

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def coldest(self, n: int) -> list[ChunkKey]:
        """About the next ``n`` chunks the policy would evict, unpinned ones only."""
        with self._lock:
            keys = cast("list[ChunkKey]", self._policy.coldest(n))
            return [k for k in keys if k in self._entries and not self._is_pinned(self._entries[k])]

    def __len__(self) -> int:
        return len(self._entries)

    # -- writes ---------------------------------------------------------------------------------
    def reserve(self) -> Reservation:
        """Take a free slot (evicting if needed). The caller fills it, then commits or releases."""
        with self._lock:
            slot = self._take_slot()
        return Reservation(slot, self.slot_view(slot))

    def commit(self, reservation: Reservation, header: ChunkHeader) -> bool:
        """Publish a filled slot (the caller has verified the bytes against ``header``); False
        when the ``admit`` hook refuses the chunk, whose slot is then released."""
        if header.length > self.slot_bytes:
            self.release(reservation)
            raise TierError(f"chunk of {header.length} bytes exceeds slot size {self.slot_bytes}")
        if self._admit is not None and not self._admit(header):
            self.release(reservation)
            self.stats.refused += 1
            return False
        if self._stamp is not None:
            header = self._stamp(header)
        with self._lock:
            old = self._entries.pop(header.key, None)
            if old is not None:
                self._policy.remove(header.key)
                self._retire(old)
            self._entries[header.key] = _Entry(header, reservation.slot, {}, self._clock())
            self._policy.insert(header.key)
            self.stats.stores += 1
        return True

    def release(self, reservation: Reservation) -> None:
        with self._lock:
            self._free.append(reservation.slot)

    def put(self, header: ChunkHeader, payload: memoryview) -> bool:
        """Copy ``payload`` (already checksummed into ``header``) into a slot; False if refused."""
        if header.length > self.slot_bytes:
            raise TierError(f"chunk of {header.length} bytes exceeds slot size {self.slot_bytes}")
        res = self.reserve()
        np.copyto(np.frombuffer(res.view, np.uint8, header.length), np.frombuffer(payload, np.uint8))
        return self.commit(res, header)

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._policy.remove(key)
            self._retire(entry)
            return True

    # -- reads ----------------------------------------------------------------------------------
    def pin(self, key: ChunkKey, timeout_s: float) -> Pin | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            token = next(self._pin_tokens)
            deadline = self._clock() + timeout_s
            entry.pins[token] = deadline
            self._policy.access(key)
            return Pin(key, entry.slot, entry.header, deadline, token)

    def unpin(self, pin: Pin) -> None:
        with self._lock:
            entry = self._entries.get(pin.key)
            if entry is not None and entry.slot == pin.slot:
                entry.pins.pop(pin.token, None)
                return
            for zombie in self._zombies:
                if zombie.slot == pin.slot:
                    zombie.pins.pop(pin.token, None)
            self._reap_zombies()

    def pinned_count(self) -> int:
        """Live (unexpired) pins, for leak checks and metrics."""
        now = self._clock()
        with self._lock:
            return sum(1 for e in [*self._entries.values(), *self._zombies] for d in e.pins.values() if d > now)

    def read_into(self, key: ChunkKey, dst: memoryview) -> ChunkHeader | None:
        """Copy a chunk's bytes into ``dst`` and verify the copy there (see :meth:`stage`); None if
        it is absent or changed in memory since it was committed (then dropped)."""
        pin = self.pin(key, 60.0)
        if pin is None:
            self.stats.misses += 1
            return None
        try:
            if not self.copy_verified(pin, dst):
                return None
            self.stats.hits += 1
            return pin.header
        finally:
            self.unpin(pin)

    def stage(self, pin: Pin) -> torch.Tensor | None:
        """A private, verified copy of a pinned chunk: what the engine scatters from.

        Slots are registered memory (a peer holding the secret may WRITE into them over NIXL, at any
        time), so bytes verified in a slot may change before the engine reads them. The copy goes
        into this thread's staging buffer, which no transport knows, and is verified there: the bytes
        scattered are the bytes checked. It is valid until this thread's next ``stage``. None if the
        copy does not match the header (changed in memory since commit): the chunk is dropped and
        counted in ``stats.corrupt_dropped``.
        """
        buf: torch.Tensor | None = getattr(self._staging, "buf", None)
        if buf is None:
            buf = self._staging.buf = torch.empty(self.slot_bytes, dtype=torch.uint8,
                                                  pin_memory=self.buffer.is_pinned())
        out = buf[: pin.header.length]
        return out if self.copy_verified(pin, out.numpy().data) else None

    def copy_verified(self, pin: Pin, dst: memoryview) -> bool:
        """Copy the pinned slot into ``dst`` (the caller's private memory), then verify the copy; one
        that does not match drops the chunk, if that slot still holds it."""
        n = pin.header.length
        copy = np.frombuffer(dst, np.uint8, n)
        np.copyto(copy, self._array[pin.slot * self.slot_bytes : pin.slot * self.slot_bytes + n])
        try:
            verify(pin.header, copy.data)
            return True
        except ChunkError as exc:
            log.error("chunk %s changed in memory after it was committed; dropped: %s", pin.key.hex()[:16], exc)
        with self._lock:
            entry = self._entries.get(pin.key)
            if entry is not None and entry.slot == pin.slot:
                del self._entries[pin.key]
                self._policy.remove(pin.key)
                self._retire(entry)
            self.stats.corrupt_dropped += 1
        return False

    # -- internals (lock held) ------------------------------------------------------------------
    def _is_pinned(self, entry: _Entry) -> bool:
        now = self._clock()
        expired = [t for t, d in entry.pins.items() if d <= now]
        for t in expired:
            del entry.pins[t]
        return bool(entry.pins)

    def _retire(self, entry: _Entry) -> None:
        if self._is_pinned(entry):
            self._zombies.append(entry)
        else:
            self._free.append(entry.slot)

    def _reap_zombies(self) -> None:
        alive: list[_Entry] = []
        for zombie in self._zombies:
            if self._is_pinned(zombie):
                alive.append(zombie)
            else:
                self._free.append(zombie.slot)
        self._zombies = alive

    def _copy_victim(self) -> ChunkKey | None:
        """A cold, unpinned chunk ``evict_first`` accepts (held elsewhere too), taken out of the policy."""
        prefer = self._evict_first
        if prefer is None:
            return None
        for key in cast("list[ChunkKey]", self._policy.coldest(EVICT_FIRST_SCAN)):
            entry = self._entries.get(key)
            if entry is not None and not self._is_pinned(entry) and prefer(key):
                self._policy.remove(key)
                self.stats.copies_evicted += 1
                return key
        return None

    def _take_slot(self) -> int:
        if not self._free:
            self._reap_zombies()
        if self._free:
            return self._free.pop()
        victim = self._copy_victim()
        if victim is None:
            victim = cast("ChunkKey | None", self._policy.evict(lambda k: not self._is_pinned(self._entries[k])))  # type: ignore[index]
        if victim is None:
            raise CapacityError(f"all {self.num_slots} CPU slots are pinned or reserved")
        entry = self._entries.pop(victim)
        self.stats.evictions += 1
        if self._on_evict is not None:  # under the pool lock: the callback must not do disk I/O
            self._on_evict(entry.header, self.slot_view(entry.slot, entry.header.length))
        return entry.slot
