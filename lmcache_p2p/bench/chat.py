"""``lmcache-p2p bench chat``: a multi-turn conversation alternating between two engines of one mesh.

Each turn's prompt is the history (every earlier prompt and the answer the mesh gave) and a new user
message; turn 1 is a first message (a system prompt and a question). Odd turns go to engine A, even
turns to engine B (a router without affinity), both with the ``LMCacheP2PConnector``; then a plain
vLLM engine (no connector) answers the same prompts: its TTFTs are the cold baseline and its answers
the reference. Per turn:

    prompt_tokens     the turn's prompt
    history_with_kv   what earlier turns computed: every earlier token but the last answer token
                      (an answer's last token is never fed back, so its KV never existed)
    reused_tokens     what the engine did not compute (``num_cached_tokens``)
    ttft_cold_ms      plain vLLM, full prefill of the turn
    ttft_mesh_ms      A or B; ``speedup`` is cold / mesh

``reused_of_history`` is reused / history_with_kv over turns 2..N (1.0: only the new message was
computed); ``answers_match_cold`` counts answers equal token for token (greedy; in bf16 a random-weight
model's near-tied logits can flip where the engine computes the new tokens over loaded KV instead of
in one prefill: the tests compare in fp32). TTFT is measured inside the
engine (its step loop), greedy decoding, ``--answer`` tokens per turn. The next turn is sent
``--think-s`` after the answer (a person reads it; the answer's tail is announced a step after it
ends). vLLM's own prefix cache is off on every engine, so A's reuse of its own earlier turns also
comes through the mesh. Engine mode: eager (``enforce_eager``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from ..testing.engine_client import EngineProcess
from ..testing.tiny_model import create_tiny_model
from .common import bench_parser, emit, progress, run_in_workdir
from .vllm import MODEL_SIZES, add_engine_arguments, bench_prompts, started, two_agents


def conversation(first: int, message: int, turns: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """The first prompt and the user messages of turns 2..N (token ids)."""
    return bench_prompts(1, first, seed)[0], bench_prompts(turns - 1, message, seed + 1)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = Path(args.model) if args.model else create_tiny_model(work / f"{args.model_size}-llama",
                                                                   **MODEL_SIZES[args.model_size])
    first, messages = conversation(args.first, args.message, args.turns, seed=3000)
    warm = bench_prompts(2, args.first, seed=9100)
    out: dict[str, Any] = {"model": args.model or args.model_size, "dtype": args.dtype, "turns": args.turns,
                           "first_tokens": args.first, "answer_tokens": args.answer,
                           "message_tokens": args.message, "think_s": args.think_s}
    # The conversation runs on the mesh first, each turn built from the answer the engine gave (what
    # its user saw); then plain vLLM answers the very same prompts. Each measured with no other running.
    prompts: list[list[int]] = [first]
    answers: list[list[int]] = []
    rows: list[dict[str, Any]] = []
    with two_agents(work, "chat", args.transport) as (cfg_a, cfg_b, engines):
        progress("chat", "starting engines A and B (the mesh)")
        for name, cfg in (("chat-a", cfg_a), ("chat-b", cfg_b)):
            started(engines, model, cfg, name, work / f"{name}.log", args.dtype)
        for engine, prompt in zip(engines, warm, strict=True):
            engine.serve(prompt, max_tokens=args.answer)
        for turn in range(args.turns):
            if turn:
                time.sleep(args.think_s)
                prompts.append(prompts[-1] + answers[-1] + messages[turn - 1])
            progress("chat", f"turn {turn + 1}/{args.turns} on {engines[turn % 2].name}")
            got = engines[turn % 2].serve(prompts[turn], max_tokens=args.answer)
            answers.append(got["tokens"])
            history = len(prompts[turn - 1]) + len(answers[turn - 1]) - 1 if turn else 0
            rows.append({"turn": turn + 1, "engine": engines[turn % 2].name, "prompt_tokens": len(prompts[turn]),
                         "history_with_kv": history, "reused_tokens": got["num_cached_tokens"],
                         "ttft_mesh_ms": round(1000 * got["ttft_s"], 1)})
    progress("chat", "plain vLLM: the same prompts (the reference)")
    cold = EngineProcess(model, None, name="cold", log_path=work / "cold.log", dtype=args.dtype)
    matches = []
    try:
        cold.wait_ready()
        cold.serve(warm[0], max_tokens=args.answer)
        for row, prompt, answer in zip(rows, prompts, answers, strict=True):
            got = cold.serve(prompt, max_tokens=args.answer)
            matches.append(got["tokens"] == answer)
            row["ttft_cold_ms"] = round(1000 * got["ttft_s"], 1)
            row["speedup"] = round(row["ttft_cold_ms"] / row["ttft_mesh_ms"], 2)
            row["answer_matches_cold"] = matches[-1]
    finally:
        cold.stop()
    later = rows[1:]
    out["per_turn"] = rows
    out["reused_of_history"] = round(sum(r["reused_tokens"] for r in later) / sum(r["history_with_kv"] for r in later),
                                     4) if later else 0.0
    out["reused_of_prompt"] = round(sum(r["reused_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
                                    4) if later else 0.0
    if later:
        out["ttft_mesh_ms_median_turns_2_on"] = statistics.median(r["ttft_mesh_ms"] for r in later)
        out["ttft_cold_ms_median_turns_2_on"] = statistics.median(r["ttft_cold_ms"] for r in later)
        out["speedup_median_turns_2_on"] = statistics.median(r["speedup"] for r in later)
    out["answers_match_cold"] = f"{sum(matches)} of {len(matches)}"
    return out


def main(argv: list[str]) -> int:
    parser = bench_parser("chat", __doc__)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first", type=int, default=1184, help="tokens of the first prompt")
    parser.add_argument("--answer", type=int, default=96, help="tokens generated per turn")
    parser.add_argument("--message", type=int, default=160, help="tokens of each later user message")
    parser.add_argument("--think-s", type=float, default=1.0, help="pause between an answer and the next turn")
    add_engine_arguments(parser, dtype="bfloat16", model_size="tiny")
    args = parser.parse_args(argv)
    if args.turns < 1 or args.answer < 1 or args.first < 1 or args.message < 1:
        parser.error("--turns, --answer, --first and --message must be >= 1")
    result = run_in_workdir(run, args, "lmcache-p2p-bench-chat-")
    table = dict(result)
    if not args.json:
        for row in table.pop("per_turn"):
            name = f"turn {row['turn']}"
            table[name] = " ".join(f"{k}={v}" for k, v in row.items() if k != "turn")
    emit(table, args.json, "bench chat (one conversation, turns alternating between engines A and B)")
    return 0

