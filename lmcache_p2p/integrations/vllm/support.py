"""Which engines the connector serves: the KV cache specs it was built for, and a refusal for the rest.

The connector moves whole blocks of one full-attention cache group: every layer's K and V in vLLM's
own layout, a block holding ``block_size`` consecutive tokens of every layer, keyed by the tokens
before and in it. A KV cache that is anything else would be stored, fingerprinted and loaded as if it
were that, and handed to the model wrong:

    hybrid models       several cache groups (Mamba / linear-attention state, sliding-window groups):
                        one block table does not describe the request's state
    MLA                 one latent vector per token instead of K and V per head
    sliding window,     blocks outside the window are freed and reused: a chunk's blocks are not all
    chunked local       the request's
    non-causal layers   a token's KV depends on what follows it: not a prefix's
    cross-layer sharing fewer layers hold a cache than the model has
    per-token scales    quantized KV whose scales live beside the blocks (not in them)
    layout BHLNC        a block's heads interleaved with other layers' blocks: no contiguous run per
                        block and layer for the gather to copy

:func:`kv_cache_refusal` reads vLLM's ``kv_cache_config`` (what the engine core built, handed to
both connector roles) and names the first such feature; the connector then neither loads nor saves
for that engine (``connector.py``), and says why once. Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any

from ..kv_order import LEGACY_ORDERS, SUPPORTED_ORDERS

FLOAT_DTYPES = frozenset({"torch.float16", "torch.bfloat16", "torch.float32", "torch.float8_e4m3fn",
                          "torch.float8_e5m2"})
QUANT_MODES = frozenset({0, 1})  # KVQuantMode NONE, FP8_PER_TENSOR (one scale per tensor, in the model)


def kv_cache_refusal(kv_cache_config: Any, num_layers: int) -> str | None:
    """Why the connector can't serve an engine with this KV cache (None: it can). ``num_layers``: the
    model's attention layers (``LayoutConfig.num_layers``)."""
    if kv_cache_config is None:
        return None  # not handed over (an older vLLM): the worker's layout checks at register_kv_caches
    order = getattr(kv_cache_config, "kv_cache_layout", None)
    if order is not None and LEGACY_ORDERS.get(str(order), str(order)) not in SUPPORTED_ORDERS:
        return f"KV cache layout {order}: supported are {', '.join(sorted(SUPPORTED_ORDERS))}"
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        return (f"{len(groups)} KV cache groups ({', '.join(kinds) or 'none'}): one full-attention group is "
                "supported (hybrid models have several)")
    group = groups[0]
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec":  # MLA, sliding window, chunked local, Mamba, ... (subclasses too)
        return f"KV cache spec {kind}: only full attention (FullAttentionSpec) is supported"
    if getattr(spec, "sliding_window", None) is not None:
        return f"sliding-window attention (window {spec.sliding_window}) is not supported"
    if getattr(spec, "attention_chunk_size", None) is not None:
        return f"chunked local attention (chunk {spec.attention_chunk_size}) is not supported"
    if getattr(spec, "non_causal", False):
        return "non-causal attention (a token's KV depends on what follows it) is not supported"
    mode = getattr(spec, "kv_quant_mode", 0)
    if int(mode) not in QUANT_MODES:
        return f"KV quantization {getattr(mode, 'name', mode)}: its scales live outside the blocks"
    if str(spec.dtype) not in FLOAT_DTYPES:
        return f"KV cache dtype {spec.dtype} is not supported"
    head_v = getattr(spec, "head_size_v", None)
    if head_v not in (None, spec.head_size):
        return f"values of head size {head_v} beside keys of {spec.head_size} are not supported"
    if getattr(group, "is_eagle_group", False):
        return "a speculative-decoding draft cache group is not supported"
    if len(group.layer_names) != num_layers:
        return (f"{len(group.layer_names)} layers hold a KV cache of the model's {num_layers} (cross-layer "
                "sharing): not supported")
    return None
