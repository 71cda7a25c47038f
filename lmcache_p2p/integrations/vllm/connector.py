"""``LMCacheP2PConnector``: vLLM's V1 KV connector for the lmcache-p2p mesh.

A thin class that delegates by role: the scheduler side (:mod:`.scheduler`, in the EngineCore
process) decides hits from the index mirror; the worker side (:mod:`.worker`, one per GPU / TP
rank) owns the embedded cache agent and moves bytes. They talk only through
:class:`~.metadata.LMCacheP2PMetadata`.

vLLM fails a request whose connector reports a chunk it could not load unless
``kv_load_failure_policy`` is ``"recompute"``, and its default is ``"fail"``. A cache problem must
never become a serving problem, so the scheduler side sets ``"recompute"`` (and says so once at
start); ``kv_connector_extra_config: {"keep_fail_policy": true}`` keeps ``"fail"``, with a warning
of what it means.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...config import rank_config
from ...coordinator.apply import set_log_level
from ...keys import head_range
from .blend import blend_refusal
from .layout import connector_config, engine_fingerprint
from .metadata import LMCacheP2PMetadata, WorkerCapability, WorkerState
from .scheduler import P2PScheduler
from .support import kv_cache_refusal
from .worker import P2PWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


class LMCacheP2PConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = connector_config(vllm_config, kv_cache_config)
        # INFO unless set (LMCACHE_P2P_LOG_LEVEL=DEBUG: per-request timings), with a handler of our own
        # where vLLM's process has none for us: what the planner declined and why shows in vLLM's output.
        set_log_level(config.log_level or "INFO")
        block_size = vllm_config.cache_config.block_size
        if config.chunk_size % block_size:
            raise ValueError(f"chunk_size ({config.chunk_size}) must be a multiple of the engine block size "
                             f"({block_size})")
        tp_size = max(vllm_config.parallel_config.tensor_parallel_size, 1)
        rank = vllm_config.parallel_config.rank % tp_size if role == KVConnectorRole.WORKER else 0
        fingerprint = engine_fingerprint(vllm_config, config, tp_rank=rank)
        heads = head_range(config.layout.num_kv_heads, tp_size, rank)  # this rank's KV heads
        if role == KVConnectorRole.WORKER:
            config = rank_config(config, rank, tp_size)  # one agent per rank: own node id, disk dir, ports
        self._scheduler: P2PScheduler | None = None
        self._worker: P2PWorker | None = None
        refusal = kv_cache_refusal(kv_cache_config, config.layout.num_layers)
        if refusal is not None:  # neither loads nor saves for this engine: vLLM runs as if without us
            log.warning("lmcache-p2p: this engine's KV cache is not supported, nothing is loaded or saved: %s",
                        refusal)
        elif role == KVConnectorRole.SCHEDULER:
            recompute_on_load_failure(vllm_config)
            self._scheduler = P2PScheduler(config, fingerprint, block_size, blend_refusal=blend_refusal(vllm_config),
                                           token_budget=vllm_config.scheduler_config.max_num_batched_tokens)
        else:
            self._worker = P2PWorker(config, fingerprint, block_size, heads)

    # -- scheduler side ------------------------------------------------------------------------------
    # (each side is None where this engine's KV cache is refused, support.py: no hit, no load, no save)
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The external hit split by where it was held: this node's CPU pool (``host``) or disk (``disk``), or
        peers and the object store (``p2p``): vLLM's ``prompt_tokens_by_source``."""
        if self._scheduler is None or num_external_tokens <= 0:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {CacheHitSource(source): n for source, n in
                self._scheduler.hit_sources(request, num_external_tokens).items()}

    def reset_cache(self) -> bool | None:
        """vLLM reset its caches (``reset_prefix_cache``): this node's chunks are dropped at the next step."""
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._scheduler is None:
            return LMCacheP2PMetadata(num_scheduled_tokens=int(scheduler_output.total_num_scheduled_tokens))
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids), None  # True: its tail is saved, then freed

    # -- worker side ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> WorkerCapability | None:
        """Once, after ``register_kv_caches``: whether this worker can blend (vLLM hands it to the scheduler)."""
        if self._worker is None:
            return None
        return WorkerCapability(blend_refusal=self._worker.blend_refusal)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Scheduler side, before the first step: every worker's ``WorkerCapability`` (by TP rank)."""
        if self._scheduler is not None:
            self._scheduler.workers_told({rank: getattr(m, "blend_refusal", "no capability sent")
                                          for rank, m in metadata.items()})

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, LMCacheP2PMetadata):
            self._worker.step_started(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheP2PMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # sync loads complete in start_load_kv; async ones report through get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole chunks are gathered for all layers at once in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheP2PMetadata)
        self._worker.wait_for_save(meta)
        self._worker.step_finished()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sent, loaded = self._worker.get_finished()
        return sent or None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> WorkerState | None:
        return self._worker.state() if self._worker is not None else None

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.workers_said(getattr(connector_output, "kv_connector_worker_meta", None))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()


def recompute_on_load_failure(vllm_config: Any) -> None:
    """Make vLLM recompute what the mesh could not load (see the module docstring). vLLM's
    scheduler reads the policy right after it constructs its connector, so setting it here counts."""
    transfer = vllm_config.kv_transfer_config
    if transfer.kv_load_failure_policy == "recompute":
        return
    if (transfer.kv_connector_extra_config or {}).get("keep_fail_policy") is True:
        log.warning("lmcache-p2p: kv_load_failure_policy=%r kept (keep_fail_policy): a request whose cached KV "
                    "can't be loaded (an owner died or hung, a chunk failed verification, a pull would be slower "
                    "than recomputing) ends with an error instead of being recomputed",
                    transfer.kv_load_failure_policy)
        return
    log.warning("lmcache-p2p: kv_load_failure_policy was %r (vLLM's default), which fails every request whose cached "
                "KV can't be loaded; this engine runs with 'recompute': what the mesh can't supply is recomputed, "
                "never an error (kv_connector_extra_config keep_fail_policy: true keeps 'fail')",
                transfer.kv_load_failure_policy)
    transfer.kv_load_failure_policy = "recompute"
