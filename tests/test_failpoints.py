"""Failpoints (``lmcache_p2p/failpoints.py``): armed by a file, fired once, off without the environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcache_p2p import failpoints

CHILD = """
from lmcache_p2p import failpoints
print("before", flush=True)
failpoints.fire(failpoints.MID_ANSWER)   # stops here when armed
failpoints.fire(failpoints.MID_ANSWER)   # fired once per arming: passes
print("after", flush=True)
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_an_armed_failpoint_stops_its_process_once_and_a_resumed_one_goes_on(tmp_path: Path) -> None:
    failpoints.arm(tmp_path, failpoints.MID_ANSWER, "stop")
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, failpoints.ENV: str(tmp_path)})
    try:
        assert child.stdout is not None and child.stdout.readline() == "before\n"
        deadline = time.monotonic() + 30
        while _state(child.pid) not in ("T", "t"):
            assert time.monotonic() < deadline, "the armed failpoint did not stop its process"
            time.sleep(0.01)
        assert not (tmp_path / failpoints.MID_ANSWER).exists()  # disarmed by firing
        os.kill(child.pid, signal.SIGCONT)
        assert child.stdout.readline() == "after\n"
        assert child.wait(30) == 0
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_failpoints_are_off_without_the_environment_and_refuse_unknown_actions(tmp_path: Path) -> None:
    failpoints.arm(tmp_path, failpoints.MID_ANSWER, "stop")
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and done.stdout == "before\nafter\n"
    assert (tmp_path / failpoints.MID_ANSWER).exists()  # nobody fired it
    with pytest.raises(ValueError, match="one of"):
        failpoints.arm(tmp_path, "x", "crash")


THREADED_CHILD = """
import sys, threading
from lmcache_p2p import failpoints

def serve():  # an owner's loop thread: fires after its first frame, then would send the rest
    sys.stdout.write("first\\n"); sys.stdout.flush()
    failpoints.fire(failpoints.MID_ANSWER)
    sys.stdout.write("rest\\n"); sys.stdout.flush()

threading.Thread(target=serve).start()
while True:  # the engine's thread beside it
    pass
"""


def test_a_failpoint_stops_the_thread_that_fires_it_before_it_goes_on() -> None:
    """The owner's loop thread fires the failpoint beside a busy thread (an engine's): nothing after the
    failpoint may run before the process is stopped. A process-wide SIGSTOP was taken by another thread
    and the firing one ran on: an owner stopped "after its first chunk" sent all eight in about one try in
    three (tests/test_vllm_faults.py's mid-answer runs then measured no stop)."""
    import select
    import tempfile

    for _ in range(20):
        with tempfile.TemporaryDirectory() as armed:
            failpoints.arm(armed, failpoints.MID_ANSWER, "stop")
            child = subprocess.Popen([sys.executable, "-c", THREADED_CHILD], stdout=subprocess.PIPE,
                                     env={**os.environ, failpoints.ENV: armed})
            try:
                assert child.stdout is not None and child.stdout.readline() == b"first\n"
                deadline = time.monotonic() + 30
                while _state(child.pid) not in ("T", "t"):
                    assert time.monotonic() < deadline, "the armed failpoint did not stop its process"
                    time.sleep(0.001)
                ready, _, _ = select.select([child.stdout], [], [], 0.2)
                assert not ready, "the firing thread ran on after the failpoint"
                os.kill(child.pid, signal.SIGCONT)
                assert child.stdout.readline() == b"rest\n"
            finally:
                child.kill()
                child.wait()
                child.stdout.close()
