"""Run by test_vllm_blend.py in a process of its own (vLLM in-process, no connector): the blending
machinery against the engine's own cache and model. Prints one JSON line of measured differences."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model runner in this process


def main() -> int:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcache_p2p.integrations.vllm.blend import Blender, blend_refusal

    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=2048, seed=0, kv_cache_memory_bytes=256 << 20)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    layers = runner.vllm_config.compilation_config.static_forward_context
    caches = {n: layers[n].kv_cache for n in layers if isinstance(getattr(layers[n], "kv_cache", None), torch.Tensor)}
    blender = Blender(runner, caches)
    blocks = next(iter(caches.values())).shape[0]
    per = -(-400 // blender.block_size)
    free = [list(range(blocks - (i + 1) * per, blocks - i * per)) for i in range(5)]  # unused: nothing runs
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(10, 500, (300,), generator=g).tolist()
    out: dict[str, object] = {"refusal": blend_refusal(runner.vllm_config), "layout": blender.key_layout}
    cfg = runner.vllm_config
    parts = {f: getattr(cfg, f) for f in ("cache_config", "parallel_config", "model_config", "lora_config",
                                          "speculative_config", "device_config")}
    refused = {}
    out["prefix_caching_refused"] = blend_refusal(SimpleNamespace(**{**parts, "cache_config": SimpleNamespace(
        enable_prefix_caching=True, cache_dtype="auto", block_size=cfg.cache_config.block_size)}))
    for name, change in [("fp8", {"cache_config": SimpleNamespace(enable_prefix_caching=False, cache_dtype="fp8",
                                                                  block_size=cfg.cache_config.block_size)}),
                         ("lora", {"lora_config": object()}), ("spec", {"speculative_config": object()}),
                         ("tp", {"parallel_config": SimpleNamespace(tensor_parallel_size=2,
                                                                    pipeline_parallel_size=1)})]:
        refused[name] = blend_refusal(SimpleNamespace(**{**parts, **change}))
    out["refused"] = refused

    def diff(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.float() - y.float()).abs().max())

    hidden = blender.recompute(toks, [(0, 300)], free[0])
    full = blender.read(free[0], 0, 300, 0)
    blender.recompute(toks, [(0, 120)], free[1])
    blender.recompute(toks, [(120, 300)], free[1])
    out["split_vs_one_run"] = diff(blender.read(free[1], 0, 300, 0), full)
    blender.recompute(toks, [(0, 60), (60, 130), (130, 300)], free[1])
    out["three_runs_vs_one_run"] = diff(blender.read(free[1], 0, 300, 0), full)

    # the question's probe over a cache (free[1]: a full prefill of toks) against a recompute of the question
    # there: the same model output (its attention answered in torch, nothing written); what it reads is a
    # share of its attention, all of it on positions before the question's own, summed over layers 2..
    question = toks[:20]
    before = blender.read(free[1], 0, 300, 0)
    read, probed = blender.question_attention(question, 300, free[1])
    out["probe_wrote_nothing"] = diff(blender.read(free[1], 0, 300, 0), before)
    computed = blender.recompute(toks + question, [(300, 320)], free[1])
    out["probe_vs_recompute"] = diff(probed, computed)
    out["probe_read"] = [float(read.sum()), float(read.min()), len(read)]
    # read per head (question-heads): each head's share of what it reads in [100, 300), the largest per position
    heads, _ = blender.question_attention(question, 300, free[1], heads_from=100)
    out["probe_heads"] = [float(heads[100:].max()), float(heads[100:].min()), float(heads[100:].sum())]
    out["probe_bound"] = 20 * layers[next(iter(caches))].num_heads * (len(caches) - 2)
    # the blend diagnostic: a cache against its own full prefill is no error, and is given back as it was
    errors = blender.kv_error(toks, free[1], (100, 300), [(100, 150)])
    out["kv_error_self"] = max(max(v) for v in errors.values())
    out["kv_error_restored"] = diff(blender.read(free[1], 0, 300, 0), before)

    # the recompute's next-token logits against vLLM's own prefill of the same prompt
    logits = runner.model.compute_logits(hidden[-1:])
    ref = llm.generate([TokensPrompt(prompt_token_ids=toks)], SamplingParams(max_tokens=1, temperature=0, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    out["next_token"] = [int(logits.argmax()), int(ref.token_ids[0])]
    lp = torch.log_softmax(logits.float(), -1)[0, ref.token_ids[0]]
    out["next_logprob_diff"] = abs(float(lp) - float(ref.logprobs[0][ref.token_ids[0]].logprob))

    # tokens 120..300 read as a segment (keys to position 0) and written back where they were
    seg = blender.read(free[0], 120, 300, 120)
    blender.write(seg.clone(), free[1], 120, 120)
    out["round_trip"] = diff(blender.read(free[1], 120, 300, 0), full[:, :, 120:300])
    # ... and written at 200 after other tokens: layer 0 has no attention before its K/V, so it must equal
    # a prefill of those tokens at 200; deeper layers saw another context (what the recompute restores)
    moved_toks = [3] * 200 + toks[120:300]
    blender.write(seg.clone(), free[2], 200, 200)
    moved = blender.read(free[2], 200, 380, 0)
    blender.recompute(moved_toks, [(0, 380)], free[2])
    fresh = blender.read(free[2], 200, 380, 0)
    out["moved_layer0_k"] = diff(moved[0, 0], fresh[0, 0])
    out["moved_layer0_v"] = diff(moved[0, 1], fresh[0, 1])
    out["moved_last_layer"] = diff(moved[-1], fresh[-1])
    out["scale"] = float(full.float().abs().max())

    # a fresh segment (tokens 150..300 after the base 0..100) computed after the base alone, in the
    # scratch of two requests whose text between base and segment differs: the same bytes, and a
    # prefill of base + segment's KV
    base, doc = toks[:100], toks[150:300]
    canonical = []
    for other, blocks in (([5] * 40, free[3]), ([7] * 90, free[4])):
        blender.recompute(base + other, [(0, 140)], blocks)  # the request's own KV: base, then its own text
        scratch = blocks[-(-140 // blender.block_size):]  # blocks past what the request wrote
        assert len(scratch) * blender.block_size >= 250
        blender.write(blender.read(blocks, 0, 100, 0), scratch, 0, 0)
        canonical.append(blender.isolated(base + doc, 100, scratch))
    out["fresh_same_bytes"] = bool(torch.equal(canonical[0], canonical[1]))
    blender.recompute(base + doc, [(0, 250)], free[1])
    out["fresh_vs_prefill"] = diff(canonical[0], blender.read(free[1], 100, 250, 100))

    # CacheBlend's selection over a moved segment (tokens 120..300 written at 200 after other tokens):
    # ``count`` positions of the candidates, and layers 0..1 of the span recomputed on the way
    blender.recompute(moved_toks, [(0, 200)], free[3])
    blender.write(seg.clone(), free[3], 200, 200)
    picked = blender.deviating(moved_toks, free[3], [(200, 380)], [(200, 380)], 18)
    out["picked"] = sum(e - s for s, e in picked)
    out["picked_inside"] = all(200 <= s < e <= 380 for s, e in picked)
    after = blender.read(free[3], 200, 380, 0)
    out["deviation_layer1_vs_prefill"] = diff(after[1], fresh[1])
    out["deviation_layer2_untouched"] = diff(after[2], moved[2])
    # CacheBlend's gradual filtering, its second round: the 18 survivors alone through layers 0..2, the 6 whose
    # layer-2 keys moved most kept; the positions that did not survive and every layer past 2 untouched
    kept = blender.deviating(moved_toks, free[3], picked, picked, 6, layer=2)
    again = blender.read(free[3], 200, 380, 0)
    survived = torch.zeros(180, dtype=torch.bool)
    for s, e in picked:
        survived[s - 200:e - 200] = True
    out["gradual_kept"] = sum(e - s for s, e in kept)
    out["gradual_inside"] = all(bool(survived[s - 200:e - 200].all()) for s, e in kept)
    out["gradual_survivors_layer2_moved"] = diff(again[2][:, survived], after[2][:, survived])
    out["gradual_others_untouched"] = diff(again[:, :, ~survived], after[:, :, ~survived])
    out["gradual_deeper_untouched"] = diff(again[3:], after[3:])
    print("BLEND_KV " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
