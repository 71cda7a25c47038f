"""``aio.every``: the one supervised periodic loop of the agent's tasks (TTL sweeps, object cleanup, peer
pruning, hand-off steps)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from lmcache_p2p.aio import every
from lmcache_p2p.errors import TransferError


def test_a_failing_step_is_logged_and_the_next_one_runs_until_the_interval_says_stop(
        caplog: pytest.LogCaptureFixture) -> None:
    steps: list[int] = []

    async def step() -> None:
        steps.append(len(steps))
        if len(steps) == 1:
            raise TransferError("the peer went away")  # expected: a warning
        if len(steps) == 2:
            raise KeyError("a bug")  # unexpected: logged with its traceback, the loop goes on

    async def main() -> None:
        await every(lambda: 0.01 if len(steps) < 4 else None, step, "the test's pass")

    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.aio"):
        asyncio.run(asyncio.wait_for(main(), 5))
    assert steps == [0, 1, 2, 3]
    records = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert records == [("WARNING", "the test's pass failed: the peer went away", False),
                       ("ERROR", "the test's pass failed", True)]


def test_a_wake_runs_the_step_at_once_and_cancelling_ends_it() -> None:
    async def main() -> list[float]:
        wake, ran = asyncio.Event(), []
        loop = asyncio.get_running_loop()

        async def step() -> None:
            ran.append(loop.time())

        task = asyncio.create_task(every(lambda: 3600.0, step, "woken", wake=wake))
        t0 = loop.time()
        for _ in range(3):
            wake.set()
            while len(ran) < _ + 1:
                await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return [t - t0 for t in ran]

    ran = asyncio.run(asyncio.wait_for(main(), 5))
    assert len(ran) == 3 and max(ran) < 2.0  # never the hour's wait
