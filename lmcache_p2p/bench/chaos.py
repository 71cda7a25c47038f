"""``lmcache-p2p bench chaos``: a 4-node mesh of vLLM-CPU engines under load while the network and
the processes fail underneath it; every answer is checked token for token.

Hosts are network namespaces on one machine (:mod:`lmcache_p2p.testing.netlab`, needs root): etcd members on
hosts 0-2, one vLLM-CPU engine (tiny model, eager mode, bf16) with the ``LMCacheP2PConnector`` and
its cache agent on each of hosts 0-3, every one bound to its host's address. A client sends a steady
stream of greedy requests (one at a time, round-robin over the engines that are up) drawn from a
fixed set of long shared documents. A seeded schedule injects one fault at a time, every kind once
per round of seven (a restarting engine may overlap the next faults). The first round opens with the
kill-restart (an engine takes about a minute to start beside the load, and its rejoin is measured
under load, not after it); a later kill-restart is not begun when the load ends sooner than the first
restart took:

- ``cut``             a host's link down (engine, agent and any etcd member there unreachable)
- ``partition_etcd``  a node's host cut off from the etcd hosts only (its peers still reach it)
- ``partition_peers`` a node's host cut off from the other nodes' hosts only (etcd still reaches it)
- ``slow``            a node's link throttled (token bucket)
- ``sigstop``         a node's engine and agent stopped (SIGSTOP), then continued
- ``kill_restart``    a node's engine and agent SIGKILLed, then started again
- ``etcd_kill``       an etcd member SIGKILLed, then restarted on its data

SIGSTOP and SIGKILL wait for the request in flight on that engine (a router would not send it more
work; a killed process loses its own request whatever the cache does); network faults hit anytime.
Every answer is compared with a no-connector engine's answer to the same document (greedy, token
for token): ``wrong_outputs``. A request that errors or times out is a ``failed_request``.
``time_to_rejoin``: from a fault's end (or a restarted engine being ready) until the node's record
is back in etcd. The no-connector engine's TTFTs are the cold baseline of the same run
(``--cached-reference``: its answers come from this machine's reference cache instead, kept by
:mod:`lmcache_p2p.testing.references`, and no cold TTFT is measured).

    lmcache-p2p bench chaos --json                          # the long run (10 min)
    lmcache-p2p bench chaos --duration 120 --fault-every 8  # CI-sized
"""
# Why one file of this size (not in the docstring: it is this command's --help): the schedule of faults, the fleet it
# hits and the report are one experiment, read as one.

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from ..aio import LoopThread
from ..config import EtcdConfig
from ..index.client import EtcdClient
from ..index.etcd_server import EtcdCluster
from ..index.schema import Schema
from ..testing.engine_client import EngineProcess
from ..testing.netlab import NetLab, available
from ..testing.references import reference_tokens
from ..testing.synthetic import synthetic_tokens
from ..testing.tiny_model import create_tiny_model
from .common import bench_parser, progress

CLUSTER = "chaos"
ETCD_HOSTS = (0, 1, 2)
FAULTS = ("cut", "partition_etcd", "partition_peers", "slow", "sigstop", "kill_restart", "etcd_kill")


@dataclasses.dataclass
class Node:
    index: int
    name: str
    config: Path
    engine: EngineProcess | None = None
    up: bool = False
    restarting: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class Chaos:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.lab = NetLab(args.nodes)
        self.etcd: EtcdCluster | None = None
        self.nodes: list[Node] = []
        self.faults: Counter[str] = Counter()
        self.rejoin: list[tuple[str, float]] = []
        self.log: list[str] = []
        self.stop = threading.Event()
        self._watchers: list[threading.Thread] = []
        self.loop = LoopThread("chaos-etcd")
        self.client: EtcdClient | None = None
        self.restart_s: float | None = None  # how long the first restarted engine took to be ready

    # -- setup -------------------------------------------------------------------------------------
    def start(self) -> None:
        self.etcd = self.lab.etcd(ETCD_HOSTS[: min(3, self.args.nodes)], unsafe_no_fsync=True).start()
        self.client = EtcdClient(EtcdConfig(endpoints=self.etcd.endpoints, timeout_s=2.0))
        self.loop.run(self.client.connect(), 30)
        secret = secrets.token_hex(32)
        for i in range(self.args.nodes):
            name = f"node-{i}"
            path = self.work / f"{name}.yaml"
            path.write_text(yaml.safe_dump({
                "node_id": name, "cluster": CLUSTER, "chunk_size": 256, "metrics_port": 0,
                "metrics_host": self.lab.ip(i), "tiers": {"cpu_capacity": "256MiB"},
                "etcd": {"endpoints": list(self.etcd.endpoints), "lease_ttl_s": self.args.lease_ttl, "timeout_s": 3},
                "transfer": {"transports": ["tcp"], "listen_host": self.lab.ip(i), "secret": secret, "timeout_s": 5},
            }))
            self.nodes.append(Node(i, name, path))
        for node in self.nodes:
            self._launch(node)
        for node in self.nodes:
            self._ready(node)

    def _launch(self, node: Node) -> None:
        node.engine = EngineProcess(self.args.model, node.config, name=node.name, prefix=self.lab.prefix(node.index),
                                    log_path=self.work / f"{node.name}.{int(time.time())}.log")

    def _ready(self, node: Node) -> None:
        assert node.engine is not None
        node.engine.wait_ready(600)
        node.engine.serve(_tokens(10_000 + node.index, 64), 1)  # warm-up: the first request is slow
        node.up = True

    def registered(self) -> set[str]:
        assert self.client is not None
        client = self.client

        async def read() -> set[str]:
            kvs, _ = await client.get_prefix(Schema(CLUSTER).nodes)
            return {kv.key.rsplit(b"/", 1)[-1].decode() for kv in kvs}

        try:
            return self.loop.run(read(), 10)
        except Exception:
            return set()

    def _await_rejoin(self, node: Node, kind: str, since: float) -> None:
        deadline = since + max(60.0, 10 * self.args.lease_ttl)  # measured even if the load has ended
        while time.monotonic() < deadline:
            if node.name in self.registered():
                self.rejoin.append((kind, time.monotonic() - since))
                return
            time.sleep(0.1)
        self.rejoin.append((kind, float("inf")))

    # -- faults --------------------------------------------------------------------------------------
    def inject(self, t_end: float) -> None:
        t_next = time.monotonic() + self.args.fault_every
        order: list[str] = []
        while not self.stop.wait(max(0.0, t_next - time.monotonic())):
            if not order:  # every kind once per round, in a seeded order; the first round opens with a restart
                order = self.rng.sample(FAULTS, len(FAULTS))
                if not self.faults:
                    order.remove("kill_restart")
                    order.append("kill_restart")
            kind = order.pop()
            if kind == "kill_restart" and self.faults[kind] and (
                    self.restart_s is None or t_end - time.monotonic() < self.restart_s):
                # an engine restarted now would come back after the load: its rejoin would be waited for,
                # not served through
                self.log.append(f"{time.strftime('%H:%M:%S')} kill_restart skipped: the load ends before a restart")
                if not order:
                    t_next = time.monotonic() + self.args.fault_every
                    continue
                kind = order.pop()
            target = self.rng.choice([n for n in self.nodes if not n.restarting] or self.nodes)
            length = self.rng.uniform(*self.args.fault_len)
            try:
                self._fault(kind, target, length)
            except Exception as exc:  # a fault that could not be applied is reported, not fatal
                self.log.append(f"{kind} on {target.name} failed: {exc}")
            t_next = time.monotonic() + self.args.fault_every

    def _fault(self, kind: str, node: Node, length: float) -> None:
        lab, i = self.lab, node.index
        self.faults[kind] += 1
        self.log.append(f"{time.strftime('%H:%M:%S')} {kind} {node.name} {length:.1f}s")
        progress("chaos", f"fault: {kind} on {node.name} for {length:.1f}s")
        if kind == "cut":
            lab.cut(i)
            self._hold(length)
            lab.heal(i)
        elif kind == "partition_etcd":
            lab.partition(i, [h for h in ETCD_HOSTS if h != i and h < len(self.nodes)])
            self._hold(length)
            lab.unpartition(i)
        elif kind == "partition_peers":
            lab.partition(i, [n.index for n in self.nodes if n is not node])
            self._hold(length)
            lab.unpartition(i)
        elif kind == "slow":
            lab.slow(i, rate=self.args.slow_rate)
            self._hold(length)
            lab.unslow(i)
            return
        elif kind == "sigstop":
            with node.lock:
                assert node.engine is not None
                node.up = False
                node.engine.signal_all(signal.SIGSTOP)
                self._hold(length)
                node.engine.signal_all(signal.SIGCONT)
                node.up = True
        elif kind == "kill_restart":
            with node.lock:
                assert node.engine is not None
                node.up, node.restarting = False, True
                node.engine.signal_all(signal.SIGKILL)
                node.engine.stop(5)
            self._hold(length)
            self._launch(node)
            self._watch(self._restarted, node)  # an engine takes a while to start: faults go on meanwhile
            return
        elif kind == "etcd_kill":
            assert self.etcd is not None
            member = self.rng.randrange(len(self.etcd.members))
            self.etcd.kill_member(member)
            self._hold(length)
            self.etcd.restart_member(member)
            return
        if kind != "partition_peers":
            self._watch(self._await_rejoin, node, kind, time.monotonic())

    def _restarted(self, node: Node) -> None:
        started = time.monotonic()
        try:
            self._ready(node)
            if self.restart_s is None:
                self.restart_s = time.monotonic() - started
        except Exception as exc:
            self.log.append(f"{node.name} did not come back: {exc}")
            return
        finally:
            node.restarting = False
        self._await_rejoin(node, "kill_restart", time.monotonic())

    def _watch(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._watchers.append(thread)
        thread.start()

    def _hold(self, seconds: float) -> None:
        self.stop.wait(seconds)

    # -- load --------------------------------------------------------------------------------------------
    def run(self, docs: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
        results: list[dict[str, Any]] = []
        failed, wrong = 0, 0
        t_end = time.monotonic() + self.args.duration
        injector = threading.Thread(target=self.inject, args=(t_end,), name="chaos-faults", daemon=True)
        injector.start()
        turn = 0
        while time.monotonic() < t_end:
            candidates = [n for n in self.nodes if n.up]
            if not candidates:
                time.sleep(0.1)
                continue
            node = candidates[turn % len(candidates)]
            turn += 1
            d = self.rng.randrange(len(docs))
            if not node.lock.acquire(timeout=0.05):
                continue
            try:
                if not node.up:
                    continue
                assert node.engine is not None
                try:
                    out = node.engine.serve(docs[d], self.args.max_tokens, timeout=self.args.request_timeout)
                except Exception as exc:
                    failed += 1
                    self.log.append(f"request to {node.name} failed: {exc}")
                    continue
            finally:
                node.lock.release()
            out["node"], out["doc"] = node.name, d
            if out["tokens"] != reference[d]:
                wrong += 1
                self.log.append(f"WRONG output from {node.name} for doc {d}")
            results.append(out)
        self.stop.set()
        injector.join(600)
        for thread in self._watchers:  # rejoin measurements and restarts still under way
            thread.join(700)
        ttfts = sorted(r["ttft_s"] * 1e3 for r in results)
        prompt_tokens = sum(len(docs[r["doc"]]) for r in results)
        rejoins = [s for _, s in self.rejoin]
        return {
            "requests": len(results) + failed, "failed_requests": failed, "wrong_outputs": wrong,
            "hit_rate": sum(r["num_cached_tokens"] for r in results) / prompt_tokens if prompt_tokens else 0.0,
            "ttft_p50_ms": _pct(ttfts, 0.5), "ttft_p99_ms": _pct(ttfts, 0.99),
            "faults_injected": dict(self.faults), "max_time_to_rejoin_s": max(rejoins, default=0.0),
            "time_to_rejoin_s": {k: max(s for kk, s in self.rejoin if kk == k) for k, _ in self.rejoin},
        }

    def close(self) -> None:
        self.stop.set()
        engines = [node.engine for node in self.nodes if node.engine is not None]
        for engine in engines:
            engine.signal_all(signal.SIGCONT)
        stopping = [threading.Thread(target=engine.stop, args=(30,), daemon=True) for engine in engines]
        for thread in stopping:  # all at once: each waits for its agent's clean stop
            thread.start()
        for thread in stopping:
            thread.join(60)
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.loop.run(self.client.close(), 10)
        self.loop.stop()
        if self.etcd is not None:
            self.etcd.stop()
        self.lab.close()


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _tokens(seed: int, n: int) -> list[int]:
    # within the tiny model's vocabulary; ids 0-2 are its tokenizer's special tokens
    return [t + 3 for t in synthetic_tokens(seed, n, 4000)]


def documents(n: int, tokens: int) -> list[list[int]]:
    return [_tokens(7_000 + i, tokens) for i in range(n)]


def references(model: Path, docs: list[list[int]], max_tokens: int, work: Path) -> tuple[list[list[int]], list[float]]:
    """Greedy answers and cold TTFTs from an engine without a connector (the baseline)."""
    with EngineProcess(model, name="reference", log_path=work / "reference.log") as ref:
        ref.wait_ready(600)
        ref.serve(_tokens(9_999, 64), 1)
        outs = [ref.serve(doc, max_tokens) for doc in docs]
    return [o["tokens"] for o in outs], [o["ttft_s"] * 1e3 for o in outs]


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = Path(args.model) if args.model else create_tiny_model(work / "tiny-llama")
    args.model = model
    docs = documents(args.docs, args.doc_tokens)
    cold: list[float] | None = None
    if args.cached_reference:
        progress("chaos", f"reference outputs: {len(docs)} documents, from this machine's reference cache")
        reference = reference_tokens(model, docs, max_tokens=args.max_tokens, log_path=work / "reference.log",
                                     name="reference")
    else:
        progress("chaos", f"reference outputs: {len(docs)} documents on a plain engine")
        reference, cold = references(model, docs, args.max_tokens, work)
    chaos = Chaos(args, work)
    try:
        progress("chaos", f"starting etcd and {args.nodes} nodes in network namespaces")
        chaos.start()
        progress("chaos", f"load and faults for {args.duration:g}s")
        summary = chaos.run(docs, reference)
    finally:
        chaos.close()
    summary.update({
        "engine_mode": "eager", "model": "tiny (4 layers, hidden 256, bf16)", "nodes": args.nodes,
        "duration_s": args.duration, "lease_ttl_s": args.lease_ttl, "seed": args.seed,
        "docs": args.docs, "doc_tokens": args.doc_tokens,
        "cold_ttft_p50_ms": statistics.median(cold) if cold else None,
        "ttft_p50_vs_cold": summary["ttft_p50_ms"] / statistics.median(cold) if cold else None,
        "goals": {"wrong_outputs == 0": summary["wrong_outputs"] == 0,
                  "failed_requests == 0": summary["failed_requests"] == 0,
                  "rejoin <= 2 x lease TTL": summary["max_time_to_rejoin_s"] <= 2 * args.lease_ttl},
        "events": chaos.log[-200:],
    })
    return summary


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("chaos", __doc__.splitlines()[0], keeps="configs and logs",
                     epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults")
    p.add_argument("--fault-len", type=float, nargs=2, default=(3.0, 10.0), metavar=("MIN", "MAX"))
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lease-ttl", type=int, default=3)
    p.add_argument("--slow-rate", default="16mbit")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="model directory (default: the tiny test model, created offline)")
    p.add_argument("--cached-reference", action="store_true",
                   help="take the no-connector answers from this machine's reference cache (computed once per "
                        "model, vLLM, torch and CPU) instead of a plain engine of this run; no cold TTFT is measured")
    args = p.parse_args(argv)
    why = available()
    if why is not None:
        print(f"lmcache-p2p bench chaos: network namespaces unavailable: {why}", file=sys.stderr)
        return 2
    if args.nodes < 3:
        p.error("--nodes must be >= 3 (etcd members live on hosts 0-2)")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        summary = run(args, Path(args.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="lmcache-p2p-chaos-") as tmp:
            summary = run(args, Path(tmp))
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            if k != "events":
                print(f"{k:>22}: {v}")
    return 0 if all(summary["goals"].values()) else 1

