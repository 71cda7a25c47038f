"""vLLM's request as the connector's scheduler side reads it, without vLLM: for tests that drive
``P2PScheduler`` by hand (the attributes it reads of ``vllm.v1.request.Request``, nothing more)."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any


def fake_request(req_id: str, prompt: Sequence[int], kv_transfer_params: dict[str, Any] | None = None,
                 **fields: Any) -> types.SimpleNamespace:
    """A request of ``prompt`` that has computed nothing yet: no adapter, salt, multimodal items or prompt
    embeddings, no block hashes; ``fields`` set or override any attribute (``lora_request``, ``cache_salt``,
    ``block_hashes``, ``num_computed_tokens`` ...)."""
    base: dict[str, Any] = {
        "request_id": req_id, "prompt_token_ids": list(prompt), "kv_transfer_params": kv_transfer_params,
        "lora_request": None, "mm_features": None, "cache_salt": None, "prompt_embeds": None, "block_hashes": [],
        "all_token_ids": list(prompt), "num_computed_tokens": 0}
    base.update(fields)
    return types.SimpleNamespace(**base)


def fake_blocks(block_ids: Sequence[int]) -> types.SimpleNamespace:
    """vLLM's ``KVCacheBlocks`` of one KV cache group, as ``update_state_after_alloc`` reads it."""
    ids = list(block_ids)
    return types.SimpleNamespace(get_block_ids=lambda: (ids,))
