"""``lmcache-p2p router``: an OpenAI-compatible front for a fleet of vLLM engines (aiohttp).

    POST /v1/completions, /v1/chat/completions   routed (streaming or not), the engine's answer as it is
    GET  /v1/models                              a healthy engine's
    GET  /health                                 200 while an engine can take requests (every pool
                                                 disaggregated serving needs), else 503
    GET  /metrics                                the router's Prometheus metrics
    GET  /router/engines                         what the router believes of each engine (JSON)

Every routed answer names its engine in ``X-LMCache-P2P-Engine`` (its agent's node id, else its URL).

What a client can make the router do is bounded: a body over ``max_body_bytes`` is a 413, headers or a
body not in within ``read_timeout_s`` end the connection (a body: 408), more than ``max_concurrent``
requests in flight, or bodies in flight that may hold more than ``max_memory_bytes`` (each reserved at
``MEMORY_PER_BODY_BYTE`` times its declared length before it is read), are answered 503 with
``Retry-After`` (``/health`` and ``/metrics`` are never held back), token ids outside [0, 2^31) are a
400 naming the first, and so is a prompt no healthy engine takes (``max_model_len`` tokens or more, as
each engine's ``/v1/models`` says; a prompt goes only to engines whose context holds it). With
``api_key`` every route but ``/health`` and ``/metrics`` asks for ``Authorization: Bearer <api_key>``
(401 without). The client's
``Authorization`` and ``X-Request-Id`` go with every call made for its request (the routed request,
``/tokenize``, ``/v1/models``) to engines the operator trusts (``engines.py``: static engines and engines
whose node record is proven; ``forward_authorization`` narrows it); never to an agent's ``/v1/score``.

A request is tokenized once (``prompts.py``: the least busy engine's ``/tokenize``, with the chat
template for chat: the exact tokens that engine will see), scored once (the least busy engine's agent's
``/v1/score``), and sent to the engine the policy picks (``policy.py``). Until the engine's first byte of
answer reaches the router nothing has reached the client: an engine that refuses the connection, answers
5xx, is taken out by the health checks or says nothing within ``first_byte_timeout_s`` is charged and the
request goes to the next best engine (at most ``attempts`` engines). After that the stream is the
engine's; if it breaks, a streaming client gets an error event and the end of the stream, a non-streaming
one a 502. Every wait is bounded: tokenize and score by ``route_timeout_s`` (the request is routed without
them past it), placing documents by ``documents_timeout_s``, an answer by ``request_timeout_s``.

A chat request carrying documents as data (vLLM's ``documents`` field, or messages marked
``"lmcache_p2p_document": true``: ``lmcache_p2p/rag.py``) is rewritten, each document a message of its
own, and forwarded with ``kv_transfer_params.lmcache_p2p_segments``: the documents' token spans, found
with the engine's own ``/tokenize`` (``prompts.py``), so its documents are reused in any order. Where
the template does not place them independently, it is forwarded without spans (prefix reuse only),
counted by reason. A request's declared segments are scored too (``/v1/score``'s ``segments``).

Disaggregated prefill (``--disaggregated``): the request first goes to a prefill-pool engine with
``max_tokens`` 1 (its chunks land in the mesh), then to a decode-pool engine with
``kv_transfer_params.lmcache_p2p_expect_chunks``: that engine's scheduler waits, bounded, until its
index shows those chunks (the prefill engine's saves announced) before planning the load.

Why one file of this size: the Router is one aiohttp application whose routes share one engine table, one client
session and one bounded request path, read top to bottom; its configuration and metrics are rooms of their own
(``router/config.py``, ``router/metrics.py``), the choice of engine too (``router/policy.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import xxhash
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..rag import DOCUMENTS_FIELD, DocumentError, place_documents
from ..request_params import EXPECT_PARAM
from .config import MEMORY_PER_BODY_BYTE, RouterConfig
from .engines import Engine, Fleet
from .metrics import Metrics
from .policy import Choice, Pending, Policy
from .prompts import BadPrompt, Prompts

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
GET_PATHS = ("/v1/models", "/health", "/metrics", "/router/engines")
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers: no API key, never held back by the limit
PARSE_INLINE_BYTES = 256 << 10  # larger bodies are parsed off the event loop
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
ENGINE_HEADER = "X-LMCache-P2P-Engine"  # on every routed answer: the engine that gave it


def client_session() -> aiohttp.ClientSession:
    """The router's client: no connection limit, bodies as sent (``identity``: a compressed answer would
    otherwise be relayed without its ``Content-Encoding``)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60), auto_decompress=False,
                                 headers={"Accept-Encoding": "identity"})


class UpstreamFailed(Exception):
    """An engine failed before its first byte: the request may go elsewhere."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Router:
    def __init__(self, fleet: Fleet, config: RouterConfig, session: aiohttp.ClientSession,
                 metrics: Metrics | None = None) -> None:
        """``metrics``: the one whose ``engines_refused`` the fleet counts into (else a new one)."""
        self.fleet = fleet
        self.config = config
        self.session = session
        self.policy = Policy(config.policy)
        self.pending = Pending(config.chunk_tokens)  # score_load: prompts routed moments ago, by prefix
        self.metrics = metrics if metrics is not None else Metrics()
        self.in_flight = 0  # client requests being handled (OPEN_PATHS aside)
        self.memory_in_flight = 0  # what they may hold (MEMORY_PER_BODY_BYTE per body byte, reserved up front)
        self.prompts = Prompts(session, self._least_busy, route_timeout_s=config.route_timeout_s,
                               documents_timeout_s=config.documents_timeout_s, score_key=config.score_key,
                               failures=self.metrics.score_failures, outcomes=self.metrics.documents)
        self._ids = itertools.count()
        self._rotate = itertools.count()
        fleet.on_change = self._engines_changed

    def _engines_changed(self) -> None:
        for state, n in self.fleet.healthy_counts().items():
            self.metrics.engines.labels(state).set(n)

    def runner(self) -> web.AppRunner:
        """The app as served: a handler is cancelled when its client leaves (its engine request with it); a
        connection whose request headers are not in ``read_timeout_s`` after it opened (or after its last
        answer) is closed (aiohttp's keep-alive deadline, which data arriving does not extend)."""
        return web.AppRunner(self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=10.0,
                             keepalive_timeout=self.config.read_timeout_s)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._gate])
        for path in ROUTED_PATHS:
            app.router.add_post(path, self.handle_routed)
        handlers = {"/v1/models": self.handle_models, "/health": self.handle_health, "/metrics": self.handle_metrics,
                    "/router/engines": self.handle_engines}
        for path in GET_PATHS:
            app.router.add_get(path, handlers[path])
        return app

    @web.middleware
    async def _gate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The API key and the limit on requests in flight, before anything is read or sent."""
        if request.path in OPEN_PATHS:
            return await handler(request)
        if self.config.api_key is not None and not _bearer_is(request, self.config.api_key):
            self.metrics.refused.labels("unauthorized").inc()
            response = _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if self.in_flight >= self.config.max_concurrent:
            self.metrics.refused.labels("busy").inc()
            response = _error(503, f"the router has {self.in_flight} requests in flight (its limit); retry later",
                              "service_unavailable")
            response.headers["Retry-After"] = "1"
            return response
        memory = self._memory(request)
        if self.memory_in_flight + memory > self.config.max_memory_bytes:
            self.metrics.refused.labels("memory").inc()
            response = _error(503, f"the router holds {self.memory_in_flight >> 20} MiB of requests in flight and "
                              f"this one may take {memory >> 20} MiB (its limit: {self.config.max_memory_bytes >> 20} "
                              "MiB); retry later", "service_unavailable")
            response.headers["Retry-After"] = "1"
            return response  # its body unread: aiohttp drains and drops it, so that the client reads the 503
        self.in_flight += 1
        self.memory_in_flight += memory
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            self.memory_in_flight -= memory

    def _memory(self, request: web.Request) -> int:
        """What a request may hold while handled, reserved before its body is read: its declared length (the
        largest body when it declares none: chunked), at ``MEMORY_PER_BODY_BYTE``; a bodiless GET nothing."""
        if request.method != "POST":
            return 0
        length = request.content_length
        size = self.config.max_body_bytes if length is None else min(length, self.config.max_body_bytes)
        return MEMORY_PER_BODY_BYTE * size

    # -- small endpoints ------------------------------------------------------------------------

    async def handle_health(self, request: web.Request) -> web.Response:
        pools = ("prefill", "decode") if self.config.disaggregated else ("mixed",)
        ready = all(self.fleet.candidates(pool) for pool in pools)
        return web.json_response({"ready": ready, **self.fleet.healthy_counts()}, status=200 if ready else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_engines(self, request: web.Request) -> web.Response:
        return web.json_response({"policy": self.config.policy, "disaggregated": self.config.disaggregated,
                                  "mean_prefill_s": round(self.fleet.mean_prefill_s, 4),
                                  "prefill_s_per_token": self.fleet.prefill_s_per_token,
                                  "engines": self.fleet.describe()})

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        """A healthy engine's answer (an engine's 4xx, e.g. a wrong API key, as it is)."""
        headers = _client_headers(request)
        for engine in self._any_engines():
            try:
                async with self.session.get(engine.url + "/v1/models", headers=engine.headers(headers),
                                            timeout=self._short()) as resp:
                    body = await resp.read()
                    if resp.status < 500:
                        return web.Response(body=body, status=resp.status, content_type="application/json",
                                            headers={ENGINE_HEADER: engine.name})
            except (TimeoutError, aiohttp.ClientError):
                continue
        return _error(503, "no engine answered /v1/models", "service_unavailable")

    def _any_engines(self) -> list[Engine]:
        engines = [e for e in self.fleet.engines.values() if e.healthy]
        k = next(self._rotate)
        return engines[k % len(engines):] + engines[:k % len(engines)] if engines else []

    def _least_busy(self) -> list[Engine]:
        """Healthy engines, the least busy first (queue, then requests in flight; the rotation breaks ties):
        where the routing calls go (tokenize, score: ``prompts.py``), so they do not wait behind the busiest
        engine's work."""
        mean = self.fleet.mean_prefill_s
        return sorted(self._any_engines(), key=lambda e: (round(e.queue_s(mean), 3), e.inflight))

    def _short(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.config.route_timeout_s)

    # -- routing --------------------------------------------------------------------------------

    async def handle_routed(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        body = await self._read_body(request)
        if not isinstance(body, bytes):
            return body
        try:
            payload = await asyncio.to_thread(json.loads, body) if len(body) > PARSE_INLINE_BYTES else json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _error(400, f"body is not JSON: {exc}", "invalid_request_error")
        except RecursionError:
            return _error(400, "body is not JSON: nested too deeply", "invalid_request_error")
        if not isinstance(payload, dict):
            return _error(400, "body must be a JSON object", "invalid_request_error")
        headers = _client_headers(request)
        chat = request.path == "/v1/chat/completions"
        try:
            plan = place_documents(payload.get("messages"), payload.get(DOCUMENTS_FIELD)) if chat else None
        except DocumentError as exc:
            return _error(400, str(exc), "invalid_request_error")
        if plan is not None:
            payload, tokens = await self.prompts.documents(payload, plan, headers)
            body = json.dumps(payload).encode()
        else:
            try:
                tokens = await self.prompts.tokens(payload, chat, headers)
            except BadPrompt as exc:
                self.metrics.refused.labels("bad_prompt").inc()
                return _error(400, str(exc), "invalid_request_error")
        longest = next((n for p in (("prefill", "decode") if self.config.disaggregated else ("mixed",))
                        if tokens and (n := self.fleet.too_long(p, len(tokens))) is not None), None)
        if tokens and longest is not None:
            self.metrics.refused.labels("too_long").inc()
            return _error(400, f"This model's maximum context length is {longest} tokens. However, your request "
                          f"has {len(tokens)} input tokens. Please reduce the length of the input.",
                          "invalid_request_error")
        if self.config.disaggregated:
            expect = await self._prefill(request.path, payload, tokens, headers)
            if expect:
                params = payload.get("kv_transfer_params")
                params = dict(params) if isinstance(params, dict) else {}
                params[EXPECT_PARAM] = expect
                payload = {**payload, "kv_transfer_params": params}
                body = json.dumps(payload).encode()
            pool = "decode"
        else:
            pool = "mixed"
        return await self._serve(request, request.path, body, payload, tokens, pool, headers, started)

    async def _read_body(self, request: web.Request) -> bytes | web.StreamResponse:
        """The request's body within ``max_body_bytes`` and ``read_timeout_s``, else the error answered. Past
        the time, the connection is closed once the 408 is written (no lingering over a trickling body);
        past the size, the rest of the body is drained and dropped (aiohttp's lingering, at most 10 s) so
        that the client reads the 413 rather than a reset."""
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.metrics.refused.labels("too_large").inc()
            return _error(413, f"request body over {self.config.max_body_bytes} bytes", "invalid_request_error")
        except TimeoutError:
            self.metrics.refused.labels("read_timeout").inc()
        response = _error(408, f"request body not received within {self.config.read_timeout_s:g} s",
                          "invalid_request_error")
        response.force_close()
        await response.prepare(request)
        await response.write_eof()
        if request.transport is not None:
            request.transport.close()
        return response

    async def _serve(self, request: web.Request, path: str, body: bytes, payload: dict[str, Any],
                     tokens: list[int] | None, pool: str, headers: dict[str, str],
                     started: float) -> web.StreamResponse:
        score = await self.prompts.score(tokens, payload) if tokens and self.config.policy != "round_robin" else None
        hash_key = _hash_key(tokens, payload, self.config.chunk_tokens)
        prefixes = self.pending.prefixes(tokens) if tokens and self.config.policy == "score_load" else []
        tried: list[str] = []
        last = "no healthy engine"
        for _ in range(self.config.attempts):
            choice = self.policy.choose(self.fleet.candidates(pool, tried, len(tokens or ())), tokens=len(tokens or ()),
                                        hash_key=hash_key, score=score, mean_prefill_s=self.fleet.mean_prefill_s,
                                        s_per_token=self.fleet.prefill_s_per_token,
                                        pending=self.pending.lookup(prefixes, time.monotonic()))
            if choice is None:
                break
            self.pending.add(prefixes, choice.engine.url, time.monotonic())
            if not tried:
                self.metrics.route_seconds.observe(time.monotonic() - started)
            tried.append(choice.engine.url)
            try:
                return await self._forward(request, path, body, bool(payload.get("stream")), choice, tokens,
                                           headers, started)
            except UpstreamFailed as exc:
                last = f"{choice.engine.name}: {exc}"
                log.warning("request to %s failed before its first byte (%s): %s", choice.engine.name, exc.reason,
                            exc)
                self.metrics.requests.labels(choice.engine.name, exc.reason).inc()
                self.metrics.retries.labels(exc.reason).inc()
        return _error(503, f"no engine could take the request ({len(tried)} tried; last: {last})",
                      "service_unavailable")

    async def _forward(self, request: web.Request, path: str, body: bytes, stream: bool, choice: Choice,
                       tokens: list[int] | None, headers: dict[str, str], started: float) -> web.StreamResponse:
        engine, rid = choice.engine, next(self._ids)
        engine.prefilling[rid] = choice.expected_prefill_s
        engine.inflight += 1
        sent = time.monotonic()
        try:
            async with contextlib.AsyncExitStack() as stack:
                # A non-streaming answer's first byte is its last: it may take the whole request time.
                wait = self.config.first_byte_timeout_s if stream else self.config.request_timeout_s
                resp, first, complete = await self._first_byte(stack, engine, path, body, headers, wait)
                self.metrics.ttft_seconds.observe(time.monotonic() - started)
                if not stream or resp.status != 200:
                    rest = b"" if complete else await resp.read()
                    self.metrics.requests.labels(engine.name, "ok" if resp.status < 400 else f"http_{resp.status}"
                                                 ).inc()
                    return web.Response(body=first + rest, status=resp.status, headers={ENGINE_HEADER: engine.name},
                                        content_type=resp.content_type or "application/json")
                # only a streamed first token times a prefill
                self.fleet.first_token(engine, rid, max(0, len(tokens or ()) - choice.matched_tokens),
                                       time.monotonic() - sent)
                out = web.StreamResponse(status=200, headers={"Content-Type": resp.headers.get(
                    "Content-Type", "text/event-stream"), "Cache-Control": "no-cache", ENGINE_HEADER: engine.name})
                await out.prepare(request)
                return await self._relay(resp, out, first, engine, started)
        finally:
            engine.prefilling.pop(rid, None)
            engine.inflight -= 1

    async def _relay(self, resp: aiohttp.ClientResponse, out: web.StreamResponse, first: bytes, engine: Engine,
                     started: float) -> web.StreamResponse:
        """The engine's stream to the client, within what is left of ``request_timeout_s``; a client that
        stops reading or leaves ends it (the engine's request with it), a broken engine stream ends with
        an error event."""
        try:
            async with asyncio.timeout(max(0.0, started + self.config.request_timeout_s - time.monotonic())):
                await out.write(first)
                async for piece in resp.content.iter_any():
                    await out.write(piece)
                await out.write_eof()
        except ConnectionResetError:  # the client left (aiohttp's ClientConnectionResetError is one too)
            self.metrics.requests.labels(engine.name, "client_gone").inc()
            return out
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("stream from %s broke after its first token: %s", engine.name, exc)
            self.metrics.requests.labels(engine.name, "broken_stream").inc()
            event = {"error": {"message": f"the engine's stream broke: {type(exc).__name__}",
                               "type": "upstream_error", "code": 502}}
            with contextlib.suppress(ConnectionResetError, TimeoutError):
                async with asyncio.timeout(5.0):
                    await out.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                    await out.write_eof()
            return out
        self.metrics.requests.labels(engine.name, "ok").inc()
        return out

    async def _first_byte(self, stack: contextlib.AsyncExitStack, engine: Engine, path: str, body: bytes,
                          headers: dict[str, str], wait_s: float) -> tuple[aiohttp.ClientResponse, bytes, bool]:
        """The engine's response, its first bytes and whether they are all of it (a non-streaming
        answer is read whole), raced against the engine being taken out and ``wait_s``."""
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, connect=min(5.0, wait_s))

        async def first() -> tuple[aiohttp.ClientResponse, bytes, bool]:
            resp = await stack.enter_async_context(self.session.post(
                engine.url + path, data=body, headers={"Content-Type": "application/json", **engine.headers(headers)},
                timeout=timeout))
            if resp.status >= 500:
                text = (await resp.read())[:300].decode(errors="replace")
                raise UpstreamFailed("http_5xx", f"HTTP {resp.status}: {text}")
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                return resp, await resp.content.readany(), False
            return resp, await resp.read(), True

        task = asyncio.ensure_future(first())
        down = asyncio.ensure_future(engine.down.wait())
        try:
            done, _ = await asyncio.wait({task, down}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not task.done():  # given up (or this handler cancelled): the engine's request goes too
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if task in done:
            try:
                return task.result()
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                raise UpstreamFailed("connect" if isinstance(exc, aiohttp.ClientConnectorError) else "io",
                                     f"{type(exc).__name__}: {exc}") from exc
        if down in done:
            raise UpstreamFailed("engine_down", "taken out by health checks before its first byte")
        raise UpstreamFailed("first_byte_timeout", f"no answer within {wait_s:g} s")

    async def _prefill(self, path: str, payload: dict[str, Any], tokens: list[int] | None,
                       headers: dict[str, str]) -> int:
        """Disaggregated: the prompt prefilled on a prefill engine (one output token, its chunks saved to
        the mesh); the number of whole chunks the decode engine should find (0: the prefill failed,
        the decode engine computes)."""
        started = time.monotonic()
        prefill = {**payload, "max_tokens": 1, "stream": False}
        prefill.pop("stream_options", None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        score = await self.prompts.score(tokens, payload) if tokens and self.config.policy != "round_robin" else None
        choice = self.policy.choose(self.fleet.candidates("prefill", (), len(tokens or ())), tokens=len(tokens or ()),
                                    hash_key=_hash_key(tokens, payload, self.config.chunk_tokens), score=score,
                                    mean_prefill_s=self.fleet.mean_prefill_s,
                                    s_per_token=self.fleet.prefill_s_per_token)
        if choice is None:
            log.warning("disaggregated: no prefill engine; the decode engine computes the prompt")
            return 0
        engine, rid = choice.engine, next(self._ids)
        engine.prefilling[rid] = choice.expected_prefill_s
        engine.inflight += 1
        ok = False
        try:
            async with contextlib.AsyncExitStack() as stack:
                resp, _, _ = await self._first_byte(stack, engine, path, json.dumps(prefill).encode(), headers,
                                                    self.config.first_byte_timeout_s)
                ok = resp.status == 200
        except UpstreamFailed as exc:
            log.warning("disaggregated prefill on %s failed (%s): %s", engine.name, exc.reason, exc)
        finally:
            engine.prefilling.pop(rid, None)
            engine.inflight -= 1
        self.metrics.requests.labels(engine.name, "prefill_ok" if ok else "prefill_failed").inc()
        self.metrics.prefill_seconds.observe(time.monotonic() - started)
        return len(tokens) // self.config.chunk_tokens if ok and tokens else 0


def _hash_key(tokens: list[int] | None, payload: dict[str, Any], chunk: int) -> bytes:
    """What rendezvous hashing hashes: the prompt's first chunk of tokens (or of its text)."""
    if tokens:
        return b"t" + xxhash.xxh3_128_digest(json.dumps(tokens[:chunk]).encode())
    text = json.dumps(payload.get("messages") or payload.get("prompt") or "")[:4 * chunk]
    return b"s" + xxhash.xxh3_128_digest(text.encode())


def _client_headers(request: web.Request) -> dict[str, str]:
    """What of the client's request goes with the calls made for it (``Engine.headers`` filters per engine)."""
    return {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}


def _bearer_is(request: web.Request, key: str) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
