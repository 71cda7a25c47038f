"""CPU time of this process's lmcache-p2p threads, by role: what the cache costs the host it runs on.

Inside a vLLM worker the agent shares a process with the engine, so the process's CPU time cannot tell
the two apart. Each long-lived thread of ours calls :func:`register` first thing with its role (``loop``,
``load``, ``store``, ``tiers``, ...); :func:`seconds` reads every registered thread's own CPU clock
(``pthread_getcpuclockid``) and sums by role. A thread that has ended keeps the last value read from it,
so the sums only grow (``lmcache_p2p_cpu_seconds_total{thread}`` is a counter); a thread ends with
:func:`finish` where it can, which records its final time itself.

Registration is process-wide (threads are): several agents in one process (tests) are summed together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    role: str
    thread: threading.Thread
    clock: int | None  # the thread's CPU clock id, None where the platform has none
    last: float = 0.0  # seconds read last (the final value once the thread has ended)


_lock = threading.Lock()
_entries: dict[int, _Entry] = {}  # id(thread) -> entry (the entry holds the thread: its id is not reused meanwhile)
_ended: dict[str, float] = {}  # role -> CPU seconds of its threads that have ended


def register(role: str) -> None:
    """Account the calling thread's CPU time under ``role`` from now on."""
    thread = threading.current_thread()
    try:
        clock: int | None = time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):  # not on this platform
        clock = None
    with _lock:
        _entries[id(thread)] = _Entry(role, thread, clock, time.thread_time())


def initializer(role: str, *then: Callable[[], None]) -> Callable[[], None]:
    """A ``ThreadPoolExecutor`` initializer that registers each of its threads, then runs ``then``."""

    def init() -> None:
        register(role)
        for fn in then:
            fn()

    return init


def finish() -> None:
    """The calling thread is about to end: record its final CPU time."""
    with _lock:
        entry = _entries.get(id(threading.current_thread()))
        if entry is not None:
            entry.last = time.thread_time()
            entry.clock = None


def seconds() -> dict[str, float]:
    """CPU seconds of the registered threads so far, summed by role."""
    with _lock:
        out = dict(_ended)
        for key, entry in list(_entries.items()):
            alive = entry.thread.is_alive()
            if alive and entry.clock is not None:
                try:
                    entry.last = max(entry.last, time.clock_gettime(entry.clock))
                except OSError:  # ended between the check and the read: keep the last value
                    entry.clock = None
            if not alive:  # folded into the role's total, the entry (and the thread object) let go
                _ended[entry.role] = _ended.get(entry.role, 0.0) + entry.last
                del _entries[key]
            out[entry.role] = out.get(entry.role, 0.0) + entry.last
    return out
