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


def empty_step() -> Any:
    """vLLM's own ``SchedulerOutput`` of a step that scheduled nothing (imports vLLM: for the processes that
    drive ``P2PScheduler``, not the test runner)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def prefill_step(*requests: tuple[Any, Sequence[int], int]) -> Any:
    """vLLM's own ``SchedulerOutput`` of a step that schedules each ``(request, block_ids, tokens)`` for the
    first time (a new request, from its first token): what ``build_connector_meta`` reads of it."""
    from vllm.v1.core.sched.output import NewRequestData

    out = empty_step()
    for request, block_ids, tokens in requests:
        out.scheduled_new_reqs.append(NewRequestData(
            req_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids), mm_features=[],
            sampling_params=None, pooling_params=None, block_ids=(list(block_ids),), num_computed_tokens=0,
            lora_request=None))
        out.num_scheduled_tokens[request.request_id] = tokens
        out.total_num_scheduled_tokens += tokens
    return out


class StepClock:
    """A clock that moves only when told (``P2PScheduler(clock=...)``): waits the scheduler side measures
    (a reset's weight check, a request held for the mirror) pass without sleeping."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
