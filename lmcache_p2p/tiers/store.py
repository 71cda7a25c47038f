"""The tiered store: the CPU pool in front of an optional disk tier.

    read:   CPU hit -> copy out
            disk hit -> read + verify into the caller's buffer, then promote into CPU
    store:  into CPU; written behind to disk by the tier worker (when a disk tier exists), so a
            CPU victim is usually on disk already when it is evicted (else it is dropped, counted)

No disk I/O happens under a tier's lock or in an eviction callback: :class:`TierWorker` does the
write-behind and the promotions asked for with :meth:`promote_later`.

``listener(key, tier)`` hears where each chunk now lives ("cpu", "disk", or None when no tier
holds it any more); the index publisher subscribes to it. It is called with tier locks held,
so it must only enqueue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..chunk import ChunkHeader, make_header
from ..config import TierConfig
from ..errors import TierError
from ..keys import ChunkKey, FingerprintDigest
from .cpu_pool import CpuPool, Reservation
from .disk import DiskTier
from .eviction import make_policy
from .worker import TierWorker

log = logging.getLogger(__name__)
Listener = Callable[[ChunkKey, str | None], None]
Admit = Callable[[ChunkHeader], bool]


class TieredStore:
    def __init__(self, cpu: CpuPool, disk: DiskTier | None = None, *, listener: Listener | None = None,
                 admit: Admit | None = None) -> None:
        self.cpu = cpu
        self.disk = disk
        self._listener = listener
        self._admit = admit
        self.writeback_dropped = 0  # CPU victims evicted before the worker wrote them to disk
        self.worker: TierWorker | None = None
        cpu._on_evict = self._on_cpu_evict  # noqa: SLF001 - the store owns both tiers' wiring
        if disk is not None:
            disk._on_evict = self._on_disk_evict  # noqa: SLF001
            self.worker = TierWorker(self._write_back_now, self.ensure_in_cpu)
            cpu._on_commit = self._on_cpu_commit  # noqa: SLF001

    @classmethod
    def from_config(cls, config: TierConfig, slot_bytes: int, *, listener: Listener | None = None,
                    admit: Admit | None = None) -> TieredStore:
        """``admit(header)`` gates every chunk entering the store (see :class:`CpuPool`) and every
        chunk recovered from disk."""
        cpu = CpuPool(config.cpu_capacity, slot_bytes, policy=make_policy(config.eviction), admit=admit)
        disk = None
        if config.disk_path:
            disk = DiskTier(config.disk_path, config.disk_capacity, policy=make_policy(config.eviction))
        return cls(cpu, disk, listener=listener, admit=admit)

    def set_listener(self, listener: Listener | None) -> None:
        self._listener = listener

    def _notify(self, key: ChunkKey, tier: str | None) -> None:
        if self._listener is not None:
            self._listener(key, tier)

    # -- eviction wiring ------------------------------------------------------------------------
    def _on_cpu_evict(self, header: ChunkHeader, _view: memoryview | None) -> None:
        """Under the pool lock: no I/O. The victim lives on if the worker already wrote it to disk."""
        if self.disk is not None and self.disk.contains(header.key):
            self._notify(header.key, "disk")
            return
        if self.disk is not None:
            self.writeback_dropped += 1
        self._notify(header.key, None)

    def _on_cpu_commit(self, header: ChunkHeader) -> None:
        if self.worker is not None:
            self.worker.write_back(header.key)

    def _write_back_now(self, key: ChunkKey) -> None:
        """On the tier worker: copy a CPU chunk to disk under a pin (the slot can't be reused meanwhile)."""
        if self.disk is None or self.disk.contains(key):
            return
        pin = self.cpu.pin(key, 60.0)
        if pin is None:
            return  # evicted or removed before its turn
        try:
            self.disk.put(pin.header, self.cpu.slot_view(pin.slot, pin.header.length))
        finally:
            self.cpu.unpin(pin)

    def promote_later(self, key: ChunkKey) -> None:
        """Bring a disk chunk into the CPU pool on the tier worker (callers that must not do I/O)."""
        if self.worker is not None and self.disk is not None and self.disk.contains(key):
            self.worker.promote(key)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    def _on_disk_evict(self, header: ChunkHeader, _view: memoryview | None) -> None:
        if not self.cpu.contains(header.key):
            self._notify(header.key, None)

    # -- API --------------------------------------------------------------------------------------
    def put(self, key: ChunkKey, fingerprint: FingerprintDigest, payload: memoryview, num_tokens: int,
            epoch: int = 0) -> ChunkHeader | None:
        """Checksum and store; None when the admission hook refused the chunk."""
        header = make_header(key, fingerprint, payload, num_tokens, epoch)
        return header if self.put_verified(header, payload) else None

    def put_verified(self, header: ChunkHeader, payload: memoryview) -> bool:
        """Store bytes whose checksum is already in ``header``; False if refused."""
        if not self.cpu.put(header, payload):
            return False
        self._notify(header.key, "cpu")
        return True

    def commit_reserved(self, reservation: Reservation, header: ChunkHeader) -> bool:
        """Publish a CPU slot the caller filled (its checksum is in ``header``); False if refused
        (the slot is released)."""
        if not self.cpu.commit(reservation, header):
            return False
        self._notify(header.key, "cpu")
        return True

    def where(self, key: ChunkKey) -> str | None:
        if self.cpu.contains(key):
            return "cpu"
        if self.disk is not None and self.disk.contains(key):
            return "disk"
        return None

    def header(self, key: ChunkKey) -> ChunkHeader | None:
        header = self.cpu.header(key)
        if header is None and self.disk is not None:
            header = self.disk.header(key)
        return header

    def read_into(self, key: ChunkKey, dst: memoryview) -> ChunkHeader | None:
        header = self.cpu.read_into(key, dst)
        if header is not None or self.disk is None:
            return header
        header = self.disk.read_into(key, dst)
        if header is not None and self._admit is not None and not self._admit(header):
            self.remove(key)
            header = None
        if header is None:
            if not self.cpu.contains(key):
                self._notify(key, None)
            return None
        self._promote(header, dst)
        return header

    def ensure_in_cpu(self, key: ChunkKey) -> bool:
        """Make a chunk servable from CPU memory (peers read slots); promotes a disk hit."""
        if self.cpu.contains(key):
            return True
        if self.disk is None or not self.disk.contains(key):
            return False
        res = self.cpu.reserve()
        try:
            header = self.disk.read_into(key, res.view)
        except BaseException:
            self.cpu.release(res)
            raise
        if header is None:
            self.cpu.release(res)
            self._notify(key, None)
            return False
        if not self.cpu.commit(res, header):
            self.remove(key)  # covered by an invalidation: the disk copy goes too
            return False
        self._notify(key, "cpu")
        return True

    def _promote(self, header: ChunkHeader, payload: memoryview) -> None:
        try:
            if self.cpu.put(header, payload[: header.length]):
                self._notify(header.key, "cpu")
        except TierError as exc:
            log.debug("promotion of %s skipped: %s", header.key.hex(), exc)

    def remove(self, key: ChunkKey) -> bool:
        removed = self.cpu.remove(key)
        if self.disk is not None:
            removed = self.disk.remove(key) or removed
        if removed:
            self._notify(key, None)
        return removed

    def recover(self) -> list[ChunkHeader]:
        """Rescan the disk tier (on start); returns the valid chunks found that the admission
        hook accepts (the others are deleted)."""
        if self.disk is None:
            return []
        scratch = memoryview(bytearray(self.cpu.slot_bytes))
        found = []
        for header in self.disk.rescan(scratch):
            if self._admit is not None and not self._admit(header):
                self.disk.remove(header.key)
                self.cpu.stats.refused += 1
                continue
            found.append(header)
            self._notify(header.key, "disk")
        return found

    def flush_to_disk(self) -> int:
        """Write every CPU chunk the disk tier lacks to disk (on shutdown); returns how many."""
        if self.disk is None:
            return 0
        written = 0
        for key in self.cpu.keys():
            if self.disk.contains(key):
                continue
            pin = self.cpu.pin(key, 60.0)
            if pin is None:
                continue
            try:
                self.disk.put(pin.header, self.cpu.slot_view(pin.slot, pin.header.length))
                written += 1
            except TierError as exc:
                log.warning("flush of %s to disk failed: %s", key.hex(), exc)
            finally:
                self.cpu.unpin(pin)
        return written

    def inventory(self) -> dict[ChunkKey, str]:
        """Every chunk held, with its fastest tier."""
        out: dict[ChunkKey, str] = {}
        if self.disk is not None:
            out.update((k, "disk") for k in self.disk.keys())
        out.update((k, "cpu") for k in self.cpu.keys())
        return out

    @property
    def used_bytes(self) -> dict[str, int]:
        used = {"cpu": self.cpu.used_bytes}
        if self.disk is not None:
            used["disk"] = self.disk.used_bytes
        return used
