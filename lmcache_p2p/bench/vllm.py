"""``lmcache-p2p bench vllm``: time to first token in real vLLM on CPU, ours against the baselines.

One run, same model, same prompts (2,048 tokens by default), every engine in its own process,
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` for all of them, one warm-up request per engine, cold and miss
each measured with no other engine started:

    ttft_cold_ms         vLLM without any connector
    ttft_miss_ms         engine A with the connector, nothing cached anywhere (A stores the chunks)
    ttft_peer_hit_ms     engine B, started afterwards, same prompts: B pulls A's chunks
    ttft_lmcache_hit_ms  LMCache server mode, second engine process (when scripts/install_lmcache.sh ran)

Then, on engine B, each document served while a decode stream runs on B (the longest gap between
two of the stream's tokens is what the document cost every other request):

    decode_gap_ms_miss       a document nobody holds (B computes it)
    decode_gap_ms_peer_hit   a document A holds
    hung_owner_ttft_ms       A holds the document but is SIGSTOPped (its lease alive): the pull is
                             abandoned at its deadline and B recomputes; hung_owner_vs_miss (goal
                             <= 1.1) compares it with ttft_miss_concurrent_ms, measured the same way
    hung_owner_backed_off_ttft_ms  the next documents A holds, A backed off: recomputed at once
    decode_gap_ms_hung_owner the stream's longest gap while the hung owner's document was served

With ``--stopped-runs N``, then N runs of a stopped owner in a row (``testing/stopped_owner.py``: each
run resumes A, lets B pull from it, stops A, and serves a miss, A's document and another miss beside the
same stream, the document's watched past the abandoned pull's liveness deadline, ``transfer.timeout_s``):

    stopped_runs             per run: ttft_ms, miss_ttft_ms (the mean of the misses before and after),
                             ttft_vs_miss, gap_ms, miss_gap_ms, gap_vs_miss, unanswered / timeout
                             (chunks given up on for A's silence, after asking / in a new connection's
                             handshake), late, silence_ms (how long B waited on A's silence),
                             healthy_pulls (B's pulls from A before the stop until one was all
                             loaded: a give-up on A, just resumed, leaves B's silence allowed doubled)
                             stalled: chunks given up on once A's answer began (``--stop-at mid-answer``:
                             A stops itself after its first chunk frame, ``failpoints.MID_ANSWER``)
    stopped_ttft_vs_miss_max the worst run's document TTFT over its miss's (goal <= 1.1)
    stopped_gap_vs_miss_max  the worst run's decode gap over its miss's (goal <= 1.2)

Medians over the prompts. vLLM's own prefix cache is off everywhere. Engine mode: eager
(``enforce_eager``) for every engine.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from .. import failpoints
from ..index.etcd_server import EtcdServer
from ..testing.engine_client import EngineProcess
from ..testing.stopped_owner import StoppedOwner, metrics_url
from ..testing.synthetic import synthetic_tokens
from ..testing.tiny_model import create_tiny_model
from .common import DTYPES, bench_parser, emit, progress, run_in_workdir

SECRET = "bench-vllm-secret-7f3a9c1e5b2d80461c9e4a7b"
SPARE_DOCS = 3  # documents of A's for --stopped-runs' healthy pulls again (StoppedOwner.pull_healthy)
# tiny: 4 layers, hidden 256 (prefill ~0.2 s here); mid: 8 layers, hidden 1024, 105 M parameters.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "mid": {"num_layers": 8, "hidden": 1024, "heads": 8, "kv_heads": 2, "head_dim": 128, "intermediate": 2816},
}


def add_engine_arguments(parser: argparse.ArgumentParser, *, dtype: str, transport: bool = True,
                         model: str | None = "model directory (default: a test model created in the work dir)",
                         model_size: str | None = None, model_size_help: str | None = None) -> None:
    """The engines' arguments of a vLLM bench: ``--dtype`` (default ``dtype``), ``--transport`` (tcp or
    nixl), ``--model`` (help ``model``; None: not taken) and ``--model-size`` (default ``model_size``; None:
    not taken) of the random-weight model created when no ``--model`` is given."""
    parser.add_argument("--dtype", default=dtype, choices=DTYPES)
    if transport:
        parser.add_argument("--transport", default="tcp", choices=["tcp", "nixl"])
    if model is not None:
        parser.add_argument("--model", help=model)
    if model_size is not None:
        parser.add_argument("--model-size", default=model_size, choices=sorted(MODEL_SIZES), help=model_size_help)


@contextlib.contextmanager
def two_agents(work: Path, prefix: str, transport: str) -> Iterator[tuple[Path, Path, list[EngineProcess]]]:
    """A private etcd, the configs of two agents (``<prefix>-a``, ``<prefix>-b``) and the list of engines
    started over them: each is resumed (an owner a bench SIGSTOPped) and stopped on the way out."""
    with EtcdServer(base_dir=str(work)) as etcd:
        cfg_a = agent_config(work / "a.yaml", f"{prefix}-a", etcd.endpoints, transport)
        cfg_b = agent_config(work / "b.yaml", f"{prefix}-b", etcd.endpoints, transport)
        engines: list[EngineProcess] = []
        try:
            yield cfg_a, cfg_b, engines
        finally:
            for engine in engines:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(engine.pid, signal.SIGCONT)
                engine.stop()


def started(engines: list[EngineProcess], model: Path, config: Path | None, name: str, log_path: Path,
            dtype: str, warm: list[int] | None = None, env: dict[str, str] | None = None) -> EngineProcess:
    """An engine started and ready, kept in ``engines`` (the caller stops them all however it ends), and
    warmed on one ``warm`` prompt (a first request pays one-time costs)."""
    engine = EngineProcess(model, config, name=name, log_path=log_path, dtype=dtype, env=env)
    engines.append(engine)
    engine.wait_ready()
    if warm is not None:
        engine.ttft([warm])
    return engine


def cold_ttft_ms(engines: list[EngineProcess], model: Path, work: Path, dtype: str, warm: list[int],
                 prompts: list[list[int]]) -> float:
    """The baseline: vLLM without a connector, the median TTFT of ``prompts`` after one warm-up (the
    engine stopped after, so that the next one is measured alone)."""
    cold = started(engines, model, None, "cold", work / "cold.log", dtype, warm)
    ttft = median_ms(cold.ttft(prompts))
    cold.stop()
    return ttft


def bench_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Token ids 3..3999: clear of the tiny tokenizer's special ids 0-2."""
    return [[t + 3 for t in synthetic_tokens(seed + i, length, 3997)] for i in range(n)]


def agent_config(path: Path, node: str, endpoints: tuple[str, ...], transport: str,
                 cluster: str = "bench-vllm", cpu_capacity: str = "512MiB",
                 blend: dict[str, Any] | None = None) -> Path:
    path.write_text(yaml.safe_dump({
        "node_id": node, "cluster": cluster, "metrics_port": 0, "tiers": {"cpu_capacity": cpu_capacity},
        "etcd": {"endpoints": list(endpoints)},
        "transfer": {"transports": [transport], "secret": SECRET},
        **({"blend": blend} if blend else {}),
    }))
    return path


def median_ms(results: list[dict[str, Any]]) -> float:
    return round(1000 * statistics.median(r["ttft_s"] for r in results), 2)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    size = MODEL_SIZES[args.model_size]
    model = (Path(args.model) if args.model
             else create_tiny_model(work / f"{args.model_size}-llama", **size))
    prompts = bench_prompts(args.prompts, args.tokens, seed=1000)
    warm = bench_prompts(3, args.tokens, seed=9000)
    hung_docs = bench_prompts(3, args.tokens, seed=5000)
    fresh = bench_prompts(1, args.tokens, seed=7000)
    stream = bench_prompts(1, 40, seed=8000)[0]
    out: dict[str, Any] = {"model": args.model or args.model_size, "prompts": args.prompts,
                           "prompt_tokens": args.tokens, "dtype": args.dtype, "transport": args.transport}
    with two_agents(work, "bench", args.transport) as (cfg_a, cfg_b, engines):
        # Each engine is measured while no other engine has run anything: two vLLM-CPU workers
        # share core 0 here, and one that has just computed keeps spinning its OpenMP threads.
        progress("vllm", "cold: vLLM without a connector")
        out["ttft_cold_ms"] = cold_ttft_ms(engines, model, work, args.dtype, warm[0], prompts)
        progress("vllm", "miss: engine A with the connector, nothing cached")
        a = started(engines, model, cfg_a, "bench-a", work / "a.log", args.dtype, warm[1],
                    env={failpoints.ENV: str(work / "failpoints")} if args.stop_at == "mid-answer" else None)
        miss = a.ttft(prompts)
        out["ttft_miss_ms"] = median_ms(miss)
        a.ttft(hung_docs)  # A holds these too
        # two a run (a healthy pull, the stopped owner's), then spares for healthy pulls again
        stopped_docs = bench_prompts(2 * args.stopped_runs + SPARE_DOCS if args.stopped_runs else 0, args.tokens,
                                     seed=6000)
        if stopped_docs:
            a.ttft(stopped_docs)
        progress("vllm", "peer hit: engine B pulls what A computed")
        b = started(engines, model, cfg_b, "bench-b", work / "b.log", args.dtype)
        out["engine_start_s"] = round(b.startup_s or 0.0, 1)
        b.ttft([warm[2]])
        hit = b.ttft(prompts)
        out["ttft_peer_hit_ms"] = median_ms(hit)
        out["peer_hit_cached_tokens"] = [r["num_cached_tokens"] for r in hit]
        out["peer_hit_outputs_match_miss"] = [r["tokens"] for r in hit] == [r["tokens"] for r in miss]
        progress("vllm", "decode stalls on B: a miss, a peer hit, a hung owner")
        out.update(_stalls(a, b, fresh[0], hung_docs, stream))
        if args.stopped_runs:
            progress("vllm", f"{args.stopped_runs} runs of a stopped owner beside a decode stream")
            out.update(_stopped_runs(a, b, cfg_b, stopped_docs, args, stream, work / "failpoints"))
    out["peer_hit_speedup_vs_cold"] = round(out["ttft_cold_ms"] / out["ttft_peer_hit_ms"], 2)
    out["hung_owner_vs_miss"] = round(out["hung_owner_ttft_ms"] / out["ttft_miss_concurrent_ms"], 3)
    out["miss_overhead_pct"] = round(100 * (out["ttft_miss_ms"] / out["ttft_cold_ms"] - 1), 2)
    if not args.no_lmcache:
        progress("vllm", "LMCache baseline (when installed)")
        ref = _lmcache(model, prompts, args.dtype, work)
        tokens = ref.pop("lmcache_tokens", None)
        if tokens is not None:
            ref["lmcache_outputs_match_miss"] = tokens == [r["tokens"] for r in miss]
        out.update(ref)
        if "ttft_lmcache_hit_ms" in out:
            out["peer_hit_vs_lmcache"] = round(out["ttft_peer_hit_ms"] / out["ttft_lmcache_hit_ms"], 3)
    return out


def _stalls(a: EngineProcess, b: EngineProcess, fresh: list[int], hung_docs: list[list[int]],
            stream: list[int]) -> dict[str, Any]:
    """B serves documents while a decode stream runs on it: a miss, a peer hit, a hung owner."""
    out: dict[str, Any] = {}
    miss = b.concurrent([fresh], stream)[0]
    out["ttft_miss_concurrent_ms"] = round(1000 * miss["ttft_s"], 2)
    out["decode_gap_ms_miss"] = round(1000 * miss["max_gap_s"], 2)
    peer = b.concurrent([hung_docs[0]], stream)[0]
    out["decode_gap_ms_peer_hit"] = round(1000 * peer["max_gap_s"], 2)
    out["ttft_peer_hit_concurrent_ms"] = round(1000 * peer["ttft_s"], 2)
    os.killpg(a.pid, signal.SIGSTOP)
    try:
        hung = b.concurrent(hung_docs[1:], stream)
    finally:
        os.killpg(a.pid, signal.SIGCONT)
    out["hung_owner_ttft_ms"] = round(1000 * hung[0]["ttft_s"], 2)
    out["decode_gap_ms_hung_owner"] = round(1000 * hung[0]["max_gap_s"], 2)
    out["hung_owner_stream_tokens_during"] = hung[0]["stream_tokens_during"]
    if len(hung) > 1:
        out["hung_owner_backed_off_ttft_ms"] = round(1000 * statistics.median(r["ttft_s"] for r in hung[1:]), 2)
    return out


def _stopped_runs(a: EngineProcess, b: EngineProcess, cfg_b: Path, docs: list[list[int]],
                  args: argparse.Namespace, stream: list[int], failpoints_dir: Path) -> dict[str, Any]:
    """``--stopped-runs`` in a row, each against a miss served beside the same stream."""
    from ..config import load_config

    url = metrics_url(cfg_b, "bench-b")
    spares = docs[2 * args.stopped_runs:]
    seeds = itertools.count(9000)

    def fresh_spare() -> list[int]:  # once the spares are spent: a document A computes now
        doc = bench_prompts(1, args.tokens, seed=next(seeds))[0]
        a.generate([doc], max_tokens=1)
        return doc

    owner = (StoppedOwner.mid_answer(a, b, url, failpoints_dir, a_node="bench-a", spares=spares,
                                     more_spares=fresh_spare)
             if args.stop_at == "mid-answer"
             else StoppedOwner(a, b, url, a_node="bench-a", spares=spares, more_spares=fresh_spare))
    watch_s = load_config(cfg_b).transfer.timeout_s + 1.0
    misses = bench_prompts(2 * args.stopped_runs, args.tokens, seed=6500)  # one before, one after each
    runs = []
    for i in range(args.stopped_runs):
        run_i = owner.run(docs[2 * i], docs[2 * i + 1], misses[2 * i + 1], stream, watch_s,
                          miss_before=misses[2 * i])
        progress("vllm", run_i.line(i))
        stopped, miss = run_i.stopped, run_i.miss
        runs.append({"ttft_ms": round(1e3 * stopped["ttft_s"], 1), "miss_ttft_ms": round(1e3 * run_i.miss_ttft_s, 1),
                     "ttft_vs_miss": round(run_i.ttft_ratio, 3), "gap_ms": round(1e3 * stopped["max_gap_s"], 1),
                     "miss_gap_ms": round(1e3 * miss["max_gap_s"], 1), "gap_vs_miss": round(run_i.gap_ratio, 3),
                     "unanswered": run_i.unanswered, "stalled": run_i.stalled, "timeout": run_i.timeout,
                     "late": run_i.late, "healthy_pulls": run_i.healthy_pulls,
                     "silence_ms": None if run_i.silence_s is None else round(1e3 * run_i.silence_s, 1)})
    return {"stopped_runs": runs, "stopped_ttft_vs_miss_max": max(r["ttft_vs_miss"] for r in runs),
            "stopped_gap_vs_miss_max": max(r["gap_vs_miss"] for r in runs)}


def _lmcache(model: Path, prompts: list[list[int]], dtype: str, work: Path) -> dict[str, Any]:
    try:
        from .lmcache_ref import lmcache_available, measure_lmcache_hit
    except ImportError:
        return {"lmcache": "not available"}
    repo = Path(__file__).resolve().parents[2]
    if not lmcache_available(repo):
        return {"lmcache": "not installed (run scripts/install_lmcache.sh)"}
    return measure_lmcache_hit(model, prompts, dtype, work)


def main(argv: list[str]) -> int:
    parser = bench_parser("vllm", __doc__)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    add_engine_arguments(parser, dtype="bfloat16", model_size="tiny",
                         model_size_help="size of the random-weight test model to create")
    parser.add_argument("--no-lmcache", action="store_true", help="skip the LMCache baseline")
    parser.add_argument("--stopped-runs", type=int, default=0,
                        help="then this many runs of a stopped owner in a row, each against a miss beside it")
    parser.add_argument("--stop-at", default="ask", choices=["ask", "mid-answer"],
                        help="when the owner of --stopped-runs stops: before B asks it (SIGSTOP), or once its "
                             "answer began (it stops itself after its first chunk frame)")
    args = parser.parse_args(argv)
    result = run_in_workdir(run, args, "lmcache-p2p-bench-")
    emit(result, args.json, "bench vllm (median TTFT over prompts; one warm-up per engine)")
    return 0
