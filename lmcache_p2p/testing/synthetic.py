"""Deterministic synthetic chunks for the standalone agent, the demo, benchmarks and tests.

Every process derives the same payload bytes from a chunk key, so a requester can check
byte-exactness of what it pulled without having been told the bytes.
"""

from __future__ import annotations

import numpy as np

from ..keys import ChunkKey


def synthetic_tokens(seed: int, num_tokens: int, vocab: int = 32000) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, num_tokens).tolist()


def synthetic_payload(key: ChunkKey, nbytes: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(nbytes)
