"""One NIXL agent per process: the CPU pool registered once, every agent call on the agent's own thread.

The Python wrapper's progress thread busy-spins a core (it hard-codes a zero delay), so it is
off, and the agent is created without thread synchronisation: after creation every call to it is
made in order on one thread of the engine's (``nixl-agent``). The loop hands work there and never
waits on the agent: with UCX ``cma`` on one host posting a READ *is* the copy (the post returns once
the bytes are in), so the copy runs on the agent thread while the loop stages the next pin batch,
has landed groups checked and commits them.

- initiator: ``read`` gives the agent thread a job that posts the READ's groups (``GROUP_BYTES``
  each) back to back, reporting each to the loop as it lands. A post that comes back in progress
  (RDMA, UCX over TCP) ends the job: the loop polls that group to its end, then the rest are posted.
  A READ whose wait ends early (deadline, cancellation) is polled to its end by a reaper task, its
  destinations quarantined by the caller until then; groups not yet posted never are.
- target: a one-sided READ over ``cma`` needs nothing from the target once the endpoints are
  wired up, but wire-up does: a target that never progresses hangs the first READ. The server
  calls :meth:`keep_progress` on every NIXL handshake and pin, which polls the worker every
  millisecond until the window closes. An idle agent uses no CPU.

Every NIXL/UCX failure leaves this module as a :class:`TransferError`. The async methods are called
from the one loop thread that owns the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ..aio import cancel_and_wait
from ..errors import PeerTimeout, TransferError
from ..tiers.cpu_pool import CpuPool

log = logging.getLogger(__name__)

GROUP_BYTES = 16 << 20  # a READ is posted in groups of about this much: each is checked while the next one lands
_SPIN_POLLS = 5000  # polls that only yield to the loop before backing off to 1 ms sleeps
_PROGRESS_PERIOD_S = 0.001
_REAP_PERIOD_S = 0.01

T = TypeVar("T")


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


@dataclasses.dataclass(slots=True)
class _Post:
    """What the agent thread did with one group: posted it (``handle``, the state the post returned), or
    not (``handle`` None: the deadline or a stop came first, or ``error``)."""

    handle: Any = None
    state: str = "UNPOSTED"
    error: Exception | None = None


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
            self._metadata = bytes(self._agent.get_agent_metadata())  # fixed once the pool is registered
        # Every agent call from here on runs on this thread, in order (no synchronisation in the agent).
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl-agent")
        self._remotes: dict[str, bytes] = {}
        self._loading: dict[bytes, asyncio.Future[str]] = {}  # metadata being loaded on the agent thread
        self._progress_until = 0.0
        self._progress_task: asyncio.Task[None] | None = None
        self._reapers: set[asyncio.Task[None]] = set()
        self.late_reads = 0  # abandoned READs that ended later (their slots were held until then)
        self._closed = False

    def _call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run ``fn(*args)`` on the agent thread."""
        return asyncio.wrap_future(self._thread.submit(fn, *args))

    # -- metadata ----------------------------------------------------------------------------
    def agent_metadata(self) -> bytes:
        """Goes into the node record / handshake: what a peer needs to READ this pool."""
        return self._metadata

    async def add_remote(self, metadata: bytes) -> str:
        """Load a peer's agent metadata (idempotent; pulls to a new peer at once share one load); returns the
        remote agent name."""
        for name, md in self._remotes.items():
            if md == metadata:
                return name
        if self._closed:
            raise TransferError("NIXL engine is closed")
        loading = self._loading.get(metadata)
        if loading is None:
            loading = self._loading[metadata] = self._call(self._load_remote, metadata, set(self._remotes))
            loading.add_done_callback(functools.partial(self._loaded, metadata))
        with _nixl_errors("remote metadata load"):
            return await asyncio.shield(loading)

    def _loaded(self, metadata: bytes, loading: asyncio.Future[str]) -> None:
        """A load ended: its name is recorded even if every pull that waited for it was cancelled."""
        self._loading.pop(metadata, None)
        if not loading.cancelled() and loading.exception() is None:
            self._remotes[loading.result()] = metadata

    def _load_remote(self, metadata: bytes, known: set[str]) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name in known:  # the peer restarted under the same name
            self._agent.remove_remote_agent(name)
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
        return name

    @property
    def reads_abandoned(self) -> int:
        """READs abandoned in flight (deadline, cancellation) that NIXL has not reported over yet."""
        return len(self._reapers)

    def forget_remote(self, name: str) -> None:
        if self._remotes.pop(name, None) is not None and not self._closed:
            self._thread.submit(self._quietly, self._agent.remove_remote_agent, name)

    @staticmethod
    def _quietly(fn: Callable[..., object], *args: Any) -> None:
        with contextlib.suppress(Exception):
            fn(*args)

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
        group_bytes: int = GROUP_BYTES,
    ) -> None:
        """One-sided READ of ``remote_addrs`` into our ``local_addrs``; raises on error or deadline.

        The descriptors are prepared once and read in groups of about ``group_bytes``, posted back
        to back on the agent thread; ``on_group(indices)`` runs on the loop as each group lands, so
        callers can check it while the next group is read (the copy and xxhash release the GIL).

        No late writes: however the wait ends before NIXL reported a posted group over (the deadline:
        :class:`ReadOverrun`; the caller's cancellation; a failed poll), that group goes to
        ``quarantine`` before the exception propagates, and is polled to its end in the background.
        Groups never posted, and groups that ended, are the caller's again at once. Every caller
        whose destinations can be reused must pass ``quarantine``.
        """
        if not lengths:
            return
        if self._closed:
            raise TransferError("NIXL engine is closed")
        loop = asyncio.get_running_loop()
        groups = list(_groups(lengths, group_bytes))
        reports: list[asyncio.Future[_Post]] = [loop.create_future() for _ in groups]
        stop = threading.Event()  # the agent thread posts nothing more once set
        prepared: asyncio.Future[tuple[Any, Any] | None] = loop.create_future()  # None: preparation failed
        self._thread.submit(self._start_read, remote, _descs(local_addrs, lengths), _descs(remote_addrs, lengths),
                            groups, list(reports), stop, deadline, loop, prepared)
        ends: list[asyncio.Future[str]] = []  # abandoned groups: they end when NIXL says so
        first_open = 0  # groups before it ended DONE and were released
        try:
            for k, group in enumerate(groups):
                post = await self._landed(reports[k], deadline, remote)
                resume = post.state == "PROC" and k + 1 < len(groups)  # that job ended here: the rest come after
                await self._poll(post, deadline, remote)
                self._release_soon(post.handle)
                first_open = k + 1
                if resume:
                    dlists = prepared.result()
                    assert dlists is not None  # a group of them was posted
                    if self._closed:
                        raise TransferError("NIXL engine closed during a READ")
                    reports[k + 1 :] = [loop.create_future() for _ in groups[k + 1 :]]
                    self._thread.submit(self._post_groups, dlists, groups, k + 1, list(reports), stop, deadline, loop)
                if on_group is not None:
                    on_group(group)
        except BaseException:
            stop.set()
            for j in range(first_open, len(groups)):
                landed = self._abandon(reports[j])
                if landed is not None:
                    ends.append(landed)
                    if quarantine is not None:
                        quarantine(groups[j], landed)
            raise
        finally:  # the descriptor lists go once prepared and no abandoned READ may use them
            asyncio.gather(prepared, *ends).add_done_callback(self._release_prepared)

    def _prepare(self, remote: str, local: list[tuple[int, int, int]], far: list[tuple[int, int, int]]
                 ) -> tuple[Any, Any]:
        """On the agent thread: both descriptor lists of a READ, prepared."""
        mine = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        try:
            return mine, self._agent.prep_xfer_dlist(remote, far, "DRAM")
        except BaseException:
            self._quietly(mine.release)
            raise

    def _release_prepared(self, ended: asyncio.Future[list[Any]]) -> None:
        if not ended.cancelled() and ended.exception() is None and (dlists := ended.result()[0]) is not None:
            self._release_soon(*dlists)

    def _start_read(self, remote: str, local: list[tuple[int, int, int]], far: list[tuple[int, int, int]],
                    groups: list[range], reports: list[asyncio.Future[_Post]], stop: threading.Event,
                    deadline: float, loop: asyncio.AbstractEventLoop,
                    prepared: asyncio.Future[tuple[Any, Any] | None]) -> None:
        """On the agent thread: prepare a READ's descriptor lists and post its groups (one job: no round trip
        to the loop between them)."""
        try:
            dlists = self._prepare(remote, local, far)
        except Exception as exc:  # reported as the first group's failure
            loop.call_soon_threadsafe(_settle, prepared, None)
            loop.call_soon_threadsafe(_settle, reports[0], _Post(error=exc))
            _unposted(reports[1:], loop)
            return
        loop.call_soon_threadsafe(_settle, prepared, dlists)
        self._post_groups(dlists, groups, 0, reports, stop, deadline, loop)

    def _post_groups(self, dlists: tuple[Any, Any], groups: list[range], start: int,
                     reports: list[asyncio.Future[_Post]], stop: threading.Event, deadline: float,
                     loop: asyncio.AbstractEventLoop) -> None:
        """On the agent thread: post ``groups[start:]`` one after another while each post completes at once.
        Every report in ``reports`` (this job's own list) is settled, whatever ends the job: a post that does
        not complete at once ends it, the groups after it reported not posted (after one in progress the loop
        posts them in a new job once it ended)."""
        local, far = dlists
        reported = start  # reports[start:reported] are settled
        try:
            for k in range(start, len(groups)):
                post = _Post()
                if not stop.is_set() and time.monotonic() <= deadline:
                    try:
                        idx = list(groups[k])
                        post.handle = self._agent.make_prepped_xfer("READ", local, idx, far, idx)
                        post.state = self._agent.transfer(post.handle)
                    except Exception as exc:  # the bindings' own types: translated on the loop
                        post.error = exc
                        if post.handle is not None:
                            self._quietly(post.handle.release)
                            post.handle = None
                if post.state != "DONE":  # in progress (the loop posts the rest after it), failed or not posted:
                    _unposted(reports[k + 1 :], loop)  # the groups after it are reported first, as not posted
                    loop.call_soon_threadsafe(_settle, reports[k], post)
                    reported = len(reports)
                    return
                loop.call_soon_threadsafe(_settle, reports[k], post)
                reported = k + 1
        finally:  # whatever ended the job, no report is left unsettled (settling is first come, first kept)
            _unposted(reports[reported:], loop)

    async def _landed(self, report: asyncio.Future[_Post], deadline: float, remote: str) -> _Post:
        """A group's post, once the agent thread made it (a post in progress counts)."""
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                post = await asyncio.shield(report)
        except TimeoutError as exc:
            raise ReadOverrun(f"NIXL READ from {remote} ran past its deadline") from exc
        if post.error is not None:
            raise TransferError(f"NIXL READ failed: {type(post.error).__name__}: {post.error}") from post.error
        if post.handle is None:
            raise ReadOverrun(f"NIXL READ from {remote} ran past its deadline before it was posted")
        return post

    async def _poll(self, post: _Post, deadline: float, remote: str) -> None:
        """Wait until a posted group is over; raises unless it ended DONE."""
        polls = 0
        while post.state == "PROC":
            if time.monotonic() > deadline:
                raise ReadOverrun(f"NIXL READ from {remote} ran past its deadline")
            polls += 1
            await asyncio.sleep(0 if polls < _SPIN_POLLS else _PROGRESS_PERIOD_S)
            with _nixl_errors("READ"):
                post.state = await self._call(self._agent.check_xfer_state, post.handle)
        if post.state != "DONE":
            raise TransferError(f"NIXL READ from {remote} failed ({post.state})")

    def _abandon(self, report: asyncio.Future[_Post]) -> asyncio.Future[str] | None:
        """A group the caller no longer waits for: None if it never was or no longer is in flight, else the
        future that completes once NIXL says it is over (a reaper polls it; the handle is released then)."""
        if report.done() and not report.cancelled():
            post = report.result()
            if post.handle is None:
                return None
            if post.state != "PROC":
                self._release_soon(post.handle)
                return None
        loop = asyncio.get_running_loop()
        landed: asyncio.Future[str] = loop.create_future()
        reaper = loop.create_task(self._reap(report, landed), name="nixl-reap")
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)
        return landed

    async def _reap(self, report: asyncio.Future[_Post], landed: asyncio.Future[str]) -> None:
        """Wait for an abandoned group's post, poll it until it is over, then release it and say so."""
        state = "PROC"
        try:
            post = await report
            state = post.state
            while state == "PROC" and not self._closed:
                await asyncio.sleep(_REAP_PERIOD_S)
                try:
                    state = await self._call(self._agent.check_xfer_state, post.handle)
                except Exception as exc:  # an error state is an end too
                    log.info("abandoned NIXL READ ended in an error: %s", exc)
                    state = "ERR"
            if state != "PROC" and post.handle is not None:
                self._release_soon(post.handle)
                self.late_reads += 1
        finally:
            if not landed.done() and state != "PROC":
                landed.set_result(state)  # only now may the slots be reused

    def _release_soon(self, *handles: Any) -> None:
        """Release transfer handles or descriptor lists on the agent thread (after what is queued there)."""
        if not self._closed:
            self._thread.submit(self._release, handles)

    @staticmethod
    def _release(handles: Sequence[Any]) -> None:
        for handle in handles:
            try:
                handle.release()
            except Exception as exc:  # an in-flight READ cannot be released; NIXL retries at teardown
                log.warning("NIXL handle not released: %s", exc)

    async def read_once(self, remote: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
                        lengths: Sequence[int]) -> None:
        """One prepared READ of every descriptor, waited for on the agent thread: what a caller that knows the
        addresses and checks nothing does (``bench transfer``'s baseline). Its destinations must be unused."""
        with _nixl_errors("READ"):
            state = await self._call(self._read_once, remote, _descs(local_addrs, lengths),
                                     _descs(remote_addrs, lengths))
        if state != "DONE":
            raise TransferError(f"NIXL READ from {remote} failed ({state})")

    def _read_once(self, remote: str, local: list[tuple[int, int, int]], far: list[tuple[int, int, int]]) -> str:
        dlists = self._prepare(remote, local, far)
        handle, state = None, "ERR"
        try:
            idx = list(range(len(local)))
            handle = self._agent.make_prepped_xfer("READ", dlists[0], idx, dlists[1], idx)
            state, until = self._agent.transfer(handle), time.monotonic() + 30.0
            while state == "PROC" and time.monotonic() < until:
                state = self._agent.check_xfer_state(handle)
        finally:
            if state != "PROC":  # one still in flight keeps its handle and lists (a benchmark's owner hung)
                self._release([*([handle] if handle is not None else []), *dlists])
        return str(state)

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
            await self._call(self.progress)
            await asyncio.sleep(_PROGRESS_PERIOD_S)

    def progress(self) -> None:
        """On the agent thread: one progress pass of the worker (also collects notifications, which we do
        not use)."""
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
            self._remotes.pop(name)
            self._thread.submit(self._quietly, self._agent.remove_remote_agent, name)
        self._thread.submit(self._quietly, self._agent.deregister_memory, self._reg)
        await asyncio.wrap_future(self._thread.submit(lambda: None))  # everything queued has run
        self._thread.shutdown(wait=False)


def _unposted(reports: Sequence[asyncio.Future[_Post]], loop: asyncio.AbstractEventLoop) -> None:
    """From the agent thread: these groups were not posted (a report already settled keeps its value)."""
    for report in reports:
        loop.call_soon_threadsafe(_settle, report, _Post())


def _settle(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)
