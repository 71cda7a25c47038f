"""The router against hostile etcd writers and hostile clients (real sockets, real etcd, a real router
process; the engines are small recording aiohttp servers, no vLLM).

- etcd writers: an engine announced in a node record is contacted only when the record's ``engine_proof``
  holds under the router key (``lmcache_p2p/router/proof.py``); a forged record next to a real agent's
  receives nothing at all: no prompt, no header, no health check, no score request.
- clients: bodies, read time and requests in flight are bounded; token ids are checked; the client's API
  key reaches the engines on every proxied route, and only engines the operator trusts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import yaml
from agent_helpers import SECRET, agent_yaml, config
from aiohttp import web
from prometheus_client import CollectorRegistry

from lmcache_p2p.agent import CacheAgent
from lmcache_p2p.certs import make_certs
from lmcache_p2p.config import EtcdConfig
from lmcache_p2p.errors import MalformedRecord
from lmcache_p2p.ids import NodeId
from lmcache_p2p.index.client import EtcdClient
from lmcache_p2p.index.etcd_server import free_port
from lmcache_p2p.index.schema import NodeRecord, Schema
from lmcache_p2p.metrics import AgentMetrics
from lmcache_p2p.router.app import ENGINE_HEADER, Router, client_session
from lmcache_p2p.router.config import RouterConfig
from lmcache_p2p.router.engines import Fleet, FleetSource
from lmcache_p2p.router.metrics import Metrics
from lmcache_p2p.router.proof import (
    engine_proof,
    load_transfer_ca,
    router_key,
    signed_engine_proof,
    signed_proof_refusal,
)

REPO = Path(__file__).parents[1]
KEY = router_key(SECRET.encode())
VICTIM = "Bearer sk-victim"


class Recorder:
    """An OpenAI-ish engine that is also an agent (``/v1/score``, claiming the whole prompt is cached on
    it) and records every request it receives. ``api_key``: ``/v1/*`` and ``/tokenize`` want it;
    ``mode`` ok | hang (completions never answer)."""

    def __init__(self, name: str, api_key: str | None = None) -> None:
        self.name = name
        self.api_key = api_key
        self.mode = "ok"
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []  # method, path, headers, body
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Recorder:
        app = web.Application(client_max_size=16 << 20)  # the largest bodies a router passes
        app.router.add_route("*", "/{tail:.*}", self._any)
        self.runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def paths(self, method: str | None = None) -> list[str]:
        return [p for m, p, _, _ in self.seen if method is None or m == method]

    def headers_on(self, path: str) -> list[dict[str, str]]:
        """The headers of the calls made on ``path`` for clients' requests (not the router's own health checks)."""
        return [h for _, p, h, _ in self.seen if p == path and "X-LMCache-P2P-Router" not in h]

    async def _any(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.path, dict(request.headers), body))
        path = request.path
        keyed = path.startswith("/v1/") and path != "/v1/score" or path == "/tokenize"
        if self.api_key and keyed and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        if path == "/health":
            return web.Response()
        if path == "/metrics":
            return web.Response(text='vllm:num_requests_running{engine="0"} 0\nvllm:num_requests_waiting{engine="0"} '
                                     '0\nvllm:kv_cache_usage_perc{engine="0"} 0.1\n')
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": f"model-{self.name}"}]})
        ask = json.loads(body or b"{}")
        if path == "/tokenize":
            text = ask.get("prompt") or json.dumps(ask.get("messages"))
            return web.json_response({"tokens": [ord(c) % 1000 for c in text]})
        if path == "/v1/score":
            return web.json_response({"nodes": [{"node": self.name, "matched_tokens": len(ask.get("tokens", [])),
                                                 "estimated_load_ms": 0.0, "estimated_compute_ms": 0.0}]})
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if not ask.get("stream"):
            return web.json_response({"choices": [{"text": f"answer from {self.name}"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f'data: {{"choices": [{{"text": "{self.name}"}}]}}\n\ndata: [DONE]\n\n'.encode())
        await out.write_eof()
        return out


async def call(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    data = io.BytesIO(raw) if raw is not None else (json.dumps(body) if body is not None else None)
    async with aiohttp.ClientSession() as s, s.request(method, url, data=data, headers={
            "Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, dict(r.headers), await r.read()


async def until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def router_on(source: FleetSource, config: RouterConfig) -> AsyncIterator[tuple[str, Router]]:
    """The router (in this process, on a free port) over ``source``'s engines, healthy ones up."""
    async with client_session() as session:
        metrics = Metrics()
        fleet = Fleet(source, session, interval_s=0.1, timeout_s=5.0, refused=metrics.engines_refused)
        router = Router(fleet, config, session, metrics)
        await fleet.start()
        runner = router.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}", router
        finally:
            await runner.cleanup()
            await fleet.stop()


def record(node: str, url: str, *, key: bytes | None = KEY, cluster: str = "default", pool: str = "mixed",
           metrics_url: str | None = None) -> NodeRecord:
    """A node record announcing ``url``, proven under ``key`` (None: no proof)."""
    metrics_url = metrics_url or url + "/metrics"
    proof = engine_proof(key, cluster=cluster, node_id=node, engine_url=url, engine_pool=pool,
                         metrics_url=metrics_url) if key is not None else None
    return NodeRecord(node_id=NodeId(node), addresses={}, transports=(), metrics_url=metrics_url, engine_url=url,
                      engine_pool=pool, engine_proof=proof)


# --------------------------------------------------------------------------- etcd writers


def test_a_forged_engine_record_next_to_a_proven_one_gets_nothing(etcd, cluster_name, tmp_path):
    """A real agent publishes engine "a" with its proof; three forged records point at a recording server:
    the real record's proof copied onto another engine URL, no proof, a proof under another key. The
    router (its own process, the key printed by ``lmcache-p2p router key``) sends every prompt, header,
    health check and score request to "a" and nothing at all to the forger; without a key it uses neither
    and says why."""

    async def main() -> None:
        honest, evil = await Recorder("a").start(), await Recorder("evil").start()
        try:
            cfg = agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints)
            cfg.write_text(yaml.safe_dump({**yaml.safe_load(cfg.read_text()), "engine_url": honest.url}))
            agent = await asyncio.to_thread(start_agent, cfg)
            try:
                await scenario(agent, cfg, honest, evil)
            finally:
                await asyncio.to_thread(agent.stop)
        finally:
            await honest.stop()
            await evil.stop()

    async def scenario(agent: CacheAgent, cfg: Path, honest: Recorder, evil: Recorder) -> None:
        real = agent.node_record()
        assert real.engine_proof is not None and real.engine_url == honest.url
        forged = {
            "evil-copy": dataclasses.replace(real, node_id=NodeId("evil-copy"), engine_url=evil.url,
                                             metrics_url=evil.url + "/metrics"),
            "evil-none": dataclasses.replace(real, node_id=NodeId("evil-none"), engine_url=evil.url,
                                             metrics_url=evil.url + "/metrics", engine_proof=None),
            "evil-other": record("evil-other", evil.url, key=router_key(b"another cluster's secret, 32 bytes+"),
                                 cluster=cluster_name)}
        forged["evil-url-only"] = dataclasses.replace(real, node_id=NodeId("evil-url-only"), engine_url=evil.url)
        async with EtcdClient(EtcdConfig(endpoints=etcd.endpoints)) as client:
            for node, r in forged.items():
                await client.put(Schema(cluster_name).node(NodeId(node)), r.pack())
        key = subprocess.run([sys.executable, "-m", "lmcache_p2p", "router", "key", "--config", str(cfg)],
                             capture_output=True, text=True, check=True, timeout=60, env=clean_env()).stdout.strip()
        assert bytes.fromhex(key) == KEY
        (tmp_path / "router.key").write_text(key + "\n")
        async with router_process(etcd.endpoints, cluster_name, ["--router-key-file", str(tmp_path / "router.key")],
                                  tmp_path / "r1.log") as url:
            async def ready() -> bool:
                engines = json.loads((await call("GET", url + "/router/engines"))[2])["engines"]
                metrics = (await call("GET", url + "/metrics"))[2].decode()
                refused = 'lmcache_p2p_router_engines_refused_total{reason="bad_proof"} 3.0' in metrics and \
                    'lmcache_p2p_router_engines_refused_total{reason="no_proof"} 1.0' in metrics
                return refused and [(e["node"], e["healthy"], e["static"]) for e in engines] == [("a", True, False)]

            await until(ready, 60, "the router never showed a healthy 'a' and the 4 forged records refused")
            headers = {"Authorization": VICTIM, "X-Request-Id": "req-1"}
            for i in range(6):
                status, got, body = await call("POST", url + "/v1/completions",
                                               {"prompt": f"secret prompt {i}", "max_tokens": 2}, headers)
                assert status == 200 and got[ENGINE_HEADER] == "a" and b"answer from a" in body
            status, got, body = await call("POST", url + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "secret chat"}], "stream": True}, headers)
            assert status == 200 and got[ENGINE_HEADER] == "a" and b'"a"' in body
            status, _, body = await call("GET", url + "/v1/models", headers=headers)
            assert status == 200 and b"model-a" in body
            await asyncio.sleep(1.0)  # several health rounds (0.2 s apart) more
        assert evil.seen == [], f"the forged engine was contacted: {evil.paths()}"
        assert honest.paths("POST").count("/v1/completions") == 6 and "/tokenize" in honest.paths()
        assert "/health" in honest.paths() and "/metrics" in honest.paths()
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models"):
            assert all(h.get("Authorization") == VICTIM for h in honest.headers_on(path)), path
        # without a router key: no announced engine is used, and the log says which and why
        async with router_process(etcd.endpoints, cluster_name, [], tmp_path / "r2.log") as url:
            await until(lambda: logged(tmp_path / "r2.log", "evil-copy", "a"), 60, "no refusal logged")
            state = json.loads((await call("GET", url + "/router/engines"))[2])
            assert state["engines"] == []
            status, _, _ = await call("POST", url + "/v1/completions", {"prompt": "p"}, headers)
            assert status == 503
        assert evil.seen == []
        text = (tmp_path / "r2.log").read_text()
        assert "no router key" in text and "announced engines are ignored" in text

    asyncio.run(main())


def start_agent(cfg: Path) -> CacheAgent:
    c = config(cfg)
    return CacheAgent.of(c, metrics=AgentMetrics(CollectorRegistry())).start()


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}


async def logged(log: Path, *nodes: str) -> bool:
    text = log.read_text() if log.exists() else ""
    return all(f"node record {n!r} ignored" in text for n in nodes)


@contextlib.asynccontextmanager
async def router_process(etcd: tuple[str, ...], cluster: str, args: list[str], log: Path) -> AsyncIterator[str]:
    """``lmcache-p2p router`` over the cluster's node records; yields its URL once it listens."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache_p2p", "router", "--port", str(port), "--etcd",
                                 ",".join(etcd), "--cluster", cluster, "--health-interval", "0.2",
                                 "--health-timeout", "5", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=clean_env(), cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        async def up() -> bool:
            assert proc.poll() is None, f"router exited: {log.read_text()[-2000:]}"
            with contextlib.suppress(aiohttp.ClientError):
                return (await call("GET", url + "/metrics"))[0] == 200
            return False

        await until(up, 60, "the router never listened")
        yield url
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_announced_engines_are_used_only_with_a_proof_that_holds(caplog):
    good = record("good", "http://10.0.0.1:8000")
    cases = {
        "tampered-url": (dataclasses.replace(good, node_id=NodeId("tampered-url"),
                                             engine_url="http://10.6.6.6:8000"), "bad_proof"),
        "tampered-pool": (dataclasses.replace(record("tampered-pool", "http://10.0.0.2:8000"), engine_pool="decode"),
                          "bad_proof"),
        "tampered-metrics": (dataclasses.replace(record("tampered-metrics", "http://10.0.0.3:8000"),
                                                 metrics_url="http://10.6.6.6:9100/metrics"), "bad_proof"),
        "copied": (dataclasses.replace(good, node_id=NodeId("copied")), "bad_proof"),  # the node id is covered
        "other-cluster": (record("other-cluster", "http://10.0.0.4:8000", cluster="other"), "bad_proof"),
        "unproven": (record("unproven", "http://10.0.0.5:8000", key=None), "no_proof"),
        "userinfo": (record("userinfo", "http://user:pw@10.0.0.6:8000"), "bad_url"),
    }
    records = [good] + [r for r, _ in cases.values()]

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            metrics = Metrics()
            fleet = Fleet(FleetSource(records=lambda: records, router_key=KEY), session,
                          refused=metrics.engines_refused)
            assert list(fleet.engines) == ["http://10.0.0.1:8000"]
            assert fleet.refused == {node: reason for node, (_, reason) in cases.items()}
            fleet._discover()  # the same records again: counted and logged once
            counted = {r: metrics.engines_refused.labels(r)._value.get() for r in ("bad_proof", "no_proof", "bad_url")}
            assert counted == {"bad_proof": 5, "no_proof": 1, "bad_url": 1}
            assert sum("ignored" in m for m in caplog.messages) == 7
            keyless = Fleet(FleetSource(records=lambda: records), session, refused=metrics.engines_refused)
            assert keyless.engines == {} and set(keyless.refused.values()) == {"no_router_key"}

    asyncio.run(main())


def test_engine_proof_is_a_node_record_field_checked_like_the_others():
    r = record("a", "http://a:8000")
    assert NodeRecord.unpack(r.pack()).engine_proof == r.engine_proof
    raw = msgpack.unpackb(r.pack())
    for bad in ("zz" * 32, r.engine_proof.upper() if r.engine_proof else "", 7, "ab"):
        with pytest.raises(MalformedRecord, match="engine_proof"):
            NodeRecord.unpack(msgpack.packb({**raw, "engine_proof": bad}))
    older = {k: v for k, v in raw.items() if k != "engine_proof"}  # a node of the last release
    assert NodeRecord.unpack(msgpack.packb(older)).engine_proof is None


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_k8s_secret_script_writes_the_router_key_of_the_cluster_secret(tmp_path):
    k8s = tmp_path / "k8s"
    k8s.mkdir()
    shutil.copy(REPO / "k8s" / "generate-secret.sh", k8s)
    subprocess.run([str(k8s / "generate-secret.sh")], check=True, timeout=30, capture_output=True)
    secret = (k8s / "cluster-secret.txt").read_text()
    assert (k8s / "router-key.txt").read_text() == router_key(secret.encode()).hex()
    assert (k8s / "router-key.txt").stat().st_mode & 0o077 == 0


# --------------------------------------------------------------------------- clients


def test_slow_clients_and_large_bodies_are_cut_off_while_others_are_served():
    async def main() -> None:
        engine = await Recorder("s").start()
        config = RouterConfig(read_timeout_s=1.0, max_body_bytes=64 << 10)
        try:
            async with router_on(FleetSource(static=((engine.url, "mixed", "s"),)), config) as (url, router):
                await until(lambda: healthy(router, 1), 30, "engine never healthy")
                port = int(url.rsplit(":", 1)[1])
                head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Pad: " + b"a" * 2000

                async def trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
                    with contextlib.suppress(ConnectionError):
                        for i in range(len(data)):
                            writer.write(data[i:i + 1])
                            await writer.drain()
                            await asyncio.sleep(0.02)  # 40 s for all of it

                async def slowloris(data: bytes, at_once: bytes = b"") -> bytes:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(at_once)
                    feeding = asyncio.create_task(trickle(writer, data))
                    try:
                        return await asyncio.wait_for(reader.read(), 30)  # until the router closes it
                    except ConnectionResetError:  # closed with our bytes unread: a reset may beat its answer
                        return b"reset"
                    finally:
                        feeding.cancel()
                        writer.close()

                headers = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n" \
                          b"Content-Length: 2000\r\n\r\n"
                headers_cut, body_cut, served = await asyncio.gather(
                    slowloris(head), slowloris(b'{"prompt": "' + b"a" * 1980, at_once=headers),
                    call("POST", url + "/v1/completions", {"prompt": "normal", "max_tokens": 2}))
                assert headers_cut in (b"", b"reset")  # closed, nothing answered
                assert body_cut == b"reset" or body_cut.startswith(b"HTTP/1.1 408") and b"not received" in body_cut
                assert served[0] == 200 and served[1][ENGINE_HEADER] == "s"
                status, _, answer = await call("POST", url + "/v1/completions", raw=b'{"prompt": "' + b"x" * (1 << 20)
                                               + b'"}')
                assert status == 413 and "request body over 65536 bytes" in json.loads(answer)["error"]["message"]
                assert (await call("POST", url + "/v1/completions", {"prompt": "after"}))[0] == 200
                assert router.metrics.refused.labels("read_timeout")._value.get() == 1
                assert router.metrics.refused.labels("too_large")._value.get() == 1
        finally:
            await engine.stop()

    asyncio.run(main())


def test_requests_over_the_concurrency_limit_get_a_503_with_retry_after():
    async def main() -> None:
        engine = await Recorder("c").start()
        engine.mode = "hang"
        config = RouterConfig(max_concurrent=2, first_byte_timeout_s=600.0)
        try:
            async with router_on(FleetSource(static=((engine.url, "mixed", "c"),)), config) as (url, router):
                await until(lambda: healthy(router, 1), 30, "engine never healthy")
                held = [asyncio.create_task(call("POST", url + "/v1/completions", {"prompt": f"p{i}"}))
                        for i in range(2)]
                await until(lambda: at_engine(engine, 2), 30, "the two requests never reached the engine")
                status, headers, body = await call("POST", url + "/v1/completions", {"prompt": "third"})
                assert status == 503 and headers["Retry-After"] == "1"
                assert "requests in flight" in json.loads(body)["error"]["message"]
                status, _, _ = await call("GET", url + "/health")  # probes are never held back
                assert status == 200
                for task in held:
                    task.cancel()
                await asyncio.gather(*held, return_exceptions=True)
                await until(lambda: idle(router), 30, "the cancelled requests were never released")
                engine.mode = "ok"
                assert (await call("POST", url + "/v1/completions", {"prompt": "later"}))[0] == 200
        finally:
            await engine.stop()

    asyncio.run(main())


async def healthy(router: Router, n: int) -> bool:
    return router.fleet.healthy_counts()["healthy"] >= n


async def at_engine(engine: Recorder, n: int) -> bool:
    return engine.paths("POST").count("/v1/completions") >= n


async def idle(router: Router) -> bool:
    return router.in_flight == 0


def test_token_ids_out_of_range_are_a_400_naming_the_first():
    async def main() -> None:
        engine = await Recorder("t").start()
        try:
            async with router_on(FleetSource(static=((engine.url, "mixed", "t"),)), RouterConfig()) as (url, router):
                await until(lambda: healthy(router, 1), 30, "engine never healthy")
                for prompt, named in (([1, 2, 1 << 31], "prompt[2]: token id 2147483648"),
                                      ([-1], "prompt[0]: token id -1"), ([1, 2.5], "prompt[1]: token ids must be"),
                                      ([[1, 2], [3, 1 << 40]], "prompt[1][1]: token id"),
                                      ([True], "prompt[0]: token ids must be integers, got bool"),
                                      ([7, "x"], "prompt[1]: token ids must be integers, got str")):
                    status, _, body = await call("POST", url + "/v1/completions", {"prompt": prompt})
                    assert status == 400 and named in json.loads(body)["error"]["message"], (prompt, body)
                assert engine.paths("POST") == []  # none of them went further
                for prompt in ([1, 2, (1 << 31) - 1], [[1], [2]], ["text", "more"], "text"):
                    assert (await call("POST", url + "/v1/completions", {"prompt": prompt}))[0] == 200, prompt
        finally:
            await engine.stop()

    asyncio.run(main())


def test_api_keys_pass_through_to_trusted_engines_and_guard_the_routers_own_routes():
    """Engines under ``vllm serve --api-key``: the client's key reaches them on every proxied route; with
    ``--forward-authorization static`` an engine announced in a (proven) record never gets it; with the
    router's own API key, every route but /health and /metrics asks for it."""

    async def main() -> None:
        static, announced = await Recorder("s", api_key="k").start(), await Recorder("p").start()
        source = FleetSource(static=((static.url, "mixed", "s"),), records=lambda: [record("p", announced.url)],
                             router_key=KEY, forward_authorization="static")
        try:
            async with router_on(source, RouterConfig(policy="round_robin")) as (url, router):
                await until(lambda: healthy(router, 2), 30, "engines never healthy")
                for _ in range(4):
                    status, got, _ = await call("POST", url + "/v1/completions", {"prompt": "p"},
                                                {"Authorization": "Bearer k"})
                    assert status == 200, got
                models = [await call("GET", url + "/v1/models", headers={"Authorization": "Bearer k"})
                          for _ in range(4)]
                assert all(s == 200 for s, _, _ in models) and {h[ENGINE_HEADER] for _, h, _ in models} == {"s", "p"}
                for path in ("/tokenize", "/v1/models", "/v1/completions"):
                    seen = static.headers_on(path)
                    assert seen and all(h.get("Authorization") == "Bearer k" for h in seen), path
                assert all("Authorization" not in h for _, _, h, _ in announced.seen)
                assert announced.paths("POST").count("/v1/completions") == 2  # used, without the client's key
                for _ in range(2):  # a wrong key: the engine's 401 as it is, not a 503
                    status, got, _ = await call("GET", url + "/v1/models", headers={"Authorization": "Bearer no"})
                    assert status == 401 or got[ENGINE_HEADER] == "p"
            guarded = RouterConfig(api_key="router-key")
            async with router_on(FleetSource(static=((static.url, "mixed", "s"),)), guarded) as (url, router):
                await until(lambda: healthy(router, 1), 30, "engine never healthy")
                for path in ("/router/engines", "/v1/models"):
                    status, got, body = await call("GET", url + path)
                    assert status == 401 and got["WWW-Authenticate"] == "Bearer" and b"API key" in body
                    assert (await call("GET", url + path, headers={"Authorization": "Bearer wrong"}))[0] == 401
                assert (await call("POST", url + "/v1/completions", {"prompt": "p"}))[0] == 401
                status, _, body = await call("GET", url + "/router/engines",
                                             headers={"Authorization": "Bearer router-key"})
                assert status == 200 and json.loads(body)["engines"][0]["node"] == "s"
                assert (await call("GET", url + "/health"))[0] == 200
                assert (await call("GET", url + "/metrics"))[0] == 200
        finally:
            await static.stop()
            await announced.stop()

    asyncio.run(main())


def signed(node: str, url: str, cert: tuple[Path, Path], *, cluster: str = "default", pool: str = "mixed",
           metrics_url: str | None = None) -> NodeRecord:
    """A node record announcing ``url``, its proof signed with the transfer certificate and key ``cert``."""
    metrics_url = metrics_url or url + "/metrics"
    proof = signed_engine_proof(cert[0].read_bytes(), cert[1].read_bytes(), cluster=cluster, node_id=node,
                                engine_url=url, engine_pool=pool, metrics_url=metrics_url)
    return NodeRecord(node_id=NodeId(node), addresses={}, transports=(), metrics_url=metrics_url, engine_url=url,
                      engine_pool=pool, engine_proof=proof)


def test_with_the_transfer_ca_only_a_nodes_own_certificate_proves_its_engine(tmp_path, caplog):
    """Every agent holds the cluster secret, so a keyed proof proves nothing about which node made it: a
    router given the transfer CA takes only proofs signed by the key of a certificate the CA issued, valid
    now, that names the record's node. Node x, holding its own certificate, the secret and etcd, cannot
    announce an engine under any other node id, nor move a's record to its URL; nor can a certificate of
    another CA, or one that names no node. A node's TP ranks (``a-r1``) are covered by its name."""
    certs = make_certs(tmp_path / "pki", ["node-a=node:a", "node-x=node:x", "unnamed"])
    foreign = make_certs(tmp_path / "other-pki", ["node-a=node:a"])
    cas = tuple(load_transfer_ca((tmp_path / "pki" / "ca.crt").read_bytes(), "ca.crt"))
    good = signed("a", "http://10.0.0.1:8000", certs["node-a"])
    rank = signed("a-r1", "http://10.0.0.9:8000", certs["node-a"])
    cases = {
        "keyed": (record("keyed", "http://10.0.0.2:8000"), "keyed_proof"),  # any secret holder's
        "evil": (signed("evil", "http://10.6.6.6:8000", certs["node-x"]), "other_node"),
        "evil-copy": (dataclasses.replace(good, node_id=NodeId("evil-copy")), "other_node"),
        "moved": (dataclasses.replace(signed("moved", "http://10.0.0.3:8000", certs["node-a"]),
                                      engine_url="http://10.6.6.6:8000"), "other_node"),
        "a-r2": (dataclasses.replace(rank, node_id=NodeId("a-r2"), engine_url="http://10.6.6.6:8000"),
                    "bad_proof"),  # a's certificate names a-r2 too, but the signature covers a-r1 and its URL
        "a-r3": (signed("a-r3", "http://10.0.0.4:8000", foreign["node-a"]), "untrusted_cert"),
        "unnamed": (signed("unnamed", "http://10.0.0.5:8000", certs["unnamed"]), "other_node"),
        "unproven": (record("unproven", "http://10.0.0.6:8000", key=None), "no_proof"),
    }
    records = [good, rank] + [r for r, _ in cases.values()]
    for r in records:  # every form travels in a node record
        assert NodeRecord.unpack(r.pack()).engine_proof == r.engine_proof

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            fleet = Fleet(FleetSource(records=lambda: records, transfer_ca=cas, router_key=KEY), session)
            assert sorted(fleet.engines) == ["http://10.0.0.1:8000", "http://10.0.0.9:8000"]
            assert fleet.refused == {node: reason for node, (_, reason) in cases.items()}
            keyed_only = Fleet(FleetSource(records=lambda: [good], router_key=KEY), session)
            assert keyed_only.engines == {} and keyed_only.refused == {"a": "no_transfer_ca"}

    asyncio.run(main())
    fields = {"cluster": "default", "node_id": "a", "engine_url": good.engine_url, "engine_pool": "mixed",
              "metrics_url": good.metrics_url}
    assert signed_proof_refusal(cas, good.engine_proof, **fields) is None
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3650)  # the certificate has expired
    assert signed_proof_refusal(cas, good.engine_proof, now=later, **fields) == "expired_cert"
    assert signed_proof_refusal(cas, good.engine_proof, **{**fields, "cluster": "other"}) == "bad_proof"


def test_an_agent_with_a_transfer_certificate_signs_the_engine_it_announces(tmp_path, etcd, cluster_name):
    """A real agent with ``transfer.tls_*`` publishes a signed proof in its node record (read back from etcd)
    that holds under the transfer CA; without TLS, the keyed one."""
    certs = make_certs(tmp_path / "pki", ["node-a=node:a"])
    cas = tuple(load_transfer_ca((tmp_path / "pki" / "ca.crt").read_bytes(), "ca.crt"))
    tls = {"tls_ca_cert": str(tmp_path / "pki" / "ca.crt"), "tls_cert": str(certs["node-a"][0]),
           "tls_key": str(certs["node-a"][1])}
    cfg = agent_yaml(tmp_path / "a.yaml", node="a", cluster=cluster_name, endpoints=etcd.endpoints, transfer=tls)
    cfg.write_text(yaml.safe_dump({**yaml.safe_load(cfg.read_text()), "engine_url": "http://10.0.0.1:8000"}))
    agent = start_agent(cfg)
    try:
        async def read() -> NodeRecord:
            async with EtcdClient(EtcdConfig(endpoints=etcd.endpoints)) as client:
                kv, _ = await client.get(Schema(cluster_name).node(NodeId("a")))
                assert kv is not None
                return NodeRecord.unpack(kv.value)

        published = asyncio.run(read())
    finally:
        agent.stop()
    assert published.engine_proof is not None and published.engine_proof.startswith("x509:")
    assert signed_proof_refusal(cas, published.engine_proof, cluster=cluster_name, node_id="a",
                                engine_url="http://10.0.0.1:8000", engine_pool="mixed",
                                metrics_url=published.metrics_url) is None


def test_maximal_bodies_past_the_memory_budget_get_a_503_and_the_router_stays_within_it(tmp_path):
    """48 clients at once, each with the largest body (8 MiB of token ids), at a router process whose only
    engine holds every request it gets (it never answers) and whose budget is 160 MiB: each request reserves
    10 bytes per body byte before its body is read (80 MiB here), so two are admitted and the rest answered
    503 with Retry-After, read by the client after its whole body was sent and dropped. The router's
    resident memory stays within the budget over its idle size (sampled from /proc during the burst: 125-134
    MiB measured);
    admitted all at once (no budget), the same 48 grew it by 2.9 GiB. A small body is served afterwards."""
    tokens = [100_000 + i % 900_000 for i in range(1_040_000)]  # "123456, ": 8 bytes each, just under 8 MiB
    body = json.dumps({"prompt": tokens, "max_tokens": 1}).encode()
    assert 7 << 20 < len(body) <= 8 << 20

    async def main() -> None:
        engine = await Recorder("m").start()
        engine.mode = "hang"
        port = free_port()
        log = open(tmp_path / "router.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "lmcache_p2p", "router", "--port", str(port), "--engine",
                                 f"m={engine.url}", "--health-interval", "0.2", "--health-timeout", "5",
                                 "--max-memory", "160MiB", "--first-byte-timeout", "600", "--policy", "round_robin"],
                                stdout=log, stderr=subprocess.STDOUT, env=clean_env(), cwd=REPO)
        url = f"http://127.0.0.1:{port}"
        try:
            async def ready() -> bool:
                assert proc.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
                with contextlib.suppress(aiohttp.ClientError):
                    return (await call("GET", url + "/health"))[0] == 200
                return False

            await until(ready, 60, "the router never had a healthy engine")
            idle_rss = rss(proc.pid)
            peak = idle_rss
            sending = [asyncio.create_task(call("POST", url + "/v1/completions", raw=body)) for _ in range(48)]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (len([t for t in sending if t.done()]) < 46
                                                   or not await at_engine(engine, 2)):
                peak = max(peak, rss(proc.pid))
                await asyncio.sleep(0.02)
            done = [t.result() for t in sending if t.done()]
            assert len(done) == 46 and all(status == 503 and headers["Retry-After"] == "1" and b"MiB" in answer
                                           for status, headers, answer in done), [d[0] for d in done]
            for _ in range(25):  # the two admitted ones stay held at the engine
                peak = max(peak, rss(proc.pid))
                await asyncio.sleep(0.02)
            assert peak - idle_rss < 160 << 20, f"router grew {(peak - idle_rss) >> 20} MiB over its idle size"
            metrics = (await call("GET", url + "/metrics"))[2].decode()
            assert 'lmcache_p2p_router_refused_total{reason="memory"} 46.0' in metrics
            for task in sending:
                task.cancel()
            await asyncio.gather(*sending, return_exceptions=True)
            engine.mode = "ok"
            await until(lambda: served(url), 30, "a small request was never served after the burst")
        finally:
            proc.terminate()
            proc.wait(15)
            log.close()
            await engine.stop()

    asyncio.run(main())


def rss(pid: int) -> int:
    """Resident memory of process ``pid`` in bytes (/proc/PID/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError(f"no VmRSS for {pid}")


async def served(url: str) -> bool:
    return (await call("POST", url + "/v1/completions", {"prompt": "small", "max_tokens": 1}))[0] == 200
