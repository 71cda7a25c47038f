"""The disk tier: one file per chunk, written atomically, verified on every read.

    <dir>/<key_hex>.chunk      80-byte header (see chunk.py) + payload
    <dir>/.<key_hex>.<n>.tmp   a write in progress; renamed into place when complete

A file is only ever visible under its final name complete (temp file + ``os.replace``).
``read_into`` checks the header and the payload checksum and drops the file on any mismatch;
``rescan`` (run on start) keeps valid chunks and removes corrupt, truncated and stray files.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

from ..chunk import HEADER_SIZE, ChunkHeader, verify
from ..errors import ChunkError, TierError
from ..keys import ChunkKey
from .base import EvictCallback, TierStats
from .eviction import LRU, EvictionPolicy, switch_policy

log = logging.getLogger(__name__)
SUFFIX = ".chunk"


class DiskTier:
    name = "disk"

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        *,
        policy: EvictionPolicy | None = None,
        on_evict: EvictCallback | None = None,
        fsync: bool = False,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self._policy: EvictionPolicy = policy if policy is not None else LRU()
        self._on_evict = on_evict
        # Hears a victim's file before it is deleted (under the lock: it may only rename it); True: taken.
        self.spill: Callable[[ChunkHeader, Path], bool] | None = None
        self._fsync = fsync
        self._headers: dict[ChunkKey, ChunkHeader] = {}
        self._used = 0
        self._tmp_ids = itertools.count()
        self._lock = threading.Lock()
        self.stats = TierStats()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Evict by ``policy`` from now on (the cluster config changed ``eviction``)."""
        with self._lock:
            self._policy = switch_policy(self._policy, policy)

    @property
    def used_bytes(self) -> int:
        return self._used

    def coldest(self, n: int) -> list[ChunkKey]:
        """About the next ``n`` chunks the policy would evict."""
        with self._lock:
            return [k for k in cast("list[ChunkKey]", self._policy.coldest(n)) if k in self._headers]

    def _file(self, key: ChunkKey) -> Path:
        return self.path / f"{key.hex()}{SUFFIX}"

    def contains(self, key: ChunkKey) -> bool:
        return key in self._headers

    def header(self, key: ChunkKey) -> ChunkHeader | None:
        return self._headers.get(key)

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._headers)

    def stored_time(self, key: ChunkKey) -> float | None:
        """When ``key``'s file was written (wall time: its mtime); None when it is not held."""
        try:
            return os.stat(self._file(key)).st_mtime
        except OSError:
            return None

    def listen_evictions(self, on_evict: EvictCallback) -> None:
        """``on_evict(header, None)`` hears each victim, under the tier's lock."""
        self._on_evict = on_evict

    def __len__(self) -> int:
        return len(self._headers)

    def put(self, header: ChunkHeader, payload: memoryview) -> None:
        size = HEADER_SIZE + header.length
        if size > self._capacity:
            raise TierError(f"chunk of {size} bytes exceeds disk capacity {self._capacity}")
        with self._lock:
            if header.key in self._headers:
                self._policy.access(header.key)
                return
            self._make_room(size)
            self._used += size  # reserved now, so concurrent puts never overshoot capacity
        tmp = self.path / f".{header.key.hex()}.{os.getpid()}.{next(self._tmp_ids)}.tmp"
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(header.pack())
                f.write(payload)
                if self._fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, self._file(header.key))
        except OSError as exc:
            with self._lock:
                self._used -= size
            tmp.unlink(missing_ok=True)
            raise TierError(f"writing chunk {header.key.hex()} failed: {exc}") from exc
        with self._lock:
            self._headers[header.key] = header
            self._policy.insert(header.key)
            self.stats.stores += 1

    def read_into(self, key: ChunkKey, dst: memoryview) -> ChunkHeader | None:
        """Read and verify a chunk into ``dst``; a bad file is removed and counted, never returned."""
        expected = self._headers.get(key)
        if expected is None:
            self.stats.misses += 1
            return None
        try:
            header = self._read_file(self._file(key), dst)
            if header != expected:
                raise ChunkError(f"header on disk differs from the one stored for {key.hex()}")
        except (OSError, ChunkError) as exc:
            log.warning("dropping disk chunk %s: %s", key.hex(), exc)
            self.stats.corrupt_dropped += 1
            self._drop(key)
            return None
        with self._lock:
            self._policy.access(key)
        self.stats.hits += 1
        return header

    def _read_file(self, path: Path, dst: memoryview) -> ChunkHeader:
        with open(path, "rb", buffering=0) as f:
            head = bytearray(HEADER_SIZE)
            if f.readinto(head) != HEADER_SIZE:
                raise ChunkError("truncated header")
            header = ChunkHeader.unpack(head)
            if header.length > len(dst):
                raise ChunkError(f"chunk of {header.length} bytes does not fit a {len(dst)}-byte buffer")
            view = dst[: header.length]
            got = f.readinto(view)
            if got != header.length or f.read(1):
                raise ChunkError(f"payload is {got} bytes or more, header says {header.length}")
        verify(header, view)
        return header

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self._headers:
                return False
            self._policy.remove(key)
        self._drop(key)
        return True

    def _drop(self, key: ChunkKey) -> None:
        with self._lock:
            header = self._headers.pop(key, None)
            if header is None:
                return
            self._policy.remove(key)
            self._used -= HEADER_SIZE + header.length
        self._file(key).unlink(missing_ok=True)

    def _make_room(self, size: int) -> None:
        while self._used + size > self._capacity:
            victim = self._policy.evict(lambda k: True)
            if victim is None:
                raise TierError("disk tier is full and has nothing to evict")
            header = self._headers.pop(victim)  # type: ignore[call-overload]
            self._used -= HEADER_SIZE + header.length
            self.stats.evictions += 1
            path = self._file(header.key)
            if not (self.spill is not None and self._spilled(header, path)):
                path.unlink(missing_ok=True)
            if self._on_evict is not None:
                self._on_evict(header, None)

    def _spilled(self, header: ChunkHeader, path: Path) -> bool:
        """Whether ``spill`` took the victim's file (it moves it aside for an upload; never raises here)."""
        assert self.spill is not None
        try:
            return self.spill(header, path)
        except Exception:  # an eviction must complete whatever the hook does
            log.exception("spilling %s failed", header.key.hex())
            return False

    def rescan(self, scratch: memoryview) -> list[ChunkHeader]:
        """Rebuild the index from the directory; returns the valid chunks' headers.

        ``scratch`` must hold the largest chunk. Stray temp files and files that fail
        verification (flipped bytes, truncation, bad header, wrong name) are deleted and counted.
        """
        found: list[ChunkHeader] = []
        for entry in sorted(os.scandir(self.path), key=lambda e: e.name):
            path = Path(entry.path)
            if entry.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                self.stats.stray_removed += 1
                continue
            if not entry.name.endswith(SUFFIX) or not entry.is_file():
                continue
            try:
                header = self._read_file(path, scratch)
                if path.name != f"{header.key.hex()}{SUFFIX}":
                    raise ChunkError("file name does not match the chunk key")
            except (OSError, ChunkError) as exc:
                log.warning("rescan: removing %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                self.stats.corrupt_dropped += 1
                continue
            size = HEADER_SIZE + header.length
            with self._lock:
                if header.key in self._headers:
                    continue
                if self._used + size > self._capacity:
                    path.unlink(missing_ok=True)
                    continue
                self._headers[header.key] = header
                self._used += size
                self._policy.insert(header.key)
            found.append(header)
        return found
