"""The tiered store: the CPU pool in front of an optional disk tier.

    read:   CPU hit -> copy out
            disk hit -> read + verify into the caller's buffer, then promote into CPU
    store:  into CPU; a CPU victim is copied out of its slot (memory only) and written back to disk
            by the tier worker (when a disk tier exists); until then reads find it in the staging
            map. Past ``STAGING_BYTES`` of pending write-backs a victim is dropped (counted).

No disk I/O happens under a tier's lock, in an eviction callback or on the caller's thread of a
store: :class:`TierWorker` does the write-backs and the promotions asked for with
:meth:`promote_later`.

``listener(key, tier)`` hears where each chunk now lives ("cpu", "disk", or None when no tier
holds it any more); the index publisher subscribes to it. It is called with tier locks held,
so it must only enqueue.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from ..chunk import ChunkHeader, make_header
from ..config import TierConfig
from ..errors import TierError
from ..ids import NO_ORIGIN, NodeDigest
from ..keys import ChunkKey, FingerprintDigest, HeadRange
from .cpu_pool import CpuPool, Reservation
from .disk import DiskTier
from .eviction import make_policy
from .worker import TierWorker

log = logging.getLogger(__name__)
Listener = Callable[[ChunkKey, str | None], None]
STAGING_BYTES = 256 << 20  # evicted chunks waiting for the tier worker to write them to disk
Admit = Callable[[ChunkHeader], bool]
Spill = Callable[[ChunkHeader, memoryview | Path], bool]


class TieredStore:
    def __init__(self, cpu: CpuPool, disk: DiskTier | None = None, *, listener: Listener | None = None,
                 admit: Admit | None = None, spill: Spill | None = None) -> None:
        self.cpu = cpu
        self.disk = disk
        self._listener = listener
        self._admit = admit
        self.writeback_dropped = 0  # CPU victims dropped because STAGING_BYTES were already pending
        self.worker: TierWorker | None = None
        self._staged: dict[ChunkKey, tuple[ChunkHeader, bytes]] = {}  # evicted, not yet on disk
        self._staged_bytes = 0
        self._staging_lock = threading.Lock()
        self._spill = spill
        cpu.listen_evictions(self._on_cpu_evict)  # the store owns both tiers' wiring
        if disk is not None:
            disk.listen_evictions(self._on_disk_evict)
            self.worker = TierWorker(self._write_back_now, self.ensure_in_cpu)
            if spill is not None:  # a disk victim the CPU pool still holds has not left this node
                disk.spill = lambda header, path: not self.cpu.contains(header.key) and spill(header, path)

    @classmethod
    def from_config(cls, config: TierConfig, slot_bytes: int, *, listener: Listener | None = None,
                    admit: Admit | None = None, stamp: Callable[[ChunkHeader], ChunkHeader] | None = None,
                    evict_first: Callable[[ChunkKey], bool] | None = None, spill: Spill | None = None) -> TieredStore:
        """``admit(header)`` gates every chunk entering the store (see :class:`CpuPool`) and every
        chunk recovered from disk; ``listener(key, tier)`` hears every chunk entering or leaving a
        tier (not those :meth:`recover` finds: their caller announces what it keeps); ``stamp`` and
        ``evict_first`` go to the CPU pool.

        ``spill(header, data)`` hears every chunk leaving the last tier by eviction (not by removal)
        with its bytes: the CPU slot's (a view, valid only during the call) or the disk tier's file (the
        hook may move it away; True: it did, or it copied the view). Called with tier locks held: it
        must only copy, rename and enqueue (the object tier's uploads, ``objects/tier.py``)."""
        cpu = CpuPool(config.cpu_capacity, slot_bytes, policy=make_policy(config.eviction), admit=admit,
                      stamp=stamp, evict_first=evict_first)
        disk = None
        if config.disk_path:
            disk = DiskTier(config.disk_path, config.disk_capacity, policy=make_policy(config.eviction))
        return cls(cpu, disk, listener=listener, admit=admit, spill=spill)

    def set_eviction(self, name: str) -> None:
        """Switch every tier to eviction policy ``name`` (``lru``, ``lfu``, ``s3fifo``) while running."""
        self.cpu.set_policy(make_policy(name))
        if self.disk is not None:
            self.disk.set_policy(make_policy(name))

    def _spill_out(self, header: ChunkHeader, view: memoryview | None) -> None:
        if self._spill is None or view is None:
            return
        try:
            self._spill(header, view)
        except Exception:  # an eviction must complete whatever the hook does
            log.exception("spilling %s failed", header.key.hex())

    def _notify(self, key: ChunkKey, tier: str | None) -> None:
        if self._listener is not None:
            self._listener(key, tier)

    # -- eviction wiring ------------------------------------------------------------------------
    def _on_cpu_evict(self, header: ChunkHeader, view: memoryview | None) -> None:
        """Under the pool lock: no I/O, one memcpy. The victim's bytes go to the staging map and
        the worker writes them to disk; past the staging budget the victim is dropped."""
        key = header.key
        if self.disk is None or self.worker is None or view is None:
            self._spill_out(header, view)
            self._notify(key, None)
            return
        if self.disk.contains(key):
            self._notify(key, "disk")
            return
        with self._staging_lock:
            if self._staged_bytes + header.length > STAGING_BYTES:
                self.writeback_dropped += 1
                staged = False
            else:
                self._staged[key] = (header, bytes(view[: header.length]))
                self._staged_bytes += header.length
                staged = True
        if staged:
            self.worker.write_back(key)
        else:
            self._spill_out(header, view)
        self._notify(key, "disk" if staged else None)

    def _write_back_now(self, key: ChunkKey) -> None:
        """On the tier worker: write a staged victim to disk, unless it was removed meanwhile."""
        with self._staging_lock:
            item = self._staged.get(key)
        if item is None or self.disk is None:
            return
        try:
            self.disk.put(item[0], memoryview(item[1]))
        except TierError as exc:
            log.warning("write-back of %s to disk failed: %s", key.hex(), exc)
        with self._staging_lock:
            current = self._staged.get(key)
            if current is item:
                del self._staged[key]
                self._staged_bytes -= item[0].length
        if current is not item:  # removed (e.g. invalidated) while it was being written: no resurrection
            self.disk.remove(key)
        elif not self.disk.contains(key) and not self.cpu.contains(key):
            self._notify(key, None)

    def _staged_copy(self, key: ChunkKey) -> tuple[ChunkHeader, bytes] | None:
        with self._staging_lock:
            return self._staged.get(key)

    def promote_later(self, key: ChunkKey) -> None:
        """Bring a disk chunk into the CPU pool on the tier worker (callers that must not do I/O)."""
        if self.worker is not None and self.disk is not None and (self.disk.contains(key) or key in self._staged):
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
            epoch: int = 0, heads: HeadRange = (0, 1), origin: NodeDigest = NO_ORIGIN) -> ChunkHeader | None:
        """Checksum and store; None when the admission hook refused the chunk."""
        header = make_header(key, fingerprint, payload, num_tokens, epoch, heads, origin)
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
        if self.disk is not None and (self.disk.contains(key) or key in self._staged):
            return "disk"
        return None

    def header(self, key: ChunkKey) -> ChunkHeader | None:
        header = self.cpu.header(key)
        if header is None and self.disk is not None:
            header = self.disk.header(key)
        if header is None:
            staged = self._staged_copy(key)
            header = staged[0] if staged is not None else None
        return header

    def read_into(self, key: ChunkKey, dst: memoryview) -> ChunkHeader | None:
        header = self.cpu.read_into(key, dst)
        if header is not None or self.disk is None:
            return header
        staged = self._staged_copy(key)
        if staged is not None:  # evicted a moment ago, on its way to disk: the bytes are right here
            header, data = staged
            dst[: header.length] = data
            self._promote(header, dst)
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

    def holds(self, key: ChunkKey, heads: HeadRange) -> bool:
        """The chunk is held, in some tier, with exactly ``heads`` (a TP rank's, or all)."""
        header = self.header(key)
        return header is not None and header.heads == heads

    def admits(self, header: ChunkHeader) -> bool:
        """Whether the admission gate lets this chunk in now (and so out to an engine: a standing
        invalidation or a quarantine may have come since it was stored); a refusal is counted there."""
        return self._admit is None or self._admit(header)

    def ensure_in_cpu(self, key: ChunkKey) -> bool:
        """Make a chunk servable from CPU memory (peers read slots); promotes a disk hit."""
        if self.cpu.contains(key):
            return True
        staged = self._staged_copy(key)
        if self.disk is None or (staged is None and not self.disk.contains(key)):
            return False
        res = self.cpu.reserve()
        try:
            if staged is not None:
                header: ChunkHeader | None = staged[0]
                res.view[: staged[0].length] = staged[1]
            else:
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
        with self._staging_lock:
            staged = self._staged.pop(key, None)
            if staged is not None:
                self._staged_bytes -= staged[0].length
        removed = self.cpu.remove(key) or staged is not None
        if self.disk is not None:
            removed = self.disk.remove(key) or removed
        if removed:
            self._notify(key, None)
        return removed

    def recover(self) -> list[ChunkHeader]:
        """Rescan the disk tier (on start); returns the valid chunks found that the admission
        hook accepts (the others are deleted). The listener hears none of them: the caller vets and
        announces what it keeps."""
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
            with self._staging_lock:
                out.update((k, "disk") for k in self._staged)
        out.update((k, "cpu") for k in self.cpu.keys())
        return out

    @property
    def used_bytes(self) -> dict[str, int]:
        used = {"cpu": self.cpu.used_bytes}
        if self.disk is not None:
            used["disk"] = self.disk.used_bytes
        return used
