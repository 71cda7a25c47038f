"""Telling routers and people where the cache is: /v1/score, KV events, ``lookup --explain``.

Real etcd, real agents (in-process agents serve their HTTP port for real; owners that must die
or hang are processes), real ZMQ between ``lmcache-p2p events`` and the example consumer, which
decodes with vLLM's own ``KVEventBatch`` when vLLM is installed.
"""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from agent_helpers import AgentProcess, agent_yaml, config, stop_process, wait_until
from prometheus_client import CollectorRegistry
from test_agent_mesh import TOKENS, load_and_check

from lmcache_p2p import metrics_http as metrics_module
from lmcache_p2p import score as score_module
from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.aio import LoopThread
from lmcache_p2p.index.reader import IndexReader
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.plan import LOCAL
from lmcache_p2p.testing.synthetic import preload, synthetic_tokens

CONSUMER = pathlib.Path(__file__).parents[1] / "examples" / "kv_events_consumer.py"


def agent(tmp_path: Path, cluster: str, endpoints: tuple[str, ...], name: str, cpu: str = "64MiB",
          **yaml_extra: Any) -> CacheAgent:
    path = agent_yaml(tmp_path / f"{name}.yaml", node=name, cluster=cluster, endpoints=endpoints, cpu=cpu)
    if yaml_extra:
        data = yaml.safe_load(path.read_text())
        data.update(yaml_extra)
        path.write_text(yaml.safe_dump(data))
    cfg = config(path)
    return CacheAgent.of(cfg, metrics=AgentMetrics(CollectorRegistry())).start()


def post(a: CacheAgent, body: bytes | None, method: str = "POST",
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{a.metrics_port}/v1/score", data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_score_matches_what_a_load_then_serves(etcd, cluster_name, tmp_path):
    a, b, c = (agent(tmp_path, cluster_name, etcd.endpoints, n) for n in "abc")
    try:
        preload(a, 1, TOKENS)
        preload(b, 1, 512)  # b holds the first 2 chunks itself
        tokens = synthetic_tokens(1, TOKENS)
        keys = c.keys_for(tokens)[0]
        # everything the answer is checked against: a's 5 chunks, b's 2 and the 3 node records in c's mirror
        assert wait_until(lambda: len(c.lookup(tokens).chunks) == 5 and len(c.index.nodes()) == 3
                          and all(set(o) == {"a", "b"} for o in c.index.owners(c.fp, keys[:2])), 10)
        status, answer = post(c, json.dumps({"tokens": tokens}).encode())
        assert status == 200, answer
        rows = {r["node"]: r for r in answer["nodes"]}
        assert set(rows) == {"a", "b", "c"} and answer["tokens"] == TOKENS
        assert answer["best"] == "a"  # everything local: the least to load, nothing to pull
        assert rows["a"]["local_tokens"] == {"cpu": TOKENS} and rows["a"]["peer_tokens"] == 0
        assert rows["b"]["local_tokens"] == {"cpu": 512} and rows["b"]["sources"] == {"a": TOKENS - 512}
        assert rows["c"]["local_tokens"] == {} and sum(rows["c"]["sources"].values()) == TOKENS
        assert set(rows["c"]["sources"]) == {"a", "b"}  # the planner spreads chunks both hold over both
        # what each node's own load then does: same hit length, same sources
        for node in ("a", "b", "c"):  # c last: once it loads, it holds the chunks b's plan could take
            row, target = rows[node], {"a": a, "b": b, "c": c}[node]
            loaded, plan = load_and_check(target, 1)
            assert all(loaded) and plan.hit_tokens == row["matched_tokens"]
            local = sum(ch.end - ch.start for ch in plan.chunks if ch.source == LOCAL)
            assert local == sum(row["local_tokens"].values())
            assert {ch.source for ch in plan.chunks if ch.source != LOCAL} == set(row["sources"])
        # a prompt nobody holds: matched 0 everywhere
        status, cold = post(c, json.dumps({"tokens": synthetic_tokens(99, 600)}).encode())
        assert status == 200 and all(r["matched_tokens"] == 0 for r in cold["nodes"])
    finally:
        for x in (a, b, c):
            x.stop()


def test_score_rejects_bad_input_with_a_clear_4xx(etcd, cluster_name, tmp_path):
    a = agent(tmp_path, cluster_name, etcd.endpoints, "a")
    try:
        cases = [
            (b'{"tokens": []}', 400, "non-empty"),
            (b'{"tokens": [1, "x"]}', 400, "integers"),
            (b'{"tokens": [1, -5]}', 400, "integers"),
            (b"not json", 400, "not JSON"),
            (b"[1, 2]", 400, "JSON object"),
            (json.dumps({"tokens": [1, 2], "model": "someone/else"}).encode(), 404, "not served here"),
        ]
        for body, code, words in cases:
            status, answer = post(a, body)
            assert status == code and words in answer["error"], (body[:40], status, answer)
        assert post(a, None, "GET")[0] == 405
        conn = http.client.HTTPConnection("127.0.0.1", a.metrics_port, timeout=10)
        conn.putrequest("POST", "/v1/score")  # announces 64 MiB: refused before any of it is read
        conn.putheader("Content-Length", str(64 << 20))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and "exceeds" in json.loads(resp.read())["error"]
        conn.close()
        assert post(a, json.dumps({"tokens": [5] * 300}).encode())[0] == 200  # still serving
        with urllib.request.urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics", timeout=5) as resp:
            assert b"lmcache_p2p_stored_chunks_total" in resp.read()
        status, answer = post(a, json.dumps({"tokens": [5] * (score_module.MAX_TOKENS + 1)}).encode())
        assert status == 413 and "at most" in answer["error"]  # a prompt past any context: not hashed
    finally:
        a.stop()


def test_the_score_api_asks_for_its_key_when_one_is_set(etcd, cluster_name, tmp_path):
    """``score_api_key``: /v1/score answers only a bearer of it (what the router sends, --score-key-file);
    /metrics stays open to scrapers."""
    key = "k" * 32
    a = agent(tmp_path, cluster_name, etcd.endpoints, "a", score_api_key=key)
    try:
        body = json.dumps({"tokens": [5] * 300}).encode()
        status, answer = post(a, body)
        assert status == 401 and "Bearer" in answer["error"]
        assert post(a, body, headers={"Authorization": "Bearer " + "x" * 32})[0] == 401
        assert post(a, body, headers={"Authorization": f"Bearer {key}"})[0] == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics", timeout=5) as resp:
            assert resp.status == 200
    finally:
        a.stop()


def test_slow_clients_of_the_agents_http_hold_a_bounded_pool_and_are_cut_off(etcd, cluster_name, tmp_path):
    """The HTTP server runs in the engine's process: 200 clients that connect and go silent (or dribble
    their headers) hold at most ``HTTP_WORKERS`` threads and ``HTTP_QUEUE`` waiting connections; the rest
    get a 503 at once, a request beside them gets an answer (a 503 while they hold the pool, never a hang),
    and ``HTTP_TIMEOUT_S`` after they were accepted they are cut and the agent serves again."""
    a = agent(tmp_path, cluster_name, etcd.endpoints, "a")
    slow: list[socket.socket] = []
    try:
        threads_before = threading.active_count()
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", a.metrics_port), timeout=5)
            sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            slow.append(sock)
        time.sleep(0.5)
        threads = threading.active_count() - threads_before
        assert threads <= 2 * metrics_module.HTTP_WORKERS, threads  # a worker and its deadline's timer, not 200
        assert a._metrics_server is not None
        refused = a._metrics_server.refused
        assert refused >= 200 - metrics_module.HTTP_WORKERS - metrics_module.HTTP_QUEUE - 5, refused
        started = time.monotonic()
        try:  # a 503 (or the connection closed on a body not read) at once: not queued behind them
            status = post(a, json.dumps({"tokens": [5] * 300}).encode())[0]
        except urllib.error.URLError:
            status = 503
        assert status in (200, 503) and time.monotonic() - started < 2.0
        with socket.create_connection(("127.0.0.1", a.metrics_port), timeout=5) as sock:  # a plain GET reads it
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 503")
        # the silent ones are closed after HTTP_TIMEOUT_S: the agent answers again
        def serves() -> bool:
            try:
                return post(a, json.dumps({"tokens": [5] * 300}).encode())[0] == 200
            except (urllib.error.URLError, OSError):
                return False

        assert wait_until(serves, 3 * metrics_module.HTTP_TIMEOUT_S)
    finally:
        for sock in slow:
            sock.close()
        a.stop()


def _held(reader: IndexReader) -> set[tuple[str, str, str]]:
    media = {0: "gpu", 1: "cpu", 2: "disk"}
    return {(node, key.hex(), media[tier]) for key, owners in reader.mirror.snapshot().items()
            for node, tier in owners.items()}


def test_kv_events_match_the_index_through_stores_evictions_invalidation_and_death(etcd, cluster_name, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    a = agent(tmp_path, cluster_name, etcd.endpoints, "a", cpu="4MiB")  # 8 chunks: evicts
    b = AgentProcess(agent_yaml(tmp_path / "b.yaml", node="b", cluster=cluster_name, endpoints=etcd.endpoints,
                                ttl=2), seeds=(5,), tokens=TOKENS, log=tmp_path / "b.log").wait_ready()
    publisher = subprocess.Popen([sys.executable, "-m", "lmcache_p2p", "events", "--etcd", ",".join(etcd.endpoints),
                                  "--cluster", cluster_name, "--bind", "tcp://127.0.0.1:*",
                                  "--fingerprint", a.fp.hex()], stdout=subprocess.PIPE, text=True, env=env)
    consumer = None
    try:
        assert publisher.stdout is not None
        endpoint = publisher.stdout.readline().split(" on ")[1].strip()
        consumer = subprocess.Popen([sys.executable, str(CONSUMER), endpoint, "--seconds", "25"],
                                    stdout=subprocess.PIPE, text=True)
        assert consumer.stdout is not None and "subscribed" in consumer.stdout.readline()
        preload(a, 1, TOKENS)  # stored
        preload(a, 2, TOKENS)  # 10 chunks into 8 slots: 2 evicted (no disk)
        fp_hex = a.fp.hex()
        subprocess.run([sys.executable, "-m", "lmcache_p2p", "invalidate", "--etcd", ",".join(etcd.endpoints),
                        "--cluster", cluster_name, "--node", "a"], check=True, env=env,
                       capture_output=True, timeout=60)
        preload(a, 3, TOKENS)  # stored after the invalidation: not covered
        b.kill(signal.SIGKILL)  # its entries go when its 2 s lease ends
        with LoopThread() as loop:
            reader = IndexReader.open(loop, a.config, a.fp)
            try:
                assert wait_until(lambda: "b" not in reader.nodes() and not any(
                    "b" in o for o in reader.mirror.snapshot().values()), 15)
                assert wait_until(lambda: len(reader.mirror) == len(a.tiers.cpu.keys()), 10)
                index = _held(reader)
            finally:
                reader.close()
        out, _ = consumer.communicate(timeout=60)
        table = {tuple(x) for x in json.loads(out.strip().splitlines()[-1])["held"]}
        assert index and table == index, (sorted(table - index)[:3], sorted(index - table)[:3])
        assert all(node == "a" for node, _, _ in table) and fp_hex  # b's chunks were removed when it died
    finally:
        if consumer is not None and consumer.poll() is None:
            consumer.kill()
            consumer.communicate()
        publisher.send_signal(signal.SIGTERM)
        publisher.wait(30)
        if publisher.stdout is not None:
            publisher.stdout.close()
        b.stop()
        a.stop()


def _explain(etcd, cluster: str, fp_hex: str, tokens: list[int], tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps(tokens))
    cfg = agent_yaml(tmp_path / "cli.yaml", node="cli", cluster=cluster, endpoints=etcd.endpoints)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
    r = subprocess.run([sys.executable, "-m", "lmcache_p2p", "lookup", "--config", str(cfg), "--tokens", str(path),
                        "--fingerprint", fp_hex, "--explain", "--json"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)["fingerprints"][fp_hex]["chunks"]


def test_lookup_explain_names_the_reason_for_each_kind_of_miss(etcd, cluster_name, tmp_path):
    a = agent(tmp_path, cluster_name, etcd.endpoints, "a", cpu="4MiB")  # evicts after 8 chunks
    fp16 = agent(tmp_path, cluster_name, etcd.endpoints, "f16", layout={"kv_dtype": "float16"})
    hung = AgentProcess(agent_yaml(tmp_path / "h.yaml", node="h", cluster=cluster_name, endpoints=etcd.endpoints,
                                   ttl=60), seeds=(7,), tokens=TOKENS, log=tmp_path / "h.log").wait_ready()
    fp_hex = a.fp.hex()
    try:
        preload(a, 1, TOKENS)
        preload(fp16, 2, TOKENS)  # the same prompt 2, under another identity
        preload(a, 3, TOKENS)  # 10 chunks into 8 slots: prompt 1's first 2 chunks are evicted
        assert wait_until(lambda: len(a.index.nodes()) == 3, 10)
        stop_process(hung.proc.pid)
        ev = _explain(etcd, cluster_name, fp_hex, synthetic_tokens(1, TOKENS), tmp_path)
        assert [c["reason"] for c in ev] == ["evicted", "evicted", "held", "held", "held"], ev
        assert ev[0]["detail"]["node"] == "a" and not ev[2]["usable"]  # held, but after a gap
        ev = _explain(etcd, cluster_name, fp_hex, synthetic_tokens(2, TOKENS), tmp_path)
        assert {c["reason"] for c in ev} == {"other-identity"}
        assert ev[0]["detail"]["differs"] == ["kv_dtype: 'bfloat16' != 'float16'"]
        ev = _explain(etcd, cluster_name, fp_hex, synthetic_tokens(7, TOKENS), tmp_path)
        assert {c["reason"] for c in ev} == {"owner-down"} and ev[0]["detail"]["silent"] == ["h"]
        ev = _explain(etcd, cluster_name, fp_hex, synthetic_tokens(8, TOKENS), tmp_path)
        assert {c["reason"] for c in ev} == {"no-owner"}
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
        subprocess.run([sys.executable, "-m", "lmcache_p2p", "invalidate", "--etcd", ",".join(etcd.endpoints),
                        "--cluster", cluster_name, "--fingerprint", fp_hex[:12]], check=True, env=env,
                       capture_output=True, timeout=60)
        assert wait_until(lambda: not a.tiers.cpu.keys(), 10)
        ev = _explain(etcd, cluster_name, fp_hex, synthetic_tokens(3, TOKENS), tmp_path)
        assert {c["reason"] for c in ev} == {"invalidated"}
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
        hung.stop()
        fp16.stop()
        a.stop()

