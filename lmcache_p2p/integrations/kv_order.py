"""vLLM's KV cache layout orders (vLLM 0.32, ``vllm/v1/kv_cache_layout.py``), without importing vLLM.

Every layer's KV tensor is a logical ``(block, head, token, content)`` view (content: K then V, ``2 *
head_size``) of one backing tensor whose memory order is a stride permutation of ``[layer, block,
head, token, content]``, named by its letters: ``LBNHC`` (NHD, vLLM's default), ``LBHNC`` (HND, the
only one vLLM-CPU supports), ``BLHNC`` / ``BLNHC`` (a block's layers together), ``LHBNC``, ``BHLNC``.
The order decides where each element lands; the connector names it in the layout fingerprint
(``vllm/layout.py``) and the worker reads it back from its tensors' strides before it shares a byte.
"""

from __future__ import annotations

from typing import Any

from ..kernels.layout import memory_order

LEGACY_ORDERS = {"NHD": "LBNHC", "HND": "LBHNC"}  # VLLM_KV_CACHE_LAYOUT's older names
SUPPORTED_ORDERS = frozenset({"LBHNC", "BLHNC", "LBNHC", "BLNHC", "LHBNC"})
"""The orders ``kernels/layout.py`` can gather (``BHLNC`` interleaves a block's heads with other layers)."""
DEFAULT_ORDER = "LBNHC"  # what vLLM picks when no backend declares a preference
CPU_ORDER = "LBHNC"  # the only layout vLLM-CPU's backend supports


def kv_cache_order(vllm_config: Any, kv_cache_config: Any = None) -> str:
    """The KV cache layout vLLM resolved for this engine (``KVCacheLayout`` name: a stride permutation of
    ``[layer, block, head, token, content]``): the engine core records it on the KV cache config and the
    cache config; else ``VLLM_KV_CACHE_LAYOUT``; else vLLM's default."""
    import os

    name = (getattr(kv_cache_config, "kv_cache_layout", None)
            or getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
            or os.environ.get("VLLM_KV_CACHE_LAYOUT") or DEFAULT_ORDER)
    return LEGACY_ORDERS.get(str(name), str(name))


def layout_order(kv_layout: str) -> str:
    """The KV cache layout order a fingerprint's ``kv_layout`` names (vLLM-CPU's: ``LBHNC``)."""
    return CPU_ORDER if kv_layout.startswith("vllm-cpu") else kv_layout.rsplit(":", 1)[-1]


def observed_order(layer: Any) -> str:
    """The layout order of one layer's KV tensor (logical ``(block, head, token, content)``), read from its
    strides: ``LBHNC``, ``BLHNC`` (blocks of all layers interleaved), ``LBNHC``, ``BLNHC``, ``LHBNC``,
    ``BHLNC``, or ``other:<memory order>``. With one head per block the two head/token orders hold the
    same bytes and read as the head-major one."""
    if layer.dim() != 4:
        return f"other:{layer.dim()}-d {tuple(layer.shape)}"
    blocks, heads, tokens, content = layer.shape
    stride = layer.stride()
    order = memory_order(layer)
    if heads == 1:
        order = tuple(d for d in order if d != 1)
        order = (order[0], 1, *order[1:]) if order[0] == 0 else order
    compact = stride[0] == heads * tokens * content  # a block's bytes of this layer are one run
    if order == (0, 1, 2, 3):
        if heads > 1 and stride[1] != tokens * content:
            return "BHLNC"
        return "LBHNC" if compact else "BLHNC"
    if order == (0, 2, 1, 3):
        return "LBNHC" if compact else "BLNHC"
    if order == (1, 0, 2, 3):
        return "LHBNC"
    return "other:" + "".join("BHNC"[d] for d in order)


_ONE_HEAD = {"LBNHC": "LBHNC", "LHBNC": "LBHNC", "BLNHC": "BLHNC", "BHLNC": "BLHNC"}


def orders_agree(observed: str, named: str, heads: int) -> bool:
    """Whether a layer laid out ``observed`` holds its bytes where the order ``named`` puts them (with one
    head per block several orders are the same bytes)."""
    return observed == (_ONE_HEAD.get(named, named) if heads == 1 else named)
