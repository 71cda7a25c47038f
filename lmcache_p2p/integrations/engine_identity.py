"""What makes KV what it is, read off vLLM's objects without importing vLLM (unit-testable anywhere).

- :func:`engine_model_id`: the model's identity (``identity.model_identity``: config.json and
  weights by content) plus a digest of the engine settings that change the KV it computes from
  the same files (``KV_MODEL_FIELDS``, ``KV_CACHE_FIELDS``): it is the fingerprint's ``model_id``.
- :func:`request_identity`: what besides its token ids changes one request's KV (its LoRA adapter,
  ``cache_salt``, multimodal items at their positions), or why it can't be keyed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from ..identity import adapter_identity, model_identity
from ..keys import MultiModalItem, RequestIdentity

# Engine settings that change the KV a model computes from the same weights and config.json,
# with the value that changes nothing (left out of the identity, so the usual engine keeps its).
KV_MODEL_FIELDS: dict[str, Any] = {
    "model_weights": "",  # weights loaded from elsewhere than the model directory
    "hf_config_path": None,  # another config.json
    "hf_overrides": {},  # e.g. rope scaling, layer counts: the config the model runs with
    "quantization": None,  # quantized projections compute other K and V
    "quantization_config": None,
    "model_impl": "auto",  # another implementation of the same architecture
    "model_class_overrides": {},
    "convert": "auto",
    "disable_sliding_window": False,
}
KV_CACHE_FIELDS: dict[str, Any] = {
    "kv_cache_dtype_skip_layers": [],  # layers whose KV stays unquantized
    "sliding_window": None,
}


def kv_options(vllm_config: Any) -> dict[str, str]:
    """The engine settings (of ``KV_MODEL_FIELDS``/``KV_CACHE_FIELDS``) that differ from their
    neutral value, canonically encoded. Rope scaling and the like come from config.json (in the
    model's identity) or ``hf_overrides`` (here); a hub id's config is pinned by its revision."""
    out: dict[str, str] = {}
    for section, fields in (("model", KV_MODEL_FIELDS), ("cache", KV_CACHE_FIELDS)):
        config = getattr(vllm_config, f"{section}_config")
        for name, neutral in fields.items():
            value = getattr(config, name, neutral)
            if value is not None and not isinstance(value, str | int | float | bool | list | dict | tuple):
                value = str(value)
            if value != neutral and value not in (None, "", {}, []):
                out[f"{section}.{name}"] = json.dumps(value, sort_keys=True, default=str)
    if str(vllm_config.cache_config.cache_dtype) != "auto":  # else the KV dtype is the compute dtype
        out["model.dtype"] = str(vllm_config.model_config.dtype).removeprefix("torch.")
    return out


def engine_model_id(vllm_config: Any) -> str:
    """What the model is (``identity.model_identity``), plus a digest of the engine settings
    that change its KV when any differs from its neutral value."""
    model = vllm_config.model_config
    identity = model_identity(model.model, model.revision)
    options = kv_options(vllm_config)
    if not options:
        return identity
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    return f"{identity}+kv:{digest}"


def request_identity(request: Any, adapter_of: Callable[[Any], str | None] | None = None
                     ) -> tuple[str, RequestIdentity | None]:
    """What besides its tokens makes ``request``'s KV (vLLM's ``Request``): ("", identity), or
    (why not, None) when it can't be keyed. ``adapter_of(lora_request)`` names an adapter (default:
    its files' digest now; the scheduler keeps it per adapter id while the files stay unchanged)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds", None
    adapter = ""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        found = (adapter_of or file_adapter)(lora)
        if found is None:
            return "unknown_adapter", None
        adapter = found
    items: list[MultiModalItem] = []
    for feature in getattr(request, "mm_features", None) or ():
        content = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        position = getattr(feature, "mm_position", None)
        if not content or position is None:
            return "multimodal_unhashed", None
        items.append(MultiModalItem(str(content), int(position.offset), int(position.length)))
    items.sort(key=lambda m: m.offset)
    return "", RequestIdentity(adapter, str(getattr(request, "cache_salt", None) or ""), tuple(items))


def file_adapter(lora: Any) -> str | None:
    """A LoRA request's adapter identity from its files as they are now."""
    return adapter_identity(str(lora.lora_name), str(lora.lora_path or ""))
