"""``lmcache-p2p bench tp``: peer hits across tensor-parallel layouts in real vLLM on CPU.

A TP=1 engine (A) and a TP=2 engine (B, one OpenMP thread per rank, ranks on cores 0 and 1) with
the connector, sharing a private etcd; chunks are head-major, so each layout uses the other's:

    ttft_cold_tp1_ms / ttft_cold_tp2_ms   each layout without any connector (the baselines)
    ttft_tp2_hit_from_tp1_ms               B, documents A computed: each rank pulls its heads of A's chunks
    ttft_tp1_hit_from_tp2_ms               A, documents B computed: every chunk assembled from B's ranks
    *_outputs_match_cold                   greedy outputs equal the same layout's cold run

Medians over the prompts, one warm-up per engine, vLLM's own prefix cache off, engine mode eager
(``enforce_eager``). Cold runs are measured with no other engine started.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..index.etcd_server import EtcdServer
from ..testing.engine_client import EngineProcess
from ..testing.tiny_model import create_tiny_model
from .common import bench_parser, emit, progress, run_in_workdir
from .vllm import MODEL_SIZES, add_engine_arguments, agent_config, bench_prompts, median_ms


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = create_tiny_model(work / f"{args.model_size}-llama", **MODEL_SIZES[args.model_size])
    docs_a = bench_prompts(args.prompts, args.tokens, seed=1000)
    docs_b = bench_prompts(args.prompts, args.tokens, seed=2000)
    warm = bench_prompts(4, args.tokens, seed=9000)
    out: dict[str, Any] = {"model": args.model_size, "prompts": args.prompts, "prompt_tokens": args.tokens,
                           "dtype": args.dtype, "transport": args.transport, "engine_mode": "eager"}
    cold: dict[int, list[dict[str, Any]]] = {}
    for i, tp in enumerate((1, 2)):
        progress("tp", f"cold: vLLM alone at TP={tp}")
        with EngineProcess(model, None, name=f"cold-tp{tp}", log_path=work / f"cold{tp}.log", dtype=args.dtype,
                           tensor_parallel_size=tp) as engine:
            engine.wait_ready().ttft([warm[i]])
            cold[tp] = engine.ttft(docs_a + docs_b)
            out[f"ttft_cold_tp{tp}_ms"] = median_ms(cold[tp])
    with EtcdServer(base_dir=str(work)) as etcd:
        a = EngineProcess(model, agent_config(work / "a.yaml", "bench-a", etcd.endpoints, args.transport),
                          name="bench-a", log_path=work / "a.log", dtype=args.dtype)
        b = EngineProcess(model, agent_config(work / "b.yaml", "bench-b", etcd.endpoints, args.transport),
                          name="bench-b", log_path=work / "b.log", dtype=args.dtype, tensor_parallel_size=2)
        try:
            progress("tp", "the mesh: engine A (TP=1) and engine B (TP=2) reuse each other's chunks")
            a.wait_ready().ttft([warm[2]])
            b.wait_ready().ttft([warm[3]])
            a.ttft(docs_a)  # A computes and stores its documents
            hit_b = b.ttft(docs_a)
            b.ttft(docs_b)  # B computes and stores its own
            hit_a = a.ttft(docs_b)
        finally:
            a.stop()
            b.stop()
    n = args.prompts
    out["ttft_tp2_hit_from_tp1_ms"] = median_ms(hit_b)
    out["ttft_tp1_hit_from_tp2_ms"] = median_ms(hit_a)
    out["tp2_hit_cached_tokens"] = [r["num_cached_tokens"] for r in hit_b]
    out["tp1_hit_cached_tokens"] = [r["num_cached_tokens"] for r in hit_a]
    out["tp2_hit_outputs_match_cold"] = [r["tokens"] for r in hit_b] == [r["tokens"] for r in cold[2][:n]]
    out["tp1_hit_outputs_match_cold"] = [r["tokens"] for r in hit_a] == [r["tokens"] for r in cold[1][n:]]
    out["tp2_hit_speedup_vs_cold"] = round(out["ttft_cold_tp2_ms"] / out["ttft_tp2_hit_from_tp1_ms"], 2)
    out["tp1_hit_speedup_vs_cold"] = round(out["ttft_cold_tp1_ms"] / out["ttft_tp1_hit_from_tp2_ms"], 2)
    return out


def main(argv: list[str]) -> int:
    parser = bench_parser("tp", __doc__)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    add_engine_arguments(parser, dtype="float32", model=None, model_size="mid",
                         model_size_help="size of the random-weight test model to create (both have 2 KV heads)")
    args = parser.parse_args(argv)
    result = run_in_workdir(run, args, "lmcache-p2p-bench-tp-")
    emit(result, args.json, "bench tp (median TTFT over prompts; one warm-up per engine)")
    return 0
