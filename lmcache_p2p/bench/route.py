"""``lmcache-p2p bench route``: open-loop load through ``lmcache-p2p router`` on a fleet with the mesh.

N ``vllm serve`` engines with the connector on a private etcd (as ``bench serve`` starts them: eager,
the reserved-CPU setting pinned, vLLM's prefix cache on), each publishing its OpenAI URL in its node
record. For each mode, a ``lmcache-p2p router`` process finds them in etcd and vLLM's own benchmark
client (``vllm bench serve``) sends every request to the router, Poisson arrivals at each rate:

    round_robin     the engines in turn
    score           where the score API expects the cache to answer first; load ignored
    score_load      expected TTFT = queue + the score's load/prefill estimate (the router's default)
    disaggregated   score_load over a prefill pool (the first ``--prefill-engines``) and a decode pool:
                    the prompt prefilled with one output token, the decode engine pulls its chunks

Disaggregated prefill's gap is measured first (``announce_gap``): from a prefill engine's answer until a
decode engine's mirror shows the prompt's chunks. Each mode and rate gets prompts of its own (same sizes,
another seed), so no mode inherits another's cache. Per run: mean, p50 and p99 TTFT and ITL, the share
within the TTFT SLO (failed requests count as misses), output tokens/s, the fleet's hit rate (vLLM's
``prompt_tokens_by_source``) and the answers per engine (the router's own counts). Goodput: the highest
rate with >= 99 % within the SLO. ``vs_round_robin``: mean and p99 TTFT over round-robin's, rate by rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..index.etcd_server import free_port
from ..router.proof import router_key
from ..testing.tiny_model import create_tiny_model
from . import plot
from .common import add_prefix_workload, bench_parser, emit, progress, run_in_workdir
from .serve import REPO, Fleet, _chunk_bytes, goodput, row_of, run_client, start_fleet
from .vllm import MODEL_SIZES, SECRET, add_engine_arguments, bench_prompts
from .workloads import Workload

MODES = ("round_robin", "score", "score_load", "disaggregated")


@contextlib.contextmanager
def router_process(fleet: Fleet, mode: str, args: argparse.Namespace, work: Path) -> Iterator[str]:
    """A ``lmcache-p2p router`` for ``mode`` over the fleet; yields its URL once every engine is healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "lmcache_p2p", "router", "--port", str(port), "--log-level", "WARNING"]
    if mode == "disaggregated":
        score = fleet.agent_metrics[0].replace("/metrics", "/v1/score")
        for i, url in enumerate(fleet.urls):
            pool = "--prefill-engine" if i < args.prefill_engines else "--decode-engine"
            cmd += [pool, f"serve-{i}={url}"]
        cmd += ["--disaggregated", "--score-url", score, "--policy", "score_load"]
    else:
        cmd += ["--etcd", fleet.etcd_endpoints, "--cluster", "bench-serve", "--policy", mode]
    with open(work / f"router-{mode}.log", "w") as log:
        # the router key of the fleet's cluster secret: announced engines are used only with proofs under it
        env = {**os.environ, "LMCACHE_P2P_ROUTER_KEY": router_key(SECRET.encode()).hex()}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"router exited with {proc.returncode} (log {log.name})")
                with contextlib.suppress(OSError, ValueError):
                    with urllib.request.urlopen(url + "/router/engines", timeout=2) as resp:  # noqa: S310 - loopback
                        if sum(e["healthy"] for e in json.loads(resp.read())["engines"]) == len(fleet.urls):
                            break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router not ready (log {log.name})")
                time.sleep(0.3)
            yield url
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            proc.kill()


def _router_counts(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:  # noqa: S310 - loopback
        for line in resp.read().decode().splitlines():
            if line.startswith(("lmcache_p2p_router_route_seconds_sum", "lmcache_p2p_router_route_seconds_count")):
                out[line.split(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
            elif line.startswith("lmcache_p2p_router_score_failures_total{"):
                call = line.split('call="', 1)[1].split('"', 1)[0]
                out[f"score_failures:{call}"] = float(line.rsplit(" ", 1)[1])
            elif line.startswith("lmcache_p2p_router_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                engine = labels.split('engine="', 1)[1].split('"', 1)[0]
                outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
                out[f"{engine}:{outcome}"] = out.get(f"{engine}:{outcome}", 0.0) + float(value)
    return out


def announce_gap(fleet: Fleet, args: argparse.Namespace, samples: int = 5) -> dict[str, Any]:
    """Disaggregated prefill's gap, measured: a prompt of 4 whole chunks prefilled on a prefill-pool engine
    (``max_tokens`` 1); from its answer until a decode-pool engine's agent (its watch-fed mirror, what its
    scheduler plans from) scores all 4 chunks as loadable. Polled every 5 ms, at most 5 s."""
    prefill, decode = 0, args.prefill_engines
    score_url = fleet.agent_metrics[decode].replace("/metrics", "/v1/score")
    gaps: list[float | None] = []
    for prompt in bench_prompts(samples, 4 * 256 + 40, seed=77_000):
        fleet.servers[prefill].complete(prompt, max_tokens=1)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:
            req = urllib.request.Request(score_url, data=json.dumps({"tokens": prompt}).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310 - loopback
                rows = {r["node"]: r for r in json.loads(resp.read())["nodes"]}
            if rows.get(f"serve-{decode}", {}).get("matched_tokens", 0) >= 4 * 256:
                gaps.append(1e3 * (time.monotonic() - t0))
                break
            time.sleep(0.005)
        else:
            gaps.append(None)
    seen = sorted(g for g in gaps if g is not None)
    return {"samples": samples, "seen": len(seen), "gap_ms_p50": round(seen[len(seen) // 2], 1) if seen else None,
            "gap_ms_max": round(seen[-1], 1) if seen else None}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    workload = Workload("prefix", args.num_prompts, args.output_len, prefix_len=args.prefix_len,
                        suffix_len=args.suffix_len, num_prefixes=args.num_prefixes)
    model = Path(args.model) if args.model else create_tiny_model(work / "model", **MODEL_SIZES[args.model_size])
    rates = sorted(float(r) for r in args.rates.split(","))
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"bench route: unknown mode {m!r} (choose from {', '.join(MODES)})")
    args.systems, args.index = "mesh", "watch"
    args.bind = "shared"  # as route.md's runs were measured (bench serve's --bind spread is not re-measured here)
    capacity_chunks = args.engines * _capacity_bytes(args.capacity) // _chunk_bytes(model, args.dtype)
    out: dict[str, Any] = {"engines": args.engines, "engine_mode": "eager", "dtype": args.dtype,
                           "model": str(args.model or args.model_size), "slo_ttft_ms": args.slo_ttft_ms,
                           "workload": {"kind": "prefix", "num_prompts": args.num_prompts,
                                        "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                                        "num_prefixes": args.num_prefixes, "output_len": args.output_len},
                           "rates": rates, "prefill_engines": args.prefill_engines,
                           "ideal_hit_rate": workload.ideal_hit_rate(capacity_chunks), "modes": {}}
    fleet = start_fleet("mesh", args, model, work, bench="route")
    with fleet.stack:
        if "disaggregated" in modes:
            progress("route", "disaggregated: measuring the announce gap")
            out["announce_gap"] = announce_gap(fleet, args)
        for m, mode in enumerate(modes):
            rows = []
            with router_process(fleet, mode, args, work) as url:
                for k, rate in enumerate(rates):
                    progress("route", f"{mode} ({m + 1}/{len(modes)}): rate {rate:g} ({k + 1}/{len(rates)})")
                    run_id = 100 * (m + 1) + k  # prompts of its own per mode and rate
                    before, sent_before = fleet.counters(), _router_counts(url)
                    res = run_client(fleet, workload, rate, run_id, args, model, work, urls=[url],
                                     label=f"route-{mode}-{k}")
                    row = row_of(rate, res, before, fleet.counters(), args.slo_ttft_ms)
                    sent = _router_counts(url)
                    delta = {key: v - sent_before.get(key, 0.0) for key, v in sent.items()}
                    routed = delta.pop("lmcache_p2p_router_route_seconds_count", 0.0)
                    row["route_ms_mean"] = round(1e3 * delta.pop("lmcache_p2p_router_route_seconds_sum", 0.0)
                                                 / routed, 2) if routed else None
                    row["answered_by"] = {key: int(v) for key, v in delta.items() if v > 0}
                    rows.append(row)
            out["modes"][mode] = {"goodput_rps": goodput(rows), "rows": rows}
    base = out["modes"].get("round_robin")
    if base:
        for mode, res in out["modes"].items():
            if mode == "round_robin":
                continue
            res["vs_round_robin"] = [
                {"rate": r["rate"], "ttft_mean": _ratio(r["ttft_mean_ms"], b["ttft_mean_ms"]),
                 "ttft_p99": _ratio(r["ttft_p99_ms"], b["ttft_p99_ms"])}
                for r, b in zip(res["rows"], base["rows"], strict=True)]
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _capacity_bytes(text: str) -> int:
    from ..config import parse_size

    return parse_size(text, "--capacity")


def print_table(result: dict[str, Any]) -> None:
    print(f"bench route: {result['engines']} engines ({result['engine_mode']}, {result['dtype']}), "
          f"workload {result['workload']}; TTFT SLO {result['slo_ttft_ms']:g} ms; ideal hit rate "
          f"{result['ideal_hit_rate']}")
    cols = ["rate", "slo_met", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "output_tok_s", "hit_rate", "failed"]
    print("  " + " ".join(f"{c:>13}" for c in ["mode", *cols]))
    for mode, res in result["modes"].items():
        for r in res["rows"]:
            print("  " + " ".join(f"{v!s:>13}" for v in [mode, *(r[c] for c in cols)]))
        print(f"  {mode:>13} goodput (>= 99 % within SLO): {res['goodput_rps']} req/s"
              + (f"; vs round-robin {res['vs_round_robin']}" if "vs_round_robin" in res else ""))


def main(argv: list[str]) -> int:
    p = bench_parser("route", __doc__, keeps="logs, configs and vLLM's result JSONs")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--prefill-engines", type=int, default=0, help="disaggregated: engines in the prefill pool "
                   "(default: half, rounded up)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--rates", default="0.5,1", help="requests/s, comma-separated")
    add_prefix_workload(p, num_prompts=32)
    p.add_argument("--capacity", default="512MiB", help="each agent's CPU tier")
    p.add_argument("--load-threads", type=int, default=1)
    p.add_argument("--max-concurrency", type=int, default=0)
    add_engine_arguments(p, dtype="bfloat16", transport=False, model_size="tiny",
                         model="model directory (default: a random-weight test model made in the work dir)")
    plot.add_argument(p)
    args = p.parse_args(argv)
    if args.engines < 2:
        p.error("--engines must be >= 2")
    if args.plot:
        plot.require()
    args.prefill_engines = args.prefill_engines or (args.engines + 1) // 2
    if not 0 < args.prefill_engines < args.engines:
        p.error("--prefill-engines must leave at least one engine for each pool")
    result = run_in_workdir(run, args, "lmcache-p2p-bench-route-")
    plot.write("route", result, args.plot, [(plot.ttft_by_rate, "ttft-by-rate", "TTFT by request rate and mode"),
                                            (plot.hit_rate_vs_ideal, "hit-rate", "hit rate against the ideal")])
    if args.json:
        emit(result, True, "")
    else:
        print_table(result)
    return 0
