"""The narrow ``Tier`` protocol every storage tier implements."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from ..chunk import ChunkHeader
from ..keys import ChunkKey


@dataclasses.dataclass(slots=True)
class TierStats:
    stores: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt_dropped: int = 0
    stray_removed: int = 0
    refused: int = 0  # chunks the admission hook refused (covered by an invalidation)
    copies_evicted: int = 0  # victims chosen because another node holds them too (CpuPool.evict_first)


EvictCallback = Callable[[ChunkHeader, memoryview | None], None]
"""Called with a victim's header (and, for memory tiers, its bytes) before its space is reused."""


class Tier(Protocol):
    name: str
    stats: TierStats

    @property
    def capacity_bytes(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    def contains(self, key: ChunkKey) -> bool: ...
    def header(self, key: ChunkKey) -> ChunkHeader | None: ...
    def keys(self) -> list[ChunkKey]: ...
    def put(self, header: ChunkHeader, payload: memoryview) -> None: ...
    def read_into(self, key: ChunkKey, dst: memoryview) -> ChunkHeader | None: ...
    def remove(self, key: ChunkKey) -> bool: ...
