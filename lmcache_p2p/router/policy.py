"""Which engine gets a request.

    round_robin   the healthy engines in turn
    score         the engine the score API expects to answer first from its cache (``/v1/score``:
                  load time of what the mesh holds + prefill of the rest), load ignored
    score_load    the engine's queue (``Engine.queue_s``) + twice the request's own load + prefill there
                  (``WORK_WEIGHT``: its wait, and the delay it adds behind it), the prefill from the
                  score's estimate or from a prompt routed there moments ago (``Pending``); the default

A score row's reuse is the prompt less what the engine would compute there (``computed_tokens``): its
exact prefix, and what a blend takes from the request's declared segments, its documents, held or
pullable there (``segment_tokens``); rows of older agents give ``matched_tokens`` only. A RAG request
goes where most of its documents are; the row's estimates already count the blend.

Ties (equal expected TTFT, e.g. an idle fleet and a prompt nobody holds) go by rendezvous hashing on
the prompt's first chunk of tokens (or of text, when the prompt could not be tokenized): a document keeps
landing on the same engine, different documents spread over all of them. An engine the score does not
list (no agent, or the score call failed) is estimated from the prompt length at the prefill rate the
router has observed.
"""

from __future__ import annotations

import dataclasses
import itertools
from array import array
from collections import OrderedDict
from typing import Any

import xxhash

from .engines import Engine

POLICIES = ("round_robin", "score", "score_load")
TIE_S = 0.005  # estimates this close are a tie: the rendezvous hash decides
# score_load's cost counts a request's own load + prefill twice: once as its wait, once as the delay it adds
# for every request queued behind it on that engine. With a prefix held (or being computed) on a busy engine
# and an idle one without it, TTFT alone is nearly a tie; the idle engine would compute the prefix again,
# work the fleet need not do (measured with bench route: hit rate fell from 0.727 to 0.646).
WORK_WEIGHT = 2.0


@dataclasses.dataclass
class Choice:
    engine: Engine
    expected_prefill_s: float  # the request's own load + prefill on it (what it adds to the queue)
    expected_ttft_s: float  # queue + that
    matched_tokens: int  # prompt tokens the score expects from the cache there (exact prefix + segments)


class Policy:
    def __init__(self, name: str) -> None:
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self._turns: dict[frozenset[str], itertools.count[int]] = {}

    def choose(self, engines: list[Engine], *, tokens: int, hash_key: bytes, score: dict[str, Any] | None,
               mean_prefill_s: float, s_per_token: float, pending: dict[str, int] | None = None) -> Choice | None:
        """``pending``: engine URL -> leading prompt tokens a request routed there moments ago is computing
        (``Pending``): the index can't show them yet, but that engine will hold them."""
        if not engines:
            return None
        rows = {r["node"]: r for r in (score or {}).get("nodes", []) if isinstance(r, dict) and "node" in r}
        pending = pending or {}

        def own(engine: Engine) -> tuple[float, int]:
            row = rows.get(engine.node) if engine.node else None
            soon = pending.get(engine.url, 0)
            if row is None:
                return (tokens - soon) * s_per_token, soon
            compute = row.get("estimated_compute_ms")
            load = float(row.get("estimated_load_ms") or 0.0)
            matched = int(row.get("matched_tokens") or 0)
            if isinstance(row.get("computed_tokens"), int):  # a blend over the request's documents counted
                matched = tokens - int(row["computed_tokens"])
            if soon > matched:  # computed there already (or being computed): a local hit when its turn comes
                return (tokens - soon) * s_per_token, soon
            if compute is None:  # its engine never prefilled: only the load is known
                compute = 1e3 * (tokens - matched) * s_per_token
            return (load + float(compute)) / 1e3, matched

        if self.name == "round_robin":  # in turn within each pool (the candidates' pools)
            turn = self._turns.setdefault(frozenset(e.pool for e in engines), itertools.count())
            engine = engines[next(turn) % len(engines)]
            prefill, matched = own(engine)
            return Choice(engine, prefill, engine.queue_s(mean_prefill_s) + prefill, matched)
        ranked = []
        for engine in engines:
            prefill, matched = own(engine)
            if self.name == "score_load":  # the request's wait and the work it leaves the requests after it
                cost = engine.queue_s(mean_prefill_s) + WORK_WEIGHT * prefill
            else:
                cost = prefill
            ranked.append((cost, prefill, matched, engine))
        best = min(r[0] for r in ranked)
        ties = [r for r in ranked if r[0] <= best + TIE_S]
        _, prefill, matched, engine = max(ties, key=lambda r: xxhash.xxh3_64_intdigest(hash_key + r[3].url.encode()))
        return Choice(engine, prefill, engine.queue_s(mean_prefill_s) + prefill, matched)


class Pending:
    """Prompts routed moments ago, by chunk-aligned prefix: which engine is computing (or just computed)
    them. The score only knows what the index shows, and a prompt's chunks reach the index after its
    prefill: without this, a second request for a document still being prefilled looks like a miss
    everywhere and, if the first engine is busy (with that very prefill), goes elsewhere to compute it
    again. Entries expire after ``ttl_s`` (by then the index knows); at most ``capacity`` prefixes."""

    def __init__(self, chunk: int, ttl_s: float = 10.0, capacity: int = 100_000) -> None:
        self.chunk = chunk
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._by_prefix: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def prefixes(self, tokens: list[int]) -> list[bytes]:
        """A chained digest per whole chunk: entry k names tokens[: (k + 1) * chunk]."""
        out, h = [], b""
        for k in range(len(tokens) // self.chunk):
            h = xxhash.xxh3_128_digest(h + array("i", tokens[k * self.chunk:(k + 1) * self.chunk]).tobytes())
            out.append(h)
        return out

    def lookup(self, prefixes: list[bytes], now: float) -> dict[str, int]:
        """Engine URL -> leading tokens of this prompt routed there within ``ttl_s``."""
        out: dict[str, int] = {}
        for k, h in enumerate(prefixes):
            hit = self._by_prefix.get(h)
            if hit is None or hit[1] < now:
                break
            out[hit[0]] = (k + 1) * self.chunk
        return out

    def add(self, prefixes: list[bytes], url: str, now: float) -> None:
        for h in prefixes:
            self._by_prefix[h] = (url, now + self.ttl_s)
            self._by_prefix.move_to_end(h)
        while len(self._by_prefix) > self.capacity:
            self._by_prefix.popitem(last=False)
