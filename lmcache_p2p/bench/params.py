"""``lmcache-p2p bench params``: what a hostile client's ``kv_transfer_params`` cost everyone else.

One real ``vllm serve`` (tiny model, eager mode, CPU) with the connector (``etcd.index: lookup``: each
plan reads etcd). A *decode stream* (one streamed completion, its gaps between tokens) and *probes*
(short requests, their time to an answer: TTFT) run beside a flood of requests, twice, alternating:

    plain     the flood's requests carry no parameters
    hostile   the same requests ask for a canary check (``lmcache_p2p_canary: true``) and name an index
              revision etcd never reached (``lmcache_p2p_index_revision: 2**60``)

Unbounded, each hostile request would copy up to 16 chunks on the forward thread and pull every
owner's copy, and would hold its scheduling for 2 s with a linearizable etcd read on the scheduler
thread every step. Bounded (``canary.requested_per_minute``; one read, then the revision is refused),
``hostile_vs_plain`` of the stream's gaps and of the probes' TTFT stays near 1, and the agent's
``request_params_refused_total`` counts the refusals.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from ..index.etcd_server import EtcdServer, free_port
from ..testing.vllm_server import VllmServer, http_get
from .common import bench_parser, emit, progress, ratio, run_in_workdir
from .vllm import add_engine_arguments, bench_prompts

SECRET = "bench-params-" + "0123456789abcdef" * 3
HOSTILE = {"lmcache_p2p_canary": True, "lmcache_p2p_index_revision": 2**60}


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
        return dict(json.loads(resp.read()))


def _stream_gaps(url: str, model: str, prompt: list[int], tokens: int) -> list[float]:
    """Seconds between the streamed tokens of one greedy completion of ``tokens`` tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    arrivals = []
    with urllib.request.urlopen(req, timeout=600) as resp:  # noqa: S310 - loopback
        for line in resp:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]  # from the second token on


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def _phase(url: str, model: str, args: argparse.Namespace, params: dict[str, Any] | None, seed: int
           ) -> dict[str, float]:
    """The stream's gaps and the probes' TTFT while a flood runs (``params``: what its requests carry)."""
    stop = threading.Event()
    flood_prompts = bench_prompts(64, args.flood_tokens, seed=seed)
    sent = [0]

    def flood() -> None:
        i = 0
        while not stop.is_set():
            body: dict[str, Any] = {"model": model, "prompt": flood_prompts[i % len(flood_prompts)], "max_tokens": 1,
                                    "temperature": 0}
            if params is not None:
                body["kv_transfer_params"] = params
            _post(url, body)
            sent[0] += 1
            i += 1

    def probe(out: list[float]) -> None:
        prompts = bench_prompts(1000, 64, seed=seed + 1)
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            _post(url, {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": 1, "temperature": 0})
            out.append(time.perf_counter() - t0)
            i += 1
            time.sleep(0.2)

    ttft: list[float] = []
    workers = [threading.Thread(target=flood, daemon=True) for _ in range(args.flood_clients)]
    workers.append(threading.Thread(target=probe, args=(ttft,), daemon=True))
    for w in workers:
        w.start()
    try:
        time.sleep(1.0)  # the flood under way
        gaps = _stream_gaps(url, model, bench_prompts(1, 128, seed=seed + 2)[0], args.stream_tokens)
    finally:
        stop.set()
        for w in workers:
            w.join(120)
    return {"gap_ms_p50": round(1e3 * statistics.median(gaps), 2),
            "gap_ms_p99": round(1e3 * _percentile(gaps, 0.99), 2),
            "ttft_ms_p50": round(1e3 * statistics.median(ttft), 1) if ttft else 0.0, "flood_requests": sent[0]}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from ..testing.tiny_model import create_tiny_model

    model = Path(args.model) if args.model else create_tiny_model(work / "tiny-llama")
    with EtcdServer(base_dir=str(work)) as etcd:
        metrics_port = free_port()
        cfg = work / "params.yaml"
        cfg.write_text(yaml.safe_dump({
            "node_id": "params-0", "cluster": "bench-params", "metrics_port": metrics_port,
            "etcd": {"endpoints": list(etcd.endpoints), "index": "lookup"},
            "canary": {"requested_per_minute": args.canary_per_minute},
            "transfer": {"transports": ["tcp"], "secret": SECRET}}))
        kv = {"kv_connector": "LMCacheP2PConnector", "kv_role": "kv_both",
              "kv_connector_module_path": "lmcache_p2p.integrations.vllm",
              "kv_connector_extra_config": {"config": str(cfg)}}
        server = VllmServer(model, name="params", log_path=work / "params.log", kv_transfer_config=kv,
                            dtype=args.dtype)
        try:
            progress("params", "starting the engine")
            server.wait_ready()
            name = str(json.loads(http_get(server.url + "/v1/models"))["data"][0]["id"])
            server.complete(bench_prompts(1, 256, seed=1)[0], max_tokens=2)  # warm-up
            out: dict[str, Any] = {"engine_mode": "eager", "stream_tokens": args.stream_tokens,
                                   "flood_clients": args.flood_clients, "flood_tokens": args.flood_tokens,
                                   "canary_per_minute": args.canary_per_minute}
            runs: dict[str, list[dict[str, float]]] = {"plain": [], "hostile": []}
            for r in range(args.rounds):  # alternating, so drift on a shared host hits both alike
                progress("params", f"round {r + 1}/{args.rounds}: plain, then hostile requests")
                runs["plain"].append(_phase(server.url, name, args, None, seed=100 * r))
                runs["hostile"].append(_phase(server.url, name, args, HOSTILE, seed=100 * r + 50))
            for mode, phases in runs.items():
                for key in phases[0]:
                    out[f"{mode}_{key}"] = round(statistics.median(p[key] for p in phases), 2)
            for key in ("gap_ms_p50", "gap_ms_p99", "ttft_ms_p50"):
                out[f"hostile_vs_plain_{key}"] = ratio(out[f"hostile_{key}"], out[f"plain_{key}"])
            text = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
            for line in text.splitlines():
                if line.startswith("lmcache_p2p_request_params_refused_total{"):
                    param = line.split('param="', 1)[1].split('"', 1)[0]
                    out[f"refused:{param}"] = int(float(line.rsplit(" ", 1)[1]))
            return out
        finally:
            server.stop()


def main(argv: list[str]) -> int:
    parser = bench_parser("params", __doc__)
    add_engine_arguments(parser, dtype="bfloat16", transport=False,
                         model="a model directory (default: the tiny test model, created)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--flood-clients", type=int, default=2)
    parser.add_argument("--flood-tokens", type=int, default=512, help="prompt tokens of each flood request")
    parser.add_argument("--canary-per-minute", type=float, default=30.0, help="canary.requested_per_minute")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.stream_tokens < 3 or args.flood_clients < 1:
        parser.error("--rounds >= 1, --stream-tokens >= 3, --flood-clients >= 1")
    emit(run_in_workdir(run, args, "lmcache-p2p-bench-params-"), args.json,
         "hostile kv_transfer_params beside a decode stream (one vLLM engine, eager, tiny model)")
    return 0
