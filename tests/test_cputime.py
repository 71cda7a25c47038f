"""CPU time of our own threads: counted per role, only for registered threads, never going down."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry

from lmcache_p2p import cputime
from lmcache_p2p.aio import LoopThread
from lmcache_p2p.metrics import AgentMetrics

BURN_S = 0.2


def burn(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_a_registered_thread_is_counted_and_keeps_its_time_after_it_ends():
    burned, release = threading.Event(), threading.Event()

    def work() -> None:
        cputime.register("test-burner")
        burn(BURN_S)
        burned.set()
        release.wait(30)

    before = cputime.seconds().get("test-burner", 0.0)
    thread = threading.Thread(target=work)
    thread.start()
    assert burned.wait(30)
    alive = cputime.seconds()["test-burner"] - before
    release.set()
    thread.join(30)
    ended = cputime.seconds()["test-burner"] - before
    assert BURN_S <= alive < BURN_S + 1.0
    assert ended >= alive  # a counter: the ended thread's time stays in its role's total


def test_an_unregistered_thread_is_not_counted():
    before = cputime.seconds()
    thread = threading.Thread(target=burn, args=(BURN_S,))
    thread.start()
    thread.join(30)
    after = cputime.seconds()
    assert all(n - before.get(role, 0.0) < BURN_S / 2 for role, n in after.items())


def test_loop_threads_are_exported_as_a_counter_by_role():
    registry = CollectorRegistry()
    AgentMetrics(registry)
    with LoopThread("test-cpu-loop", role="test-loop") as loop:
        loop.run(_spin(BURN_S), timeout=30)
        value = registry.get_sample_value("lmcache_p2p_cpu_seconds_total", {"thread": "test-loop"})
    assert value is not None and value >= BURN_S


async def _spin(seconds: float) -> None:
    burn(seconds)
