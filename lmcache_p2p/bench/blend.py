"""``lmcache-p2p bench blend``: RAG prompts whose documents come back in other orders, on two engines.

A prompt is a base (``--base`` tokens: the system prompt), ``--pick`` documents drawn from a pool of
``--docs`` (``--doc`` tokens each), a question (``--question`` tokens) and a held-out continuation
(``--continuation`` tokens, scored: the model's perplexity on text it has not seen, given all of the
prompt before it). Documents, base, question and continuation are held-out text (never trained on).

Engine A answers ``--prompts`` such prompts, declaring the documents as segments (its first prompt
saves its first document; later ones blend what is held and compute the others fresh, after the base
alone, and save them). Engine B (same mesh) then gets the same document sets, each in another order, as:

    blend f=F [deviation]  segments declared, recompute fraction F (each of ``--fractions``; 0 is plain
                   concatenation, the lower bound that shows what the recompute buys), its tokens chosen
                   by each of ``--selections`` (first: each document's first tokens; deviation: CacheBlend's;
                   question: what the question reads over the blended cache; ``-gradual``: in two rounds,
                   the second scored over the cache the first refreshed, CacheBlend's gradual filtering)
    prefix-only    no segments declared: today's reuse, the exact prefix (the base)

and a plain vLLM engine (no connector) computes the same prompts: ``full`` prefill, the reference.
Per mode: ``reused`` (prompt tokens not computed by the engine, of all prompt tokens), median TTFT and
its ratio to full prefill and to prefix-only, and quality against full prefill: ``--task
continuation`` (the trained tiny model): continuation perplexity (and its change), greedy agreement
over ``--answer`` generated tokens, the largest |Δ logprob| of a continuation token; ``--task facts``
(a real instruct model, ``rag_task.py``): answers right, per question kind, and answers equal to the
full prefill's. TTFT is measured inside the engine (its step loop), one request at a time. Engine
mode: eager (``enforce_eager``); vLLM's own prefix cache off on the mesh engines unless
``--prefix-caching`` (then B's blends run beside it).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..index.etcd_server import EtcdServer
from ..keys import LEAD_INS
from ..request_params import SELECTIONS
from ..segments import KV_ERROR_ENV, ingest_prompt
from ..testing.engine_client import EngineProcess
from ..testing.instruct_model import instruct_model_path
from ..testing.trained_model import held_out_prompts, trained_model_path
from . import plot
from .common import bench_parser, emit, progress, run_in_workdir
from .rag_task import RagTask
from .vllm import add_engine_arguments, agent_config


def pool(model: Path, args: argparse.Namespace) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """The base, the documents, and each prompt's question + continuation (held-out text)."""
    length = max(args.base, args.doc, args.question + args.continuation) + 1
    texts = held_out_prompts(model, 1 + args.docs + args.prompts, length)
    base = texts[0][:args.base]
    docs = [t[1:args.doc + 1] for t in texts[1:1 + args.docs]]
    tails = [t[1:args.question + args.continuation + 1] for t in texts[1 + args.docs:]]
    return base, docs, tails


def rag(base: list[int], docs: list[list[int]], order: list[int], tail: list[int]) -> tuple[list[int], list[list[int]]]:
    prompt, spans = list(base), []
    for i in order:
        spans.append([len(prompt), len(prompt) + len(docs[i])])
        prompt += docs[i]
    return prompt + tail, spans


Ask = Callable[[EngineProcess, list[int], dict[str, Any] | None], dict[str, Any]]


def measure(args: argparse.Namespace, work: Path, model: Path, warm: list[int],
            on_a: list[tuple[list[int], list[list[int]]]], on_b: list[tuple[list[int], list[list[int]]]],
            ask: Ask) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Engine A computes ``on_a`` (documents declared as segments); engine B, on the same mesh, each
    prompt of ``on_b`` in every mode (a blend per ``--fractions``, then prefix-only); a plain engine
    the full prefill of ``on_b``. Returns the full prefill's results and each mode's."""
    blends = {f"blend f={f:g}" + ("" if sel == "first" else f" {sel}"): {
        "lmcache_p2p_blend": True, "lmcache_p2p_recompute_fraction": f, "lmcache_p2p_blend_selection": sel}
        for sel in args.selections for f in args.fractions if not (f in (0, 1) and sel != args.selections[0])}
    modes = [*blends, "prefix-only"]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    kv_file = work / "kv_error.jsonl"

    def blended(prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """B's answer, with its blend's K/V error against a full prefill (``--kv-error``; None: not blended)."""
        def written() -> list[str]:
            return kv_file.read_text().splitlines() if kv_file.exists() else []

        seen = len(written()) if args.kv_error else 0
        row = ask(b, prompt, params)
        if args.kv_error:
            lines = written()[seen:]
            row["kv_error"] = json.loads(lines[-1]) if lines else None
        return row

    with EtcdServer(base_dir=str(work)) as etcd:
        engines: list[EngineProcess] = []
        try:
            for name in ("blend-a", "blend-b"):
                # room for every prompt's chunks (the real model's are 5.6 MiB): nothing measured is evicted
                cfg = agent_config(work / f"{name}.yaml", name, etcd.endpoints, args.transport, cpu_capacity="2GiB",
                                   blend={"lead_in": args.lead_in, "max_recompute_tokens": args.max_recompute_tokens})
                env = {KV_ERROR_ENV: str(kv_file)} if name == "blend-b" and args.kv_error else None
                engines.append(EngineProcess(model, cfg, name=name, log_path=work / f"{name}.log", dtype=args.dtype,
                                             prefix_caching=args.prefix_caching, env=env))
            progress("blend", "starting engines A and B (the mesh)")
            a, b = (e.wait_ready() for e in engines)
            for engine in (a, b):
                ask(engine, warm, None)
            if args.lead_in == "self":  # each document ingested once: its KV after the base and a copy of itself
                documents = {tuple(p[s:e]): p[:spans[0][0]] for p, spans in on_a for s, e in spans}
                progress("blend", f"engine A: {len(documents)} documents ingested (lead-in self)")
                for doc, base in documents.items():
                    ingest, ingest_spans = ingest_prompt(base, doc)
                    ask(a, ingest, {"lmcache_p2p_segments": ingest_spans})
            progress("blend", f"engine A: {len(on_a)} prompts, documents declared")
            for prompt, spans in on_a:
                ask(a, prompt, {"lmcache_p2p_segments": spans, "lmcache_p2p_blend": True})
            for i, (prompt, spans) in enumerate(on_b):  # prefix-only last: it saves this order's prefix chain
                progress("blend", f"engine B: prompt {i + 1}/{len(on_b)} in {len(modes)} modes")
                for mode, params in blends.items():
                    results[mode].append(blended(prompt, {"lmcache_p2p_segments": spans, **params}))
                results["prefix-only"].append(ask(b, prompt, None))
        finally:
            for engine in engines:
                engine.stop()
    progress("blend", f"a plain engine: full prefill of {len(on_b)} prompts (the reference)")
    cold = EngineProcess(model, None, name="cold", log_path=work / "cold.log", dtype=args.dtype)
    try:
        cold.wait_ready()
        ask(cold, warm, None)
        full = [ask(cold, prompt, None) for prompt, _ in on_b]
    finally:
        cold.stop()
    return full, results


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = Path(args.model) if args.model else trained_model_path()
    base, docs, tails = pool(model, args)
    rnd = random.Random(args.seed)
    sets = [rnd.sample(range(args.docs), args.pick) for _ in range(args.prompts)]
    again = []
    for chosen in sets:  # the same documents in another order
        order = list(chosen)
        while order == chosen:
            rnd.shuffle(order)
        again.append(order)
    on_a = [rag(base, docs, s, t) for s, t in zip(sets, tails, strict=True)]
    on_b = [rag(base, docs, s, t) for s, t in zip(again, tails, strict=True)]
    warm = held_out_prompts(model, 1 + args.docs + args.prompts + 1, 600)[-1]

    def score(engine: EngineProcess, prompt: list[int], params: dict[str, Any] | None) -> dict[str, Any]:
        return engine.score([prompt], max_tokens=args.answer, scored=args.continuation, kv_transfer_params=params)[0]

    full, results = measure(args, work, model, warm, on_a, on_b, score)
    return report(args, on_b, full, results)


def run_facts(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``--task facts``: the graded RAG task (``rag_task.py``) on an instruct model; answers graded."""
    from tokenizers import Tokenizer

    model = instruct_model_path() if args.model in (None, "instruct") else Path(args.model)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    task = RagTask(lambda text: tokenizer.encode(text, add_special_tokens=False).ids, docs=args.docs,
                   doc_words=args.doc_words, seed=args.seed)
    pairs = task.pairs(args.prompts, args.pick, seed=args.seed)
    warm = task.prompt([0], pairs[0][0].question).tokens

    def answer(engine: EngineProcess, prompt: list[int], params: dict[str, Any] | None) -> dict[str, Any]:
        return engine.score([prompt], max_tokens=args.answer, kv_transfer_params=params, timeout=900.0)[0]

    full, results = measure(args, work, model, warm, [(p.tokens, p.spans) for p, _ in pairs],
                            [(p.tokens, p.spans) for _, p in pairs], answer)
    questions = [second.question for _, second in pairs]
    end = tokenizer.token_to_id("<|im_end|>")

    def reply(tokens: list[int]) -> str:  # the answer ends at the turn's end (what follows is not graded)
        return tokenizer.decode(tokens[:tokens.index(end)] if end in tokens else tokens, skip_special_tokens=True)

    replies = {m: [reply(r["tokens"]) for r in rows] for m, rows in {"full": full, **results}.items()}
    right_full = [q.score(r) for q, r in zip(questions, replies["full"], strict=True)]
    tokens = sum(len(second.tokens) for _, second in pairs)
    full_ms = statistics.median(r["ttft_s"] for r in full) * 1000
    prefix_ms = statistics.median(r["ttft_s"] for r in results["prefix-only"]) * 1000
    out: dict[str, Any] = {"model": str(model), "dtype": args.dtype, "engine_mode": "eager", "prompts": args.prompts,
                           "prompt_tokens": round(tokens / len(pairs)), "documents_per_prompt": args.pick}
    for mode, rows in {"full": full, **results}.items():
        ms = statistics.median(r["ttft_s"] for r in rows) * 1000
        right = [q.score(reply) for q, reply in zip(questions, replies[mode], strict=True)]
        by_kind = {kind: [ok for ok, q in zip(right, questions, strict=True) if q.kind == kind]
                   for kind in ("single", "pair")}
        out[mode] = {"accuracy": round(sum(right) / len(right), 4),
                     **{f"accuracy_{k}": round(sum(v) / len(v), 4) for k, v in by_kind.items() if v},
                     "reused": round(sum(r["num_cached_tokens"] for r in rows) / tokens, 4),
                     "ttft_ms": round(ms, 1), "vs_full": round(full_ms / ms, 2),
                     "vs_prefix_only": round(prefix_ms / ms, 2),
                     "same_answer_as_full": round(sum(x == y for x, y in zip(replies[mode], replies["full"],
                                                                                strict=True)) / len(rows), 4),
                     **paired(right, right_full), **first_token_kl(rows, full), **kv_error(rows)}
    out["replies"] = {m: r[:6] for m, r in replies.items()}
    out["expected"] = [q.answers for q in questions[:6]]
    return out


def paired(right: list[float], right_full: list[float]) -> dict[str, Any]:
    """Answer credit a mode loses and gains against full prefill's, prompt by prompt (a pair question's
    half counts a half), and its accuracy on the prompts full prefill answers wholly right."""
    lost = sum(max(f - r, 0.0) for r, f in zip(right, right_full, strict=True))
    gained = sum(max(r - f, 0.0) for r, f in zip(right, right_full, strict=True))
    on_right = [r for r, f in zip(right, right_full, strict=True) if f == 1.0]
    return {"lost": lost, "gained": gained,
            "accuracy_where_full_right": round(sum(on_right) / len(on_right), 4) if on_right else None}


def first_token_kl(rows: list[dict[str, Any]], full: list[dict[str, Any]]) -> dict[str, Any]:
    """KL(full || mode) of the first answer token's distribution, per prompt (median and mean), over full
    prefill's ``first_top`` tokens (a token the mode does not rank there takes the mode's least logprob)."""
    kls = []
    for r, f in zip(rows, full, strict=True):
        p, q = f.get("first_top") or {}, r.get("first_top") or {}
        if not p or not q:
            continue
        floor = min(q.values())
        kls.append(sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in p.items()))
    if not kls:
        return {}
    return {"first_token_kl_median": round(statistics.median(kls), 5),
            "first_token_kl_mean": round(statistics.mean(kls), 5)}


def kv_error(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The blended cache's K/V error against a full prefill (``--kv-error``), per layer, median over prompts:
    all blended positions, and the reused ones alone."""
    errors = [r["kv_error"] for r in rows if r.get("kv_error")]
    if not errors:
        return {}
    out: dict[str, Any] = {}
    for name in ("k_all", "v_all", "k_reused", "v_reused"):
        per_prompt = [e[name] for e in errors if e.get(name)]
        if per_prompt:
            layers = [statistics.median(col) for col in zip(*per_prompt, strict=True)]
            out[f"kv_error_{name}"] = [round(x, 4) for x in layers]
            out[f"kv_error_{name}_mean"] = round(statistics.mean(layers), 5)
    out["recomputed_share"] = round(statistics.median(e["recomputed"] / max(e["span"][1] - e["span"][0], 1)
                                                      for e in errors), 4)
    return out


def _ppl(rows: list[dict[str, Any]]) -> float:
    lps = [lp for r in rows for lp in r["prompt_logprobs"] if lp is not None]
    return math.exp(-sum(lps) / len(lps)) if lps else float("nan")


def report(args: argparse.Namespace, prompts: list[tuple[list[int], list[list[int]]]], full: list[dict[str, Any]],
           results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    tokens = sum(len(p) for p, _ in prompts)
    cached = sum(spans[-1][1] for _, spans in prompts)
    full_ms = statistics.median(r["ttft_s"] for r in full) * 1000
    prefix_ms = statistics.median(r["ttft_s"] for r in results["prefix-only"]) * 1000
    full_ppl = _ppl(full)
    out: dict[str, Any] = {
        "model": args.model or "trained tiny llama (tests')", "dtype": args.dtype, "prompts": args.prompts,
        "prompt_tokens": round(tokens / len(prompts)), "cached_somewhere": round(cached / tokens, 4),
        "full_prefill": f"ttft_ms={full_ms:.1f} continuation_ppl={full_ppl:.2f}"}
    for mode, rows in results.items():
        ms = statistics.median(r["ttft_s"] for r in rows) * 1000
        agree = [sum(x == y for x, y in zip(r["tokens"], f["tokens"], strict=True)) / len(f["tokens"])
                 for r, f in zip(rows, full, strict=True)]
        deltas = [abs(x - y) for r, f in zip(rows, full, strict=True)
                  for x, y in zip(r["prompt_logprobs"], f["prompt_logprobs"], strict=True)
                  if x is not None and y is not None]
        ppl = _ppl(rows)
        out[mode] = (f"reused={sum(r['num_cached_tokens'] for r in rows) / tokens:.4f} ttft_ms={ms:.1f} "
                     f"vs_full={full_ms / ms:.2f}x vs_prefix_only={prefix_ms / ms:.2f}x ppl={ppl:.2f} "
                     f"({100 * (ppl / full_ppl - 1):+.2f}%) greedy_agree={statistics.mean(agree):.3f} "
                     f"max_dlogprob={max(deltas, default=float('nan')):.3f}")
    return out


def main(argv: list[str]) -> int:
    parser = bench_parser("blend", __doc__)
    parser.add_argument("--task", default="continuation", choices=["continuation", "facts"],
                        help="continuation: held-out text scored (perplexity, agreement) on the trained tiny model; "
                        "facts: the graded RAG task (answers right) on a real instruct model")
    parser.add_argument("--doc-words", type=int, default=330, help="facts: words per product document (~450 tokens)")
    parser.add_argument("--prompts", type=int, help="prompts (default: 4; facts: 24)")
    parser.add_argument("--docs", type=int, help="documents in the pool (default: 6; facts: 8)")
    parser.add_argument("--pick", type=int, help="documents per prompt (default: 3; facts: 4)")
    parser.add_argument("--base", type=int, default=256, help="tokens of the system prompt")
    parser.add_argument("--doc", type=int, default=512, help="tokens per document")
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--continuation", type=int, default=64, help="held-out tokens after the question, scored")
    parser.add_argument("--answer", type=int, default=32, help="tokens generated (greedy agreement)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.15, 0.0, 1.0],
                        help="recompute fractions measured (the first is the default under test)")
    parser.add_argument("--lead-in", choices=LEAD_INS, default="none",
                        help="blend.lead_in of both engines: what each document's KV is computed after, besides "
                             "the base (with self, engine A first ingests each document: segments.ingest_prompt)")
    parser.add_argument("--max-recompute-tokens", type=int, default=4096,
                        help="blend.max_recompute_tokens of both engines (a blend over it is served prefix-only)")
    parser.add_argument("--selections", nargs="+", default=["first"], choices=list(SELECTIONS),
                        help="how the recompute's tokens are chosen (each fraction but 0 and 1 is run with each)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="the mesh engines run with vLLM's own prefix cache on (off: every reuse comes through "
                        "the mesh)")
    parser.add_argument("--kv-error", action="store_true",
                        help="engine B also computes each blended prompt in full (same model, same kernels) and "
                        "reports the blended cache's K/V error against it, per layer (a diagnostic: it costs a full "
                        "prefill per blend; TTFT is then not comparable)")
    parser.add_argument("--seed", type=int, default=0)
    add_engine_arguments(parser, dtype="float32", model="model directory (default: the tests' trained tiny Llama; "
                         "facts: 'instruct', SmolLM2-135M-Instruct built from PyPI once per machine)")
    plot.add_argument(parser)
    args = parser.parse_args(argv)
    if args.plot:
        plot.require()
    facts = args.task == "facts"
    args.prompts = args.prompts or (24 if facts else 4)
    args.docs = args.docs or (8 if facts else 6)
    args.pick = args.pick or (4 if facts else 3)
    if not 1 <= args.pick <= args.docs or args.prompts < 1 or args.pick < 2:
        parser.error("need 2 <= --pick <= --docs and --prompts >= 1")
    if any(not 0 <= f <= 1 for f in args.fractions):
        parser.error("--fractions must be in [0, 1]")
    result = run_in_workdir(run_facts if args.task == "facts" else run, args, "lmcache-p2p-bench-blend-")
    emit(result, args.json, "bench blend (RAG documents in another order: engine B reuses what engine A computed)")
    plot.write("blend", result, args.plot, [(plot.blend_quality, "quality", f"quality by recompute fraction "
                                             f"({args.task})")])
    return 0
