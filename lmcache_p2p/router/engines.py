"""The engines a router sends requests to, how healthy and how busy each one is.

An :class:`Engine` is one vLLM OpenAI server: its base URL, the node id of its agent (the score API
names engines by it), and its pool (``mixed``, or ``prefill`` / ``decode`` for disaggregated serving).
Engines come from a static list (the operator's: trusted as given) or from the node records in etcd
(``engine_url`` / ``engine_pool``, published by each agent), where only a record whose ``engine_proof``
holds (``proof.py``: signed by the node's own certificate under the transfer CA when the router has it,
else keyed under the router key) is used: any other is never contacted at all (no health check, prompt or
header), counted by reason and logged once per record as it stands. With neither, every announced engine
is refused. The client's ``Authorization`` goes to an engine only where
``forward_authorization`` allows (``all-trusted``: static and proven engines; ``static``; ``none``).
:class:`Fleet` keeps them fresh in the background: every ``interval_s`` it re-reads the records, asks each
engine's ``/health`` and reads its ``/metrics`` (running and waiting requests, KV-cache usage), each call
bounded by ``timeout_s``. ``fails_down`` failed checks in a row
take an engine out (requests waiting on it before their first byte are retried elsewhere); one good
check brings it back.

Load as the router sees it is what it sent: each request in flight on an engine carries the seconds
its prefill is expected to take (from the score, else from the prompt length at the prefill rate the
router observed) until its first token; their sum is the engine's queue. Requests that came from
elsewhere show up in vLLM's waiting count and are charged at the engine's mean prefill time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from .proof import SIGNED_PREFIX, plain_url, proof_holds, signed_proof_refusal

log = logging.getLogger(__name__)

POOLS = ("mixed", "prefill", "decode")
DEFAULT_PREFILL_S_PER_TOKEN = 2e-4  # until the router has seen a first token (CPU engines run ~0.1-1 ms)
KV_FULL = 0.95  # KV usage above which an engine's next request is likely to wait for or cause a preemption
MAX_METRICS_BYTES = 4 << 20
MODELS_EVERY_S = 60.0  # an engine's /v1/models is asked again this long after it did not say its max_model_len
OWN_CALL = {"X-LMCache-P2P-Router": "health"}  # on the calls the router makes of its own (for no client's request)
FORWARD_AUTHORIZATION = ("all-trusted", "static", "none")


@dataclasses.dataclass
class Engine:
    url: str  # base URL, no trailing slash
    node: str | None = None  # its agent's node id (score rows name engines by it)
    pool: str = "mixed"
    score_url: str | None = None  # its agent's /v1/score (from the node record's metrics URL)
    static: bool = False  # given by the operator (else: announced in a proven node record)
    gets_authorization: bool = True  # the client's Authorization header may be sent to it
    healthy: bool = False
    checked: bool = False  # at least one health check answered (or failed)
    fails: int = 0  # failed health checks in a row
    running: float = 0.0  # vLLM's gauges, last read
    waiting: float = 0.0
    kv_usage: float = 0.0
    max_model_len: int | None = None  # from its /v1/models (None: not known yet, or it does not say)
    models_asked_at: float = -math.inf  # when its /v1/models was last asked (time.monotonic())
    prefilling: dict[int, float] = dataclasses.field(default_factory=dict)  # request -> expected prefill s
    inflight: int = 0  # requests sent and not finished
    down: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set while taken out

    @property
    def name(self) -> str:
        return self.node or self.url

    def headers(self, client: Mapping[str, str]) -> dict[str, str]:
        """The client's headers as this engine may see them."""
        return {k: v for k, v in client.items() if self.gets_authorization or k.lower() != "authorization"}

    def queue_s(self, mean_prefill_s: float) -> float:
        """Seconds a request sent now waits before its own prefill starts (see the module docstring)."""
        outside = max(0.0, self.waiting - len(self.prefilling))
        penalty = mean_prefill_s if self.kv_usage >= KV_FULL else 0.0
        return sum(self.prefilling.values()) + outside * mean_prefill_s + penalty


@dataclasses.dataclass(frozen=True)
class FleetSource:
    """Where engines come from: static URLs per pool, and/or a function returning node records (used
    only where their proof holds for ``cluster``: signed by a certificate of ``transfer_ca`` naming the node
    when that is given, else keyed under ``router_key``)."""

    static: tuple[tuple[str, str, str | None], ...] = ()  # (url, pool, node id)
    records: Callable[[], Iterable[Any]] | None = None  # -> NodeRecords (an etcd mirror's nodes)
    score_url: str | None = None  # static: the agent asked for scores
    router_key: bytes | None = dataclasses.field(default=None, repr=False)
    transfer_ca: tuple[Any, ...] = ()  # CA certificates: then only proofs signed by a node's certificate hold
    cluster: str = "default"
    forward_authorization: str = "all-trusted"  # which engines get the client's Authorization

    def __post_init__(self) -> None:
        if self.forward_authorization not in FORWARD_AUTHORIZATION:
            raise ValueError(f"forward_authorization must be one of {FORWARD_AUTHORIZATION}, "
                             f"got {self.forward_authorization!r}")


class Fleet:
    """The engines, refreshed in the background (``start``/``stop``); see the module docstring."""

    def __init__(self, source: FleetSource, session: aiohttp.ClientSession, *, interval_s: float = 1.0,
                 timeout_s: float = 1.0, fails_down: int = 2, refused: Counter | None = None) -> None:
        """``refused``: counts announced engines refused, by reason (each record as it stands, once)."""
        self.source = source
        self.session = session
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.fails_down = fails_down
        self.engines: dict[str, Engine] = {}
        self.prefill_s_per_token = DEFAULT_PREFILL_S_PER_TOKEN  # learned from first tokens (EWMA)
        self.mean_prefill_s = 0.1
        self._task: asyncio.Task[None] | None = None
        self.on_change: Callable[[], None] = lambda: None
        self._refused_counter = refused
        self._refused: dict[str, tuple[Any, ...]] = {}  # node id -> the refused record's values, last seen
        self._discover()

    def _discover(self) -> None:
        found: dict[str, tuple[str, str | None, str | None, bool]] = {}
        for url, pool, node in self.source.static:
            found[url.rstrip("/")] = (pool, node, self.source.score_url, True)
        if self.source.records is not None:
            try:
                records = list(self.source.records())
            except Exception as exc:  # a bug there must not stop routing: keep the engines known so far
                log.warning("reading node records failed (engines kept as they were): %s", exc)
                return
            refused: dict[str, tuple[Any, ...]] = {}
            for record in records:
                if record.role != "engine" or not record.engine_url:
                    continue
                reason = self._refusal(record)
                if reason is not None:
                    refused[record.node_id] = self._refuse(record, reason)
                    continue
                url = record.engine_url.rstrip("/")
                if url in found and found[url][3]:
                    continue  # the operator's own entry for it stands
                found[url] = (record.engine_pool, record.node_id, _score_url(record), False)
            self._refused = refused
        for url in list(self.engines):
            if url not in found:
                log.info("engine %s left (its node record is gone)", self.engines[url].name)
                self.engines.pop(url).down.set()
        policy = self.source.forward_authorization
        for url, (pool, node, score, static) in found.items():
            engine = self.engines.get(url)
            if engine is None:
                self.engines[url] = engine = Engine(url, node, pool, score)
                engine.down.set()  # until its first health check
                log.info("engine %s at %s (pool %s, %s)", engine.name, url, pool, "static" if static else "proven")
            engine.node, engine.pool, engine.score_url, engine.static = node, pool, score, static
            engine.gets_authorization = policy == "all-trusted" or (policy == "static" and static)

    def _refusal(self, record: Any) -> str | None:
        """Why an announced engine may not be used (None: its proof holds)."""
        key, cas = self.source.router_key, self.source.transfer_ca
        if key is None and not cas:
            return "no_router_key"
        if not plain_url(record.engine_url):
            return "bad_url"
        if cas:
            return signed_proof_refusal(cas, record.engine_proof, cluster=self.source.cluster,
                                        node_id=record.node_id, engine_url=record.engine_url,
                                        engine_pool=record.engine_pool, metrics_url=record.metrics_url)
        if record.engine_proof is None:
            return "no_proof"
        if key is None or record.engine_proof.startswith(SIGNED_PREFIX):
            return "no_transfer_ca"
        if not proof_holds(key, record.engine_proof, cluster=self.source.cluster, node_id=record.node_id,
                           engine_url=record.engine_url, engine_pool=record.engine_pool,
                           metrics_url=record.metrics_url):
            return "bad_proof"
        return None

    def _refuse(self, record: Any, reason: str) -> tuple[Any, ...]:
        """Count and log a refused record once as it stands (again only when it changes)."""
        seen = (reason, record.engine_url, record.engine_pool, record.metrics_url, record.engine_proof)
        if self._refused.get(record.node_id) != seen:
            if self._refused_counter is not None:
                self._refused_counter.labels(reason).inc()
            why = {"no_router_key": "the router has neither the transfer CA (--transfer-ca) nor a router key "
                                    "(--router-key-file): announced engines are ignored",
                   "bad_url": "its engine URL is not a plain http(s) URL",
                   "no_proof": "its record carries no engine_proof",
                   "bad_proof": "its engine_proof does not hold (forged or edited record, or another cluster "
                                "secret or CA)",
                   "keyed_proof": "its engine_proof is keyed by the cluster secret, which every agent holds: "
                                  "with --transfer-ca only proofs signed by the node's own certificate count",
                   "no_transfer_ca": "its engine_proof is signed by a node certificate: give the router the "
                                     "transfer CA (--transfer-ca) to check it",
                   "untrusted_cert": "its engine_proof's certificate was not issued by the transfer CA",
                   "expired_cert": "its engine_proof's certificate is not valid now",
                   "other_node": "its engine_proof's certificate names another node"}[reason]
            log.warning("engine at %.200r announced by node record %r ignored: %s", record.engine_url,
                        record.node_id, why)
        return seen

    def candidates(self, pool: str, exclude: Iterable[str] = (), tokens: int = 0) -> list[Engine]:
        """Healthy engines able to serve ``pool`` (mixed engines serve every pool) and a prompt of ``tokens``
        (shorter than their ``max_model_len``, where known)."""
        skip = set(exclude)
        return [e for e in self.engines.values()
                if e.healthy and e.url not in skip and (e.pool == pool or e.pool == "mixed")
                and (e.max_model_len is None or tokens < e.max_model_len)]

    def too_long(self, pool: str, tokens: int) -> int | None:
        """The longest context any healthy engine of ``pool`` takes, when every one of them says and a prompt
        of ``tokens`` fits none (vLLM refuses a prompt of ``max_model_len`` tokens or more); else None."""
        healthy = self.candidates(pool, tokens=0)
        lengths = [e.max_model_len for e in healthy]
        if not healthy or any(n is None for n in lengths):
            return None
        longest = max(n for n in lengths if n is not None)
        return longest if tokens >= longest else None

    @property
    def refused(self) -> dict[str, str]:
        """Node id -> why its announced engine is not used (as of the last discovery)."""
        return {node: seen[0] for node, seen in self._refused.items()}

    def by_node(self) -> dict[str, Engine]:
        return {e.node: e for e in self.engines.values() if e.node}

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="router-fleet")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # one bad round must not end health checking
                log.exception("engine health round failed")

    async def refresh(self) -> None:
        self._discover()
        await asyncio.gather(*(self._check(e) for e in list(self.engines.values())))
        self.on_change()

    async def _check(self, engine: Engine) -> None:
        try:
            async with self.session.get(engine.url + "/health", timeout=self._timeout(), headers=OWN_CALL) as resp:
                ok = resp.status == 200
                await resp.read()
            if ok:
                await self._read_load(engine)
                if engine.max_model_len is None and time.monotonic() - engine.models_asked_at >= MODELS_EVERY_S:
                    await self._read_max_model_len(engine)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            ok = False
        engine.checked = True
        if ok:
            if not engine.healthy:
                log.info("engine %s is up", engine.name)
            engine.healthy, engine.fails = True, 0
            engine.down.clear()
            return
        engine.fails += 1
        if engine.healthy and engine.fails >= self.fails_down:
            log.warning("engine %s: %d health checks failed; taken out", engine.name, engine.fails)
            engine.healthy = False
        if not engine.healthy:
            engine.down.set()

    async def _read_load(self, engine: Engine) -> None:
        """vLLM's running/waiting gauges and KV usage; a scrape that fails leaves the last values."""
        try:
            async with self.session.get(engine.url + "/metrics", timeout=self._timeout(), headers=OWN_CALL) as resp:
                if resp.status != 200:
                    return
                body = bytearray()
                async for piece in resp.content.iter_chunked(1 << 16):
                    body += piece
                    if len(body) > MAX_METRICS_BYTES:
                        return
            text = body.decode(errors="replace")
        except (TimeoutError, aiohttp.ClientError):
            return
        wanted = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                  "vllm:kv_cache_usage_perc": "kv_usage"}
        values: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(text):
                attr = wanted.get(family.name)
                if attr is not None:
                    values[attr] = sum(s.value for s in family.samples)
        except ValueError:
            return
        for attr, value in values.items():
            setattr(engine, attr, value)

    async def _read_max_model_len(self, engine: Engine) -> None:
        """The longest context its models take (vLLM's ``/v1/models``: ``max_model_len`` of each model, its
        adapters included); left unknown where the page is refused (an engine with an API key) or says nothing,
        and asked again ``MODELS_EVERY_S`` later. Marked as the router's own call (``OWN_CALL``): no client's."""
        engine.models_asked_at = time.monotonic()
        try:
            async with self.session.get(engine.url + "/v1/models", timeout=self._timeout(), headers=OWN_CALL) as resp:
                data = await resp.json() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return
        models = data.get("data") if isinstance(data, dict) else None
        lengths = [m.get("max_model_len") for m in models if isinstance(m, dict)] if isinstance(models, list) else []
        known = [n for n in lengths if type(n) is int and n > 0]
        if known:
            engine.max_model_len = max(known)

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.timeout_s)

    def first_token(self, engine: Engine, request: int, uncached_tokens: int, seconds: float) -> None:
        """``request`` got its first token after ``seconds``: no longer in ``engine``'s queue; an
        engine that had nothing else queued teaches the prefill rate."""
        expected = engine.prefilling.pop(request, None)
        if expected is None:
            return
        self.mean_prefill_s = 0.8 * self.mean_prefill_s + 0.2 * seconds
        if not engine.prefilling and uncached_tokens >= 64:
            self.prefill_s_per_token = 0.8 * self.prefill_s_per_token + 0.2 * seconds / uncached_tokens

    def healthy_counts(self) -> dict[str, int]:
        out = {"healthy": 0, "unhealthy": 0}
        for e in self.engines.values():
            out["healthy" if e.healthy else "unhealthy"] += 1
        return out

    def describe(self) -> list[dict[str, Any]]:
        return [{"url": e.url, "node": e.node, "pool": e.pool, "static": e.static, "healthy": e.healthy,
                 "running": e.running, "max_model_len": e.max_model_len,
                 "waiting": e.waiting, "kv_usage": round(e.kv_usage, 4), "inflight": e.inflight,
                 "queue_s": round(e.queue_s(self.mean_prefill_s), 4)} for e in self.engines.values()]


def _score_url(record: Any) -> str | None:
    """A proven record's agent's /v1/score (None: its metrics URL is not a plain http(s) URL)."""
    url = record.metrics_url
    if not plain_url(url) or not url.endswith("/metrics"):
        return None
    return url[: -len("/metrics")] + "/v1/score"
