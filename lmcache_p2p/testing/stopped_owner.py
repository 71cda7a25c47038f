"""A stopped owner beside a decode stream, run after run: what ``tests/test_vllm_faults.py`` asserts and
``lmcache-p2p bench vllm --stopped-runs`` reports.

Engine A holds every document; B is asked for them. Each run: A is resumed and B is waited for until it
would ask A again (not backed off, A's estimate under the recompute time), B pulls a document from A (a
healthy pull: it also clears the backoff the last run's liveness deadline left), A is SIGSTOPped with its
lease alive, and B is asked for a document only A holds beside a decode stream, then for a document
nobody holds (a miss) beside the same stream; both streams are watched until ``watch_s`` after the
document arrived, past the abandoned pull's liveness deadline.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..ids import NodeId
from ..keys import FingerprintDigest
from ..metrics import scrape
from .engine_client import EngineProcess, group_states


@dataclasses.dataclass(frozen=True, slots=True)
class StoppedRun:
    stopped: dict[str, Any]  # B's answer to the stopped owner's document (``EngineProcess.concurrent``)
    miss: dict[str, Any]  # ... and to a document nobody holds, beside the same stream
    unanswered: float  # chunks B gave up on for A's silence after asking (pull_chunks_total{outcome})
    timeout: float  # ... for its silence in the handshake of a new connection (or past the deadline)
    late: float  # ... that ran past their deadline, still arriving

    @property
    def ttft_ratio(self) -> float:
        return float(self.stopped["ttft_s"] / self.miss["ttft_s"])

    @property
    def gap_ratio(self) -> float:
        return float(self.stopped["max_gap_s"] / max(self.miss["max_gap_s"], 1e-6))

    def line(self, i: int) -> str:
        stopped, miss = self.stopped, self.miss
        return (f"run {i}: document TTFT {1e3 * stopped['ttft_s']:.1f} ms (miss {1e3 * miss['ttft_s']:.1f} ms, "
                f"{self.ttft_ratio:.2f}x); worst decode gap {1e3 * stopped['max_gap_s']:.1f} ms (miss "
                f"{1e3 * miss['max_gap_s']:.1f} ms, {self.gap_ratio:.2f}x); chunks: {self.unanswered:.0f} "
                f"unanswered, {self.timeout:.0f} timeout, {self.late:.0f} late")


def metrics_url(cfg_path: Path, node: str) -> str:
    """``node``'s metrics URL from its record in etcd, read with an agent config's etcd settings."""
    from ..aio import LoopThread
    from ..config import load_config
    from ..index.reader import IndexReader

    with LoopThread() as loop:
        reader = IndexReader.open(loop, load_config(cfg_path), FingerprintDigest(b"\0" * 16))
        try:
            url = reader.nodes()[NodeId(node)].metrics_url
        finally:
            reader.close()
    if url is None:
        raise RuntimeError(f"{node} publishes no metrics URL")
    return url


def group_stopped(pgid: int) -> bool:
    """Every process of process group ``pgid`` is stopped (state T in /proc/PID/stat): a process in the
    middle of a system call stops only once it returns."""
    states = group_states(pgid)
    return bool(states) and all(s in ("T", "t") for s in states)


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class StoppedOwner:
    """Engine ``a`` (every document's owner) stopped and resumed under engine ``b``'s eyes."""

    def __init__(self, a: EngineProcess, b: EngineProcess, b_metrics_url: str, a_node: str = "engine-a") -> None:
        self.a, self.b, self._url, self._node = a, b, b_metrics_url, a_node
        self.stopped = False

    def counters(self) -> dict[str, float]:
        return scrape(self._url)

    def outcome(self, name: str) -> float:
        return sum(v for k, v in self.counters().items()
                   if k.startswith("lmcache_p2p_pull_chunks_total{") and f'outcome="{name}"' in k)

    def pulled_chunks(self) -> float:
        """Chunks B's pulls asked for so far, whatever their outcome (``pull_chunks_total``)."""
        return sum(v for k, v in self.counters().items() if k.startswith("lmcache_p2p_pull_chunks_total{"))

    def would_pull(self) -> bool:
        """B asks A now: not backed off, and A measured faster than recomputing."""
        m = self.counters()
        expected = m.get(f'lmcache_p2p_pull_expected_seconds{{peer="{self._node}"}}', 0.0)
        return m["lmcache_p2p_peers_backed_off"] == 0 and expected <= m["lmcache_p2p_recompute_chunk_seconds"]

    def stop(self) -> None:
        os.killpg(self.a.pid, signal.SIGSTOP)
        self.stopped = True
        if not wait_until(lambda: group_stopped(self.a.pid), 10):
            raise RuntimeError("A's processes did not all stop")

    def resume(self, settle_s: float = 2.0) -> None:
        """SIGCONT, then ``settle_s`` for A to catch up (its lease, its index, the connections it lost). Half a
        second was too short after a stop of several seconds: A's first handshakes and acks came late, so the
        next run's healthy pull timed out or widened B's round-trip estimate, and that run measured an owner
        stopped just after a slow one (a deadline-bound give-up) instead of a healthy owner that stopped."""
        os.killpg(self.a.pid, signal.SIGCONT)
        self.stopped = False
        time.sleep(settle_s)

    def run(self, healthy: list[int], held: list[int], miss: list[int], stream: list[int], watch_s: float,
            wait_s: float = 60.0) -> StoppedRun:
        """One run (see the module docstring); A is running again when it returns."""
        if not wait_until(self.would_pull, wait_s):
            raise RuntimeError(f"B would not ask A within {wait_s:.0f} s: {self.counters()}")
        self.b.concurrent([healthy], stream)
        if not wait_until(self.would_pull, wait_s):
            raise RuntimeError(f"B would not ask A again within {wait_s:.0f} s: {self.counters()}")
        before = {name: self.outcome(name) for name in ("unanswered", "timeout", "late")}
        self.stop()
        try:
            stopped = self.b.concurrent([held], stream, watch_s=watch_s)[0]
            missed = self.b.concurrent([miss], stream, watch_s=watch_s)[0]
        finally:
            self.resume()
        after = {name: self.outcome(name) - n for name, n in before.items()}
        return StoppedRun(stopped, missed, after["unanswered"], after["timeout"], after["late"])
