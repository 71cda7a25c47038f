"""The router's logic over real HTTP in milliseconds: the policy's choice, retries before the first byte,
health checks taking an engine out, bounded waits, bad input. The engines here are small aiohttp apps
that answer like vLLM's OpenAI server (or hang, fail, break a stream); the same router against real vLLM
engines on CPU, SIGKILLed and SIGSTOPped ones and disaggregated prefill: ``tests/test_vllm_router.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from lmcache_p2p.ids import NodeId
from lmcache_p2p.index.schema import NodeRecord
from lmcache_p2p.request_params import EXPECT_PARAM
from lmcache_p2p.router.app import ENGINE_HEADER, Router, client_session
from lmcache_p2p.router.config import RouterConfig
from lmcache_p2p.router.engines import Engine, Fleet, FleetSource
from lmcache_p2p.router.policy import Pending, Policy
from lmcache_p2p.router.proof import engine_proof

KEY = bytes(range(32))  # a router key for records proven in these tests


def proven(record: NodeRecord, cluster: str = "default") -> NodeRecord:
    """``record`` with the proof its agent would publish under ``KEY``."""
    assert record.engine_url is not None
    proof = engine_proof(KEY, cluster=cluster, node_id=record.node_id, engine_url=record.engine_url,
                         engine_pool=record.engine_pool, metrics_url=record.metrics_url)
    return dataclasses.replace(record, engine_proof=proof)


class FakeEngine:
    """An OpenAI-ish engine: ``mode`` ok | hang | fail (500) | break (a stream cut after its first token);
    ``health`` ok | fail | hang."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.health = "ok"
        self.bodies: list[dict[str, Any]] = []
        self.tokenized = 0
        self.waiting = 0
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.max_model_len: int | None = 8192  # what /v1/models says (None: nothing)

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self.runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        if self.health == "hang":
            await asyncio.sleep(3600)
        return web.Response(status=200 if self.health == "ok" else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        padding = "".join(f"# HELP other_{i} a series the router does not read\n" for i in range(5000))  # ~250 KB
        return web.Response(text=padding + f'vllm:num_requests_running{{engine="0"}} 0\n'
                                 f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
                                 f'vllm:kv_cache_usage_perc{{engine="0"}} 0.1\n')

    async def _models(self, request: web.Request) -> web.Response:
        extra = {"max_model_len": self.max_model_len} if self.max_model_len is not None else {}
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model", **extra}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized += 1
        text = body.get("prompt") or json.dumps(body.get("messages"))
        return web.json_response({"tokens": [ord(c) % 1000 for c in text], "count": len(text)})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "slow":  # a long non-streaming answer: nothing until it is complete
            await asyncio.sleep(3.0)
        if self.mode == "fail":
            return web.json_response({"error": "boom"}, status=500)
        if not isinstance(body.get("max_tokens", 1), int) or body.get("max_tokens", 1) < 0:
            return web.json_response({"error": {"message": "max_tokens must be >= 0"}}, status=400)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": f"answer from {self.name}"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"text": "one"}]}\n\n')
        if self.mode == "break":
            assert request.transport is not None
            request.transport.close()
            return out
        await out.write(b'data: {"choices": [{"text": " two"}]}\n\ndata: [DONE]\n\n')
        await out.write_eof()
        return out


Scenario = Callable[[str, list[FakeEngine], Router], Awaitable[None]]


def run_router(n: int, scenario: Scenario, *, config: RouterConfig | None = None,
               pools: tuple[str, ...] | None = None, score: dict[str, Any] | None = None,
               health_timeout_s: float = 0.3, engine_type: Callable[[str], FakeEngine] = FakeEngine,
               scored: list[dict[str, Any]] | None = None, authorizations: list[str | None] | None = None) -> None:
    """``n`` fake engines (``engine_type``) behind a router on a free port; ``scenario(router_url, engines,
    router)``; the score requests it made are appended to ``scored``, their Authorization headers to
    ``authorizations``."""

    async def main() -> None:
        engines = [await engine_type(f"e{i}").start() for i in range(n)]
        score_app = web.Application()

        async def score_handler(request: web.Request) -> web.Response:
            if scored is not None:
                scored.append(await request.json())
            if authorizations is not None:
                authorizations.append(request.headers.get("Authorization"))
            return web.json_response(score or {"nodes": []})

        score_app.router.add_post("/v1/score", score_handler)
        score_runner = web.AppRunner(score_app)
        await score_runner.setup()
        await web.TCPSite(score_runner, "127.0.0.1", 0).start()
        score_url = f"http://127.0.0.1:{score_runner.addresses[0][1]}/v1/score"
        static = tuple((e.url, (pools or ("mixed",) * n)[i], e.name) for i, e in enumerate(engines))
        async with client_session() as session:
            fleet = Fleet(FleetSource(static=static, score_url=score_url), session, interval_s=0.1,
                          timeout_s=health_timeout_s)
            router = Router(fleet, config or RouterConfig(first_byte_timeout_s=2.0), session)
            await fleet.start()
            runner = router.runner()
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            try:
                await scenario(f"http://127.0.0.1:{runner.addresses[0][1]}", engines, router)
            finally:
                await runner.cleanup()
                await fleet.stop()
                for e in engines:
                    await e.stop()
                await score_runner.cleanup()

    asyncio.run(main())


async def post(url: str, body: Any, *, raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, data=raw if raw is not None else json.dumps(body),
                                                    headers={"Content-Type": "application/json"}) as r:
        return r.status, dict(r.headers), await r.read()


def test_answers_pass_through_streaming_or_not_and_name_their_engine():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        status, headers, body = await post(url + "/v1/completions", {"prompt": "hello", "max_tokens": 4})
        assert status == 200 and json.loads(body)["choices"][0]["text"].startswith("answer from e")
        assert headers[ENGINE_HEADER] in ("e0", "e1")
        status, headers, body = await post(url + "/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        assert body == b'data: {"choices": [{"text": "one"}]}\n\ndata: {"choices": [{"text": " two"}]}\n\n' \
                       b'data: [DONE]\n\n'
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
            async with s.get(url + "/health") as r:
                assert r.status == 200 and (await r.json())["healthy"] == 2

    run_router(2, scenario)


def test_bad_input_gets_a_clear_4xx_and_an_engines_4xx_passes_through():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        status, _, body = await post(url + "/v1/completions", None, raw=b"{not json")
        assert status == 400 and "not JSON" in json.loads(body)["error"]["message"]
        status, _, body = await post(url + "/v1/completions", [1, 2])
        assert status == 400 and "JSON object" in json.loads(body)["error"]["message"]
        status, headers, body = await post(url + "/v1/completions", {"prompt": "x", "max_tokens": -1})
        assert status == 400 and "max_tokens" in body.decode() and headers[ENGINE_HEADER]
        assert sum(len(e.bodies) for e in engines) == 1  # a client error is not retried elsewhere

    run_router(2, scenario)


class ShortEngine(FakeEngine):
    """e0 takes 64 tokens, e1 and on 128 (as their /v1/models say)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.max_model_len = 64 if name == "e0" else 128


def test_a_prompt_goes_only_to_engines_whose_context_holds_it_and_one_none_holds_is_a_400():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        await wait_healthy(router, len(engines))
        assert {e.name: e.max_model_len for e in router.fleet.engines.values()} == {"e0": 64, "e1": 128}
        for _ in range(4):  # 100 tokens: only e1's context holds it
            status, headers, _ = await post(url + "/v1/completions", {"prompt": list(range(100)), "max_tokens": 1})
            assert status == 200 and headers[ENGINE_HEADER] == "e1"
        status, _, body = await post(url + "/v1/completions", {"prompt": list(range(128)), "max_tokens": 1})
        assert status == 400 and "maximum context length is 128 tokens" in json.loads(body)["error"]["message"]
        status, _, body = await post(url + "/v1/chat/completions",  # tokenized by the engine: 200 characters
                                     {"messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 1})
        assert status == 400 and "request has " in json.loads(body)["error"]["message"]
        assert sum(len(e.bodies) for e in engines) == 4  # nothing too long reached an engine
        assert router.metrics.refused.labels("too_long")._value.get() == 2
        # An engine that does not say (an API key on /v1/models, an older server): not judged, nothing refused.
        engines[1].max_model_len = None
        router.fleet.engines[engines[1].url].max_model_len = None
        await router.fleet.refresh()
        status, headers, _ = await post(url + "/v1/completions", {"prompt": list(range(300)), "max_tokens": 1})
        assert status == 200 and headers[ENGINE_HEADER] == "e1"

    run_router(2, scenario, engine_type=ShortEngine)


async def wait_healthy(router: Router, n: int, timeout_s: float = 20.0) -> None:
    """Until ``n`` engines passed a health check (beside a CPU hog one 0.3 s check can time out)."""
    deadline = time.monotonic() + timeout_s
    while sum(e.healthy for e in router.fleet.engines.values()) < n:
        assert time.monotonic() < deadline, "engines never all healthy"
        await asyncio.sleep(0.05)


def test_an_engine_failing_or_silent_before_its_first_byte_is_retried_elsewhere():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        engines[0].mode = "fail"
        for _ in range(4):  # round-robin: half of them meet e0 first
            status, headers, _ = await post(url + "/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200 and headers[ENGINE_HEADER] == "e1"
        engines[0].mode = "hang"  # health still answers: only the first-byte timeout catches it
        results = await asyncio.gather(*(post(url + "/v1/completions", {"prompt": "p", "stream": True})
                                         for _ in range(4)))
        assert all(s == 200 and h[ENGINE_HEADER] == "e1" for s, h, _ in results)
        assert router.metrics.retries.labels("http_5xx")._value.get() >= 1
        assert router.metrics.retries.labels("first_byte_timeout")._value.get() >= 1

    run_router(2, scenario, config=RouterConfig(policy="round_robin", first_byte_timeout_s=2.0))


def test_an_engine_taken_out_by_health_checks_releases_its_waiting_requests_at_once():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        engines[0].mode = "hang"
        pending = asyncio.gather(*(post(url + "/v1/completions", {"prompt": f"p{i}"}) for i in range(4)))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        engines[0].health = "hang"  # a SIGSTOPped engine: connections open, nothing answers
        results = await pending
        assert all(s == 200 and h[ENGINE_HEADER] == "e1" for s, h, _ in results)
        assert time.monotonic() - t0 < 15.0  # two failed checks (0.1 s apart, 0.3 s each), not the 30 s timeout
        assert not router.fleet.engines[engines[0].url].healthy
        status, headers, _ = await post(url + "/v1/completions", {"prompt": "next"})
        assert status == 200 and headers[ENGINE_HEADER] == "e1"
        engines[0].health, engines[0].mode = "ok", "ok"
        for _ in range(50):
            if router.fleet.engines[engines[0].url].healthy:
                break
            await asyncio.sleep(0.05)
        assert router.fleet.engines[engines[0].url].healthy  # back after one good check

    run_router(2, scenario, config=RouterConfig(policy="round_robin", first_byte_timeout_s=30.0))


def test_no_engine_left_is_a_503_never_a_hang_and_a_broken_stream_ends_with_an_error_event():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        engines[0].mode = "break"
        status, _, body = await post(url + "/v1/completions", {"prompt": "p", "stream": True})
        assert status == 200 and body.startswith(b'data: {"choices": [{"text": "one"}]}\n\n')
        assert b'"type": "upstream_error"' in body and body.endswith(b"data: [DONE]\n\n")
        engines[0].mode = "fail"
        t0 = time.monotonic()
        status, _, body = await post(url + "/v1/completions", {"prompt": "p"})
        assert status == 503 and "no engine could take the request" in json.loads(body)["error"]["message"]
        engines[0].health = "fail"
        for _ in range(50):
            if not router.fleet.engines[engines[0].url].healthy:
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            assert r.status == 503
        status, _, body = await post(url + "/v1/completions", {"prompt": "p"})
        assert status == 503 and time.monotonic() - t0 < 5.0

    run_router(1, scenario)


def test_disaggregated_requests_prefill_on_one_pool_and_decode_on_the_other_expecting_the_chunks():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        prompt = "x" * 600  # 600 tokens by the fake tokenizer: 2 whole chunks of 256
        status, headers, _ = await post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 8, "stream": True,
                                                                  "stream_options": {"include_usage": True}})
        assert status == 200 and headers[ENGINE_HEADER] == "e1"
        (prefill,), (decode,) = engines[0].bodies, engines[1].bodies
        assert prefill["max_tokens"] == 1 and not prefill["stream"] and "stream_options" not in prefill
        assert decode["max_tokens"] == 8 and decode["stream"]
        assert decode["kv_transfer_params"] == {EXPECT_PARAM: 2}
        engines[0].mode = "fail"  # the prefill pool failing: the decode engine computes the prompt itself
        status, headers, _ = await post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 8})
        assert status == 200 and "kv_transfer_params" not in engines[1].bodies[-1]

    run_router(2, scenario, config=RouterConfig(disaggregated=True, first_byte_timeout_s=2.0),
               pools=("prefill", "decode"))


def engine(name: str, queue: float = 0.0) -> Engine:
    e = Engine(f"http://{name}:8000", node=name, healthy=True)
    if queue:
        e.prefilling[0] = queue
    return e


def row(node: str, matched: int, load_ms: float, compute_ms: float | None) -> dict[str, Any]:
    return {"node": node, "matched_tokens": matched, "estimated_load_ms": load_ms,
            "estimated_compute_ms": compute_ms}


def test_score_load_weighs_the_cache_against_the_queue():
    a, b = engine("a"), engine("b")
    score = {"nodes": [row("a", 2048, 5.0, 20.0), row("b", 0, 0.0, 900.0)]}
    kw: dict[str, Any] = {"tokens": 2100, "hash_key": b"k", "mean_prefill_s": 0.5, "s_per_token": 1e-3}
    assert Policy("score_load").choose([a, b], score=score, **kw).engine is a  # idle: the cache wins
    a.prefilling[1] = 2.0  # a is busy for 2 s: b's 0.9 s prefill answers first
    choice = Policy("score_load").choose([a, b], score=score, **kw)
    assert choice.engine is b and choice.expected_ttft_s == pytest.approx(0.9)  # 2.05 + 2 x 0.025 > 2 x 0.9
    assert Policy("score").choose([a, b], score=score, **kw).engine is a  # score only ignores the queue
    a.prefilling.clear()
    a.waiting = 4  # requests from elsewhere, charged at the mean prefill time: 2.0 + 0.05 > 1.8
    assert Policy("score_load").choose([a, b], score=score, **kw).engine is b
    # an engine the score does not list is estimated from the prompt at the observed rate
    c = engine("c")
    assert Policy("score_load").choose([c], score=score, **kw).expected_prefill_s == pytest.approx(2.1)


def test_routing_calls_go_to_the_least_busy_engine():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        busy, idle = engines
        busy.waiting = 6  # read from its /metrics by the next health check
        deadline = time.monotonic() + 10
        while router.fleet.engines[busy.url].waiting != 6:
            assert time.monotonic() < deadline, "the busy engine's queue was never read"
            await asyncio.sleep(0.02)
        for i in range(6):
            status, _, _ = await post(url + "/v1/completions", {"model": "tiny", "prompt": f"document {i}"})
            assert status == 200
        assert (busy.tokenized, idle.tokenized) == (0, 6)  # never behind the six requests waiting there

    run_router(2, scenario, health_timeout_s=5.0)  # a stalled health check must not take the idle engine out


def test_ties_go_by_rendezvous_hashing_on_the_prompts_first_chunk():
    engines = [engine(n) for n in "abcd"]
    policy = Policy("score_load")
    kw: dict[str, Any] = {"tokens": 512, "score": None, "mean_prefill_s": 0.1, "s_per_token": 1e-3}
    picks = {k: policy.choose(engines, hash_key=bytes([k]), **kw).engine.node for k in range(64)}
    assert all(policy.choose(engines, hash_key=bytes([k]), **kw).engine.node == picks[k] for k in range(64))
    assert set(picks.values()) == set("abcd")  # documents spread over every engine
    rr = Policy("round_robin")
    assert [rr.choose(engines, hash_key=b"k", **kw).engine.node for _ in range(5)] == list("abcda")
    with pytest.raises(ValueError, match="policy must be one of"):
        Policy("fastest")


def test_engines_come_from_node_records_and_leave_with_them():
    def record(node: str, url: str | None, pool: str = "mixed", role: str = "engine") -> NodeRecord:
        r = NodeRecord(node_id=NodeId(node), addresses={}, transports=(), metrics_url=f"http://{node}:9100/metrics",
                       role=role, engine_url=url, engine_pool=pool)
        return proven(r) if url else r

    records = [record("a", "http://a:8000"), record("b", "http://b:8000/", "decode"), record("c", None),
               record("cache", "http://x:1", role="cache")]

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            fleet = Fleet(FleetSource(records=lambda: records, router_key=KEY), session)
            assert {e.url: (e.node, e.pool, e.score_url) for e in fleet.engines.values()} == {
                "http://a:8000": ("a", "mixed", "http://a:9100/v1/score"),
                "http://b:8000": ("b", "decode", "http://b:9100/v1/score")}
            gone = fleet.engines["http://b:8000"]
            records.pop(1)
            fleet._discover()
            assert list(fleet.engines) == ["http://a:8000"] and gone.down.is_set()

    asyncio.run(main())


def test_engine_url_and_pool_are_checked_in_config_and_in_records():
    from lmcache_p2p.config import load_config
    from lmcache_p2p.errors import ConfigError, MalformedRecord

    config = load_config(env={"LMCACHE_P2P_ENGINE_URL": "http://10.0.0.5:8000", "LMCACHE_P2P_ENGINE_POOL": "decode"})
    assert (config.engine_url, config.engine_pool) == ("http://10.0.0.5:8000", "decode")
    for bad, field in ((("engine_url", "ftp://x"), "engine_url"), (("engine_url", "http://x:99999"), "engine_url"),
                       (("engine_pool", "both"), "engine_pool")):
        with pytest.raises(ConfigError, match=field):
            load_config(overrides=dict([bad]))
    record = NodeRecord(node_id=NodeId("a"), addresses={}, transports=(), engine_url="http://a:8000",
                        engine_pool="prefill")
    again = NodeRecord.unpack(record.pack())
    assert (again.engine_url, again.engine_pool) == ("http://a:8000", "prefill")
    import msgpack

    raw = msgpack.unpackb(record.pack())
    for field, value in (("engine_url", "javascript:alert(1)"), ("engine_pool", "all"), ("engine_url", 7)):
        with pytest.raises(MalformedRecord, match=field):
            NodeRecord.unpack(msgpack.packb({**raw, field: value}))
    older = {k: v for k, v in raw.items() if k not in ("engine_url", "engine_pool")}  # a node of the last release
    assert NodeRecord.unpack(msgpack.packb(older)).engine_url is None


def test_a_document_still_being_prefilled_waits_for_its_engine_instead_of_being_computed_twice():
    pending = Pending(chunk=256, ttl_s=10.0)
    doc = list(range(2048))
    first, other = doc + [1] * 52, doc[:1024] + [7] * 1076
    a, b = engine("a"), engine("b")
    kw: dict[str, Any] = {"tokens": 2100, "hash_key": b"k", "score": None, "mean_prefill_s": 0.5,
                          "s_per_token": 1e-3}
    choice = Policy("score_load").choose([a, b], pending=pending.lookup(pending.prefixes(first), 0.0), **kw)
    assert choice is not None
    pending.add(pending.prefixes(first), choice.engine.url, now=0.0)
    choice.engine.prefilling[1] = choice.expected_prefill_s  # 2.1 s: that engine is busy with it
    again = Policy("score_load").choose([a, b], pending=pending.lookup(pending.prefixes(first), 1.0), **kw)
    assert again is not None and again.engine is choice.engine  # 2.1 + 2 x 0.052 s there beats 2 x 2.1 s elsewhere
    assert again.matched_tokens == 2048
    assert pending.lookup(pending.prefixes(other), 1.0) == {choice.engine.url: 1024}  # the shared chunks only
    assert pending.lookup(pending.prefixes(first), 11.0) == {}  # expired: by now the index knows
    blind = Policy("score_load").choose([a, b], pending={}, **kw)
    assert blind is not None and blind.engine is not choice.engine  # what it did before: computed twice


def test_a_long_non_streaming_answer_is_not_a_first_byte_timeout_and_load_is_read_from_a_large_metrics_page():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        engines[0].mode = "slow"  # 3 s, past the 2 s first-byte timeout: its first byte is its last
        engines[0].waiting = 3
        status, headers, _ = await post(url + "/v1/completions", {"prompt": "p", "max_tokens": 500})
        assert status == 200 and headers[ENGINE_HEADER] == "e0" and len(engines[0].bodies) == 1
        assert router.metrics.retries.labels("first_byte_timeout")._value.get() == 0
        await router.fleet.refresh()
        assert router.fleet.engines[engines[0].url].waiting == 3  # parsed past ~250 KB of other series

    run_router(1, scenario, config=RouterConfig(first_byte_timeout_s=2.0))


def test_disaggregated_round_robin_takes_each_pool_in_turn():
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        await wait_healthy(router, len(engines))  # else a pool's engine still unchecked gets no turn
        for i in range(4):
            status, _, _ = await post(url + "/v1/completions", {"prompt": f"p{i}", "max_tokens": 2})
            assert status == 200
        assert [len(e.bodies) for e in engines] == [2, 2, 2, 2]

    run_router(4, scenario, config=RouterConfig(policy="round_robin", disaggregated=True),
               pools=("prefill", "prefill", "decode", "decode"))


def test_a_failed_read_of_the_node_records_keeps_the_engines_known():
    records = [proven(NodeRecord(node_id=NodeId("a"), addresses={}, transports=(), engine_url="http://a:8000"))]
    broken = False

    def read() -> list[NodeRecord]:
        if broken:
            raise RuntimeError("mirror bug")
        return records

    async def main() -> None:
        nonlocal broken
        async with client_session() as session:
            fleet = Fleet(FleetSource(records=read, router_key=KEY), session)
            broken = True
            fleet._discover()
            assert list(fleet.engines) == ["http://a:8000"]

    asyncio.run(main())


def test_the_router_sends_the_agents_score_key_to_v1_score():
    """``--score-key-file``: the agents' ``score_api_key`` goes to their /v1/score as a bearer token (and,
    without one, no Authorization header at all: never the client's)."""
    for key, expected in (("s" * 32, "Bearer " + "s" * 32), (None, None)):
        seen: list[str | None] = []

        async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
            async with aiohttp.ClientSession() as s, s.post(
                    url + "/v1/completions", json={"prompt": list(range(600)), "max_tokens": 1},
                    headers={"Authorization": "Bearer the-clients-own"}) as r:
                assert r.status == 200

        run_router(2, scenario, config=RouterConfig(first_byte_timeout_s=2.0, score_key=key), authorizations=seen)
        assert seen and set(seen) == {expected}, seen
