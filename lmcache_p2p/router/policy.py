"""Which engine gets a request.

    round_robin   the healthy engines in turn
    score         the engine the score API expects to answer first from its cache (``/v1/score``:
                  load time of what the mesh holds + prefill of the rest), load ignored
    score_load    expected TTFT = the engine's queue (``Engine.queue_s``) + the score's estimate;
                  the default

Ties (equal expected TTFT, e.g. an idle fleet and a prompt nobody holds) go by rendezvous hashing on
the prompt's first chunk of tokens (or of text, when the prompt could not be tokenized): a document keeps
landing on the same engine, different documents spread over all of them. An engine the score does not
list (no agent, or the score call failed) is estimated from the prompt length at the prefill rate the
router has observed.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import xxhash

from .engines import Engine

POLICIES = ("round_robin", "score", "score_load")
TIE_S = 0.005  # estimates this close are a tie: the rendezvous hash decides


@dataclasses.dataclass
class Choice:
    engine: Engine
    expected_prefill_s: float  # the request's own load + prefill on it (what it adds to the queue)
    expected_ttft_s: float  # queue + that
    matched_tokens: int  # prompt tokens the score expects from the cache there


class Policy:
    def __init__(self, name: str) -> None:
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self._turn = itertools.count()

    def choose(self, engines: list[Engine], *, tokens: int, hash_key: bytes, score: dict[str, Any] | None,
               mean_prefill_s: float, s_per_token: float) -> Choice | None:
        if not engines:
            return None
        rows = {r["node"]: r for r in (score or {}).get("nodes", []) if isinstance(r, dict) and "node" in r}

        def own(engine: Engine) -> tuple[float, int]:
            row = rows.get(engine.node) if engine.node else None
            if row is None:
                return tokens * s_per_token, 0
            compute = row.get("estimated_compute_ms")
            matched = int(row.get("matched_tokens") or 0)
            if compute is None:  # its engine never prefilled: only the load is known
                compute = 1e3 * (tokens - matched) * s_per_token
            return (float(row.get("estimated_load_ms") or 0.0) + float(compute)) / 1e3, matched

        if self.name == "round_robin":
            engine = engines[next(self._turn) % len(engines)]
            prefill, matched = own(engine)
            return Choice(engine, prefill, engine.queue_s(mean_prefill_s) + prefill, matched)
        ranked = []
        for engine in engines:
            prefill, matched = own(engine)
            queue = engine.queue_s(mean_prefill_s) if self.name == "score_load" else 0.0
            ranked.append((queue + prefill, prefill, matched, engine))
        best = min(r[0] for r in ranked)
        ties = [r for r in ranked if r[0] <= best + TIE_S]
        pick = max(ties, key=lambda r: xxhash.xxh3_64_intdigest(hash_key + r[3].url.encode()))
        total, prefill, matched, engine = pick
        if self.name == "score":
            total = engine.queue_s(mean_prefill_s) + prefill
        return Choice(engine, prefill, total, matched)
