"""The connector's view of the engine: config loading and the layout fingerprint.

Both connector processes (scheduler and worker) derive the same fingerprint from the engine's
``VllmConfig``, so the scheduler's index lookups match the keys the worker stores.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ...config import AgentConfig, LayoutConfig, extra_config_overrides, load_config
from ...coordinator.apply import read_at_start
from ...keys import Fingerprint
from ..engine_identity import engine_model_id
from ..kv_order import kv_cache_order
from .probe import engine_cpu_layout

log = logging.getLogger(__name__)


def connector_config(vllm_config: Any, kv_cache_config: Any = None) -> AgentConfig:
    """The agent config: the file named by ``kv_connector_extra_config["config"]`` (optional; else
    ``LMCACHE_P2P_CONFIG``), ``LMCACHE_P2P_*`` environment variables, then ``extra_config["overrides"]``
    and flat dotted keys beside it (``config.extra_config_overrides``), with the layout taken from the
    engine. ``layout.model_id`` set there pins the model's identity by name instead of by content
    (copies of one model whose files differ)."""
    path, overrides = extra_config_overrides(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    layout = engine_layout(vllm_config, overrides.get("layout.tenant_salt", ""), kv_cache_config)
    own = load_config(path, overrides=overrides)  # the node's file, environment, overrides
    pinned = own.layout.model_id if "layout.model_id" in own.set_by_node else None
    if pinned:  # the operator names the model: engines share by that name, whatever their files say
        log.warning("lmcache-p2p: model identity pinned by name %r (the engine's files say %s): every engine "
                    "pinned to it must run the same weights; the canary (canary.rate) checks it", pinned,
                    layout.model_id)
        _, plus, options = layout.model_id.partition("+kv:")  # the engine settings still count
        layout = dataclasses.replace(layout, model_id=str(pinned) + plus + options)
    for name in LayoutConfig.__dataclass_fields__:
        overrides[f"layout.{name}"] = getattr(layout, name)
    # Both connector sides read the same stored cluster config (e.g. chunk_size) at start.
    config, _ = read_at_start(load_config(path, overrides=overrides))
    return config


def _dtype_name(vllm_config: Any) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def engine_layout(vllm_config: Any, tenant_salt: str = "", kv_cache_config: Any = None) -> LayoutConfig:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    device = str(getattr(vllm_config.device_config, "device_type", "cpu"))
    return LayoutConfig(
        model_id=engine_model_id(vllm_config),  # what the model is, not where
        kv_dtype=_dtype_name(vllm_config),
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_total_num_kv_heads(),  # every rank's: which a rank holds is in its records
        head_size=model.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        kv_layout=(engine_cpu_layout(vllm_config) if device == "cpu"
                   else _named_layout(vllm_config, device, kv_cache_config)),
        tenant_salt=tenant_salt,
    )


def _named_layout(vllm_config: Any, device: str, kv_cache_config: Any = None) -> str:
    """A GPU engine's layout: ``vllm-<device>:<backend>:<order>``. Every vLLM attention backend for GPUs
    reads and writes the same logical ``(block, head, token, K|V content)`` per layer through its strides
    (vLLM 0.32: FlashAttention, FlashInfer, Triton and FlexAttention split the content into K then V), so
    the layout order decides where each element lands; the backend stays in the name all the same (a
    backend with a format of its own never shares by accident). Head-major orders (``LBHNC``,
    ``BLHNC``) store chunks by KV head like vLLM-CPU's, so TP sizes share; for the rest TP size and rank
    stay in the fingerprint. The worker checks the order against its KV tensors' strides at start
    (:func:`observed_order`)."""
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(getattr(attention, "backend", None), "name", None) or "auto"
    return f"vllm-{device}:{backend}:{kv_cache_order(vllm_config, kv_cache_config)}"


def engine_fingerprint(vllm_config: Any, config: AgentConfig, tp_rank: int = 0) -> Fingerprint:
    return Fingerprint.of(config.layout, vllm_config.parallel_config.tensor_parallel_size, tp_rank)
