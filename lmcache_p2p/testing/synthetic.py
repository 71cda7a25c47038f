"""Deterministic synthetic chunks for the standalone agent, the demo, benchmarks and tests.

Every process derives the same payload bytes from a chunk key, so a requester can check
byte-exactness of what it pulled without having been told the bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..keys import ChunkKey

if TYPE_CHECKING:
    from ..agent import CacheAgent


def synthetic_tokens(seed: int, num_tokens: int, vocab: int = 32000) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, num_tokens).tolist()


def synthetic_payload(key: ChunkKey, nbytes: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(nbytes)


def preload(agent: CacheAgent, seed: int, num_tokens: int) -> int:
    """Store the chunks of synthetic prompt ``seed`` (``num_tokens`` long) in ``agent``; how many were new."""
    tokens = synthetic_tokens(seed, num_tokens)
    keys, spans = agent.keys_for(tokens)
    layout = agent.config.layout
    payloads = [memoryview(synthetic_payload(k, layout.chunk_bytes(e - s)))
                for k, (s, e) in zip(keys, spans, strict=True)]
    return agent.store_chunks(keys, [e - s for s, e in spans], payloads).result(timeout=120)
