"""A stopped owner beside a decode stream, run after run: what ``tests/test_vllm_faults.py`` asserts and
``lmcache-p2p bench vllm --stopped-runs`` reports.

Engine A holds every document; B is asked for them. Each run: A is resumed and B is waited for until it
would ask A again (not backed off, A's estimate under the recompute time), B pulls a document from A (a
healthy pull: it also clears the backoff the last run's liveness deadline left), A is SIGSTOPped with its
lease alive, and B is asked for a document nobody holds (a miss, when one is given: ``miss_before``), then
for a document only A holds beside a decode stream, then for another miss beside the same stream; the
document's stream is watched until ``watch_s`` after it arrived, past the abandoned pull's liveness
deadline (what the abandoned pull left behind must not stall it either). The document's TTFT is
compared with the mean of the misses served just before and after it: on this host a single miss's
TTFT drifts by up to 10 % from one request to the next, as much as the cost being measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import failpoints
from ..ids import NodeId
from ..keys import FingerprintDigest
from ..metrics_http import scrape
from .engine_client import EngineProcess, group_states

MORE_SPARES = 4  # documents A computes for one healthy pull once the spares are spent (``pull_healthy``)
CLEAR = 0.8  # a healthy pull counts once A's expected pull is this share of recomputing or less


@dataclasses.dataclass(frozen=True, slots=True)
class StoppedRun:
    stopped: dict[str, Any]  # B's answer to the stopped owner's document (``EngineProcess.concurrent``)
    miss: dict[str, Any]  # ... and to a document nobody holds, beside the same stream, after it
    miss_before: dict[str, Any] | None  # ... and to another one just before it (not watched), if asked
    unanswered: float  # chunks B gave up on for A's silence after asking (pull_chunks_total{outcome})
    timeout: float  # ... for its silence in the handshake of a new connection (or past the deadline)
    stalled: float  # ... for its silence once its answer began (stopped mid-answer)
    late: float  # ... that ran past their deadline, still arriving
    silence_s: float | None  # how long B waited on A's silence before recomputing (mean; None: it did not)
    healthy_pulls: int = 1  # pulls from A before the stop until one was all loaded (``pull_healthy``)
    unclean: tuple[dict[str, float], ...] = ()  # ... the outcomes of those that were not

    @property
    def miss_ttft_s(self) -> float:
        """A miss's TTFT at the time of the document: the mean of the misses beside it."""
        misses = [m["ttft_s"] for m in (self.miss_before, self.miss) if m is not None]
        return float(sum(misses) / len(misses))

    @property
    def ttft_ratio(self) -> float:
        return float(self.stopped["ttft_s"] / self.miss_ttft_s)

    @property
    def gap_ratio(self) -> float:
        return float(self.stopped["max_gap_s"] / max(self.miss["max_gap_s"], 1e-6))

    def line(self, i: int) -> str:
        stopped, miss = self.stopped, self.miss
        silence = "" if self.silence_s is None else f" after {1e3 * self.silence_s:.1f} ms of silence"
        before = "" if self.miss_before is None else f"{1e3 * self.miss_before['ttft_s']:.1f} ms before, "
        return (f"run {i}: document TTFT {1e3 * stopped['ttft_s']:.1f} ms (miss {before}"
                f"{1e3 * miss['ttft_s']:.1f} ms after: {self.ttft_ratio:.2f}x); worst decode gap "
                f"{1e3 * stopped['max_gap_s']:.1f} ms (miss {1e3 * miss['max_gap_s']:.1f} ms, "
                f"{self.gap_ratio:.2f}x; in it the longest step {1e3 * stopped.get('gap_step_s', 0.0):.0f} ms, "
                f"the longest pause between steps {1e3 * stopped.get('gap_pause_s', 0.0):.0f} ms); "
                f"chunks: {self.unanswered:.0f} "
                f"unanswered, {self.stalled:.0f} stalled, {self.timeout:.0f} timeout, {self.late:.0f} late{silence}; "
                f"{'' if self.healthy_pulls == 1 else f'healthy after {self.healthy_pulls} pulls {self.unclean}; '}"
                f"steps (ms): "
                f"{_steps(stopped)} vs miss {_steps(miss)}")


def _steps(answer: dict[str, Any]) -> str:
    return "/".join(f"{1e3 * s:.0f}" for s in answer.get("steps_s", []))


def pull_outcomes(counters: dict[str, float]) -> dict[str, float]:
    """Pulled chunks by outcome (``pull_chunks_total``, summed over transports) in a scraped agent's counters."""
    out: dict[str, float] = {}
    for k, v in counters.items():
        if k.startswith("lmcache_p2p_pull_chunks_total{") and 'outcome="' in k:
            name = k.split('outcome="', 1)[1].split('"', 1)[0]
            out[name] = out.get(name, 0.0) + v
    return out


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
    """Engine ``a`` (every document's owner) stopped and resumed under engine ``b``'s eyes: SIGSTOP and
    SIGCONT by default, or another fault (``halt``, ``restore``: e.g. ``a``'s host dropping every packet
    to and from ``b``'s, ``netlab.NetLab.partition``)."""

    def __init__(self, a: EngineProcess, b: EngineProcess, b_metrics_url: str, a_node: str = "engine-a",
                 halt: Callable[[], None] | None = None, restore: Callable[[], None] | None = None,
                 spares: list[list[int]] | None = None, more_spares: Callable[[], list[int]] | None = None) -> None:
        self.a, self.b, self._url, self._node = a, b, b_metrics_url, a_node
        self._halt, self._restore = halt, restore
        self._spares = list(spares or [])  # documents A holds, for healthy pulls again (``pull_healthy``)
        # once those are spent: a document A computes now (and holds), for the same
        self._more_spares = more_spares
        self.unclean: list[dict[str, float]] = []  # the last pull_healthy's pulls not all loaded: their outcomes
        self.stopped = False

    @classmethod
    def mid_answer(cls, a: EngineProcess, b: EngineProcess, b_metrics_url: str, failpoints_dir: Path,
                   a_node: str = "engine-a", spares: list[list[int]] | None = None,
                   more_spares: Callable[[], list[int]] | None = None) -> StoppedOwner:
        """``a`` stops itself once its answer to ``b`` is under way (``failpoints.MID_ANSWER``: its first
        chunk frame sent, then SIGSTOP; ``a`` runs with ``LMCACHE_P2P_FAILPOINTS=failpoints_dir``), and is
        resumed with SIGCONT (the failpoint disarmed first, had nobody asked ``a``)."""

        def restore() -> None:
            with contextlib.suppress(FileNotFoundError):
                (failpoints_dir / failpoints.MID_ANSWER).unlink()
            os.killpg(a.pid, signal.SIGCONT)

        return cls(a, b, b_metrics_url, a_node,
                   halt=lambda: failpoints.arm(failpoints_dir, failpoints.MID_ANSWER, "stop"), restore=restore,
                   spares=spares, more_spares=more_spares)

    @property
    def spares(self) -> list[list[int]]:
        """The spare documents not pulled yet (for another ``StoppedOwner`` of the same engines)."""
        return list(self._spares)

    def counters(self) -> dict[str, float]:
        return scrape(self._url)

    def outcome(self, name: str) -> float:
        return self.outcomes().get(name, 0.0)

    def silence(self) -> tuple[float, float]:
        """B's waits on a silent owner so far: their count and total seconds (``silent_owner_seconds``)."""
        m = self.counters()
        return (sum(v for k, v in m.items() if k.startswith("lmcache_p2p_silent_owner_seconds_count")),
                sum(v for k, v in m.items() if k.startswith("lmcache_p2p_silent_owner_seconds_sum")))

    def pulled_chunks(self) -> float:
        """Chunks B's pulls asked for so far, whatever their outcome (``pull_chunks_total``)."""
        return sum(v for k, v in self.counters().items() if k.startswith("lmcache_p2p_pull_chunks_total{"))

    def would_pull(self, margin: float = 1.0) -> bool:
        """B asks A now: not backed off, and A measured faster than recomputing (``margin``: by that factor)."""
        m = self.counters()
        expected = m.get(f'lmcache_p2p_pull_expected_seconds{{peer="{self._node}"}}', 0.0)
        return (m["lmcache_p2p_peers_backed_off"] == 0
                and expected <= margin * m["lmcache_p2p_recompute_chunk_seconds"])

    def stop(self) -> None:
        self.stopped = True
        if self._halt is not None:
            self._halt()
            return
        os.killpg(self.a.pid, signal.SIGSTOP)
        if not wait_until(lambda: group_stopped(self.a.pid), 10):
            raise RuntimeError("A's processes did not all stop")

    def resume(self, settle_s: float = 2.0) -> None:
        """SIGCONT, then ``settle_s`` for A to catch up (its lease, its index, the connections it lost). Half a
        second was too short after a stop of several seconds: A's first handshakes and acks came late, so the
        next run's healthy pull timed out or widened B's round-trip estimate, and that run measured an owner
        stopped just after a slow one (a deadline-bound give-up) instead of a healthy owner that stopped."""
        if self._restore is not None:
            self._restore()
        else:
            os.killpg(self.a.pid, signal.SIGCONT)
        self.stopped = False
        time.sleep(settle_s)

    def outcomes(self) -> dict[str, float]:
        """B's pulled chunks so far by outcome (``pull_chunks_total``, summed over transports)."""
        return pull_outcomes(self.counters())

    def pull_healthy(self, doc: list[int], stream: list[int], wait_s: float = 60.0) -> int:
        """Once B would ask A, B pulls ``doc`` from A (over a connection made anew if the last stop closed it:
        asked about a stopped A, B then hears nothing on a connection A answered before, the stop measured,
        not a handshake), and waits until B would ask A again. Beside a CPU hog A, just resumed, is not always
        healthy yet: B gave up on its handshake (``timeout``) or on a pause (A answered 45-70 ms late), or B
        asked nothing (its scheduler still held A back); a give-up leaves B's silence allowed doubled until
        A's next ack in time, and the stop would measure that backoff rather than a stop of a healthy owner.
        So until a pull is all loaded, B pulls again, one of the ``spares`` each time, then (up to
        ``MORE_SPARES`` a call) one ``more_spares`` gives (the outcomes of the others: ``unclean``): a run after
        the spares were spent once went on over a handshake that had failed, and measured another handshake
        instead of a stop mid-answer (the hog suite: A, resumed, answered no hello in 20 ms, four times).
        Likewise while A's expected pull is not clearly (``CLEAR``) faster than recomputing: a first pull over
        a new connection through a bridge took 700 ms idle, and the run's planner then declined A by a hair
        (pull expected 39.9 ms, recompute 38.6 ms) and asked nothing. The pulls taken."""
        pulls = 0
        self.unclean = []
        for next_doc in self._healthy_docs(doc):
            if not wait_until(self.would_pull, wait_s):
                raise RuntimeError(f"B would not ask A within {wait_s:.0f} s: {self.counters()}")
            before = self.outcomes()
            self.b.concurrent([next_doc], stream)
            pulls += 1
            grown = {k: v - before.get(k, 0.0) for k, v in self.outcomes().items() if v > before.get(k, 0.0)}
            if set(grown) == {"loaded"} and self.would_pull(CLEAR):
                break
            self.unclean.append(grown)
        if not wait_until(self.would_pull, wait_s):
            raise RuntimeError(f"B would not ask A again within {wait_s:.0f} s: {self.counters()}")
        return pulls

    def _healthy_docs(self, doc: list[int]) -> Iterator[list[int]]:
        """``doc``, then the spares (each taken once), then up to ``MORE_SPARES`` documents A computes now."""
        yield doc
        while self._spares:
            yield self._spares.pop(0)
        for _ in range(MORE_SPARES if self._more_spares is not None else 0):
            assert self._more_spares is not None
            yield self._more_spares()

    def run(self, healthy: list[int], held: list[int], miss: list[int], stream: list[int], watch_s: float,
            wait_s: float = 60.0, miss_before: list[int] | None = None) -> StoppedRun:
        """One run (see the module docstring); A is running again when it returns."""
        pulls = self.pull_healthy(healthy, stream, wait_s)
        before = {name: self.outcome(name) for name in ("unanswered", "stalled", "timeout", "late")}
        silences, silent_s = self.silence()
        self.stop()
        try:
            before_answer = None if miss_before is None else self.b.concurrent([miss_before], stream)[0]
            stopped = self.b.concurrent([held], stream, watch_s=watch_s)[0]
            missed = self.b.concurrent([miss], stream)[0]  # its worst gap is its prefill step's, as the document's
        finally:
            self.resume()
        after = {name: self.outcome(name) - n for name, n in before.items()}
        count, total = self.silence()
        silence = (total - silent_s) / (count - silences) if count > silences else None
        return StoppedRun(stopped, missed, before_answer, after["unanswered"], after["timeout"], after["stalled"],
                          after["late"], silence, pulls, tuple(self.unclean))
