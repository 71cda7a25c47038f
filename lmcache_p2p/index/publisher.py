"""Writes this node's block entries and node record to etcd, in batches, under the session lease.

The publisher keeps the node's *desired* state (``(fingerprint, key) -> tier``) and a set of
dirty entries. ``add``/``remove`` (any thread) update both and return at once; the flush task on
the loop coalesces for ``coalesce_s``, then writes the dirty entries as txns of at most
``txn_ops`` operations, ``max_inflight`` txns concurrently (etcd folds concurrent proposals into
one raft entry and one fsync)::

    engine thread:  add(k1) add(k2) remove(k1) add(k3) ...      (dict + set update, no I/O)
    loop:           sleep(coalesce) -> take <= 128*8 dirty -> 8 txns in parallel -> repeat

Each write reads the desired state at the moment it is taken, so a failed txn is simply marked
dirty again: retries never duplicate or resurrect an entry, and puts/deletes are idempotent.
Without a session (etcd down at start) or with a lost lease, writing waits until
:meth:`set_session` gives a new one, which marks the whole desired state (and the node record)
dirty (everything is republished). The desired state is bounded by what the node holds, so an
outage of any length costs memory proportional to the node's chunks, and the publisher
converges on reconnect. The flush task is supervised: an unexpected error is logged, counted
and retried, never the end of publishing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable

from ..aio import cancel_and_wait
from ..backoff import jittered
from ..errors import IndexError_, LeaseLost
from ..keys import ChunkKey, FingerprintDigest
from .client import EtcdClient, is_transient, op_delete, op_put
from .schema import NodeRecord, Schema
from .session import Session

log = logging.getLogger(__name__)

TXN_MAX_OPS = 128  # etcd's default --max-txn-ops
_Entry = tuple[FingerprintDigest, ChunkKey]


class Publisher:
    def __init__(self, client: EtcdClient, schema: Schema, record: NodeRecord, session: Session | None,
                 *, coalesce_s: float = 0.003, txn_ops: int = TXN_MAX_OPS, max_inflight: int = 8) -> None:
        if not 1 <= txn_ops <= TXN_MAX_OPS:
            raise ValueError(f"txn_ops must be in [1, {TXN_MAX_OPS}], got {txn_ops}")
        self._client = client
        self._schema = schema
        self._record = record
        self._node = record.node_id.encode()
        self._session = session
        self._coalesce_s = coalesce_s
        self._txn_ops = txn_ops
        self._max_inflight = max_inflight
        self._lock = threading.Lock()
        self._state: dict[_Entry, int] = {}
        self._dirty: set[_Entry] = set()
        self._record_dirty = True
        self._inflight = 0
        self._pending_since: float | None = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._new_session = asyncio.Event()  # cuts a failure backoff short: a new lease is worth trying at once
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.written_total = 0
        self.txns_total = 0
        self.errors_total = 0

    # ---- any thread ------------------------------------------------------------------------
    def add(self, fp: FingerprintDigest, key: ChunkKey, tier: int) -> None:
        """Announce that this node holds ``key`` in ``tier`` (0..255). Never blocks on I/O."""
        self.add_many(fp, (key,), tier)

    def add_many(self, fp: FingerprintDigest, keys: Iterable[ChunkKey], tier: int) -> None:
        if not 0 <= tier <= 255:
            raise ValueError(f"tier must be in [0, 255], got {tier}")
        with self._lock:
            was_clean = not self._dirty
            for key in keys:
                entry = (fp, key)
                if self._state.get(entry) != tier:
                    self._state[entry] = tier
                    self._dirty.add(entry)
            self._wake_if(was_clean)

    def remove(self, fp: FingerprintDigest, key: ChunkKey) -> None:
        """Withdraw ``key`` (evicted). Removing an unknown key is a no-op."""
        self.remove_many(fp, (key,))

    def remove_many(self, fp: FingerprintDigest, keys: Iterable[ChunkKey]) -> None:
        with self._lock:
            was_clean = not self._dirty
            for key in keys:
                if self._state.pop((fp, key), None) is not None:
                    self._dirty.add((fp, key))
            self._wake_if(was_clean)

    def set_record(self, record: NodeRecord) -> None:
        """Replace the node record (e.g. a new fingerprint served); written with the next flush."""
        with self._lock:
            self._record = record
            self._record_dirty = True
            self._wake_if(True)

    @property
    def pending(self) -> int:
        """Entries not yet confirmed by etcd (queued or in flight)."""
        return len(self._dirty) + self._inflight

    @property
    def lag_s(self) -> float:
        """Age of the oldest unconfirmed change; 0 when everything is published."""
        since = self._pending_since
        return 0.0 if since is None else time.monotonic() - since

    def held(self) -> int:
        return len(self._state)

    def _wake_if(self, was_clean: bool) -> None:
        if was_clean and self._loop is not None:
            if self._pending_since is None:
                self._pending_since = time.monotonic()
            self._loop.call_soon_threadsafe(self._wake.set)

    # ---- loop ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="index-publisher")
        self._wake.set()

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def flush(self, timeout: float) -> None:
        """Wait until every change so far is confirmed by etcd (tests, benchmarks, shutdown)."""
        self._wake.set()
        async with asyncio.timeout(timeout):
            while self.pending or self._record_dirty:
                self._idle.clear()
                await self._idle.wait()

    @property
    def record(self) -> NodeRecord:
        return self._record

    def set_session(self, session: Session) -> None:
        """Continue under a new lease: republish the node record and the whole desired state."""
        with self._lock:
            self._session = session
            self._dirty.update(self._state)
            self._record_dirty = True
            self._wake_if(True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._new_session.set)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self._coalesce_s)
            self._new_session.clear()  # a lease taken from now on cuts the backoff below short
            try:
                ok = await self._drain()
            except Exception:
                self.errors_total += 1
                log.exception("publisher: unexpected error; retrying")
                with self._lock:
                    self._inflight = 0
                ok = False
            if ok:
                backoff = 0.05
                self._idle.set()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(jittered(backoff)):
                        await self._new_session.wait()
                backoff = 0.05 if self._new_session.is_set() else min(backoff * 2, 2.0)
                self._wake.set()

    async def _drain(self) -> bool:
        """Write until nothing is dirty; False after a failure (the caller backs off)."""
        while True:
            session = self._session
            if session is None or session.is_done():
                return True  # blocked until set_session(); nothing to do meanwhile
            if self._record_dirty:
                self._record_dirty = False
                if not await self._write_record(session):
                    return False
            batch = self._take(self._txn_ops * self._max_inflight)
            if not batch:
                self._pending_since = None if not self._dirty else self._pending_since
                return True
            if not await self._write(batch, session):
                return False

    def _take(self, n: int) -> list[tuple[_Entry, int | None]]:
        with self._lock:
            out: list[tuple[_Entry, int | None]] = []
            while self._dirty and len(out) < n:
                entry = self._dirty.pop()
                out.append((entry, self._state.get(entry)))
            self._inflight = len(out)
            return out

    async def _write_record(self, session: Session) -> bool:
        try:
            await self._client.put(self._schema.node(self._record.node_id), self._record.pack(), session.lease_id)
            return True
        except IndexError_ as exc:
            self._record_dirty = True
            self._failed(exc)
            return False

    async def _write(self, batch: list[tuple[_Entry, int | None]], session: Session) -> bool:
        lease = session.lease_id
        blocks = self._schema.blocks
        txns = []
        for i in range(0, len(batch), self._txn_ops):
            ops = []
            for (fp, key), tier in batch[i:i + self._txn_ops]:
                etcd_key = b"%s%s/%s/%s" % (blocks, fp.hex().encode(), key.hex().encode(), self._node)
                if tier is None:
                    ops.append(op_delete(etcd_key))
                else:
                    ops.append(op_put(etcd_key, bytes((tier,)), lease=lease))
            txns.append(ops)
        results = await asyncio.gather(*(self._client.txn((), ops) for ops in txns), return_exceptions=True)
        ok = True
        for i, res in enumerate(results):
            part = batch[i * self._txn_ops:(i + 1) * self._txn_ops]
            if isinstance(res, BaseException):
                if isinstance(res, asyncio.CancelledError):
                    raise res
                ok = False
                self._failed(res if isinstance(res, IndexError_) else IndexError_(f"txn: {res!r}"))
                with self._lock:
                    self._dirty.update(entry for entry, _ in part)  # re-read desired state on retry
            else:
                self.written_total += len(part)
                self.txns_total += 1
        self._inflight = 0
        return ok

    def _failed(self, exc: IndexError_) -> None:
        self.errors_total += 1
        if isinstance(exc, LeaseLost):
            log.warning("publisher: the lease is gone, waiting for a new session")
        elif is_transient(exc):
            log.info("publisher: transient etcd error, will retry: %s", exc)
        else:
            log.error("publisher: etcd write failed, will retry: %s", exc)
