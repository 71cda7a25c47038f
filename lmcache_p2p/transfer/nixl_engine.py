"""One NIXL agent per process: the CPU pool registered once, READs driven without a spinning thread.

The Python wrapper's progress thread busy-spins a core (it hard-codes a zero delay), so it is
off. Progress is driven here instead, on the agent's asyncio loop and only while needed:

- initiator: ``read`` posts one READ for a whole request and polls ``check_xfer_state``
  (yielding to the loop between polls) until it is done; with UCX ``cma`` on one host the
  post itself usually completes the copy. A READ whose wait ends early (deadline, cancellation)
  is polled to its end by a reaper task, its destinations quarantined by the caller until then.
- target: a one-sided READ over ``cma`` needs nothing from the target once the endpoints are
  wired up, but wire-up does: a target that never progresses hangs the first READ. The server
  calls :meth:`keep_progress` on every NIXL handshake and pin, which polls the worker every
  millisecond until the window closes. An idle agent uses no CPU.

Every NIXL/UCX failure leaves this module as a :class:`TransferError`. All calls must come
from the one loop thread (the agent is created with no thread synchronisation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..aio import cancel_and_wait
from ..errors import PeerTimeout, TransferError
from ..tiers.cpu_pool import CpuPool

log = logging.getLogger(__name__)

_SPIN_POLLS = 5000  # polls that only yield to the loop before backing off to 1 ms sleeps
_PROGRESS_PERIOD_S = 0.001
_REAP_PERIOD_S = 0.01


class ReadOverrun(PeerTimeout):
    """A READ ran past its deadline. It may still land: its group went to ``read``'s ``quarantine``."""


Quarantine = Callable[[range, asyncio.Future[str]], None]
"""``quarantine(indices, landed)``: the READ of those descriptors is still in flight; their local
destinations must not be reused until ``landed`` completes (with the READ's final state)."""


def nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True


@contextlib.contextmanager
def _nixl_errors(what: str) -> Iterator[None]:
    try:
        yield
    except TransferError:
        raise
    except Exception as exc:  # the bindings raise their own exception types
        raise TransferError(f"NIXL {what} failed: {type(exc).__name__}: {exc}") from exc


def _groups(lengths: Sequence[int], group_bytes: int) -> Iterator[range]:
    start, total = 0, 0
    for i, n in enumerate(lengths):
        total += n
        if total >= group_bytes:
            yield range(start, i + 1)
            start, total = i + 1, 0
    if start < len(lengths):
        yield range(start, len(lengths))


def _descs(addrs: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    return [(a, n, 0) for a, n in zip(addrs, lengths, strict=True)]


class NixlEngine:
    def __init__(self, name: str, pool: CpuPool) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise TransferError("nixl is not installed (pip install 'lmcache-p2p[nixl]')") from exc
        self.name = name
        self.pool = pool
        with _nixl_errors("agent creation"):
            conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
            self._agent: Any = nixl_agent(name, conf)
            if "UCX" not in self._agent.backends:
                raise TransferError("NIXL UCX backend is not available")
            self._reg = self._agent.register_memory([(pool.base_address, pool.capacity_bytes, 0, "")], "DRAM")
        self._remotes: dict[str, bytes] = {}
        self._progress_until = 0.0
        self._progress_task: asyncio.Task[None] | None = None
        self._reapers: set[asyncio.Task[None]] = set()
        self.late_reads = 0  # abandoned READs that ended later (their slots were held until then)
        self._closed = False

    # -- metadata ----------------------------------------------------------------------------
    def agent_metadata(self) -> bytes:
        """Goes into the node record / handshake: what a peer needs to READ this pool."""
        with _nixl_errors("metadata export"):
            return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's agent metadata (idempotent); returns the remote agent name."""
        for name, md in self._remotes.items():
            if md == metadata:
                return name
        with _nixl_errors("remote metadata load"):
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name in self._remotes:  # the peer restarted under the same name
                self._agent.remove_remote_agent(name)
                name = self._agent.add_remote_agent(metadata)
                name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes[name] = metadata
        return name

    @property
    def reads_abandoned(self) -> int:
        """READs abandoned in flight (deadline, cancellation) that NIXL has not reported over yet."""
        return len(self._reapers)

    def forget_remote(self, name: str) -> None:
        if self._remotes.pop(name, None) is not None:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(name)

    # -- initiator ------------------------------------------------------------------------------
    async def read(
        self,
        remote: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        deadline: float,
        *,
        quarantine: Quarantine | None = None,
        on_group: Callable[[range], None] | None = None,
        group_bytes: int = 16 << 20,
    ) -> None:
        """One-sided READ of ``remote_addrs`` into our ``local_addrs``; raises on error or deadline.

        The descriptors are prepared once and read in groups of about ``group_bytes``;
        ``on_group(indices)`` runs as each group lands, so callers can check it while the next
        group is in flight (the READ and xxhash both release the GIL).

        No late writes: however the wait for a group ends before NIXL reported it over (the
        deadline: :class:`ReadOverrun`; the caller's cancellation; a failed poll), that group goes
        to ``quarantine`` before the exception propagates, and is polled to its end in the
        background. Groups never posted, and groups that ended, are the caller's again at once.
        Every caller whose destinations can be reused must pass ``quarantine`` (only a raw
        benchmark READ into buffers nothing else uses goes without).
        """
        if not lengths:
            return
        with _nixl_errors("READ preparation"):
            local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(local_addrs, lengths), "DRAM")
            far = self._agent.prep_xfer_dlist(remote, _descs(remote_addrs, lengths), "DRAM")
        in_flight: list[asyncio.Future[str]] = []  # the one group left in flight, if any

        def abandoned(group: range, landed: asyncio.Future[str]) -> None:
            in_flight.append(landed)
            if quarantine is not None:
                quarantine(group, landed)

        def release_dlists(*_: object) -> None:
            for dlist in (local, far):
                with contextlib.suppress(Exception):
                    dlist.release()

        try:
            for group in _groups(lengths, group_bytes):
                await self._read_group(remote, local, far, group, deadline, abandoned)
                if on_group is not None:
                    on_group(group)
        finally:
            if in_flight:
                in_flight[0].add_done_callback(release_dlists)  # still in use by the abandoned READ
            else:
                release_dlists()

    async def _read_group(self, remote: str, local: Any, far: Any, group: range, deadline: float,
                          abandoned: Quarantine) -> None:
        idx = list(group)
        with _nixl_errors("READ preparation"):
            handle = self._agent.make_prepped_xfer("READ", local, idx, far, idx)
        state = "ERR"
        try:
            with _nixl_errors("READ"):
                state = self._agent.transfer(handle)
                polls = 0
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise ReadOverrun(f"NIXL READ from {remote} ran past its deadline")
                    polls += 1
                    await asyncio.sleep(0 if polls < _SPIN_POLLS else _PROGRESS_PERIOD_S)
                    state = self._agent.check_xfer_state(handle)
                if state != "DONE":
                    raise TransferError(f"NIXL READ from {remote} failed ({state})")
        except BaseException:
            if state == "PROC":  # posted, not over: it may still write its destinations
                landed = self._abandon(handle)
                state = "ABANDONED"
                abandoned(group, landed)
            raise
        finally:
            if state != "ABANDONED":
                self._release(handle, state)

    def _abandon(self, handle: Any) -> asyncio.Future[str]:
        """Hand an in-flight READ to a reaper; the future completes when NIXL says it is over."""
        loop = asyncio.get_running_loop()
        landed: asyncio.Future[str] = loop.create_future()
        reaper = loop.create_task(self._reap(handle, landed), name="nixl-reap")
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)
        return landed

    async def _reap(self, handle: Any, landed: asyncio.Future[str]) -> None:
        """Poll an abandoned READ until it is over, then release it and say so."""
        state = "PROC"
        try:
            while state == "PROC" and not self._closed:
                await asyncio.sleep(_REAP_PERIOD_S)
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception as exc:  # an error state is an end too
                    log.info("abandoned NIXL READ ended in an error: %s", exc)
                    state = "ERR"
            if state != "PROC":
                self._release(handle, state)
                self.late_reads += 1
        finally:
            if not landed.done() and state != "PROC":
                landed.set_result(state)  # only now may the slots be reused

    def _release(self, handle: Any, state: str) -> None:
        try:
            handle.release()
        except Exception as exc:  # an in-flight READ cannot be released; NIXL retries at teardown
            log.warning("NIXL transfer handle not released (state %s): %s", state, exc)

    # -- target ------------------------------------------------------------------------------------
    def keep_progress(self, seconds: float) -> None:
        """Drive this agent's UCX worker for the next ``seconds`` (call from the loop thread)."""
        if self._closed:
            return
        self._progress_until = max(self._progress_until, time.monotonic() + seconds)
        if self._progress_task is None or self._progress_task.done():
            self._progress_task = asyncio.get_running_loop().create_task(self._progress_loop())

    async def _progress_loop(self) -> None:
        while time.monotonic() < self._progress_until and not self._closed:
            self.progress()
            await asyncio.sleep(_PROGRESS_PERIOD_S)

    def progress(self) -> None:
        """One progress pass of the worker (also collects notifications, which we do not use)."""
        try:
            self._agent.get_new_notifs()
        except Exception as exc:
            log.warning("NIXL progress failed: %s", exc)

    async def close(self) -> None:
        self._closed = True
        for reaper in list(self._reapers):
            await cancel_and_wait(reaper)
        await cancel_and_wait(self._progress_task)
        for name in list(self._remotes):
            self.forget_remote(name)
        with contextlib.suppress(Exception):
            self._agent.deregister_memory(self._reg)
