"""What the router learns of a request before it routes it, from the engines and their agents.

    tokens     the prompt's token ids as an engine will see them: the least busy engine's ``/tokenize``
               (with the chat template for chat)
    documents  a chat request carrying documents as data (``lmcache_p2p/rag.py``): rewritten, each document
               a message of its own, and its documents' spans found with that engine's ``/tokenize``:
                   T(messages, as the request asks)                        1 call
                   T(context), T(context + each unit), [T(first doc)]      at most 2 x documents + 1 calls
               (past ``rag.STAND_IN_OVER`` characters of context, each unit after a one-message stand-in:
               the long context is sent twice, not once per document)
               made concurrently (at most ``PARALLEL_CALLS`` at a time), all within ``documents_timeout_s``
    score      one agent's ``/v1/score`` of every engine, a request's declared segments included (and whether
               it asks to be blended, when its ``kv_transfer_params`` say)

Every ``/tokenize`` call carries what shapes the engine's rendering (:func:`chat_ask`), so the tokens are
those the engine makes of the forwarded request and the spans refer to its prompt, and the client's headers
as that engine may see them (``Engine.headers``: its API key). Every call is bounded; one that fails or runs
out of time is counted, and the request is routed (or forwarded) without it. A completion's prompt given as
token ids is checked first: each an integer in [0, 2^31) (:class:`BadPrompt` names the first that is not).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from prometheus_client import Counter

from ..rag import DOCUMENTS_FIELD, NotSegmentable, SpanPlan
from ..request_params import SEGMENTS_PARAM, RequestParams
from .engines import Engine

log = logging.getLogger(__name__)

# The chat request's fields that /tokenize takes and that shape the prompt (and the model it is for)
TOKENIZE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                   "add_special_tokens", "tools", "model")
PARALLEL_CALLS = 8  # per request: 64 documents must not open 129 connections to one engine at once
MAX_TOKEN_ID = 1 << 31  # token ids are int32 everywhere downstream (vLLM, the chunk keys)


class BadPrompt(ValueError):
    """A request's prompt the router refuses (a 400): the message names the offending element."""

Tokenize = Callable[[dict[str, Any]], Awaitable[list[int] | None]]
"""An engine's ``/tokenize``: the request body -> token ids (None: the call failed)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    tokens: list[int] | None  # the full prompt's (None: unknown)
    spans: list[tuple[int, int]] | None  # the documents' (None: not declared)
    outcome: str  # "segments", or why there are none (a metric label)


class Prompts:
    def __init__(self, session: aiohttp.ClientSession, engines: Callable[[], list[Engine]], *,
                 route_timeout_s: float, documents_timeout_s: float, failures: Counter, outcomes: Counter,
                 score_key: str | None = None) -> None:
        """``engines``: the healthy engines, the least busy first; ``failures`` counts tokenize and score calls
        that failed (by call), ``outcomes`` requests carrying documents (by outcome); ``score_key``: the
        agents' ``score_api_key``, sent to ``/v1/score`` as a bearer token."""
        self.session = session
        self._score_headers = {"Authorization": f"Bearer {score_key}"} if score_key else {}
        self.engines = engines
        self.route_timeout_s = route_timeout_s
        self.documents_timeout_s = documents_timeout_s
        self.failures = failures
        self.outcomes = outcomes

    async def tokens(self, payload: dict[str, Any], chat: bool, headers: Mapping[str, str]) -> list[int] | None:
        """The prompt's token ids as an engine will see them; None when unknown (routed without a score).
        Raises BadPrompt for token ids out of range."""
        ask = chat_ask(payload) if chat else _prompt_ask(payload)
        if ask is None or isinstance(ask, list):
            return ask
        for engine in self.engines()[:1]:
            tokens = await self._tokenize(engine, ask, headers, timeout=self._short())
            if tokens is not None:
                return tokens
        self.failures.labels("tokenize").inc()
        return None

    async def documents(self, payload: dict[str, Any], plan: SpanPlan,
                        headers: Mapping[str, str]) -> tuple[dict[str, Any], list[int] | None]:
        """A request carrying documents as data, as it is forwarded (its documents messages of their own, their
        spans in ``kv_transfer_params`` where the engine's template places them), and its prompt's tokens."""
        payload = {k: v for k, v in payload.items() if k != DOCUMENTS_FIELD}
        payload["messages"] = plan.messages
        timeout = aiohttp.ClientTimeout(total=self.documents_timeout_s)
        placed, outcome = None, "tokenize_failed"
        for engine in self.engines()[:1]:  # one engine's template for every call
            try:
                async with asyncio.timeout(self.documents_timeout_s):
                    placed = await place(plan, chat_ask(payload) or {},
                                         functools.partial(self._tokenize, engine, headers=headers, timeout=timeout))
                outcome = placed.outcome
            except TimeoutError:
                outcome = "timeout"
        self.outcomes.labels(outcome).inc()
        if placed is not None and placed.spans:
            params = payload.get("kv_transfer_params")
            params = dict(params) if isinstance(params, dict) else {}
            params[SEGMENTS_PARAM] = [list(span) for span in placed.spans]
            payload["kv_transfer_params"] = params
        return payload, placed.tokens if placed is not None else None

    async def score(self, tokens: list[int], payload: dict[str, Any]) -> dict[str, Any] | None:
        # One agent's mirror scores every engine: ask the least busy one's, never spend the budget on a second.
        url = next((e.score_url for e in self.engines() if e.score_url), None)
        if url is None:
            return None
        ask: dict[str, Any] = {"tokens": tokens}
        # declared segments (documents): the score counts what each engine holds of them too (malformed: the
        # engine ignores them as well), and whether it blends, as its engine's scheduler side reads them
        params = RequestParams.parse(payload.get("kv_transfer_params"), len(tokens))
        if params.segments:
            ask["segments"] = [list(span) for span in params.segments]
            blend = params.wants_blend(False) if params.says_blend else None  # None: the engines' default
            if blend is not None:
                ask["blend"] = blend
        try:
            async with self.session.post(url, json=ask, timeout=self._short(), headers=self._score_headers) as resp:
                data = await resp.json() if resp.status == 200 else None
            if isinstance(data, dict):
                return data
        except (TimeoutError, aiohttp.ClientError, ValueError):
            pass
        self.failures.labels("score").inc()
        return None

    async def _tokenize(self, engine: Engine, ask: dict[str, Any], headers: Mapping[str, str], *,
                        timeout: aiohttp.ClientTimeout) -> list[int] | None:
        try:
            async with self.session.post(engine.url + "/tokenize", json=ask, headers=engine.headers(headers),
                                         timeout=timeout) as resp:
                data = await resp.json() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        return tokens if isinstance(tokens, list) and all(_token_id(t) for t in tokens) else None

    def _short(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.route_timeout_s)


def chat_ask(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` body for a chat request's prompt (None: its messages are not a list)."""
    if not isinstance(payload.get("messages"), list):
        return None
    ask = {k: payload[k] for k in ("messages", *TOKENIZE_FIELDS) if k in payload}
    effort = payload.get("reasoning_effort")
    if isinstance(effort, str):  # what vLLM's chat request adds to the template's kwargs (build_chat_params)
        kwargs = ask.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        if effort != "auto":
            kwargs["reasoning_effort"] = effort
        ask["chat_template_kwargs"] = kwargs
    return ask


def _token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value < MAX_TOKEN_ID


def check_token_ids(prompt: Any) -> None:
    """A completion's prompt given as token ids (a list, or a batch of lists, not all strings): every id an
    integer in [0, 2^31); BadPrompt names the first that is not."""
    if not isinstance(prompt, list) or all(isinstance(p, str) for p in prompt):
        return
    batch = prompt if prompt and all(isinstance(p, list) for p in prompt) else [prompt]
    for k, ids in enumerate(batch):
        where = f"prompt[{k}]" if batch is prompt else "prompt"
        for i, t in enumerate(ids):
            if type(t) is not int:
                raise BadPrompt(f"{where}[{i}]: token ids must be integers, got {type(t).__name__}")
            if not 0 <= t < MAX_TOKEN_ID:
                raise BadPrompt(f"{where}[{i}]: token id {t} out of range [0, 2^31)")


def _prompt_ask(payload: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """The ``/tokenize`` body for a completion's prompt; its token ids when it is ids; None: no prompt.
    Raises BadPrompt for token ids out of range."""
    prompt = payload.get("prompt")
    check_token_ids(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    return {"prompt": prompt, **{k: payload[k] for k in ("add_special_tokens", "model") if k in payload}}


async def place(plan: SpanPlan, ask: dict[str, Any], tokenize: Tokenize) -> Placed:
    """The prompt's tokens and its documents' spans, from one engine's ``/tokenize`` (``tokenize``)."""
    gate = asyncio.Semaphore(PARALLEL_CALLS)

    async def call(messages: list[dict[str, Any]], whole: bool) -> list[int] | None:
        body = {**ask, "messages": messages}
        if not whole:
            body.update(add_generation_prompt=False, continue_final_message=False)
        async with gate:
            return await tokenize(body)

    full, *parts = await asyncio.gather(call(plan.messages, True), *(call(c, False) for c in plan.calls()))
    if full is None or any(p is None for p in parts):
        return Placed(full, None, "tokenize_failed")
    try:
        return Placed(full, plan.spans([p for p in parts if p is not None], full), "segments")
    except NotSegmentable as exc:
        log.info("documents not declared as segments (%s): %s; prefix reuse only", exc.reason, exc)
        return Placed(full, None, exc.reason)
