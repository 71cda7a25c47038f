"""Failpoints: named places in the serving path where a test makes this process fail on cue, at a moment
no signal from outside could hit (an owner stopped between the first and the second frame of an answer
that takes a millisecond). etcd's gofail and FoundationDB's buggify do the same.

Off, and one environment lookup at import, unless ``LMCACHE_P2P_FAILPOINTS`` names a directory: a failpoint
is armed by a file of its name there holding its action, and firing it removes the file (one firing per
arming, so a test arms it again for each run). Actions: ``stop`` (SIGSTOP this process, as a hung owner;
a test resumes it with SIGCONT).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

ENV = "LMCACHE_P2P_FAILPOINTS"
MID_ANSWER = "serve-mid-answer"  # transfer/server.py: after a get's first chunk frame is sent, before the rest

_DIR = os.environ.get(ENV) or None
ACTIONS = ("stop",)


def armed(name: str) -> bool:
    return _DIR is not None and os.path.exists(os.path.join(_DIR, name))


def arm(directory: str | os.PathLike[str], name: str, action: str) -> None:
    """Arm ``name`` for the processes started with ``LMCACHE_P2P_FAILPOINTS=directory`` (the test's side)."""
    if action not in ACTIONS:
        raise ValueError(f"failpoint action {action!r}: one of {ACTIONS}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(f"{path}.tmp", "w") as f:  # renamed into place: never seen armed with no action yet
        f.write(action)
    os.replace(f"{path}.tmp", path)


def fire(name: str) -> None:
    """Take ``name``'s action if it is armed (and disarm it)."""
    if _DIR is None:
        return
    path = os.path.join(_DIR, name)
    try:
        with open(path) as f:
            action = f.read().strip()
        os.unlink(path)
    except FileNotFoundError:
        return
    log.warning("failpoint %s fired: %s (pid %d)", name, action or "(no action written yet)", os.getpid())
    if action == "stop":
        # At this thread, not the process: a process-wide SIGSTOP may be taken by another thread, and this
        # one ran on for milliseconds (an owner sent all 8 chunks it was to stop after the first of, in
        # about one try in three); sent to itself, it stops on return from the call
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
