"""Request identity in the key chain: everything besides the tokens that changes a request's KV.

Pure functions over vLLM's request fields (``integrations/engine_identity.request_identity``) and
the engine settings that enter the fingerprint (``kv_options``); the
real-engine cases (cache_salt and LoRA across two engines) are in ``test_vllm_identity.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_p2p.identity import adapter_identity
from lmcache_p2p.integrations.engine_identity import (
    KV_CACHE_FIELDS,
    KV_MODEL_FIELDS,
    engine_model_id,
    kv_options,
    request_identity,
)
from lmcache_p2p.keys import (
    FingerprintDigest,
    MultiModalItem,
    RequestIdentity,
    chunk_keys,
    request_root,
)

FP = FingerprintDigest(bytes(range(16)))
TOKENS = list(range(1000, 1000 + 1024))


def _adapter(tmp: Path, name: str, weights: bytes) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    (d / "adapter_model.safetensors").write_bytes(weights)
    return d


def _request(**fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = {"request_id": "r", "prompt_embeds": None, "lora_request": None, "mm_features": [],
                            "cache_salt": None}
    base.update(fields)
    return SimpleNamespace(**base)


def _keys(identity: RequestIdentity | None) -> list[bytes]:
    assert identity is not None
    return chunk_keys(request_root(FP, identity), TOKENS, 256, mm_items=identity.mm_items)


def test_a_plain_request_keeps_the_fingerprint_root() -> None:
    reason, identity = request_identity(_request())
    assert reason == "" and identity is not None and identity.plain
    assert request_root(FP, identity) == FP
    assert _keys(identity) == chunk_keys(FP, TOKENS, 256)


def test_cache_salt_separates_tenants_and_the_same_salt_shares() -> None:
    one = _keys(request_identity(_request(cache_salt="tenant-one"))[1])
    two = _keys(request_identity(_request(cache_salt="tenant-two"))[1])
    none = _keys(request_identity(_request())[1])
    assert not set(one) & set(two) and not set(one) & set(none) and not set(two) & set(none)
    assert one == _keys(request_identity(_request(cache_salt="tenant-one"))[1])


def test_the_root_is_one_way_in_the_salt() -> None:
    root = request_root(FP, RequestIdentity(cache_salt="s3cret"))
    assert b"s3cret" not in bytes(root) and root != FP and len(root) == 16


def test_adapters_are_keyed_by_name_and_weights(tmp_path: Path) -> None:
    a = _adapter(tmp_path, "a", b"\x01" * 64)
    b = _adapter(tmp_path, "b", b"\x02" * 64)
    a_copy = _adapter(tmp_path, "a_copy", b"\x01" * 64)
    lora = SimpleNamespace
    ka = _keys(request_identity(_request(lora_request=lora(lora_name="a", lora_path=str(a))))[1])
    kb = _keys(request_identity(_request(lora_request=lora(lora_name="b", lora_path=str(b))))[1])
    base = _keys(request_identity(_request())[1])
    assert not set(ka) & set(kb) and not set(ka) & set(base)
    # The same files under another path share; the same name over other weights does not.
    assert ka == _keys(request_identity(_request(lora_request=lora(lora_name="a", lora_path=str(a_copy))))[1])
    assert ka != _keys(request_identity(_request(lora_request=lora(lora_name="a", lora_path=str(b))))[1])
    # Weights changed in place: a new identity (the digest follows the files' size and mtime).
    (a / "adapter_model.safetensors").write_bytes(b"\x03" * 65)
    assert ka != _keys(request_identity(_request(lora_request=lora(lora_name="a", lora_path=str(a))))[1])


def test_an_adapter_we_cannot_read_is_not_cached(tmp_path: Path) -> None:
    missing = SimpleNamespace(lora_name="x", lora_path=str(tmp_path / "nowhere"))
    assert request_identity(_request(lora_request=missing)) == ("unknown_adapter", None)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert adapter_identity("x", empty) is None


def test_prompt_embeds_are_not_cached() -> None:
    assert request_identity(_request(prompt_embeds=object())) == ("prompt_embeds", None)


def _image(content: str, offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(identifier=content, mm_hash=content,
                           mm_position=SimpleNamespace(offset=offset, length=length))


def test_images_enter_the_keys_of_the_chunks_they_overlap_and_every_later_one() -> None:
    plain = chunk_keys(FP, TOKENS, 256)
    cat = _keys(request_identity(_request(mm_features=[_image("cat", 300, 100)]))[1])
    dog = _keys(request_identity(_request(mm_features=[_image("dog", 300, 100)]))[1])
    assert cat[0] == dog[0] == plain[0]  # before the image: the same KV
    assert all(c != d for c, d in zip(cat[1:], dog[1:], strict=True))  # chunk 1 holds it; later ones chain
    moved = _keys(request_identity(_request(mm_features=[_image("cat", 310, 100)]))[1])
    assert moved[0] == cat[0] and moved[1] != cat[1]  # the same image at another position
    spanning = _keys(request_identity(_request(mm_features=[_image("cat", 500, 100)]))[1])
    assert spanning[1] != plain[1] and spanning[2] != plain[2]  # an item over a chunk boundary keys both


def test_multimodal_items_without_a_hash_are_not_cached() -> None:
    assert request_identity(_request(mm_features=[_image("", 0, 10)])) == ("multimodal_unhashed", None)
    with pytest.raises(ValueError):
        MultiModalItem("h", -1, 3)


def _engine(**changes: Any) -> SimpleNamespace:
    model = {name: neutral for name, neutral in KV_MODEL_FIELDS.items()}
    cache = {name: neutral for name, neutral in KV_CACHE_FIELDS.items()}
    model.update({"model": "org/model", "revision": "abc", "dtype": "bfloat16"})
    cache["cache_dtype"] = "auto"
    for dotted, value in changes.items():
        section, name = dotted.split("__")
        (model if section == "model" else cache)[name] = value
    return SimpleNamespace(model_config=SimpleNamespace(**model), cache_config=SimpleNamespace(**cache))


VALUES = {"model_weights": "/elsewhere", "hf_config_path": "/other/config", "hf_overrides": {"rope_scaling":
          {"rope_type": "linear", "factor": 2.0}}, "quantization": "fp8", "quantization_config": {"bits": 4},
          "model_impl": "transformers", "model_class_overrides": {"LlamaForCausalLM": "x.Y"}, "convert": "embed",
          "disable_sliding_window": True, "kv_cache_dtype_skip_layers": ["0"], "sliding_window": 1024}


@pytest.mark.parametrize("field", [f"model__{n}" for n in KV_MODEL_FIELDS] + [f"cache__{n}" for n in KV_CACHE_FIELDS])
def test_every_kv_setting_changes_the_model_identity(field: str) -> None:
    neutral = engine_model_id(_engine())
    assert neutral == "hf:org/model@abc" and kv_options(_engine()) == {}
    changed = engine_model_id(_engine(**{field: VALUES[field.split("__")[1]]}))
    assert changed.startswith(neutral + "+kv:") and changed != neutral


def test_compute_dtype_counts_when_the_kv_cache_is_quantized() -> None:
    fp8 = _engine(cache__cache_dtype="fp8")
    other = _engine(cache__cache_dtype="fp8", model__dtype="float16")
    assert engine_model_id(fp8) != engine_model_id(other) != engine_model_id(_engine())
