"""Storage tiers: the slotted CPU pool, the disk tier, and the store that composes them."""

from .base import Tier, TierStats
from .cpu_pool import CpuPool, Pin, Reservation
from .disk import DiskTier
from .eviction import LFU, LRU, S3FIFO, EvictionPolicy, make_policy
from .store import TieredStore

__all__ = [
    "Tier", "TierStats", "CpuPool", "Pin", "Reservation", "DiskTier",
    "LFU", "LRU", "S3FIFO", "EvictionPolicy", "make_policy", "TieredStore",
]
