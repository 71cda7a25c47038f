"""The router's settings (``lmcache-p2p router`` flags), each checked, and the limits on what a client's request
may cost it (``app.py`` says how each is enforced)."""

from __future__ import annotations

import dataclasses

MAX_BODY_BYTES = 8 << 20
# What a routed request's body may cost the router while it is handled, per byte: the body, its parsed JSON
# (a token id list: a Python int and a list slot per ~6 bytes of text), the body re-encoded for the engine
# and the tokens for the score. Measured: 62-67 MiB of resident memory per 8 MiB body of token ids (8x); 10x
# leaves the allocator a fifth more.
MEMORY_PER_BODY_BYTE = 10
MAX_MEMORY_BYTES = 1 << 30
CHUNK_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    policy: str = "score_load"
    disaggregated: bool = False
    attempts: int = 3  # engines tried per request before the client gets an error
    first_byte_timeout_s: float = 60.0  # an engine silent this long (before its first byte) is given up
    request_timeout_s: float = 600.0  # a whole answer
    route_timeout_s: float = 0.5  # tokenize + score, each
    documents_timeout_s: float = 2.0  # placing a request's documents: its /tokenize calls together
    chunk_tokens: int = CHUNK_TOKENS
    max_body_bytes: int = MAX_BODY_BYTES  # a request body
    read_timeout_s: float = 30.0  # a request's headers (and an idle connection), and its body, each
    max_concurrent: int = 512  # requests in flight (routed and proxied); past it: 503
    max_memory_bytes: int = MAX_MEMORY_BYTES  # bodies in flight, at MEMORY_PER_BODY_BYTE each; past it: 503
    api_key: str | None = dataclasses.field(default=None, repr=False)  # clients must present it
    score_key: str | None = dataclasses.field(default=None, repr=False)  # the agents' score_api_key

    def __post_init__(self) -> None:
        for name in ("first_byte_timeout_s", "request_timeout_s", "route_timeout_s", "documents_timeout_s",
                     "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("attempts", "max_body_bytes", "max_concurrent"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_memory_bytes < MEMORY_PER_BODY_BYTE * self.max_body_bytes:
            raise ValueError(f"max_memory_bytes must hold one largest body: at least {MEMORY_PER_BODY_BYTE} x "
                             f"max_body_bytes ({MEMORY_PER_BODY_BYTE * self.max_body_bytes} bytes)")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
