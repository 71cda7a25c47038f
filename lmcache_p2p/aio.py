"""A private asyncio loop on a background thread: the agent's network side runs here.

The engine-facing code is synchronous; it submits coroutines with :meth:`LoopThread.run`
(blocking, with a timeout) or :meth:`LoopThread.submit` (fire and forget, returns a future).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from . import cputime
from .errors import LMCacheP2PError, PeerTimeout

log = logging.getLogger(__name__)
T = TypeVar("T")


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.monotonic()``, the clock of every deadline here), never negative."""
    return max(0.0, deadline - time.monotonic())


async def every(interval_s: Callable[[], float | None], step: Callable[[], Awaitable[object]], what: str, *,
                wake: asyncio.Event | None = None) -> None:
    """Run ``step`` every ``interval_s()`` seconds (read before each wait: a live setting may change it;
    None ends the loop), or as soon as ``wake`` is set, until cancelled. The supervision every periodic
    task of an agent shares: a step that fails is logged (an expected failure, ``LMCacheP2PError`` or
    ``OSError``, as a warning; anything else with its traceback) and the next one runs; none ends the loop."""
    while (interval := interval_s()) is not None:
        if wake is None:
            await asyncio.sleep(interval)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), interval)
            wake.clear()
        try:
            await step()
        except (LMCacheP2PError, OSError) as exc:
            log.warning("%s failed: %s", what, exc)
        except Exception:  # supervised: logged, and the next step runs
            log.exception("%s failed", what)


class TaskSet:
    """Loop tasks kept referenced until they end (the loop holds only weak references), each one's failure
    logged as ``whose`` task's; :meth:`cancel_all` ends them on a stop."""

    def __init__(self, whose: str) -> None:
        self._whose = whose
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """``coro`` as a task on the running loop, kept until it ends."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def named(self, name: str) -> list[asyncio.Task[Any]]:
        return [task for task in self._tasks if task.get_name() == name]

    def __len__(self) -> int:
        return len(self._tasks)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s task %s failed", self._whose, task.get_name(), exc_info=task.exception())

    async def cancel_all(self) -> None:
        """Cancel every task and wait until each has ended (what they raised is swallowed: logged above)."""
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has finished (its cancellation is swallowed).

    The cancel is repeated until the task is done: a cancellation can be lost inside the task
    (Python 3.11's ``asyncio.wait_for`` drops one that races with its inner result), and a
    stop must never hang on it.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def unpin_thread() -> None:
    """Let the calling thread run on every CPU of the process's cgroup.

    An engine pins its worker thread (and so every thread it starts) to the cores of its compute
    threads, which spin between steps: the agent's loop and load threads, started from there, would
    wait behind them. Our threads move bytes, not FLOPs; any core will do.
    """
    with contextlib.suppress(AttributeError, OSError):
        allowed = os.sched_getaffinity(os.getpid())  # the process's (main thread's) mask
        cpus = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, allowed | cpus)


class LoopThread:
    def __init__(self, name: str = "lmcache-p2p-loop", role: str = "loop") -> None:
        """``role``: the thread's CPU time is accounted under it (``cputime``)."""
        self.loop = asyncio.new_event_loop()
        self._role = role
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        cputime.register(self._role)
        unpin_thread()
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()
        # Cancel whatever is left so nothing runs after stop().
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        cputime.finish()

    @property
    def in_loop_thread(self) -> bool:
        """The caller runs on this loop's thread (where blocking on the loop would deadlock)."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait at most ``timeout`` seconds for its result."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop thread (would deadlock)")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            fut.cancel()
            raise PeerTimeout(f"operation did not finish within {timeout:.1f}s") from exc

    def stop(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("loop thread %s did not stop within %.1fs", self._thread.name, timeout)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
