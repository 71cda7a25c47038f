"""``lmcache-p2p bench route``: score-based routing against round-robin, 3 vLLM engines on CPU.

Three engines with the connector share a private etcd. A tiny router sends each request either
round-robin or to the engine ``POST /v1/score`` names best (asked of one agent: its mirror scores
every engine; the score call is counted in the request's TTFT). The workload: ``--docs`` long
documents, each asked ``--repeats`` times with a different short question appended, in one seeded
order; each policy gets its own documents (same sizes and order), so neither inherits the other's
cache. Reported per policy: mean and p99 TTFT over all requests and over the repeats only (the
first request of a document is a miss under both), the hit tokens, and where the hits came from
(engine-local vs pulled from a peer). Engine mode eager (``enforce_eager``), vLLM's prefix cache
off, one warm-up request per engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from ..ids import NodeId
from ..index.etcd_server import EtcdServer
from ..index.schema import NodeRecord
from ..testing.engine_client import EngineProcess
from ..testing.tiny_model import create_tiny_model
from .common import emit, run_in_workdir
from .vllm import MODEL_SIZES, agent_config, bench_prompts

ENGINES = ("route-a", "route-b", "route-c")


def _records(work: Path, endpoints: tuple[str, ...]) -> dict[NodeId, NodeRecord]:
    from ..aio import LoopThread
    from ..config import load_config
    from ..index.reader import IndexReader

    config = load_config(agent_config(work / "probe.yaml", "probe", endpoints, "tcp", cluster="bench-route"), env={})
    with LoopThread() as loop:
        reader = IndexReader.open(loop, config, b"\0" * 16)  # type: ignore[arg-type]
        try:
            return reader.nodes()
        finally:
            reader.close()


def _score(url: str, tokens: list[int]) -> dict[str, Any]:
    req = urllib.request.Request(url.replace("/metrics", "/v1/score"), data=json.dumps({"tokens": tokens}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - the agents of this run
        return dict(json.loads(resp.read()))


def workload(docs: int, repeats: int, tokens: int, seed: int) -> list[list[int]]:
    bodies = bench_prompts(docs, tokens, seed)
    questions = bench_prompts(docs * repeats, 24, seed + 50_000)
    order = np.random.default_rng(seed).permutation(docs * repeats).tolist()
    return [bodies[i % docs] + questions[i] for i in order]


def _policy(name: str, prompts: list[list[int]], engines: dict[str, EngineProcess], score_url: str) -> dict[str, Any]:
    ttft, cached, seen, sent = [], [], set(), []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        if name == "score":
            answer = _score(score_url, prompt)
            best = answer["best"] if answer["best"] in engines else ENGINES[i % len(ENGINES)]
        else:
            best = ENGINES[i % len(ENGINES)]
        routing_s = time.perf_counter() - t0
        result = engines[best].ttft([prompt])[0]
        doc = tuple(prompt[:64])
        ttft.append((routing_s + result["ttft_s"], doc in seen))
        cached.append(result["num_cached_tokens"])
        seen.add(doc)
        sent.append(best)
    every = [t for t, _ in ttft]
    repeat = [t for t, again in ttft if again]
    return {
        f"{name}_ttft_mean_ms": round(1e3 * statistics.mean(every), 2),
        f"{name}_ttft_p99_ms": round(1e3 * _p99(every), 2),
        f"{name}_repeat_ttft_mean_ms": round(1e3 * statistics.mean(repeat), 2) if repeat else None,
        f"{name}_repeat_ttft_p99_ms": round(1e3 * _p99(repeat), 2),
        f"{name}_hit_tokens": int(sum(cached)),
        f"{name}_requests_per_engine": {e: sent.count(e) for e in ENGINES},
    }


def _p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else 0.0


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = create_tiny_model(work / f"{args.model_size}-llama", **MODEL_SIZES[args.model_size])
    out: dict[str, Any] = {"model": args.model_size, "docs": args.docs, "repeats": args.repeats,
                           "doc_tokens": args.tokens, "dtype": args.dtype, "engine_mode": "eager"}
    with EtcdServer(base_dir=str(work)) as etcd:
        engines: dict[str, EngineProcess] = {}
        try:
            for name in ENGINES:
                cfg = agent_config(work / f"{name}.yaml", name, etcd.endpoints, "tcp", cluster="bench-route")
                engines[name] = EngineProcess(model, cfg, name=name, log_path=work / f"{name}.log", dtype=args.dtype)
            for i, engine in enumerate(engines.values()):
                engine.wait_ready().ttft(bench_prompts(1, args.tokens, 90_000 + i))
            score_url = _records(work, etcd.endpoints)[NodeId(ENGINES[0])].metrics_url or ""
            for seed, name in ((1000, "round_robin"), (2000, "score")):
                out.update(_policy(name, workload(args.docs, args.repeats, args.tokens, seed), engines, score_url))
        finally:
            for engine in engines.values():
                engine.stop()
    for what in ("ttft_mean_ms", "ttft_p99_ms", "repeat_ttft_mean_ms", "repeat_ttft_p99_ms"):
        rr, sc = out[f"round_robin_{what}"], out[f"score_{what}"]
        out[f"score_vs_round_robin_{what.removesuffix('_ms')}"] = round(sc / rr, 3) if rr and sc else None
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p bench route", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--model-size", default="mid", choices=sorted(MODEL_SIZES))
    parser.add_argument("--workdir", help="keep logs and configs here (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run_in_workdir(run, args, "lmcache-p2p-bench-route-")
    emit(result, args.json, "bench route (TTFT incl. the routing call; 3 engines)")
    return 0
